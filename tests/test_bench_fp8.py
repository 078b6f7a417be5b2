"""attngen bench prefill-fp8 without a GPU: its options, the sweep, the quantisation its inputs go through, the
summary and the table re-rendered from a saved JSON."""

import argparse
import json

import pytest

from attngen.families.prefill import bench_fp8 as bf
from test_bench import FAKE_ENV


def _parser():
    p = argparse.ArgumentParser(prog="attngen bench")
    bf.add_parser(p.add_subparsers())
    return p


def test_defaults_give_the_issue_sweep():
    args = _parser().parse_args(["prefill-fp8"])
    shapes = bf.sweep(args)
    assert len(shapes) == 4 * 2 * 2 * 2  # batch x seqlen, heads, head dims, masks
    assert {(s["batch"], s["seqlen"]) for s in shapes} == {(1, 4096), (1, 8192), (1, 16384), (8, 2048)}
    assert {(s["heads"], s["kv_heads"]) for s in shapes} == {(32, 8), (16, 16)}
    assert {s["head_dim"] for s in shapes} == {128, 256} and {s["causal"] for s in shapes} == {False, True}
    one = bf.sweep(_parser().parse_args(["prefill-fp8", "--shapes", "2x1000", "--heads", "8/1", "--head-dims", "128",
                                         "--causal", "yes"]))
    assert one == [dict(head_dim=128, causal=True, heads=8, kv_heads=1, batch=2, seqlen=1000)]


@pytest.mark.parametrize("opt,text", [("--shapes", "4096"), ("--shapes", "0x4096"), ("--heads", "32/5"),
                                      ("--heads", "32")])
def test_bad_shapes_and_heads_are_argparse_errors(opt, text, capsys):
    with pytest.raises(SystemExit) as ei:
        _parser().parse_args(["prefill-fp8", opt, text])
    assert ei.value.code == 2
    assert repr(text) in capsys.readouterr().err


def test_quantisation_one_descale_a_kv_head():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 8, 128, generator=g).to(torch.bfloat16)
    x[1, 3, 5, 7] = 40.0  # KV head 2 of a group of 2 (heads 4, 5) takes its descale from this one value
    x8, descale, deq = bf.quantised(torch, x, group=2)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (4,) and deq.dtype == torch.bfloat16
    amax = x.float().abs().reshape(2, 64, 4, 2, 128).amax(dim=(0, 1, 3, 4))
    assert torch.allclose(descale, amax / 448)
    assert descale[2].item() == pytest.approx(40.0 / 448)
    # every value within e4m3's range (the largest one a KV head lands on 448) and within its rounding of x: 2^-4
    # relative (3 mantissa bits; subnormals: half of 2^-9 times the descale), then bf16's 2^-9 of the product
    assert x8.float().abs().amax().item() == 448.0
    err = (deq.float() - x.float()).abs()
    floor = descale.repeat_interleave(2)[None, None, :, None] * 2 ** -9
    assert (err <= x.float().abs() * (2 ** -4 + 2 ** -8) + floor).all()


def _rec(d, causal, b, s, h, hk, tf, rel=0.02, nan=0):
    rec = dict(head_dim=d, causal=causal, batch=b, seqlen=s, heads=h, kv_heads=hk, flops=1.0, errors={},
               ms={n: 1.0 for n in tf}, tflops=dict(tf),
               check={"fp8": dict(rel_l2=rel, nan_count=nan, max_abs=0.1, ok=nan == 0 and rel <= bf.FP8_TOL)})
    rec["ratio"] = {n: tf["fp8"] / tf[n] for n in tf if n != "fp8" and tf[n]}
    return rec


RECORDS = [_rec(128, False, 1, 4096, 32, 8, {"fp8": 900.0, "bf16": 600.0, "cudnn": 500.0}),
           _rec(256, True, 8, 2048, 16, 16, {"fp8": 700.0, "bf16": 560.0, "cudnn": 560.0}, rel=0.2),
           _rec(128, True, 1, 16384, 32, 8, {"fp8": 1000.0, "bf16": 625.0, "cudnn": 500.0}, nan=3)]


def test_summary_ratios_and_failed_checks():
    s = bf.summarize(RECORDS)
    assert s["ratio"]["bf16"]["min"] == pytest.approx(1.25) and s["ratio"]["bf16"]["shapes"] == 3
    assert s["ratio"]["bf16"]["min_at"] == {"head_dim": 256, "causal": True, "batch": 8, "seqlen": 2048, "heads": 16,
                                       "kv_heads": 16}
    assert s["ratio"]["cudnn"]["geomean"] == pytest.approx((1.8 * 1.25 * 2.0) ** (1 / 3))
    assert "fp8/flashinfer" not in s
    assert s["checks"] == {"run": 3, "failed": 2, "max_rel_l2": 0.2}


def test_table_from_saved_json(tmp_path, capsys):
    data = dict(benchmark="prefill-fp8", complete=True, env=FAKE_ENV, config={}, results=RECORDS,
                summary=bf.summarize(RECORDS))
    saved = tmp_path / bf.JSON_NAME
    saved.write_text(json.dumps(data))
    md = tmp_path / "fp8.md"
    args = _parser().parse_args(["prefill-fp8", "--from-json", str(saved), "--markdown", str(md)])
    assert bf.run_fp8(args) == 0
    out = capsys.readouterr().out
    assert "fp8/bf16: min 1.250" in out and "checks: 3 run, 2 failed" in out
    text = md.read_text()
    assert "| 128 | no | 1 | 4096 | 32/8 | 900.0 | 600.0 | 500.0 | 1.50 | 1.80 | 2.0e-02 |" in text
    assert "| 256 | yes | 8 | 2048 | 16 | 700.0 | 560.0 | 560.0 | 1.25 | 1.25 | 2.0e-01 FAIL |" in text
    assert "| 128 | yes | 1 | 16384 | 32/8 | 1000.0 | 625.0 | 500.0 | 1.60 | 2.00 | FAIL 3 NaN |" in text
    assert "flashinfer" not in text  # no FlashInfer column where no record has one
