"""attngen bench variants on the GPU, on a small shape: a case's row carries the causal probe timed with the others,
the live-pair fraction its mask keeps (checked here against the count from the mask's definition) and FlexAttention's
time over the probe scaled by it; the outputs are checked against each other."""

from argparse import Namespace

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


def _args(flex: bool) -> Namespace:
    return Namespace(tokens=1024, rep_ms=2.0, seed=0, no_flex=not flex)


def _has_flex() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("case", ["prefix_lm", "sinks"])
def test_a_rows_probe_and_live_pairs(case, cache_dir):
    from attngen.families.prefill import bench_variants as bv

    seqlen, flex = 512, _has_flex()
    row = bv.run_case(torch, case, 64, seqlen, _args(flex))
    causal_pairs = seqlen * (seqlen + 1) / 2
    prefix = seqlen // 4  # the case's prefix: its keys seen by every query, those above the diagonal added
    want = (causal_pairs + prefix * (prefix - 1) / 2) / causal_pairs if case == "prefix_lm" else 1.0
    assert row["live"] == pytest.approx(want, rel=1e-12)
    assert row["ms"]["causal"] > 0 and row["ms"]["builtin"] > 0
    # (sinks without FlexAttention has one output, the built-in's: nothing to check it against)
    assert (row["check"] or case == "sinks" and not flex) and all(c["ok"] for c in row["check"].values()), row["check"]
    if flex and "flex" in row["ms"]:
        assert row["ratio"]["flex_probe"] == pytest.approx(row["ms"]["flex"] / (row["ms"]["causal"] * want))
    else:
        assert "flex_probe" not in row["ratio"]
