"""Decode's key bounds (sliding window, left pads, several tokens without causality) and the options of
``flash_attn_with_kvcache`` (window_size, cache_leftpad, rotary, more than 8 new tokens, causal=False), against
the fp32 references (pytest -m gpu). Every cache position outside a row's keys (past its length, before its left
pad) and every block no table names is NaN, so a stray read turns the output NaN; outputs are poisoned with NaN
first where the call takes ``out``."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]
torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import (check_output_and_lse, fresh_generator, reference_decode,  # noqa: E402
                                 reference_rotary, rel)

TOL = 2e-2


def rnd(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def nan_cache(b, cap, hk, d, paged, bs, gen, dtype=torch.bfloat16):
    """k and v caches of ``cap`` positions a row, NaN everywhere, and (paged) a table over a shuffled pool
    with spare NaN blocks."""
    if paged:
        per = cap // bs
        kc = torch.full((b * per + 5, bs, hk, d), float("nan"), device="cuda", dtype=dtype)
        table = torch.randperm(b * per + 5, device="cuda", generator=gen)[: b * per].to(torch.int32).reshape(b, per)
        return kc, kc.clone(), table
    kc = torch.full((b, cap, hk, d), float("nan"), device="cuda", dtype=dtype)
    return kc, kc.clone(), None


def fill(kc, vc, table, ends, gen, starts=None):
    """Random keys and values at positions [starts[i], ends[i]) of row i (cache row i, or table row i); the
    rest stays NaN."""
    for i, n in enumerate(ends):
        lo = 0 if starts is None else starts[i]
        if n <= lo:
            continue
        pos = torch.arange(lo, n, device="cuda")
        at = (table[i].long()[pos // kc.shape[1]], pos % kc.shape[1]) if table is not None else (i, pos)
        kc[at] = rnd(n - lo, *kc.shape[2:], gen=gen, dtype=kc.dtype)
        vc[at] = rnd(n - lo, *kc.shape[2:], gen=gen, dtype=kc.dtype)


def i32(xs):
    return torch.tensor(xs, device="cuda", dtype=torch.int32)


# ---- attngen.decode --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 5, 0])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("variant", ["fused", "unfused"])
@pytest.mark.parametrize("window", [(37, 0), (200, 0), (-1, -1)])
@pytest.mark.parametrize("pads", [False, True])
def test_decode_window_and_leftpad(paged, num_splits, q_len, variant, window, pads):
    gen = fresh_generator()
    b, hk, g, d, cap = 4, 2, 4, 128, 1024
    ends = [2, 300, 1024, 777]
    starts = [0, 17, 650, 700] if pads else None
    if window == (-1, -1) and not pads:
        window = (0, 0)  # a window of one key: the narrowest
    kc, vc, table = nan_cache(b, cap, hk, d, paged, 64, gen)
    fill(kc, vc, table, ends, gen, starts)
    q = rnd(b, q_len, hk * g, d, gen=gen)
    out = torch.full_like(q, float("nan"))
    lp = i32(starts) if pads else None
    _, lse = attngen.decode(q, kc, vc, cache_seqlens=i32(ends), block_table=table, num_splits=num_splits,
                            variant=variant, window=window, cache_leftpad=lp, out=out, return_lse=True)
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table, window=window, cache_leftpad=starts)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)
    # The window changes the result of the long rows: a kernel that ignored it would fail above (one that
    # ignored the pads would read their NaN).
    plain, _ = reference_decode(q, kc, vc, ends, block_table=table, cache_leftpad=starts)
    assert rel(ref[2:], plain[2:]) > 1e-2 or window == (-1, -1)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("q_len", [2, 5, 8])
@pytest.mark.parametrize("window", [(-1, -1), (20, 3), (-1, 1), (6, -1)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_several_tokens_without_causality(paged, q_len, window, num_splits):
    gen = fresh_generator()
    b, hk, g, d, cap = 3, 1, 8, 64, 512
    ends = [q_len, 130, 512]
    kc, vc, table = nan_cache(b, cap, hk, d, paged, 32, gen)
    fill(kc, vc, table, ends, gen)
    q = rnd(b, q_len, hk * g, d, gen=gen)
    out = torch.full_like(q, float("nan"))
    _, lse = attngen.decode(q, kc, vc, cache_seqlens=i32(ends), block_table=table, num_splits=num_splits,
                            causal=False, window=window, out=out, return_lse=True)
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table, causal=False, window=window)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)
    causal, _ = reference_decode(q, kc, vc, ends, block_table=table, window=(window[0], 0))
    assert rel(ref[:1], causal[:1]) > 1e-2, "the later keys count (row 0: its q_len keys are all new)"


@pytest.mark.parametrize("mods", ["softcap", "alibi"])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_window_with_score_modifiers(mods, paged):
    gen = fresh_generator()
    b, hk, g, d, cap = 2, 2, 2, 256, 768
    ends, starts = [700, 400], [3, 129]
    kc, vc, table = nan_cache(b, cap, hk, d, paged, 128, gen)
    fill(kc, vc, table, ends, gen, starts)
    q = rnd(b, 3, hk * g, d, gen=gen)
    cap_v = 4.0 if mods == "softcap" else 0.0
    al = torch.rand(b, hk * g, device="cuda", generator=gen) * 0.3 + 0.01 if mods == "alibi" else None
    out = torch.full_like(q, float("nan"))
    _, lse = attngen.decode(q, kc, vc, cache_seqlens=i32(ends), block_table=table, num_splits=4, window=(90, 0),
                            cache_leftpad=i32(starts), softcap=cap_v, alibi_slopes=al, out=out, return_lse=True)
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table, window=(90, 0), cache_leftpad=starts,
                                    softcap=cap_v, alibi_slopes=al)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)


def test_decode_window_in_a_cache_row_chosen_by_index():
    gen = fresh_generator()
    hk, g, d, cap = 2, 4, 64, 300
    kc, vc, _ = nan_cache(3, cap, hk, d, False, 0, gen)
    rows, ends, starts = [2, 0], [300, 41], [5, 40]
    for r, n, lo in zip(rows, ends, starts):
        kc[r, lo:n] = rnd(n - lo, hk, d, gen=gen)
        vc[r, lo:n] = rnd(n - lo, hk, d, gen=gen)
    q = rnd(2, 1, hk * g, d, gen=gen)
    out = torch.full_like(q, float("nan"))
    attngen.decode(q, kc, vc, cache_seqlens=i32(ends), cache_batch_idx=i32(rows), cache_leftpad=i32(starts),
                   window=(100, 0), num_splits=2, out=out)
    ref, _ = reference_decode(q, kc, vc, ends, cache_batch_idx=rows, cache_leftpad=starts, window=(100, 0))
    assert torch.isfinite(out).all() and rel(out, ref) < TOL


# ---- flash_attn_with_kvcache -----------------------------------------------------------------------------------

def kvcache_case(gen, *, b=3, hk=2, g=4, d=128, cap=512, paged=False, bs=64, old=(0, 200, 430), pads=None, n_new=1,
                 q_len=None):
    """A cache (NaN outside the rows' keys), the old lengths and the new tokens."""
    kc, vc, table = nan_cache(b, cap, hk, d, paged, bs, gen)
    fill(kc, vc, table, list(old), gen, pads)
    q = rnd(b, q_len or n_new, hk * g, d, gen=gen)
    k_new, v_new = rnd(b, n_new, hk, d, gen=gen), rnd(b, n_new, hk, d, gen=gen)
    return q, kc, vc, table, k_new, v_new


def check_appended(kc, vc, table, k_new, v_new, old):
    bs = kc.shape[1]
    for i, o in enumerate(old):
        for t in range(k_new.shape[1]):
            p = o + t
            at = (int(table[i, p // bs]), p % bs) if table is not None else (i, p)
            assert torch.equal(kc[at], k_new[i, t]) and torch.equal(vc[at], v_new[i, t]), (i, t)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_new", [1, 3])
@pytest.mark.parametrize("num_splits", [1, 4, 0])
@pytest.mark.parametrize("pads", [False, True])
def test_kvcache_sliding_window_and_leftpad(paged, n_new, num_splits, pads):
    gen = fresh_generator()
    old = (0, 200, 430)
    starts = [0, 50, 429] if pads else None
    q, kc, vc, table, k_new, v_new = kvcache_case(gen, paged=paged, old=old, pads=starts, n_new=n_new)
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=i32(old), block_table=table,
                                               cache_leftpad=None if starts is None else i32(starts), causal=True,
                                               window_size=(127, 0), num_splits=num_splits, return_softmax_lse=True)
    check_appended(kc, vc, table, k_new, v_new, old)
    ends = [o + n_new for o in old]
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table, window=(127, 0), cache_leftpad=starts)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pads", [False, True])
@pytest.mark.parametrize("n_new", [1, 3, 12])
def test_kvcache_rotary(interleaved, rotary_dim, causal, pads, n_new):
    gen = fresh_generator()
    b, cap, d = 3, 512, 128
    old = (0, 200, 430)
    starts = [0, 33, 400] if pads else None
    q, kc, vc, table, k_new, v_new = kvcache_case(gen, old=old, pads=starts, n_new=n_new, d=d, cap=cap)
    ang = torch.rand(cap, rotary_dim // 2, device="cuda", generator=gen) * 6.0
    cos, sin = ang.cos().to(torch.bfloat16), ang.sin().to(torch.bfloat16)
    seqlens = i32(old)
    lp = None if starts is None else i32(starts)
    # More than 8 tokens go to the prefill kernel over the cache: with left pads, over its rows laid end to end.
    q0, k0 = q.clone(), k_new.clone()
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cos, sin, cache_seqlens=seqlens,
                                               cache_leftpad=lp, causal=causal, rotary_interleaved=interleaved,
                                               return_softmax_lse=True)
    assert torch.equal(q, q0) and torch.equal(k_new, k0), "the caller's q and k are not modified"
    base = seqlens.long() - (lp.long() if lp is not None else 0)
    pos_k = base[:, None] + torch.arange(n_new, device="cuda")
    pos_q = base[:, None] + (torch.arange(n_new, device="cuda") if causal else torch.zeros(n_new, dtype=torch.long,
                                                                                            device="cuda"))
    k_rot = reference_rotary(k_new, cos, sin, pos_k, interleaved)
    q_rot = reference_rotary(q, cos, sin, pos_q, interleaved)
    for i, o in enumerate(old):  # the cache holds the rotated keys (one rounding to bf16)
        assert rel(kc[i, o:o + n_new], k_rot[i]) < 1e-2 and torch.equal(vc[i, o:o + n_new], v_new[i])
    ends = [o + n_new for o in old]
    ref, ref_lse = reference_decode(q_rot, kc, vc, ends, causal=causal, cache_leftpad=starts)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)
    plain, _ = reference_decode(q, kc, vc, ends, causal=causal, cache_leftpad=starts)
    assert rel(ref, plain) > 1e-2, "the rotation changes the result"


@pytest.mark.parametrize("layout", ["paged", "contiguous", "contiguous_odd", "leftpad"])
@pytest.mark.parametrize("n_new", [9, 40])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (25, 0)), (False, (-1, -1)), (False, (30, 5))])
def test_kvcache_many_new_tokens(layout, n_new, causal, window):
    """Chunked prefill through the KV-cache call: the prefill kernel over a paged cache, a contiguous cache as
    pages; with left pads or rows of 1000 positions, causal calls as decode calls of 8 tokens, others through the
    prefill kernel over the cache's rows laid end to end."""
    gen = fresh_generator()
    cap = 1000 if layout == "contiguous_odd" else 1024
    old = (0, 300, cap - n_new - 5)
    starts = [0, 120, 7] if layout == "leftpad" else None
    q, kc, vc, table, k_new, v_new = kvcache_case(gen, cap=cap, paged=layout == "paged", old=old, pads=starts,
                                                  n_new=n_new, d=64)
    lp = None if starts is None else i32(starts)
    call = dict(cache_seqlens=i32(old), block_table=table, cache_leftpad=lp, causal=causal, window_size=window,
                return_softmax_lse=True)
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, **call)
    check_appended(kc, vc, table, k_new, v_new, old)
    ends = [o + n_new for o in old]
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table, causal=causal, window=window,
                                    cache_leftpad=starts)
    assert out.shape == q.shape and lse.shape == (3, q.shape[2], n_new)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_new", [2, 8, 11])
def test_kvcache_several_tokens_causal_false(paged, n_new):
    gen = fresh_generator()
    old = (5, 200, 301)
    q, kc, vc, table, k_new, v_new = kvcache_case(gen, paged=paged, old=old, n_new=n_new, bs=32)
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=i32(old), block_table=table,
                                               causal=False, return_softmax_lse=True)
    ends = [o + n_new for o in old]
    ref, ref_lse = reference_decode(q, kc, vc, ends, block_table=table, causal=False)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)
    causal, _ = reference_decode(q, kc, vc, ends, block_table=table)
    assert rel(ref[:1], causal[:1]) > 1e-2, "row 0 (5 old keys): its first token sees every new key"


def test_kvcache_every_option_at_once():
    """Window, left pads, rotary (NeoX, half the head), softcap, ALiBi, GQA, a forced split count and fewer new
    keys than queries (the first query sits before the new keys)."""
    gen = fresh_generator()
    b, hk, g, d, cap = 2, 2, 4, 64, 640
    old, starts = (100, 500), [10, 260]
    q, kc, vc, table, k_new, v_new = kvcache_case(gen, b=b, hk=hk, g=g, d=d, cap=cap, old=old, pads=starts,
                                                  n_new=2, q_len=4)
    ang = torch.rand(cap, d // 4, device="cuda", generator=gen) * 3.0
    cos, sin = ang.cos(), ang.sin()
    al = torch.rand(hk * g, device="cuda", generator=gen) * 0.2 + 0.01
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cos, sin, cache_seqlens=i32(old),
                                               cache_leftpad=i32(starts), softmax_scale=0.2, causal=True,
                                               window_size=(64, 0), softcap=6.0, rotary_interleaved=False,
                                               alibi_slopes=al, num_splits=3, return_softmax_lse=True)
    base = i32(old).long() - i32(starts).long()
    q_rot = reference_rotary(q, cos, sin, base[:, None] + torch.arange(4, device="cuda"), False)
    ends = [o + 2 for o in old]
    ref, ref_lse = reference_decode(q_rot, kc, vc, ends, sm_scale=0.2, softcap=6.0, alibi_slopes=al,
                                    window=(64, 0), cache_leftpad=starts)
    assert torch.isfinite(out).all()
    check_output_and_lse(out, lse, ref, ref_lse, TOL)
