"""The prefill family's per-arch defaults: measured configs first, then every allowed combination.

``resolve`` takes the first candidate that agrees with what the spec pins and passes
``validate`` on the arch, so archs with less shared memory fall through to the best measured
config that fits them.
"""

from __future__ import annotations

import itertools

from ...arch import Arch
from .spec import MaskMode, Mma, Persistent, Pipeline, PrefillSpec, Schedule
from . import fp8

# The mma.sync kernels' configs, best first, as tools/sweep_configs.py ranked them (bf16, 16k tokens
# at seqlen 4096). Archs with less shared memory take the best ranked config that fits them.
TUNED = {
    # head_dim: [(cta_tile_q, cta_tile_kv, num_warps, num_stages), ...] best first (mma.sync kernels)
    64: [(128, 64, 4, 3), (64, 64, 4, 3)],
    96: [(128, 64, 8, 2)],
    128: [(64, 64, 4, 3), (128, 64, 8, 2)],
    192: [(128, 32, 8, 2), (64, 32, 4, 2)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
}


def neighbour(head_dim: int) -> int:
    """The measured head dim whose mma.sync configs a whole-row head dim takes: itself, or the nearest measured
    one above it (40 -> 64, 80 -> 96, 160 -> 192, 224 -> 256). Tiles that fit the wider rows fit the narrower
    ones' shared memory, so the neighbour's ranking is the best guess short of a sweep; where one spills on an
    arch at the narrower dim, ``SPILLS_ON`` puts it last there."""
    return next(d for d in sorted(TUNED) if d >= head_dim)


def tuned_sync(head_dim: int) -> list:
    """The mma.sync kernel's configs for ``head_dim``, best first: TUNED's, or its neighbour's."""
    return TUNED[neighbour(head_dim)]


# sm_90a, the dense layout: the TMA pipeline's wgmma kernels (a producer warpgroup more), per
# (head_dim, head_dim_v, masked): (cta_tile_q, cta_tile_kv, num_warps, num_stages[, schedule[, persistent]]),
# serial where no schedule is named. Tiles from tools/sweep_configs.py --tma: each was the fastest config of either
# pipeline. Ping-pong leads at head_dim 64 and 128, with two stages, since K's and V's slots are emptied apart; at 256
# the warpgroups' turns cost more than they hide, so serial stays. Persistent (the last element; one CTA a query
# tile where none is named) pays off where a query tile is short, so the next tile's Q loads under this one's work;
# at head_dim 256 O's own staging tile does not fit beside 128x64 tiles, so its persistent form is the by-rows rule
# below (O staged in Q's tile).
# DeepSeek's 192/128: 128-key tiles with two stages, in ping-pong; no persistent form of those tiles fits (O's own
# tile). Head dim 192: 128-key tiles do not fit the registers; 128x64, serial, persistent under a causal mask only
# (the window keeps one CTA a tile, see PERSISTENT_MASKS).
_P = Persistent.ON
# The masks the persistent kernel is the default for. Not a sliding window: a unit's two query tiles read
# far-apart keys, and the CTAs running together share less of them in L2.
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

# sm_90a, varlen batches (prefill_varlen; over a paged cache too, in blocks of a multiple of 16 rows): the TMA
# pipeline's kernels, one CTA a work-list slot, per (head_dim, head_dim_v, masked) as TUNED_TMA, chosen against the
# cp.async kernels (TUNED_WGMMA) on long-tailed and equal-length contiguous batches, causal and not. Head dim 64
# without a mask: 64-row tiles on one consumer warpgroup (two CTAs an SM, overlap); under a mask the cp.async kernel
# stays (no TMA config beat it on short rows). Paged, the same configs measured 1.23-1.71x the cp.async kernels at
# head dims 64, 128 and 256 (blocks of 16 and 64). Blocks of other sizes (page_rows) and the other head dims keep the
# cp.async kernels.
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

# sm_90a, paged: where a paged batch's best differs from TUNED_TMA_VARLEN's. Head dim 128 under a mask: three stages
# (a key tile of 16-row blocks is 16 boxes of K and 16 of V, which land later than a contiguous tile's 4): one more
# tile in flight measured 1.01-1.06x two on an H200 with blocks of 16 and 1.06-1.07x with blocks of 64. Without a
# mask it gained 1.08x with blocks of 64 but lost 0.94-1.00x with blocks of 16, the common size: two stay. Head dim
# 64 under a mask: TUNED_TMA_VARLEN's unmasked 64x128 overlap config, 1.31-1.40x the cp.async kernel with blocks of
# 16 and 1.47-1.66x with 64 (128x128 ping-pong in 2 or 3 stages: within 0.90-1.0x of it).
TUNED_TMA_PAGED = {
    (64, 64, True): [(64, 128, 4, 2, Schedule.OVERLAP)],
    (128, 128, True): [(128, 128, 8, 3, Schedule.PINGPONG)],
}

# sm_90a, an fp8 cache (kv_dtype; contiguous or paged), whose TMA kernel runs two consumer warpgroups only
# (templates/prefill/widen.cuh): head dims 64 and 128, 128x128 ping-pong in three stages. On an H200 (GQA 32/8,
# blocks of 16 and 64, bf16 q, 0.5k-2k rows over 2k-8k keys) at 64: 1.33-1.59x the cp.async default, 1.11-1.23x its
# best tiles (128x64), 1.14-1.35x the TMA 128x64 overlap kernel, 1.00-1.11x two stages; at 128, 1.05-1.13x two stages.
# Head dim 256 keeps TUNED_TMA_VARLEN's 128x64 (ping-pong 0.96-0.98x).
TUNED_TMA_KV8 = {
    (64, 64, False): [(128, 128, 8, 3, Schedule.PINGPONG)],
    (64, 64, True): [(128, 128, 8, 3, Schedule.PINGPONG)],
    (128, 128, False): [(128, 128, 8, 3, Schedule.PINGPONG)],
    (128, 128, True): [(128, 128, 8, 3, Schedule.PINGPONG)],
}

# sm_90a, custom masks (a plan's tile lists): the TMA pipeline's kernels where measured faster than the cp.async
# default (64-row tiles), one CTA a work-list slot: at head_dim 128, 128x128 ping-pong. At 64 without a causal mask,
# 64x128 in overlap (H200, GQA 32/8, one run: prefix-LM over 4 x 4k 1.09x; 1 x 8k: block-diagonal masks of 4 and
# 16 documents 1.17x and 1.02x, random 128-blocks 1.11-1.21x; a two-sided window 0.985x), where an earlier probe had
# it lose on very sparse masks (sixteen documents, 0.84x); under a causal mask the cp.async kernel's 64-key tiles
# stay (TUNED_WGMMA_MASK: a document mask 0.98x, a window with global keys 0.95x on the TMA ring). Other head dims
# not measured.
TUNED_TMA_MASK = {
    (64, 64, False): [(64, 128, 4, 2, Schedule.OVERLAP)],
    (128, 128, False): [(128, 128, 8, 2, Schedule.PINGPONG)],
    (128, 128, True): [(128, 128, 8, 2, Schedule.PINGPONG)],
}

# sm_90a, custom masks at head_dim 64 under a causal mask: 64-key tiles, whose lists skip more of a sparse mask
# (a window with global keys: 0.20 against 0.27 ms for TUNED_WGMMA's 64x128; a document mask the same).
TUNED_WGMMA_MASK = {
    (64, True): [(64, 64, 4, 2)],
}

# sm_90a: the wgmma kernels, one warpgroup per 64 query rows (cta_tile_q = 16 x num_warps), per
# (head_dim, masked), as tools/sweep_configs.py ranked them; head_dim 192 not timed.
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
# appended when only that mask spills, per layout: the custom-mask and varlen kernels hold a few
# more registers than the dense one, at other edges (found by compiling each candidate for every
# manifest arch). No mma.sync candidate compiles spill-free for a custom mask at head_dim 192 on
# sm_100/sm_120 or 256 on sm_86/sm_89: those keep the least-spilling one and stay out of the default
# manifest.
_ALL_STAGES = (1, 2, 3, 4)
SPILLS_ON = {
    "dense": {
        (64, (128, 64, 4, 3), Mma.SYNC): ("sm_80", "sm_86", "sm_89", "sm_120"),
    },
    "varlen": {
        (64, (128, 64, 4, 3), Mma.SYNC): ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120"),
        # head_dim 256 on sm_100: each of these spills for some mask, contiguous or paged (every candidate
        # compiled for every mask and layout): (128, 64, 8, 1) is taken. On sm_86/sm_89 no candidate is
        # spill-free for a contiguous sliding window: that one stays out of the default manifest.
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


# Head dims between the measured ones (``neighbour``), per layout as SPILLS_ON: found by compiling each one's
# default, no mask and causal, contiguous and paged, for every manifest arch (NVRTC 13.5), until none spilled.
# Their neighbour's entries do not carry over (at 200-232 a custom mask spills where 256's does not, and the
# reverse).
_C, _N = MaskMode.CAUSAL, MaskMode.NONE
_WHOLE_SPILLS = {
    "dense": {
        (56, (128, 64, 4, 3)): ("sm_80", "sm_86", "sm_89", "sm_90a"),
        (120, (128, 64, 4, 1)): ("sm_86", "sm_89", "sm_120"),
        (136, (128, 32, 8, 2), _C): ("sm_86", "sm_89", "sm_90a"),
        (224, (128, 64, 8, 2)): ("sm_90a",),
        (232, (128, 64, 8, 2)): ("sm_100",),
        (240, (128, 64, 8, 2)): ("sm_90a", "sm_100"),
        (248, (128, 64, 8, 2)): ("sm_90a", "sm_100"),
    },
    "varlen": {
        (56, (128, 64, 4, 3)): ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100"),
        (72, (128, 64, 8, 2), _N): ("sm_86", "sm_89"),
        (104, (64, 64, 4, 3), _N): ("sm_100",),
        (112, (64, 64, 4, 3)): ("sm_100",),
        (120, (64, 64, 4, 3), _C): ("sm_100",),
        (120, (128, 64, 4, 1)): ("sm_86", "sm_89", "sm_120"),
        (144, (128, 32, 8, 2), _C): ("sm_120",),
        (208, (128, 64, 8, 2), _C): ("sm_80",),
        (216, (64, 32, 4, 2), _C): ("sm_86", "sm_89"),
        (224, (128, 64, 8, 2)): ("sm_90a",),
        (232, (128, 64, 8, 2)): ("sm_100",),
        (240, (128, 64, 8, 2)): ("sm_90a", "sm_100"),
        (248, (128, 64, 8, 2)): ("sm_90a", "sm_100"),
    },
    "mask": {
        **{(232, c, _C): ("sm_100",) for c in ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 1),
                                                (64, 128, 4, 1))},
        # 240 with a custom mask spills in most 64-row configs: 128-row ones are taken where these do
        (240, (64, 32, 4, 2)): ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100"),
        (240, (64, 64, 4, 2)): ("sm_80", "sm_90a", "sm_100"),
        (240, (64, 64, 4, 1)): ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100"),
        (240, (64, 64, 4, 3)): ("sm_90a", "sm_100"),
        (240, (64, 128, 4, 1)): ("sm_80", "sm_90a", "sm_100"),
        (240, (64, 32, 4, 3)): ("sm_80", "sm_90a"),
        (240, (64, 32, 4, 1)): ("sm_90a",),
        (240, (64, 32, 4, 1), _C): ("sm_80", "sm_86", "sm_89"),
        (240, (64, 32, 4, 4)): ("sm_80", "sm_90a"),
        (240, (128, 64, 8, 2)): ("sm_90a",),
        **{(248, c, _N): ("sm_100",) for c in ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 1), (64, 128, 4, 1))},
    },
}
for _layout, _entries in _WHOLE_SPILLS.items():
    SPILLS_ON[_layout].update({(k[0], k[1], Mma.SYNC, *k[2:]): v for k, v in _entries.items()})

# The chunked kernel (head_dim above 256, head_dim_v above head_dim): (cta_tile_q, cta_tile_kv, num_warps,
# num_stages, head_dim_chunk), best first. 64 query rows while O's columns split four ways stay
# within the registers (head_dim_v up to 640, with 64-key tiles there), 32 rows (eight ways) above.
# In tools/sweep_configs.py --chunked this order's first fitting config was the fastest, or close to it,
# at every head dim from 320 to 1024.
CHUNKED_ROWS_64_UP_TO = 640
CHUNKED = {
    64: [(64, 128, 8, 3, 64), (64, 128, 8, 2, 64), (64, 64, 8, 3, 64), (64, 64, 8, 4, 64), (64, 64, 8, 2, 64),
         (64, 64, 8, 3, 32), (64, 64, 8, 2, 32)],
    32: [(32, 128, 8, 3, 64), (32, 128, 8, 2, 64), (32, 128, 8, 3, 32), (32, 128, 8, 2, 32)],
}


# The chunked kernel's wgmma form on sm_90a: (cta_tile_kv, num_stages, head_dim_chunk), 64 query rows and
# 8 warps, best first. 128-key tiles with four stages of 64-wide chunks lead; four stages rather than three
# because a step's wgmma is left running, so three stages prefetch one step only. 640 fits 64-key tiles only.
# Past 640 columns of v two CTAs split O (each repeating the QK work).
CHUNKED_WGMMA = [(128, 4, 64), (64, 4, 64), (64, 4, 128), (128, 3, 128), (64, 3, 64)]
# Per (head_dim, head_dim_v), what ran fastest there, ahead of the list above: a deeper ring (five to six
# stages, which the list above never takes) or 128-wide chunks, halving the steps a tile and so the CTA
# barriers; 320 keeps the list's first (more stages lost at small batches), and 768 and 1024 spill at
# 128-wide chunks. Where a warpgroup's V columns end in a 32-column tail step (no padding: 320, 448, 576),
# 576's 128-key tiles no longer spill.
# The same on the TMA ring (a producer warpgroup, Q's tile loaded once; every head dim whose V columns need no
# padding), from tools/sweep_configs.py --chunked --tma: the best config, or close to it, over both shapes and masks.
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
# compiled for every arch), per (head_dim, head_dim_v, mask):
# (cta_tile_q, cta_tile_kv, num_warps, num_stages, head_dim_chunk, mma) -> archs. Those of the cp.async ring:
# the TMA ring's consumers hold 240 registers a thread (setmaxnreg) and compile these spill-free.
CHUNKED_SPILLS_ON = {
    (192, 128, MaskMode.CAUSAL): {(64, 128, 8, 3, 64, Mma.SYNC): ("sm_80", "sm_86", "sm_89")},
    (640, 640, MaskMode.SLIDING_WINDOW): {(64, 64, 8, 3, 64, Mma.SYNC): ("sm_90a",)},
    # the two-CTA split at 768 with a window spills at 128-key tiles, whatever the ring's depth (64-key
    # tiles are spill-free)
    (768, 768, MaskMode.SLIDING_WINDOW): {(64, 128, 8, st, 64, Mma.WGMMA): ("sm_90a",) for st in range(3, 9)},
}
# The same for varlen kernels (NVRTC 13.5).
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
    if spec.qkv_dtype:
        return fp8.candidates(spec)
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
        elif spec.varlen and not spec.page_rows:
            if spec.kv_dtype:
                yield from tma(TUNED_TMA_KV8.get((d, spec.dim_v, key[1]), ()))
            if spec.paged:
                yield from tma(TUNED_TMA_PAGED.get((d, spec.dim_v, key[1]), ()))
            yield from tma(TUNED_TMA_VARLEN.get((d, spec.dim_v, key[1]), ()))
        elif spec.custom_mask:
            yield from tma(TUNED_TMA_MASK.get((d, spec.dim_v, key[1]), ()))
        if spec.custom_mask:
            yield from ((*c, W, S, SER, OFF) for c in TUNED_WGMMA_MASK.get(key, ()))
        yield from ((*c, W, S, SER, OFF) for c in TUNED_WGMMA[key])
        if not spec.custom_mask:
            yield from tma(wgmma_all)
        yield from ((*c, W, S, SER, OFF) for c in wgmma_all)
        if spec.custom_mask:  # the other TMA configs of a mask's tile lists: where asked for
            yield from tma(wgmma_all)
    yield from ((*c, Mma.SYNC, S, SER, OFF) for c in tuned_sync(d))
    yield from ((*c, Mma.SYNC, S, SER, OFF)
                for c in itertools.product((128, 64), (64, 128, 32), (4, 8), (2, 3, 1, 4)))
    if wgmma and dense:
        # Key tiles between the powers of two, last: no default takes one. Over the sweep's shapes none beat the
        # power-of-two default by geomean (128x80 at 256 wins some lengths and loses others; at 64 and 128 the wider
        # tiles spill or do not fit persistent). `attngen tune` tries them, and a spec may pin them.
        wide = [(16 * w, kv, w, st) for w in (8, 4) for kv in PrefillSpec.CTA_TILE_KV_WIDE for st in (2, 3)]
        yield from tma(wide)
        yield from ((*c, W, S, SER, OFF) for c in wide)
        # Three consumer warpgroups (192-row tiles on 12 warps, the TMA kernel's only): 160 registers a thread
        # fit head_dim 64 up to 128-key tiles, 128 up to 80 (``check`` refuses the rest).
        yield from tma([(192, kv, 12, st) for kv in (128, 112, 96, 80, 64) for st in (2, 3)])
