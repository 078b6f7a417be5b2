"""softcap and ALiBi in prefill and decode, and FlashAttention's entry points, against the fp32
reference (pytest -m gpu). Outputs are poisoned with NaN first, cache positions past each row's
length are NaN (a stray read turns the output NaN), and appended tokens are read back."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]
torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import reference_attention, reference_decode, rel  # noqa: E402

TOL = 2e-2


def rnd(*shape, dtype=torch.bfloat16, gen=None):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def slopes(b, h, per_batch, gen):
    s = torch.rand(b, h, device="cuda", generator=gen) * 0.5 + 0.01
    return s if per_batch else s[0].contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mods", ["softcap", "alibi", "alibi_per_batch", "both"])
@pytest.mark.parametrize("mma", ["auto", "mma_sync"])
def test_prefill_softcap_and_alibi(dtype, d, causal, mods, mma, cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    b, sq, sk, h, hk = 2, 77, 203, 8, 2
    q, k, v = rnd(b, sq, h, d, dtype=dtype, gen=gen), rnd(b, sk, hk, d, dtype=dtype, gen=gen), \
        rnd(b, sk, hk, d, dtype=dtype, gen=gen)
    cap = 5.0 if mods in ("softcap", "both") else 0.0
    al = slopes(b, h, mods == "alibi_per_batch", gen) if mods != "softcap" else None
    out = torch.full_like(q, float("nan"))
    spec = attngen.PrefillSpec(mma=mma) if mma != "auto" else None
    _, lse = attngen.prefill(q, k, v, causal=causal, softcap=cap, alibi_slopes=al, out=out, return_lse=True, spec=spec)
    ref, ref_lse = reference_attention(q, k, v, causal=causal, softcap=cap, alibi_slopes=al)
    assert torch.isfinite(out).all()
    assert rel(out, ref) < TOL
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and (lse[fin] - ref_lse[fin]).abs().max().item() < 2e-2
    # The modifiers change the result: a kernel that ignored them would fail here.
    plain, _ = reference_attention(q, k, v, causal=causal)
    assert rel(ref, plain) > 1e-2


def test_flash_attn_func_is_prefill(cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    q, k, v = rnd(2, 300, 8, 128, gen=gen), rnd(2, 300, 4, 128, gen=gen), rnd(2, 300, 4, 128, gen=gen)
    al = slopes(2, 8, False, gen)
    out = attngen.flash_attn_func(q, k, v, softmax_scale=0.1, causal=True, window_size=(64, 0), softcap=20.0,
                                  alibi_slopes=al, deterministic=True)
    native = attngen.prefill(q, k, v, sm_scale=0.1, causal=True, window=(64, 0), softcap=20.0, alibi_slopes=al)
    assert torch.equal(out, native)
    ref, _ = reference_attention(q, k, v, sm_scale=0.1, causal=True, window=(64, 0), softcap=20.0, alibi_slopes=al)
    assert rel(out, ref) < TOL


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_varlen_func_is_prefill_varlen(paged, cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    lens_q, lens_k = [5, 300, 0, 77], [40, 300, 9, 500]
    cu_q = torch.tensor([0, 5, 305, 305, 382], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 40, 340, 349, 849], dtype=torch.int32, device="cuda")
    q, k, v = rnd(382, 8, 128, gen=gen), rnd(849, 2, 128, gen=gen), rnd(849, 2, 128, gen=gen)
    al = slopes(4, 8, True, gen)
    kc, vc, table = k, v, None
    if paged:  # each sequence's keys in its own 64-row blocks, in a shuffled pool
        bs, per = 64, 8
        kc = torch.full((4 * per + 3, bs, 2, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
        vc = kc.clone()
        table = torch.randperm(4 * per + 3, device="cuda", generator=gen)[: 4 * per].to(torch.int32).reshape(4, per)
        for s, (k0, n) in enumerate(zip((0, 40, 340, 349), lens_k)):
            for j in range(-(-n // bs)):
                rows = min(bs, n - j * bs)
                kc[table[s, j], :rows] = k[k0 + j * bs: k0 + j * bs + rows]
                vc[table[s, j], :rows] = v[k0 + j * bs: k0 + j * bs + rows]
    args = (q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k))
    out = attngen.flash_attn_varlen_func(*args, softmax_scale=0.1, causal=True, window_size=(128, 0), softcap=20.0,
                                         alibi_slopes=al, deterministic=True, block_table=table)
    native = attngen.prefill_varlen(*args, sm_scale=0.1, causal=True, window=(128, 0), softcap=20.0,
                                    alibi_slopes=al, block_table=table)
    assert torch.equal(out, native) and torch.isfinite(out).all()
    for s, (q0, k0, nq, nk) in enumerate(zip((0, 5, 305, 305), (0, 40, 340, 349), lens_q, lens_k)):
        if nq:
            ref, _ = reference_attention(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], sm_scale=0.1,
                                         causal=True, window=(128, 0), softcap=20.0, alibi_slopes=al[s:s + 1])
            assert rel(out[None, q0:q0 + nq], ref) < TOL
    with pytest.raises(attngen.LaunchError, match="dropout_p"):
        attngen.flash_attn_varlen_func(*args, dropout_p=0.1)
    with pytest.raises(attngen.LaunchError, match="return_attn_probs"):
        attngen.flash_attn_varlen_func(*args, return_attn_probs=True)


def _cache(b, cap, hk, d, paged, bs, gen, dtype=torch.bfloat16):
    """A cache of capacity ``cap`` per row, NaN everywhere, and its table when paged."""
    if paged:
        per = cap // bs
        kc = torch.full((b * per + 3, bs, hk, d), float("nan"), device="cuda", dtype=dtype)
        table = torch.randperm(b * per + 3, device="cuda", generator=gen)[: b * per].to(torch.int32).reshape(b, per)
        return kc, kc.clone(), table
    kc = torch.full((b, cap, hk, d), float("nan"), device="cuda", dtype=dtype)
    return kc, kc.clone(), None


def _fill(kc, vc, table, lengths, gen):
    """Random keys and values at every position below each row's length (the rest stays NaN)."""
    for i, n in enumerate(lengths):
        if table is not None:
            bs = kc.shape[1]
            for j in range(0, n, bs):
                m = min(bs, n - j)
                blk = int(table[i, j // bs])
                kc[blk, :m] = rnd(m, *kc.shape[2:], dtype=kc.dtype, gen=gen)
                vc[blk, :m] = rnd(m, *kc.shape[2:], dtype=kc.dtype, gen=gen)
        else:
            kc[i, :n] = rnd(n, *kc.shape[2:], dtype=kc.dtype, gen=gen)
            vc[i, :n] = rnd(n, *kc.shape[2:], dtype=kc.dtype, gen=gen)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("variant", ["fused", "unfused"])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("mods", ["softcap", "alibi", "both"])
def test_decode_softcap_and_alibi(paged, variant, q_len, mods, cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    b, hk, g, d, cap = 3, 2, 4, 128, 1024
    lengths = [5, 700, 1024]
    kc, vc, table = _cache(b, cap, hk, d, paged, 64, gen)
    _fill(kc, vc, table, lengths, gen)
    q = rnd(b, q_len, hk * g, d, gen=gen)
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    softcap = 3.0 if mods != "alibi" else 0.0
    al = slopes(b, hk * g, True, gen) if mods != "softcap" else None
    out = torch.full_like(q, float("nan"))
    _, lse = attngen.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table, variant=variant, softcap=softcap,
                            alibi_slopes=al, out=out, return_lse=True, num_splits=3)
    ref, ref_lse = reference_decode(q, kc, vc, seqlens, block_table=table, softcap=softcap, alibi_slopes=al)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL
    assert (lse - ref_lse).abs().max().item() < 2e-2
    plain, _ = reference_decode(q, kc, vc, seqlens, block_table=table)
    assert rel(ref, plain) > 1e-2


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_new", [1, 4])
def test_flash_attn_with_kvcache_appends_then_attends(paged, n_new, cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    b, hk, g, d, cap = 3, 2, 4, 64, 512
    old = [0, 200, 500]
    kc, vc, table = _cache(b, cap, hk, d, paged, 32, gen)
    _fill(kc, vc, table, old, gen)
    rows = None
    if not paged:  # batch row i writes and reads cache row rows[i]
        rows = torch.tensor([2, 0, 1], device="cuda", dtype=torch.int32)
        perm = rows.long()
        kc[perm] = kc.clone()
        vc[perm] = vc.clone()
    q = rnd(b, n_new, hk * g, d, gen=gen)
    k_new, v_new = rnd(b, n_new, hk, d, gen=gen), rnd(b, n_new, hk, d, gen=gen)
    seqlens = torch.tensor(old, device="cuda", dtype=torch.int32)
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens,
                                               cache_batch_idx=rows, block_table=table, causal=True,
                                               return_softmax_lse=True)
    new = seqlens + n_new
    # The new tokens are in the cache where FlashAttention puts them.
    for i in range(b):
        for t in range(n_new):
            p = old[i] + t
            if paged:
                at_k = kc[int(table[i, p // 32]), p % 32]
                at_v = vc[int(table[i, p // 32]), p % 32]
            else:
                at_k, at_v = kc[int(rows[i]), p], vc[int(rows[i]), p]
            assert torch.equal(at_k, k_new[i, t]) and torch.equal(at_v, v_new[i, t])
    ref, ref_lse = reference_decode(q, kc, vc, new, cache_batch_idx=rows, block_table=table)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL
    assert (lse - ref_lse).abs().max().item() < 2e-2
    assert lse.shape == (b, hk * g, n_new)
