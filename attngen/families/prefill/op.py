"""``attngen.prefill``: FlashAttention-layout attention forward on torch tensors or CuPy arrays.

The host path of one call is kept short (the issue's target: 10 us on tiny inputs). What depends
only on (head_dim, dtype, device, mask, return_lse, the user's spec, array kind) is worked out once
per process into a ``_Plan`` (resolved spec, loaded kernel(s), allocators, stream getter, default
scale); what depends on the call's operands and arguments (the checks, the kernel for its length,
the grid, the TMA maps, the parameters but the output's pointers) once per distinct call into a
``_Call``, kept for the last few hundred. A repeated call (a model's layers, a serving loop) reads
its operands' infos, looks up its ``_Call``, allocates the output and launches.

Which tuning a plan uses: the user's ``spec`` when given (its 0 fields resolved for the arch);
else the winners ``attngen tune`` stored for this GPU (bucketed by seqlen_q, nearest by log
distance); else the arch's built-in default (``spec.resolve``). ``ATTNGEN_NO_TUNED=1`` skips the
stored winners; it, the cache root and the store are read when a plan is made (the first call
for its key), not per call.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from ... import runtime as _rt
from ...errors import LaunchError, SpecError
from ...runtime import data_ptr, tensor_info
from ...spec import op_spec
from ..choice import device_facts
from ..head_pad import default_scale, pad_widths, run_padded, zero_padded
from ..host import LOG2E
from ..score_mods import NO_EXTRAS, check_spec_sinks, checked_scale, extras, sinks_ptr
from ..snippets import call_mods, check_spec_mods, mod_layout, pack_aux, refuse_traced
from .choose import CUSTOM_MASK, DENSE, base_spec, dense_grid, persistent_grid, table
from .spec import PrefillSpec
# (check_qkv, plan_for, clear_plans: imported from here by varlen, serving and the tests)
from . import fp8_op
from .checks import _MASKS, _NO_WINDOW, check_infos, check_q_scaled, check_qkv, mask_and_window, out_of  # noqa: F401
from .plans import _calls, _memo, _plans, clear_plans, mods_key, plan_for  # noqa: F401

# PrefillParams in templates/prefill/params.cuh: 5 pointers, 12 strides, 4 ints, 2 floats, 2 ints,
# 2 floats (softcap), the ALiBi slopes' pointer and batch stride. A dense launch packs only these;
# the varlen and custom-mask kernels read the rest (PARAMS_EXT): 8 pointers, 2 strides, 9 ints.
_PARAMS = struct.Struct("<5Q12q4i2f2i2fQq")
PARAMS_EXT = struct.Struct("<5Q12q4i2f2i2fQq8Q2q9i")
# PrefillTmaParams (a pipeline=tma kernel): the three 128-byte tensor maps (tma.py), then the dense ones;
# persistent, and batch_count after the extended ones (8 pointers, 2 strides, 9 ints), which it does not read:
# zero-filled padding, which packs in half the time of 19 zeros.
_PARAMS_TMA = struct.Struct("<384s5Q12q4i2f2i2fQq")
_PARAMS_TMA4 = struct.Struct("<512s5Q12q4i2f2i2fQq")  # (the chunked kernel with a V tail: four maps)
_PARAMS_TMA_PERSISTENT = struct.Struct("<384s5Q12q4i2f2i2fQq116xi")
PARAMS_EXT_TMA = struct.Struct("<384s" + PARAMS_EXT.format[1:])  # the varlen and custom-mask kernels' on TMA
# A sinks kernel's (spec sinks=true): every field, the sinks' pointer last, after batch_count (0 but for the persistent
# kernel); a dense launch zero-fills the varlen and custom-mask fields it does not read, as the persistent one does.
_PARAMS_SINKS = struct.Struct("<5Q12q4i2f2i2fQq116xiQ")
_PARAMS_TMA_SINKS = struct.Struct("<384s5Q12q4i2f2i2fQq116xiQ")
_PARAMS_TMA4_SINKS = struct.Struct("<512s5Q12q4i2f2i2fQq116xiQ")
PARAMS_EXT_SINKS = struct.Struct(PARAMS_EXT.format + "iQ")
PARAMS_EXT_TMA_SINKS = struct.Struct(PARAMS_EXT_TMA.format + "iQ")


def mods_layout(layout: struct.Struct) -> struct.Struct:
    """``layout`` of a kernel with snippets: ModArgs (the aux tensors) after it, then a mask_mod plan's pool and slots
    (params.cuh; ``NO_POOL`` where the launch has none)."""
    s = _mods_layouts.get(layout.format)
    if s is None:
        s = _mods_layouts[layout.format] = struct.Struct(mod_layout(layout).format + "2Q")
    return s


_mods_layouts: dict = {}
NO_POOL = (0, 0)


def _check_qkv(q, k, v):
    """The dense layout's TensorInfos, checked."""
    qi, ki, vi = tensor_info(q, "q"), tensor_info(k, "k"), tensor_info(v, "v")
    _check_dense(qi, ki, vi)
    return qi, ki, vi


def _check_dense(qi, ki, vi) -> None:
    check_infos(qi, ki, vi)
    if ki.shape[0] != qi.shape[0]:
        raise LaunchError(f"batch mismatch: q has {qi.shape[0]}, k/v have {ki.shape[0]}")


def kernel_for(q, k, v, *, causal: bool = False, window: tuple[int, int] = _NO_WINDOW, return_lse: bool = False,
               spec: PrefillSpec | str | Mapping | None = None):
    """The loaded ``Kernel`` that ``prefill`` launches for these arguments (``kernel.spec`` is the
    spec it runs; ``spec`` as ``prefill`` takes it). Loads or compiles it if needed; enqueues nothing."""
    if spec is not None and spec.__class__ is not PrefillSpec:
        spec = op_spec(spec, "prefill", "attngen.prefill")
    qi, _, vi = _check_qkv(q, k, v)
    mask, _, _ = mask_and_window(causal, window)
    key = (qi.shape[3], qi.dtype, qi.device, mask, bool(return_lse), spec, qi.kind, False, False, DENSE, vi.shape[3],
           False)
    plan = _plans.get(key) or _memo.plan(key)
    return plan.kernel or plan.kernel_for(qi.shape[1])


def prefill(q, k, v, *, causal: bool = False, window: tuple[int, int] = _NO_WINDOW, sm_scale: float | None = None,
            return_lse: bool = False, out=None, spec: PrefillSpec | str | Mapping | None = None, softcap: float = 0.0,
            alibi_slopes=None, mask=None, mask_plan=None, sinks=None, score_mod: str = "", mask_mod: str = "",
            aux=None, q_descale=None, k_descale=None, v_descale=None):
    """Attention forward: softmax(q k^T * sm_scale) v, per head, with the FlashAttention layout.

    q ``[batch, seqlen_q, heads, head_dim]``; k, v ``[batch, seqlen_k, kv_heads, head_dim]`` with
    kv_heads dividing heads. ``causal`` aligns the mask to the bottom right (query i sees keys
    up to i + seqlen_k - seqlen_q); ``window=(left, right)`` limits each query to that many
    keys either side of its aligned position, -1 meaning unbounded. Returns ``out`` (same kind
    as q), and with ``return_lse`` also the fp32 natural-log LSE ``[batch, heads, seqlen_q]``.
    ``sm_scale`` (default 1/sqrt(head_dim)) must be finite and > 0, as in ``attngen.decode``.
    Rows that see no key give zeros and LSE -inf. ``spec`` (a spec, its text or a dict of its
    fields) overrides the tuning fields; without it, a configuration stored by ``attngen tune``
    for this GPU is used where there is one. A head dim up to 256 that is not a multiple of 8 (or
    is below 32) runs on a zero-padded copy (the output a view of its first head_dim columns); that
    costs a copy of q, k and v per call.
    ``softcap`` > 0 caps the scaled logits at ``softcap * tanh(s / softcap)`` (Gemma 2, Grok);
    ``alibi_slopes`` (fp32 ``[heads]`` or ``[batch, heads]``) adds ``-slope * |i' - j|`` to them,
    i' the query's aligned key position (FlashAttention's conventions for both).

    ``mask``: a custom mask, boolean (True keeps) or additive (0 keeps, -inf masks; fp16, bf16 or
    fp32), shaped ``[seqlen_q, seqlen_k]``, ``[batch, 1, seqlen_q, seqlen_k]`` or ``[batch, heads,
    seqlen_q, seqlen_k]`` (size-1 or stride-0 dims broadcast), contiguous in the keys; it combines
    with ``causal`` and ``window``. The kernel walks only the KV tiles some row can see, listed by
    a plan built on the GPU from the mask (``attngen.mask_plan``); pass that plan as
    ``mask_plan`` to reuse it across calls (layers), else each call builds one.

    ``sinks``: attention sinks (gpt-oss), one fp32 logit per query head (``[heads]``, contiguous, q's kind and
    device) that joins each row's softmax denominator and adds no value: ``O = sum_j exp(x_j) v_j / (sum_j
    exp(x_j) + exp(sink))`` over the row's scaled (capped, biased, masked) logits x_j. The LSE then includes the
    sink (the log of that whole denominator): a caller merging partial results must give the sink to exactly one
    of them. A row that sees no key gives zeros and LSE = its sink; a sink of -inf is no sink. A caller's ``spec``
    must say ``sinks=true`` exactly when sinks are passed.

    ``score_mod`` / ``mask_mod``: a user's variant as CUDA device-function bodies compiled into the kernel, reading
    the named tensors of ``aux`` (a dict name -> device tensor); see docs/variants.md. score_mod returns the new
    logit (after sm_scale, softcap and ALiBi), mask_mod false drops the pair; both run only on existing rows and keys.
    A mask_mod without a mask tensor builds its block plan on the GPU first (per batch row only if its text names
    ``b``, per head only if it names ``h``): KV tiles it drops whole are never read, and it is not run on tiles it
    keeps whole. ``mask_plan`` then takes such a plan (``attngen.mask_plan(None, q, k, mask_mod=..., aux=...)``) to
    reuse, or ``'off'`` to run mask_mod on every pair of every tile the built-in masks leave.

    fp8: q, k and v in ``torch.float8_e4m3fn`` (or uint8 bytes with a spec of ``qkv_dtype=fp8_e4m3``), head dim
    128 or 256, run on sm_90a's fp8 wgmma (``attngen/families/prefill/fp8.py``); the output is bf16 (or ``out``'s,
    or the spec's ``dtype``). ``q_descale``, ``k_descale``, ``v_descale``: what each operand is multiplied by to
    dequantise it, a number or an fp32 device tensor of shape ``[]``, ``[1]``, ``[kv_heads]`` or ``[batch,
    kv_heads]`` (FlashAttention-3's); 1 where omitted. causal, window, sm_scale, return_lse and out work as above;
    softcap, ALiBi, sinks, masks and snippets are refused with fp8.
    """
    if _rt.tracing is not None and _rt.tracing():
        refuse_traced("attngen.prefill", score_mod, mask_mod, aux)
        fp8_op.refuse_traced("attngen.prefill", q, (q_descale, k_descale, v_descale))
        return _rt.traced_ops["prefill"](
            q, k, v, causal=causal, window=window, sm_scale=sm_scale, return_lse=return_lse, out=out, spec=spec,
            softcap=softcap, alibi_slopes=alibi_slopes, mask=mask, mask_plan=mask_plan, sinks=sinks)
    if spec is not None and spec.__class__ is not PrefillSpec and spec.__class__ is not str:
        # a dict, another family's spec, a wrong type: read or refused before the tensors (text is
        # kept as given, part of the call's key, and read once in _prepare)
        spec = op_spec(spec, "prefill", "attngen.prefill")
    qi, ki, vi = tensor_info(q, "q"), tensor_info(k, "k"), tensor_info(v, "v")
    # A dense call's key: the operands' infos and every other argument as a value (the checks and
    # the launch's parameters are a function of them). Arguments of other classes (a 0-dim tensor
    # whose value may change) are never remembered; those that are no array, or unhashable, go to
    # the checks, which say what is wrong.
    call = key = None
    mods = call_mods(score_mod, mask_mod, aux) if score_mod or mask_mod or aux else None
    mode, mask_plan = plan_mode(mask_plan, mask, mods)
    if mask is None:
        try:
            key = (qi, ki, vi, causal, window, sm_scale, return_lse, spec, softcap,
                   None if out is None else tensor_info(out, "out"),
                   None if alibi_slopes is None else tensor_info(alibi_slopes, "alibi_slopes"),
                   None if sinks is None else tensor_info(sinks, "sinks"), mods, mode)
            call = _calls.get(key)
        except (LaunchError, TypeError):
            key = None
    if call is None:
        if q_descale is not None or k_descale is not None or v_descale is not None or (
                qi.dtype != "bf16" and qi.dtype != "fp16"):
            if spec.__class__ is str:
                spec = op_spec(spec, "prefill", "attngen.prefill")
            if fp8_op.is_fp8_call(qi, spec):
                fp8_op.refuse_options(softcap=softcap, alibi_slopes=alibi_slopes, mask=mask, mask_plan=mask_plan,
                                      sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, aux=aux)
                return fp8_op.prefill_fp8(q, k, v, qi, ki, vi, causal=causal, window=window, sm_scale=sm_scale,
                                          return_lse=return_lse, out=out, spec=spec,
                                          descales=(q_descale, k_descale, v_descale))
            if qi.dtype in ("bf16", "fp16"):
                raise LaunchError("q_descale, k_descale and v_descale are for fp8 q, k, v (torch.float8_e4m3fn); "
                                  f"q has dtype {qi.dtype}")
        widths = pad_widths(q, k, v, PrefillSpec.WHOLE_DIMS) if len(qi.shape) == len(vi.shape) == 4 else None
        if widths is not None:  # a head dim no kernel is built for, run on zero-padded copies (head_pad)
            return run_padded(prefill, q, k, v, widths, sm_scale=sm_scale, out=out, return_lse=return_lse,
                              causal=causal, window=window, spec=spec, softcap=softcap, alibi_slopes=alibi_slopes,
                              mask=mask, mask_plan=mode if mask_plan is None else mask_plan, sinks=sinks,
                              score_mod=score_mod, mask_mod=mask_mod,
                              aux=aux)
        call = _prepare(qi, ki, vi, causal, window, sm_scale, return_lse, out, spec, softcap, alibi_slopes,
                        mask is not None, sinks, mods, mode)
        _memo.keep(key, call, flags=(causal, return_lse), numbers=(sm_scale, softcap))
    plan, kind = call.plan, qi.kind
    if out is None:
        out = plan.alloc(*call.out_shape)
        optr = data_ptr(out, kind)
    else:
        optr = call.out_ptr
    if return_lse:
        lse = plan.alloc_f32(*call.lse_shape)
        lse_ptr = data_ptr(lse, kind)
    else:
        lse, lse_ptr = None, 0
    if call.grid is None:  # nothing to compute
        return (out, lse) if return_lse else out
    stream = plan.stream(qi.device)
    if mask_plan is not None and mask is None and call.mod_aux is None:
        raise LaunchError("mask_plan was passed with a mask_mod, but the call's kernel has no custom-mask form (a "
                          "spec with persistent=true?); allowed there: mask_plan=None or 'off'")
    if call.mod_aux is not None:  # a mask_mod's block plan (masks.build_mod), built now or the caller's
        from .masks import checked_bits_plan, checked_mod_plan

        mp = checked_mod_plan(mask_plan, call.kern, qi, ki, call.mcode, call.left, call.right, call.mod_aux, aux,
                              stream)
        kern = call.kern
        if kern.spec.mod_bits and not mp.holds_every_tile():  # a caller's plan with the bits of some tiles only:
            # the kernel that runs mask_mod on the others, or refused where the caller's spec asked for mod_bits
            kern = _rt.get_kernel(call.mixed, device=plan.device) if call.mixed is not None else checked_bits_plan(mp)
        grid, ext = mp.launch_args(qi.shape[2], qi.shape[0])
        kern.launch_struct(call.layout, grid, stream, *call.head, optr, lse_ptr, *call.tail, *ext,
                           *call.post[:-2], *mp.pool_args())  # (post ends with NO_POOL)
    elif mask is None:
        call.kern.launch_struct(call.layout, call.grid, stream, *call.head, optr, lse_ptr, *call.tail)
    else:
        from .masks import checked_plan

        mp = checked_plan(mask_plan, mask, call.kern, qi, ki, call.mcode, call.left, call.right, stream)
        grid, ext = mp.launch_args(qi.shape[2], qi.shape[0])
        call.kern.launch_struct(call.layout, grid, stream, *call.head, optr, lse_ptr, *call.tail, *ext, *call.post)
    return (out, lse) if return_lse else out


class _Call:
    """What a call with a given key launches, worked out once: its plan, the kernel and the layout of
    its parameters, the shapes it allocates (or the caller's ``out``), the grid (None: nothing to
    compute), and the parameters before and after out's and the LSE's pointers (``head``: the TMA
    maps and q, k, v; ``tail``: strides, sizes, scales, window, score mods, and the persistent
    kernel's batch; with sinks, the sinks' pointer last). A custom mask's call keeps its mask code and window for the
    mask plan, and ``post``: the parameters after the plan's (with sinks, batch_count and the sinks' pointer)."""

    __slots__ = ("plan", "kern", "layout", "out_shape", "out_ptr", "lse_shape", "grid", "head", "tail", "mcode",
                 "left", "right", "post", "mod_aux", "mixed")


# What ``mask_plan=`` may say about a mask_mod's block plan: built per call (the default), or none (every KV tile the
# built-in masks leave is read and mask_mod runs on each of its pairs: what a benchmark compares the plan with).
PLAN_MODES = ("auto", "off")


def plan_mode(mask_plan, mask, mods) -> tuple[str, object]:
    """(mode, the caller's plan or None) of a call's ``mask_plan``: "auto" (None, or a plan of the caller's: used
    when the call has a mask_mod and no mask tensor), or "off"."""
    if mask_plan is None or mask_plan.__class__ is not str:
        if mask_plan is not None and mask is None and not (mods and mods[1]):
            raise LaunchError("mask_plan needs the mask it was built from (mask=), or the mask_mod (mask_mod=)")
        return "auto", mask_plan
    if mask_plan not in PLAN_MODES:
        raise LaunchError(f"mask_plan={mask_plan!r} is not allowed; allowed: a MaskPlan (attngen.mask_plan), None, "
                          f"{', '.join(map(repr, PLAN_MODES))}")
    if mask_plan == "off" and mask is not None:
        raise LaunchError("mask_plan='off' is not allowed with a mask tensor (mask=): its kernel walks the plan's "
                          "tile lists; allowed: None or a MaskPlan of that mask")
    return mask_plan, None



def _prepare(qi, ki, vi, causal, window, sm_scale, return_lse, out, spec, softcap, alibi_slopes, masked,
             sinks=None, mods=None, mode="auto") -> _Call:
    """Check a call's arguments and work out its ``_Call``. ``mods``: the call's snippets (``call_mods``) or None;
    ``mode``: ``plan_mode``'s, whether a mask_mod without a mask tensor walks its block plan (a custom-mask kernel)."""
    if spec is not None and spec.__class__ is not PrefillSpec:
        spec = op_spec(spec, "prefill", "attngen.prefill")
    _check_dense(qi, ki, vi)
    check_spec_sinks(spec, sinks)
    check_spec_mods(spec, mods)
    b, sq, h, d = qi.shape
    _, sk, hk, _ = ki.shape
    dv = vi.shape[3]
    call = _Call()
    call.mcode, call.left, call.right = mcode, left, right = mask_and_window(causal, window)
    return_lse = bool(return_lse)
    cap_u, inv_cap_u, alibi_ptr, alibi_sb = (extras(softcap, alibi_slopes, b, h, qi, sm_scale)
                                             if softcap or alibi_slopes is not None else NO_EXTRAS)
    sinks_at = sinks_ptr(sinks, h, qi)
    mod_plan = not masked and mode == "auto" and bool(mods and mods[1])
    if mod_plan and spec is not None:
        try:  # (pure and cached: no compile)
            table(base_spec(d, qi.dtype, _MASKS[mcode], return_lse, spec, bool(softcap), alibi_ptr != 0, CUSTOM_MASK,
                            dv, sinks is not None, mods[:3]), device_facts(qi.device).arch, False)
        except SpecError:  # a caller's spec with no custom-mask form (persistent=true): mask_mod on every pair
            mod_plan = False
    scale = checked_scale(default_scale(sm_scale, d))
    key = (d, qi.dtype, qi.device, mcode, return_lse, spec, qi.kind, bool(softcap), alibi_ptr != 0,
           CUSTOM_MASK if masked or mod_plan else DENSE, dv, sinks is not None, *mods_key(mods, scale))
    call.plan = plan = _plans.get(key) or _memo.plan(key)
    call.mod_aux = call.mixed = None
    call.out_shape, call.lse_shape = (b, sq, h, dv), (b, h, sq)
    if out is None:
        ostrides = (sq * h * dv, h * dv, dv)  # a fresh contiguous array, aligned by its allocator
    else:
        call.out_ptr, ostrides = out_of(out, qi, dv)
    call.grid, call.post = None, ()
    if sq == 0 or b == 0 or h == 0:
        return call
    if b > 65535:
        raise LaunchError(f"batch={b} exceeds 65535 (the grid's z limit)")

    call.kern = kern = plan.mod_kernel(qi, ki) if mod_plan and spec is None else plan.kernel or plan.kernel_for(sq)
    check_q_scaled(kern.spec, scale)
    qs, ks, vs = qi.strides, ki.strides, vi.strides
    call.head = (qi.ptr, ki.ptr, vi.ptr)
    call.tail = (qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                 ostrides[0], ostrides[1], ostrides[2],
                 sq, sk, h, h // hk,
                 scale, scale * LOG2E,
                 left, right,
                 cap_u, inv_cap_u, alibi_ptr, alibi_sb)
    if masked and kern.spec.mod_bits:
        raise LaunchError("the spec's mod_bits=true reads a mask_mod's keep bits from its block plan; this call has a "
                          "mask tensor (mask=), whose plan has none: leave mod_bits off")
    if masked or mod_plan:  # the mask plan gives the grid, per call
        call.grid, call.layout = (), PARAMS_EXT_SINKS if sinks_at or mods else PARAMS_EXT
        call.kern, maps = plan.tma_maps(kern, qi, ki, vi)
        if call.kern.spec.mod_bits and spec is None:  # (the form a caller's plan of fewer slots needs: the same maps)
            call.mixed = call.kern.spec.replace(mod_bits=False)
        if maps is not None:
            call.head, call.layout = (maps, *call.head), PARAMS_EXT_TMA_SINKS if sinks_at or mods else PARAMS_EXT_TMA
        if sinks_at or mods:
            call.post = (0, sinks_at)
        if mods:  # the aux tensors after every other field (params.cuh, ModArgs)
            packed = pack_aux(call.kern.spec.aux, mods[3], qi)
            call.layout, call.post = mods_layout(call.layout), (*call.post, *packed, *NO_POOL)
            if mod_plan:
                call.mod_aux = packed
        return call
    ks_ = kern.spec
    # v_splits: the chunked kernel past 640 columns
    if h * ks_.v_splits > 65535:
        raise LaunchError(f"heads={h} exceed the grid's y limit (65535 / {ks_.v_splits} with this kernel)")
    call.layout = _PARAMS
    maps = None
    if ks_.tma:
        call.kern, maps = plan.tma_maps(kern, qi, ki, vi)  # (the cp.async twin where no map describes them)
    if maps is None:
        call.grid = dense_grid(sq, h, b, call.kern.spec)
        if sinks_at or mods:
            call.layout, call.tail = _PARAMS_SINKS, (*call.tail, 0, sinks_at)
    else:
        call.head = (maps, *call.head)
        if ks_.is_persistent:
            call.grid = persistent_grid(sq, h, b, ks_, plan.facts)
            call.layout, call.tail = _PARAMS_TMA_PERSISTENT, (*call.tail, b)
        else:
            call.grid = dense_grid(sq, h, b, ks_)
            call.layout = _PARAMS_TMA if len(maps) == 384 else _PARAMS_TMA4
        if sinks_at or mods:  # batch_count (the persistent kernel's, else 0), then the sinks' pointer
            call.layout = _PARAMS_TMA_SINKS if len(maps) == 384 else _PARAMS_TMA4_SINKS
            call.tail = (*call.tail, sinks_at) if ks_.is_persistent else (*call.tail, 0, sinks_at)
    if mods:  # the aux tensors after every other field (params.cuh, ModArgs)
        call.layout = mods_layout(call.layout)
        call.tail = (*call.tail, *pack_aux(call.kern.spec.aux, mods[3], qi), *NO_POOL)
    return call


def mask_plan(mask, q, k, *, v=None, causal: bool = False, window: tuple[int, int] = _NO_WINDOW,
              spec: PrefillSpec | str | Mapping | None = None, mask_mod: str = "", aux=None):
    """Build the plan ``attngen.prefill(q, k, v, mask=mask, causal=..., window=..., mask_plan=plan)``
    walks: per query tile, the KV tiles some row sees (``mask`` with ``causal``/``window``), each
    marked when the mask keeps all of it, and the query tiles sorted heaviest first. Built on the
    GPU on the current stream, without a host sync; reuse it for every call (layer) with this mask
    unchanged, the same shapes and masks, and a kernel of the same tile sizes (``spec``), which
    ``prefill`` checks. q and k give the shapes, dtype and device (their values are not read); pass
    ``v`` too when its head dim differs from k's (the kernel, and so its tiles, depend on it). ``spec``
    may be given as its text or a dict of its fields, as to ``prefill``. Returns a ``MaskPlan``.

    ``mask=None`` with a ``mask_mod`` (and its ``aux`` tensors) builds that snippet's block plan instead (what
    ``prefill(..., mask_mod=...)`` builds per call by default): pass it as ``mask_plan`` to calls with the same
    mask_mod and aux tensors (unchanged), shapes and masks, FlexAttention's block mask reused across layers.
    """
    if spec is not None and spec.__class__ is not PrefillSpec:
        spec = op_spec(spec, "prefill", "attngen.mask_plan")
    widths = pad_widths(q, k, k if v is None else v, PrefillSpec.WHOLE_DIMS)
    if widths is not None:  # the plan of the kernel prefill runs on the zero-padded copies
        q, k, v = (zero_padded(x, w) for x, w in ((q, widths[0]), (k, widths[0]), (k if v is None else v, widths[1])))
    qi, ki, vi = _check_qkv(q, k, k if v is None else v)
    mcode, left, right = mask_and_window(causal, window)
    mods = None
    if mask is None:
        if not mask_mod:
            raise LaunchError("mask_plan needs a mask tensor (mask) or, with mask=None, a mask_mod")
        mods = call_mods("", mask_mod, aux)
    elif mask_mod or aux:
        raise LaunchError("mask_plan takes a mask tensor or a mask_mod (with mask=None), not both")
    key = (qi.shape[3], qi.dtype, qi.device, mcode, False, spec, qi.kind, False, False, CUSTOM_MASK, vi.shape[3],
           False, *(() if mods is None else (mods[:3],)))
    plan = _plans.get(key) or _memo.plan(key)
    # (a mask_mod's: the call's form, whose pool holds every tile's bits where the call runs mod_bits)
    if mods is not None and spec is None:
        kern = plan.mod_kernel(qi, ki)
    else:
        kern = plan.kernel or plan.kernel_for(qi.shape[1])
    from .masks import build, build_mod

    if mods is not None:
        return build_mod(kern, qi, ki, mcode, left, right, pack_aux(kern.spec.aux, mods[3], qi), aux,
                         plan.stream(qi.device))
    return build(kern, mask, qi, ki, mcode, left, right, plan.stream(qi.device))
