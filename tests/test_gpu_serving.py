"""attngen.BatchAttention on a real GPU: a serving step's ragged batch (decode, verify under tree masks, chunked
prefill, empty requests) against fp32 attention per request (pytest -m gpu). Fresh random inputs, outputs
poisoned with NaN first; a graph replay with new lengths."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.serving_reference import MAX_ABS, check, make_step, reference, tree_words  # noqa: E402


def mixed_step(gen, h, hk, d, page, dtype, with_tree):
    """Decode rows (1 token), an empty request, verify rows (5 and 8 tokens), chunked-prefill rows (9..700 tokens)
    on a paged cache: make_step's tensors, the lengths, and a random tree over each request of up to 8 tokens."""
    q_lens = [1, 1, 0, 5, 1, 8, 300, 1, 9, 700, 5, 1]
    lens = [700, 33, 90, 1200, 17, 8, 2000, 5000, 9, 700, 64, 1]
    tensors = make_step(gen, q_lens, lens, h, hk, d, page, dtype)
    tree = None
    if with_tree:
        words = []
        for n in q_lens:
            words += tree_words(n, gen, "cuda") if n <= 8 else [0] * n
        tree = torch.tensor(words, dtype=torch.int64, device="cuda")
    return (*tensors, q_lens, lens, tree)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,hk,d,page", [(32, 8, 128, 16), (8, 8, 64, 64), (16, 2, 128, 64), (16, 4, 128, 1)])
@pytest.mark.parametrize("with_tree", [False, True])
def test_mixed_step_matches_attention_per_request(dtype, h, hk, d, page, with_tree):
    q, kc, vc, table, cu, cache_lens, q_lens, lens, tree = mixed_step(fresh_generator(), h, hk, d, page, dtype,
                                                                      with_tree)
    ba = attngen.BatchAttention(h, hk, d, page, dtype=dtype)
    ba.plan(cu, cache_lens, table, total_q=q.shape[0])
    out = torch.full_like(q, float("nan"))
    o, lse = ba.run(q, kc, vc, tree_mask=tree, out=out, return_lse=True)
    assert o is out
    ref_o, ref_l = reference(q, kc, vc, table, q_lens, lens, d ** -0.5, tree, 8)
    check(o, lse, ref_o, ref_l, dtype)


def test_every_option_at_its_default():
    gen = fresh_generator()
    q_lens, lens = [1, 3, 40], [100, 300, 40]
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, 32, 8, 128, 16, torch.bfloat16)
    o = attngen.BatchAttention(32, 8, 128, 16).plan(cu, cache_lens, table, total_q=q.shape[0]).run(q, kc, vc)
    ref_o, _ = reference(q, kc, vc, table, q_lens, lens, 128 ** -0.5)
    assert (o.float() - ref_o).abs().max().item() < MAX_ABS[torch.bfloat16]


def test_sinks_and_a_longer_decode_bound():
    gen = fresh_generator()
    dtype = torch.bfloat16
    q_lens, lens = [1, 16, 17, 2], [4096, 4100, 300, 2]
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, 16, 4, 128, 64, dtype)
    sinks = torch.randn(16, device="cuda", generator=gen)
    ba = attngen.BatchAttention(16, 4, 128, 64, dtype=dtype, max_decode_q_len=16)
    o, lse = ba.plan(cu, cache_lens, table, total_q=q.shape[0]).run(q, kc, vc, sinks=sinks, return_lse=True)
    ref_o, ref_l = reference(q, kc, vc, table, q_lens, lens, 128 ** -0.5, sinks=sinks)
    check(o, lse, ref_o, ref_l, dtype)


def test_graph_replay_with_new_lengths():
    gen = fresh_generator()
    dtype, h, hk, d, page = torch.bfloat16, 32, 8, 128, 16
    q_lens, lens = [1, 5, 1, 600], [3000, 400, 20, 1500]
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, h, hk, d, page, dtype)
    ba = attngen.BatchAttention(h, hk, d, page, dtype=dtype)
    out = torch.empty_like(q)
    ba.plan(cu, cache_lens, table, total_q=q.shape[0]).run(q, kc, vc, out=out)  # loads the kernels
    replay_with_new_lengths(ba, q, (kc, vc), (kc, vc), table, cu, cache_lens, out, gen,
                            (([1, 5, 1, 600], [3000, 400, 20, 1500]), ([300, 1, 300, 6], [300, 2999, 1000, 7]),
                             ([0, 1, 606, 0], [0, 1, 606, 5])))


def replay_with_new_lengths(ba, q, caches, values, table, cu, cache_lens, out, gen, steps, **run_kw):
    """The step (plan and run over ``caches``) captured in a graph, then replayed with each of ``steps``' (q_lens,
    lens) written into the plan's tensors and a fresh q; each against fp32 attention over ``values`` (what the
    caches stand for)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.plan(cu, cache_lens, table, total_q=q.shape[0])
        ba.run(q, *caches, out=out, **run_kw)
    for q_lens2, lens2 in steps:
        cu.copy_(torch.tensor([0] + list(torch.tensor(q_lens2).cumsum(0)), dtype=torch.int32))
        cache_lens.copy_(torch.tensor(lens2, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_o, _ = reference(q, *values, table, q_lens2, lens2, q.shape[-1] ** -0.5)
        n = sum(q_lens2)
        assert not torch.isnan(out[:n]).any()
        assert (out[:n].float() - ref_o).abs().max().item() < MAX_ABS[q.dtype]


FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def fp8_cache(c, scale, fmt):
    """c quantised (c / scale, saturating as the engines do) and the values it stands for (its dequantised copy)."""
    dt = FP8[fmt]
    top = torch.finfo(dt).max
    c8 = (c.float() / scale).clamp(-top, top).to(dt)
    return c8, c8.float() * scale


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("h,hk,d,page", [(32, 8, 128, 16), (16, 2, 128, 64), (8, 8, 64, 1)])
@pytest.mark.parametrize("with_tree", [False, True])
def test_fp8_cache_step_matches_attention_per_request(fmt, h, hk, d, page, with_tree):
    """A mixed step over an fp8 cache (both kernels widen its tiles), against fp32 attention on the values the
    cache stands for; per-tensor scales."""
    dtype = torch.bfloat16
    q, kc, vc, table, cu, cache_lens, q_lens, lens, tree = mixed_step(fresh_generator(), h, hk, d, page, dtype,
                                                                      with_tree)
    ks, vs = 0.02, 0.05
    k8, kdq = fp8_cache(kc, ks, fmt)
    v8, vdq = fp8_cache(vc, vs, fmt)
    ba = attngen.BatchAttention(h, hk, d, page, dtype=dtype, kv_dtype=FP8[fmt])
    ba.plan(cu, cache_lens, table, total_q=q.shape[0])
    out = torch.full_like(q, float("nan"))
    o, lse = ba.run(q, k8, v8, tree_mask=tree, out=out, return_lse=True, k_scale=ks, v_scale=vs)
    assert o is out
    ref_o, ref_l = reference(q, kdq, vdq, table, q_lens, lens, d ** -0.5, tree, 8)
    check(o, lse, ref_o, ref_l, dtype)


def test_fp8_cache_step_per_head_scales_bytes_and_graph_replay():
    """Scales per KV head as device tensors, the cache as uint8 bytes, fp16 q; then the step captured in a graph and
    replayed with new lengths."""
    gen = fresh_generator()
    dtype, h, hk, d, page = torch.float16, 32, 8, 128, 16
    q_lens, lens = [1, 5, 1, 600], [3000, 400, 20, 1500]
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, h, hk, d, page, dtype)
    ks = torch.rand(hk, device="cuda", generator=gen) * 0.05 + 0.01
    vs = torch.rand(hk, device="cuda", generator=gen) * 0.05 + 0.01
    k8, _ = fp8_cache(kc / ks[:, None], 1.0, "e4m3")
    v8, _ = fp8_cache(vc / vs[:, None], 1.0, "e4m3")
    kdq, vdq = k8.float() * ks[:, None], v8.float() * vs[:, None]
    ba = attngen.BatchAttention(h, hk, d, page, dtype=dtype, kv_dtype="fp8_e4m3")
    kb, vb = k8.view(torch.uint8), v8.view(torch.uint8)
    out = torch.full_like(q, float("nan"))
    ba.plan(cu, cache_lens, table, total_q=q.shape[0]).run(q, kb, vb, out=out, k_scale=ks, v_scale=vs)
    ref_o, _ = reference(q, kdq, vdq, table, q_lens, lens, d ** -0.5)
    assert (out.float() - ref_o).abs().max().item() < MAX_ABS[dtype]
    replay_with_new_lengths(ba, q, (kb, vb), (kdq, vdq), table, cu, cache_lens, out, gen,
                            (([300, 1, 300, 6], [300, 2999, 1000, 7]), ([0, 1, 606, 0], [0, 1, 606, 5])),
                            k_scale=ks, v_scale=vs)


def test_fp8_cache_mismatches_are_refused_by_name():
    gen = fresh_generator()
    q, kc, vc, table, cu, cache_lens = make_step(gen, [1, 20], [50, 60], 32, 8, 128, 16, torch.bfloat16)
    k8, _ = fp8_cache(kc, 0.1, "e4m3")
    plain = attngen.BatchAttention(32, 8, 128, 16).plan(cu, cache_lens, table, total_q=q.shape[0])
    with pytest.raises(attngen.LaunchError, match="k_cache has dtype torch.float8_e4m3fn.*kv_dtype"):
        plain.run(q, k8, k8, k_scale=0.1)
    with pytest.raises(attngen.LaunchError, match="k_scale and v_scale are for an fp8 cache"):
        plain.run(q, kc, vc, k_scale=0.1)
    e5 = attngen.BatchAttention(32, 8, 128, 16, kv_dtype=torch.float8_e5m2).plan(cu, cache_lens, table,
                                                                                 total_q=q.shape[0])
    with pytest.raises(attngen.LaunchError, match="k_cache has dtype torch.float8_e4m3fn"):
        e5.run(q, k8, k8)
    with pytest.raises(attngen.LaunchError, match="k_cache has dtype torch.bfloat16"):
        e5.run(q, kc, vc)


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(attngen.LaunchError, match="num_kv_heads"):
        attngen.BatchAttention(32, 5, 128, 16)
    with pytest.raises(attngen.LaunchError, match="page_size"):
        attngen.BatchAttention(32, 8, 128, 0)
    with pytest.raises(attngen.LaunchError, match="max_decode_q_len"):
        attngen.BatchAttention(32, 8, 128, 16, max_decode_q_len=64)
    ba = attngen.BatchAttention(32, 8, 128, 16)
    q = torch.zeros(4, 32, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(attngen.LaunchError, match="before plan"):
        ba.run(q, q, q)


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("h,hk,short", [(32, 8, 4), (32, 4, 2), (32, 1, 1)])
def test_verify_requests_forked_onto_a_side_stream(graphed, h, hk, short):
    """Where max_decode_q_len's rows need a larger CTA than a one-token request's, the requests of more than
    short_q_len tokens run in a second decode launch on a side stream: run on a stream of the caller's, captured
    in a graph and replayed, every request's rows and LSE are the step's (trees over the requests of both
    launches)."""
    gen = fresh_generator()
    dtype, d, page = torch.bfloat16, 128, 16
    q_lens, lens = [1, 5, 0, 1, 900, short, short + 1, 3], [3000, 400, 7, 20, 1500, 64, 2200, 3]
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, h, hk, d, page, dtype)
    group = h // hk
    most = min(8, 128 // group)
    words = []
    for n in q_lens:
        words += tree_words(n, gen, "cuda") if n <= most else [0] * n
    tree = torch.tensor(words, dtype=torch.int64, device="cuda")
    ba = attngen.BatchAttention(h, hk, d, page, dtype=dtype, max_decode_q_len=most)
    assert ba.short_q_len == short
    ba.plan(cu, cache_lens, table, total_q=q.shape[0])
    out = torch.full_like(q, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        if graphed:
            ba.run(q, kc, vc, tree_mask=tree, out=out, return_lse=True)
            stream.synchronize()
            out.fill_(float("nan"))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                o, lse = ba.run(q, kc, vc, tree_mask=tree, out=out, return_lse=True)
            lse.fill_(float("nan"))
            graph.replay()
        else:
            o, lse = ba.run(q, kc, vc, tree_mask=tree, out=out, return_lse=True)
        # on the caller's stream, after the join: every row is written
        done = torch.isnan(out).sum()
    torch.cuda.synchronize()
    assert done.item() == 0
    ref_o, ref_l = reference(q, kc, vc, table, q_lens, lens, d ** -0.5, tree, most)
    check(o, lse, ref_o, ref_l, dtype)


def test_bench_step_times_its_serial_bound():
    """bench step's serial bound: the decode and verify requests' pages read bare plus the prefill call alone, each
    timed, and the bound the separate calls' time over their sum; the step is checked against the separate calls."""
    import argparse

    from attngen.bench import step

    args = argparse.Namespace(decode=6, verify=2, draft=3, prefill=1, chunk=300, cached=700, keys="100,3000",
                              rep_ms=10.0, seed=0, kv_dtype="bf16", no_flashinfer=True)
    rec = step.measure(args)
    ms = rec["ms"]
    assert ms["bare_read_decode_pages"] > 0 and ms["prefill_alone"] > 0
    assert ms["bare_read_decode_pages"] <= ms["bare_read_all_pages"] * 1.5
    assert rec["serial_bound"] == pytest.approx(ms["separate"] / (ms["bare_read_decode_pages"] + ms["prefill_alone"]))
    assert rec["prefill_tflops"] > 0
    assert all(c["ok"] for c in rec["checks"].values()), rec["checks"]
    no_prefill = step.measure(argparse.Namespace(**{**vars(args), "prefill": 0}))
    assert "prefill_alone" not in no_prefill["ms"] and no_prefill["prefill_tflops"] is None
    assert no_prefill["serial_bound"] == pytest.approx(no_prefill["ms"]["separate"]
                                                       / no_prefill["ms"]["bare_read_decode_pages"])
