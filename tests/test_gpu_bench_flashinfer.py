"""The FlashInfer column on the GPU, where flashinfer is installed: one small shape a family through the
benchmark's own shape runner, FlashInfer's output against attngen's and against the fp32 reference,
its time and its first call recorded apart. The first call builds FlashInfer's kernels with nvcc
(a minute or more on a cold FlashInfer cache)."""

import pytest

from attngen.bench import core
from attngen.bench import flashinfer as fi

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(fi.missing() is not None, reason=fi.missing() or "")]

TIMING = dict(warmup_ms=5.0, rep_ms=20.0)


def _first_call_apart(rec: dict) -> None:
    f = rec[fi.NAME]
    assert f["first_call_s"] > 0 and f["first_call_s"] >= f["plan_s"] >= 0 and f["import_s"] >= 0


def test_prefill_row_against_flashinfer(cache_dir):
    from attngen.families.prefill import bench as prefill_bench

    for causal in (False, True):
        shape = prefill_bench.Shape("bf16", 128, causal, 2, 1024, 8)
        rec = prefill_bench.run_shape(shape, ("flash",), flashinfer=True, **TIMING)
        assert "flashinfer" not in rec["errors"], rec["errors"]
        c = rec[fi.NAME]["vs_attngen"]
        assert c["nan_count"] == 0 and c["rel_l2"] < core.CHECK_TOL and c["max_abs"] < 0.05, c
        assert rec["check"]["ok"], rec["check"]
        assert rec["ms"][fi.NAME] > 0 and rec["ratio"][fi.NAME] == pytest.approx(
            rec["tflops"]["attngen"] / rec["tflops"][fi.NAME])
        _first_call_apart(rec)


def test_decode_row_against_flashinfer(cache_dir):
    from attngen.families.decode import bench as decode_bench

    # 1000 keys: a last page of 8 (the other 8 positions hold NaN in the paged copy), as last_page_len says
    for kv_len, rotate in ((1000, False), (1024, True)):
        shape = decode_bench.DecodeShape("bf16", 4, kv_len, 1, 32, 8, 128)
        rec = decode_bench.run_decode_shape(shape, ("flash",), impls=decode_bench.decode_impls("auto", False),
                                            block_size=16, graph=True, rotate=rotate, flashinfer=True, **TIMING)
        assert fi.NAME not in rec["errors"], rec["errors"]
        assert rec["checks"][fi.NAME]["ok"] and rec["checks"]["attngen"]["ok"], rec["checks"]
        c = rec[fi.NAME]["vs_attngen"]
        assert c["nan_count"] == 0 and c["rel_l2"] < core.CHECK_TOL and c["max_abs"] < 0.05, c
        assert rec["ms"][fi.NAME] > 0
        assert rec["ratio"]["attngen"][fi.NAME] == pytest.approx(rec["ms"][fi.NAME] / rec["ms"]["attngen"])
        _first_call_apart(rec)
    refused = decode_bench.run_decode_shape(decode_bench.DecodeShape("bf16", 2, 256, 4, 16, 1, 128), (),
                                            impls=decode_bench.decode_impls("auto", False), block_size=16,
                                            flashinfer=True, **TIMING)
    assert "q_len 4" in refused["errors"][fi.NAME] and refused["ms"][fi.NAME] is None


def test_mla_row_against_flashinfer(cache_dir):
    from attngen.families.mla_decode import bench as mla_bench

    rec = mla_bench.run_shape(4, 1024, 16, "bf16", ["attngen", "read", fi.NAME], core.stream_reader(), seed=0,
                              **TIMING)
    assert fi.NAME not in rec["errors"], rec["errors"]
    assert rec["checks"][fi.NAME]["ok"] and rec["checks"]["attngen"]["ok"], rec["checks"]
    c = rec[fi.NAME]["vs_attngen"]
    assert c["nan_count"] == 0 and c["rel_l2"] < core.CHECK_TOL and c["max_abs"] < 0.05, c
    assert rec["gbps"][fi.NAME] > 0
    assert rec["ratio"][fi.NAME] == pytest.approx(rec["us"][fi.NAME] / rec["us"]["attngen"])
    _first_call_apart(rec)


def test_step_row_against_flashinfer(cache_dir):
    """bench step's third column: FlashInfer's BatchAttention on the same causal step (decode, verify and prefill
    requests), checked against attngen's step, its first call apart."""
    import argparse

    from attngen.bench import step

    args = argparse.Namespace(decode=6, verify=2, draft=3, prefill=1, chunk=300, cached=700, keys="100,3000",
                              rep_ms=10.0, seed=0, kv_dtype="bf16", no_flashinfer=False)
    rec = step.measure(args)
    assert fi.NAME not in rec.get("errors", {}), rec.get("errors")
    c = rec[fi.NAME]["vs_attngen"]
    assert c["nan_count"] == 0 and c["rel_l2"] < core.CHECK_TOL, c
    assert rec["ms"][fi.NAME] > 0 and rec["ratio"][fi.NAME] == pytest.approx(rec["ms"][fi.NAME] / rec["ms"]["step"])
    _first_call_apart(rec)
    no = step.measure(argparse.Namespace(**{**vars(args), "no_flashinfer": True}))
    assert fi.NAME not in no["ms"] and fi.NAME not in no
