"""Cache keys through the public command (``attngen inspect --key --json``) for a few specs of each
family and arch, against a table: a refactor of the build path must not move a key.

The key schema is versioned (``cache_key.KEY_SCHEMA``): a deliberate schema bump, or a change of
what a spec resolves to, updates the table (``python3 tests/test_key_stability.py`` prints it).
The parts of the material that change with the machine or with every template edit (the NVRTC
version, and with it the options' NVRTC cache flag; the digests of the template files and of the
template-context code) are pinned to fixed values before hashing, so the table checks everything
else that goes into a key: the resolved spec, the options, the arch, attngen's version, the schema
and the key function. The key the command prints is checked to be the hash of the material it
prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import sys

import pytest

from attngen import cli

PINNED = {"nvrtc": "13.0", "templates_sha256": "t" * 64, "code_sha256": "c" * 64}

# (spec, arch) -> key with PINNED material, as main computed them before the build path left cache.py
# (prefill's and decode's since their specs gained the sinks field, which every canonical spec of theirs holds;
# paged decode at head_dim 128 since it resolves to a three-stage ring, TUNED_PLAIN; every key since compiles on NVRTC
# 12.9 and later take --no-cache, compiler.cache_options).
KEYS = {
    ("prefill:head_dim=128", "sm_90a"): "e15af49e7967ab1ee01c8a505ac7998437ef6e1ee6bc1904c67c333c95cdcba7",
    ("prefill:head_dim=64,mask=causal,dtype=fp16", "sm_80"): "9c3d810dcdf0e32b1a01e073b77575ebc75bac13014a40f22ac7850db12d7c6e",
    ("prefill:head_dim=128,varlen=true,paged=true", "sm_89"): "487a2368e997721124cd4e8905b4dd0b636cc94e5797fc4df86bb95a8b513601",
    ("prefill:head_dim=256,mask=causal", "sm_90"): "bad9df1235dd5beec09f85a2677501042b761ea2d3bd5a11ebfc1a1ce385e382",
    ("decode:head_dim=128", "sm_90a"): "6c691fd8ecb3f611ee343d699a877271fe8eb5fc57e37e2959e8f6fd8749f668",
    ("decode:head_dim=128,paged=true", "sm_80"): "39aeb9f3b10e668253398f672358963f256c79fc91d5f8ab4ebacee431c60852",
    ("decode:head_dim=64,q_rows=32", "sm_120"): "076a3f9f4a153d8134c4d8d8e4dec6ccc0eac3054a2c43bff03b0ad4ddc91bea",
    ("mla_decode:", "sm_90a"): "2137446d31f950dca1f10ef859654886e20915921b6013b207e0a06add465300",
    ("mla_decode:", "sm_80"): "8a0c0212a82e9c17b193b347ab2a03e9257c9b18373d86b9246c35bafcac6fb5",
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


def pinned_options(options: list) -> list:
    """``options`` with the NVRTC cache option (compiler.cache_options, by NVRTC version) of the pinned version in
    place of this machine's."""
    from attngen.compiler import BASE_OPTIONS, cache_options, nvrtc_version

    at, mine = 1 + len(BASE_OPTIONS), list(cache_options(nvrtc_version()))
    assert options[at:at + len(mine)] == mine, options
    return options[:at] + list(cache_options(PINNED["nvrtc"])) + options[at + len(mine):]


def pinned_key(spec: str, arch: str) -> str:
    key, material = inspect_key(spec, arch)
    assert _canonical_sha(material) == key, "the printed key is not the hash of the printed material"
    return _canonical_sha({**material, **PINNED, "options": pinned_options(material["options"])})


@pytest.mark.parametrize("spec,arch", sorted(KEYS))
def test_key_is_what_main_gave(spec, arch):
    assert pinned_key(spec, arch) == KEYS[(spec, arch)]


if __name__ == "__main__":  # the table as this checkout computes it; --raw: the keys as they are on this machine
    for (spec, arch) in KEYS:
        key = inspect_key(spec, arch)[0] if "--raw" in sys.argv else pinned_key(spec, arch)
        sys.stdout.write(f'    ("{spec}", "{arch}"): "{key}",\n')
