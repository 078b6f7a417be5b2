"""fp8 latent caches for ``attngen.mla_decode``: which format ``ckv_cache`` and ``kpe_cache`` hold, their checks,
and the dequantisation scale as the kernel takes it.

A torch cache of ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` names its format; a cache of raw bytes (uint8: CuPy
has no fp8 dtype) takes it from the spec's ``kv_dtype``, as ``attngen.decode`` does. One scale, ``k_scale``, for
both (ckv is K and V at once, and FlashMLA and vLLM keep one scale for the MLA cache): a number, or an fp32 device
tensor of shape [] or [1], read by the kernel (CUDA-graph safe). q stays fp16 or bf16; the kernel widens the cache to
fp16 in registers (templates/mla_decode/fp8.cuh).
"""

from __future__ import annotations

import math

from ...errors import LaunchError
from ...runtime import tensor_info
from ..decode import fp8 as _decode_fp8
from ..decode.spec import KVDType

SCALE_SHAPES = "a float > 0, or an fp32 device tensor of shape [] or [1] (one scale for ckv and kpe)"


def cache_format(qi, cv, pe, spec_kv: KVDType | None) -> KVDType | None:
    """The caches' format (None: q's dtype) for q of dtype fp16 or bf16; ``spec_kv`` is the caller's spec's
    ``kv_dtype``. Decode's rule, with MLA's argument names in its messages."""
    return _decode_fp8.cache_format(qi, cv, pe, spec_kv, ("ckv_cache", "kpe_cache"),
                                    "q_nope, q_pe, ckv_cache, kpe_cache")


# An fp8 cache the kernel copies in 16-byte chunks, as decode's.
check_rows = _decode_fp8.check_rows


def scale_args(k_scale, kv: KVDType | None, kind: str, device: int) -> tuple[int, float]:
    """(pointer, number) of ``k_scale`` for the fp8 kernel (MlaFp8Params): a device tensor's pointer and 1.0, or 0
    and the number. Refused where the cache holds q's dtype (nothing to dequantise), and missing with an fp8 cache
    (a cache quantised with a scale of 1 passes k_scale=1.0)."""
    if kv is None:
        if k_scale is not None:
            raise LaunchError("k_scale is only for fp8 caches (kv_dtype fp8_e4m3 or fp8_e5m2); ckv_cache and "
                              "kpe_cache hold q's dtype")
        return 0, 1.0
    if k_scale is None:
        raise LaunchError(f"k_scale is required with an fp8 cache (kv_dtype={kv.value}): {SCALE_SHAPES}")
    if isinstance(k_scale, bool):
        raise LaunchError(f"k_scale={k_scale!r} is not allowed; allowed: {SCALE_SHAPES}")
    if k_scale.__class__ in (int, float):
        v = float(k_scale)
        if not math.isfinite(v) or v <= 0:
            raise LaunchError(f"k_scale={k_scale!r} must be finite and > 0")
        return 0, v
    t = tensor_info(k_scale, "k_scale")  # refuses host tensors and what is no array, by name
    if t.kind != kind or t.device != device:
        raise LaunchError(f"k_scale must be a {kind} tensor on device {device}; got {t.kind} on device {t.device}")
    if t.dtype != "fp32":
        raise LaunchError(f"k_scale has dtype {t.dtype}; allowed: {SCALE_SHAPES}")
    if tuple(t.shape) not in ((), (1,)):
        raise LaunchError(f"k_scale has shape {list(t.shape)}; allowed: {SCALE_SHAPES}")
    return t.ptr, 1.0
