"""attngen.mla_decode with fp8 latent caches on a real GPU (pytest -m gpu), against an fp32 reference computed from
the DEQUANTISED cache (k_scale * ckv_fp8, k_scale * kpe_fp8).

The caches are built as tests/test_gpu_mla_decode.py builds its own (every position a row must not read, and every
paged block no table names, holds NaN, which stays NaN in fp8; the contiguous rows sit in a NaN-padded buffer), then
quantised: x / k_scale rounded to fp8. The queries sit inside NaN buffers, the output inside a sentinel border, and
it is poisoned with NaN before each call.

Error bound: that of the 16-bit MLA tests (test_gpu_mla_decode.TOL: relative L2 of O under 2e-2 with a bf16 q and
output, 4e-3 with fp16; the LSE within 2e-2 absolute), not looser. Every fp8 value is an fp16 value, so the kernel's
fp16 MMAs see the cache exactly; k_scale multiplies fp32 values (the logits with the softmax scale, the fp32 output),
so the only roundings are P's (to fp16 for P V: finer than the 16-bit kernels' bf16 P with a bf16 q), the fp32
accumulation and the output's own rounding. A bf16 q enters the MMAs as fp16 times a power of two chosen per CTA,
exact but for elements under 2^-28 of the CTA's largest |q| (the scaled-q cases below move that range).

64 and 128 heads (64 packed rows and more) on sm_90a run the wgmma kernel, which widens each tile in shared memory into
q's dtype (exact too: every e4m3 and e5m2 value is a bf16 and an fp16 value) and keeps q as it is; its roundings are
the 16-bit wgmma kernel's (P in q's dtype). Each case asserts which kernel ran (run_case's ``expect``), so that a
change of routing cannot pass these tests on the other kernel.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.families.mla_decode import op as _op  # noqa: E402
from tests.gpu_reference import check_output_and_lse, fresh_generator, reference_mla  # noqa: E402
from tests.test_gpu_mla_decode import NAN, SENTINEL, TOL, _inside_nan, shuffled_table  # noqa: E402

FMTS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _table(b: int, per_row: int, gen):
    """Shuffled blocks with a gap of unnamed ones among them."""
    return shuffled_table(b, per_row, int(gen.initial_seed() % 2**31))


def make_fp8_cache(seqlens, dim, dt, k_scale: float, gen, block_size=None, table=None):
    """(the fp8 cache, its dequantised live part [b, cap, dim] in fp32 with NaN past each length). Contiguous: a
    [b, cap, dim] view of a buffer with 16 NaN bytes past each row and a NaN row past the last (fp8 rows keep strides
    that are multiples of 16). Paged: a pool [num_blocks, block_size, dim]; blocks no table names and slots past a
    length hold NaN. Normal x (|x| < 22 in practice) over k_scale >= 0.05 stays inside both formats' finite range
    (e4m3: 448; torch's cast does not saturate)."""
    b = len(seqlens)
    cap = max(max(seqlens), 1)
    dense = torch.randn((b, cap, dim), device="cuda", generator=gen)
    for i, n in enumerate(seqlens):
        dense[i, n:] = NAN
    raw = dense / k_scale
    deq = raw.to(dt).float() * k_scale
    # laid out in fp32, then cast whole (torch's indexing does not take fp8 tensors in every build)
    if block_size is None:
        buf = torch.full((b, cap + 1, dim + 16), NAN, device="cuda")
        buf[:, :cap, :dim] = raw
        return buf.to(dt)[:, :cap, :dim], deq
    blocks = table.cpu()
    pool = torch.full((int(blocks.max()) + 3, block_size, dim), NAN, device="cuda")
    for i in range(b):
        for j in range(-(-seqlens[i] // block_size)):
            n = min(block_size, seqlens[i] - j * block_size)
            pool[int(blocks[i, j]), :n] = raw[i, j * block_size: j * block_size + n]
    return pool.to(dt), deq


def _wgmma_here() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


def _expected(heads: int, q_len: int, spec) -> str:
    """The kernel a call should run: "wgmma" for 64 packed rows and more on sm_90a (unless the spec pins mma.sync),
    else "mma_sync"."""
    pinned = spec is not None and "mma=mma_sync" in spec
    return "wgmma" if heads * q_len >= 64 and _wgmma_here() and not pinned else "mma_sync"


def run_case(seqlens, heads, *, fmt="e4m3", dtype=torch.bfloat16, q_len=1, block_size=None, num_splits=0,
             scale_kind="float", q_mul=1.0, rank=512, rope=64, spec=None, expect=None):
    """One call against the reference; ``expect``: the kernel it must run ("wgmma" or "mma_sync"; None: by _expected).
    Returns the error."""
    gen = fresh_generator()
    b = len(seqlens)
    q_nope = _inside_nan((b, q_len, heads, rank), dtype, gen)
    q_pe = _inside_nan((b, q_len, heads, rope), dtype, gen)
    if q_mul != 1.0:
        q_nope.mul_(q_mul)
        q_pe.mul_(q_mul)
    table = _table(b, max(1, -(-max(seqlens) // block_size)), gen) if block_size else None
    ks = 0.05 + 0.3 * torch.rand(1, generator=gen, device="cuda").item()
    dt = FMTS[fmt]
    ckv, ckv_ref = make_fp8_cache(seqlens, rank, dt, ks, gen, block_size, table)
    kpe, kpe_ref = make_fp8_cache(seqlens, rope, dt, ks, gen, block_size, table)
    k_scale = {"float": ks, "tensor0": torch.tensor(ks, device="cuda"),
               "tensor1": torch.tensor([ks], device="cuda")}[scale_kind]
    sm_scale = 1.0 / (rank // 4 + rope) ** 0.5 / q_mul  # (the logits as at q_mul 1: q's range alone varies)
    obuf = torch.full((b, q_len + 2, heads, rank + 8), SENTINEL, dtype=dtype, device="cuda")
    out = obuf[:, 1:1 + q_len, :, :rank]
    out.fill_(NAN)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    used = []
    real_get_kernel = _op.get_kernel

    def spy(s, **kw):
        used.append(s)
        return real_get_kernel(s, **kw)

    _op.get_kernel = spy
    try:
        o, lse = attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, block_table=table,
                                    sm_scale=sm_scale, num_splits=num_splits, return_lse=True, out=out,
                                    k_scale=k_scale, spec=spec)
    finally:
        _op.get_kernel = real_get_kernel
    torch.cuda.synchronize()
    ran = used[-1]
    want = expect or _expected(heads, q_len, spec)
    assert ran.kv_dtype is not None and ran.mma.value == want, (want, ran.to_text())
    assert o is out
    border = obuf.clone()
    border[:, 1:1 + q_len, :, :rank] = SENTINEL
    assert (border == SENTINEL).all(), "a write landed outside the output"
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite output elements: a stray read or no write"
    ref_o, ref_l = reference_mla(q_nope, q_pe, ckv_ref, kpe_ref, seqlens, sm_scale)
    return check_output_and_lse(o, lse, ref_o, ref_l, TOL[dtype])


# lengths 1..4k, tile multiples and not (the kernels' tiles are 16-64 keys)
LENGTHS = {1: [[1], [63], [4096], [4001]], 4: [[1, 17, 64, 129], [4096, 1000, 65, 2049]],
           32: [[(37 * i) % 4096 + 1 for i in range(32)]]}


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("batch", [1, 4, 32])
@pytest.mark.parametrize("block_size", [None, 64], ids=["contiguous", "paged64"])
def test_fp8_mla_matches_the_dequantised_reference(fmt, dtype, heads, batch, block_size):
    for seqlens in LENGTHS[batch]:
        run_case(seqlens, heads, fmt=fmt, dtype=dtype, block_size=block_size)


@pytest.mark.parametrize("num_splits", [1, 3, 7, 32])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_fp8_mla_split_counts(num_splits, heads):
    # more splits than a short row has tiles leave late splits empty; the merge still sees each split's LSE
    run_case([4096, 333, 1], heads, num_splits=num_splits)
    run_case([2500, 64], heads, fmt="e5m2", dtype=torch.float16, block_size=64, num_splits=num_splits)


@pytest.mark.parametrize("scale_kind", ["float", "tensor0", "tensor1"])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_fp8_mla_scales_and_tokens(scale_kind, q_len):
    run_case([1500, 77], 16, q_len=q_len, scale_kind=scale_kind)
    run_case([700], 32, q_len=q_len, scale_kind=scale_kind, block_size=64, dtype=torch.float16)


@pytest.mark.parametrize("q_mul", [1e-4, 40.0, 2.0**17, 2.0**-24], ids=["1e-4", "40", "2^17", "2^-24"])
def test_fp8_mla_bf16_q_far_from_one(q_mul):
    """A bf16 q far below or above 1, past fp16's range or under its subnormals, still lands in fp16 (its power of
    two), on the mma.sync kernel (16 heads) and the wgmma one (128), as the output shows."""
    run_case([3000, 90], 16, q_mul=q_mul)
    run_case([513], 128, q_mul=q_mul, block_size=64)


def test_fp8_mla_small_dims():
    run_case([1000, 31], 16, rank=256, rope=32)
    run_case([640], 128, rank=256, rope=32, fmt="e5m2", block_size=64)


# --- the wgmma kernel (sm_90a, 64 packed rows and more) -------------------------------------------------------------
needs_wgmma = pytest.mark.skipif(not torch.cuda.is_available() or not _wgmma_here(), reason="needs sm_90a (H100/H200)")


@needs_wgmma
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("block_size", [1, 24])
def test_fp8_mla_page_rows(fmt, heads, block_size):
    """An fp8 cache in blocks that are not a multiple of 16 (page 1 among them): the mma.sync kernel on the cp.async
    ring, every key row's block looked up, 64 and 128 heads included (the wgmma kernel's tiles come off the TMA ring
    only)."""
    run_case([1, 17, 64, 129, 1000], heads, fmt=fmt, block_size=block_size, expect="mma_sync")
    run_case([2049, 31], heads, fmt=fmt, dtype=torch.float16, block_size=block_size, num_splits=5, expect="mma_sync")


@pytest.mark.parametrize("block_size", [16, 48, 128], ids=lambda b: f"paged{b}")
@pytest.mark.parametrize("heads", [64, 128])
def test_fp8_mla_wgmma_paged_boxes(block_size, heads):
    """Blocks whose largest power-of-two divisor is under 32 keys (TMA boxes of 16 rows, a tile from several blocks)
    and over (boxes of 32), e4m3 and e5m2, with and without splits."""
    run_case([1, 17, 64, 129, 1000], heads, block_size=block_size)
    run_case([2049, 31], heads, fmt="e5m2", dtype=torch.float16, block_size=block_size, num_splits=5)


@needs_wgmma
@pytest.mark.parametrize("pin", ["qk_shard=false", "cta_tile_kv=32", "cta_tile_kv=32,num_stages=2",
                                 "qk_shard=false,cta_tile_kv=32"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_mla_wgmma_pinned_forms(pin, fmt):
    """The wgmma kernel's other tile forms a spec may pin (unsharded S; 32-key tiles, one unit a block, 2-4 stages)."""
    spec = f"mla_decode:kv_dtype=fp8_{fmt},mma=wgmma,{pin}"
    run_case([4001, 33, 1, 64], 128, fmt=fmt, spec=spec, expect="wgmma")
    run_case([700, 95], 64, fmt=fmt, dtype=torch.float16, block_size=64, spec=spec, expect="wgmma")


@needs_wgmma
@pytest.mark.parametrize("q_len", [2, 4])
def test_fp8_mla_wgmma_tokens(q_len):
    """Several new tokens: 32 heads x 2 tokens is one 64-row block, 64 heads x 4 tokens four, 32 x 4 two; each token
    sees its own prefix."""
    run_case([1500, 77, 3], 32 if q_len == 2 else 64, q_len=q_len)
    run_case([700], 32, q_len=q_len, block_size=64, dtype=torch.float16, fmt="e5m2")


@needs_wgmma
def test_fp8_mla_wgmma_and_mma_sync_agree():
    """The two fp8 kernels on the same call (the mma.sync one pinned): each within the bound of the reference."""
    for kernel in ("mma_sync", "wgmma"):
        run_case([3000, 130], 128, spec=f"mla_decode:mma={kernel}", expect=kernel)
