"""attngen.prefill_varlen over an fp8 KV cache (kv_dtype: e4m3 / e5m2) with q in fp16/bf16, on a real GPU (pytest -m
gpu), against an fp32 reference computed from the DEQUANTISED cache (k_scale * K_fp8, v_scale * V_fp8).

The cache holds NaN (which stays NaN in fp8) in every slot past a sequence's length and in every block no table
names, so a stray read turns the output NaN; the output is NaN-poisoned first. Tolerance: the 16-bit prefill's
(every fp8 value is a 16-bit value, widened exactly; the scales multiply fp32 logits and O): rel L2 within TOL.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator, reference_attention, rel  # noqa: E402
from tests.test_gpu_prefill_serving import paged_pool  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
NAN = float("nan")


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _scales(kind, hk, gen):
    """(k_scale argument, per-head values) of a kind: "float", "tensor" ([1]) or "head" ([kv_heads])."""
    if kind == "head":
        s = 0.05 + 0.3 * torch.rand(hk, device="cuda", generator=gen)
        return s, s
    v = 0.05 + 0.3 * torch.rand(1, device="cuda", generator=gen)
    return (v.item() if kind == "float" else v), v.expand(hk).clone()


def run_case(lq, lk, *, d=128, h=8, hk=2, dtype=torch.bfloat16, fmt="e4m3", page=None, causal=True, kind="head",
             spec=None, twin=False, q_mul=1.0):
    """One call against the reference per sequence, q times q_mul and the softmax's scale over it. ``twin``: and the
    cp.async kernel of the spec's tiles. fp16 q: bit-equal (the widening is exact and the consumers' arithmetic the
    same). bf16 q on TMA, whose MMAs run in fp16 over q times 2^k (k from each query tile's largest |q|): every q
    in [-3, 3] and dim 0 3.5, so k is 13 in every tile, against the fp16 kernel given q times 2^13 and the scale
    times 2^-13: the LSE bit-equal, O as the fp32 accumulator rounded to bf16 rather than to fp16."""
    gen = fresh_generator()
    b = len(lq)
    q = (torch.randn(sum(lq), h, d, device="cuda", generator=gen) * q_mul).to(dtype)
    sm = d ** -0.5 / q_mul
    q16_twin = twin and dtype is torch.bfloat16
    if q16_twin:
        q = q.clamp(-3, 3)
        q[..., 0] = 3.5
    ks_arg, ks = _scales(kind, hk, gen)
    vs_arg, vs = _scales(kind, hk, gen)
    kk = [torch.randn(n, hk, d, device="cuda", generator=gen) for n in lk]
    vv = [torch.randn(n, hk, d, device="cuda", generator=gen) for n in lk]
    f8 = FMTS[fmt]
    # |x| < ~5, scales >= 0.05: |x / scale| < ~100, inside both formats' range
    k8 = [(x / ks[None, :, None]).to(f8) for x in kk]
    v8 = [(x / vs[None, :, None]).to(f8) for x in vv]
    kd = [x.float() * ks[None, :, None] for x in k8]
    vd = [x.float() * vs[None, :, None] for x in v8]
    kc = torch.cat(k8) if sum(lk) else torch.empty(0, hk, d, device="cuda").to(f8)
    vc = torch.cat(v8) if sum(lk) else torch.empty(0, hk, d, device="cuda").to(f8)
    table = None
    if page is not None:
        # blocks shuffled, spare NaN blocks no table names, NaN past each sequence's end, table entries past it -1
        kc, vc, table = paged_pool(kc, vc, lk, page)
    out = torch.full((sum(lq), h, d), NAN, device="cuda", dtype=dtype)
    o, lse = attngen.prefill_varlen(q, kc, vc, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, return_lse=True,
                                    out=out, block_table=table, k_scale=ks_arg, v_scale=vs_arg, spec=spec, sm_scale=sm)
    torch.cuda.synchronize()
    assert o is out
    if twin:
        tq, tsm, tspec = q, sm, spec.replace(pipeline="sync", schedule="serial")
        if q16_twin:
            tq, tsm, tspec = (q.float() * 2**13).half(), sm * 2**-13, tspec.replace(dtype="fp16")
        o2, lse2 = attngen.prefill_varlen(tq, kc, vc, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal,
                                          return_lse=True, block_table=table, k_scale=ks_arg, v_scale=vs_arg,
                                          spec=tspec, sm_scale=tsm)
        assert torch.equal(lse, lse2), "TMA and cp.async kernels of one tile config differ"
        if q16_twin:  # |bf16(x) - fp16(x)| <= 2^-9 |x| + 2^-12 |x|, and fp16's subnormal step
            assert torch.allclose(o.float(), o2.float(), rtol=2**-8, atol=2**-24), "O differs past bf16's rounding"
        else:
            assert torch.equal(o, o2), "TMA and cp.async kernels of one tile config differ"
    cq = _cu(lq).tolist()
    for s in range(b):
        if lq[s] == 0:
            continue
        rows = slice(cq[s], cq[s + 1])
        if lk[s] == 0:
            assert (o[rows] == 0).all() and torch.isinf(lse[:, rows]).all()
            continue
        ro, rl = reference_attention(q[rows].float()[None], kd[s][None], vd[s][None], causal=causal, sm_scale=sm)
        got = o[rows].float()[None]
        assert torch.isfinite(got).all(), f"NaN in sequence {s}: a stray read or an unwritten row"
        err = rel(got, ro)
        assert err <= TOL[dtype], f"sequence {s} (q {lq[s]}, k {lk[s]}): rel L2 {err:.3e}"
        fin = torch.isfinite(rl[0])
        assert (lse[:, rows][fin] - rl[0][fin]).abs().max().item() < 1e-2


LQ = [1, 300, 0, 129, 64]
LK = [5, 1000, 7, 129, 700]


@pytest.mark.parametrize("page", [None, 16, 1], ids=["contiguous", "page16", "page1"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_cache(page, dtype, fmt):
    run_case(LQ, LK, dtype=dtype, fmt=fmt, page=page)


@pytest.mark.parametrize("kind", ["float", "tensor", "head"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_cache_scales_and_masks(kind, causal):
    run_case([17, 200], [40, 200] if causal else [300, 5], kind=kind, causal=causal, page=16)


@pytest.mark.parametrize("d", [64, 96, 256])
def test_fp8_cache_head_dims(d):
    run_case([100, 257], [700, 300], d=d, page=16)


# sm_90a's TMA kernel (the producer widens in the slots): (head_dim, cta_tile_kv, num_stages, schedule)
TMA = [(64, 128, 2, "pingpong"), (128, 128, 2, "pingpong"), (128, 128, 3, "pingpong"), (128, 128, 2, "serial"),
       (128, 64, 2, "overlap"), (256, 64, 2, "serial")]


@pytest.mark.parametrize("cfg", TMA, ids=lambda c: "d%d_k%d_s%d_%s" % c)
@pytest.mark.parametrize("page", [None, 16, 48, 64], ids=lambda p: "contiguous" if p is None else f"page{p}")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_cache_tma(cfg, page, causal):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernel is sm_90a's")
    d, tk, st, sched = cfg
    spec = attngen.PrefillSpec(head_dim=d, dtype="bf16", varlen=True, paged=page is not None, kv_dtype="fp8_e4m3",
                               cta_tile_q=128, cta_tile_kv=tk, num_warps=8, num_stages=st, mma="wgmma",
                               pipeline="tma", schedule=sched)
    run_case(LQ, LK, d=d, page=page, causal=causal, spec=spec, twin=True)


@pytest.mark.parametrize("q_mul", [2.0**17, 2.0**-20, 1e-30], ids=["2^17", "2^-20", "1e-30"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_cache_tma_bf16_q_of_any_magnitude(q_mul, fmt):
    # The bf16-q TMA kernel's MMAs run in fp16 over q times 2^k: q past fp16's range (2^17), in its subnormals
    # (2^-20) or past them (1e-30) is as exact as at 1 (a q carried into fp16 unscaled would be inf, or rounded away).
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernel is sm_90a's")
    assert attngen.resolve(attngen.PrefillSpec(head_dim=128, varlen=True, kv_dtype="fp8_e4m3"), "sm_90a").tma
    run_case(LQ, LK, fmt=fmt, page=16, q_mul=q_mul)
    run_case(LQ, LK, fmt=fmt, q_mul=q_mul, causal=False)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_cache_tma_fp16_many_sequences(fmt):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA kernel is sm_90a's")
    spec = attngen.PrefillSpec(head_dim=128, dtype="fp16", varlen=True, paged=True, kv_dtype=f"fp8_{fmt}",
                               cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=3, mma="wgmma",
                               pipeline="tma", schedule="pingpong")
    lq = [(37 * i) % 300 for i in range(40)]
    lk = [n + (0, 33, 500, 2000)[i % 4] for i, n in enumerate(lq)]
    run_case(lq, lk, dtype=torch.float16, fmt=fmt, page=32, spec=spec, twin=True)


def test_fp8_cache_pinned_mma_sync():
    spec = attngen.PrefillSpec(head_dim=128, varlen=True, paged=True, kv_dtype="fp8_e4m3", cta_tile_q=64,
                               cta_tile_kv=64, num_warps=4, num_stages=2, mma="mma_sync", pipeline="sync")
    run_case(LQ, LK, page=16, spec=spec)


def test_flash_attn_varlen_func_fp8_cache_takes_fa3_descales():
    gen = fresh_generator()
    q = torch.randn(64, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(64, 2, 128, device="cuda", generator=gen)
    v = torch.randn(64, 2, 128, device="cuda", generator=gen)
    k8, v8 = (k / 0.1).to(torch.float8_e4m3fn), (v / 0.2).to(torch.float8_e4m3fn)
    cu = torch.tensor([0, 64], dtype=torch.int32, device="cuda")
    a = attngen.prefill_varlen(q, k8, v8, cu, cu, 64, 64, causal=True, k_scale=0.1, v_scale=0.2)
    b = attngen.flash_attn_varlen_func(q, k8, v8, cu, cu, 64, 64, causal=True, k_descale=0.1, v_descale=0.2)
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    ro, _ = reference_attention(q.float()[None], (k8.float() * 0.1)[None], (v8.float() * 0.2)[None], causal=True)
    assert rel(a.float()[None], ro) <= TOL[torch.bfloat16]


def test_fp8_cache_refusals():
    q = torch.randn(8, 4, 128, device="cuda").to(torch.bfloat16)
    k8 = torch.randn(8, 2, 128, device="cuda").to(torch.float8_e4m3fn)
    cu = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    with pytest.raises(attngen.LaunchError, match="k_scale"):  # a scale with a 16-bit cache
        attngen.prefill_varlen(q, q[:, :2], q[:, :2], cu, cu, 8, 8, k_scale=0.5)
    with pytest.raises(attngen.LaunchError, match="k_scale"):  # on the host
        attngen.prefill_varlen(q, k8, k8, cu, cu, 8, 8, k_scale=torch.ones(2))
    with pytest.raises((attngen.LaunchError, attngen.SpecError)):  # softcap has no fp8-cache form
        attngen.prefill_varlen(q, k8, k8, cu, cu, 8, 8, softcap=30.0)
    with pytest.raises(attngen.LaunchError):  # k and v in different formats
        attngen.prefill_varlen(q, k8, k8.to(torch.float32).to(torch.float8_e5m2), cu, cu, 8, 8)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_flash_attn_with_kvcache_many_tokens_over_an_fp8_cache(paged):
    # past 8 new tokens: appended (quantised, read back and compared), then the prefill kernel over the fp8 cache
    gen = fresh_generator()
    b, h, hk, d, cap, new = 2, 8, 2, 128, 512, 40
    old = [100, 37]
    q = torch.randn(b, new, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    kn = torch.randn(b, new, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
    vn = torch.randn(b, new, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
    ks = 0.05 + 0.3 * torch.rand(hk, device="cuda", generator=gen)
    vs = 0.05 + 0.3 * torch.rand(hk, device="cuda", generator=gen)
    kc = (torch.randn(b, cap, hk, d, device="cuda", generator=gen) / ks[:, None]).to(torch.float8_e4m3fn)
    vc = (torch.randn(b, cap, hk, d, device="cuda", generator=gen) / vs[:, None]).to(torch.float8_e4m3fn)
    if paged:  # row i's positions in blocks i * cap / 16 onwards (the same bytes as the contiguous cache)
        table = torch.arange(b * cap // 16, dtype=torch.int32, device="cuda").view(b, cap // 16)
        kk, vv = kc.view(b * cap // 16, 16, hk, d), vc.view(b * cap // 16, 16, hk, d)
    else:
        table, kk, vv = None, kc, vc
    out = attngen.flash_attn_with_kvcache(q, kk, vv, k=kn, v=vn, cache_seqlens=torch.tensor(old, dtype=torch.int32,
                                                                                         device="cuda"),
                                         block_table=table, causal=True, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    for i in range(b):
        want = (kn[i].float() / ks[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(kc[i, old[i]:old[i] + new].view(torch.uint8), want.view(torch.uint8)), "the append"
        n = old[i] + new
        ro, _ = reference_attention(q[i:i + 1].float(), (kc[i, :n].float() * ks[:, None])[None],
                                    (vc[i, :n].float() * vs[:, None])[None], causal=True)
        assert rel(out[i:i + 1].float(), ro) <= TOL[torch.bfloat16], f"row {i}"
