"""Head dims up to 256 that no kernel is built for (not a multiple of 8, or below 32; FlashAttention 2 runs any
head dim up to 256): the ops run them on copies of their operands zero-padded to the next built head dim.

Zero columns add nothing to q k^T, and v's zero columns give output columns that are cut off; the default
scale is the real head dim's. The copies cost a read and a write of q, k and v (or the KV cache) per call."""

from __future__ import annotations

import math

from ..errors import LaunchError
from ..runtime import tensor_info

# Past it the ops take only the head dims their kernels are built for (and refuse the rest naming head_dim).
PAD_MAX = 256


def padded_width(d, allowed) -> int:
    """The head dim a kernel runs ``d`` at, where ``d`` (an int) is not in ``allowed`` and below PAD_MAX: the next
    multiple of 8, at least 32; else 0 (``d`` runs as it is, or is refused as it is)."""
    if d.__class__ is not int or d in allowed or not 0 < d < PAD_MAX:
        return 0
    return max(32, -(-d // 8) * 8)


def pad_widths(q, k, v, allowed, v_allowed=None, v_as_k: bool = False) -> tuple[int, int] | None:
    """(q and k's head dim, v's) to pad to, each the dim itself where it needs no pad; None where nothing is
    padded (or an operand has no shape: the op's checks name it). q and k are padded only together, where their
    head dims agree, and with ``v_as_k`` (a family whose q, k and v share one head dim) only where all three agree:
    else the op names the mismatch. ``allowed`` must hold every multiple of 8 from 32 to 256."""
    try:
        d, dk, dv = q.shape[-1], k.shape[-1], v.shape[-1]
        if not (d & 7 or dv & 7) and d >= 32 and dv >= 32:  # (the common case)
            return None
    except (AttributeError, IndexError, TypeError):
        return None
    if v_as_k and not d == dk == dv:
        return None
    pd = padded_width(d, allowed) if d == dk else 0
    pv = padded_width(dv, allowed if v_allowed is None else v_allowed)
    if not (pd or pv):
        return None
    return pd or d, pv or dv


def zero_padded(x, width: int):
    """A copy of ``x`` (a torch tensor or a CuPy array) whose last dim is zero-padded to ``width``, on x's
    device (the current stream); ``x`` itself where it is that wide already."""
    d = x.shape[-1]
    if d == width:
        return x
    shape = (*x.shape[:-1], width)
    if type(x).__module__.startswith("torch"):
        z = x.new_zeros(shape)
    else:
        import cupy

        with cupy.cuda.Device(x.device.id):
            z = cupy.zeros(shape, dtype=x.dtype)
    z[..., :d] = x
    return z


def default_scale(sm_scale, d: int):
    """The scale a padded call passes on: the caller's, or 1 / sqrt of the real head dim."""
    return 1.0 / math.sqrt(d) if sm_scale is None else sm_scale


def cut(result, dv: int, out, return_lse: bool):
    """A padded call's result with its output's columns past ``dv`` cut off (a view, as FlashAttention returns),
    or copied into the caller's ``out`` (checked against the real shape); the LSE as it is."""
    o = result[0] if return_lse else result
    o = o[..., :dv]
    if out is not None:
        oi, ri = tensor_info(out, "out"), tensor_info(o, "out")
        if (oi.kind, tuple(oi.shape), oi.dtype, oi.device) != (ri.kind, tuple(ri.shape), ri.dtype, ri.device):
            raise LaunchError(f"out must match q with v's head dim: {ri.kind} {tuple(ri.shape)} {ri.dtype} on device "
                              f"{ri.device}; got {oi.kind} {tuple(oi.shape)} {oi.dtype} on device {oi.device}")
        out[...] = o
        o = out
    return (o, result[1]) if return_lse else o


def run_padded(op, q, k, v, widths: tuple[int, int], *args, sm_scale, out, return_lse: bool, **kw):
    """``op`` (prefill, prefill_varlen or decode) on copies of q and k zero-padded to ``widths[0]`` and of v to
    ``widths[1]`` (``pad_widths``), at the caller's scale or the real head dim's; the result ``cut`` back to v's
    head dim (into ``out`` where given). ``args`` and ``kw``: the rest of the call, as the caller made it."""
    r = op(zero_padded(q, widths[0]), zero_padded(k, widths[0]), zero_padded(v, widths[1]), *args,
           sm_scale=default_scale(sm_scale, q.shape[-1]), return_lse=return_lse, **kw)
    return cut(r, v.shape[-1], out, return_lse)
