"""Issue 55's last refusals, now served, against the fp32 references (pytest -m gpu):

- head dims up to 256 that no kernel is built for (59, 111, 33, 24, 255; v alone 57), on zero-padded copies,
  through attngen.prefill, prefill_varlen (contiguous and paged), decode and flash_attn_with_kvcache (the append
  landing in the caller's cache), with the caller's ``out`` where the op takes one;
- paged blocks past 256 positions (272, 512, 1024) in decode (split-KV, windows) and prefill_varlen;
- more than 8 new tokens with causal=False (windows, ALiBi) where no paged prefill route reads the cache: a
  contiguous cache with left pads, rows not whole 16-position blocks apart, rows chosen by cache_batch_idx (the
  varlen kernel over the rows laid end to end), and a paged cache with left pads (decode calls of 8 tokens).

Cache positions outside a row's keys (past its length, before its left pad) and blocks no table names are NaN, so
a stray read turns the output NaN; outputs are poisoned with NaN first where the call takes ``out``.
"""

from __future__ import annotations

import itertools

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]
torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.kvcache import packed_limit  # noqa: E402
from tests.gpu_reference import (check_output_and_lse, fresh_generator, reference_attention,  # noqa: E402
                                 reference_decode, rel)
from tests.test_gpu_kvcache_options import fill, i32, nan_cache, rnd  # noqa: E402

TOL = 2e-2
MODS = {"plain": (0.0, False), "softcap": (20.0, False), "alibi": (0.0, True)}


# ---- head dims on a zero-padded copy ------------------------------------------------------------------------

@pytest.mark.parametrize("d,dv", [(59, 59), (111, 111), (33, 33), (24, 24), (255, 255), (64, 57), (120, 71)])
@pytest.mark.parametrize("mask,mods", [("none", "plain"), ("causal", "softcap"), ("window", "alibi")])
def test_padded_head_dims_dense(cache_dir, d, dv, mask, mods):
    gen = fresh_generator()
    b, sq, sk, h, hk = 2, 203, 317, 6, 2
    dtype = torch.float16 if d % 2 else torch.bfloat16
    q, k, v = rnd(b, sq, h, d, gen=gen, dtype=dtype), rnd(b, sk, hk, d, gen=gen, dtype=dtype), \
        rnd(b, sk, hk, dv, gen=gen, dtype=dtype)
    cap, alibi = MODS[mods]
    slopes = torch.rand(b, h, device="cuda", generator=gen) * 0.3 if alibi else None
    causal, window = mask == "causal", ((60, 17) if mask == "window" else (-1, -1))
    out = torch.full((b, sq, h, dv), float("nan"), device="cuda", dtype=dtype)
    o, lse = attngen.prefill(q, k, v, causal=causal, window=window, softcap=cap, alibi_slopes=slopes, out=out,
                             return_lse=True)
    ref, ref_lse = reference_attention(q, k, v, causal=causal, window=window, softcap=cap, alibi_slopes=slopes)
    assert o is out and torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)
    # Without out: a view of the padded output's real columns, the same values.
    o2, lse2 = attngen.prefill(q, k, v, causal=causal, window=window, softcap=cap, alibi_slopes=slopes,
                               return_lse=True)
    assert o2.shape == (b, sq, h, dv) and torch.equal(o2, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("d", [59, 111])
@pytest.mark.parametrize("block_size", [None, 48, 512])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_head_dims_varlen(cache_dir, d, block_size, causal):
    gen = fresh_generator()
    lens_q, lens_k, h, hk = [77, 0, 130], [203, 40, 600], 4, 2
    b = len(lens_q)
    cu_q = i32([0, *itertools.accumulate(lens_q)])
    cu_k = i32([0, *itertools.accumulate(lens_k)])
    q = rnd(sum(lens_q), h, d, gen=gen)
    if block_size:
        per = -(-max(lens_k) // block_size)
        kc, vc, table = nan_cache(b, per * block_size, hk, d, True, block_size, gen)
        fill(kc, vc, table, lens_k, gen)
        k_of = [kc[table[s].long()].reshape(-1, hk, d)[:n] for s, n in enumerate(lens_k)]
        v_of = [vc[table[s].long()].reshape(-1, hk, d)[:n] for s, n in enumerate(lens_k)]
        o = attngen.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           block_table=table)
    else:
        k, v = rnd(sum(lens_k), hk, d, gen=gen), rnd(sum(lens_k), hk, d, gen=gen)
        k_of = [k[a:a + n] for a, n in zip(itertools.accumulate([0, *lens_k]), lens_k)]
        v_of = [v[a:a + n] for a, n in zip(itertools.accumulate([0, *lens_k]), lens_k)]
        o = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    assert o.shape == (sum(lens_q), h, d) and torch.isfinite(o).all()
    q0 = 0
    for s, n in enumerate(lens_q):
        if n:
            ref, _ = reference_attention(q[None, q0:q0 + n], k_of[s][None], v_of[s][None], causal=causal)
            assert rel(o[None, q0:q0 + n], ref) < TOL, (s, n)
        q0 += n


@pytest.mark.parametrize("d", [59, 111, 24])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_len", [1, 3])
def test_padded_head_dims_decode(cache_dir, d, paged, q_len):
    gen = fresh_generator()
    b, hk, g, cap = 3, 2, 4, 1024
    ends = [q_len, 300, 1024]
    kc, vc, table = nan_cache(b, cap, hk, d, paged, 64, gen)
    fill(kc, vc, table, ends, gen)
    q = rnd(b, q_len, hk * g, d, gen=gen)
    out = torch.full_like(q, float("nan"))
    o, lse = attngen.decode(q, kc, vc, cache_seqlens=i32(ends), block_table=table, out=out, return_lse=True)
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table)
    assert o is out and torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_new", [1, 3, 12])
@pytest.mark.parametrize("causal", [True, False])
def test_padded_head_dim_kvcache_appends_to_the_callers_cache(cache_dir, paged, n_new, causal):
    gen = fresh_generator()
    b, hk, g, d, cap = 2, 2, 3, 59, 512
    old = [17, 400]
    kc, vc, table = nan_cache(b, cap, hk, d, paged, 32, gen)
    fill(kc, vc, table, old, gen)
    q = rnd(b, n_new, hk * g, d, gen=gen)
    kn, vn = rnd(b, n_new, hk, d, gen=gen), rnd(b, n_new, hk, d, gen=gen)
    o, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=i32(old), block_table=table,
                                             causal=causal, return_softmax_lse=True)
    for i, n in enumerate(old):  # the new tokens are in the caller's cache, where the row ended
        pos = torch.arange(n, n + n_new, device="cuda")
        at = (table[i].long()[pos // 32], pos % 32) if paged else (i, pos)
        assert torch.equal(kc[at], kn[i]) and torch.equal(vc[at], vn[i])
    ends = [n + n_new for n in old]
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table, causal=causal)
    assert o.shape == q.shape and torch.isfinite(o).all()
    check_output_and_lse(o, lse, ref, ref_lse, TOL)


# ---- paged blocks past 256 positions --------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [272, 512, 1024])
@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("window", [(-1, -1), (300, 0)])
@pytest.mark.parametrize("q_len", [1, 4])
def test_decode_blocks_past_256(cache_dir, block_size, num_splits, window, q_len):
    gen = fresh_generator()
    b, hk, g, d = 3, 2, 4, 128
    cap = 3 * block_size
    ends = [q_len, block_size + 7, cap]
    kc, vc, table = nan_cache(b, cap, hk, d, True, block_size, gen)
    fill(kc, vc, table, ends, gen)
    q = rnd(b, q_len, hk * g, d, gen=gen)
    out = torch.full_like(q, float("nan"))
    attngen.decode(q, kc, vc, cache_seqlens=i32(ends), block_table=table, num_splits=num_splits, window=window,
                   out=out)
    ref, _ = reference_decode(q, kc, vc, ends, block_table=table, window=window)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL


@pytest.mark.parametrize("block_size", [272, 512, 1024])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_varlen_blocks_past_256(cache_dir, block_size, causal):
    gen = fresh_generator()
    lens_q, lens_k, h, hk, d = [100, 1, 513], [1000, 40, 2 * block_size + 5], 4, 2, 128
    b = len(lens_q)
    per = -(-max(lens_k) // block_size)
    kc, vc, table = nan_cache(b, per * block_size, hk, d, True, block_size, gen)
    fill(kc, vc, table, lens_k, gen)
    q = rnd(sum(lens_q), h, d, gen=gen)
    cu_q, cu_k = i32([0, *itertools.accumulate(lens_q)]), i32([0, *itertools.accumulate(lens_k)])
    out = torch.full_like(q, float("nan"))
    attngen.prefill_varlen(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, block_table=table,
                           out=out)
    assert torch.isfinite(out).all()
    q0 = 0
    for s, (n, nk) in enumerate(zip(lens_q, lens_k)):
        kk = kc[table[s].long()].reshape(-1, hk, d)[:nk]
        vv = vc[table[s].long()].reshape(-1, hk, d)[:nk]
        ref, _ = reference_attention(q[None, q0:q0 + n], kk[None], vv[None], causal=causal)
        assert rel(out[None, q0:q0 + n], ref) < TOL, s
        q0 += n


# ---- more than 8 new tokens without causality, where no paged prefill route reads the cache ----------------------

LAYOUTS = {  # (paged, capacity, left pads, cache rows by index)
    "contiguous, rows of 200": (False, 200, False, False),
    "contiguous, left pads": (False, 256, True, False),
    "contiguous, left pads, rows by index": (False, 200, True, True),
    "paged, left pads": (True, 256, True, False),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("n_new", [12, 40])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (False, (20, 5)), (False, (-1, 0)), (False, (7, 60)),
                                           (True, (-1, -1)), (True, (30, 0))])
@pytest.mark.parametrize("alibi", [False, True])
def test_many_new_tokens_without_a_paged_prefill_route(cache_dir, layout, n_new, causal, window, alibi):
    paged, cap, with_pads, by_index = LAYOUTS[layout]
    gen = fresh_generator()
    b, hk, g, d = 3, 2, 4, 64
    old = [0, 90, cap - n_new - 3]
    pads = [0, 33, 9] if with_pads else None
    rows = [2, 0, 1] if by_index else None
    kc, vc, table = nan_cache(b, cap, hk, d, paged, 32, gen)
    if rows is None:
        fill(kc, vc, table, old, gen, pads)
    else:  # row i of the batch lives in cache row rows[i]
        for i, (r, n) in enumerate(zip(rows, old)):
            lo = pads[i] if pads else 0
            kc[r, lo:n] = rnd(max(n - lo, 0), hk, d, gen=gen)
            vc[r, lo:n] = rnd(max(n - lo, 0), hk, d, gen=gen)
    q = rnd(b, n_new, hk * g, d, gen=gen)
    kn, vn = rnd(b, n_new, hk, d, gen=gen), rnd(b, n_new, hk, d, gen=gen)
    slopes = torch.rand(b, hk * g, device="cuda", generator=gen) * 0.3 if alibi else None
    kw = dict(k=kn, v=vn, cache_seqlens=i32(old), block_table=table, cache_leftpad=i32(pads) if pads else None,
              cache_batch_idx=i32(rows) if rows else None, causal=causal, window_size=window, alibi_slopes=slopes,
              return_softmax_lse=True)
    right = 0 if causal else window[1]
    # the one refusal left: ALiBi, keys after a token's own, paged left pads, rows past the packed decode route's
    if paged and alibi and right != 0 and n_new > packed_limit(hk * g, hk):
        with pytest.raises(attngen.LaunchError, match="and alibi_slopes is not supported with cache_leftpad"):
            attngen.flash_attn_with_kvcache(q, kc, vc, **kw)
        return
    o, lse = attngen.flash_attn_with_kvcache(q, kc, vc, **kw)
    ends = [n + n_new for n in old]
    ref, ref_lse = reference_decode(q, kc, vc, ends, cache_batch_idx=rows, block_table=table, causal=causal,
                                    window=window, cache_leftpad=pads, alibi_slopes=slopes)
    assert o.shape == q.shape and torch.isfinite(o).all()
    check_output_and_lse(o, lse, ref, ref_lse, TOL)
