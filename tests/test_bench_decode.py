"""attngen bench decode: the sweep and its options, bytes and memory, the reference and the paged
copy, the report (on fake records), and the sweep simulated on the CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attngen import bench
from attngen.bench import core
from attngen.families.decode import bench as decode_bench
from attngen.families.decode import bench_report as decode_report
from test_bench import FAKE_ENV, ROOT


def parse(*argv):
    return bench.build_parser().parse_args(list(argv))


# --- the sweep and its arguments ------------------------------------------------------------------

def test_decode_full_sweep_is_the_issues():
    shapes = decode_bench.decode_sweep_from_args(parse("decode"))
    assert len(shapes) == 3 * 4 * 4 + 1 == 49
    assert len(set(shapes)) == 49
    main = shapes[:48]
    assert {(s.heads, s.kv_heads) for s in main} == {(32, 8), (32, 4), (64, 8)}
    assert {s.batch for s in main} == {1, 16, 64, 128}
    assert {s.kv_len for s in main} == {1024, 4096, 8192, 32768}
    assert all(s.q_len == 1 and s.head_dim == 128 and s.dtype == "bf16" for s in main)
    assert shapes[-1] == decode_bench.DecodeShape("bf16", 4, 16384, 4, 16, 1, 128)
    assert shapes[-1].group == 16
    assert shapes[-1].label() == "b=4 L=16k q=4 h=16/1 d=128 bf16"


def test_decode_narrowing_quick_and_extra():
    s = decode_bench.decode_sweep_from_args(parse("decode", "--heads", "32/8", "--batches", "1,16", "--kv-lens",
                                                  "4k,1000"))
    assert [(x.batch, x.kv_len) for x in s] == [(1, 4096), (1, 1000), (16, 4096), (16, 1000)]
    assert all((x.heads, x.kv_heads, x.q_len) == (32, 8, 1) for x in s)   # narrowing drops the extra shape
    quick = decode_bench.decode_sweep_from_args(parse("decode", "--quick"))
    full = set(decode_bench.decode_sweep_from_args(parse("decode")))
    assert 0 < len(quick) <= 6 and set(quick) <= full
    assert any(x.batch == 1 and x.kv_len == 32768 for x in quick)           # the cuDNN target's shape
    assert any(x.batch >= 16 and x.kv_len >= 4096 for x in quick)           # the copy target's
    assert len(decode_bench.decode_sweep_from_args(parse("decode", "--no-extra"))) == 48
    s = decode_bench.decode_sweep_from_args(parse("decode", "--q-lens", "1,4", "--heads", "16/2", "--batches", "2",
                                                  "--kv-lens", "1k", "--dtype", "fp16", "--head-dim", "64"))
    assert [(x.q_len, x.dtype, x.head_dim) for x in s] == [(1, "fp16", 64), (4, "fp16", 64)]


def test_decode_arguments():
    a = parse("decode")
    assert a.variant == "auto" and a.num_splits == 0 and not a.paged and a.block_size == 64
    assert a.backends == ("flash", "cudnn") and a.dtype == "bf16"
    a = parse("decode", "--variant", "both", "--num-splits", "7", "--paged", "--block-size", "16", "--backends",
              "flash,cudnn,efficient", "--dtype", "half", "--out", "x", "--json")
    assert (a.variant, a.num_splits, a.paged, a.block_size, a.dtype) == ("both", 7, True, 16, "fp16")
    assert a.backends == ("flash", "cudnn", "efficient") and a.out == Path("x") and a.json is True
    assert parse("decode", "--heads", "32/8, 64/8").heads == ((32, 8), (64, 8))
    for bad in (["--heads", "32/5"], ["--heads", "32"], ["--heads", "a/b"], ["--q-lens", "9"], ["--q-lens", "0"],
                ["--block-size", "24"], ["--block-size", "512"], ["--num-splits", "-1"], ["--variant", "split"],
                ["--dtype", "fp8"], ["--dtype", "bf16,fp16"], ["--head-dim", "96"], ["--backends", "xformers"]):
        with pytest.raises(SystemExit):
            parse("decode", *bad)


def test_decode_impl_rows():
    assert decode_bench.decode_impls("auto", False) == [("attngen", "auto", False)]
    assert decode_bench.decode_impls("unfused", False) == [("attngen-unfused", "unfused", False)]
    assert [n for n, _, _ in decode_bench.decode_impls("both", True)] == [
        "attngen-fused", "attngen-unfused", "attngen-fused-paged", "attngen-unfused-paged"]
    assert decode_bench.decode_impls("auto", True)[1] == ("attngen-paged", "auto", True)


# --- bytes, bandwidth, memory ----------------------------------------------------------------------

def test_decode_byte_counting():
    assert decode_report.decode_kv_bytes([1024] * 16, 8, 128, 2) == 16 * 1024 * 8 * 128 * 2 * 2
    assert decode_report.decode_kv_bytes([1, 17, 4097], 2, 64, 2) == (1 + 17 + 4097) * 2 * 64 * 2 * 2
    assert decode_report.decode_kv_bytes([], 8, 128, 2) == 0
    big = decode_bench.DecodeShape("bf16", 128, 32768, 1, 32, 8, 128)
    assert big.kv_bytes == 16 * 2**30                  # the issue's largest cache: 16 GiB of K+V
    # Query heads do not change the bytes: one KV head serves its whole group.
    assert decode_bench.DecodeShape("bf16", 128, 32768, 1, 64, 8, 128).kv_bytes == big.kv_bytes
    assert decode_bench.DecodeShape("fp16", 4, 16384, 4, 16, 1, 128).kv_bytes == 4 * 16384 * 1 * 128 * 2 * 2
    assert bench.gbps(1e9, 1.0) == pytest.approx(1000.0)
    assert bench.gbps(16 * 2**30, 5.0) == pytest.approx(16 * 2**30 / 5e-3 / 1e9)
    assert bench.gbps(1e9, None) is None and bench.gbps(1e9, 0.0) is None


def test_decode_memory_estimate():
    s = decode_bench.DecodeShape("bf16", 128, 32768, 1, 64, 8, 128)
    base = decode_bench.decode_mem_need(s, check=False)
    assert base > s.kv_bytes
    assert decode_bench.decode_mem_need(s, paged=True, check=False) == base + s.kv_bytes
    assert decode_bench.decode_mem_need(s, sdpa_contiguous=True, check=False) == base + s.kv_bytes
    assert decode_bench.decode_mem_need(s) > base
    assert decode_bench.decode_mem_need(s, unfused=True, check=False) == base + 128 * 64 * 32768 * 4  # fp32 scores
    # The whole default sweep, paged, fits an 80 GB card: the largest shape needs well under 64 GiB.
    worst = max(decode_bench.decode_mem_need(x, paged=True) for x in decode_bench.make_decode_sweep())
    assert worst < 40 * 2**30
    small = decode_bench.DecodeShape("bf16", 1, 1024, 1, 32, 8, 128)
    assert decode_bench.decode_mem_need(small) < 2 * 2**30


def test_decode_rotate_argument():
    assert not parse("decode").rotate
    a = parse("decode", "--rotate", "--quick")
    assert a.rotate and not a.graph and a.quick


def test_rotate_copies():
    mib = 2**20
    rotate_copies, DecodeShape = decode_bench.rotate_copies, decode_bench.DecodeShape
    assert decode_bench.ROTATE_BYTES == 200 * mib                 # four 50 MB H100 L2s
    # Small caches: enough copies to cover ROTATE_BYTES, rounding up.
    assert rotate_copies(4 * mib) == 50
    assert rotate_copies(3 * mib) == 67                           # 66 copies would be 198 MiB
    assert rotate_copies(1) == decode_bench.ROTATE_BYTES
    # Exact multiples need no extra copy; a cache of ROTATE_BYTES or more is read once per replay.
    assert rotate_copies(50 * mib) == 4
    assert rotate_copies(50 * mib + 1) == 4
    assert rotate_copies(50 * mib - 1) == 5
    assert rotate_copies(decode_bench.ROTATE_BYTES) == 1
    assert rotate_copies(decode_bench.ROTATE_BYTES + 1) == 1
    assert rotate_copies(DecodeShape("bf16", 128, 32768, 1, 32, 4, 128).kv_bytes) == 1
    # The sweep's smallest caches: b=1 L=1k with 8 and 4 KV heads; the MQA extra shape.
    assert rotate_copies(DecodeShape("bf16", 1, 1024, 1, 32, 8, 128).kv_bytes) == 50
    assert rotate_copies(DecodeShape("bf16", 1, 1024, 1, 32, 4, 128).kv_bytes) == 100
    assert rotate_copies(DecodeShape("bf16", 4, 16384, 4, 16, 1, 128).kv_bytes) == 7
    # The memory cap: copies in a quarter of free memory, never fewer than one.
    assert rotate_copies(4 * mib, free_bytes=80 * 2**30) == 50
    assert rotate_copies(4 * mib, free_bytes=4 * 4 * mib * 10) == 10
    assert rotate_copies(4 * mib, free_bytes=4 * 4 * mib * 10 - 1) == 9
    assert rotate_copies(4 * mib, free_bytes=0) == 1
    assert rotate_copies(decode_bench.ROTATE_BYTES, free_bytes=0) == 1
    assert rotate_copies(0) == decode_bench.ROTATE_BYTES          # no division by zero


# --- the reference and the paged copy (CPU torch) --------------------------------------------------

def test_decode_reference_matches_the_test_reference():
    torch = pytest.importorskip("torch")
    from tests.gpu_reference import reference_attention, reference_decode

    g = torch.Generator().manual_seed(1)
    for ql, (h, hk) in ((1, (8, 2)), (3, (4, 4)), (4, (16, 1))):
        q = torch.randn(5, ql, h, 64, generator=g)
        k = torch.randn(5, 40, hk, 64, generator=g)
        v = torch.randn(5, 40, hk, 64, generator=g)
        ref = decode_bench.decode_reference(q, k, v, chunk_bytes=1)   # one row per chunk
        assert torch.allclose(ref, decode_bench.decode_reference(q, k, v), atol=1e-6)
        o, lse = reference_decode(q, k, v, 40)
        assert torch.allclose(ref, o, atol=1e-5)
        o2, _ = reference_attention(q, k, v, causal=True)         # prefill's reference: bottom-right causal
        assert torch.allclose(ref, o2, atol=1e-5)
        assert torch.isfinite(lse).all()
    # Fewer keys than new tokens: the first query sees nothing.
    q = torch.randn(2, 4, 2, 64, generator=g)
    k = torch.randn(2, 3, 1, 64, generator=g)
    ref = decode_bench.decode_reference(q, k, k)
    assert (ref[:, 0] == 0).all() and ref[:, 1:].abs().sum() > 0


def test_paged_copy_scatters_blocks_and_keeps_the_data():
    torch = pytest.importorskip("torch")
    from tests.gpu_reference import reference_decode

    g = torch.Generator().manual_seed(2)
    for n, bs in ((64, 16), (70, 16), (5, 64)):
        k = torch.randn(3, n, 2, 64, generator=g).to(torch.bfloat16)
        v = torch.randn(3, n, 2, 64, generator=g).to(torch.bfloat16)
        kp, vp, table = decode_bench.paged_copy(k, v, bs, seed=3)
        nb = (n + bs - 1) // bs
        assert kp.shape == (3 * nb, bs, 2, 64) and table.shape == (3, nb) and table.dtype == torch.int32
        assert sorted(table.flatten().tolist()) == list(range(3 * nb))
        if nb > 1:
            assert table.flatten().tolist() != list(range(3 * nb))    # scattered, not in order
        for i in range(3):
            got = kp[table[i].long()].reshape(-1, 2, 64)
            assert torch.equal(got[:n], k[i]) and torch.equal(vp[table[i].long()].reshape(-1, 2, 64)[:n], v[i])
            assert torch.isnan(got[n:].float()).all()                 # the tail of the last block is poison
        q = torch.randn(3, 2, 4, 64, generator=g).to(torch.bfloat16)
        dense = decode_bench.decode_reference(q, k, v)
        paged, _ = reference_decode(q, kp, vp, torch.full((3,), n, dtype=torch.int32), block_table=table)
        assert torch.allclose(dense, paged, atol=1e-5)


def test_scatter_blocks_takes_any_trailing_shape():
    # MLA's cache is [B, L, 576]: the same scatter, one table for every call with one seed.
    torch = pytest.importorskip("torch")
    x = torch.randn(2, 40, 24, generator=torch.Generator().manual_seed(1))
    pages, table = decode_bench.scatter_blocks(x, 16, seed=5)
    assert pages.shape == (6, 16, 24) and table.shape == (2, 3)
    for i in range(2):
        got = pages[table[i].long()].reshape(-1, 24)
        assert torch.equal(got[:40], x[i]) and torch.isnan(got[40:]).all()
    assert torch.equal(decode_bench.scatter_blocks(x.clone(), 16, seed=5)[1], table)


# --- the report on fake records --------------------------------------------------------------------

COPY = {"buffer_bytes": 2**30, "bytes_moved": 2**31, "ms": 0.6, "gbps": 3579.1, "timer": "triton.do_bench"}


def fake_decode_record(batch=16, kv_len=4096, heads=32, kv_heads=8, q_len=1, a=None, flash=None, cudnn=None,
                       rel=3e-3, nan=0, impls=("attngen",), cudnn_error=None):
    shape = decode_bench.DecodeShape("bf16", batch, kv_len, q_len, heads, kv_heads, 128)
    ms = {"flash": flash, "cudnn": cudnn}
    for name in impls:
        ms[name] = a
    rec = {**shape.__dict__, "bytes": shape.kv_bytes, "impls": list(impls), "backends": ["flash", "cudnn"],
           "ms": ms, "gbps": {n: bench.gbps(shape.kv_bytes, t) for n, t in ms.items()}, "errors": {},
           "checks": {n: {"reference": "fp32", "nan_count": nan, "max_abs": 0.01, "rel_l2": rel,
                          "ok": nan == 0 and rel <= decode_bench.CHECK_TOL, "tolerance_rel_l2": decode_bench.CHECK_TOL}
                      for n in impls},
           "sdpa_call": {"flash": "no mask"}, "timer": "sim"}
    rec["frac_copy"] = {n: (g / COPY["gbps"] if g else None) for n, g in rec["gbps"].items()}
    rec["ratio"] = {n: {p: (ms[p] / a if a and ms[p] else None) for p in ("flash", "cudnn")} for n in impls}
    if cudnn_error:
        rec["errors"]["cudnn"] = cudnn_error
    return rec


def fake_decode_data(complete=True):
    b16 = decode_bench.DecodeShape("bf16", 16, 4096, 1, 32, 8, 128).kv_bytes
    at = b16 / (0.93 * COPY["gbps"] * 1e9) * 1e3          # attngen at 93% of copy
    recs = [fake_decode_record(a=at, flash=at * 1.2, cudnn=at * 1.1),
            fake_decode_record(batch=1, kv_len=32768, a=0.02, flash=0.03, cudnn=0.028),
            fake_decode_record(batch=64, kv_len=8192, a=1.0, flash=0.95, cudnn=None, cudnn_error="RuntimeError: x"),
            {**decode_bench.DecodeShape("bf16", 128, 32768, 1, 64, 8, 128).__dict__, "impls": ["attngen"],
             "backends": ["flash", "cudnn"], "skipped": "needs ~17.5 GiB, 10.0 GiB free"}]
    return {"benchmark": "decode", "complete": complete, "env": FAKE_ENV, "copy": COPY,
            "config": {"backends": ["flash", "cudnn"], "variant": "auto", "num_splits": 0, "warmup_ms": 25,
                       "rep_ms": 100, "reps": None, "timer": "triton.do_bench"},
            "results": recs}


def test_decode_text_rows():
    data = fake_decode_data()
    backends = ["flash", "cudnn"]
    header = decode_report.decode_text_header(backends)
    for col in ("shape", "impl", "ms", "GB/s", "%copy", "vs flash", "vs cudnn", "check"):
        assert col in header
    rows = decode_report.decode_text_rows(data["results"][0], backends)
    assert len(rows) == 3                                   # attngen, sdpa-flash, sdpa-cudnn
    assert rows[0].startswith("b=16 L=4k q=1 h=32/8 d=128 bf16")
    assert " attngen " in rows[0] and "93.0" in rows[0] and "1.20" in rows[0] and "1.10" in rows[0]
    assert "3.0e-03" in rows[0]
    assert rows[1].split()[0] == "sdpa-flash" and rows[2].split()[0] == "sdpa-cudnn"
    assert len({len(r) for r in rows} | {len(header)}) == 1
    refused = decode_report.decode_text_rows(data["results"][2], backends)
    assert "0.95" in refused[0] and "error" in refused[2]    # slower than flash; cuDNN refused
    skipped = decode_report.decode_text_rows(data["results"][3], backends)
    assert len(skipped) == 1 and "(skipped)" in skipped[0] and "GiB free" in skipped[0]
    bad = fake_decode_record(a=1.0, flash=1.0, cudnn=1.0, nan=4)
    assert "FAIL 4 NaN" in decode_report.decode_text_rows(bad, backends)[0]


def test_decode_summary_and_targets():
    data = fake_decode_data()
    summ = decode_report.decode_summary(data["results"], ["flash", "cudnn"])
    s = summ["impls"]["attngen"]
    assert s["ratio"]["flash"]["min"] == pytest.approx(0.95) and s["ratio"]["flash"]["shapes"] == 3
    assert s["ratio"]["flash"]["min_at"].startswith("b=64 L=8k")
    assert s["ratio"]["cudnn"]["shapes"] == 2
    t = {x["target"]: x for x in s["targets"]}
    assert t["copy"]["shapes"] == 2 and t["copy"]["verdict"] == "MISSED"   # b=64 8k is far below copy
    assert t["cudnn_b1_32k"]["verdict"] == "met" and t["cudnn_b1_32k"]["worst"] == pytest.approx(1.4)
    assert t["flash"]["verdict"] == "MISSED" and t["flash"]["worst"] == pytest.approx(0.95)
    assert summ["checks"] == {"run": 3, "failed": 0, "max_rel_l2": 3e-3, "peers_run": 0}
    assert summ["skipped"] == 1
    lines = decode_report.decode_summary_lines(summ)
    assert any(ln.startswith("attngen vs flash: min 0.95 at b=64 L=8k") for ln in lines)
    assert any("target attngen: >= 90% of copy bandwidth" in ln and "MISSED" in ln for ln in lines)
    assert any("1.3x SDPA cuDNN at batch 1, kv_len 32k: met (worst 1.40x" in ln for ln in lines)
    assert any(ln.startswith("skipped shapes (memory): 1") for ln in lines)
    # Only the good shapes: every target met. No batch-1 32k shape: that one is not measured.
    good = decode_report.decode_summary(data["results"][:1], ["flash", "cudnn"])
    t = {x["target"]: x["verdict"] for x in good["impls"]["attngen"]["targets"]}
    assert t == {"copy": "met", "cudnn_b1_32k": "not measured", "flash": "met"}


def test_decode_paged_target():
    # A paged row is held to its contiguous row's time on every shape where both ran (>= 0.95).
    recs = [fake_decode_record(a=1.0, flash=1.2, cudnn=1.1, impls=("attngen-fused", "attngen-fused-paged")),
            fake_decode_record(batch=1, kv_len=32768, a=1.0, flash=1.2, cudnn=1.1,
                               impls=("attngen-fused", "attngen-fused-paged"))]
    recs[0]["ms"]["attngen-fused-paged"] = 1.0 / 0.97
    recs[1]["ms"]["attngen-fused-paged"] = 1.0 / 0.90
    summ = decode_report.decode_summary(recs, ["flash", "cudnn"])
    assert "paged" not in {x["target"] for x in summ["impls"]["attngen-fused"]["targets"]}
    t = {x["target"]: x for x in summ["impls"]["attngen-fused-paged"]["targets"]}["paged"]
    assert t["verdict"] == "MISSED" and t["worst"] == pytest.approx(0.90) and t["shapes"] == 2
    assert t["worst_at"].startswith("b=1 L=32k")
    lines = decode_report.decode_summary_lines(summ)
    assert any("target attngen-fused-paged: within 0.95x of attngen-fused" in ln and "MISSED (worst 0.90x at b=1 L=32k"
               in ln for ln in lines), lines
    recs[1]["ms"]["attngen-fused-paged"] = 1.0 / 0.96
    t = decode_report.decode_summary(recs, ["flash", "cudnn"])["impls"]["attngen-fused-paged"]["targets"][-1]
    assert t["target"] == "paged" and t["verdict"] == "met"


def test_decode_markdown():
    md = decode_report.decode_markdown(fake_decode_data(complete=False))
    lines = md.splitlines()
    assert lines[0] == "## Decode: attngen vs PyTorch SDPA"
    assert any("NVIDIA H100" in ln for ln in lines)
    assert any(ln.startswith("- copy bandwidth: 3579 GB/s") for ln in lines)
    assert "Partial run" in md and "enable_gqa=True" in md and "peer time / attngen time" in md
    table = [ln for ln in lines if ln.startswith("|")]
    assert len(table) == 2 + 3 * 3 + 1
    ncols = table[0].count("|")
    assert all(ln.count("|") == ncols for ln in table)
    assert "- b=64 L=8k q=1 h=32/8 d=128 bf16, cudnn: RuntimeError: x" in md
    assert any("target attngen: never slower than SDPA flash" in ln for ln in lines)


def test_decode_markdown_names_the_timing_method(tmp_path, capsys):
    data = fake_decode_data()
    md = decode_report.decode_markdown(data)
    assert "--rotate" not in md and "CUDA-graph replays" not in md
    data["config"]["graph"] = True
    assert "- timed on CUDA-graph replays (each call captured once" in decode_report.decode_markdown(data)
    data["config"].update(rotate=True, timer="cuda-events, no flush, CUDA-graph replays over rotated K/V copies")
    data["results"][0]["rotate"], data["results"][1]["rotate"], data["results"][2]["rotate"] = 2, 50, 1
    md = decode_report.decode_markdown(data)
    note = [ln for ln in md.splitlines() if "(--rotate)" in ln]
    assert len(note) == 1 and note[0].startswith("- timed as a decode step's layers run (--rotate)")
    assert "own K/V copy (1..50 per shape)" in note[0] and ">= 200 MiB" in note[0] and "no L2 flush" in note[0]
    assert "each call captured once" not in md                     # the rotate note replaces the graph one
    assert "(cuda-events, no flush, CUDA-graph replays over rotated K/V copies)" in md
    for r in data["results"][:3]:
        r["rotate"] = 7
    assert "own K/V copy (7 per shape)" in decode_report.decode_markdown(data)
    p = tmp_path / "bench_decode.json"
    bench.write_json(p, data)
    assert bench.main(["decode", "--from-json", str(p)]) == 0
    assert "(--rotate): one CUDA graph of back-to-back calls" in capsys.readouterr().out


def test_decode_json_and_from_json(tmp_path, capsys):
    data = fake_decode_data()
    data["results"][0]["checks"]["attngen"]["max_abs"] = float("nan")
    p = tmp_path / "d" / "bench_decode.json"
    bench.write_json(p, data)
    back = json.loads(p.read_text())
    assert back["results"][0]["checks"]["attngen"]["max_abs"] == "nan"
    md = tmp_path / "decode.md"
    assert bench.main(["decode", "--from-json", str(p), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "copy bandwidth: 3579 GB/s" in out and "sdpa-flash" in out and "(skipped)" in out
    assert "target attngen: never slower than SDPA flash" in out
    assert md.read_text().startswith("## Decode")


# --- the sweep's plumbing, simulated on the CPU ----------------------------------------------------

@pytest.fixture
def decode_sim(monkeypatch):
    """cmd_decode on CPU tensors: attngen.decode faked with the fp32 reference, no CUDA calls.

    Tests orchestration only (peers refused or accepted, NaN detection, memory skips, JSON,
    paged rows), never a measurement.
    """
    torch = pytest.importorskip("torch")

    import attngen
    from tests.gpu_reference import reference_decode

    state = {"calls": [], "nan": False, "free": 64 * 2**30, "interrupt_at": None}

    def fake_decode(q, k_cache, v_cache, *, cache_seqlens, cache_batch_idx=None, block_table=None, num_splits=0,
                    sm_scale=None, return_lse=False, out=None, variant="auto", spec=None):
        state["calls"].append((variant, block_table is not None, num_splits))
        if state["interrupt_at"] is not None and len(state["calls"]) >= state["interrupt_at"]:
            raise KeyboardInterrupt
        o, lse = reference_decode(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, block_table, sm_scale)
        o = o.to(q.dtype)
        if out is None:
            out = o
        elif state["nan"] and variant == "unfused":
            out[:, :, 1:] = o[:, :, 1:]       # forgets head 0 of the poisoned output
        else:
            out.copy_(o)
        return (out, lse) if return_lse else out

    # The benchmarks reach DEVICE, the timer and the environment through attngen.bench.core.
    monkeypatch.setattr(core, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (state["free"], 80 * 2**30))
    monkeypatch.setattr(attngen, "decode", fake_decode, raising=False)
    monkeypatch.setattr(core, "bench_ms", lambda fn, *a, **k: (fn(), 1.0)[1:] + ("sim",))
    monkeypatch.setattr(core, "environment", lambda gpu=None: dict(FAKE_ENV, gpu="SIM"))
    return state


DSIM = ["decode", "--heads", "8/2", "--batches", "2", "--kv-lens", "64,100", "--head-dim", "64", "--copy-mib", "1"]


def test_decode_plumbing_simulated(decode_sim, tmp_path, capsys):
    p = tmp_path / "r" / "bench_decode.json"
    rc = bench.main(DSIM + ["--q-lens", "1,3", "--variant", "both", "--paged", "--block-size", "16",
                            "--num-splits", "3", "--out", str(p.parent), "--markdown", str(tmp_path / "d.md")])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(p.read_text())
    assert data["complete"] and len(data["results"]) == 4
    assert data["copy"]["gbps"] == pytest.approx(2 * 2**20 / 1e-3 / 1e9)
    assert data["config"]["impls"] == ["attngen-fused", "attngen-unfused", "attngen-fused-paged",
                                       "attngen-unfused-paged"]
    assert {c for c in decode_sim["calls"]} == {("fused", False, 3), ("unfused", False, 3), ("fused", True, 3),
                                               ("unfused", True, 3)}
    for r in data["results"]:
        for name in data["config"]["impls"]:
            assert r["checks"][name]["ok"] and r["checks"][name]["nan_count"] == 0, (name, r["checks"])
            assert r["ms"][name] == 1.0 and r["gbps"][name] == pytest.approx(r["bytes"] / 1e-3 / 1e9)
            assert r["frac_copy"][name] == pytest.approx(r["gbps"][name] / data["copy"]["gbps"])
        for peer in ("flash", "cudnn"):   # whatever CPU SDPA does: a time with a passing check, or a reason
            if r["ms"][peer] is None:
                assert r["errors"][peer]
                assert all(x[peer] is None for x in r["ratio"].values())
            else:
                assert r["checks"][peer]["ok"] and r["sdpa_call"][peer]
                assert r["ratio"]["attngen-fused"][peer] == pytest.approx(1.0)
    assert "target attngen-fused: never slower than SDPA flash" in out
    assert "checks (attngen vs fp32, NaN-poisoned out): 16 run, 0 failed" in out
    md = (tmp_path / "d.md").read_text()
    assert md.count("| b=2 L=") == 4
    if data["results"][1]["sdpa_call"].get("flash"):
        assert "SDPA call forms for q_len > 1: flash: " in md


def test_decode_simulated_nan_and_memory_skip(decode_sim, tmp_path, capsys):
    decode_sim["nan"] = True
    need64 = decode_bench.decode_mem_need(decode_bench.DecodeShape("bf16", 2, 64, 1, 8, 2, 64), unfused=True)
    decode_sim["free"] = need64 + 1          # the 64-key shape fits, the 100-key one does not
    rc = bench.main(DSIM + ["--variant", "both", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1                           # the unfused row leaves head 0 unwritten
    data = json.loads((tmp_path / "bench_decode.json").read_text())
    first, second = data["results"]
    assert first["checks"]["attngen-fused"]["ok"]
    assert not first["checks"]["attngen-unfused"]["ok"] and first["checks"]["attngen-unfused"]["nan_count"] > 0
    assert second["skipped"].startswith("needs ~")
    assert "skipped:" in out and "FAIL" in out


def test_decode_sweep_leaves_partial_json_when_cut_short(decode_sim, tmp_path):
    decode_sim["interrupt_at"] = 5    # an untimed warm-up pass (2 calls), then 2 calls per shape: dies in the second shape
    p = tmp_path / "bench_decode.json"
    assert bench.main(DSIM + ["--out", str(tmp_path)]) == 130
    data = json.loads(p.read_text())
    assert not data["complete"] and len(data["results"]) == 1
    assert "Partial run" in decode_report.decode_markdown(data)


def test_decode_rotate_simulated(decode_sim, monkeypatch, tmp_path, capsys):
    """--rotate's plumbing: one graph per row over N copies, each call on its own K/V, ms per call."""
    graphs = []

    def fake_graphed(*fns):
        graphs.append([f.keywords.get("kk", f.keywords.get("kt")) for f in fns])
        return lambda: [f() for f in fns]

    def fake_event_bench(fn, warmup_ms, rep_ms, reps, flush=True):
        assert not flush
        fn()
        return 6.0

    monkeypatch.setattr(core, "_graphed", fake_graphed)
    monkeypatch.setattr(core, "_event_bench", fake_event_bench)
    monkeypatch.setattr(decode_bench, "ROTATE_BYTES", 3 * 2**16)   # 3 copies of the 64-key cache, 2 of the 100-key one
    p = tmp_path / "bench_decode.json"
    rc = bench.main(DSIM + ["--rotate", "--paged", "--block-size", "16", "--out", str(tmp_path), "--markdown",
                            str(tmp_path / "d.md")])
    out = capsys.readouterr().out
    assert rc == 0, out
    data = json.loads(p.read_text())
    assert data["config"]["rotate"] is True and data["config"]["graph"] is True
    assert [r["bytes"] for r in data["results"]] == [2**16, 100 * 2**10]
    assert [r["rotate"] for r in data["results"]] == [3, 2]
    for r in data["results"]:
        assert r["timer"] == f"cuda-events, no flush, {r['rotate']} calls over {r['rotate']} K/V copies per " \
                             "CUDA-graph replay"
        for name in ("attngen", "attngen-paged"):
            assert r["checks"][name]["ok"] and r["ms"][name] == pytest.approx(6.0 / r["rotate"])
        for peer in ("flash", "cudnn"):
            assert r["ms"][peer] is None or r["ms"][peer] == pytest.approx(6.0 / r["rotate"])
    assert graphs and all(len(g) in (3, 2) for g in graphs)
    for g in graphs:                                             # every call reads its own copy
        assert len({t.data_ptr() for t in g}) == len(g)
    assert "own K/V copy (2..3 per shape)" in (tmp_path / "d.md").read_text()


def test_decode_needs_a_gpu_message(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["decode", "--quick"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_decode_help_runs_from_a_checkout():
    r = subprocess.run([sys.executable, "-m", "attngen", "bench", "decode", "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--markdown" in r.stdout and "--paged" in r.stdout


# --- on the GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_decode_bench_small_on_gpu(tmp_path, capsys):
    pytest.importorskip("torch")
    p = tmp_path / "bench_decode.json"
    rc = bench.main(["decode", "--heads", "32/8", "--batches", "1,16", "--kv-lens", "1000,4k", "--variant", "both",
                     "--paged", "--warmup-ms", "5", "--rep-ms", "20", "--out", str(tmp_path), "--markdown",
                     str(tmp_path / "d.md")])
    data = json.loads(p.read_text())
    assert data["complete"] and len(data["results"]) == 4
    assert data["copy"]["gbps"] > 100
    for r in data["results"]:
        for name in data["config"]["impls"]:
            assert r["checks"][name]["nan_count"] == 0 and r["checks"][name]["ok"], (name, r["checks"])
            assert r["gbps"][name] and r["gbps"][name] > 1
        assert set(r["ms"]) >= {"flash", "cudnn"}
    assert rc == 0
    assert "target attngen-fused: never slower than SDPA flash" in capsys.readouterr().out


@pytest.mark.gpu
def test_decode_bench_rotate_on_gpu(tmp_path):
    pytest.importorskip("torch")
    p = tmp_path / "bench_decode.json"
    rc = bench.main(["decode", "--heads", "32/8", "--batches", "1", "--kv-lens", "1k", "--paged", "--rotate",
                     "--warmup-ms", "5", "--rep-ms", "20", "--out", str(tmp_path)])
    data = json.loads(p.read_text())
    assert rc == 0 and data["complete"] and data["config"]["rotate"]
    (r,) = data["results"]
    assert r["rotate"] == decode_bench.rotate_copies(r["bytes"]) == 50       # 4 MiB of K+V: 50 copies
    assert "50 calls over 50 K/V copies" in r["timer"]
    for name in ("attngen", "attngen-paged", "flash", "cudnn"):
        if name in r["errors"]:
            assert not name.startswith("attngen"), r["errors"]
            continue
        assert r["ms"][name] > 0 and r["checks"][name]["ok"], (name, r)


def test_decode_read_column_and_target():
    # A rotated run times the bare read of each shape's bytes: %read is its time over the row's, and every
    # shape's attngen row is held to 90% of it; runs without the read show "—" and no such target.
    recs = [fake_decode_record(a=1.0, flash=1.2, cudnn=1.1), fake_decode_record(batch=1, kv_len=8192, a=0.02,
                                                                               flash=0.03, cudnn=0.021)]
    recs[0]["read_ms"], recs[1]["read_ms"] = 0.97, 0.0144
    rows = decode_report.decode_text_rows(recs[0], ["flash", "cudnn"])
    assert " 97.0 " in rows[0] and " 80.8 " in rows[1]          # attngen 0.97 / 1.0; flash 0.97 / 1.2
    summ = decode_report.decode_summary(recs, ["flash", "cudnn"])
    t = {x["target"]: x for x in summ["impls"]["attngen"]["targets"]}["read"]
    assert t["verdict"] == "MISSED" and t["worst"] == pytest.approx(0.72) and t["worst_at"].startswith("b=1 L=8k")
    assert any("90% of the bare read's speed on every shape" in ln and "MISSED (worst 72.0% at b=1 L=8k" in ln
               for ln in decode_report.decode_summary_lines(summ))
    del recs[1]["read_ms"]
    assert {x["target"]: x for x in decode_report.decode_summary(recs[1:], ["flash"])["impls"]["attngen"]["targets"]
            }.keys() == {"copy", "cudnn_b1_32k", "flash"}
    assert decode_report.decode_text_rows(recs[1], ["flash"])[0].split()[10] == "—"
    md = decode_report.decode_markdown({**fake_decode_data(), "config": {"rotate": True, "backends": ["flash"]},
                                        "results": recs})
    assert "- %read (rotated runs only) = the bare read's time" in md and "| %read |" in md
