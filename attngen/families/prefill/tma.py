"""Tensor maps for the TMA prefill kernel (``pipeline=tma``): what its producer warpgroup copies from.

q, k and v ``[batch, seqlen, heads, head_dim]`` (any strides the op accepts) each become a 4-d map
(head_dim, seqlen, heads, batch) whose boxes are one 64-column block of ``cta_tile_q`` rows (q) or
``cta_tile_kv`` rows (k, v), 128-byte swizzled as wgmma reads them (WgmmaLayout), with zeros past
the ends. The driver builds a map in a few microseconds; the maps of the last few hundred
(pointer, shape, strides) are kept, so a call on the same buffers (a model's layers, a serving
loop) looks them up. So are the driver's refusals: a caller that falls back to the cp.async kernel
for such inputs does not ask the driver again each call.
"""

from __future__ import annotations

from ..._driver import driver
from ...errors import LaunchError

_DTYPE_CODES = {"fp16": 6, "bf16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_MAX_KEPT = 512
_kept: dict[tuple, "bytes | LaunchError"] = {}


def _map(t, rows: int, fallback_ptr: int) -> bytes:
    """The map of TensorInfo ``t`` with boxes of ``rows`` rows."""
    b, s, h, d = t.shape
    sb, ss, sh, _ = t.strides
    key = (t.ptr, t.dtype, b, s, h, d, sb, ss, sh, rows)
    m = _kept.get(key)
    if m is None:
        # An empty sequence is never read (its CTAs visit no tile), but a map's dims must be >= 1 and
        # its address not null.
        ptr = t.ptr or fallback_ptr
        try:
            m = driver().encode_tiled(_DTYPE_CODES[t.dtype], ptr, (d, max(s, 1), h, b), (2 * ss, 2 * sh, 2 * sb),
                                      (64, rows, 1, 1), _SWIZZLE_128B, _L2_PROMOTION_256B)
        except LaunchError as e:
            m = LaunchError(f"pipeline=tma: no TMA tensor map for shape {tuple(t.shape)} with strides "
                            f"{tuple(t.strides)}: {e}; use a spec with pipeline=sync")
        if len(_kept) >= _MAX_KEPT:
            _kept.clear()
        _kept[key] = m
    if m.__class__ is LaunchError:
        raise m
    return m


def tensor_maps(qi, ki, vi, spec) -> bytes:
    """The kernel's three maps (q, k, v), as PrefillTmaParams holds them."""
    return _map(qi, spec.cta_tile_q, qi.ptr) + _map(ki, spec.cta_tile_kv, qi.ptr) + _map(vi, spec.cta_tile_kv, qi.ptr)
