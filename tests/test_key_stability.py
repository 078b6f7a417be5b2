"""Cache keys through the public command (``attngen inspect --key --json``) for a few specs of each
family and arch, against a table: a refactor of the build path must not move a key.

The key schema is versioned (``cache_key.KEY_SCHEMA``): a deliberate schema bump, or a change of
what a spec resolves to, updates the table (``python3 tests/test_key_stability.py`` prints it).
The parts of the material that change with the machine or with every template edit (the NVRTC
version, the digests of the template files and of the template-context code) are pinned to fixed
values before hashing, so the table checks everything else that goes into a key: the resolved
spec, the options, the arch, attngen's version, the schema and the key function. The key the
command prints is checked to be the hash of the material it prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys

import pytest

from attngen import cli

PINNED = {"nvrtc": "12.8", "templates_sha256": "t" * 64, "code_sha256": "c" * 64}

# (spec, arch) -> key with PINNED material, as main computed them before the build path left cache.py
# (prefill's and decode's since their specs gained the sinks field, which every canonical spec of theirs holds;
# paged decode at head_dim 128 since it resolves to a three-stage ring, TUNED_PLAIN).
KEYS = {
    ("prefill:head_dim=128", "sm_90a"): "fcca0f7b48d3150f4a41b5d4e730dc9c7ee30765e6b226efd5104dcbb41ccdea",
    ("prefill:head_dim=64,mask=causal,dtype=fp16", "sm_80"): "988815e024f0d943d05f0d6e15c236108938f10ef93fb2d3d11e9c7a1ade2584",
    ("prefill:head_dim=128,varlen=true,paged=true", "sm_89"): "b4313156a37805b3741f8df5c52e7400587f7d86fcc9595426f156586f2d98c4",
    ("prefill:head_dim=256,mask=causal", "sm_90"): "113252cd57f717d1acfb7200907e8e0a321398320a86998d268cffe2283a6391",
    ("decode:head_dim=128", "sm_90a"): "51cf6a68ed78e2ea9e6a182ba120792993ce97f744deb433d81071e1dba77441",
    ("decode:head_dim=128,paged=true", "sm_80"): "dbf8cfe0d07f0467266a7849668ae1881f6ab3083782714605b18b858e286f6b",
    ("decode:head_dim=64,q_rows=32", "sm_120"): "496f97c6b912c7e24fe1bfc3f9948d5b0e6268e94c4763303d088c8214f19576",
    ("mla_decode:", "sm_90a"): "1cfc9a92ab0d868bec6fe01bbc25170f493caad3c8ad773e88d0793e55d13ef6",
    ("mla_decode:", "sm_80"): "4ca6128b106adaa5c2c8f41bc82d173df854b1596af2492a112f990dff7a10f5",
}


def _canonical_sha(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def inspect_key(spec: str, arch: str) -> tuple[str, dict]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(["inspect", spec, "--arch", arch, "--key", "--json"])
    assert rc == 0, out.getvalue()
    got = json.loads(out.getvalue())
    return got["key"], got["key_material"]


def pinned_key(spec: str, arch: str) -> str:
    key, material = inspect_key(spec, arch)
    assert _canonical_sha(material) == key, "the printed key is not the hash of the printed material"
    return _canonical_sha({**material, **PINNED})


@pytest.mark.parametrize("spec,arch", sorted(KEYS))
def test_key_is_what_main_gave(spec, arch):
    assert pinned_key(spec, arch) == KEYS[(spec, arch)]


if __name__ == "__main__":  # the table as this checkout computes it; --raw: the keys as they are on this machine
    for (spec, arch) in KEYS:
        key = inspect_key(spec, arch)[0] if "--raw" in sys.argv else pinned_key(spec, arch)
        sys.stdout.write(f'    ("{spec}", "{arch}"): "{key}",\n')
