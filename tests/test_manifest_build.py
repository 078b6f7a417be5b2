"""Every kernel of the shipped manifest compiles with NVRTC for every arch it names, spill-free and without
ptxas performance notes.

This is the pre-warm a CI job runs for production, done for real: no GPU, real compiles into a
temporary cache (18-25 minutes on 2 cores: some 1,800 kernels at 1-4 s each). Marked ``slow``: the
README's test command leaves it out, ``.ci/run`` runs it as a step of its own (``python3 -m pytest -q -m slow``).
"""

from __future__ import annotations

import pytest

from attngen.manifest import expand, load_manifest
from attngen.prewarm import run_prewarm


def spills(item: dict) -> bool:
    """Whether a prewarm result spilled: its report's counts, or, where NVRTC's log held no report (the counts
    None), a stack frame (a spill needs one)."""
    return bool(item["spill_stores"] or item["spill_loads"] or item["spill_stores"] is None and item["stack_frame"])


@pytest.mark.slow
def test_default_manifest_builds_for_every_arch_without_spills(cache_dir):
    items = expand(load_manifest())
    families = {spec.family for spec, _ in items}
    assert families == {"prefill", "decode", "mla_decode", "merge"}
    results = run_prewarm(items, jobs=2)
    assert len(results) == len(items)
    failed = [(r["spec"], r["arch"], r["error"]) for r in results if r["error"]]
    assert not failed, failed[:5]
    assert {r["origin"] for r in results} <= {"compiled", "disk", "memory"}
    spilled = [(r["spec_resolved"], r["arch"], r["spill_stores"], r["spill_loads"]) for r in results if spills(r)]
    assert not spilled, spilled
    # nor does ptxas ignore setmaxnreg in, or serialise or wait for the wgmma of, any sm_90a kernel (C7508-C7520:
    # the MMAs no longer overlapped; seen where NVRTC's log holds ptxas' report, as the cu13 wheels' does)
    noted = [(r["spec_resolved"], r["arch"], r["ptxas_notes"]) for r in results if r["ptxas_notes"]]
    assert not noted, noted
    assert len({r["key"] for r in results}) == len(items)
