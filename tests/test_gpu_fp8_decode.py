"""attngen.decode with fp8 KV caches on a real GPU (pytest -m gpu), against an fp32 reference computed from the
DEQUANTISED cache (k_scale * K_fp8, v_scale * V_fp8).

The caches are built as tests/test_gpu_decode.py builds its own (every position a row must not read holds NaN,
which stays NaN in fp8), then quantised: K / k_scale rounded to fp8. Outputs are poisoned with NaN before each call.

Tolerance: that of the 16-bit decode tests (test_gpu_decode.TOL, MAX_ABS, LSE_MAX_ABS), not looser. Every fp8 value
is an fp16 value, so the kernel's fp16 MMAs see the cache exactly; the scales multiply fp32 values (k_scale the
logits with the softmax scale, v_scale the fp32 output), so the only roundings are P's (to fp16 for P V: finer than
the 16-bit kernels' bf16 P with a bf16 q) and the fp32 accumulation, on values of the same size (|V| < ~5). A bf16 q
enters the MMAs as fp16 times a power of two, exact but for elements under 2^-28 of the CTA's largest |q|.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator, reference_decode  # noqa: E402
from tests.test_gpu_decode import LSE_MAX_ABS, MAX_ABS, NAN, RAGGED, TOL, Case, rel_l2  # noqa: E402

FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class Fp8Case:
    """A Case (q and a NaN-poisoned cache in q's dtype, contiguous or paged) with its caches quantised to fp8 under
    the given scales: ``scale_kind`` "none" (no scale passed, 1.0), "float", "tensor0" (shape []), "tensor1"
    ([1]) or "head" ([kv_heads])."""

    def __init__(self, lengths, *, fmt="e4m3", scale_kind="float", **kw):
        self.base = Case(lengths, **kw)
        c = self.base
        hk = c.k_cache.shape[2]
        gen = fresh_generator()
        self.scale_kind = scale_kind
        if scale_kind == "none":
            ks = vs = torch.ones(hk, device="cuda")
        elif scale_kind == "head":
            ks = 0.05 + 0.3 * torch.rand(hk, device="cuda", generator=gen)
            vs = 0.05 + 0.3 * torch.rand(hk, device="cuda", generator=gen)
        else:
            ks = torch.full((hk,), 0.05 + 0.3 * torch.rand(1, generator=gen, device="cuda").item(), device="cuda")
            vs = torch.full((hk,), 0.05 + 0.3 * torch.rand(1, generator=gen, device="cuda").item(), device="cuda")
        dt = FMTS[fmt]
        # |x| < ~5, scales >= 0.05: |x / scale| < ~100, inside both formats' finite range (torch's cast is not
        # saturating)
        self.k8 = (c.k_cache.float() / ks[:, None]).to(dt)
        self.v8 = (c.v_cache.float() / vs[:, None]).to(dt)
        self.kd = self.k8.float() * ks[:, None]  # the dequantised cache (NaN where the cache was poisoned)
        self.vd = self.v8.float() * vs[:, None]
        if scale_kind == "float":
            self.k_scale, self.v_scale = ks[0].item(), vs[0].item()
            self.kd = self.k8.float() * self.k_scale
            self.vd = self.v8.float() * self.v_scale
        elif scale_kind == "tensor0":
            self.k_scale, self.v_scale = ks[0].clone().reshape(()), vs[0].clone().reshape(())
        elif scale_kind == "tensor1":
            self.k_scale, self.v_scale = ks[:1].clone(), vs[:1].clone()
        elif scale_kind == "head":
            self.k_scale, self.v_scale = ks, vs
        else:
            self.k_scale = self.v_scale = None
        self.q, self.dtype, self.lengths, self.seed = c.q, c.dtype, c.lengths, c.seed

    def kwargs(self):
        return self.base.kwargs()

    def reference(self, sm_scale=None, **kw):
        c = self.base
        return reference_decode(c.q, self.kd, self.vd, c.seqlens, cache_batch_idx=c.cache_batch_idx,
                                block_table=c.block_table, sm_scale=sm_scale, **kw)


def check(case, o, lse, **ref_kw):
    b, ql, h, d = case.q.shape
    assert o.shape == (b, ql, h, d) and o.dtype == case.dtype
    ref_o, ref_l = case.reference(**ref_kw)
    at = f"lengths {case.lengths}, seed {case.seed}, scales {case.scale_kind}"
    assert torch.isfinite(o).all(), f"{int((~torch.isfinite(o)).sum())} unwritten (NaN) or non-finite outputs; {at}"
    err = rel_l2(o, ref_o)
    mx = (o.float() - ref_o).abs().max().item()
    assert err < TOL[case.dtype], f"rel L2 error {err:.3e} (max abs {mx:.3e}); {at}"
    assert mx < MAX_ABS[case.dtype], f"max abs error {mx:.3e} (rel L2 {err:.3e}); {at}"
    empty = torch.isinf(ref_l).transpose(1, 2)
    if empty.any():
        assert (o[empty] == 0).all(), f"a query that sees no key must give zeros; {at}"
    if lse is not None:
        assert not torch.isnan(lse).any(), f"NaN in the LSE; {at}"
        fin = torch.isfinite(ref_l)
        assert torch.equal(torch.isfinite(lse), fin), f"LSE finite where the reference is -inf, or the reverse; {at}"
        if fin.any():
            lerr = (lse[fin] - ref_l[fin]).abs().max().item()
            assert lerr < LSE_MAX_ABS, f"LSE max abs error {lerr:.3e}; {at}"
    return err


def run(case, *, num_splits=0, sm_scale=None, spec=None, k8=None, v8=None, **kw):
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.decode(case.q, case.k8 if k8 is None else k8, case.v8 if v8 is None else v8, **case.kwargs(),
                            num_splits=num_splits, sm_scale=sm_scale, return_lse=True, out=out, spec=spec,
                            k_scale=case.k_scale, v_scale=case.v_scale, **kw)
    torch.cuda.synchronize()
    assert o is out
    return check(case, o, lse, sm_scale=sm_scale, **kw)


@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("q_len", [1, 4])
def test_contiguous_ragged(fmt, dtype, d, q_len):
    run(Fp8Case(RAGGED, fmt=fmt, q_len=q_len, heads=8, kv_heads=2, head_dim=d, dtype=dtype))


@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("block_size", [16, 48])
def test_paged(fmt, d, block_size):
    run(Fp8Case(RAGGED, fmt=fmt, scale_kind="head", q_len=2, heads=8, kv_heads=2, head_dim=d, dtype=torch.bfloat16,
                block_size=block_size))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_views_of_wider_pools(d, num_splits):
    # k and v as views of one [blocks, 2, page, kv_heads, head_dim] pool (vLLM's: a block stride of two pages) and
    # the table a slice of a wider one: the kernel forms its offsets from the views' own strides
    case = Fp8Case([1, 17, 300, 2000], fmt="e4m3", scale_kind="head", q_len=1, heads=16, kv_heads=4, head_dim=d,
                   dtype=torch.bfloat16, block_size=16)
    pool = torch.empty((case.k8.shape[0], 2, *case.k8.shape[1:]), dtype=torch.uint8, device="cuda")
    pool[:, 0] = case.k8.view(torch.uint8)
    pool[:, 1] = case.v8.view(torch.uint8)
    pool = pool.view(case.k8.dtype)
    table = case.base.block_table
    wide = torch.full((table.shape[0], table.shape[1] + 7), -1, dtype=torch.int32, device="cuda")
    wide[:, :table.shape[1]] = table
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.decode(case.q, pool[:, 0], pool[:, 1], cache_seqlens=case.base.seqlens, num_splits=num_splits,
                            block_table=wide[:, :table.shape[1]], return_lse=True, out=out, k_scale=case.k_scale,
                            v_scale=case.v_scale)
    torch.cuda.synchronize()
    check(case, o, lse)


@pytest.mark.parametrize("d", [32, 48, 80, 96, 112, 144, 160, 192, 240])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_head_dims(d, paged):
    # swizzled fp8 rows at 32 (2 chunks, 4 rows a 128-byte line); padded rows at an odd chunk count (48: 3, 80: 5, 112:
    # 7, 144: 9, 240: 15; their last chunk's fragments are x2 reads) and at 96, 160, 192 (6, 10, 12 chunks, padded to
    # the next odd count); the padded rows' copies step over (row, chunk) pairs
    fmt, dtype = ("e4m3", torch.bfloat16) if paged else ("e5m2", torch.float16)
    run(Fp8Case(RAGGED, fmt=fmt, scale_kind="head", q_len=2, heads=8, kv_heads=2, head_dim=d, dtype=dtype,
                block_size=32 if paged else None))


@pytest.mark.parametrize("d,rows,spec", [(64, 16, "decode:cta_tile_kv=64,num_warps=4,num_stages=1"),
                                         (64, 16, "decode:cta_tile_kv=128,num_warps=8,num_stages=2"),
                                         (32, 32, "decode:cta_tile_kv=64,num_warps=8,num_stages=3"),
                                         (128, 64, "decode:cta_tile_kv=16,num_warps=4,num_stages=4"),
                                         (256, 16, "decode:cta_tile_kv=128,num_warps=8,num_stages=2"),
                                         (256, 32, "decode:cta_tile_kv=32,num_warps=4,num_stages=1")])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_tilings(d, rows, spec, paged):
    # a thread's copies of a tile (rows STEP apart; at head_dim 32 with 8 warps more threads a chunk than rows), one
    # to four ring stages, warps splitting the keys and the rows (rows packed query rows: q_len 2, GQA group rows / 2)
    run(Fp8Case(RAGGED, fmt="e4m3", scale_kind="float", q_len=2, heads=rows, kv_heads=2, head_dim=d,
                dtype=torch.bfloat16, block_size=16 if paged else None), spec=spec)


@pytest.mark.parametrize("scales", [(1e2, 1e2), (1e-5, 1e-5), (1e-5, 1.0), (3e3, 1e-3)], ids=str)
def test_bf16_q_magnitudes(scales):
    # a bf16 q enters the fp16 MMAs times 2^k, the CTA's largest finite |q| put in [2^14, 2^15): large and tiny q,
    # and CTAs whose rows differ by up to 2^21 in size (one query head of each group scaled by the first factor, the
    # others by the second)
    case = Fp8Case(RAGGED, fmt="e4m3", scale_kind="head", q_len=1, heads=8, kv_heads=2, head_dim=128,
                   dtype=torch.bfloat16)
    f = torch.tensor([scales[0], scales[1], scales[1], scales[1]] * 2, device="cuda")
    case.q = case.base.q = (case.base.q.float() * f[:, None]).to(torch.bfloat16)
    run(case)


@pytest.mark.parametrize("scale_kind", ["none", "float", "tensor0", "tensor1", "head"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_every_form_of_the_scales(scale_kind, paged):
    run(Fp8Case([1, 65, 1000, 3000], fmt="e4m3", scale_kind=scale_kind, heads=16, kv_heads=4, head_dim=128,
                dtype=torch.bfloat16, block_size=32 if paged else None), sm_scale=0.07)


@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("q_len", [1, 2, 3, 8])
def test_gqa_and_q_len(group, q_len):
    if group * q_len > 128:
        pytest.skip("past 128 packed rows")
    run(Fp8Case([0, 1, 7, 129, 1000, 4097], fmt="e5m2", scale_kind="head", q_len=q_len, heads=group * 2, kv_heads=2,
                head_dim=128, dtype=torch.float16))


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "merge_launch"])
@pytest.mark.parametrize("num_splits", [0, 1, 3, 8, 64])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_split_kv(num_splits, cluster, paged):
    # each split's output carries v_scale before the merge (cluster or launch), so the merge itself is unchanged
    from attngen.families.decode import op

    was = op.set_cluster_merge(op.CLUSTER_MAX if cluster else 0)
    try:
        run(Fp8Case([0, 1, 17, 129, 1000, 4097, 300, 2000], fmt="e4m3", scale_kind="head", q_len=2, heads=32,
                    kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=48 if paged else None),
            num_splits=num_splits)
    finally:
        op.set_cluster_merge(was)


def test_cluster_merge_is_taken():
    # A spec whose CTAs hold an SM each with a 4-stage ring (cluster_limit's conditions): on sm_90 the splits of a
    # row merge in a cluster (at least the two-split call's), the normalised partials carrying v_scale as with the
    # merge launch.
    from attngen.families.decode import op

    spec = "decode:kv_dtype=fp8_e4m3,cta_tile_kv=128,num_warps=8,num_stages=4"
    case = Fp8Case([0, 1, 17, 129, 1000, 4097, 300, 2000], fmt="e4m3", scale_kind="head", q_len=2, heads=32,
                   kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    was = op.set_cluster_merge(op.CLUSTER_MAX)  # (also forgets the calls worked out so far)
    try:
        for splits in (2, 5, 8):
            run(case, num_splits=splits, spec=spec)
        calls = [c for c in op._calls.values() if c.grid is not None]
    finally:
        op.set_cluster_merge(was)
    if torch.cuda.get_device_capability() == (9, 0):
        # two splits merge in a cluster there; five and eight may take the merge launch (how many clusters of that
        # size the device holds at once decides), which the same run checked against the reference too
        assert any(c.cluster and c.grid[0] == 2 for c in calls), [(c.grid, c.cluster) for c in calls]


@pytest.mark.parametrize("window", [(100, 0), (0, 0), (-1, -1)])
def test_window(window):
    case = Fp8Case([1, 65, 1000, 4097], fmt="e4m3", scale_kind="float", q_len=3, heads=8, kv_heads=2, head_dim=128,
                   dtype=torch.bfloat16)
    run(case, window=window, causal=window != (-1, -1))


def test_bytes_with_the_spec_kv_dtype():
    # uint8 caches (torch here, CuPy below) name their format through the spec
    case = Fp8Case([5, 300, 2049], fmt="e5m2", scale_kind="head", q_len=1, heads=8, kv_heads=2, head_dim=128,
                   dtype=torch.float16)
    run(case, k8=case.k8.view(torch.uint8), v8=case.v8.view(torch.uint8), spec="decode:kv_dtype=fp8_e5m2")
    cp = pytest.importorskip("cupy")
    out = attngen.decode(cp.asarray(case.q), cp.asarray(case.k8.view(torch.uint8)),
                         cp.asarray(case.v8.view(torch.uint8)), cache_seqlens=cp.asarray(case.base.seqlens),
                         k_scale=cp.asarray(case.k_scale), v_scale=cp.asarray(case.v_scale),
                         spec="decode:kv_dtype=fp8_e5m2")
    cp.cuda.get_current_stream().synchronize()
    check(case, torch.as_tensor(out, device="cuda"), None)


def _widen_module(tmp_path):
    """The conversions of templates/common/fp8.cuh in a module of their own,
    with a kernel that widens every pair of bytes every way the kernel does: the arch's path and the bit-level one
    for a pair, and the two four-byte forms the fragments take (K's: bytes (0, 1) and (2, 3); V's: bytes (0, 2) and
    (1, 3)). Built as the kernels are (attngen's NVRTC compile, a cubin for the device's arch) and loaded through
    CuPy."""
    cp = pytest.importorskip("cupy")
    from attngen.compiler import compile
    from attngen.runtime import device_arch

    root = Path(__file__).resolve().parent.parent / "templates"
    convert = (root / "common" / "fp8.cuh").read_text()  # (the conversions decode's and MLA's fp8 kernels share)
    src = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n" + (root / "common" / "ptx.cuh").read_text() + convert
           + r"""
namespace attngen {
template <int FMT>
__device__ void widen_all(unsigned* out) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;  // the pair of bytes (i & 0xff, i >> 8)
  if (i < 65536u) {
    out[i] = fp8x2_to_f16x2<FMT>(i);
    out[65536 + i] = FMT == 1 ? e4m3x2_to_f16x2_bits(i) : fp8x2_to_f16x2<2>(i);
    // the four bytes (lo, hi, lo, hi): K's pairs are both (lo, hi), V's (lo, lo) and (hi, hi)
    fp8x4_to_f16x2<FMT>(i | (i << 16), out[2 * 65536 + i], out[3 * 65536 + i]);
    fp8x4_split_f16<FMT>(i | (i << 16), out[4 * 65536 + i], out[5 * 65536 + i]);
  }
}
}  // namespace attngen
extern "C" __global__ void widen_e4m3(unsigned* out) { attngen::widen_all<1>(out); }
extern "C" __global__ void widen_e5m2(unsigned* out) { attngen::widen_all<2>(out); }
""")
    cubin = tmp_path / "widen.cubin"
    cubin.write_bytes(compile(src, device_arch(torch.cuda.current_device()), kernel_name="widen_e4m3").cubin)
    return cp, cp.RawModule(path=str(cubin))


@pytest.mark.parametrize("fmt", list(FMTS))
def test_widening_is_exact_both_ways(fmt, tmp_path):
    # the GPU runs the cvt form (sm_89+) for e4m3; the bit-level form sm_80/86 run is checked here too, on the chip
    cp, mod = _widen_module(tmp_path)
    out = cp.zeros(6 * 65536, dtype=cp.uint32)
    mod.get_function(f"widen_{fmt}")((256,), (256,), (out,))
    cp.cuda.get_current_stream().synchronize()
    got = torch.as_tensor(out.view(cp.int32), device="cuda").cpu().view(torch.float16).float().view(6, 65536, 2)
    pairs = torch.arange(65536, dtype=torch.int32)
    lo = (pairs & 0xFF).to(torch.uint8).view(FMTS[fmt]).float()
    hi = (pairs >> 8).to(torch.uint8).view(FMTS[fmt]).float()
    want = {0: (lo, hi), 1: (lo, hi), 2: (lo, hi), 3: (lo, hi), 4: (lo, lo), 5: (hi, hi)}
    for form, refs in want.items():
        for col, ref in enumerate(refs):
            g = got[form, :, col]
            nan = torch.isnan(ref)
            assert torch.equal(torch.isnan(g), nan), (fmt, form, col)
            assert torch.equal(g[~nan], ref[~nan]), (fmt, form, col)


@pytest.mark.parametrize("fmt", list(FMTS))
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("n_new", [1, 4])
def test_flash_attn_with_kvcache_quantises_the_append(fmt, paged, n_new):
    # the new tokens land in the caller's cache as k / k_scale rounded to the format (saturating), read back and
    # compared byte for byte; the queries then attend over the dequantised cache, the new tokens included
    case = Fp8Case([0, 17, 300, 1000], fmt=fmt, scale_kind="head", q_len=n_new, heads=8, kv_heads=2, head_dim=128,
                   dtype=torch.bfloat16, block_size=32 if paged else None, pad=n_new + 3)
    gen = fresh_generator()
    b, hk, d = case.q.shape[0], 2, 128
    k_new = torch.randn(b, n_new, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
    v_new = torch.randn(b, n_new, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
    k_new[0, 0, 0, :2] = torch.tensor([1e6, -1e6])  # past every format's range: saturates
    old = case.base.seqlens.clone()
    top = torch.finfo(FMTS[fmt]).max
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.flash_attn_with_kvcache(case.q, case.k8, case.v8, k=k_new, v=v_new, cache_seqlens=old,
                                             causal=True, k_scale=case.k_scale, v_scale=case.v_scale,
                                             return_softmax_lse=True, **({"block_table": case.base.block_table}
                                                                         if paged else {}))
    torch.cuda.synchronize()
    ks, vs = case.k_scale[:, None], case.v_scale[:, None]
    want_k = (k_new.float() / ks).clamp(-top, top).to(FMTS[fmt])
    want_v = (v_new.float() / vs).clamp(-top, top).to(FMTS[fmt])
    bs = case.k8.shape[1]
    for i, n in enumerate(case.lengths):
        for j in range(n_new):
            pos = n + j
            at = (case.base.block_table[i, pos // bs].item(), pos % bs) if paged else (i, pos)
            assert torch.equal(case.k8[at].view(torch.uint8), want_k[i, j].view(torch.uint8)), (i, j)
            assert torch.equal(case.v8[at].view(torch.uint8), want_v[i, j].view(torch.uint8)), (i, j)
    assert case.k8[(case.base.block_table[0, 0].item(), 0) if paged else (0, 0)][0, 0].float().item() == top
    # the reference over the cache as it is now (dequantised), each row n + n_new long
    case.kd, case.vd = case.k8.float() * ks, case.v8.float() * vs
    case.base.seqlens = old + n_new
    check(case, o, lse)


@pytest.mark.parametrize("num_splits", [1, 3, 0])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_sinks_with_an_fp8_cache(num_splits, paged):
    # the fp8 kernels end through the same DecodeEnd as the 16-bit ones: the sink joins there, or in the merge
    case = Fp8Case([0, 1, 300, 3000], fmt="e4m3", scale_kind="head", q_len=2, heads=8, kv_heads=2, head_dim=128,
                   dtype=torch.bfloat16, block_size=16 if paged else None)
    sinks = 2 * torch.randn(8, device="cuda", generator=fresh_generator())
    sinks[0], sinks[1] = 40.0, float("-inf")
    run(case, num_splits=num_splits, sinks=sinks)
