"""Which kernel ``attngen.merge_state`` / ``attngen.merge_states`` run, and how: one pure function,
``choose(problem, device) -> Choice(spec, launch)``. The spec is the problem's fields resolved for the arch (a
merge has no size-dependent tiles); the launch covers ``lanes_per_row`` threads of each (token, head) row (a thread
a vector for two states, a warp a chunk for several), ``num_warps`` warps a CTA."""

from __future__ import annotations

import functools
from typing import NamedTuple

from ...arch import Arch
from ...spec import resolve
from ..choice import Choice, DeviceFacts
from .spec import MergeDType, MergeSpec, States


class Problem(NamedTuple):
    """A merge call as the choice sees it: ``states`` "pair" or "many"."""

    head_dim: int
    dtype: str = "bf16"
    states: str = "pair"
    tokens: int = 1
    heads: int = 1


class Launch(NamedTuple):
    grid: tuple


@functools.lru_cache(maxsize=None)
def resolved(head_dim: int, dtype: str, states: str, arch: Arch) -> MergeSpec:
    return resolve(MergeSpec(head_dim=head_dim, dtype=MergeDType(dtype), states=States(states)), arch)


def launch(p: Problem, rs: MergeSpec) -> Launch:
    lanes = p.tokens * p.heads * rs.lanes_per_row
    return Launch((-(-lanes // rs.threads), 1, 1))


def choose(p: Problem, device: DeviceFacts) -> Choice:
    rs = resolved(p.head_dim, p.dtype, p.states, device.arch)
    return Choice(rs, launch(p, rs))


def reachable(spec: MergeSpec, arch: Arch) -> set:
    """Every resolved spec ``choose`` can return for a problem of ``spec``'s fields: ``spec`` resolved."""
    return {resolve(spec, arch)}
