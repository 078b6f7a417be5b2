"""``attngen.prefill``: FlashAttention-layout attention forward on torch tensors or CuPy arrays."""

from __future__ import annotations

import math
import struct

from ..errors import LaunchError
from ..runtime import current_stream, empty_like_kind, get_kernel, tensor_info
from ..spec import DType, MaskMode, PrefillSpec

# PrefillParams in templates/common/prefill_fwd.cuh: 5 pointers, 12 strides, 4 ints, 2 floats, 2 ints.
_PARAMS = struct.Struct("<5Q12q4i2f2i")
_LOG2E = 1.4426950408889634


def _check_qkv(q, k, v):
    qi, ki, vi = tensor_info(q, "q"), tensor_info(k, "k"), tensor_info(v, "v")
    for name, t in (("q", qi), ("k", ki), ("v", vi)):
        if len(t.shape) != 4:
            raise LaunchError(f"{name} has shape {t.shape}; expected 4 dims [batch, seqlen, heads, head_dim]")
        if t.strides[-1] != 1:
            raise LaunchError(f"{name} has stride {t.strides[-1]} in its last dim; head_dim must be contiguous")
        if t.ptr % 16 or any(s % 8 for s in t.strides[:-1]):
            raise LaunchError(f"{name} must be 16-byte aligned with batch/seq/head strides that are multiples "
                              f"of 8 elements; got strides {t.strides}")
    if len({qi.kind, ki.kind, vi.kind}) != 1:
        raise LaunchError(f"q, k, v must be of one kind; got {qi.kind}, {ki.kind}, {vi.kind}")
    if len({qi.device, ki.device, vi.device}) != 1:
        raise LaunchError(f"q, k, v must be on one device; got {qi.device}, {ki.device}, {vi.device}")
    if qi.dtype not in ("fp16", "bf16"):
        raise LaunchError(f"q has dtype {qi.dtype}; allowed: fp16, bf16")
    if ki.dtype != qi.dtype or vi.dtype != qi.dtype:
        raise LaunchError(f"q, k, v must share a dtype; got {qi.dtype}, {ki.dtype}, {vi.dtype}")
    b, sq, h, d = qi.shape
    if ki.shape != vi.shape:
        raise LaunchError(f"k {ki.shape} and v {vi.shape} must have the same shape")
    bk, sk, hk, dk = ki.shape
    if bk != b:
        raise LaunchError(f"batch mismatch: q has {b}, k/v have {bk}")
    if dk != d:
        raise LaunchError(f"head_dim mismatch: q has {d}, k/v have {dk}")
    if d not in PrefillSpec.HEAD_DIMS:
        raise LaunchError(f"head_dim={d} is not supported; allowed: {', '.join(map(str, PrefillSpec.HEAD_DIMS))}")
    if hk == 0 or h % hk:
        raise LaunchError(f"heads={h} must be a multiple of kv_heads={hk} (GQA/MQA)")
    return qi, ki, vi


def prefill(q, k, v, *, causal: bool = False, window: tuple[int, int] = (-1, -1), sm_scale: float | None = None,
            return_lse: bool = False, out=None, spec: PrefillSpec | None = None):
    """Attention forward: softmax(q k^T * sm_scale) v, per head, with the FlashAttention layout.

    q ``[batch, seqlen_q, heads, head_dim]``; k, v ``[batch, seqlen_k, kv_heads, head_dim]`` with
    kv_heads dividing heads. ``causal`` aligns the mask to the bottom right (query i sees keys
    up to i + seqlen_k - seqlen_q); ``window=(left, right)`` limits each query to that many
    keys either side of its aligned position, -1 meaning unbounded. Returns ``out`` (same kind
    as q), and with ``return_lse`` also the fp32 natural-log LSE ``[batch, heads, seqlen_q]``.
    Rows that see no key give zeros and LSE -inf. ``spec`` overrides the tuning fields.
    """
    qi, ki, vi = _check_qkv(q, k, v)
    b, sq, h, d = qi.shape
    _, sk, hk, _ = ki.shape
    try:
        left, right = (int(window[0]), int(window[1]))
    except (TypeError, ValueError, IndexError):
        raise LaunchError(f"window={window!r} must be a pair (left, right) of ints, -1 for unbounded") from None
    if left < -1 or right < -1:
        raise LaunchError(f"window={window!r}: each side is -1 (unbounded) or a count >= 0")
    if causal:
        right = 0
    mask = MaskMode.CAUSAL if (causal and left < 0) else (
        MaskMode.SLIDING_WINDOW if (left >= 0 or right >= 0) else MaskMode.NONE)
    scale = float(1.0 / math.sqrt(d) if sm_scale is None else sm_scale)
    if not math.isfinite(scale):
        raise LaunchError(f"sm_scale={sm_scale!r} must be finite")

    fields = dict(head_dim=d, dtype=DType(qi.dtype), mask=mask, return_lse=bool(return_lse))
    spec = PrefillSpec(**fields) if spec is None else spec.replace(**fields)

    if out is None:
        out = empty_like_kind(qi.kind, (b, sq, h, d), qi.dtype, qi.device)
    oi = tensor_info(out, "out")
    if oi.kind != qi.kind or oi.shape != qi.shape or oi.dtype != qi.dtype or oi.device != qi.device:
        raise LaunchError(f"out must match q: {qi.kind} {qi.shape} {qi.dtype} on device {qi.device}; got "
                          f"{oi.kind} {oi.shape} {oi.dtype} on device {oi.device}")
    if oi.strides[-1] != 1 or oi.ptr % 16 or any(s % 8 for s in oi.strides[:-1]):
        raise LaunchError(f"out must be 16-byte aligned with a contiguous last dim; got strides {oi.strides}")
    lse = empty_like_kind(qi.kind, (b, h, sq), "fp32", qi.device) if return_lse else None
    if sq == 0 or b == 0 or h == 0:
        return (out, lse) if return_lse else out

    kern = get_kernel(spec, device=qi.device)
    rs = kern.spec
    lse_ptr = tensor_info(lse, "lse").ptr if lse is not None else 0
    params = _PARAMS.pack(
        qi.ptr, ki.ptr, vi.ptr, oi.ptr, lse_ptr,
        qi.strides[0], qi.strides[1], qi.strides[2],
        ki.strides[0], ki.strides[1], ki.strides[2],
        vi.strides[0], vi.strides[1], vi.strides[2],
        oi.strides[0], oi.strides[1], oi.strides[2],
        sq, sk, h, h // hk,
        scale, scale * _LOG2E,
        left, right,
    )
    grid = ((sq + rs.cta_tile_q - 1) // rs.cta_tile_q, h, b)
    if b > 65535:
        raise LaunchError(f"batch={b} exceeds 65535 (the grid's z limit)")
    kern.launch(grid, params, current_stream(qi.kind, qi.device))
    return (out, lse) if return_lse else out
