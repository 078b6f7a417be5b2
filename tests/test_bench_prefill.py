"""attngen bench prefill: sweep parsing, FLOP counting, the writers (on fake records), the sweep simulated on
the CPU."""

import json

import pytest

from attngen import bench
from attngen.bench import core
from attngen.families.prefill import bench as prefill_bench
from test_bench import FAKE_ENV


def parse(*argv):
    return bench.build_parser().parse_args(list(argv))


# --- the sweep ------------------------------------------------------------------------------------

def test_full_sweep_is_flash_attentions():
    shapes = prefill_bench.sweep_from_args(parse("prefill"))
    assert len(shapes) == 6 * 3 * 2 * 2 == 72
    assert len(set(shapes)) == 72
    for s in shapes:
        assert s.heads * s.head_dim == 2048
        assert s.batch * s.seqlen == 16384
    assert {s.seqlen for s in shapes} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {s.head_dim for s in shapes} == {64, 128, 256}
    assert {s.dtype for s in shapes} == {"bf16", "fp16"}
    assert {s.causal for s in shapes} == {False, True}


def test_sweep_narrowing_options():
    args = parse("prefill", "--head-dims", "64,128", "--seqlens", "512,2k", "--dtypes", "bf16", "--causal", "yes")
    shapes = prefill_bench.sweep_from_args(args)
    assert [(s.head_dim, s.seqlen) for s in shapes] == [(64, 512), (64, 2048), (128, 512), (128, 2048)]
    assert all(s.causal and s.dtype == "bf16" for s in shapes)
    assert [s.batch for s in shapes] == [32, 8, 32, 8]
    assert [s.heads for s in shapes] == [32, 32, 16, 16]
    assert {s.causal for s in prefill_bench.sweep_from_args(parse("prefill", "--causal", "no"))} == {False}


def test_quick_is_a_small_subset_and_explicit_options_win():
    quick = prefill_bench.sweep_from_args(parse("prefill", "--quick"))
    full = set(prefill_bench.sweep_from_args(parse("prefill")))
    assert 0 < len(quick) <= 12 and set(quick) <= full
    q2 = prefill_bench.sweep_from_args(parse("prefill", "--quick", "--head-dims", "256"))
    assert {s.head_dim for s in q2} == {256}


def test_backends_and_bad_values():
    assert parse("prefill").backends == ("flash", "cudnn", "efficient")
    assert parse("prefill", "--backends", "cudnn,flash").backends == ("cudnn", "flash")
    for bad in (["--backends", "xformers"], ["--dtypes", "fp8"], ["--seqlens", "abc"], ["--head-dims", "0"],
                ["--causal", "maybe"]):
        with pytest.raises(SystemExit):
            parse("prefill", *bad)


def test_split_head_dims_in_the_sweep():
    shapes = prefill_bench.sweep_from_args(parse("prefill", "--head-dims", "128,192/128", "--seqlens", "4k",
                                                 "--dtypes", "bf16", "--causal", "false"))
    assert [(s.head_dim, s.head_dim_v, s.heads) for s in shapes] == [(128, 0, 16), (192, 128, 10)]
    assert "d=192/128" in shapes[1].label() and "d=128 " in shapes[0].label()
    assert prefill_bench.dims_text(shapes[1].__dict__) == "192/128"
    for bad in ("192/", "a/128", "0/128", "192/128/64"):
        with pytest.raises(SystemExit):
            parse("prefill", "--head-dims", bad)


def test_explicit_shapes_with_gqa_heads():
    shapes = prefill_bench.sweep_from_args(parse("prefill", "--head-dims", "128", "--dtypes", "bf16", "--causal", "no",
                                                 "--shapes", "1x32/8x4096,8x32/8x2048,1x48x8192,2x16/16x512"))
    assert [(s.batch, s.heads, s.kv_heads, s.seqlen) for s in shapes] == [(1, 32, 8, 4096), (8, 32, 8, 2048),
                                                                          (1, 48, 0, 8192), (2, 16, 0, 512)]
    assert shapes[0].label().endswith("h=32/8") and shapes[2].label().endswith("h=48")
    assert shapes[0].flops == 4.0 * 32 * 4096 * 4096 * 128     # FLOPs count query heads
    for bad in ("1x32/5x4096", "1x32/0x4096", "1x/8x4096", "1x32/8", "1x32/8/2x4096"):
        with pytest.raises(SystemExit):
            parse("prefill", "--shapes", bad)


def test_simulated_gqa_rows(cpu_sim, monkeypatch, tmp_path):
    import torch.nn.functional as F

    import attngen

    seen = []

    def fake_gqa_prefill(q, k, v, *, causal=False, out=None, **kw):
        seen.append((q.shape[2], k.shape[2], v.shape[2]))
        o = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal,
                                           enable_gqa=True).transpose(1, 2).to(q.dtype)
        return o if out is None else out.copy_(o)

    monkeypatch.setattr(attngen, "prefill", fake_gqa_prefill)
    rc = bench.main(["prefill", "--head-dims", "64", "--dtypes", "bf16", "--causal", "both", "--backends", "flash",
                     "--shapes", "1x8/2x64", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert rc == 0 and set(seen) == {(8, 2, 2)}
    for r in data["results"]:
        assert (r["heads"], r["kv_heads"]) == (8, 2) and r["check"]["ok"], r["check"]
        assert prefill_bench.table_row(r, ["flash"])[5] == "8/2"
    assert data["config"]["explicit_shapes"] == [[1, 8, 64, 2]]


# --- FLOPs -----------------------------------------------------------------------------------------

def test_flops_counting():
    assert bench.attention_flops(2, 16, 1024, 1024, 128, False) == 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench.attention_flops(2, 16, 1024, 1024, 128, True) == 2 * 2 * 16 * 1024 * 1024 * 128
    assert bench.attention_flops(1, 1, 3, 5, 64, False) == 4 * 3 * 5 * 64
    s = prefill_bench.Shape("bf16", 64, True, 32, 512, 32)
    assert s.flops == 4 * 32 * 32 * 512 * 512 * 64 / 2
    # Every shape of the sweep does the same work per mask: 4 * tokens * seqlen * hidden.
    for shape in prefill_bench.make_sweep():
        assert shape.flops == 4 * 16384 * shape.seqlen * 2048 / (2 if shape.causal else 1)
    # Split head dims: Q K^T over D, P V over DV.
    assert bench.attention_flops(1, 2, 8, 8, 192, False, 128) == 2 * 2 * 8 * 8 * (192 + 128)
    assert bench.attention_flops(1, 2, 8, 8, 192, False, 0) == bench.attention_flops(1, 2, 8, 8, 192, False)
    assert bench.tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert bench.tflops(1e12, None) is None and bench.tflops(1e12, 0.0) is None


# --- writers on fake records ----------------------------------------------------------------------

def fake_record(dtype="bf16", d=128, causal=False, s=2048, a=300.0, flash=330.0, cudnn=None, eff=200.0,
                rel=2.5e-3, nan=0):
    shape = prefill_bench.Shape(dtype, d, causal, 16384 // s, s, 2048 // d)
    tf = {"attngen": a, "flash": flash, "cudnn": cudnn, "efficient": eff}
    rec = {**shape.__dict__, "flops": shape.flops,
           "ms": {k: (shape.flops / (v * 1e12) * 1e3 if v else None) for k, v in tf.items()},
           "tflops": tf, "errors": {} if cudnn else {"cudnn": "RuntimeError: No available kernel."},
           "ratio": {k: (a / v if v else None) for k, v in tf.items() if k != "attngen"},
           "check": {"reference": "flash", "nan_count": nan, "max_abs": 0.01, "rel_l2": rel,
                     "ok": nan == 0 and rel <= prefill_bench.CHECK_TOL, "tolerance_rel_l2": prefill_bench.CHECK_TOL}}
    return rec


def fake_data(complete=True):
    recs = [fake_record(), fake_record(causal=True, s=512, a=150.0, flash=200.0, cudnn=210.0),
            fake_record(dtype="fp16", d=64, s=16384, a=350.0, flash=340.0, rel=0.5, nan=3)]
    return {"benchmark": "prefill", "complete": complete, "env": FAKE_ENV,
            "config": {"backends": ["flash", "cudnn", "efficient"], "warmup_ms": 25, "rep_ms": 100, "reps": None,
                       "timer": "triton.do_bench"},
            "results": recs}


def test_text_rows_and_summary():
    data = fake_data()
    backends = ["flash", "cudnn", "efficient"]
    header = prefill_bench.text_header(backends)
    for col in ("dtype", "attngen", "flash", "/flash", "/cudnn", "check"):
        assert col in header
    row = prefill_bench.text_row(data["results"][0], backends)
    assert "300.0" in row and "330.0" in row and "0.91" in row and "—" in row   # cudnn refused: null
    assert "FAIL" in prefill_bench.text_row(data["results"][2], backends)
    summ = prefill_bench.summarize(data["results"], backends)
    assert summ["flash"]["min"] == pytest.approx(0.75)
    assert summ["flash"]["min_at"]["seqlen"] == 512 and summ["flash"]["min_at"]["causal"] is True
    assert summ["cudnn"]["shapes"] == 1
    assert summ["checks"] == {"run": 3, "failed": 1, "max_rel_l2": 0.5}
    lines = prefill_bench.summary_lines(summ, backends)
    assert any(ln.startswith("attngen/flash: min 0.750") for ln in lines)


def test_markdown_writer():
    md = prefill_bench.prefill_markdown(fake_data(complete=False))
    lines = md.splitlines()
    assert lines[0].startswith("## ")
    assert any("NVIDIA H100" in ln and "driver 580.95" in ln for ln in lines)
    assert any("torch 2.11.0+cu130" in ln and "nvrtc 13.0" in ln for ln in lines)
    assert any(".transpose(1, 2)" in ln for ln in lines)
    assert "Partial run" in md
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 2 + 3
    ncols = table[0].count("|")
    assert all(ln.count("|") == ncols for ln in table)
    assert "| bf16 | 128 | no | 8 | 2048 | 16 | 300.0 | 330.0 | — | 200.0 | 0.91 | — | 1.50 |" in md


def test_json_writer_is_strict_and_atomic(tmp_path):
    data = fake_data()
    data["results"][0]["check"]["max_abs"] = float("nan")
    data["results"][0]["tflops"]["attngen"] = float("inf")
    p = tmp_path / "sub" / "bench_prefill.json"
    bench.write_json(p, data)
    back = json.loads(p.read_text())   # strict JSON: no bare NaN / Infinity
    assert back["results"][0]["check"]["max_abs"] == "nan"
    assert back["results"][0]["tflops"]["attngen"] == "inf"
    assert back["results"][1]["tflops"]["cudnn"] == 210.0
    assert [f.name for f in p.parent.iterdir()] == ["bench_prefill.json"]


def test_from_json_rerenders_without_gpu(tmp_path, capsys):
    p = tmp_path / "bench_prefill.json"
    bench.write_json(p, fake_data())
    md = tmp_path / "prefill.md"
    assert bench.main(["prefill", "--from-json", str(p), "--markdown", str(md), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "minimum ratio attngen/flash across the sweep: 0.750" in out
    assert md.read_text().startswith("## Prefill")
    try:
        import matplotlib  # noqa: F401
    except Exception:
        assert "plot skipped" in out
    else:
        assert (tmp_path / "bench_prefill.png").stat().st_size > 0


# --- the sweep's plumbing, simulated on the CPU -----------------------------------------------------

@pytest.fixture
def cpu_sim(monkeypatch):
    """run_shape on CPU tensors: attngen.prefill faked with fp32 SDPA, a host-clock timer, no CUDA calls.

    Tests orchestration only (nulls for refused peers, NaN detection, streaming, incremental
    JSON), never a measurement.
    """
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import attngen
    from attngen.compiler import Resources

    calls = {"n": 0, "nan_at_d": None, "interrupt_at": None}

    def fake_prefill(q, k, v, *, causal=False, out=None, **kw):
        calls["n"] += 1
        if calls["interrupt_at"] is not None and calls["n"] >= calls["interrupt_at"]:
            raise KeyboardInterrupt
        o = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal)
        o = o.transpose(1, 2).to(q.dtype)
        if q.shape[-1] == calls["nan_at_d"]:
            o[0, -1, 0, 0] = float("nan")
        if out is None:
            return o
        out[:, :-1] = o[:, :-1]   # a kernel that forgets the last row when poisoned
        if q.shape[-1] != calls["nan_at_d"]:
            out[:, -1] = o[:, -1]
        return out

    def fake_get_kernel(spec, arch=None, device=None):
        return type("K", (), dict(spec=attngen.resolve(spec, "sm_90"), origin="compiled", smem_bytes=0, threads=128,
                                  binary=type("B", (), dict(resources=Resources()))))

    # The benchmarks reach DEVICE, the timer and the environment through attngen.bench.core.
    monkeypatch.setattr(core, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(attngen, "prefill", fake_prefill)
    monkeypatch.setattr(attngen, "get_kernel", fake_get_kernel)
    dtypes = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    monkeypatch.setattr(prefill_bench, "kernel_for", lambda q, k, v, causal=False: fake_get_kernel(
        attngen.PrefillSpec(head_dim=q.shape[-1], head_dim_v=v.shape[-1], dtype=dtypes[q.dtype],
                            mask="causal" if causal else "none")))
    monkeypatch.setattr(core, "bench_ms", lambda fn, *a, **k: (fn(), 1.0)[1:] + ("sim",))
    monkeypatch.setattr(core, "environment", lambda gpu=None: dict(FAKE_ENV, gpu="SIM"))
    return calls


SIM = ["prefill", "--tokens", "256", "--hidden", "128", "--seqlens", "64,128", "--head-dims", "64,128",
       "--dtypes", "bf16"]


def test_sweep_plumbing_simulated(cpu_sim, tmp_path, capsys):
    cpu_sim["nan_at_d"] = 128
    rc = bench.main(SIM + ["--out", str(tmp_path), "--markdown", str(tmp_path / "p.md")])
    out = capsys.readouterr().out
    assert rc == 1   # the shapes with an unwritten element fail the check
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert data["complete"] and len(data["results"]) == 8
    for r in data["results"]:
        assert r["tflops"]["attngen"] == pytest.approx(r["flops"] / 1e-3 / 1e12)
        assert r["check"]["reference"] == "flash"
        if r["head_dim"] == 128:
            assert r["check"]["nan_count"] > 0 and not r["check"]["ok"]
        else:
            assert r["check"]["ok"] and r["check"]["rel_l2"] < 1e-2, r["check"]
        for peer in ("cudnn", "efficient"):   # CPU SDPA has neither: recorded as null, not a crash
            if r["tflops"][peer] is None:
                assert peer in r["errors"] and r["ratio"][peer] is None
    assert out.count(" bf16 ") >= 8
    assert "minimum ratio attngen/flash across the sweep" in out
    assert (tmp_path / "p.md").read_text().count("\n| bf16 |") == 8


def test_interleave_times_each_column_twice_and_keeps_the_mean(cpu_sim, tmp_path, monkeypatch):
    # Each column is timed in one order, then the reverse, and keeps the mean of its two: a timer that drifts evenly
    # over a shape's sequence (here 1 us faster each time it runs) gives every column the same mean, whatever its
    # place (keeping the faster of the two gave the first column the first place's advantage).
    seen = []
    clock = iter(range(1000, 0, -1))

    def timed(fn, *a, **k):
        fn()
        seen.append(fn)
        return next(clock) / 1000.0, "sim"

    monkeypatch.setattr(core, "bench_ms", timed)
    args = SIM + ["--backends", "flash", "--also", "x=num_stages=2", "--interleave", "--out", str(tmp_path)]
    bench.main(args)
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert data["config"]["interleave"] is True
    n = len(data["results"])
    assert len(seen) == n * 3 * 2  # attngen, flash, x; twice each
    for i, r in enumerate(data["results"]):
        first = 1000 - 6 * i  # this shape's first pass read 1000 - 6i, -6i - 1, -6i - 2 (ms x 1000)
        # the reverse pass: x, flash, attngen read first - 3, first - 4, first - 5: each column's mean, first - 2.5
        assert [r["ms"][c] * 1000 for c in ("attngen", "flash", "x")] == pytest.approx([first - 2.5] * 3)
    bench.main(SIM + ["--backends", "flash", "--also", "x=num_stages=2", "--out", str(tmp_path)])
    assert len(seen) == n * 3 * 3  # without --interleave: once each


def test_sweep_leaves_partial_json_when_cut_short(cpu_sim, tmp_path):
    cpu_sim["interrupt_at"] = 5   # two calls per shape (check, timing): dies in the third shape
    assert bench.main(SIM + ["--out", str(tmp_path)]) == 130
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert not data["complete"] and len(data["results"]) == 2
    md = prefill_bench.prefill_markdown(data)
    assert "Partial run" in md


# --- on the GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_prefill_bench_one_shape_on_gpu(tmp_path, cache_dir, capsys):
    pytest.importorskip("torch")
    rc = bench.main(["prefill", "--head-dims", "64", "--seqlens", "1k", "--dtypes", "bf16", "--causal", "both",
                     "--warmup-ms", "5", "--rep-ms", "20", "--out", str(tmp_path), "--markdown",
                     str(tmp_path / "p.md")])
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert data["complete"] and len(data["results"]) == 2
    for r in data["results"]:
        assert r["check"]["nan_count"] == 0 and r["check"]["ok"], r["check"]
        assert r["tflops"]["attngen"] and r["tflops"]["attngen"] > 1
        assert set(r["tflops"]) == {"attngen", "flash", "cudnn", "efficient"}
    assert rc == 0
    assert "minimum ratio attngen/flash" in capsys.readouterr().out
