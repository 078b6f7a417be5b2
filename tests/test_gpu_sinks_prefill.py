"""Attention sinks in the prefill family on a real GPU (pytest -m gpu), against an fp64 reference.

The reference is the definition: each head's sink joins the row's logits as one more column, the softmax runs over
them all, the column is dropped and what remains multiplies V; the LSE is over every column. Sinks per head mix
ordinary values, -inf (no sink), one far above every logit (+40: O near 0, LSE near the sink), one whose exp overflows
fp32 (+200) and a large negative one. Inputs sit in NaN-filled buffers, outputs in NaN-poisoned views of a
sentinel-filled buffer (tests/test_gpu_prefill_serving.py's helpers). Rows that see no key give O = 0 and LSE = the
sink exactly. Every route: dense (causal or not, GQA, a window, softcap and ALiBi with sinks), every kernel form on
sm_90a (mma.sync, wgmma on cp.async, TMA serial/overlap/ping-pong, persistent, O staged in Q, three warpgroups), the
chunked kernel (512, 576/512, 1024), a padded head dim (100), varlen contiguous and paged, a custom mask with its
plan, FlashAttention's names, fp16 and bf16.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.test_gpu_prefill_serving import _cu, check_sentinel, guarded, range_keep, sentinel_out  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
NEG_INF = float("-inf")


def sinks_for(h, gen):
    """fp32 [h] sinks: +40 (above every logit by 30 and more), -inf, random ones, +200 (exp overflows fp32), -30."""
    s = torch.randn(h, generator=gen, device="cuda", dtype=torch.float32) * 2
    for i, x in enumerate((40.0, NEG_INF, None, 200.0, -30.0)):
        if i < h and x is not None:
            s[i] = x
    return s


def reference(q, k, v, keep, scale, sinks, softcap=0.0, alibi=None):
    """(out fp32 [B, Sq, H, Dv], lse fp32 [B, H, Sq]) by the definition, in fp64. keep: bool broadcastable to
    [B, H, Sq, Sk]; alibi: fp32 [H] slopes on |i' - j| (i' the query's bottom-right aligned position)."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    qf = q.double().transpose(1, 2)
    kf = k.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vf = v.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        dist = (torch.arange(sq, device=q.device)[:, None] + (sk - sq) - torch.arange(sk, device=q.device)[None, :])
        s = s - alibi.double()[:, None, None] * dist.abs().double()
    s = s.masked_fill(~keep, NEG_INF)
    full = torch.cat([s, sinks.double()[None, :, None, None].expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.softmax(full, dim=-1).nan_to_num(0.0)[..., :-1]
    return torch.matmul(p, vf).transpose(1, 2).float(), lse.float()


def compare(o, lse, ref_o, ref_l, dtype):
    """o [B, Sq, H, Dv] and lse [B, H, Sq] against the reference (relative L2 error of O, LSE within 2e-2 where
    finite, -inf exactly where the reference's is)."""
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite output elements"
    err = (torch.linalg.vector_norm(o.float() - ref_o) / torch.linalg.vector_norm(ref_o).clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"rel L2 error {err:.3e}"
    assert not torch.isnan(lse).any()
    fin = torch.isfinite(ref_l)
    assert torch.equal(torch.isfinite(lse), fin), "LSE finite where the reference is -inf, or the reverse"
    assert (lse[~fin] == NEG_INF).all()
    if fin.any():
        lerr = (lse[fin] - ref_l[fin]).abs().max().item()
        assert lerr < 2e-2, f"LSE max abs error {lerr:.3e}"
    return err


def empty_rows(keep, b, h, sq):
    """[B, H, Sq]: the rows that see no key."""
    return ~keep.expand(b, h, sq, keep.shape[-1]).any(-1)


def run_dense(b, sq, sk, h, hk, d, dtype, *, causal=False, window=(-1, -1), dv=None, softcap=0.0, alibi=False,
              spec=None, lse=True, api=False):
    gen = fresh_generator()
    dv = dv or d
    q, k = guarded(b, sq, h, d, dtype=dtype, gen=gen), guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    v = guarded(b, sk, hk, dv, dtype=dtype, gen=gen)
    sinks = sinks_for(h, gen)
    slopes = torch.rand(h, generator=gen, device="cuda") * 0.1 if alibi else None
    if api:  # FlashAttention's name: a new output, no LSE
        o = attngen.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes,
                                    sinks=sinks)
        l, buf = None, None
    else:
        out, buf, guards = sentinel_out((b, sq, h, dv), dtype)
        r = attngen.prefill(q, k, v, causal=causal, window=window, softcap=softcap, alibi_slopes=slopes,
                            return_lse=lse, out=out, spec=spec, sinks=sinks)
        o, l = r if lse else (r, None)
        assert o is out
    torch.cuda.synchronize()
    if buf is not None:
        check_sentinel(buf, guards)
    keep = range_keep(sq, sk, causal, window)
    ref_o, ref_l = reference(q, k, v, keep, d ** -0.5, sinks, softcap, slopes)
    got_lse = l is not None
    err = compare(o, l if got_lse else ref_l, ref_o, ref_l, dtype)  # (without an LSE, the output alone)
    none = empty_rows(keep, b, h, sq)  # [B, H, Sq]: zeros there, and the sink as the LSE
    if none.any():
        assert (o.transpose(1, 2)[none] == 0).all(), "a row that sees no key is not zero"
        if got_lse:
            assert torch.equal(l[none], sinks[None, :, None].expand(b, h, sq)[none]), "its LSE is not the sink"
    return err


@pytest.mark.parametrize("d,dtype", [(64, torch.bfloat16), (128, torch.float16), (256, torch.bfloat16)],
                         ids=["d64-bf16", "d128-fp16", "d256-bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (133, 133), (1000, 1000), (300, 77), (77, 1500)])
def test_dense(d, dtype, causal, sq, sk):
    # GQA (8 query heads on 2); causal with sq > sk leaves the first rows without a key
    run_dense(2, sq, sk, 8, 2, d, dtype, causal=causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_window_softcap_alibi_and_sinks(dtype):
    run_dense(2, 700, 900, 6, 3, 128, dtype, window=(100, 20), softcap=20.0, alibi=True)
    run_dense(1, 257, 257, 4, 1, 64, dtype, causal=True, softcap=30.0, alibi=True, lse=False)


# (the defaults, ping-pong and persistent, run in test_dense)
SM90A_FORMS = [
    "mma=mma_sync",
    "cta_tile_q=64,cta_tile_kv=64,num_warps=4,num_stages=4,mma=wgmma,pipeline=sync,schedule=serial,persistent=false",
    "pipeline=tma,schedule=serial,persistent=false",
    "schedule=overlap,persistent=false",
]


def _sm90a():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma and TMA need sm_90a")


@pytest.mark.parametrize("form", SM90A_FORMS)
def test_every_kernel_form_on_sm90a(form):
    _sm90a()
    run_dense(2, 555, 600, 4, 2, 128, torch.bfloat16, causal=True, spec=f"prefill:head_dim=128,sinks=true,{form}")


def test_o_in_q_and_three_warpgroups_on_sm90a():
    _sm90a()
    run_dense(2, 900, 900, 4, 4, 256, torch.bfloat16, causal=True,
              spec="prefill:head_dim=256,sinks=true,cta_tile_q=128,cta_tile_kv=80,num_warps=8,num_stages=2,mma=wgmma,"
                   "pipeline=tma,schedule=pingpong,persistent=true")
    run_dense(1, 700, 700, 4, 2, 64, torch.float16,
              spec="prefill:head_dim=64,sinks=true,cta_tile_q=192,cta_tile_kv=128,num_warps=12,num_stages=2,"
                   "mma=wgmma,pipeline=tma,schedule=pingpong,persistent=false")


@pytest.mark.parametrize("d,dv,dtype,causal", [(512, 512, torch.bfloat16, False), (576, 512, torch.float16, True),
                                               (1024, 1024, torch.bfloat16, True)], ids=["512", "576-512", "1024"])
def test_chunked(d, dv, dtype, causal):
    # (causal with fewer keys than queries: the first rows see none)
    run_dense(1, 200, 150 if causal else 333, 4, 2, d, dtype, dv=dv, causal=causal)


def test_padded_head_dim():
    run_dense(2, 129, 200, 4, 2, 100, torch.bfloat16, causal=True)


def test_flash_attn_func():
    run_dense(2, 64, 96, 4, 2, 128, torch.bfloat16, causal=True, api=True)
    # the packed form hands sinks on
    gen = fresh_generator()
    qkv = torch.randn(1, 50, 3, 4, 64, generator=gen, device="cuda").to(torch.float16)
    sinks = sinks_for(4, gen)
    o = attngen.flash_attn_qkvpacked_func(qkv, causal=True, sinks=sinks)
    q, k, v = (qkv[:, :, i] for i in range(3))
    ref_o, ref_l = reference(q, k, v, range_keep(50, 50, True, (-1, -1)), 64 ** -0.5, sinks)
    compare(o, ref_l, ref_o, ref_l, torch.float16)


@pytest.mark.parametrize("block_size,d,dtype", [(0, 128, torch.bfloat16), (16, 128, torch.bfloat16),
                                               (64, 64, torch.float16), (0, 64, torch.float16)],
                         ids=["contiguous-d128-bf16", "paged16-d128-bf16", "paged64-d64-fp16", "contiguous-d64-fp16"])
def test_varlen(block_size, d, dtype):
    gen = fresh_generator()
    lens_q, lens_k = [5, 300, 0, 40, 17], [5, 420, 9, 0, 700]
    h, hk = 6, 2
    tq, tk = sum(lens_q), sum(lens_k)
    q, k, v = (guarded(n, hh, d, dtype=dtype, gen=gen) for n, hh in ((tq, h), (tk, hk), (tk, hk)))
    sinks = sinks_for(h, gen)
    kc, vc, kwargs = k, v, {}
    if block_size:  # each sequence's keys in shuffled blocks of a NaN-filled pool; spare blocks stay NaN
        per = [-(-n // block_size) for n in lens_k]
        nblocks = sum(per) + 2
        order = torch.randperm(nblocks, device="cpu").tolist()
        kc = torch.full((nblocks, block_size, hk, d), float("nan"), dtype=dtype, device="cuda")
        vc = torch.full_like(kc, float("nan"))
        table = torch.zeros(len(lens_k), max(per + [1]), dtype=torch.int32)
        k0 = 0
        for s, n in enumerate(lens_k):
            for j in range(per[s]):
                blk = order.pop()
                table[s, j] = blk
                rows = min(block_size, n - j * block_size)
                kc[blk, :rows] = k[k0 + j * block_size: k0 + j * block_size + rows]
                vc[blk, :rows] = v[k0 + j * block_size: k0 + j * block_size + rows]
            k0 += n
        kwargs["block_table"] = table.cuda()
    out, buf, guards = sentinel_out((tq, h, d), dtype)
    o, lse = attngen.prefill_varlen(q, kc, vc, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), causal=True,
                                    return_lse=True, out=out, sinks=sinks, **kwargs)
    torch.cuda.synchronize()
    assert o is out and lse.shape == (h, tq)
    check_sentinel(buf, guards)
    q0 = k0 = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            keep = range_keep(nq, nk, True, (-1, -1))
            ref_o, ref_l = reference(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], keep, d ** -0.5,
                                     sinks)
            compare(o[None, q0:q0 + nq], lse[None, :, q0:q0 + nq], ref_o, ref_l, dtype)
            if nk == 0:  # no key at all: zeros, and the sinks as the LSE
                assert (o[q0:q0 + nq] == 0).all() and torch.equal(lse[:, q0:q0 + nq], sinks[:, None].expand(h, nq))
        q0 += nq
        k0 += nk


@pytest.mark.parametrize("dtype,causal", [(torch.bfloat16, True), (torch.float16, False)], ids=["bf16", "fp16"])
def test_custom_mask_and_its_plan(dtype, causal):
    gen = fresh_generator()
    b, sq, sk, h, hk, d = 2, 300, 400, 4, 2, 128
    q, k, v = guarded(b, sq, h, d, dtype=dtype, gen=gen), *(guarded(b, sk, hk, d, dtype=dtype, gen=gen)
                                                            for _ in range(2))
    sinks = sinks_for(h, gen)
    # a random per-head mask with whole rows masked out (no key: O = 0, LSE = the sink)
    mask = torch.rand(b, h, sq, sk, generator=gen, device="cuda") > 0.6
    mask[:, :, 10:20] = False
    plan = attngen.mask_plan(mask, q, k, causal=causal)
    for reuse in (None, plan):
        out, buf, guards = sentinel_out((b, sq, h, d), dtype)
        o, lse = attngen.prefill(q, k, v, mask=mask, mask_plan=reuse, causal=causal, return_lse=True, out=out,
                                 sinks=sinks)
        torch.cuda.synchronize()
        check_sentinel(buf, guards)
        keep = mask & range_keep(sq, sk, causal, (-1, -1))
        ref_o, ref_l = reference(q, k, v, keep, d ** -0.5, sinks)
        compare(o, lse, ref_o, ref_l, dtype)
        none = empty_rows(keep, b, h, sq)
        assert (o.transpose(1, 2)[none] == 0).all() and torch.equal(lse[none], sinks[None, :, None].expand(b, h,
                                                                                                           sq)[none])
