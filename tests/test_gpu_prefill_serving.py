"""Prefill for serving on a real GPU (pytest -m gpu): custom masks walked through live-tile plans,
varlen batches and paged KV, against an fp32 reference.

Inputs sit inside larger NaN-filled buffers (and paged caches hold NaN in every slot past a
sequence's length and in every block no table names), outputs are written into NaN-poisoned
views of a sentinel-filled buffer: a stray read turns the output NaN, a stray write changes the
sentinel, an unwritten element stays NaN.
"""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.errors import LaunchError  # noqa: E402
from attngen.families.prefill.spec import Mma, PrefillSpec  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
SENTINEL = 12345.0
NAN = float("nan")



def _padded(shape, dtype, fill, pad=3):
    """(a view of ``shape`` in the middle of a flat buffer filled with ``fill``, the buffer, the
    slices of ``pad`` rows of filler before and after it)."""
    n = 1
    for s in shape:
        n *= s
    row = shape[-1]
    buf = torch.full((n + 2 * pad * row,), fill, dtype=dtype, device="cuda")
    return buf[pad * row: pad * row + n].view(*shape), buf, (slice(0, pad * row), slice(pad * row + n, None))


def guarded(*shape, dtype, gen, pad=3):
    """A random tensor of ``shape`` inside a NaN-filled buffer: a read past either end brings NaN in."""
    inner, _, _ = _padded(shape, dtype, NAN, pad)
    inner.copy_(torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype))
    return inner


def sentinel_out(shape, dtype, pad=3):
    """(out view poisoned with NaN, the whole buffer, slices of the sentinel around it)."""
    out, buf, guards = _padded(shape, dtype, SENTINEL, pad)
    out.fill_(NAN)
    return out, buf, guards


def check_sentinel(buf, guards):
    for g in guards:
        assert (buf[g] == SENTINEL).all(), "a write landed outside the output"


def reference(q, k, v, keep, scale):
    """fp32 attention. q [B, Sq, H, D], k/v [B, Sk, Hk, D], keep bool broadcastable to [B, H, Sq, Sk].
    Returns out [B, Sq, H, D] and lse [B, H, Sq] (rows that see nothing: zeros, -inf)."""
    b, sq, h, d = q.shape
    hk = k.shape[2]
    qf = q.double().transpose(1, 2)
    kf = k.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vf = v.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vf).transpose(1, 2).float(), lse.float()


def range_keep(sq, sk, causal, window, device="cuda"):
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right >= 0:
        keep &= j <= i + right
    if left >= 0:
        keep &= j >= i - left
    return keep


def rel_l2(out, ref):
    out = out.float()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()


def compare(o, lse, ref_o, ref_l, dtype):
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite output elements"
    err = rel_l2(o, ref_o)
    assert err < TOL[dtype], f"rel L2 error {err:.3e}"
    fin = torch.isfinite(ref_l)
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isfinite(lse), fin), "LSE finite where the reference is -inf, or the reverse"
    assert (lse[~fin] == float("-inf")).all()
    if fin.any():
        assert (lse[fin] - ref_l[fin]).abs().max().item() < 2e-2
    return err


# --- custom masks --------------------------------------------------------------------------------

def block_diag_keep(sq, sk, nseq, gen_py, causal_within=True):
    """llama.cpp's batched layout: ``nseq`` sequences share the KV buffer of ``sk`` cells, each owning
    a contiguous run of cells; its queries are the last cells of its run and see its own cells,
    causally. Sequences get uneven shares."""
    cuts_k = sorted(gen_py.sample(range(1, sk), nseq - 1)) if nseq > 1 else []
    cuts_q = sorted(gen_py.sample(range(1, sq), nseq - 1)) if 1 < nseq <= sq else []
    ks = [0, *cuts_k, sk]
    qs = [0, *cuts_q, sq] if len(cuts_q) == nseq - 1 else [0] * nseq + [sq]
    keep = torch.zeros(sq, sk, dtype=torch.bool)
    for s in range(nseq):
        q0, q1, k0, k1 = qs[s], qs[s + 1], ks[s], ks[s + 1]
        for i in range(q0, q1):
            pos = k1 - (q1 - i)  # the query's own cell: the last cells of its run
            lim = pos + 1 if causal_within else k1
            if lim > k0:
                keep[i, k0:max(k0, lim)] = True
    return keep.cuda()


def mask_of(keep, kind="bool"):
    """The mask a caller passes for ``keep``: bool itself, or additive (0 / -inf) of dtype ``kind``."""
    if kind == "bool":
        return keep
    mdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[kind]
    return torch.zeros(keep.shape, dtype=mdt, device="cuda").masked_fill(~keep, float("-inf"))


def run_masked(b, sq, sk, h, hk, d, dtype, keep4, *, kind="bool", causal=False, window=(-1, -1), spec=None,
               plan=None, check_plan_reuse=False, dv=None):
    gen = fresh_generator()
    dv = dv or d
    q = guarded(b, sq, h, d, dtype=dtype, gen=gen)
    k = guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    v = guarded(b, sk, hk, dv, dtype=dtype, gen=gen)
    mask = mask_of(keep4, kind)
    out, buf, guards = sentinel_out((b, sq, h, dv), dtype)
    if check_plan_reuse:
        plan = attngen.mask_plan(mask, q, k, v=v, causal=causal, window=window, spec=spec)
    o, lse = attngen.prefill(q, k, v, mask=mask, mask_plan=plan, causal=causal, window=window, return_lse=True,
                             out=out, spec=spec)
    torch.cuda.synchronize()
    assert o is out
    check_sentinel(buf, guards)
    k4 = keep4 if keep4.dim() == 4 else keep4[None, None]
    keep = k4 & range_keep(sq, sk, causal, window)
    ref_o, ref_l = reference(q, k, v, keep, d ** -0.5)
    err = compare(o, lse, ref_o, ref_l, dtype)
    if check_plan_reuse:  # the same plan again, on other q/k/v of the same shapes
        q2 = guarded(b, sq, h, d, dtype=dtype, gen=gen)
        o2 = attngen.prefill(q2, k, v, mask=mask, mask_plan=plan, causal=causal, window=window, spec=spec)
        ref2, _ = reference(q2, k, v, keep, d ** -0.5)
        assert rel_l2(o2, ref2) < TOL[dtype]
    return err, mask, plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", ["2d", "b1", "bh"])
@pytest.mark.parametrize("density", [0.5, 0.05])
@pytest.mark.parametrize("sq,sk", [(1, 1), (77, 300), (300, 77), (513, 1025)])
def test_random_masks(dtype, shape, density, sq, sk):
    b, h, hk, d = 2, 4, 2, 128
    gen = fresh_generator()
    dims = {"2d": (sq, sk), "b1": (b, 1, sq, sk), "bh": (b, h, sq, sk)}[shape]
    keep = torch.rand(dims, device="cuda", generator=gen) < density
    run_masked(b, sq, sk, h, hk, d, dtype, keep)


@pytest.mark.parametrize("kind", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (64, 16)), (True, (100, -1))])
def test_additive_masks_with_causal_and_window(kind, causal, window):
    b, h, hk, d, sq, sk = 2, 4, 4, 64, 200, 333
    keep = torch.rand(b, 1, sq, sk, device="cuda", generator=fresh_generator()) < 0.7
    run_masked(b, sq, sk, h, hk, d, torch.bfloat16, keep, kind=kind, causal=causal, window=window)


@pytest.mark.parametrize("nseq", [1, 2, 7, 32, 64])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_block_diagonal_masks(nseq, d):
    sq, sk = 512, 4096
    keep = block_diag_keep(sq, sk, nseq, random.Random())
    run_masked(1, sq, sk, 8, 2, d, torch.bfloat16, keep, check_plan_reuse=True)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("mma", [Mma.SYNC, Mma.WGMMA])
def test_head_dims_and_instruction_paths(d, mma):
    if mma is Mma.WGMMA and (d % 64 or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("wgmma needs sm_90a and head_dim a multiple of 64")
    keep = block_diag_keep(300, 1000, 5, random.Random()) | (torch.rand(300, 1000, device="cuda") < 0.02)
    run_masked(2, 300, 1000, 4, 1, d, torch.float16, keep, causal=True, spec=PrefillSpec(mma=mma))


@pytest.mark.parametrize("d,dv", [(192, 128), (128, 64)])
@pytest.mark.parametrize("mma", [None, Mma.SYNC, Mma.WGMMA])
def test_narrower_v_custom_mask(d, dv, mma):
    """A plan built with v (mask_plan(..., v=v)) has the tiles of the 192/128 kernel, not 192/192's
    (they differ on sm_90a by default)."""
    if mma is Mma.WGMMA and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90a")
    keep = block_diag_keep(300, 1000, 5, random.Random()) | (torch.rand(300, 1000, device="cuda") < 0.02)
    run_masked(2, 300, 1000, 4, 1, d, torch.bfloat16, keep, causal=True, spec=mma and PrefillSpec(mma=mma), dv=dv,
               check_plan_reuse=True)


def test_dead_rows_and_dead_query_tiles():
    sq, sk = 400, 700
    keep = torch.rand(sq, sk, device="cuda") < 0.3
    keep[:130] = False          # whole query tiles see nothing
    keep[200:205] = False       # single dead rows
    keep[300:, 256:] = False    # tiles dead on one side only
    keep[350:360, :] = True     # and some rows that see every key
    run_masked(1, sq, sk, 2, 2, 128, torch.bfloat16, keep)


def test_all_masked_and_nothing_masked():
    sq, sk = 150, 260
    run_masked(1, sq, sk, 2, 1, 64, torch.bfloat16, torch.zeros(sq, sk, dtype=torch.bool, device="cuda"))
    run_masked(1, sq, sk, 2, 1, 64, torch.bfloat16, torch.ones(sq, sk, dtype=torch.bool, device="cuda"),
               causal=True)


def test_broadcast_by_stride_zero():
    b, h, sq, sk = 3, 4, 90, 170
    base = torch.rand(sq, sk, device="cuda") < 0.4
    run_masked(b, sq, sk, h, h, 64, torch.bfloat16, base[None, None].expand(b, h, sq, sk))


def test_plan_reused_then_refused_when_stale():
    b, h, d, sq, sk = 1, 2, 64, 256, 512
    keep = torch.rand(sq, sk, device="cuda") < 0.5
    _, mask, plan = run_masked(b, sq, sk, h, h, d, torch.bfloat16, keep, check_plan_reuse=True)
    assert plan.tiles[0] in (64, 128) and 0 < plan.live_fraction() <= 1
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, h, d, device="cuda", dtype=torch.bfloat16)
    mask[0, 0] = False  # in place: the plan no longer describes it
    with pytest.raises(LaunchError, match="modified in place"):
        attngen.prefill(q, k, k, mask=mask, mask_plan=plan)
    fresh = attngen.mask_plan(mask, q, k)
    attngen.prefill(q, k, k, mask=mask, mask_plan=fresh)
    with pytest.raises(LaunchError, match="causal/window"):
        attngen.prefill(q, k, k, mask=mask, mask_plan=fresh, causal=True)
    other = mask.clone()
    with pytest.raises(LaunchError, match="another mask"):
        attngen.prefill(q, k, k, mask=other, mask_plan=fresh)
    with pytest.raises(LaunchError, match="tiles of"):
        big = PrefillSpec(cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, mma=Mma.SYNC)
        attngen.prefill(q, k, k, mask=mask, mask_plan=fresh, spec=big)
    q2 = torch.randn(b, sq - 1, h, d, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="seqlen_q=256"):
        attngen.prefill(q2, k, k, mask=mask, mask_plan=fresh)
    with pytest.raises(LaunchError, match="mask has shape"):
        attngen.prefill(q2, k, k, mask=mask)
    with pytest.raises(LaunchError, match="needs the mask"):
        attngen.prefill(q, k, k, mask_plan=fresh)


def test_bad_masks_raise():
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 80, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(LaunchError, match="dtype"):
        attngen.prefill(q, k, k, mask=torch.zeros(64, 80, dtype=torch.int32, device="cuda"))
    with pytest.raises(LaunchError, match="shape"):
        attngen.prefill(q, k, k, mask=torch.ones(64, 81, dtype=torch.bool, device="cuda"))
    with pytest.raises(LaunchError, match="contiguous in the keys"):
        attngen.prefill(q, k, k, mask=torch.ones(80, 64, dtype=torch.bool, device="cuda").t())
    with pytest.raises(LaunchError, match="CUDA"):
        attngen.prefill(q, k, k, mask=torch.ones(64, 80, dtype=torch.bool))


def test_plan_check_flags_non_binary_additive():
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 80, 2, 64, device="cuda", dtype=torch.bfloat16)
    good = torch.zeros(64, 80, device="cuda")
    good[:, 40:] = float("-inf")
    attngen.mask_plan(good, q, k).check()
    bad = good.clone()
    bad[3, 3] = -2.5
    with pytest.raises(LaunchError, match="other than 0 and -inf"):
        attngen.mask_plan(bad, q, k).check()


# --- varlen and paged ---------------------------------------------------------------------------

def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def paged_pool(k, v, lens_k, block_size, interleaved=False):
    """(k cache, v cache, block table): each sequence's keys of the packed k, v scattered into shuffled blocks of a
    NaN-filled pool; spare blocks, and a last block's rows past its sequence, stay NaN, and a table row's entries
    past its sequence's blocks are -1. ``interleaved``: k and v are views of one [num_blocks, 2, block_size, ...]
    pool (vLLM's and FlashInfer's layout), so their block strides are twice a block. The pool is in k's dtype, fp8
    too (filled as fp32 NaN and cast: torch.full has no fp8 fill)."""
    _, hk, d = k.shape
    dv = v.shape[-1]
    per = [-(-n // block_size) for n in lens_k]
    nblocks = sum(per) + 3
    order = torch.randperm(nblocks, generator=torch.Generator().manual_seed(random.randrange(1 << 30)))
    if interleaved:
        assert d == dv
        pool = torch.full((nblocks, 2, block_size, hk, d), NAN, device="cuda").to(k.dtype)
        kc, vc = pool[:, 0], pool[:, 1]
    else:
        kc = torch.full((nblocks, block_size, hk, d), NAN, device="cuda").to(k.dtype)
        vc = torch.full((nblocks, block_size, hk, dv), NAN, device="cuda").to(k.dtype)
    table = torch.full((len(lens_k), max(per + [1])), -1, dtype=torch.int32)
    at = 0
    for s, n in enumerate(lens_k):
        k0 = sum(lens_k[:s])
        for j in range(per[s]):
            blk = int(order[at])
            at += 1
            table[s, j] = blk
            rows = min(block_size, n - j * block_size)
            kc[blk, :rows] = k[k0 + j * block_size: k0 + j * block_size + rows]
            vc[blk, :rows] = v[k0 + j * block_size: k0 + j * block_size + rows]
    return kc, vc, table.cuda()


def run_varlen(lens_q, lens_k, h, hk, d, dtype, *, causal=False, window=(-1, -1), block_size=0, spec=None, dv=None):
    gen = fresh_generator()
    tq, tk = sum(lens_q), sum(lens_k)
    dv = dv or d
    q = guarded(tq, h, d, dtype=dtype, gen=gen)
    k = guarded(tk, hk, d, dtype=dtype, gen=gen)
    v = guarded(tk, hk, dv, dtype=dtype, gen=gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    kwargs = {}
    kc, vc = k, v
    if block_size:
        kc, vc, kwargs["block_table"] = paged_pool(k, v, lens_k, block_size)
    out, buf, guards = sentinel_out((tq, h, dv), dtype)
    o, lse = attngen.prefill_varlen(q, kc, vc, cu_q, cu_k, max(lens_q + [0]), max(lens_k + [0]), causal=causal,
                                    window=window, return_lse=True, out=out, spec=spec, **kwargs)
    torch.cuda.synchronize()
    assert o is out and lse.shape == (h, tq)
    check_sentinel(buf, guards)
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite output elements"
    errs = []
    q0 = k0 = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            keep = range_keep(nq, nk, causal, window)
            ref_o, ref_l = reference(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], keep, d ** -0.5)
            errs.append(compare(o[None, q0:q0 + nq], lse[None, :, q0:q0 + nq], ref_o, ref_l, dtype))
        q0 += nq
        k0 += nk
    return errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (128, 0))])
@pytest.mark.parametrize("nseq", [1, 5, 64])
def test_varlen_ragged(dtype, causal, window, nseq):
    rng = random.Random()
    lens_q = [rng.choice([0, 1, 17, 64, 200, 1000, 5000]) if nseq < 64 else rng.randrange(0, 300)
              for _ in range(nseq)]
    lens_k = [n + rng.choice([0, 0, 33, 500]) for n in lens_q]
    run_varlen(lens_q, lens_k, 8, 2, 128, dtype, causal=causal, window=window)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_varlen_head_dims(d):
    run_varlen([3, 700, 0, 129], [3, 900, 5, 129], 4, 4, d, torch.bfloat16, causal=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", [(192, 128), (576, 512), (320, 320), (512, 512), (1024, 1024)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_chunked_kernel(dtype, d, dv, causal):
    """Head dims past 256 and split QK/V head dims (DeepSeek's 192/128 prefill) go through the
    chunked kernel: ragged sequences, empty ones, more keys than queries, GQA."""
    run_varlen([1, 17, 0, 1000, 3001], [1, 50, 7, 1000, 3001], 4, 2, d, dtype, causal=causal, dv=dv)


@pytest.mark.parametrize("d,dv", [(576, 512), (512, 512), (384, 384), (320, 320), (1024, 1024)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_chunked_wgmma(d, dv, causal):
    """The chunked kernel's wgmma form (sm_90a) on the varlen work list."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90a (H100/H200)")
    run_varlen([1, 17, 0, 1000, 3001], [1, 50, 7, 1000, 3001], 4, 2, d, torch.bfloat16, causal=causal, dv=dv,
               spec="prefill:mma=wgmma")


@pytest.mark.parametrize("nseq", [5, 64])
def test_varlen_chunked_kernel_many_sequences(nseq):
    rng = random.Random()
    lens_q = [rng.choice([0, 1, 17, 64, 200, 1000]) if nseq < 64 else rng.randrange(0, 300) for _ in range(nseq)]
    lens_k = [n + rng.choice([0, 0, 33, 500]) for n in lens_q]
    run_varlen(lens_q, lens_k, 8, 1, 192, torch.bfloat16, causal=True, dv=128)
    run_varlen(lens_q, lens_k, 2, 2, 512, torch.float16, window=(100, 37))


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_paged_every_block_size(block_size, causal):
    rng = random.Random()
    lens_q = [rng.randrange(1, 300) for _ in range(6)] + [0]
    lens_k = [n + rng.randrange(0, 1500) for n in lens_q]
    run_varlen(lens_q, lens_k, 8, 1, 128, torch.bfloat16, causal=causal, block_size=block_size)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("mma", [Mma.SYNC, Mma.WGMMA])
def test_varlen_paged_paths(d, mma):
    if mma is Mma.WGMMA and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90a")
    run_varlen([100, 1, 513], [1000, 40, 513], 4, 2, d, torch.float16, causal=True, block_size=64,
               spec=PrefillSpec(mma=mma))


@pytest.mark.parametrize("block_size", [16, 48, 64])
@pytest.mark.parametrize("mma", [Mma.SYNC, Mma.WGMMA])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_narrower_v(block_size, mma, causal):
    """192/128 (DeepSeek's non-absorbed prefill in a serving batch) through the whole-row kernel,
    contiguous and paged."""
    if mma is Mma.WGMMA and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs sm_90a")
    rng = random.Random()
    lens_q = [rng.choice([0, 1, 17, 200, 1000]) for _ in range(6)]
    lens_k = [n + rng.choice([0, 33, 500]) for n in lens_q]
    for bs in (0, block_size):
        run_varlen(lens_q, lens_k, 8, 2, 192, torch.bfloat16, causal=causal, block_size=bs, dv=128,
                   spec=PrefillSpec(mma=mma))


def test_varlen_bad_inputs_raise():
    q = torch.randn(10, 2, 64, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(LaunchError, match="int32"):
        attngen.prefill_varlen(q, q, q, cu.long(), cu, 10, 10)
    with pytest.raises(LaunchError, match="batch \\+ 1"):
        attngen.prefill_varlen(q, q, q, cu, cu[:1].clone()[:0], 10, 10)
    with pytest.raises(LaunchError, match="max_seqlen_q"):
        attngen.prefill_varlen(q, q, q, cu, cu, -1, 10)
    with pytest.raises(LaunchError, match="block_size"):
        attngen.prefill_varlen(q, torch.zeros(4, 0, 2, 64, device="cuda", dtype=torch.bfloat16),
                               torch.zeros(4, 0, 2, 64, device="cuda", dtype=torch.bfloat16), cu, cu, 10, 10,
                               block_table=torch.zeros(1, 2, dtype=torch.int32, device="cuda"))


def test_varlen_clamps_bad_lengths_without_faulting():
    # cu_seqlens past the arrays' ends: rows are clamped to what exists, nothing read or written outside.
    gen = fresh_generator()
    q = guarded(50, 2, 64, dtype=torch.bfloat16, gen=gen)
    k = guarded(40, 2, 64, dtype=torch.bfloat16, gen=gen)
    cu_q = torch.tensor([0, 30, 90], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 20, 500], dtype=torch.int32, device="cuda")
    out, buf, guards = sentinel_out((50, 2, 64), torch.bfloat16)
    attngen.prefill_varlen(q, k, k, cu_q, cu_k, 60, 480, out=out)
    torch.cuda.synchronize()
    check_sentinel(buf, guards)
    assert torch.isfinite(out).all()
