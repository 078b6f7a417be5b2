"""Tensor maps for the TMA prefill kernel (``pipeline=tma``): what its producer warpgroup copies from.

q, k and v ``[batch, seqlen, heads, head_dim]`` (any strides the op accepts) each become a 4-d map
(head_dim, seqlen, heads, batch) whose boxes are one 64-column block of ``cta_tile_q`` rows (q) or
``cta_tile_kv`` rows (k, v; the chunked kernel's v: a V step's keys), 128-byte swizzled as wgmma reads
them (WgmmaLayout), with zeros past the ends (``attngen/families/tma.py`` builds and keeps them).
"""

from __future__ import annotations

from ..tma import tiled_map


def _map(t, rows: int, fallback_ptr: int) -> bytes:
    """The map of TensorInfo ``t`` with boxes of ``rows`` rows."""
    b, s, h, d = t.shape
    sb, ss, sh, _ = t.strides
    # An empty sequence is never read (its CTAs visit no tile), but a map's dims must be >= 1 and its
    # address not null.
    return tiled_map(t.dtype, t.ptr or fallback_ptr, (d, max(s, 1), h, b), (2 * ss, 2 * sh, 2 * sb), (64, rows, 1, 1),
                     lambda e: f"pipeline=tma: no TMA tensor map for shape {tuple(t.shape)} with strides "
                               f"{tuple(t.strides)}: {e}; use a spec with pipeline=sync")


def tensor_maps(qi, ki, vi, spec) -> bytes:
    """The kernel's three maps (q, k, v), as PrefillTmaParams holds them."""
    # (the chunked kernel copies v a V step at a time: its keys)
    v_rows = spec.chunk_grid["vk"] if spec.chunked else spec.cta_tile_kv
    return (_map(qi, spec.cta_tile_q, qi.ptr) + _map(ki, spec.cta_tile_kv, qi.ptr)
            + _map(vi, v_rows, qi.ptr))
