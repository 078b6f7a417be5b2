"""The score modifiers the attention ops take, FlashAttention's conventions: ``softcap`` (logit
capping, Gemma 2 and Grok) and ``alibi_slopes`` (ALiBi), and attention ``sinks`` (gpt-oss). Each is a
template switch in the spec (``softcap``, ``alibi``, ``sinks``); the cap, the slopes and the sinks are
call arguments, checked here."""

from __future__ import annotations

import math

from ..errors import LaunchError
from ..runtime import tensor_info


# What ``extras`` gives for a call with neither: no cap, no slopes (ops test for this case inline,
# on their hot path, and take this tuple instead of calling).
NO_EXTRAS = (0.0, 0.0, 0, 0)


def checked_scale(sm_scale) -> float:
    """``sm_scale`` as a float after the one rule every op shares: finite and > 0."""
    scale = float(sm_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise LaunchError(f"sm_scale={sm_scale!r} must be finite and > 0")
    return scale


def extras(softcap, alibi_slopes, batch: int, heads: int, qi, sm_scale) -> tuple[float, float, int, int]:
    """(cap / scale, scale / cap, slopes pointer, slopes batch stride) for the kernel, after checking
    ``softcap`` and ``alibi_slopes`` against the call (shared by prefill and decode). ``qi`` is q's
    info in any layout whose last dimension is the head dim: dense and decode ``[batch, seqlen, heads,
    head_dim]``, varlen ``[total, heads, head_dim]``; the default scale is 1 / sqrt(head_dim)."""
    scale = 1.0 / math.sqrt(qi.shape[-1]) if sm_scale is None else float(sm_scale)
    try:
        cap = float(softcap)
    except (TypeError, ValueError):
        raise LaunchError(f"softcap={softcap!r} must be a number: 0 (off) or the cap > 0") from None
    if not math.isfinite(cap) or cap < 0:
        raise LaunchError(f"softcap={softcap!r} must be 0 (off) or a finite cap > 0")
    if cap and not scale > 0:
        raise LaunchError(f"softcap needs sm_scale > 0; got {scale!r}")
    ptr = sb = 0
    if alibi_slopes is not None:
        a = tensor_info(alibi_slopes, "alibi_slopes")
        if a.kind != qi.kind or a.device != qi.device or a.dtype != "fp32":
            raise LaunchError(f"alibi_slopes must be an fp32 {qi.kind} array on device {qi.device}; got "
                              f"{a.dtype} {a.kind} on device {a.device}")
        if a.shape not in ((heads,), (batch, heads)) or a.strides[-1] != 1:
            raise LaunchError(f"alibi_slopes has shape {tuple(a.shape)}; expected ({heads},) or ({batch}, {heads}), "
                              f"contiguous in the heads")
        if not scale > 0:
            raise LaunchError(f"alibi_slopes needs sm_scale > 0; got {scale!r}")
        ptr, sb = a.ptr, (a.strides[0] if len(a.shape) == 2 else 0)
    return (cap / scale if cap else 0.0), (scale / cap if cap else 0.0), ptr, sb


def sinks_ptr(sinks, heads: int, qi) -> int:
    """The device pointer of ``sinks`` (one fp32 sink logit per query head, ``[heads]``, contiguous) after
    checking it against q's info ``qi`` (kind and device); 0 where ``sinks`` is None."""
    if sinks is None:
        return 0
    s = tensor_info(sinks, "sinks")
    if s.kind != qi.kind or s.device != qi.device or s.dtype != "fp32" or tuple(s.shape) != (heads,) or \
            (heads > 1 and s.strides[0] != 1):
        raise LaunchError(f"sinks must be an fp32 {qi.kind} array of shape ({heads},) (one logit a query head), "
                          f"contiguous, on device {qi.device}; got {s.dtype} {s.kind} of shape {tuple(s.shape)}, "
                          f"strides {tuple(s.strides)}, on device {s.device}")
    return s.ptr


def check_spec_sinks(spec, sinks) -> None:
    """A caller's spec and ``sinks`` must agree: ``sinks=true`` in the spec exactly when a sinks tensor is passed."""
    if spec is None or spec.sinks == (sinks is not None):
        return
    flag = str(spec.sinks).lower()
    raise LaunchError(f"sinks: the spec {spec} is refused: the spec has sinks={flag} but the call has "
                      f"{'none' if sinks is None else 'a sinks array'}; allowed: a spec with sinks=true together with "
                      "sinks (fp32 [heads]), or sinks=false (the default) without them")
