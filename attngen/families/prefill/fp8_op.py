"""The host path of fp8 prefill (``attngen.prefill`` / ``prefill_varlen`` with q, k, v in e4m3; the kernel and its
spec: fp8.py): the operands' and descales' checks, V's transposed copy and the two launches.

As ``op.py`` does for 16-bit calls, what depends only on a call's operands and arguments (the checks, the plan and
kernel, the grid, the parameters but the output's, the LSE's and the copy's pointers) is worked out once per
distinct call into an ``_Fp8Call``, kept for the last few hundred; a repeated call allocates the output and the
copy, launches ``_vt`` (and for varlen the work list's sort, whose lengths are read on the GPU) and the kernel.
"""

from __future__ import annotations

import struct

from ...errors import LaunchError
from ...runtime import allocator, data_ptr, keep_call, register_dependent_cache, tensor_info
from ...spec import allowed_text
from ..head_pad import default_scale
from ..score_mods import checked_scale
from ..tma import tiled_map
from ..decode.fp8 import check_rows, scale_arg, scale_key
from ..host import LOG2E
from .checks import check_infos, mask_and_window, out_of
from .choose import DENSE, VARLEN, dense_grid, persistent_grid, varlen_grid
from .fp8 import HEAD_DIMS, QKV_DTYPES
from .order import _index, launch_order
from .plans import plan_for

# tensor_info's names: torch's e4m3 names its format; bytes (uint8: CuPy has no fp8 dtype) take the spec's word.
_E4M3 = "torch.float8_e4m3fn"
_BYTES = ("torch.uint8", "uint8")
_OTHER_FP8 = ("torch.float8_e5m2", "torch.float8_e4m3fnuz", "torch.float8_e5m2fnuz", "torch.float8_e8m0fnu")
_DESCALE_SHAPES = ("a number, or an fp32 device tensor of shape [] or [1] (per tensor), [kv_heads] (per KV head) or "
                   "[batch, kv_heads]")
_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")
# PrefillFp8Params (templates/prefill/fp8.cuh): the three maps, every field of PrefillParams (the varlen ones, the
# batch count, the sinks' pointer), then Fp8Scales: 3 pointers, 6 strides, v's number.
_PARAMS = struct.Struct("<384s5Q12q4i2f2i2fQq8Q2q9iiQ3Q6qf")
# PrefillFp8SyncParams (the mma.sync form): the same without the maps.
_PARAMS_SYNC = struct.Struct("<5Q12q4i2f2i2fQq8Q2q9iiQ3Q6qf")
# VtParams: v, the copy, cu_k; v's strides (batch, key, KV head), the copy's (batch, KV head, column); 2 lengths.
_VT_PARAMS = struct.Struct("<3Q6q2i")
VT_KEYS = 128  # templates/prefill/fp8.cuh: keys a CTA of `_vt` copies



def is_fp8_call(qi, spec) -> bool:
    """Whether a call's q is fp8 (or bytes a spec names as such): the path of this module."""
    if qi.dtype == _E4M3 or qi.dtype in _OTHER_FP8:
        return True
    return qi.dtype in _BYTES and bool(getattr(spec, "qkv_dtype", ""))


def refuse_traced(op: str, q, descales) -> None:
    """fp8 q, k, v or descales while torch.compile traces: its custom ops take neither (their fake would give the
    output q's dtype, and the descales would be dropped), so they are refused by name rather than run wrong."""
    if any(x is not None for x in descales) or "float8" in str(getattr(q, "dtype", "")):
        raise LaunchError(f"{op} with fp8 q, k, v (or q_descale, k_descale, v_descale) is not supported under "
                          "torch.compile; call it outside the compiled region (torch.compiler.disable)")


def refuse_options(**given) -> None:
    """Arguments fp8 prefill has no form for, refused by name where given."""
    for name, value in given.items():
        if value is not None and value is not False and value != 0.0 and value != "":
            raise LaunchError(f"{name} is not supported with fp8 q, k, v (qkv_dtype=fp8_e4m3); fp8 prefill takes "
                              "causal, window, sm_scale, return_lse, out and the descales")


def check_operands(qi, ki, vi, spec, varlen: bool) -> None:
    """Dtypes (all e4m3, or bytes with the spec's qkv_dtype), ranks, head dims, strides, kind and device."""
    names = (qi.dtype, ki.dtype, vi.dtype)
    if any(n in _OTHER_FP8 for n in names):
        bad = next(n for n in names if n in _OTHER_FP8)
        raise LaunchError(f"q, k, v have dtypes {', '.join(names)}: fp8 prefill takes {_E4M3} ({bad} is not built)")
    if not (names[0] == names[1] == names[2]) or (names[0] in _BYTES and not getattr(spec, "qkv_dtype", "")):
        raise LaunchError(f"q, k, v have dtypes {', '.join(names)}: fp8 prefill takes all three {_E4M3} (or uint8 "
                          "bytes with a spec of qkv_dtype=fp8_e4m3)")
    dims = "[total, heads, head_dim]" if varlen else "[batch, seqlen, heads, head_dim]"
    _rows_checked(qi, ki, vi, (True, True, True), dims, dims)
    d, dv = qi.shape[-1], vi.shape[-1]
    if d not in HEAD_DIMS or dv != d:
        raise LaunchError(f"head_dim={d} (k: {ki.shape[-1]}, v: {dv}) is not allowed with fp8 q, k, v; allowed: "
                          f"{allowed_text(HEAD_DIMS)}, the same for q, k and v")
    if not varlen and ki.shape[0] != qi.shape[0]:
        raise LaunchError(f"batch mismatch: q has {qi.shape[0]}, k/v have {ki.shape[0]}")


def _rows_checked(qi, ki, vi, fp8: tuple, dims: str, kv_dims: str) -> None:
    """The checks every prefill layout shares (checks.check_infos: ranks, head dims, strides, kind, device, shapes,
    GQA) with the operands ``fp8`` marks (q, k, v) seen in a 16-bit dtype, then those rows' 16-byte chunks
    (decode's check_rows: the kernels copy 16 fp8 values at a time)."""
    as16 = qi.dtype if qi.dtype in ("fp16", "bf16") else "bf16"
    infos = (qi, ki, vi)
    check_infos(*(t._replace(dtype=as16) if f else t for t, f in zip(infos, fp8)), dims, kv_dims)
    for name, t, f in zip("qkv", infos, fp8):
        if f:
            check_rows(t, name)


def scales(descales: tuple, batch: int, hk: int, qi, sm_scale: float) -> tuple[float, tuple]:
    """(sm_scale with the numbers of q's and k's descales folded in, Fp8Scales' fields): each descale as decode's
    scales are taken (a number, or fp32 [], [1], [kv_heads]) or FlashAttention-3's [batch, kv_heads]."""
    (qm, qp, qsb, qsh), (km, kp, ksb, ksh), (vm, vp, vsb, vsh) = (
        scale_arg(x, n, hk, qi.kind, qi.device, batch, _DESCALE_SHAPES) for x, n in zip(descales, _DESCALE_NAMES))
    return sm_scale * qm * km, (qp, kp, vp, qsb, qsh, ksb, ksh, vsb, vsh, vm)


def _out_dtype(out, spec) -> str:
    """The output's dtype: ``out``'s, else the spec's ``dtype`` (bf16 by default)."""
    want = spec.dtype.value if spec is not None else "bf16"
    if out is None:
        return want
    od = tensor_info(out, "out").dtype
    if od not in ("fp16", "bf16"):
        raise LaunchError(f"out has dtype {od}; fp8 prefill writes fp16 or bf16")
    if spec is not None and od != want:
        raise LaunchError(f"out has dtype {od} but the spec says dtype={want} (the output's dtype with qkv_dtype)")
    return od


def _spec(spec, d: int, dtype: str):
    """The caller's spec (a PrefillSpec: the ops parse it first) with qkv_dtype set, or the fp8 default's base."""
    from .spec import PrefillSpec

    if spec is None:
        return PrefillSpec(head_dim=d, dtype=dtype, qkv_dtype=QKV_DTYPES[0])
    if spec.qkv_dtype:
        return spec
    return spec.replace(head_dim=d, dtype=dtype, qkv_dtype=QKV_DTYPES[0])


def _plan(qi, d: int, out, spec, mcode: int, return_lse: bool, layout: int):
    dtype = _out_dtype(out, spec)
    fspec = _spec(spec, d, dtype)
    return plan_for((d, dtype, qi.device, mcode, bool(return_lse), fspec, qi.kind, False, False, layout, d, False))


def _qk_map(t, rows: int, what: str) -> bytes:
    """q or k (bytes) as rows of 16-bit pairs, 64-pair boxes of ``rows`` rows: the 16-bit kernel's boxes."""
    if len(t.shape) == 3:
        (s, h, d), (ss, sh, _) = t.shape, t.strides
        b, sb = 1, ss
    else:
        b, s, h, d = t.shape
        sb, ss, sh, _ = t.strides
    return tiled_map("bf16", t.ptr, (d // 2, max(s, 1), h, b), (ss, sh, sb), (64, rows, 1, 1),
                     lambda e: f"no TMA tensor map for {what} {tuple(t.shape)} with strides {tuple(t.strides)}: {e}")


def _vt_map(ptr: int, cols: int, d: int, hk: int, b: int) -> bytes:
    """V's transposed copy: ``cols`` keys a row, d rows a KV head; boxes of 128 keys x d rows, 128-byte swizzled."""
    return tiled_map("uint8", ptr, (cols, d, hk, b), (cols, d * cols, hk * d * cols), (128, d, 1, 1),
                     lambda e: f"no TMA tensor map for v's transposed copy: {e}", swizzled_bytes=True)


# A call's key -> its _Fp8Call (runtime.keep_call: the last few hundred; cleared with the loaded kernels).
_calls: dict = register_dependent_cache({})


class _Fp8Call:
    """What a call with a given key launches (see the module): ``vals`` are the main entry's parameters after the
    maps and the output's and LSE's pointers; ``vt`` the copy's size, grid and ``_vt`` parameters but its pointer;
    ``order`` (varlen) the work list's launch."""

    __slots__ = ("plan", "kern", "grid", "out_shape", "out_ptr", "lse_shape", "qk_maps", "vt_bytes", "vt_grid",
                 "vt_head", "vt_tail", "vt_map", "head", "vals", "order", "tma")


def _call_key(*parts):
    try:
        key = tuple(parts)
        hash(key)
        return key
    except TypeError:  # an unhashable argument: the checks name it, nothing is kept
        return None


def prefill_fp8(q, k, v, qi, ki, vi, *, causal, window, sm_scale, return_lse, out, spec, descales):
    """``attngen.prefill`` for fp8 q, k, v: ``_prepare_dense`` once per distinct call, then the launches."""
    key = _call_key("dense", qi, ki, vi, causal, window, sm_scale, bool(return_lse), spec,
                    None if out is None else tensor_info(out, "out"), *map(scale_key, descales, _DESCALE_NAMES))
    call = _calls.get(key) if key is not None else None
    if call is None:
        call = _prepare_dense(qi, ki, vi, causal, window, sm_scale, return_lse, out, spec, descales)
        keep_call(_calls, key, call, flags=(causal, bool(return_lse)), numbers=(sm_scale,))
    return _launch(call, qi, out, return_lse)


def _prepare_dense(qi, ki, vi, causal, window, sm_scale, return_lse, out, spec, descales) -> _Fp8Call:

    check_operands(qi, ki, vi, spec, False)
    b, sq, h, d = qi.shape
    _, sk, hk, _ = ki.shape
    mcode, left, right = mask_and_window(causal, window)
    call = _Fp8Call()
    call.plan = plan = _plan(qi, d, out, spec, mcode, return_lse, DENSE)
    scale, f8 = scales(descales, b, hk, qi, checked_scale(default_scale(sm_scale, d)))
    call.out_shape, call.lse_shape, call.grid, call.order = (b, sq, h, d), (b, h, sq), None, None
    ost = (sq * h * d, h * d, d)
    if out is not None:
        call.out_ptr, ost = out_of(out, out_like(qi, out), d)
    if sq == 0 or b == 0 or h == 0:
        return call
    if b > 65535:
        raise LaunchError(f"batch={b} exceeds 65535 (the grid's z limit)")
    call.kern = kern = plan.kernel or plan.kernel_for(sq)
    ks = kern.spec
    bn = ks.cta_tile_kv
    pad = max(bn, VT_KEYS)
    cols = max(1, -(-sk // pad)) * pad  # keys a row of the copy: padded as prefill/fp8.cuh's vt_pad
    vs = vi.strides
    call.vt_bytes, call.vt_grid = b * hk * d * cols, (cols // VT_KEYS, hk, b)
    call.vt_head, call.vt_tail = (vi.ptr,), (0, vs[0], vs[1], vs[2], hk * d * cols, d * cols, cols, sk, 0)
    call.vt_map = (cols, d, hk, b)
    call.tma = ks.tma
    call.qk_maps = _qk_map(qi, ks.cta_tile_q, "q") + _qk_map(ki, bn, "k") if ks.tma else b""
    call.grid = persistent_grid(sq, h, b, ks, plan.facts) if ks.is_persistent else dense_grid(sq, h, b, ks)
    # q, k and the copy as 16-bit pairs (the mma.sync form reads them through these; TMA through its maps)
    qs, kst = [x // 2 for x in qi.strides], [x // 2 for x in ki.strides]
    call.head = (qi.ptr, ki.ptr)
    call.vals = (qs[0], qs[1], qs[2], kst[0], kst[1], kst[2], hk * d * cols // 2, cols // 2, d * cols // 2,
                 ost[0], ost[1], ost[2],
                 sq, sk, h, h // hk, scale, scale * LOG2E, left, right, 0.0, 0.0, 0, 0,
                 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                 0, 0, 0, 0, 0, 0, 0, 0, 0, b, 0, *f8)  # (batch_count: the persistent kernel's walk)
    return call


def _launch(call, qi, out, return_lse):
    """The launches of a worked-out call: the output, LSE and copy allocated, ``_vt``, (varlen) the work list's
    sort, the main entry."""
    plan, kind = call.plan, qi.kind
    if out is None:
        out = plan.alloc(*call.out_shape)
        optr = data_ptr(out, kind)
    else:
        optr = call.out_ptr
    lse = plan.alloc_f32(*call.lse_shape) if return_lse else None
    if call.grid is None:
        return (out, lse) if return_lse else out
    kern = call.kern
    stream = plan.stream(qi.device)
    vt = allocator(kind, "uint8", qi.device)(call.vt_bytes)
    vt_ptr = data_ptr(vt, kind)
    kern.launch_struct(_VT_PARAMS, call.vt_grid, stream, *call.vt_head, vt_ptr, *call.vt_tail, entry="_vt")
    tail = ()
    if call.order is not None:  # varlen: the work list, sorted on the GPU from the lengths there
        ws = plan.alloc_index(call.order[0])
        wp = data_ptr(ws, kind)
        launch_order(kern, stream, wp, *call.order[1:])
        tail = (wp, wp + 8 * call.order[1])
    lse_ptr = data_ptr(lse, kind) if return_lse else 0
    vals = call.vals if not tail else (*call.vals[:_WORK_AT], *tail, *call.vals[_WORK_AT + 2:])
    if call.tma:
        maps = call.qk_maps + _vt_map(vt_ptr, *call.vt_map)
        kern.launch_struct(_PARAMS, call.grid, stream, maps, *call.head, vt_ptr, optr, lse_ptr, *vals)
    else:
        kern.launch_struct(_PARAMS_SYNC, call.grid, stream, *call.head, vt_ptr, optr, lse_ptr, *vals)
    return (out, lse) if return_lse else out


# Where the work list's two pointers sit in a varlen call's ``vals`` (PrefillParams: 12 strides, 4 ints, 2 floats,
# 2 ints, 2 floats, 2 alibi fields, then cu_q, cu_k, block_table, work, work_count).
_WORK_AT = 12 + 4 + 2 + 2 + 2 + 2 + 3


def out_like(qi, out):
    """q's info as ``out`` must match it (q's shape, ``out``'s 16-bit dtype): for ``op.out_of``'s checks."""
    return qi._replace(dtype=tensor_info(out, "out").dtype)



def prefill_varlen_fp8(q, k, v, qi, ki, vi, cu_seqlens_q, cu_seqlens_k, max_seqlen_k: int, *, causal, window,
                       sm_scale, return_lse, out, spec, descales):
    """``attngen.prefill_varlen`` for fp8 q, k, v: the work list, V's transposed copy (each sequence padded to
    whole key tiles), the main launch."""

    cq = _index(cu_seqlens_q, "cu_seqlens_q", 1, qi)
    ck = _index(cu_seqlens_k, "cu_seqlens_k", 1, qi)
    key = _call_key("varlen", qi, ki, vi, cq, ck, max_seqlen_k, causal, window, sm_scale, bool(return_lse), spec,
                    None if out is None else tensor_info(out, "out"), *map(scale_key, descales, _DESCALE_NAMES))
    call = _calls.get(key) if key is not None else None
    if call is None:
        call = _prepare_varlen(qi, ki, vi, cq, ck, max_seqlen_k, causal, window, sm_scale, return_lse, out, spec,
                               descales)
        keep_call(_calls, key, call, flags=(causal, bool(return_lse)), numbers=(sm_scale,))
    return _launch(call, qi, out, return_lse)


def _prepare_varlen(qi, ki, vi, cq, ck, max_seqlen_k, causal, window, sm_scale, return_lse, out, spec,
                    descales) -> _Fp8Call:

    check_operands(qi, ki, vi, spec, True)
    total_q, h, d = qi.shape
    total_k, hk, _ = ki.shape
    if cq.shape[0] != ck.shape[0] or cq.shape[0] < 1:
        raise LaunchError(f"cu_seqlens_q has {cq.shape[0]} entries and cu_seqlens_k {ck.shape[0]}; both must be "
                          f"batch + 1 >= 1")
    batch = cq.shape[0] - 1
    if total_q >= 2 ** 31 or total_k >= 2 ** 31:
        raise LaunchError(f"total_q={total_q} / total_k={total_k}: at most 2^31 - 1 rows (int32 cu_seqlens)")
    mcode, left, right = mask_and_window(causal, window)
    call = _Fp8Call()
    call.plan = plan = _plan(qi, d, out, spec, mcode, return_lse, VARLEN)
    scale, f8 = scales(descales, batch, hk, qi, checked_scale(default_scale(sm_scale, d)))
    call.out_shape, call.lse_shape, call.grid, call.order = (total_q, h, d), (h, total_q), None, None
    ost = (h * d, d)
    if out is not None:
        call.out_ptr, ost = out_of(out, out_like(qi, out), d)
    if total_q == 0 or batch == 0 or h == 0:
        return call
    call.kern = kern = plan.kernel or plan.kernel_for(max(1, total_q // batch))
    ks = kern.spec
    bn = ks.cta_tile_kv
    # each sequence from its first key rounded down to 16, plus seq * (pad + 16) (prefill/fp8.cuh, fp8_vt_col)
    pad = max(bn, VT_KEYS)
    cols = -(-(total_k + batch * (pad + 16) + pad) // 16) * 16
    vs = vi.strides
    # (max_seqlen_k bounds every sequence's keys: the copy's grid; FlashAttention's contract for the argument)
    call.vt_bytes, call.vt_grid = hk * d * cols, (max(1, -(-max_seqlen_k // pad) * pad // VT_KEYS), hk, batch)
    call.vt_head, call.vt_tail = (vi.ptr,), (ck.ptr, 0, vs[0], vs[1], 0, d * cols, cols, 0, total_k)
    call.vt_map = (cols, d, hk, 1)
    call.tma = ks.tma
    call.qk_maps = _qk_map(qi, ks.cta_tile_q, "q") + _qk_map(ki, bn, "k") if ks.tma else b""
    call.grid = varlen_grid(total_q, batch, h, ks)
    max_items = call.grid[0]
    call.order = (2 * max_items + 1 + batch + 1, max_items, cq.ptr, ck.ptr, left, right, batch, total_q, total_k,
                  False)
    qs, kst = [x // 2 for x in qi.strides], [x // 2 for x in ki.strides]  # (16-bit pairs, as for dense)
    call.head = (qi.ptr, ki.ptr)
    call.vals = (0, qs[0], qs[1], 0, kst[0], kst[1], 0, cols // 2, d * cols // 2, 0, ost[0], ost[1],
                 0, 0, h, h // hk, scale, scale * LOG2E, left, right, 0.0, 0.0, 0, 0,
                 cq.ptr, ck.ptr, 0, 0, 0, 0, 0, 0, 0, 0,
                 0, 0, total_q, total_k, 0, 0, 0, 0, 0, 0, 0, *f8)
    return call


# ---- an fp8 cache (kv_dtype) read by prefill_varlen with q in fp16/bf16 ----------------------------------------------

# The fp8-cache kernel's parameters (PrefillFp8SyncParams): every field of PrefillParams, then Fp8Scales; on the TMA
# pipeline (PrefillFp8Params) the tensor maps first.
PARAMS_KV8 = _PARAMS_SYNC
PARAMS_KV8_TMA = _PARAMS


def cache_kind(qi, k, v, spec):
    """The fp8 format of a varlen call's k and v (decode's KVDType), or None where they hold q's dtype; raises where
    they disagree with each other, with q or with the spec's kv_dtype (decode's rules and messages)."""
    from ..decode import fp8 as dfp8
    from ..decode.spec import KVDType

    ki, vi = tensor_info(k, "k"), tensor_info(v, "v")
    want = getattr(spec, "kv_dtype", "") or ""
    if ki.dtype == qi.dtype and vi.dtype == qi.dtype and not want:
        return None
    return dfp8.cache_format(qi, ki, vi, KVDType(want) if want else None, names=("k", "v"), operands="q, k, v")


def cache_operands(q, k, v, kv, dims: str, kv_dims: str):
    """q, k, v's infos for an fp8 cache: the shared checks on k and v seen in q's dtype, then their 16-byte rows."""
    qi, ki, vi = tensor_info(q, "q"), tensor_info(k, "k"), tensor_info(v, "v")
    _rows_checked(qi, ki, vi, (False, True, True), dims, kv_dims)
    return qi, ki, vi


def cache_spec(spec, kv):
    """The caller's spec (or none) with the cache's kv_dtype: what the call's plan is keyed and resolved by."""
    from .spec import PrefillSpec

    if spec is not None and spec.kv_dtype == kv.value:
        return spec
    return (spec or PrefillSpec(varlen=True)).replace(varlen=True, kv_dtype=kv.value)


def check_cache_route(q, kv, paged: bool, mask: int, softcap: bool, alibi: bool, sinks: bool) -> None:
    """flash_attn_with_kvcache past the decode kernels' tokens over an fp8 cache (and BatchAttention's prefill rows
    over one): the varlen prefill kernel that will serve it resolved now for q's device (a SpecError naming what it
    lacks), before the cache is written or any kernel launched."""
    from ...runtime import device_arch

    qi = tensor_info(q, "q")
    cache_route(qi.shape[-1], qi.dtype, kv, paged, mask, softcap, alibi, sinks, device_arch(qi.device))


def cache_route(head_dim: int, dtype: str, kv, paged: bool, mask: int, softcap: bool, alibi: bool, sinks: bool,
                arch):
    """The varlen prefill kernel over an fp8 cache of format ``kv`` for those switches on ``arch``, resolved (a
    SpecError naming what it lacks: e.g. sinks, which that kernel has no form of yet)."""
    from ...spec import resolve
    from .checks import _MASKS
    from .spec import PrefillSpec

    return resolve(PrefillSpec(head_dim=head_dim, dtype=dtype, mask=_MASKS[mask], varlen=True, paged=paged,
                               kv_dtype=kv.value, softcap=softcap, alibi=alibi, sinks=sinks), arch)


def cache_scales(k_scale, v_scale, kv, hk: int, qi) -> tuple[float, tuple]:
    """(the factor k's scale puts on sm_scale, Fp8Scales' fields) of decode's k_scale / v_scale forms (a number, or
    an fp32 device tensor of shape [], [1] or [kv_heads])."""
    from ..decode import fp8 as dfp8

    k_mul, k_ptr, v_ptr, k_sh, v_sh, v_mul = dfp8.scales(k_scale, v_scale, kv, hk, qi.kind, qi.device)
    return k_mul, (0, k_ptr, v_ptr, 0, 0, 0, k_sh, 0, v_sh, v_mul)
