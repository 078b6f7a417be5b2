"""Older NVRTCs: CUDA 12 installs (``attngen[cu12]``) and NVRTC 13.0 (what torch's cu130 wheels install). The first
kernel of every ``[[kernel]]`` group of the default manifest, for every arch the group names, compiles with that
NVRTC into a cubin keyed by it.

The defaults are chosen spill-free against CI's NVRTC 13 (13.5); older ptxas spills on some mma.sync kernels (README,
"CUDA 12 drivers" and "NVRTC 13.0"), so spills are reported here, not failed on. Its coded notes (C7519: wgmma
serialised by an injected ``warpgroup.arrive``; setmaxnreg ignored) are failed on: every kernel of the manifest
builds without them under 12.9 and 13.0 too, and a template change that brings one back costs speed there.

Runs only where the installed NVRTC is 12.x or 13.0; ``.ci/run`` makes a venv for each. Under a newer NVRTC it skips
(the slow manifest test covers that one).
"""

from __future__ import annotations

import json

import pytest

from attngen.compiler import nvrtc_version
from attngen.manifest import load_manifest
from attngen.prewarm import run_prewarm
from tests.test_manifest_build import spills


def _version() -> str:
    try:
        return nvrtc_version()
    except Exception:
        return ""


_VERSION = _version()
OLDER = _VERSION.startswith("12.") or _VERSION == "13.0"


@pytest.mark.skipif(not OLDER, reason="needs NVRTC 12 or 13.0 (pip install -e '.[cu12,test]', or '.[cu13,test]' "
                                      "with 'cuda-toolkit[cudart,nvrtc]==13.0.*')")
def test_manifest_slice_compiles_with_an_older_nvrtc(cache_dir):
    manifest = load_manifest()
    items = []
    for group in manifest.groups:
        items += [(group.specs[0], arch) for arch in (group.archs or manifest.archs)]
    assert {spec.family for spec, _ in items} == {"prefill", "decode", "mla_decode", "merge"}
    results = run_prewarm(items, jobs=2)
    failed = [(r["spec"], r["arch"], r["error"]) for r in results if r["error"]]
    assert not failed, failed[:5]
    assert len(results) == len(items)
    assert {r["origin"] for r in results} == {"compiled"}
    metas = [json.loads(p.read_text()) for p in cache_dir.rglob("meta.json")]
    assert len(metas) == len({r["key"] for r in results})
    assert all(m["nvrtc"] == _version() for m in metas), {m["nvrtc"] for m in metas}
    spilled = [(r["spec_resolved"], r["arch"], r["spill_stores"]) for r in results if spills(r)]
    print(f"NVRTC {nvrtc_version()}: {len(spilled)} of {len(results)} kernels spill")
    for s in spilled:
        print("  spills:", *s)
    noted = [(r["spec_resolved"], r["arch"], r["ptxas_notes"]) for r in results if r["ptxas_notes"]]
    print(f"NVRTC {nvrtc_version()}: {len(noted)} of {len(results)} kernels with ptxas notes "
          "(setmaxnreg ignored, wgmma serialised or waited for)")
    for s in noted:
        print("  ptxas notes:", *s)
    assert not noted, noted[:3]
