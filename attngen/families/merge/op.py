"""``attngen.merge_state`` and ``attngen.merge_states``: partial attention results combined through their LSE.

A state is what attention over a subset of the keys gives a query: its normalised output row and the
log-sum-exp (natural log) of its scores. Merging states of disjoint key sets gives the output and LSE of attention
over their union (split-KV, a shared prefix read once for many requests then merged with each request's own
keys, context-parallel attention). The ops take attngen's LSE in natural log as every attngen op returns it, one
value a (token, head): see ``merge_state`` for how each op's layout is passed.
"""

from __future__ import annotations

import struct

from ... import runtime as _rt
from ...errors import LaunchError
from ...runtime import data_ptr, tensor_info
from ..choice import SizeTable, device_facts
from ..host import OpMemo, Plan
from .choose import Problem, launch, resolved
from .spec import HEAD_DIMS_TEXT, MergeSpec

# MergeParams in templates/merge/params.cuh: 6 pointers, 14 strides, 3 ints (and the struct's tail padding).
_PARAMS = struct.Struct("<6Q14q3i4x")
_DTYPES = ("fp16", "bf16", "fp32")
_ITEM = {"fp16": 2, "bf16": 2, "fp32": 4}
_MAX_BLOCKS = 2 ** 31 - 1


def _make_plan(key: tuple) -> Plan:
    """The plan of a key (head_dim, dtype, device, states, array kind): the resolved kernel, loaded now."""
    d, dtype, device, states, kind = key
    plan = Plan()
    plan.setup(SizeTable.one(resolved(d, dtype, states, device_facts(device).arch)), device, kind, dtype)
    return plan


_memo = OpMemo(_make_plan)
_plans, _calls = _memo.plans, _memo.calls


class _Call:
    """What a call with a given key launches, worked out once: the plan, its kernel and grid, the output shapes
    it allocates (or the caller's outputs' pointers and strides) and the input parameters."""

    __slots__ = ("plan", "kern", "grid", "out_shape", "lse_shape", "out_ptr", "lse_ptr", "out_strides",
                 "lse_strides", "inputs", "tail")


def _extent(t, item: int) -> tuple[int, int]:
    """The bytes [lo, hi) an array's elements span."""
    lo = hi = 0
    for n, st in zip(t.shape, t.strides):
        lo += min(0, (n - 1) * st)
        hi += max(0, (n - 1) * st)
    return t.ptr + lo * item, t.ptr + (hi + 1) * item


def _check_values(t, name: str, dims: str, shape: tuple, dtype: str) -> None:
    """A values operand: ``shape`` and ``dtype`` where given, its last dim contiguous, 16-byte aligned with the
    other strides whole 16-byte vectors (the kernel reads and writes rows in 16-byte vectors)."""
    if len(t.shape) != len(shape) or tuple(t.shape) != shape:
        raise LaunchError(f"{name} has shape {tuple(t.shape)}; expected {shape} {dims}")
    if t.dtype != dtype:
        raise LaunchError(f"{name} has dtype {t.dtype}; expected {dtype} (the states' values dtype)")
    if t.strides[-1] != 1:
        raise LaunchError(f"{name} has stride {t.strides[-1]} in its last dim (head_dim); allowed: 1 (contiguous)")
    vec = 16 // _ITEM[dtype]
    bad = [(i, s) for i, s in enumerate(t.strides[:-1]) if s % vec and t.shape[i] > 1]
    if bad:
        i, s = bad[0]
        dim = ("tokens", "num_states", "heads")[i] if len(t.shape) == 4 else ("tokens", "heads")[i]
        raise LaunchError(f"{name} has stride {s} in dim {i} ({dim}; strides {tuple(t.strides)}); allowed: "
                          f"multiples of {vec} elements (16 bytes of {dtype})")
    if t.ptr % 16:
        raise LaunchError(f"{name} starts at address {t.ptr:#x}; allowed: 16-byte aligned addresses")


def _check_lse(t, name: str, dims: str, shape: tuple) -> None:
    if tuple(t.shape) != shape:
        raise LaunchError(f"{name} has shape {tuple(t.shape)}; expected {shape} {dims}")
    if t.dtype != "fp32":
        raise LaunchError(f"{name} has dtype {t.dtype}; allowed: fp32 (the LSE in natural log)")


def _outputs(out, kind: str, device: int):
    """(values info, LSE info) of ``out``: None, a values array, or a pair (values, LSE)."""
    if out is None:
        return None, None
    if isinstance(out, (tuple, list)):
        if len(out) != 2:
            raise LaunchError(f"out has {len(out)} items; allowed: a values array, or a pair (values, lse)")
        oi, li = tensor_info(out[0], "out[0]"), tensor_info(out[1], "out[1]")
    else:
        oi, li = tensor_info(out, "out"), None
    for t, name in ((oi, "out"), (li, "out lse")):
        if t is not None and (t.kind != kind or t.device != device):
            raise LaunchError(f"{name} must be a {kind} array on device {device}; got {t.kind} on device {t.device}")
    return oi, li


def _prepare(vs: tuple, ss: tuple, out, many: bool) -> _Call:
    """Check a call's operands (values infos ``vs``, LSE infos ``ss``: two of each, or one of each with a states
    dim) and work out its ``_Call``."""
    vdims = "[tokens, num_states, heads, head_dim]" if many else "[tokens, heads, head_dim]"
    sdims = "[tokens, num_states, heads]" if many else "[tokens, heads]"
    # (info, name, bytes an element) of every input, values first
    inputs = ([(vs[0], "v", 0), (ss[0], "s", 4)] if many else
              [(vs[0], "v_a", 0), (ss[0], "s_a", 4), (vs[1], "v_b", 0), (ss[1], "s_b", 4)])
    names = [name for _, name, _ in inputs]
    v0 = vs[0]
    kind, dev = v0.kind, v0.device
    for t, name, _ in inputs:
        if t.kind != kind or t.device != dev:
            raise LaunchError(f"{name} must be a {kind} array on device {dev} like {names[0]}; got {t.kind} on "
                              f"device {t.device}")
    rank = 4 if many else 3
    if len(v0.shape) != rank:
        raise LaunchError(f"{names[0]} has shape {tuple(v0.shape)}; expected {rank} dims {vdims}")
    dtype = v0.dtype
    if dtype not in _DTYPES:
        raise LaunchError(f"{names[0]} has dtype {dtype}; allowed: {', '.join(_DTYPES)}")
    d = v0.shape[-1]
    if d not in MergeSpec.HEAD_DIMS:
        raise LaunchError(f"head_dim={d} ({names[0]}.shape[-1]) is not supported; allowed: {HEAD_DIMS_TEXT}")
    tokens, heads = v0.shape[0], v0.shape[-2]
    n = v0.shape[1] if many else 2
    _check_values(v0, names[0], vdims, tuple(v0.shape), dtype)
    sshape = (tokens, n, heads) if many else (tokens, heads)
    _check_lse(ss[0], names[1], sdims, sshape)
    if not many:
        _check_values(vs[1], names[2], vdims, tuple(v0.shape), dtype)
        _check_lse(ss[1], names[3], sdims, sshape)
    oi, li = _outputs(out, kind, dev)
    call = _Call()
    call.out_shape, call.lse_shape = (tokens, heads, d), (tokens, heads)
    call.out_ptr = call.lse_ptr = None  # None: allocated per call
    call.out_strides, call.lse_strides = (heads * d, d), (heads, 1)
    if oi is not None:
        _check_values(oi, "out" if li is None else "out[0]", "[tokens, heads, head_dim]", call.out_shape, dtype)
        call.out_ptr, call.out_strides = oi.ptr, tuple(oi.strides[:2])
    if li is not None:
        _check_lse(li, "out[1]", "[tokens, heads]", call.lse_shape)
        call.lse_ptr, call.lse_strides = li.ptr, tuple(li.strides)
    # Different threads read a row's states and write its output and LSE in no set order: an output that shares
    # bytes with an input could be read after another thread wrote it.
    for t, item, name in ((oi, _ITEM[dtype], "out"), (li, 4, "out[1]")):
        if t is None or not all(t.shape):
            continue
        lo, hi = _extent(t, item)
        for x, xname, xitem in inputs:
            xlo, xhi = _extent(x, xitem or _ITEM[dtype])
            if all(x.shape) and lo < xhi and xlo < hi:
                raise LaunchError(f"{name} overlaps {xname} in memory; allowed: outputs apart from the inputs "
                                  "(pass out=None for new arrays)")
    pkey = (d, dtype, dev, "many" if many else "pair", kind)
    call.plan = plan = _plans.get(pkey) or _memo.plan(pkey)
    call.kern = plan.kernel
    call.grid = None
    if tokens * heads == 0:
        return call
    lc = launch(Problem(d, dtype, pkey[3], tokens, heads), plan.kernel.spec)
    if lc.grid[0] > _MAX_BLOCKS:
        raise LaunchError(f"tokens x heads = {tokens} x {heads} rows need {lc.grid[0]} CTAs; allowed: at most "
                          f"{_MAX_BLOCKS}")
    call.grid = lc.grid
    s0 = ss[0]
    if many:
        call.inputs = (v0.ptr, 0, s0.ptr, 0)
        vstr = (v0.strides[0], v0.strides[2], 0, 0, v0.strides[1])
        sstr = (s0.strides[0], s0.strides[2], 0, 0, s0.strides[1])
    else:
        v1, s1 = vs[1], ss[1]
        call.inputs = (v0.ptr, v1.ptr, s0.ptr, s1.ptr)
        vstr = (v0.strides[0], v0.strides[1], v1.strides[0], v1.strides[1], 0)
        sstr = (s0.strides[0], s0.strides[1], s1.strides[0], s1.strides[1], 0)
    call.tail = (*vstr, *sstr)
    return call


def _traced(op: str) -> None:
    """Refuse a call while torch.compile traces: the merges are not torch custom ops (a traced tensor has no
    address to launch on)."""
    if _rt.tracing is not None and _rt.tracing():
        raise LaunchError(f"attngen.{op} is not a torch custom op; allowed: calls outside torch.compile's traced "
                          "region (e.g. under torch.compiler.disable)")


def _run(key, vs, ss, out, many: bool):
    call = _calls.get(key) if key is not None else None
    if call is None:
        call = _prepare(vs, ss, out, many)
        _memo.keep(key, call)
    plan, kind = call.plan, vs[0].kind
    if call.out_ptr is not None:
        o, optr = (out[0] if isinstance(out, (tuple, list)) else out), call.out_ptr
    else:
        o = plan.alloc(*call.out_shape)
        optr = data_ptr(o, kind)
    if call.lse_ptr is not None:
        lse, lptr = out[1], call.lse_ptr
    else:
        lse = plan.alloc_f32(*call.lse_shape)
        lptr = data_ptr(lse, kind)
    if call.grid is None:
        return o, lse
    tokens, heads = call.out_shape[0], call.out_shape[1]
    call.kern.launch_struct(_PARAMS, call.grid, plan.stream(vs[0].device), *call.inputs, optr, lptr, *call.tail,
                            *call.out_strides, *call.lse_strides, tokens, heads,
                            vs[0].shape[1] if many else 2)
    return o, lse


def _key(vs, ss, out):
    """The call's key: the operands' infos (pointers, shapes, strides) and the outputs'."""
    if out is None:
        return (vs, ss, None)
    if isinstance(out, (tuple, list)):
        if len(out) != 2:
            return None
        return (vs, ss, tensor_info(out[0], "out[0]"), tensor_info(out[1], "out[1]"))
    return (vs, ss, tensor_info(out, "out"))


def merge_state(v_a, s_a, v_b, s_b, *, out=None):
    """Merge two attention states of the same queries over disjoint key sets: ``(v, s)``, the output and LSE of
    attention over both sets.

    ``v_a``, ``v_b``: ``[tokens, heads, head_dim]`` fp16, bf16 or fp32 (one dtype), head_dim a multiple of 8 up
    to 1024, the last dim contiguous, 16-byte aligned, the other strides multiples of 16 bytes (any tokens or
    heads stride: a view of a larger tensor is fine). ``s_a``, ``s_b``: fp32 ``[tokens, heads]``, the natural-log
    LSE, any strides. An LSE of -inf is an empty state (weight 0, its values ignored); a row whose states are
    both empty gets zeros and LSE -inf. Returns ``v`` (the values' dtype) and ``s`` (fp32) as new arrays of the
    inputs' kind, or writes into ``out``: a values array ``[tokens, heads, head_dim]`` (the LSE then new), or a
    pair ``(values, lse)``; outputs must not share memory with the inputs.

    attngen's ops return the LSE with the heads before the tokens; pass it as a view where one exists:
    ``prefill_varlen``'s ``[heads, total_q]`` as ``lse.T`` (no copy); ``prefill``'s ``[batch, heads, seqlen_q]``
    and ``decode``'s ``[batch, heads, q_len]`` as ``lse.transpose(1, 2).reshape(-1, heads)`` with the output as
    ``out.reshape(-1, heads, head_dim)`` (the LSE reshape copies where batch > 1 and heads > 1).
    """
    _traced("merge_state")
    vs = (tensor_info(v_a, "v_a"), tensor_info(v_b, "v_b"))
    ss = (tensor_info(s_a, "s_a"), tensor_info(s_b, "s_b"))
    return _run(_key(vs, ss, out), vs, ss, out, False)


def merge_states(v, s, *, out=None):
    """Merge ``num_states`` attention states of the same queries over disjoint key sets into one: ``(v, s)``.

    ``v``: ``[tokens, num_states, heads, head_dim]`` fp16, bf16 or fp32 (head_dim a multiple of 8 up to 1024,
    the last dim contiguous, 16-byte aligned, the other strides multiples of 16 bytes); ``s``: fp32
    ``[tokens, num_states, heads]``, the natural-log LSE, any strides. Empty states, the outputs and ``out`` as
    in ``merge_state``; num_states 0 gives zeros and LSE -inf.
    """
    _traced("merge_states")
    vs = (tensor_info(v, "v"),)
    ss = (tensor_info(s, "s"),)
    return _run(_key(vs, ss, out), vs, ss, out, True)
