"""CUDA 12 installs (``attngen[cu12]``): the first kernel of every ``[[kernel]]`` group of the
default manifest, for every arch the group names, compiles with NVRTC 12 into a cubin keyed by it.

The defaults are chosen spill-free against NVRTC 13; NVRTC 12.9's ptxas spills on some of them
(README, "CUDA 12 drivers"), so spills are reported here, not failed on; so are ptxas' coded notes.

Runs only where the installed NVRTC is 12.x; ``.ci/run`` makes a venv with the cu12 extra for it.
Under the cu13 install it skips (the slow manifest test covers NVRTC 13).
"""

from __future__ import annotations

import json

import pytest

from attngen.compiler import nvrtc_version
from attngen.manifest import load_manifest
from attngen.prewarm import run_prewarm
from tests.test_manifest_build import spills


def _major() -> int:
    try:
        return int(nvrtc_version().split(".")[0])
    except Exception:
        return 0


@pytest.mark.skipif(_major() != 12, reason="needs NVRTC 12 (pip install -e '.[cu12,test]')")
def test_manifest_slice_compiles_with_nvrtc12(cache_dir):
    manifest = load_manifest()
    items = []
    for group in manifest.groups:
        items += [(group.specs[0], arch) for arch in (group.archs or manifest.archs)]
    assert {spec.family for spec, _ in items} == {"prefill", "decode", "mla_decode"}
    results = run_prewarm(items, jobs=2)
    failed = [(r["spec"], r["arch"], r["error"]) for r in results if r["error"]]
    assert not failed, failed[:5]
    assert len(results) == len(items)
    assert {r["origin"] for r in results} == {"compiled"}
    metas = [json.loads(p.read_text()) for p in cache_dir.rglob("meta.json")]
    assert len(metas) == len({r["key"] for r in results})
    assert all(m["nvrtc"].startswith("12.") for m in metas), {m["nvrtc"] for m in metas}
    spilled = [(r["spec_resolved"], r["arch"], r["spill_stores"]) for r in results if spills(r)]
    print(f"NVRTC {nvrtc_version()}: {len(spilled)} of {len(results)} kernels spill")
    for s in spilled:
        print("  spills:", *s)
    noted = [(r["spec_resolved"], r["arch"], r["ptxas_notes"]) for r in results if r["ptxas_notes"]]
    print(f"NVRTC {nvrtc_version()}: {len(noted)} of {len(results)} kernels with ptxas notes "
          "(setmaxnreg ignored, wgmma serialised or waited for)")
    for s in noted:
        print("  ptxas notes:", *s)
