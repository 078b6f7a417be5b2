"""The prefill ops' operand checks (q, k, v; a caller's out) and their masks' codes, shared by the dense, varlen and
fp8 paths (op.py, varlen.py, fp8_op.py)."""

from __future__ import annotations

from ...errors import LaunchError
from ...runtime import tensor_info
from .choose import scales_exactly
from .spec import MaskMode, PrefillSpec

_NO_WINDOW = (-1, -1)
# Masks by code: plan keys hold the int, since hashing an Enum member runs Python code (~0.15 us).
_MASKS = (MaskMode.NONE, MaskMode.CAUSAL, MaskMode.SLIDING_WINDOW)


def _shape(s) -> tuple:
    return tuple(s)  # torch.Size prints as "torch.Size([...])"; messages show plain tuples


def check_qkv(q, k, v, dims: str = "[batch, seqlen, heads, head_dim]", kv_dims: str = ""):
    """TensorInfos of q, k, v after the checks every layout shares: ranks (``dims`` for q, ``kv_dims``
    for k and v, default ``dims``), kind, device, dtype, alignment, head_dim and GQA heads."""
    qi, ki, vi = tensor_info(q, "q"), tensor_info(k, "k"), tensor_info(v, "v")
    check_infos(qi, ki, vi, dims, kv_dims)
    return qi, ki, vi


def check_infos(qi, ki, vi, dims: str = "[batch, seqlen, heads, head_dim]", kv_dims: str = "") -> None:
    """``check_qkv``'s checks on the TensorInfos."""
    operands = (("q", qi, dims), ("k", ki, kv_dims or dims), ("v", vi, kv_dims or dims))
    for name, t, want in operands:
        if len(t.strides) != want.count(",") + 1:
            raise LaunchError(f"{name} has shape {_shape(t.shape)}; expected {want}")
    # An unsupported head dim is named as such before the strides it makes misaligned (59 -> stride 59).
    for name, x in (("head_dim", qi.shape[-1]), ("v's head dim", vi.shape[-1])):
        if x not in PrefillSpec.HEAD_DIMS:
            raise LaunchError(f"{name}={x} is not supported; allowed: {PrefillSpec.HEAD_DIMS_TEXT}")
    for name, t, want in operands:
        st = t.strides
        if st[-1] != 1:
            raise LaunchError(f"{name} has stride {st[-1]} in its last dim; head_dim must be contiguous")
        if t.ptr & 15 or (st[-2] | st[-3] | (st[-4] if len(st) > 3 else 0)) & 7:  # ranks are 3 or 4
            raise LaunchError(f"{name} must be 16-byte aligned with batch/seq/head strides that are multiples "
                              f"of 8 elements; got strides {_shape(st)}")
    if not (qi.kind == ki.kind == vi.kind):
        raise LaunchError(f"q, k, v must be of one kind; got {qi.kind}, {ki.kind}, {vi.kind}")
    if not (qi.device == ki.device == vi.device):
        raise LaunchError(f"q, k, v must be on one device; got {qi.device}, {ki.device}, {vi.device}")
    if qi.dtype != "bf16" and qi.dtype != "fp16":
        raise LaunchError(f"q has dtype {qi.dtype}; allowed: fp16, bf16")
    if ki.dtype != qi.dtype or vi.dtype != qi.dtype:
        raise LaunchError(f"q, k, v must share a dtype; got {qi.dtype}, {ki.dtype}, {vi.dtype}")
    if ki.shape[:-1] != vi.shape[:-1]:
        raise LaunchError(f"k {_shape(ki.shape)} and v {_shape(vi.shape)} must have the same shape but for the "
                          f"last dim (v's head dim may differ)")
    h, d = qi.shape[-2], qi.shape[-1]
    hk, dk, dv = ki.shape[-2], ki.shape[-1], vi.shape[-1]
    if dk != d:
        raise LaunchError(f"head_dim mismatch: q has {d}, k has {dk}")
    if hk == 0 or h % hk:
        raise LaunchError(f"heads={h} must be a multiple of kv_heads={hk} (GQA/MQA)")


def out_of(out, qi, dv: int) -> tuple[int, tuple]:
    """(pointer, strides) of a caller's ``out``, checked against q with v's head dim ``dv`` last
    (shape, kind, dtype, device, 16-byte alignment, contiguous last dim)."""
    oi = tensor_info(out, "out")
    want = (*qi.shape[:-1], dv)
    if oi.kind != qi.kind or tuple(oi.shape) != want or oi.dtype != qi.dtype or oi.device != qi.device:
        raise LaunchError(f"out must match q with v's head dim: {qi.kind} {want} {qi.dtype} on device {qi.device}; "
                          f"got {oi.kind} {_shape(oi.shape)} {oi.dtype} on device {oi.device}")
    st = oi.strides
    if st[-1] != 1 or oi.ptr & 15 or (st[-2] | st[-3] | (st[-4] if len(st) > 3 else 0)) & 7:
        raise LaunchError(f"out must be 16-byte aligned with a contiguous last dim; got strides {_shape(st)}")
    return oi.ptr, st


def mask_and_window(causal, window) -> tuple[int, int, int]:
    """(mask code, left, right): the index into ``_MASKS`` and the window as the kernel takes it."""
    if window is _NO_WINDOW or window == _NO_WINDOW:
        left = right = -1
    else:
        try:
            left, right = (int(window[0]), int(window[1]))
        except (TypeError, ValueError, IndexError):
            raise LaunchError(f"window={window!r} must be a pair (left, right) of ints, -1 for unbounded") from None
        if left < -1 or right < -1:
            raise LaunchError(f"window={window!r}: each side is -1 (unbounded) or a count >= 0")
    if causal:
        right = 0
    return (1 if (causal and left < 0) else 2 if (left >= 0 or right >= 0) else 0), left, right


def check_q_scaled(spec: PrefillSpec, sm_scale: float) -> None:
    """A kernel of q_scaled=true multiplies q's 16-bit values by sm_scale, exact only where ``scales_exactly``."""
    if spec.q_scaled and not scales_exactly(sm_scale):
        raise LaunchError(f"sm_scale={sm_scale!r} with the spec's q_scaled=true: its kernel multiplies q by sm_scale "
                          "in 16 bits, which is exact for a power of two from 2^-14 to 1 only; allowed: such an "
                          "sm_scale, or q_scaled=false")
