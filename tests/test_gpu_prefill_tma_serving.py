"""The TMA prefill pipeline over the serving layouts on a real sm_90 GPU (pytest -m gpu): contiguous varlen batches
(``prefill_varlen``; the maps cover the packed tensors) and custom masks (a plan's lists of live KV tiles), against an
fp64 reference and bit-equal to the cp.async kernel of the same tiles, with tests/test_gpu_prefill_tma.py's guards:
inputs inside NaN-filled buffers, outputs in NaN-poisoned views of a sentinel-filled buffer.
"""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.test_gpu_prefill_serving import (block_diag_keep, check_sentinel, compare, guarded,  # noqa: E402
                                            mask_of, paged_pool, range_keep, reference, sentinel_out)
from tests.test_gpu_prefill_tma import BF16, FP16, SCHEDULES, _spec, _sync  # noqa: E402
from tests.test_gpu_sinks_prefill import reference as sink_reference  # noqa: E402
from tests.test_gpu_sinks_prefill import sinks_for  # noqa: E402


# ---- contiguous varlen batches (prefill_varlen) on the TMA pipeline: the maps cover the packed tensors ----------

VARLEN_TMA = [  # (head_dim, head_dim_v, cta_tile_q, cta_tile_kv, num_warps, num_stages, schedule)
    (64, 64, 128, 128, 8, 2, "pingpong"), (64, 64, 192, 128, 12, 2, "pingpong"), (128, 128, 128, 128, 8, 2, "pingpong"),
    (128, 128, 64, 128, 4, 3, "overlap"), (128, 128, 128, 64, 8, 3, "serial"), (256, 256, 128, 64, 8, 2, "serial"),
    (256, 256, 128, 64, 8, 2, "pingpong"), (192, 128, 128, 128, 8, 2, "pingpong")]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def run_varlen_tma(spec, lens_q, lens_k, dtype, causal=False, window=(-1, -1), h=4, hk=2, bad_keys=()):
    """prefill_varlen through ``spec`` against the fp64 reference per sequence, and bit-equal to the cp.async kernel
    of its tiles (where one exists). The sequences ``bad_keys`` names (no query rows) hold NaN in k and inf and NaN
    in v, as do 5 rows past the last sequence: a key tile crossing a sequence's end reads its neighbour's rows, and
    none may reach the output."""
    gen = fresh_generator()
    d, dv = spec.head_dim, spec.dim_v
    spec = spec.replace(dtype="bf16" if dtype is BF16 else "fp16")
    tq, tk = sum(lens_q), sum(lens_k)
    q = guarded(tq, h, d, dtype=dtype, gen=gen)
    k = guarded(tk + 5, hk, d, dtype=dtype, gen=gen)
    v = guarded(tk + 5, hk, dv, dtype=dtype, gen=gen)
    for lo, hi in [(tk, tk + 5)] + [(sum(lens_k[:s]), sum(lens_k[:s + 1])) for s in bad_keys]:
        k[lo:hi] = float("nan")
        v[lo:hi] = float("inf")
        v[lo:hi:2] = float("nan")
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, buf, guards = sentinel_out((tq, h, dv), dtype)
    args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k))
    o, lse = attngen.prefill_varlen(*args, causal=causal, window=window, return_lse=True, out=out, spec=spec)
    torch.cuda.synchronize()
    assert o is out
    check_sentinel(buf, guards)
    check_sequences(q, k, v, o, lse, lens_q, lens_k, causal, window, dtype)
    check_sync_twin(spec, args, dict(causal=causal, window=window, return_lse=True), o, lse)


def check_sequences(q, k, v, o, lse, lens_q, lens_k, causal, window, dtype, sink=None):
    """Each sequence's rows of o and lse (packed varlen rows) against the fp64 reference, with sinks where given."""
    q0 = k0 = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq:
            seq = (q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], range_keep(nq, nk, causal, window),
                   q.shape[-1] ** -0.5)
            ref_o, ref_l = sink_reference(*seq, sink) if sink is not None else reference(*seq)
            compare(o[None, q0:q0 + nq], lse[None, :, q0:q0 + nq], ref_o, ref_l, dtype)
        q0 += nq
        k0 += nk


def check_sync_twin(spec, args, kw, o, lse):
    """The same call through the cp.async kernel of the spec's tiles gives the same bits (none has 12 warps)."""
    if spec.num_warps != 12:
        o2, lse2 = attngen.prefill_varlen(*args, spec=_sync(spec), **kw)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), "TMA and cp.async kernels of one tile config differ"


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("cfg", VARLEN_TMA, ids=lambda c: "%d_%d_%dx%dx%d_%d_%s" % c)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 0))],
                         ids=["full", "causal", "window"])
def test_varlen_tma_matches_reference(dtype, cfg, causal, window):
    d, dv, tq, tk, w, st, sched = cfg
    spec = _spec(head_dim=d, head_dim_v=dv, cta_tile_q=tq, cta_tile_kv=tk, num_warps=w, num_stages=st,
                 schedule=sched, persistent=False, varlen=True)
    # sequence 2 has keys only (NaN and inf), which sequence 1's last key tile reads past its end
    run_varlen_tma(spec, [1, 200, 0, 129, 1000, 77, 5], [1, 333, 90, 129, 1000, 80, 700], dtype, causal, window,
                   bad_keys=(2,))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_tma_many_sequences(schedule, causal):
    rng = random.Random()
    lens_q = [rng.randrange(0, 300) for _ in range(64)]
    lens_k = [n + rng.choice([0, 0, 33, 500]) for n in lens_q]
    spec = _spec(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, schedule=schedule,
                 persistent=False, varlen=True)
    run_varlen_tma(spec, lens_q, lens_k, BF16, causal, h=8, hk=2)


# ---- paged caches (prefill_varlen with a block table) on the TMA pipeline: a key tile in boxes of one block's rows ---

# (with the paged defaults of TUNED_TMA_PAGED: 3 stages at head dim 128, 64-row overlap at 64, under a mask)
PAGED_TMA = VARLEN_TMA + [(128, 128, 128, 128, 8, 3, "pingpong"), (64, 64, 64, 128, 4, 2, "overlap")]


def run_paged_tma(spec, lens_q, lens_k, block_size, dtype, causal=False, window=(-1, -1), h=4, hk=2,
                  interleaved=False, sinks=False):
    """prefill_varlen over a paged pool (tests/test_gpu_prefill_serving.py's paged_pool: NaN in every row no
    sequence owns, -1 past each table row's blocks) through ``spec`` against the fp64 reference per sequence,
    and bit-equal to the cp.async kernel of its tiles."""
    gen = fresh_generator()
    d, dv = spec.head_dim, spec.dim_v
    spec = spec.replace(dtype="bf16" if dtype is BF16 else "fp16", sinks=sinks)
    tq, tk = sum(lens_q), sum(lens_k)
    q = guarded(tq, h, d, dtype=dtype, gen=gen)
    k = guarded(tk, hk, d, dtype=dtype, gen=gen)
    v = guarded(tk, hk, dv, dtype=dtype, gen=gen)
    kc, vc, table = paged_pool(k, v, lens_k, block_size, interleaved)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    sink = sinks_for(h, gen) if sinks else None
    out, buf, guards = sentinel_out((tq, h, dv), dtype)
    args = (q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k))
    kw = dict(causal=causal, window=window, return_lse=True, block_table=table, sinks=sink)
    o, lse = attngen.prefill_varlen(*args, out=out, spec=spec, **kw)
    torch.cuda.synchronize()
    assert o is out
    check_sentinel(buf, guards)
    check_sequences(q, k, v, o, lse, lens_q, lens_k, causal, window, dtype, sink)
    check_sync_twin(spec, args, kw, o, lse)


@pytest.mark.parametrize("cfg", PAGED_TMA, ids=lambda c: "%d_%d_%dx%dx%d_%d_%s" % c)
@pytest.mark.parametrize("block_size", [16, 48, 64, 256])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 0))],
                         ids=["full", "causal", "window"])
def test_paged_tma_matches_reference(cfg, block_size, causal, window):
    d, dv, tq, tk, w, st, sched = cfg
    spec = _spec(head_dim=d, head_dim_v=dv, cta_tile_q=tq, cta_tile_kv=tk, num_warps=w, num_stages=st,
                 schedule=sched, persistent=False, varlen=True, paged=True)
    # (one key past a block, a sequence of keys only, one shorter than a box, a whole number of blocks)
    run_paged_tma(spec, [1, 200, 0, 129, 1000, 77, 5], [1, 333, 90, 129, 1024, 80, 700], block_size, BF16, causal,
                  window)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("block_size", [16, 32, 80, 512])
@pytest.mark.parametrize("interleaved", [False, True], ids=["apart", "interleaved"])
def test_paged_tma_layouts_and_sinks(dtype, block_size, interleaved):
    """k and v as views of one interleaved pool (block strides of two blocks), fp16, sinks, many sequences."""
    rng = random.Random()
    lens_q = [rng.randrange(0, 300) for _ in range(40)]
    lens_k = [n + rng.choice([0, 0, 33, 500, 2000]) for n in lens_q]
    spec = _spec(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=3, schedule="pingpong",
                 persistent=False, varlen=True, paged=True)
    run_paged_tma(spec, lens_q, lens_k, block_size, dtype, True, h=8, hk=2, interleaved=interleaved,
                  sinks=interleaved)


# ---- custom masks (a plan's lists of live KV tiles) on the TMA pipeline: the producer copies the listed tiles ------

MASK_TMA = [  # (head_dim, head_dim_v, cta_tile_q, cta_tile_kv, num_warps, num_stages, schedule)
    (64, 64, 64, 128, 4, 2, "overlap"), (64, 64, 128, 128, 8, 2, "pingpong"), (128, 128, 64, 128, 4, 2, "serial"),
    (128, 128, 128, 128, 8, 2, "pingpong"), (256, 256, 64, 64, 4, 2, "serial"), (192, 128, 128, 128, 8, 2, "pingpong")]


def run_masked_tma(spec, b, sq, sk, h, hk, keep, dtype, causal=False, window=(-1, -1), kind="bool"):
    """prefill(mask=...) through ``spec`` against the fp64 reference, bit-equal to the cp.async kernel of its tiles,
    and again through a plan built apart (mask_plan) and reused."""
    gen = fresh_generator()
    d, dv = spec.head_dim, spec.dim_v
    spec = spec.replace(dtype="bf16" if dtype is BF16 else "fp16")
    q = guarded(b, sq, h, d, dtype=dtype, gen=gen)
    k = guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    v = guarded(b, sk, hk, dv, dtype=dtype, gen=gen)
    mask = mask_of(keep, kind)
    out, buf, guards = sentinel_out((b, sq, h, dv), dtype)
    kw = dict(mask=mask, causal=causal, window=window, return_lse=True)
    o, lse = attngen.prefill(q, k, v, out=out, spec=spec, **kw)
    torch.cuda.synchronize()
    assert o is out
    check_sentinel(buf, guards)
    k4 = keep if keep.dim() == 4 else keep[None, None]
    compare(o, lse, *reference(q, k, v, k4 & range_keep(sq, sk, causal, window), d ** -0.5), dtype)
    o2, lse2 = attngen.prefill(q, k, v, spec=_sync(spec), **kw)
    assert torch.equal(o, o2) and torch.equal(lse, lse2), "TMA and cp.async kernels of one tile config differ"
    plan = attngen.mask_plan(mask, q, k, v=v, causal=causal, window=window, spec=spec.to_text())  # (text, as prefill)
    o3, lse3 = attngen.prefill(q, k, v, mask_plan=plan, spec=spec, **kw)
    assert torch.equal(o, o3) and torch.equal(lse, lse3)


def _mask_spec(cfg):
    d, dv, tq, tk, w, st, sched = cfg
    return _spec(head_dim=d, head_dim_v=dv, cta_tile_q=tq, cta_tile_kv=tk, num_warps=w, num_stages=st, schedule=sched,
                 persistent=False, custom_mask=True)


@pytest.mark.parametrize("cfg", MASK_TMA, ids=lambda c: "%d_%d_%dx%dx%d_%d_%s" % c)
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("density,shape", [(0.5, "2d"), (0.05, "bh")])
@pytest.mark.parametrize("sq,sk", [(77, 300), (513, 1025)])
def test_custom_mask_tma_matches_reference(cfg, dtype, density, shape, sq, sk):
    b, h, hk = 2, 4, 2
    dims = {"2d": (sq, sk), "bh": (b, h, sq, sk)}[shape]
    keep = torch.rand(dims, device="cuda", generator=fresh_generator()) < density
    run_masked_tma(_mask_spec(cfg), b, sq, sk, h, hk, keep, dtype)


@pytest.mark.parametrize("cfg", MASK_TMA[:4], ids=lambda c: "%d_%d_%dx%dx%d_%d_%s" % c)
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (64, 16))], ids=["causal", "window"])
def test_custom_mask_tma_block_diagonal_with_causal_and_window(cfg, causal, window):
    keep = block_diag_keep(512, 2048, 7, random.Random())[None, None]  # dead tiles skipped, some query tiles dead
    run_masked_tma(_mask_spec(cfg), 1, 512, 2048, 8, 2, keep, BF16, causal=causal, window=window, kind="fp32")
