"""What the families' choice functions share: the facts of a device they read, and a table of specs by size.

Each family has one pure function that chooses its kernel (``attngen/families/<family>/choose.py``):
``choose(problem, device, tuned) -> Choice(spec, launch)``. It reads the device only through a
``DeviceFacts`` (plain numbers, and the occupancy of a kernel of a given spec as a function the op backs
with the driver and a test with a table) and the tuned store only as data (``tuned.tuned_choices``' list),
so its decisions can be pinned on a machine without a GPU.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Callable, NamedTuple

from ..arch import Arch
from ..spec import Spec
from ..tuned import bucket_bounds


def _one_cta(spec, entry: str = "") -> int:
    return 1


def _no_clusters(spec, cluster_x: int) -> int:
    return 0


@dataclass(frozen=True)
class DeviceFacts:
    """What a choice reads of the device: its arch, SM count, the share of its SMs whose reads reach its
    memory's bandwidth (``split_kv.saturating_share``), and for a kernel of a given resolved spec how many
    CTAs of an entry one SM holds (``occupancy(spec, entry)``, the driver's count) and how many clusters of
    ``n`` CTAs the device holds at once (``max_clusters(spec, n)``; 0 where clusters are not launched)."""

    arch: Arch
    sm_count: int = 132
    memory_share: float = 0.5
    occupancy: Callable[..., int] = _one_cta
    max_clusters: Callable[[Spec, int], int] = _no_clusters


@functools.lru_cache(maxsize=None)
def device_facts(device: int) -> DeviceFacts:
    """The facts of ``device`` as the ops read them: from the driver, a kernel's through its loaded form
    (``runtime.get_kernel``, which loads each spec once per device)."""
    from ..runtime import device_arch, get_kernel, register_dependent_cache
    from .split_kv import saturating_share, sm_count

    # id of a spec -> (the spec, its loaded kernel): by identity, as a choice asks of the specs it keeps
    # (hashing a spec per call costs more); cleared with the loaded kernels
    kernels: dict = register_dependent_cache({})

    def kernel(spec):
        got = kernels.get(id(spec))
        if got is None or got[0] is not spec:
            got = kernels[id(spec)] = (spec, get_kernel(spec, device=device))
        return got[1]

    def occupancy(spec, entry: str = "") -> int:
        return kernel(spec).occupancy(entry)

    def max_clusters(spec, n: int) -> int:
        return kernel(spec).max_clusters(n)

    return DeviceFacts(device_arch(device), sm_count(device), saturating_share(device), occupancy, max_clusters)


@dataclass(frozen=True)
class SizeTable:
    """Which resolved spec a call runs by its size (prefill: its query rows; decode: its cache's capacity):
    ``specs[i]`` from ``bounds[i - 1]`` on (``bisect_right``)."""

    bounds: tuple[float, ...]
    specs: tuple[Spec, ...]

    def spec_for(self, size: int) -> Spec:
        return self.specs[bisect.bisect_right(self.bounds, size)]

    @classmethod
    def one(cls, spec: Spec) -> "SizeTable":
        return cls((), (spec,))

    @classmethod
    def tuned(cls, choices) -> "SizeTable":
        """The winners ``attngen tune`` stored, (size, spec) sorted by size: a size goes to the nearest tuned
        one by log distance (``tuned.bucket_bounds``)."""
        return cls(tuple(bucket_bounds([s for s, _ in choices])), tuple(c for _, c in choices))

    @classmethod
    def from_rows(cls, bounds, specs) -> "SizeTable":
        """``specs[i]`` from ``bounds[i - 1]`` (an int size) on, below ``bounds[i]``."""
        return cls(tuple(b - 0.5 for b in bounds), tuple(specs))


class Choice(NamedTuple):
    """What a choice function returns: the resolved spec to launch and the family's launch plan."""

    spec: Spec
    launch: object
