"""What the decode families share on the host: the checks of their tensor arguments, how many CTAs
an SM holds and how many splits of the cache a call uses (the partials are merged by
``templates/common/split_merge.cuh``)."""

from __future__ import annotations

import functools

from .._driver import CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, driver
from ..arch import get_arch
from ..errors import LaunchError
from ..runtime import tensor_info

MAX_SPLITS = 256


def check_rows(t, name: str, rank: int, dims: str) -> None:
    """A 16-bit operand the kernels copy in 16-byte chunks: ``rank`` dims, a contiguous last dim,
    16-byte aligned with strides that are multiples of 8 elements."""
    if len(t.shape) != rank:
        raise LaunchError(f"{name} has shape {t.shape}; expected {rank} dims {dims}")
    if t.strides[-1] != 1:
        raise LaunchError(f"{name} has stride {t.strides[-1]} in its last dim; the last dim must be contiguous")
    if t.ptr % 16 or any(s % 8 for s in t.strides[:-1]):
        raise LaunchError(f"{name} must be 16-byte aligned with strides that are multiples of 8 elements; "
                          f"got strides {t.strides}")


def check_index(x, name: str, rank: int, kind: str, device: int):
    """An int32 index tensor (lengths, rows, a block table) of ``rank`` dims beside the operands."""
    t = tensor_info(x, name)
    if t.kind != kind or t.device != device:
        raise LaunchError(f"{name} must be a {kind} tensor on device {device}; got {t.kind} on device {t.device}")
    if t.dtype != "int32":
        raise LaunchError(f"{name} has dtype {t.dtype}; allowed: int32")
    if len(t.shape) != rank or t.strides[-1] != 1:
        raise LaunchError(f"{name} has shape {t.shape} and strides {t.strides}; expected {rank} dims with a "
                          f"contiguous last dim")
    return t


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    return driver().attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)


@functools.lru_cache(maxsize=None)
def ctas_per_sm(kern) -> int:
    """How many CTAs of a loaded kernel one SM holds at once (shared memory, threads, registers)."""
    spec = kern.spec
    a = get_arch(kern.binary.arch)
    regs = kern.binary.resources.registers if kern.binary.resources.known else 255
    by_smem = a.smem_per_sm // (spec.smem_bytes() + 1024)
    by_threads = 2048 // spec.threads
    by_regs = a.regs_per_sm // (max(regs, 1) * spec.threads)
    return max(1, min(by_smem, by_threads, by_regs))


@functools.lru_cache(maxsize=4096)
def choose_splits(ctas: int, capacity: int, block_n: int, sm_count: int, per_sm: int, tile_bytes: int,
                  out_bytes: int) -> int:
    """Split count from a cost model over SM count, the unsplit grid and sequence capacity.

    ``ctas`` is the grid without splitting, ``tile_bytes`` what one CTA reads per KV tile and
    ``out_bytes`` one split's fp32 partial output (every output row). Time is counted in "tile
    steps": one step is every resident CTA reading one tile. A split count s runs ctas * s CTAs
    in ceil(CTAs / slots) waves of ceil(tiles / s) + 2 steps (2 for the pipeline's fill), plus,
    when s > 1, one step for the merge launch and the merge's traffic (s partials) in steps of
    the same bandwidth.
    """
    tiles = max(1, -(-capacity // block_n))
    base = max(1, ctas)
    slots = max(1, sm_count * per_sm)
    best, best_cost = 1, None
    for s in range(1, min(MAX_SPLITS, tiles) + 1):
        waves = -(-base * s // slots)
        cost = waves * (-(-tiles // s) + 2)
        if s > 1:
            cost += 1 + s * out_bytes / (slots * tile_bytes)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best
