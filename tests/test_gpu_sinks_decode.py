"""Attention sinks in attngen.decode and flash_attn_with_kvcache on a real GPU against the fp32 reference
(pytest -m gpu): the sink is one more logit column of each query head's softmax whose probability is dropped.

Every route a sink joins through: one split (the epilogue), several (the merge launch; on sm_90 the cluster
merge), the unfused kernels, contiguous and paged caches, GQA packing and MHA, head dims 64, 128 and 512 (two
CTAs a KV head), with softcap, ALiBi and windows, cache_batch_idx, return_lse, and the KV-cache call with and
without appended tokens. Sinks per head: ordinary logits, one far above every score (the keys' share of the
denominator ~1e-15: an exp of the sink relative to the keys' max would overflow), and -inf (no sink). Caches are
NaN past every row's keys (tests/test_gpu_decode.Case), outputs NaN before the launch; rows with no key give
zeros and LSE = their sink.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]
torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import check_output_and_lse, fresh_generator, reference_decode  # noqa: E402
from tests.test_gpu_decode import MAX_ABS, NAN, TOL, Case  # noqa: E402

# More than 30 above every scaled score here: unit-normal q and k give scores of about N(0, 1), |s| < 7.
LARGE = 40.0
LENGTHS = [0, 1, 3, 17, 129, 1000, 3001]  # a row of no key, rows shorter than q_len, tile edges, long rows


def sinks_for(heads: int, gen=None):
    """fp32 [heads]: N(0, 2^2) logits, LARGE at heads 1, 5, 9, ... and -inf at heads 2, 6, 10, ..."""
    s = torch.randn(heads, device="cuda", generator=fresh_generator() if gen is None else gen) * 2
    s[1::4] = LARGE
    s[2::4] = float("-inf")
    return s


def check(case, o, lse, sinks, **ref_kw):
    """out and lse against the reference with the sinks; tokens with no key give zeros and LSE = their sink."""
    b, ql, h, d = case.q.shape
    ref_o, ref_l = reference_decode(case.q, case.k_cache, case.v_cache, case.seqlens,
                                    cache_batch_idx=case.cache_batch_idx, block_table=case.block_table,
                                    sinks=sinks, **ref_kw)
    at = f"lengths {case.lengths}, seed {case.seed}"
    assert torch.isfinite(o).all(), f"unwritten (NaN) or non-finite outputs; {at}"
    assert lse.shape == (b, h, ql) and not torch.isnan(lse).any(), at
    check_output_and_lse(o, lse, ref_o, ref_l, TOL[case.dtype])
    mx = (o.float() - ref_o).abs().max().item()
    assert mx < MAX_ABS[case.dtype], f"max abs error {mx:.3e}; {at}"
    if "window" not in ref_kw and "cache_leftpad" not in ref_kw:
        for i, n in enumerate(case.lengths):
            for t in range(ql):
                if n - ql + t < 0:  # token t of row i sees no key
                    assert (o[i, t] == 0).all(), (i, t, at)
                    fin = torch.isfinite(sinks)
                    assert torch.equal(lse[i, :, t][fin], sinks[fin]) and (lse[i, :, t][~fin] == -float("inf")).all()
    big = sinks == LARGE
    if big.any():  # the keys' share of those heads' denominators is ~exp(-30): their outputs ~0
        assert o[:, :, big].float().abs().max().item() < 1e-6, at


def run(case, sinks, *, num_splits=0, variant="auto", spec=None, **kw):
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=num_splits,
                            variant=variant, spec=spec, out=out, return_lse=True, sinks=sinks, **kw)
    torch.cuda.synchronize()
    assert o is out
    ref_kw = {k: v for k, v in kw.items() if k in ("sm_scale", "softcap", "alibi_slopes", "window", "cache_leftpad")}
    if "cache_leftpad" in ref_kw:
        ref_kw["cache_leftpad"] = ref_kw["cache_leftpad"].tolist()
    check(case, o, lse, sinks, **ref_kw)
    return o, lse


@pytest.mark.parametrize("layout", [None, 16, 64], ids=["contiguous", "paged16", "paged64"])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_layouts_and_splits(layout, q_len, num_splits):
    # GQA 32/8 at head_dim 128: one split (the epilogue adds the sink), three forced (the merge launch, or on
    # sm_90 the cluster merge), and the automatic count.
    case = Case(LENGTHS, q_len=q_len, heads=32, kv_heads=8, head_dim=128, block_size=layout)
    run(case, sinks_for(32), num_splits=num_splits)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_unfused(paged, num_splits):
    case = Case(LENGTHS, q_len=2, heads=32, kv_heads=8, head_dim=128, block_size=64 if paged else None)
    run(case, sinks_for(32), num_splits=num_splits, variant="unfused")


@pytest.mark.parametrize("d,paged", [(64, False), (512, False), (512, True)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_mha_and_head_dims(d, paged, num_splits):
    # MHA (8 query heads on 8 KV heads); at 512 two CTAs a KV head each normalise half the columns with the sink.
    case = Case([0, 5, 200, 1500], q_len=2, heads=8, kv_heads=8, head_dim=d, block_size=16 if paged else None)
    run(case, sinks_for(8), num_splits=num_splits)


def test_fp16():
    case = Case(LENGTHS, q_len=3, heads=16, kv_heads=4, head_dim=128, dtype=torch.float16)
    for splits in (1, 5):
        run(case, sinks_for(16), num_splits=splits)


def test_cluster_merge_and_merge_launch_agree():
    # sm_90: the splits of a row merge in a cluster (the sink joins in its epilogue); elsewhere, and with the
    # cluster merge off, through the merge launch. Both against the reference and each other.
    from attngen.families.decode import op

    case = Case([0, 1, 17, 129, 1000, 4097, 300, 2000], q_len=2, heads=32, kv_heads=8, head_dim=128)
    sinks = sinks_for(32)
    got = {}
    for cluster in (True, False):
        was = op.set_cluster_merge(op.CLUSTER_MAX if cluster else 0)
        try:
            for splits in (2, 5, 8):
                got[cluster, splits] = run(case, sinks, num_splits=splits)
            calls = [c for c in op._calls.values() if c.grid]
        finally:
            op.set_cluster_merge(was)
        if torch.cuda.get_device_capability() == (9, 0):
            for c in calls:
                fits = c.grid[0] <= op.cluster_limit(c.kern, c.grid[1] * c.grid[2])
                assert bool(c.cluster) == (cluster and fits), (cluster, fits, c.grid, c.cluster)
            assert not cluster or any(c.cluster for c in calls), "no call here took the cluster merge"
    for splits in (2, 5, 8):
        (o1, l1), (o2, l2) = got[True, splits], got[False, splits]
        assert (o1.float() - o2.float()).abs().max().item() < 2e-2
        fin = torch.isfinite(l2)
        assert torch.equal(torch.isfinite(l1), fin) and (l1[fin] - l2[fin]).abs().max().item() < 1e-4


@pytest.mark.parametrize("variant", ["fused", "unfused"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_with_softcap_alibi_window_and_leftpad(variant, num_splits):
    gen = fresh_generator()
    case = Case([3, 300, 1024, 777], q_len=4, heads=8, kv_heads=2, head_dim=128, block_size=64)
    slopes = torch.rand(4, 8, device="cuda", generator=gen) * 0.05
    pads = torch.tensor([0, 17, 650, 700], dtype=torch.int32, device="cuda")
    # (the cache before each pad holds keys the window hides; the reference reads from the pad on)
    run(case, sinks_for(8, gen), num_splits=num_splits, variant=variant, softcap=15.0, alibi_slopes=slopes,
        window=(200, 0), cache_leftpad=pads, sm_scale=0.07)


def test_cache_batch_idx_and_sm_scale():
    case = Case([1, 65, 1000, 129, 4097, 17], q_len=2, heads=32, kv_heads=8, head_dim=128,
                cache_batch_idx=[9, 2, 0, 7, 4, 5], cache_batch=10)
    for scale in (None, 0.3):
        run(case, sinks_for(32), num_splits=0, sm_scale=scale)


def test_every_row_empty():
    case = Case([0, 0, 0], q_len=2, heads=8, kv_heads=2, head_dim=128)
    sinks = sinks_for(8)
    for splits in (1, 3):
        run(case, sinks, num_splits=splits)


def test_a_sinks_spec_and_the_torch_op():
    case = Case([5, 700], q_len=1, heads=32, kv_heads=8, head_dim=128)
    sinks = sinks_for(32)
    run(case, sinks, num_splits=1, spec="decode:head_dim=128,sinks=true")
    import attngen.torch_ops  # noqa: F401

    o, lse = torch.ops.attngen.decode(case.q, case.k_cache, case.v_cache, case.seqlens, 0, None, None, 2, None, True,
                                      "auto", None, 0.0, None, True, -1, -1, None, sinks)
    torch.cuda.synchronize()
    check(case, o, lse, sinks)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("append", [False, True], ids=["cache-only", "append"])
def test_flash_attn_with_kvcache(paged, append):
    gen = fresh_generator()
    b, hk, g, d, n_new = 3, 2, 4, 128, 3
    old = [0, 90, 500]
    case = Case([n + n_new for n in old], q_len=n_new, heads=hk * g, kv_heads=hk, head_dim=d,
                block_size=64 if paged else None, pad=20)
    sinks = sinks_for(hk * g, gen)
    kw = dict(block_table=case.block_table, causal=True, return_softmax_lse=True, sinks=sinks)
    if append:  # the new tokens' k/v written by the call at each row's old length (the cache holds them already:
        # overwritten with themselves, read back from where the append put them)
        kn = torch.stack([_keys(case.k_cache, case.block_table, i, n, n_new) for i, n in enumerate(old)])
        vn = torch.stack([_keys(case.v_cache, case.block_table, i, n, n_new) for i, n in enumerate(old)])
        for c in (case.k_cache, case.v_cache):
            for i, n in enumerate(old):
                _poison(c, case.block_table, i, n, n_new)
        out, lse = attngen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, kn, vn,
                                                   cache_seqlens=torch.tensor(old, dtype=torch.int32, device="cuda"),
                                                   **kw)
    else:
        out, lse = attngen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=case.seqlens,
                                                   **kw)
    torch.cuda.synchronize()
    check(case, out, lse, sinks)


def test_flash_attn_with_kvcache_many_tokens_on_decode_route():
    # 12 new tokens on a paged cache with left pads: decode calls of 8 tokens, each with the sinks.
    gen = fresh_generator()
    case = Case([40, 300], q_len=12, heads=8, kv_heads=2, head_dim=128, block_size=64)
    pads = torch.tensor([0, 30], dtype=torch.int32, device="cuda")
    sinks = sinks_for(8, gen)
    out, lse = attngen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=case.seqlens,
                                               block_table=case.block_table, cache_leftpad=pads, causal=True,
                                               return_softmax_lse=True, sinks=sinks)
    torch.cuda.synchronize()
    check(case, out, lse, sinks, cache_leftpad=[0, 30])


def _keys(cache, table, row, start, n):
    """Positions [start, start + n) of a row of the cache (contiguous, or through the block table)."""
    pos = torch.arange(start, start + n, device="cuda")
    if table is None:
        return cache[row, pos].clone()
    bs = cache.shape[1]
    return cache[table[row].long()[pos // bs], pos % bs].clone()


def _poison(cache, table, row, start, n):
    pos = torch.arange(start, start + n, device="cuda")
    if table is None:
        cache[row, pos] = NAN
    else:
        bs = cache.shape[1]
        cache[table[row].long()[pos // bs], pos % bs] = NAN
