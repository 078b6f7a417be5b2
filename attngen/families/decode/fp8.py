"""fp8 KV caches for ``attngen.decode``: which format a call's caches hold, their checks, and the dequantisation
scales (``k_scale``, ``v_scale``) as the kernel takes them.

A torch cache of ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` names its format; a cache of raw bytes (uint8:
CuPy has no fp8 dtype, and torch users may keep bytes too) takes it from the spec's ``kv_dtype``. q stays fp16 or
bf16; the kernel widens K and V to fp16 in registers (templates/decode/fp8.cuh).
"""

from __future__ import annotations

import math

from ...errors import LaunchError
from ...runtime import tensor_info
from .spec import KVDType

# tensor_info's dtype names of fp8 arrays (torch's own; CuPy has none) and of raw bytes.
FP8_DTYPES = {"torch.float8_e4m3fn": KVDType.FP8_E4M3, "torch.float8_e5m2": KVDType.FP8_E5M2}
BYTE_DTYPES = ("torch.uint8", "uint8")
# An fp8 dtype torch has that no kernel reads (e4m3 with a NaN at 0x80 and a bias of 8, ...): named, not guessed.
_OTHER_FP8 = ("torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz", "torch.float8_e8m0fnu")
_SCALE_SHAPES = "a float, or an fp32 device tensor of shape [] or [1] (per tensor) or [kv_heads] (per KV head)"


def is_fp8_name(dtype: str) -> bool:
    return dtype in FP8_DTYPES or dtype in BYTE_DTYPES or dtype in _OTHER_FP8


def cache_format(qi, ki, vi, spec_kv: KVDType | None, names: tuple[str, str] = ("k_cache", "v_cache"),
                 operands: str = "q, k_cache, v_cache") -> KVDType | None:
    """The caches' format (None: q's dtype) after the dtype checks of a call whose q is fp16 or bf16; ``spec_kv``
    is the ``kv_dtype`` of the caller's spec, if any. ``names``: the two caches' argument names, ``operands``
    every operand's, for the messages (MLA decode's ckv and kpe caches). Raises LaunchError naming the
    disagreement."""
    if ki.dtype != vi.dtype:
        raise LaunchError(f"{names[0]} and {names[1]} must share a dtype; got {ki.dtype}, {vi.dtype}")
    dt = ki.dtype
    if dt == qi.dtype and spec_kv is None:
        return None
    if dt in FP8_DTYPES:
        kv = FP8_DTYPES[dt]
        if spec_kv is not None and spec_kv is not kv:
            raise LaunchError(f"kv_dtype={spec_kv.value} (the spec) disagrees with the caches' dtype {dt} "
                              f"(kv_dtype={kv.value})")
        return kv
    if dt in BYTE_DTYPES:
        if spec_kv is None:
            raise LaunchError(f"{names[0]} and {names[1]} are {dt} bytes: pass a spec with kv_dtype=fp8_e4m3 or "
                              f"fp8_e5m2 to name their format")
        return spec_kv
    if spec_kv is not None:
        raise LaunchError(f"kv_dtype={spec_kv.value} (the spec) disagrees with the caches' dtype {dt}; an fp8 "
                          f"cache is torch.float8_e4m3fn, torch.float8_e5m2 or uint8 bytes")
    raise LaunchError(f"{operands} must share a dtype, or the caches be fp8 (torch.float8_e4m3fn, "
                      f"torch.float8_e5m2, or uint8 with the spec's kv_dtype); got {qi.dtype}, {ki.dtype}, "
                      f"{vi.dtype}")


def check_rows(t, name: str) -> None:
    """An fp8 cache the kernel copies in 16-byte chunks (16 elements): 4 dims, a contiguous last dim, 16-byte
    aligned, strides multiples of 16 elements."""
    if t.ptr % 16 or any(s % 16 for s in t.strides[:-1]):
        raise LaunchError(f"{name} (fp8) must be 16-byte aligned with strides that are multiples of 16 elements; "
                          f"got strides {t.strides}")


def check_paged(ki, vi, batch: int, bt_sb: int, row_blocks: int) -> None:
    """A paged fp8 cache's offsets as the kernel forms them (templates/decode/fp8.cuh): block and slot strides
    below 2^32 elements, and the block table's entries (``batch`` rows ``bt_sb`` apart, ``row_blocks`` read a row)
    within 2^32 of its start."""
    for t, name in ((ki, "k_cache"), (vi, "v_cache")):
        if max(t.strides[0], t.strides[1]) >= 2 ** 32:
            raise LaunchError(f"{name} (fp8, paged) has strides {t.strides}; allowed: block and slot strides (the "
                              f"first two) below 2^32 elements")
    if (batch - 1) * bt_sb + row_blocks > 2 ** 32:
        raise LaunchError(f"block_table (with an fp8 cache) spans {(batch - 1) * bt_sb + row_blocks} entries from "
                          f"its start ({batch} rows {bt_sb} apart, {row_blocks} a row); allowed: at most 2^32")


def scale_key(x, name: str = "scale"):
    """A scale as part of a call's key: a number as itself (None too), an array as its info (``name``: the
    argument's, for tensor_info's refusals)."""
    if x is None or x.__class__ in (int, float):
        return x
    return tensor_info(x, name)


def scale_number(x):
    """A scale as one of keep_call's numbers (None where it is an array, which the key names by its info)."""
    return x if x is None or x.__class__ in (int, float) else None


def scales(k_scale, v_scale, kv: KVDType | None, kv_heads: int, kind: str, device: int) -> tuple:
    """(host factor of the softmax scale, k pointer, v pointer, k stride, v stride, v's number) for the kernel
    (DecodeParams' order after the factor): a number
    is folded on the host (k into sm_scale, v as v_scale_f), a device tensor is read by each CTA at its KV head.
    Without an fp8 cache a scale is refused: the 16-bit kernels have nothing to dequantise."""
    if kv is None:
        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
            if x is not None:
                raise LaunchError(f"{name} is only for fp8 caches (kv_dtype fp8_e4m3 or fp8_e5m2); the caches hold "
                                  f"q's dtype")
        return 1.0, 0, 0, 0, 0, 1.0
    k_mul, k_ptr, _, k_sh = scale_arg(k_scale, "k_scale", kv_heads, kind, device)
    v_mul, v_ptr, _, v_sh = scale_arg(v_scale, "v_scale", kv_heads, kind, device)
    return k_mul, k_ptr, v_ptr, k_sh, v_sh, v_mul


def scale_arg(x, name: str, kv_heads: int, kind: str, device: int, batch: int | None = None,
              shapes: str = _SCALE_SHAPES) -> tuple[float, int, int, int]:
    """(number, pointer, batch stride, KV-head stride) of one scale: (x, 0, 0, 0) for a number (1.0 where missing),
    (1.0, ptr, strides) for a device tensor of shape [], [1], [kv_heads], or with ``batch`` (fp8 prefill's
    descales, FlashAttention-3's form) [batch, kv_heads]. ``shapes``: the allowed forms as the messages say them."""
    if x is None:
        return 1.0, 0, 0, 0
    if x.__class__ in (int, float):
        v = float(x)
        if not math.isfinite(v) or v <= 0:
            raise LaunchError(f"{name}={x!r} must be finite and > 0")
        return v, 0, 0, 0
    if isinstance(x, bool):
        raise LaunchError(f"{name}={x!r} is not allowed; allowed: {shapes}")
    t = tensor_info(x, name)  # refuses host tensors and what is no array, by name
    if t.kind != kind or t.device != device:
        raise LaunchError(f"{name} must be a {kind} tensor on device {device}; got {t.kind} on device {t.device}")
    if t.dtype != "fp32":
        raise LaunchError(f"{name} has dtype {t.dtype}; allowed: fp32 ({shapes})")
    shape = tuple(t.shape)
    if shape in ((), (1,)):
        return 1.0, t.ptr, 0, 0
    if shape == (kv_heads,):
        return 1.0, t.ptr, 0, t.strides[0]
    if batch is not None and shape == (batch, kv_heads):
        return 1.0, t.ptr, t.strides[0], t.strides[1]
    if batch is None:
        raise LaunchError(f"{name} has shape {list(shape)}; allowed: {shapes}, kv_heads={kv_heads}")
    raise LaunchError(f"{name} has shape {list(shape)}; allowed: {shapes} (batch={batch}, kv_heads={kv_heads})")


def check_kvcache_call(q, k_cache, v_cache, k, k_scale, v_scale, many: bool) -> KVDType | None:
    """``flash_attn_with_kvcache``'s fp8 rules, before the cache is written: the caches' format (None: q's dtype,
    where a scale is refused), and for an fp8 cache a head dim the fp8 kernels take, new k/v in q's dtype and valid
    scales (``many``: past MAX_Q_LEN new tokens, whose prefill route the caller checks). Raises LaunchError."""
    # the dtypes' names without tensor_info, so that what is no array keeps the error the checks after give it
    names = (str(getattr(k_cache, "dtype", "")), str(getattr(v_cache, "dtype", "")))
    if not any(map(is_fp8_name, names)):
        scales(k_scale, v_scale, None, 0, "", 0)  # refuses a scale without an fp8 cache
        return None
    ki, vi = tensor_info(k_cache, "k_cache"), tensor_info(v_cache, "v_cache")
    kv = FP8_DTYPES.get(ki.dtype)
    if kv is None or vi.dtype != ki.dtype:
        raise LaunchError(f"k_cache/v_cache have dtype {ki.dtype}/{vi.dtype}: flash_attn_with_kvcache takes an fp8 "
                          f"cache as torch.float8_e4m3fn or torch.float8_e5m2 for both (bytes name no format)")
    qi = tensor_info(q, "q")
    d = ki.shape[-1] if len(ki.shape) == 4 else 0
    if d % 16 or not 32 <= d <= 256:
        raise LaunchError(f"head_dim={d} with an fp8 cache (kv_dtype={kv.value}); allowed: a multiple of 16 from 32 "
                          f"to 256")
    if k is not None:
        kd = tensor_info(k, "k").dtype
        if kd != qi.dtype:
            raise LaunchError(f"k/v have dtype {kd}; with an fp8 cache they come in q's dtype ({qi.dtype}) and are "
                              f"quantised with k_scale/v_scale as they are appended")
    scales(k_scale, v_scale, kv, ki.shape[2], qi.kind, qi.device)
    return kv


def quantise(x, scale, kv: KVDType):
    """New tokens (torch, q's dtype) as the cache stores them: x / scale rounded to the format, saturating at its
    largest finite value (as serving engines quantise); ``scale`` a number, None (1) or a checked fp32 tensor of
    shape [], [1] or [kv_heads]."""
    import torch

    dt = torch.float8_e4m3fn if kv is KVDType.FP8_E4M3 else torch.float8_e5m2
    top = torch.finfo(dt).max
    if scale is None or scale.__class__ in (int, float):
        y = x.float() / float(1.0 if scale is None else scale)
    else:
        s = scale.reshape(()) if scale.numel() == 1 else scale
        y = x.float() / (s if s.dim() == 0 else s[:, None])
    return y.clamp(-top, top).to(dt)


def byte_views(*xs):
    """fp8 tensors as uint8 views of the same memory: the append writes them through indexing, which every torch
    build has for bytes (not every one for its fp8 dtypes)."""
    import torch

    return tuple(x.view(torch.uint8) for x in xs)
