"""Paged caches of any block size on a real GPU (pytest -m gpu): attngen.decode, attngen.prefill_varlen,
attngen.BatchAttention and the FlashAttention-named calls with blocks of 1, 2, 8 and 24 positions (the page_rows
kernels: a table lookup a key row) beside 16 and 64 (the 16-row group kernels), pages in random order, against
fp32 references. Outputs are poisoned with NaN first; every cache position a call must not read holds NaN."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator, reference_attention, reference_decode  # noqa: E402
from tests.test_gpu_decode import LSE_MAX_ABS, MAX_ABS, NAN, RAGGED, TOL, Case, check, run  # noqa: E402
from tests.serving_reference import check as check_step  # noqa: E402
from tests.serving_reference import make_step, reference, tree_words  # noqa: E402

PAGES = [1, 2, 8, 24, 16, 64]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# --- decode ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("d,dtype", [(128, "bf16"), (64, "fp16")])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=["split1", "split3", "auto"])
def test_decode_gqa(page, d, dtype, q_len, num_splits):
    case = Case(RAGGED, q_len=q_len, heads=32, kv_heads=8, head_dim=d, dtype=DTYPES[dtype], block_size=page)
    run(case, num_splits=num_splits)


@pytest.mark.parametrize("page", [1, 24])
@pytest.mark.parametrize("d,dtype", [(128, "fp16"), (64, "bf16"), (256, "bf16")])
def test_decode_other_dtypes_and_dims(page, d, dtype):
    run(Case(RAGGED, q_len=2, heads=8, kv_heads=2, head_dim=d, dtype=DTYPES[dtype], block_size=page))


@pytest.mark.parametrize("page", [1, 24])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_decode_32_packed_rows(page, num_splits):
    # GQA 4 x 8 new tokens: the q_rows 32 kernel the manifest prewarms beside the 16-row one
    run(Case(RAGGED, q_len=8, heads=32, kv_heads=8, head_dim=128, dtype=torch.float16, block_size=page),
        num_splits=num_splits)


@pytest.mark.parametrize("page", [1, 3, 24])
def test_decode_unfused(page):
    run(Case(RAGGED, q_len=1, heads=32, kv_heads=8, head_dim=128, block_size=page), variant="unfused")


def _decode_with(case, **kw):
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), return_lse=True, out=out, **kw)
    torch.cuda.synchronize()
    assert o is out
    ref_o, ref_l = reference_decode(case.q, case.k_cache, case.v_cache, case.seqlens, block_table=case.block_table,
                                    **kw)
    assert torch.isfinite(o).all(), f"unwritten (NaN) outputs; seed {case.seed}"
    err = (torch.linalg.vector_norm(o.float() - ref_o) / torch.linalg.vector_norm(ref_o)).item()
    assert err < TOL[case.dtype], f"rel L2 error {err:.3e}; seed {case.seed}"
    assert (o.float() - ref_o).abs().max().item() < MAX_ABS[case.dtype]
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse[fin] - ref_l[fin]).abs().max().item() < LSE_MAX_ABS


@pytest.mark.parametrize("page", [1, 8, 24])
@pytest.mark.parametrize("num_splits", [1, 0])
def test_decode_sinks(page, num_splits):
    case = Case(RAGGED, q_len=2, heads=32, kv_heads=8, head_dim=128, block_size=page)
    sinks = torch.randn(32, device="cuda", generator=fresh_generator())
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), return_lse=True, out=out,
                            sinks=sinks, num_splits=num_splits)
    torch.cuda.synchronize()
    ref_o, ref_l = reference_decode(case.q, case.k_cache, case.v_cache, case.seqlens, block_table=case.block_table,
                                    sinks=sinks)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert (o.float() - ref_o).abs().max().item() < MAX_ABS[case.dtype]
    assert (lse - ref_l).abs().max().item() < LSE_MAX_ABS


@pytest.mark.parametrize("page", [1, 24])
@pytest.mark.parametrize("window", [(100, 0), (37, 2)])
def test_decode_window(page, window):
    _decode_with(Case(RAGGED, q_len=4, heads=32, kv_heads=8, head_dim=128, block_size=page), window=window,
                 causal=window[1] == 0)


@pytest.mark.parametrize("page", [1, 24])
@pytest.mark.parametrize("d", [64, 128])
def test_decode_fp8_cache(page, d):
    from tests.test_gpu_fp8_decode import Fp8Case
    from tests.test_gpu_fp8_decode import run as run_fp8

    run_fp8(Fp8Case(RAGGED, fmt="e4m3", scale_kind="head", q_len=2, heads=8, kv_heads=2, head_dim=d,
                    dtype=torch.bfloat16, block_size=page))


@pytest.mark.parametrize("page", [1, 24])
def test_decode_packed_ragged_q(page):
    # one launch over requests of 1..6 tokens (cu_seqlens_q), against one decode call a request
    q_lens, lens = [1, 6, 3, 1, 2], [4097, 700, 3, 65, 129]
    gen = fresh_generator()
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, 32, 8, 128, page, torch.bfloat16)
    out = torch.full_like(q, NAN)
    o, lse = attngen.decode(q, kc, vc, cache_seqlens=cache_lens, block_table=table, cu_seqlens_q=cu, max_q_len=6,
                            out=out, return_lse=True)
    torch.cuda.synchronize()
    ref_o, ref_l = reference(q, kc, vc, table, q_lens, lens, 128 ** -0.5)
    check_step(o, lse, ref_o, ref_l, torch.bfloat16)


# --- prefill_varlen over pages ----------------------------------------------------------------------------------

def paged_keys(lens_k, page, hk, d, dtype, gen):
    """A NaN-poisoned paged pool holding each sequence's keys and values in blocks in random order (the pool's
    spare blocks and the table's entries past a sequence's last block, NaN too); returns (k, v, table, keys,
    values) with keys/values each sequence's dense [L, hk, d]."""
    nblk = [-(-n // page) for n in lens_k]
    num = sum(nblk) + 3
    perm = torch.randperm(num, device="cuda", generator=gen).tolist()
    kc = torch.full((num, page, hk, d), NAN, dtype=dtype, device="cuda")
    vc = torch.full_like(kc, NAN)
    width = max(nblk + [0]) + 1
    table, keys, values, at = [], [], [], 0
    for n, m in zip(lens_k, nblk):
        own = perm[at:at + m]
        at += m
        table.append(own + [perm[-1]] * (width - m))
        k = torch.randn(n, hk, d, device="cuda", generator=gen).to(dtype)
        v = torch.randn(n, hk, d, device="cuda", generator=gen).to(dtype)
        keys.append(k)
        values.append(v)
        if m:
            blocks = torch.tensor(own, dtype=torch.long, device="cuda")
            for cache, x in ((kc, k), (vc, v)):
                dense = torch.full((m * page, hk, d), NAN, dtype=dtype, device="cuda")
                dense[:n] = x
                cache[blocks] = dense.view(m, page, hk, d)
    return kc, vc, torch.tensor(table, dtype=torch.int32, device="cuda"), keys, values


def run_varlen_paged(page, causal, dtype, lens_q, lens_k, h=32, hk=8, d=128, via_flash=False):
    gen = fresh_generator()
    kc, vc, table, keys, values = paged_keys(lens_k, page, hk, d, dtype, gen)
    q = torch.randn(sum(lens_q), h, d, device="cuda", generator=gen).to(dtype)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    if via_flash:
        o = attngen.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                           block_table=table)
        lse = None
    else:
        out = torch.full_like(q, NAN)
        o, lse = attngen.prefill_varlen(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        block_table=table, return_lse=True, out=out)
        assert o is out
    torch.cuda.synchronize()
    assert torch.isfinite(o).all(), f"unwritten (NaN) outputs; seed {gen.initial_seed()}"
    at = 0
    for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        ref_o, ref_l = reference_attention(q[None, at:at + nq], keys[s][None], values[s][None], causal=causal)
        got = o[at:at + nq].float()
        err = (torch.linalg.vector_norm(got - ref_o[0]) / torch.linalg.vector_norm(ref_o[0]).clamp_min(1e-30)).item()
        assert err < TOL[dtype], f"sequence {s}: rel L2 error {err:.3e}; seed {gen.initial_seed()}"
        if lse is not None:
            fin = torch.isfinite(ref_l[0])
            assert torch.equal(torch.isfinite(lse[:, at:at + nq]), fin)
            assert (lse[:, at:at + nq][fin] - ref_l[0][fin]).abs().max().item() < LSE_MAX_ABS
        at += nq


LENS_Q = [1, 7, 300, 700, 64, 129]
LENS_K = [1, 900, 300, 1400, 64, 2000]


@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_varlen_paged(page, causal, dtype):
    run_varlen_paged(page, causal, DTYPES[dtype], LENS_Q, LENS_K)


@pytest.mark.parametrize("page", [1, 3])
def test_prefill_varlen_paged_head_dim_64_gqa_4(page):
    run_varlen_paged(page, True, torch.float16, LENS_Q, LENS_K, h=16, hk=4, d=64)


@pytest.mark.parametrize("page", [1, 24])
def test_flash_attn_varlen_func_paged(page):
    run_varlen_paged(page, True, torch.bfloat16, [5, 200], [40, 700], via_flash=True)


@pytest.mark.parametrize("page", [1, 24])
@pytest.mark.parametrize("q_len", [1, 4, 12])
def test_flash_attn_with_kvcache_paged(page, q_len):
    # q_len 12 (past 8 new tokens) takes the prefill kernel over the pages (or the packed decode kernel)
    case = Case([700, 33, 1000], q_len=q_len, heads=32, kv_heads=8, head_dim=128, block_size=page)
    o, lse = attngen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=case.seqlens,
                                             block_table=case.block_table, causal=True, return_softmax_lse=True)
    torch.cuda.synchronize()
    check(case, o, lse)


# --- BatchAttention ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("with_tree", [False, True], ids=["causal", "tree"])
def test_batch_attention(page, dtype, with_tree):
    gen = fresh_generator()
    dt = DTYPES[dtype]
    h, hk, d = 32, 8, 128
    q_lens = [1, 1, 0, 5, 1, 8, 300, 1, 9, 700, 5, 1]
    lens = [700, 33, 90, 1200, 17, 8, 2000, 5000, 9, 700, 64, 1]
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, h, hk, d, page, dt)
    tree = None
    if with_tree:
        words = []
        for n in q_lens:
            words += tree_words(n, gen, "cuda") if n <= 8 else [0] * n
        tree = torch.tensor(words, dtype=torch.int64, device="cuda")
    ba = attngen.BatchAttention(h, hk, d, page, dtype=dt)
    ba.plan(cu, cache_lens, table, total_q=q.shape[0])
    out = torch.full_like(q, NAN)
    o, lse = ba.run(q, kc, vc, tree_mask=tree, out=out, return_lse=True)
    torch.cuda.synchronize()
    assert o is out
    ref_o, ref_l = reference(q, kc, vc, table, q_lens, lens, d ** -0.5, tree, 8)
    check_step(o, lse, ref_o, ref_l, dt)
