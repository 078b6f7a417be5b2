"""Tensor maps for the TMA prefill kernel (``pipeline=tma``): what its producer warpgroup copies from.

q, k and v ``[batch, seqlen, heads, head_dim]`` (any strides the op accepts) each become a 4-d map
(head_dim, seqlen, heads, batch) whose boxes are one 64-column block of ``cta_tile_q`` rows (q) or
``cta_tile_kv`` rows (k, v; the chunked kernel's v: a V step's keys), 128-byte swizzled as wgmma reads
them (WgmmaLayout), with zeros past the ends (``attngen/families/tma.py`` builds and keeps them). A varlen
batch's packed ``[total, heads, head_dim]`` tensors are one batch of ``total`` rows: its kernel offsets a tile's
rows by its sequence's first. A paged cache ``[num_blocks, block_size, kv_heads, head_dim]`` is a map of
``num_blocks`` batches of ``block_size`` rows, whose boxes are one block's rows (``page_box_rows``): the kernel
copies a key tile box by box, each from the block its table names. An fp8 cache's k and v (``kv_dtype``) are maps of
bytes, unswizzled, in boxes of at most 32 rows, which the kernel widens in place.
"""

from __future__ import annotations

from ..tma import tiled_map


def _refusal(t, what: str = ""):
    """The text of a refusal by the driver for TensorInfo ``t`` (``what``: which map of it, if not the whole)."""
    return lambda e: (f"pipeline=tma: no TMA tensor map for {what}shape {tuple(t.shape)} with strides "
                      f"{tuple(t.strides)}: {e}; use a spec with pipeline=sync")


def _map(t, rows: int, fallback_ptr: int, item: int = 2) -> bytes:
    """The map of TensorInfo ``t`` (4-d, or 3-d: packed varlen rows, one batch) with boxes of ``rows`` rows;
    ``item``: its element's bytes (1: an fp8 cache, whose boxes of 64 columns are unswizzled bytes)."""
    if len(t.shape) == 3:
        (s, h, d), (ss, sh, _) = t.shape, t.strides
        b, sb = 1, ss  # (a dim of one: its stride is never used, and any multiple of 16 bytes is valid)
    else:
        b, s, h, d = t.shape
        sb, ss, sh, _ = t.strides
    # An empty sequence is never read (its CTAs visit no tile), but a map's dims must be >= 1 and its
    # address not null.
    return tiled_map(t.dtype, t.ptr or fallback_ptr, (d, max(s, 1), h, b), (item * ss, item * sh, item * sb),
                     (64, rows, 1, 1), _refusal(t))


def _tail_map(t, spec, rows: int, fallback_ptr: int) -> bytes:
    """The chunked kernel's V tail (``spec.v_tail``): a 5-d map (32 columns, seqlen, the 2 x v_splits warpgroup
    halves of v's columns, heads, batch) starting 32 columns before the end of the first half. TMA gives each
    32-column row of a box a 128-byte row of its own (the swizzle's span), so a box (32, rows, 2) lands each
    warpgroup's tail in the first 32 columns of a 64-column block of its own."""
    b, s, h, d = t.shape
    sb, ss, sh, _ = t.strides
    half = spec.dim_v_padded // 2  # a warpgroup's columns
    return tiled_map(t.dtype, (t.ptr or fallback_ptr) + 2 * (half - 32), (32, max(s, 1), 2 * spec.v_splits, h, b),
                     (2 * ss, 2 * half, 2 * sh, 2 * sb), (32, rows, 2, 1, 1), _refusal(t, "v's column tails, "))


def page_box_rows(block_size: int, cta_tile_kv: int) -> int:
    """The rows of a paged cache's box: the largest power of two that divides both ``block_size`` (a multiple of
    16) and ``cta_tile_kv``; so a box never crosses a block, and a key tile is whole boxes (the kernel works it out
    the same way: prefill/producer.cuh's produce)."""
    return min(cta_tile_kv & -cta_tile_kv, block_size & -block_size)


def tensor_maps(qi, ki, vi, spec) -> bytes:
    """The kernel's maps (q, k, v, and the chunked kernel's V tail where it has one), as PrefillTmaParams
    holds them."""
    # (the chunked kernel copies v a V step at a time: its keys)
    v_rows = spec.chunk_grid["vk"] if spec.chunked else spec.cta_tile_kv
    k_rows = spec.cta_tile_kv
    if spec.paged:
        k_rows = v_rows = page_box_rows(ki.shape[1], spec.cta_tile_kv)
    item = 2
    if spec.kv_dtype:  # an fp8 cache: boxes of at most 32 rows, each widened in its 32-key unit of the slot
        k_rows = v_rows = min(k_rows, 32)
        item = 1
    maps = _map(qi, spec.cta_tile_q, qi.ptr) + _map(ki, k_rows, qi.ptr, item) + _map(vi, v_rows, qi.ptr, item)
    if spec.chunked and spec.v_tail:
        maps += _tail_map(vi, spec, v_rows, qi.ptr)
    return maps
