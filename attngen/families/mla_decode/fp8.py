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
    ``kv_dtype``. Raises LaunchError naming the disagreement."""
    if cv.dtype != pe.dtype:
        raise LaunchError(f"ckv_cache and kpe_cache must share a dtype; got {cv.dtype}, {pe.dtype}")
    dt = cv.dtype
    if dt == qi.dtype and spec_kv is None:
        return None
    if dt in _decode_fp8.FP8_DTYPES:
        kv = _decode_fp8.FP8_DTYPES[dt]
        if spec_kv is not None and spec_kv is not kv:
            raise LaunchError(f"kv_dtype={spec_kv.value} (the spec) disagrees with the caches' dtype {dt} "
                              f"(kv_dtype={kv.value})")
        return kv
    if dt in _decode_fp8.BYTE_DTYPES:
        if spec_kv is None:
            raise LaunchError(f"ckv_cache and kpe_cache are {dt} bytes: pass a spec with kv_dtype=fp8_e4m3 or "
                              f"fp8_e5m2 to name their format")
        return spec_kv
    if spec_kv is not None:
        raise LaunchError(f"kv_dtype={spec_kv.value} (the spec) disagrees with the caches' dtype {dt}; an fp8 "
                          f"cache is torch.float8_e4m3fn, torch.float8_e5m2 or uint8 bytes")
    raise LaunchError(f"q_nope, q_pe, ckv_cache, kpe_cache must share a dtype, or the caches be fp8 "
                      f"(torch.float8_e4m3fn, torch.float8_e5m2, or uint8 with the spec's kv_dtype); got "
                      f"{qi.dtype}, {cv.dtype}, {pe.dtype}")


def check_rows(t, name: str) -> None:
    """An fp8 cache the kernel copies in 16-byte chunks (16 elements): 16-byte aligned, strides multiples of 16."""
    if t.ptr % 16 or any(s % 16 for s in t.strides[:-1]):
        raise LaunchError(f"{name} (fp8) must be 16-byte aligned with strides that are multiples of 16 elements; "
                          f"got strides {t.strides}")


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
