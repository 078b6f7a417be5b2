"""TMA tensor maps for the kernels that load tiles with TMA (sm_90a): built by the driver
(``cuTensorMapEncodeTiled``), 128-byte swizzled as wgmma reads them (WgmmaLayout), zero fill past the
ends. The driver builds a map in a few microseconds; the maps of the last few hundred (pointer,
shape, strides, box) are kept, so a call on the same buffers (a model's layers, a serving loop)
looks them up. So are the driver's refusals: a caller that falls back to a cp.async kernel for such
inputs does not ask the driver again each call.
"""

from __future__ import annotations

from .._driver import driver
from ..errors import LaunchError

_DTYPE_CODES = {"fp16": 6, "bf16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
# fp8 caches (torch's fp8 dtypes, or uint8 bytes): CU_TENSOR_MAP_DATA_TYPE_UINT8, boxes unswizzled (a kernel widens
# them into a swizzled 16-bit tile itself: mla_decode/fp8_wgmma.cuh)
_BYTE_DTYPES = ("torch.float8_e4m3fn", "torch.float8_e5m2", "torch.uint8", "uint8")
_UINT8 = 0
_SWIZZLE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_256B = 3
_MAX_KEPT = 512
_kept: dict[tuple, "bytes | LaunchError"] = {}


def tiled_map(dtype: str, ptr: int, dims: tuple, byte_strides: tuple, box: tuple, what,
              swizzled_bytes: bool = False) -> bytes:
    """The map (128 bytes) of a ``dtype`` tensor at ``ptr`` with ``dims`` (innermost first),
    ``byte_strides`` (every dim but the first) and boxes of ``box``: 128-byte swizzled, or for an fp8 tensor
    (bytes) unswizzled unless ``swizzled_bytes`` (boxes of 128-byte rows that wgmma reads as they land: fp8
    prefill's transposed V). A refusal raises LaunchError with the text ``what(error)`` returns (the caller names
    its tensor and the fallback)."""
    key = (dtype, ptr, dims, byte_strides, box, swizzled_bytes)
    m = _kept.get(key)
    if m is None:
        byte = dtype in _BYTE_DTYPES
        try:
            m = driver().encode_tiled(_UINT8 if byte else _DTYPE_CODES[dtype], ptr, dims, byte_strides, box,
                                      _SWIZZLE_NONE if byte and not swizzled_bytes else _SWIZZLE_128B,
                                      _L2_PROMOTION_256B)
        except LaunchError as e:
            m = LaunchError(what(e))
        if len(_kept) >= _MAX_KEPT:
            _kept.clear()
        _kept[key] = m
    if m.__class__ is LaunchError:
        raise m
    return m
