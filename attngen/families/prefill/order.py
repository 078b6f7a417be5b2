"""A varlen batch's work list: the (sequence, query tile) items the ``_order`` entry sorts on the GPU from
``cu_seqlens`` (plan.cuh ``order_work``), launched by every varlen call (varlen.py, fp8_op.py) and by the serving
step's plan; and the index arrays those calls take (cu_seqlens, block tables)."""

from __future__ import annotations

from ...errors import LaunchError
from ...runtime import tensor_info
from .masks import PLAN_PARAMS
from .spec import ORDER_SORT_MAX, PrefillSpec


def _index(x, name: str, rank: int, qi):
    t = tensor_info(x, name)
    if t.kind != qi.kind or t.device != qi.device:
        raise LaunchError(f"{name} must be a {qi.kind} array on device {qi.device}; got {t.kind} on device {t.device}")
    if t.dtype != "int32":
        raise LaunchError(f"{name} has dtype {t.dtype}; allowed: int32")
    if len(t.shape) != rank or t.strides[-1] != 1:
        raise LaunchError(f"{name} has shape {tuple(t.shape)}; expected {rank} dim(s), contiguous in the last")
    return t


class VarlenOrder:
    """A work list the ``_order`` entry built on the GPU (plan.cuh ``order_work``), kept to be launched over more
    than once: the serving step builds it once and each layer's call reads it. ``ws`` holds the items, their count
    and the per-sequence tile offsets; ``tiles`` the (query, key) tile sizes and mask it was sorted for, so that a
    call whose kernel has other tiles builds its own."""

    __slots__ = ("ws", "tiles", "max_items", "skip_q_le")

    def __init__(self, ws, tiles: tuple, max_items: int, skip_q_le: int):
        self.ws, self.tiles, self.max_items, self.skip_q_le = ws, tiles, max_items, skip_q_le


def order_tiles(spec: PrefillSpec) -> tuple:
    """What a varlen work list depends on in a kernel: its query and key tiles and its mask mode."""
    return spec.cta_tile_q, spec.cta_tile_kv, spec.mask


def launch_order(kern, stream: int, wp: int, max_items: int, cq_ptr: int, ck_ptr: int, left: int, right: int,
                 batch: int, total_q: int, total_k: int, paged: bool, skip_q_le: int = 0, *, seqlens_ptr: int = 0,
                 decode_order_ptr: int = 0) -> None:
    """``kern``'s ``_order`` entry: the (sequence, query tile) items of every sequence of more than ``skip_q_le``
    queries (PlanParams.max_decode_q_len), heaviest first, into the work buffer at ``wp`` (``max_items`` int2 slots,
    then the count, then batch + 1 tile offsets). The serving step's plan (paged): with ``seqlens_ptr`` (int32
    ``[batch]`` key counts) the entry reads the key counts there and writes their running sums to ``ck_ptr``
    (``[batch + 1]``, the kernel's cu_seqlens_k); with ``decode_order_ptr`` (int32 ``[batch]``, batch at most
    ``ORDER_SORT_MAX``) it also writes the decode kernel's order: the requests of 1 to ``skip_q_le`` queries, most
    keys first (ties by index), then the others by index."""
    if decode_order_ptr and batch > ORDER_SORT_MAX:
        raise LaunchError(f"batch={batch}: a decode order is sorted for at most {ORDER_SORT_MAX} requests")
    if seqlens_ptr and not paged:
        raise LaunchError("seqlens_ptr is for a paged cache's plan (cu_seqlens_k then gives only lengths)")
    kern.launch_struct(PLAN_PARAMS, (1, 1, 1), stream,
                       0, 0, 0, 0, 0, wp, wp + 8 * max_items, 0, cq_ptr, ck_ptr, wp + 8 * max_items + 4,
                       0, 0, 0, 0,
                       0, 0, 0, 1, 1, 0, 0, 0, left, right, batch, total_q, total_k, int(paged),
                       seqlens_ptr, ck_ptr if seqlens_ptr else 0, decode_order_ptr, skip_q_le, entry="_order")
