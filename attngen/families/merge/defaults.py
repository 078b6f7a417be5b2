"""The merge family's per-arch defaults: (num_warps,) best first. A merge streams its states once and does little
arithmetic; four warps a CTA (128 threads) is the usual shape of such a kernel and keeps many CTAs resident on
every arch, so the order is not measured per arch."""

from __future__ import annotations

from ...arch import Arch


def candidates(spec, arch: Arch):
    yield from ((4,), (8,), (2,))
