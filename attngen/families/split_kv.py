"""What the decode families share on the host: the checks of their tensor arguments, how many CTAs
an SM holds and how many splits of the cache a call uses (the partials are merged by
``templates/common/split_merge.cuh``)."""

from __future__ import annotations

import functools

from .._driver import (CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE,
                       CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, driver)
from ..errors import LaunchError
from ..runtime import tensor_info

MAX_SPLITS = 256
# The most splits of a row merged in one thread-block cluster (sm_90): the portable cluster size (16, where
# a GPU allows it, was slower for decode at batch 1: fewer of its clusters fit at once).
CLUSTER_MAX = 8


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


def checked_splits(num_splits) -> int:
    """``num_splits``: 0 (automatic) or a forced split count up to MAX_SPLITS."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits <= MAX_SPLITS:
        raise LaunchError(f"num_splits={num_splits!r} must be an int from 0 (automatic) to {MAX_SPLITS}")
    return num_splits


# Key positions are int32 on the device: a paged cache's capacity (table entries x block_size) stays below this.
MAX_PAGED_KEYS = 2 ** 31


def check_block_size(block_size: int, blocks: int, cache_name: str, max_block: int = 0, multiple: int = 16) -> int:
    """The capacity ``blocks`` x ``block_size`` of a paged cache (``cache_name``.shape[1] positions a block),
    after checking the block size: a multiple of ``multiple`` (16 where a 16-row group of a KV tile must never
    span two blocks, which the kernels' per-group lookups rely on; 1 where the kernels look up every row), at
    most ``max_block`` where that is not 0, and a capacity below 2^31 positions (int32 on the device)."""
    if block_size % multiple or block_size < max(1, multiple) or (max_block and block_size > max_block):
        kind = "an int" if multiple == 1 else f"a multiple of {multiple}"
        allowed = f"{kind} from {multiple} to {max_block}" if max_block else f"a positive {kind[2:].lstrip()}"
        raise LaunchError(f"block_size={block_size} ({cache_name}.shape[1]) is not supported; allowed: {allowed}")
    if blocks * block_size >= MAX_PAGED_KEYS:
        raise LaunchError(f"a paged cache of {blocks} blocks a row x block_size={block_size} = "
                          f"{blocks * block_size} positions is not supported; allowed: fewer than 2^31")
    return blocks * block_size


def paged_table(block_table, batch: int, block_size: int, kind: str, device: int, q_name: str,
                cache_name: str, max_block: int = 0, multiple: int = 16) -> tuple[int, int, int]:
    """(capacity, table pointer, table row stride) of a paged cache whose blocks hold ``block_size``
    positions (``cache_name``.shape[1]), after checking the int32 table against the batch and the block size
    (``check_block_size``)."""
    bt = check_index(block_table, "block_table", 2, kind, device)
    if bt.shape[0] != batch:
        raise LaunchError(f"block_table has {bt.shape[0]} rows; {q_name} has batch {batch}")
    return check_block_size(block_size, bt.shape[1], cache_name, max_block, multiple), bt.ptr, bt.strides[0]


def cache_lengths(cache_seqlens, batch: int, kind: str, device: int, q_name: str) -> tuple[int, int]:
    """(lengths pointer, fixed length) for ``cache_seqlens``: an int32 tensor [batch] (pointer, 0)
    or one int for every row (0, the int)."""
    if isinstance(cache_seqlens, bool):
        raise LaunchError("cache_seqlens must be an int32 tensor [batch] or an int; got a bool")
    if isinstance(cache_seqlens, int):
        if cache_seqlens < 0:
            raise LaunchError(f"cache_seqlens={cache_seqlens} must be >= 0")
        return 0, cache_seqlens
    si = check_index(cache_seqlens, "cache_seqlens", 1, kind, device)
    if si.shape[0] != batch:
        raise LaunchError(f"cache_seqlens has {si.shape[0]} entries; {q_name} has batch {batch}")
    return si.ptr, 0


@functools.lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    return driver().attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device)


SM_STREAM_BYTES_PER_S = 52e9  # what one SM streams at most (fitted to decode's reads on two GPUs' memories)


@functools.lru_cache(maxsize=None)
def saturating_share(device: int) -> float:
    """The share of the device's SMs whose streaming reads reach its memory's peak bandwidth (the
    driver's memory clock and bus width), at SM_STREAM_BYTES_PER_S an SM; 0.5 where the driver
    does not say. About 0.49 on an H100 SXM (3.35 TB/s) and 0.7 on an H200 (4.8 TB/s)."""
    drv = driver()
    try:
        khz = drv.attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, device)
        bits = drv.attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, device)
    except LaunchError:
        khz = bits = 0
    peak = 2 * khz * 1e3 * bits / 8
    return min(1.0, peak / (SM_STREAM_BYTES_PER_S * sm_count(device))) if peak > 0 else 0.5


def ctas_per_sm(kern) -> int:
    """How many CTAs of a loaded kernel's main entry one SM holds at once: the driver's count (registers,
    threads, shared memory), not one worked out from the compile's register report: NVRTC leaves that report
    out of some logs, and a kernel without one would count as 255 registers a thread, which halves the
    persistent grid of a kernel that runs two CTAs an SM."""
    return max(1, kern.occupancy())


@functools.lru_cache(maxsize=4096)
def choose_splits(ctas: int, capacity: int, block_n: int, sm_count: int, per_sm: int, tile_bytes: int,
                  out_bytes: int, *, q_bytes: int = 0, side_weight: float = 1.0, out_passes: int = 1,
                  max_splits: int = MAX_SPLITS) -> int:
    """Split count from a cost model over SM count, the unsplit grid and sequence capacity.

    ``ctas`` is the grid without splitting, ``tile_bytes`` what one CTA reads per KV tile and
    ``out_bytes`` one split's fp32 partial output (every output row). Time is counted in "tile
    steps": one step is every resident CTA reading one tile. A split count s runs ctas * s CTAs
    in ceil(CTAs / slots) waves of ceil(tiles / s) + 2 steps (2 for the pipeline's fill), plus,
    when s > 1, one step for the merge launch and the merge's traffic (s partials, ``out_passes``
    times) in steps of the same bandwidth (``out_bytes`` 0 where the splits merge on chip), at
    most ``max_splits`` splits. ``q_bytes`` is what every split reads besides its tiles
    (the queries of the whole grid); ``side_weight`` scales that and the partials' traffic (MLA
    decode: its 64-row partials and Q are as large as a tile, and cost about twice their bytes).
    """
    tiles = max(1, -(-capacity // block_n))
    base = max(1, ctas)
    slots = max(1, sm_count * per_sm)
    step = slots * tile_bytes
    best, best_cost = 1, None
    for s in range(1, min(max_splits, tiles) + 1):
        waves = -(-base * s // slots)
        cost = waves * (-(-tiles // s) + 2) + side_weight * s * q_bytes / step
        if s > 1:
            cost += 1 + side_weight * s * out_passes * out_bytes / step
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best
