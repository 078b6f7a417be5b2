"""The prefill family's per-arch defaults: measured configs first, then every allowed combination.

``resolve`` takes the first candidate that agrees with what the spec pins and passes
``validate`` on the arch, so archs with less shared memory fall through to the best measured
config that fits them.
"""

from __future__ import annotations

import itertools

from ...arch import Arch
from .spec import MaskMode, Mma

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

# Configs ptxas spills on some archs (NVRTC 13.5): there the next tuned config is taken.
SPILLS_ON = {
    (64, (128, 64, 4, 3)): ("sm_80", "sm_86", "sm_89", "sm_120"),
}


def candidates(spec, arch: Arch):
    """(cta_tile_q, cta_tile_kv, num_warps, num_stages, mma): tuned configs first, then every
    allowed combination, larger tiles first; wgmma ones first on sm_90a."""
    d = spec.head_dim
    if arch.name == "sm_90a" and d % 64 == 0:
        yield from ((*c, Mma.WGMMA) for c in TUNED_WGMMA[(d, spec.mask is not MaskMode.NONE)])
        yield from ((16 * w, kv, w, st, Mma.WGMMA) for w in (8, 4) for kv in (128, 64, 32) for st in (2, 3, 1, 4))
    yield from ((*c, Mma.SYNC) for c in TUNED[d] if arch.name not in SPILLS_ON.get((d, c), ()))
    yield from ((*c, Mma.SYNC) for c in itertools.product((128, 64), (64, 128, 32), (4, 8), (2, 3, 1, 4)))
