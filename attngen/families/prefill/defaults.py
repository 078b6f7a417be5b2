"""The prefill family's per-arch defaults: measured configs first, then every allowed combination.

``resolve`` takes the first candidate that agrees with what the spec pins and passes
``validate`` on the arch, so archs with less shared memory fall through to the best measured
config that fits them.
"""

from __future__ import annotations

import itertools

from ...arch import Arch
from .spec import MaskMode, Mma, Persistent, Pipeline, PrefillSpec, Schedule

# Measured on an H200 (sm_90) with NVRTC 13.5, bf16, 16k tokens at seqlen 4096, 2026-11-22
# (tools/sweep_configs.py; BENCHMARKS.md). Archs with less shared memory take the best
# measured config that fits them.
TUNED = {
    # head_dim: [(cta_tile_q, cta_tile_kv, num_warps, num_stages), ...] best first (mma.sync kernels)
    64: [(128, 64, 4, 3), (64, 64, 4, 3)],
    96: [(128, 64, 8, 2)],
    128: [(64, 64, 4, 3), (128, 64, 8, 2)],
    192: [(128, 32, 8, 2), (64, 32, 4, 2)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
}

# sm_90a, the dense layout: the TMA pipeline's wgmma kernels (a producer warpgroup more), per
# (head_dim, head_dim_v, masked): (cta_tile_q, cta_tile_kv, num_warps, num_stages[, schedule[, persistent]]),
# serial where no schedule is named. Tiles from tools/sweep_configs.py --tma on an H100 (NVRTC 13.5, bf16, 16k tokens
# at seqlen 4096, 2026-11-23; BENCHMARKS.md): each was the fastest config of either pipeline, 3-39% over
# the cp.async kernels' best. Schedules timed on an H100 the same day (3 interleaved repeats, 16k tokens
# at seqlen 4096 and 16384): ping-pong 2-10% over serial at head_dim 64 and 128 (with two stages, as
# K's and V's slots are emptied apart); at 256 it was even to 5% slower, so serial stays. Head dim 192
# not timed: it keeps the cp.async configs below. Persistent (the last element, one CTA a query tile where
# none is named) timed on an H100 on 2026-11-24 at the ping-pong tiles over the 72-shape sweep: 1.02-1.11x at
# seqlen 512-4096, 0.96-1.02x at 8k-16k (BENCHMARKS.md); at head_dim 256 it takes smaller tiles (O's own
# staging tile does not fit beside 128x64 tiles) and ran 0.65-0.75x.
# DeepSeek's 192/128 (swept on an H100 the same day, seqlen 1024 and 4096, both masks): 128-key tiles with
# two stages on the TMA pipeline ran 1.26-1.38x the cp.async default (128x64) and led three of the four
# rows in ping-pong (serial 1.03x in the fourth); no persistent form of those tiles fits (O's own tile).
# Head dim 192 (the same sweep): 128-key tiles do not fit the registers; 128x64 on the TMA pipeline, serial,
# led or came within 3% (1.18-1.30x the cp.async default), persistent under a causal mask (1.06-1.07x one CTA a
# tile there, 0.97x without a mask; the window keeps one CTA a tile, see PERSISTENT_MASKS).
_P = Persistent.ON
# The masks the persistent kernel is the default for. A sliding window (H100, 2026-11-24, seven shapes at head dims
# 64-192, windows 128-4096): 0.94-1.08x one CTA a tile, 0.94 at seqlen 16k with a 4k window, where a unit's two
# query tiles read far-apart keys and the CTAs running together share less of them in L2.
PERSISTENT_MASKS = (MaskMode.NONE, MaskMode.CAUSAL)
TUNED_TMA = {
    (64, 64, False): [(128, 128, 8, 2, Schedule.PINGPONG, _P), (128, 128, 8, 4)],
    (64, 64, True): [(128, 128, 8, 2, Schedule.PINGPONG, _P), (64, 128, 4, 2)],
    (128, 128, False): [(128, 128, 8, 2, Schedule.PINGPONG, _P), (128, 128, 8, 3)],
    (128, 128, True): [(128, 128, 8, 2, Schedule.PINGPONG, _P), (128, 128, 8, 3)],
    (192, 128, False): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (192, 128, True): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (192, 192, False): [(128, 64, 8, 2)],
    (192, 192, True): [(128, 64, 8, 2, Schedule.SERIAL, _P)],
    (256, 256, False): [(128, 64, 8, 2)],
    (256, 256, True): [(128, 64, 8, 2)],
}

# sm_90a, contiguous varlen batches (prefill_varlen without a block table): the TMA pipeline's kernels, one CTA a
# work-list slot, per (head_dim, head_dim_v, masked) as TUNED_TMA. Chosen on an H100, 2026-11-27, bf16, 16k tokens as a
# long-tailed batch, 16 x 1024, 2 x 8192 and 32 x 512, causal and not, against the cp.async kernels (TUNED_WGMMA), two
# rounds (BENCHMARKS.md): 128 ping-pong 1.08-1.32x; 256 128x64 serial 1.07-1.23x; 192 128x64 serial 1.09-1.31x
# (ping-pong alike); 192/128 ping-pong 1.05-1.43x. Head dim 64 without a mask: 64-row tiles on one consumer warpgroup
# (two CTAs an SM, overlap) 1.04-1.20x; under a mask the cp.async kernel stays (every TMA config 0.73-0.94x at 512-1k
# rows and long-tailed batches; 1.16x at 8k). The kept kernels against the old defaults (H200, the same day, three
# rounds): 1.10-1.47x at 128-256, 0.98-1.17x at 64. Paged batches and the other head dims keep the cp.async kernels.
TUNED_TMA_VARLEN = {
    (64, 64, False): [(64, 128, 4, 2, Schedule.OVERLAP)],
    (128, 128, False): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (128, 128, True): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (192, 128, False): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (192, 128, True): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (192, 192, False): [(128, 64, 8, 2)],
    (192, 192, True): [(128, 64, 8, 2)],
    (256, 256, False): [(128, 64, 8, 2)],
    (256, 256, True): [(128, 64, 8, 2)],
}

# sm_90a, custom masks (a plan's tile lists): the TMA pipeline's kernels where measured faster, one CTA a work-list slot.
# H200, 2026-11-27, bf16, 8k x 8k, a plan reused, against the cp.async default (64-row tiles; BENCHMARKS.md): at head_dim
# 128, 128x128 ping-pong 1.35-1.46x on block-diagonal (4 sequences) and random 128-block masks (10%, 50% live), 1.06x
# block-diagonal with 16 sequences (3% live). At 64 the cp.async kernel stays (the best TMA config, 64x128 overlap,
# 1.12-1.19x there but 0.84x at 3% live); other head dims not measured.
TUNED_TMA_MASK = {
    (128, 128, False): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (128, 128, True): [(128, 128, 8, 2, Schedule.PINGPONG)],
}

# sm_90a: the wgmma kernels, one warpgroup per 64 query rows (cta_tile_q = 16 x num_warps), per
# (head_dim, masked). From tools/sweep_configs.py on an H100 (NVRTC 13.5, bf16, 16k tokens at
# seqlen 4096, 2026-11-22; BENCHMARKS.md); head_dim 192 not timed yet.
TUNED_WGMMA = {
    (64, False): [(64, 64, 4, 2), (64, 128, 4, 2)],
    (64, True): [(64, 128, 4, 2), (64, 64, 4, 3)],
    (128, False): [(128, 128, 8, 3), (64, 64, 4, 3)],
    (128, True): [(128, 128, 8, 3), (128, 128, 8, 2)],
    (192, False): [(128, 64, 8, 2)],
    (192, True): [(128, 64, 8, 2)],
    (256, False): [(128, 64, 8, 2), (64, 64, 4, 1)],
    (256, True): [(128, 64, 8, 2), (64, 64, 4, 1)],
}

# Configs ptxas spills on some archs (NVRTC 13.5): there the next candidate is taken. Keyed by
# (head_dim, (cta_tile_q, cta_tile_kv, num_warps, num_stages), mma) -> archs, or with a mask mode
# appended when only that mask spills, per layout: the
# custom-mask and varlen kernels hold a few more registers than the dense one, at other edges
# (measured by compiling each candidate for every manifest arch, 2026-11-23). No mma.sync
# candidate compiled spill-free for a custom mask at head_dim 192 on sm_100/sm_120 (8-32 bytes)
# or 256 on sm_86/sm_89 (16 bytes): those keep the least-spilling one and stay out of the
# default manifest.
_ALL_STAGES = (1, 2, 3, 4)
SPILLS_ON = {
    "dense": {
        (64, (128, 64, 4, 3), Mma.SYNC): ("sm_80", "sm_86", "sm_89", "sm_120"),
    },
    "varlen": {
        (64, (128, 64, 4, 3), Mma.SYNC): ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120"),
        # head_dim 256 on sm_100: each of these spills for some mask, contiguous or paged (4-52
        # bytes; every candidate compiled for every mask and layout, 2026-11-23): (128, 64, 8, 1)
        # is taken. On sm_86/sm_89 no candidate is spill-free for a contiguous sliding window
        # (32 bytes at best): that one stays out of the default manifest.
        (256, (128, 64, 8, 2), Mma.SYNC): ("sm_100",),
        (256, (128, 32, 8, 2), Mma.SYNC): ("sm_100",),
        (256, (64, 32, 4, 2), Mma.SYNC): ("sm_100",),
    },
    "mask": {
        (64, (128, 64, 4, 3), Mma.SYNC): ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120"),
        (256, (64, 32, 4, 2), Mma.SYNC): ("sm_80", "sm_100", "sm_120"),
        **{(192, (64, 64, 4, st), Mma.WGMMA): ("sm_90a",) for st in _ALL_STAGES},
    },
}


# The chunked kernel (head_dim above 256, head_dim_v above head_dim): (cta_tile_q, cta_tile_kv, num_warps,
# num_stages, head_dim_chunk), best first. 64 query rows while O's columns split four ways stay
# within the registers (head_dim_v up to 640, with 64-key tiles there), 32 rows (eight ways) above.
# Timed with tools/sweep_configs.py --chunked on an H200 (NVRTC 13.0, bf16, B=4 H=16 S=2048,
# 2026-11-23; BENCHMARKS.md): this order's first fitting config was the fastest or within 2% for
# every head dim from 320 to 1024 but 640, where 64 rows with 64-key tiles ran 1.5x the 32-row
# tiles taken before.
CHUNKED_ROWS_64_UP_TO = 640
CHUNKED = {
    64: [(64, 128, 8, 3, 64), (64, 128, 8, 2, 64), (64, 64, 8, 3, 64), (64, 64, 8, 4, 64), (64, 64, 8, 2, 64),
         (64, 64, 8, 3, 32), (64, 64, 8, 2, 32)],
    32: [(32, 128, 8, 3, 64), (32, 128, 8, 2, 64), (32, 128, 8, 3, 32), (32, 128, 8, 2, 32)],
}


# The chunked kernel's wgmma form on sm_90a: (cta_tile_kv, num_stages, head_dim_chunk), 64 query rows and
# 8 warps, best first. Timed on an H100 (NVRTC 13.0, bf16, B=1 H=48 S=8192 and B=4 H=16 S=2048, 2026-11-24;
# BENCHMARKS.md): 128-key tiles with four stages of 64-wide chunks ran 1.25-1.50x the 64-key tiles at
# head_dim 384/512/576-512 and 1.56-1.87x the mma.sync default; four stages ran 1.5-1.85x three at 64-key
# tiles (a step's wgmma is left running, so three stages prefetch one step only). 640 fits 64-key tiles only
# (1.50-1.86x the mma.sync default). Past 640 columns of v two CTAs split O (each repeating the QK work):
# 1.54-1.73x the mma.sync default at head_dim 768 and 1024, the same day.
CHUNKED_WGMMA = [(128, 4, 64), (64, 4, 64), (64, 4, 128), (128, 3, 128), (64, 3, 64)]
# Per (head_dim, head_dim_v), what ran fastest there, ahead of the list above. Timed on an H100 (NVRTC 13.0,
# bf16, B=1 H=48 S=8192 and B=4 H=16 S=2048, causal and not, 2026-11-25; BENCHMARKS.md): a deeper ring
# (five to six stages, which the list above never took) or 128-wide chunks, halving the steps a tile and
# so the CTA barriers, ran 1.07-1.29x the list's first config; 320 kept it (more stages lost at B=4), and
# 768 and 1024 at 128-wide chunks spill. Where a warpgroup's V columns end in a 32-column tail step (no
# padding: 320, 448, 576; the same day), 320 and 576 were timed again: 320 at six stages ran 1.03-1.11x its
# padded default, and 576, whose 128-key tiles no longer spill, 1.24-1.60x its 64-key padded default; 448
# kept its config (within the run-to-run spread of the padded kernel).
# The same on the TMA ring (a producer warpgroup, Q's tile loaded once; every head dim whose V columns need no
# padding), timed with tools/sweep_configs.py --chunked --tma on an H100 (NVRTC 13.0, bf16, both shapes and
# masks, 2026-11-26; BENCHMARKS.md): the best config or within 2% of it by geomean over the four rows.
CHUNKED_TMA_BY_DIMS = {
    (320, 320): [(128, 6, 64)],
    (384, 384): [(128, 4, 128)],
    (448, 448): [(128, 6, 64)],
    (512, 512): [(128, 4, 128)],
    (576, 512): [(128, 6, 64)],
    (576, 576): [(128, 5, 64)],
    (640, 640): [(64, 8, 128)],
    (768, 768): [(128, 6, 64)],
    (1024, 1024): [(128, 5, 64)],
}
CHUNKED_WGMMA_BY_DIMS = {
    (320, 320): [(128, 6, 64)],
    (384, 384): [(128, 4, 128)],
    (448, 448): [(128, 5, 64)],
    (512, 512): [(128, 4, 128)],
    (576, 512): [(128, 6, 64)],
    (576, 576): [(128, 6, 64)],
    (640, 640): [(64, 6, 128)],
    (768, 768): [(128, 5, 64)],
    (1024, 1024): [(128, 5, 64)],
}


# Chunked configs ptxas spills (NVRTC 13.5, every default candidate of every chunked manifest entry
# compiled for every arch, 2026-11-23; the wgmma form's 2026-11-24), per (head_dim, head_dim_v, mask):
# (cta_tile_q, cta_tile_kv, num_warps, num_stages, head_dim_chunk, mma) -> archs. Those of the cp.async ring:
# the TMA ring's consumers hold 240 registers a thread (setmaxnreg) and compiled these spill-free (2026-11-26).
CHUNKED_SPILLS_ON = {
    (192, 128, MaskMode.CAUSAL): {(64, 128, 8, 3, 64, Mma.SYNC): ("sm_80", "sm_86", "sm_89")},
    (640, 640, MaskMode.SLIDING_WINDOW): {(64, 64, 8, 3, 64, Mma.SYNC): ("sm_90a",)},
    # the two-CTA split at 768 with a window: 72-100 bytes at 128-key tiles, whatever the ring's depth (64-key
    # tiles are spill-free)
    (768, 768, MaskMode.SLIDING_WINDOW): {(64, 128, 8, st, 64, Mma.WGMMA): ("sm_90a",) for st in range(3, 9)},
}
# The same for varlen kernels (NVRTC 13.5, 2026-11-25): 4 and 40 bytes.
CHUNKED_VARLEN_SPILLS_ON = {
    (512, 512, MaskMode.CAUSAL): {(64, 128, 8, 4, 128, Mma.WGMMA): ("sm_90a",)},
    (640, 640, MaskMode.SLIDING_WINDOW): {(64, 64, 8, 6, 128, Mma.WGMMA): ("sm_90a",)},
}


def candidates(spec, arch: Arch):
    """(cta_tile_q, cta_tile_kv, num_warps, num_stages, mma, head_dim_chunk, pipeline, schedule, persistent): tuned
    configs first, then every allowed combination, larger tiles first; wgmma ones first on sm_90a, the TMA
    pipeline's first where it runs (the dense layout; elsewhere ``check`` refuses them), each tuned one with its
    measured schedule and persistence first and then the others. A custom mask takes
    64-row tiles first (after TUNED_TMA_MASK's): the finer its tiles, the more of a sparse mask its live-tile lists
    skip.
    Configs ``SPILLS_ON`` lists for the arch come after all others: a default never takes one
    while another fits, and a spec that pins one still gets it (spills cost speed, not results)."""
    if spec.chunked:
        rows = (64, 32) if spec.dim_v <= CHUNKED_ROWS_64_UP_TO else (32, 64)
        listed = [c for r in rows for c in CHUNKED[r]]
        rest = [(q, kv, 8, st, dk) for q in rows for kv in (128, 64) for dk in (64, 32) for st in (3, 2, 4)]
        every = [(q, kv, w, st, Mma.SYNC, dk, Pipeline.SYNC, Schedule.SERIAL, Persistent.OFF)
                 for q, kv, w, st, dk in dict.fromkeys(listed + rest)]
        if arch.has_wgmma:
            # the wgmma form first (past 640 columns of v, two CTAs a query tile, each repeating the QK work):
            # on the dense layout its TMA ring first (``check`` refuses it where a warpgroup's V columns would be
            # padded, e.g. head_dim_v 96), then the cp.async ring
            where = (spec.head_dim, spec.dim_v)
            rest = CHUNKED_WGMMA + [(kv, st, dk) for kv in (128, 64, 32) for dk in (64, 128) for st in (4, 3, 5, 6, 7, 8)]
            rings = [(Pipeline.SYNC, dict.fromkeys(CHUNKED_WGMMA_BY_DIMS.get(where, []) + rest))]
            if not spec.varlen:
                rings.insert(0, (Pipeline.TMA, dict.fromkeys(CHUNKED_TMA_BY_DIMS.get(where, []) + rest)))
            every = [(64, kv, 8, st, Mma.WGMMA, dk, pipe, Schedule.SERIAL, Persistent.OFF)
                     for pipe, configs in rings for kv, st, dk in configs] + every
        where = (spec.head_dim, spec.dim_v, spec.mask)
        chunked_spills = {**CHUNKED_SPILLS_ON.get(where, {}),
                          **(CHUNKED_VARLEN_SPILLS_ON.get(where, {}) if spec.varlen else {})}

        def spilled(c):
            return c[6] is Pipeline.SYNC and arch.name in chunked_spills.get((*c[:4], c[5], c[4]), ())
    else:
        every = [(*c[:5], 0, *c[5:]) for c in _candidates(spec, arch)]  # head_dim_chunk 0: whole rows
        if spec.custom_mask:  # (after the measured TMA configs, which lead: every other TMA one comes last)
            n = next((i for i, c in enumerate(every) if c[6] is not Pipeline.TMA), len(every))
            every = every[:n] + [c for c in every[n:] if c[0] == 64] + [c for c in every[n:] if c[0] != 64]
        spills = SPILLS_ON["mask" if spec.custom_mask else "varlen" if spec.varlen else "dense"]

        def spilled(c):
            key = (spec.head_dim, tuple(c[:4]), c[4])  # both pipelines of a config alike
            return arch.name in spills.get(key, ()) or arch.name in spills.get((*key, spec.mask), ())

    return iter(sorted(every, key=spilled))  # stable: the order within each group is kept


def _candidates(spec, arch: Arch):
    d = spec.head_dim
    W, S, T, SER, OFF = Mma.WGMMA, Pipeline.SYNC, Pipeline.TMA, Schedule.SERIAL, Persistent.OFF

    def tma(configs):
        # each TMA config with its measured schedule and persistence first (serial and one CTA a query tile
        # where none is listed), then the others
        for c in configs:
            first = c[4] if len(c) > 4 else SER
            per = c[5] if len(c) > 5 and spec.mask in PERSISTENT_MASKS else OFF
            yield from ((*c[:4], W, T, sc, pe) for sc in (first, *(x for x in Schedule if x and x is not first))
                        for pe in (per, *(x for x in Persistent if x and x is not per)))

    wgmma = arch.has_wgmma and d % 64 == 0 and spec.dim_v % 64 == 0
    dense = not (spec.varlen or spec.custom_mask)
    if wgmma:
        key = (d, spec.mask is not MaskMode.NONE)
        wgmma_all = [(16 * w, kv, w, st) for w in (8, 4) for kv in (128, 64, 32) for st in (2, 3, 1, 4)]
        if dense:
            yield from tma(TUNED_TMA.get((d, spec.dim_v, key[1]), ()))
        elif spec.varlen and not spec.paged:
            yield from tma(TUNED_TMA_VARLEN.get((d, spec.dim_v, key[1]), ()))
        elif spec.custom_mask:
            yield from tma(TUNED_TMA_MASK.get((d, spec.dim_v, key[1]), ()))
        yield from ((*c, W, S, SER, OFF) for c in TUNED_WGMMA[key])
        if not spec.custom_mask:
            yield from tma(wgmma_all)
        yield from ((*c, W, S, SER, OFF) for c in wgmma_all)
        if spec.custom_mask:  # the other TMA configs of a mask's tile lists: where asked for
            yield from tma(wgmma_all)
    yield from ((*c, Mma.SYNC, S, SER, OFF) for c in TUNED[d])
    yield from ((*c, Mma.SYNC, S, SER, OFF)
                for c in itertools.product((128, 64), (64, 128, 32), (4, 8), (2, 3, 1, 4)))
    if wgmma and dense:
        # Key tiles between the powers of two, last: no default takes one. H100, 2026-11-25, bf16, the 12 shapes of
        # the sweep a head dim (BENCHMARKS.md): at 256, 128x80 (serial or ping-pong) ran 0.93-1.15x the default
        # 128x64 by shape, 0.99-1.01x by geomean (faster at 2k and 16k, slower at 512-1k and 8k); at 64, 128x160-192
        # persistent 0.93-0.95x the default persistent 128x128; at 128, 128x144-176 one CTA a tile no faster than
        # 128x128 one CTA a tile (0.96x the persistent default; persistent, they spill or do not fit). `attngen
        # tune` tries them (it took 128x80 ping-pong at 256 for 2k and 16k tokens, 1.01-1.07x) and a spec may pin
        # them.
        wide = [(16 * w, kv, w, st) for w in (8, 4) for kv in PrefillSpec.CTA_TILE_KV_WIDE for st in (2, 3)]
        yield from tma(wide)
        yield from ((*c, W, S, SER, OFF) for c in wide)
        # Three consumer warpgroups (192-row tiles on 12 warps, the TMA kernel's only): 160 registers a thread
        # fit head_dim 64 up to 128-key tiles, 128 up to 80 (``check`` refuses the rest).
        yield from tma([(192, kv, 12, st) for kv in (128, 112, 96, 80, 64) for st in (2, 3)])
