"""softcap and ALiBi through every entry point, with FlashAttention's default ``softmax_scale=None`` and
with a scale given, against the fp32 reference (pytest -m gpu).

Each entry point (attngen's ops, FlashAttention's names and their qkv-/kv-packed forms) in each layout it
takes (dense, varlen contiguous and paged, KV cache with and without appended tokens). Outputs are
poisoned with NaN first; cache positions past each row's length are NaN.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]
torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import reference_attention, reference_decode, rel  # noqa: E402

TOL = 2e-2
B, H, HK, D = 3, 8, 2, 128
LENS_Q, LENS_K = [17, 130, 64], [17, 300, 200]  # varlen: causal rows align bottom-right per sequence


def rnd(*shape, gen):
    return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)


def _mods(mod, gen):
    cap = {"softcap": 6.0, "alibi": 0.0, "both": 25.0}[mod]
    al = None if mod == "softcap" else (torch.rand(B, H, device="cuda", generator=gen) * 0.3 + 0.01)
    if mod == "both":
        al = al[0].contiguous()  # one set of slopes for the batch; "alibi" uses per-sequence slopes
    return cap, al


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")


def _slopes_of(al, i):
    if al is None:
        return None
    return al[i:i + 1] if al.dim() == 2 else al


DENSE = ["prefill", "flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"]
VARLEN = ["prefill_varlen", "flash_attn_varlen_func", "flash_attn_varlen_qkvpacked_func",
          "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_func_paged"]
KVCACHE = ["decode", "flash_attn_with_kvcache", "flash_attn_with_kvcache_append"]


@pytest.mark.parametrize("entry", DENSE)
@pytest.mark.parametrize("mod", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("scale", [None, 0.15])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_entry_points(entry, mod, scale, causal, cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    sq, sk = 150, 211
    cap, al = _mods(mod, gen)
    if entry == "flash_attn_qkvpacked_func":
        sk, hk = sq, H
        qkv = rnd(B, sq, 3, H, D, gen=gen)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        out = attngen.flash_attn_qkvpacked_func(qkv, softmax_scale=scale, causal=causal, softcap=cap,
                                                alibi_slopes=al)
    else:
        q = rnd(B, sq, H, D, gen=gen)
        kv = rnd(B, sk, 2, HK, D, gen=gen)
        k, v = kv[:, :, 0], kv[:, :, 1]
        if entry == "flash_attn_kvpacked_func":
            out = attngen.flash_attn_kvpacked_func(q, kv, softmax_scale=scale, causal=causal, softcap=cap,
                                                   alibi_slopes=al)
        elif entry == "flash_attn_func":
            out = attngen.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, softcap=cap, alibi_slopes=al)
        else:
            out = torch.full_like(q, float("nan"))
            attngen.prefill(q, k, v, sm_scale=scale, causal=causal, softcap=cap, alibi_slopes=al, out=out)
    ref, _ = reference_attention(q, k, v, sm_scale=scale, causal=causal, softcap=cap, alibi_slopes=al)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL
    plain, _ = reference_attention(q, k, v, sm_scale=scale, causal=causal)
    assert rel(ref, plain) > 1e-2, "the modifiers change the result"


@pytest.mark.parametrize("entry", VARLEN)
@pytest.mark.parametrize("mod", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("scale", [None, 0.15])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_entry_points(entry, mod, scale, causal, cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    cap, al = _mods(mod, gen)
    lens_q, lens_k = LENS_Q, LENS_K
    if entry == "flash_attn_varlen_qkvpacked_func":
        lens_k, hk = lens_q, H
        qkv = rnd(sum(lens_q), 3, H, D, gen=gen)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    else:
        hk = HK
        q = rnd(sum(lens_q), H, D, gen=gen)
        kv = rnd(sum(lens_k), 2, HK, D, gen=gen)
        k, v = kv[:, 0], kv[:, 1]
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    kw = dict(softmax_scale=scale, causal=causal, softcap=cap, alibi_slopes=al)
    if entry == "flash_attn_varlen_qkvpacked_func":
        out = attngen.flash_attn_varlen_qkvpacked_func(qkv, cu_q, mq, **kw)
    elif entry == "flash_attn_varlen_kvpacked_func":
        out = attngen.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, mq, mk, **kw)
    elif entry == "flash_attn_varlen_func":
        out = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, **kw)
    elif entry == "flash_attn_varlen_func_paged":  # each sequence's keys in its own 32-row blocks of a shuffled pool
        bs, per = 32, -(-mk // 32)
        kc = torch.full((B * per + 2, bs, hk, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        vc = kc.clone()
        table = torch.randperm(B * per + 2, device="cuda", generator=gen)[: B * per].to(torch.int32).reshape(B, per)
        k0 = 0
        for s, n in enumerate(lens_k):
            for j in range(-(-n // bs)):
                m = min(bs, n - j * bs)
                kc[table[s, j], :m] = k[k0 + j * bs: k0 + j * bs + m]
                vc[table[s, j], :m] = v[k0 + j * bs: k0 + j * bs + m]
            k0 += n
        out = attngen.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, mq, mk, block_table=table, **kw)
    else:
        out = torch.full_like(q, float("nan"))
        attngen.prefill_varlen(q, k, v, cu_q, cu_k, mq, mk, sm_scale=scale, causal=causal, softcap=cap,
                               alibi_slopes=al, out=out)
    assert torch.isfinite(out).all()
    q0 = k0 = 0
    for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        ref, _ = reference_attention(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], sm_scale=scale,
                                     causal=causal, softcap=cap, alibi_slopes=_slopes_of(al, s))
        assert rel(out[None, q0:q0 + nq], ref) < TOL, f"sequence {s}"
        q0, k0 = q0 + nq, k0 + nk


@pytest.mark.parametrize("entry", KVCACHE)
@pytest.mark.parametrize("mod", ["softcap", "alibi", "both"])
@pytest.mark.parametrize("scale", [None, 0.15])
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_entry_points(entry, mod, scale, paged, cache_dir):
    gen = torch.Generator(device="cuda")
    gen.seed()
    cap, al = _mods(mod, gen)
    lengths, capacity, bs = [5, 400, 1000], 1024, 64
    n_new = 2 if entry == "flash_attn_with_kvcache_append" else 1
    if paged:
        per = capacity // bs
        kc = torch.full((B * per + 3, bs, HK, D), float("nan"), device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(B * per + 3, device="cuda", generator=gen)[: B * per].to(torch.int32).reshape(B, per)
    else:
        kc, table = torch.full((B, capacity, HK, D), float("nan"), device="cuda", dtype=torch.bfloat16), None
    vc = kc.clone()
    for i, n in enumerate(lengths):
        for j in range(0, n, bs):
            m = min(bs, n - j)
            at = (int(table[i, j // bs]), slice(0, m)) if paged else (i, slice(j, j + m))
            kc[at] = rnd(m, HK, D, gen=gen)
            vc[at] = rnd(m, HK, D, gen=gen)
    q = rnd(B, n_new, H, D, gen=gen)
    seqlens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    if entry == "flash_attn_with_kvcache_append":
        k_new, v_new = rnd(B, n_new, HK, D, gen=gen), rnd(B, n_new, HK, D, gen=gen)
        out = attngen.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens, block_table=table,
                                              softmax_scale=scale, causal=True, softcap=cap, alibi_slopes=al)
        seqlens = seqlens + n_new
    elif entry == "flash_attn_with_kvcache":
        out = attngen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=table,
                                              softmax_scale=scale, softcap=cap, alibi_slopes=al)
    else:
        out = torch.full_like(q, float("nan"))
        attngen.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table, sm_scale=scale, softcap=cap,
                       alibi_slopes=al, out=out)
    ref, _ = reference_decode(q, kc, vc, seqlens, block_table=table, sm_scale=scale, softcap=cap, alibi_slopes=al)
    assert torch.isfinite(out).all() and rel(out, ref) < TOL
