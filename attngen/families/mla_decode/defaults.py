"""The MLA decode family's per-arch defaults: measured configs first, then every allowed combination.

``resolve`` takes the first candidate that agrees with the pinned fields and fits the arch, so the
order below is the choice: on the 99-100 KB arches (sm_86, sm_89, sm_120) a 64-row block leaves room
for one stage of 16 keys, and there the unsharded form (no P exchange, one barrier per tile) comes
first; elsewhere sharding does. On sm_90a every config comes first with the TMA ring.
"""

from __future__ import annotations

import itertools

from ...arch import Arch
from ...spec import Mma, Pipeline
from .spec import QkShard

T, F, A = QkShard.TRUE, QkShard.FALSE, QkShard.ALTERNATE

# Per q_rows: [(qk_shard, cta_tile_kv, num_warps, num_stages), ...] best first, as tools/sweep_mla.py
# ranked every fitting config timed as a decode step (bf16, 512 + 64, q_len 1). 16 and 32 rows: 64-key
# tiles, two stages, sharded (32 rows: deep enough a ring to keep the memory busy, where 32-key tiles in
# three stages were not); 32-key tiles on 4 warps next. 64 rows (64-128 heads, compute-bound on mma.sync):
# 32-key tiles, three stages, sharded; the unsharded 64-key config close behind.
TUNED = {
    64: [(T, 32, 8, 3), (F, 64, 8, 2), (F, 32, 8, 2)],
    32: [(T, 64, 8, 2), (T, 32, 4, 2)],
    16: [(T, 64, 8, 2), (T, 32, 4, 2)],
}

# mma_sync configs ptxas spills on some archs (NVRTC 13.5; every single-field pin of every rank, row count and
# layout compiled for every manifest arch, sm_90a's 32-row pins again after the pushed cluster merge),
# per (kv_lora_rank, q_rows, paged) and
# (qk_shard, cta_tile_kv, num_warps, num_stages, pipeline): they come after every other candidate, so a default
# never takes one while another fits, and a spec that pins one still gets it (spills cost speed, not results).
SPILLS_ON = {
    (512, 16, False): {(F, 64, 8, 2, Pipeline.TMA): ("sm_90a",), (F, 16, 8, 4, Pipeline.SYNC): ("sm_120",)},
    (512, 16, True): {(F, 64, 8, 2, Pipeline.SYNC): ("sm_100",)},
    (256, 16, True): {(F, 64, 8, 4, Pipeline.TMA): ("sm_90a",)},
    (256, 32, False): {(F, 64, 8, 4, Pipeline.TMA): ("sm_90a",)},
    (256, 32, True): {(F, 64, 8, 4, Pipeline.TMA): ("sm_90a",), (F, 64, 8, 4, Pipeline.SYNC): ("sm_90a",),
                      (F, 64, 8, 3, Pipeline.TMA): ("sm_90a",), (F, 64, 8, 3, Pipeline.SYNC): ("sm_90a",),
                      (F, 64, 8, 2, Pipeline.SYNC): ("sm_120",)},
    (256, 64, False): {(T, 64, 4, 4, Pipeline.TMA): ("sm_90a",)},
    (256, 64, True): {(T, 64, 4, 4, Pipeline.TMA): ("sm_90a",)},
}

# The same for the kernels of an fp8 cache (kv_dtype; mla_decode/fp8.cuh): every default of both formats, both q
# dtypes, both dims, 16-64 rows and both layouts compiled for every manifest arch; e4m3 spilled the 64-key paged
# 16-row tile on sm_86 (fp16 q) and sm_89 (both), listed here for both formats and q dtypes.
FP8_SPILLS_ON = {
    (512, 16, True): {(F, 64, 8, 2, Pipeline.SYNC): ("sm_86", "sm_89")},
}

# sm_90a, q_rows 64: the wgmma configs (qk_shard, cta_tile_kv, num_stages; always 8 warps), best first as
# tools/sweep_mla.py ranked them: sharded 64-key tiles with two stages first at 64 and 128 heads, the
# unsharded form next (it repeats QK work), 32-key tiles last (a 16-key-wide S wgmma per warpgroup).
# sm_90a, 16 rows of an fp8 cache (mla_decode/fp8.cuh, fragments widened in registers): ahead of TUNED's, four warps
# in a CTA and two CTAs an SM. Every mma_sync config timed as a decode step on an H200 (16 heads, b8-128 x 4k-16k):
# first on each shape, 1.07-1.16x the 8-warp tile; sm_80 and sm_100 were not timed and keep TUNED's order.
TUNED_FP8_SM90 = {16: [(T, 64, 4, 2)]}

TUNED_WGMMA = [(T, 64, 2), (F, 64, 2), (T, 64, 1), (T, 32, 4), (T, 32, 3)]

SMALL_SMEM = 128 * 1024  # per block: below this the unsharded form goes first


def candidates(spec, arch: Arch):
    """(qk_shard, cta_tile_kv, num_warps, num_stages, mma, pipeline): on sm_90a the wgmma configs first
    (they fit only q_rows 64), each with the TMA ring and then with cp.async, then the mma_sync ones:
    measured configs, then every combination; those SPILLS_ON lists for the arch last. An fp8 cache (kv_dtype) takes
    the wgmma configs on the TMA ring only, in the 16-bit order (mla_decode/fp8_wgmma.cuh; no alternate tiles), then
    the mma_sync configs on the cp.async ring only (mla_decode/fp8.cuh)."""
    fp8 = spec.kv_dtype is not None
    if arch.has_wgmma:
        wg = itertools.chain(TUNED_WGMMA, [] if fp8 else [(A, 64, 2)],
                             itertools.product((T, F), (64, 32), (4, 3, 2, 1)))
        pipes = (Pipeline.TMA,) if fp8 else (Pipeline.TMA, Pipeline.SYNC)
        yield from ((shard, kv, 8, st, Mma.WGMMA, pipe) for shard, kv, st in wg for pipe in pipes)
    shard_order = (F, T) if arch.smem_per_block < SMALL_SMEM else (T, F)
    first = TUNED[spec.q_rows] if arch.smem_per_block >= SMALL_SMEM else []
    if fp8 and arch.has_wgmma:
        first = TUNED_FP8_SM90.get(spec.q_rows, []) + first
    spills = (FP8_SPILLS_ON if fp8 else SPILLS_ON).get((spec.kv_lora_rank, spec.q_rows, spec.paged), {})
    every = itertools.chain(first, itertools.product(shard_order, (64, 32, 16), (8, 4), (4, 3, 2, 1)))
    # On sm_90a each mma_sync config with the TMA ring first (the loads no longer wait on the threads that
    # issue them), then with cp.async.
    pipes = (Pipeline.TMA, Pipeline.SYNC) if arch.has_wgmma and not fp8 else (Pipeline.SYNC,)
    sync = [(*c, pipe) for c in every for pipe in pipes]
    yield from ((*c[:4], Mma.SYNC, c[4]) for c in sorted(sync, key=lambda c: arch.name in spills.get(c, ())))
