"""``attngen.prefill_varlen``: packed sequences of different lengths, optionally over a paged cache.

The lengths stay on the GPU: the grid is sized by what the host knows (total query rows and the
number of sequences bound the number of query tiles), and one small launch of the kernel's
``_order`` entry turns ``cu_seqlens`` into the list of (sequence, query tile) items, heaviest
first; CTAs past the list's length return at once.
"""

from __future__ import annotations

from collections.abc import Mapping

from ... import runtime as _rt
from ...errors import LaunchError
from ...runtime import data_ptr, tensor_info
from ...spec import op_spec
from ..head_pad import default_scale, pad_widths, run_padded
from ..host import LOG2E
from ..score_mods import NO_EXTRAS, check_spec_sinks, checked_scale, extras, sinks_ptr
from ..snippets import call_mods, check_spec_mods, pack_aux, refuse_traced
from ..split_kv import check_block_size
from .choose import VARLEN, VARLEN_PAGE_ROWS, VARLEN_PAGED, varlen_grid
from .op import (_NO_WINDOW, NO_POOL, PARAMS_EXT, PARAMS_EXT_SINKS, PARAMS_EXT_TMA, PARAMS_EXT_TMA_SINKS, check_qkv,
                 check_q_scaled, mask_and_window, mods_key, mods_layout, out_of, plan_for)
from . import fp8_op
from .order import VarlenOrder, _index, launch_order, order_tiles  # noqa: F401  (serving, the tests)
from .spec import PrefillSpec


def _max_seqlen(x, name: str) -> int:
    try:
        n = int(x)
    except (TypeError, ValueError):
        raise LaunchError(f"{name}={x!r} must be an int >= 0") from None
    if n < 0 or n != x:
        raise LaunchError(f"{name}={x!r} must be an int >= 0")
    return n


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                   causal: bool = False, window: tuple[int, int] = _NO_WINDOW, sm_scale: float | None = None,
                   return_lse: bool = False, out=None, block_table=None,
                   spec: PrefillSpec | str | Mapping | None = None, softcap: float = 0.0,
                   alibi_slopes=None, sinks=None, score_mod: str = "", mask_mod: str = "", aux=None,
                   q_descale=None, k_descale=None, v_descale=None, k_scale=None, v_scale=None):
    """Attention forward over packed sequences of different lengths (FlashAttention's varlen API).

    q ``[total_q, heads, head_dim]``, k and v ``[total_k, kv_heads, head_dim]``; sequence s is rows
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` of q and ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` of k/v
    (int32 ``[batch + 1]`` on the device, non-decreasing; values outside the arrays are clamped to
    them, never read past). With ``block_table`` (int32 ``[batch, max_blocks]``) k and v are a
    paged cache ``[num_blocks, block_size, kv_heads, head_dim]`` (block_size any positive int;
    block_table.shape[1] x block_size below 2^31): key j of sequence s is at ``k[block_table[s, j // block_size], j % block_size]``
    and ``cu_seqlens_k`` gives only the lengths. ``causal`` and ``window`` align bottom-right
    per sequence, as in ``prefill``; GQA, ``sm_scale``, ``softcap`` and ``alibi_slopes`` (``[heads]`` or
    ``[batch, heads]``) too. ``max_seqlen_q``/``max_seqlen_k`` are accepted for FlashAttention's
    signature and checked as ints >= 0; the lengths are never read on the host. Returns ``out``
    ``[total_q, heads, head_dim]`` and with ``return_lse`` the LSE ``[heads, total_q]`` (fp32).
    ``spec`` (a spec, its text or a dict of its fields) overrides the tuning fields, as in ``prefill``.
    A head dim up to 256 that is not a multiple of 8 (or is below 32) runs on a zero-padded copy, as in
    ``prefill``; that costs a copy of q, k and v (or the paged cache) per call. ``sinks`` (fp32 ``[heads]``):
    attention sinks as in ``prefill``; the LSE includes them. ``score_mod``, ``mask_mod`` and ``aux``: a user's
    variant as in ``prefill`` (b is the sequence's index, q_idx and kv_idx positions within the sequence).
    fp8 q, k, v with ``q_descale``, ``k_descale``, ``v_descale`` as in ``prefill`` (a descale of shape
    ``[batch, kv_heads]`` is indexed by sequence); there ``max_seqlen_k`` must bound every sequence's keys (it
    sizes the copy of V the fp8 kernel reads).
    An fp8 cache (k and v ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, or uint8 with a spec's ``kv_dtype``) with
    q in fp16/bf16: each tile is widened in shared memory (on sm_90a's TMA kernel into fp16, a bf16 q carried into fp16
    by a power of two); ``k_scale`` and ``v_scale`` as ``attngen.decode`` takes
    them (a number, or fp32 ``[]``, ``[1]``, ``[kv_heads]``; FlashAttention-3's ``k_descale`` / ``v_descale`` are
    the same), contiguous or paged.
    """
    if _rt.tracing is not None and _rt.tracing():
        refuse_traced("attngen.prefill_varlen", score_mod, mask_mod, aux)
        fp8_op.refuse_traced("attngen.prefill_varlen", q, (q_descale, k_descale, v_descale))
        return _rt.traced_ops["prefill_varlen"](
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, window=window,
            sm_scale=sm_scale, return_lse=return_lse, out=out, block_table=block_table, spec=spec, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks)
    if spec is not None and spec.__class__ is not PrefillSpec:
        spec = op_spec(spec, "prefill", "attngen.prefill_varlen")  # (named before the tensors, as run_varlen does)
    qi = tensor_info(q, "q")
    if q_descale is not None or k_descale is not None or v_descale is not None or (
            qi.dtype != "bf16" and qi.dtype != "fp16"):
        if fp8_op.is_fp8_call(qi, spec):
            fp8_op.refuse_options(block_table=block_table, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                  score_mod=score_mod, mask_mod=mask_mod, aux=aux)
            return fp8_op.prefill_varlen_fp8(q, k, v, qi, tensor_info(k, "k"), tensor_info(v, "v"), cu_seqlens_q,
                                             cu_seqlens_k, _max_seqlen(max_seqlen_k, "max_seqlen_k"), causal=causal,
                                             window=window, sm_scale=sm_scale, return_lse=return_lse, out=out,
                                             spec=spec, descales=(q_descale, k_descale, v_descale))
        if qi.dtype in ("bf16", "fp16"):
            if q_descale is None and "float8" in str(getattr(k, "dtype", "")):
                # an fp8 cache under q in 16 bits: FlashAttention-3's descales of k and v are its scales
                k_scale = k_descale if k_scale is None else k_scale
                v_scale = v_descale if v_scale is None else v_scale
            else:
                raise LaunchError("q_descale, k_descale and v_descale are for fp8 q, k, v (torch.float8_e4m3fn), "
                                  f"or k_descale / v_descale for an fp8 cache; q has dtype {qi.dtype}")
    widths = pad_widths(q, k, v, PrefillSpec.WHOLE_DIMS)
    if widths is not None:  # a head dim no kernel is built for, run on zero-padded copies (head_pad)
        return run_padded(prefill_varlen, q, k, v, widths, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          sm_scale=sm_scale, out=out, return_lse=return_lse, causal=causal, window=window,
                          block_table=block_table, spec=spec, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                          score_mod=score_mod, mask_mod=mask_mod, aux=aux)
    _max_seqlen(max_seqlen_q, "max_seqlen_q")
    _max_seqlen(max_seqlen_k, "max_seqlen_k")
    return run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window, sm_scale=sm_scale,
                      return_lse=return_lse, out=out, block_table=block_table, spec=spec, softcap=softcap,
                      alibi_slopes=alibi_slopes, sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, aux=aux,
                      k_scale=k_scale, v_scale=v_scale)


def page_layout(block_size: int) -> int:
    """The plan layout of a paged cache: blocks of a multiple of 16 positions share a lookup a 16-row group, others
    take the kernels that look up every key row (spec page_rows)."""
    return VARLEN_PAGED if block_size % 16 == 0 else VARLEN_PAGE_ROWS


def run_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal, window, sm_scale, return_lse, out, block_table, spec,
               softcap, alibi_slopes, sinks, score_mod, mask_mod, aux, order: VarlenOrder | None = None,
               lse=None, size: int = 0, k_scale=None, v_scale=None):
    """``prefill_varlen`` past its tracing and head-dim padding. The serving step's extras: ``order``, a work list
    built before (``launch_order``; its skipped sequences are not computed and their rows of ``out`` and ``lse``
    are left as they were), ``lse`` the caller's fp32 ``[heads, total_q]`` to write instead of a new one (with
    ``return_lse``), ``size`` the rows a sequence is expected to have for the kernel's choice (0: total / batch)."""
    if spec is not None and spec.__class__ is not PrefillSpec:
        spec = op_spec(spec, "prefill", "attngen.prefill_varlen")
    check_spec_sinks(spec, sinks)
    mods = call_mods(score_mod, mask_mod, aux) if score_mod or mask_mod or aux else None
    check_spec_mods(spec, mods)
    paged = block_table is not None
    dims = ("[total_q, heads, head_dim]",
            "[num_blocks, block_size, kv_heads, head_dim]" if paged else "[total_k, kv_heads, head_dim]")
    qi = tensor_info(q, "q")
    kv = fp8_op.cache_kind(qi, k, v, spec)  # an fp8 cache (kv_dtype), or None
    if kv is None:
        qi, ki, vi = check_qkv(q, k, v, *dims)
    else:
        qi, ki, vi = fp8_op.cache_operands(q, k, v, kv, *dims)
        spec = fp8_op.cache_spec(spec, kv)
    total_q, h, d = qi.shape
    hk, dv = ki.shape[-2], vi.shape[-1]
    cq = _index(cu_seqlens_q, "cu_seqlens_q", 1, qi)
    ck = _index(cu_seqlens_k, "cu_seqlens_k", 1, qi)
    if cq.shape[0] != ck.shape[0] or cq.shape[0] < 1:
        raise LaunchError(f"cu_seqlens_q has {cq.shape[0]} entries and cu_seqlens_k {ck.shape[0]}; both must be "
                          f"batch + 1 >= 1")
    batch = cq.shape[0] - 1
    if paged:
        bt = _index(block_table, "block_table", 2, qi)
        if bt.shape[0] != batch:
            raise LaunchError(f"block_table has {bt.shape[0]} rows; cu_seqlens give batch {batch}")
        num_blocks, block_size = ki.shape[0], ki.shape[1]
        total_k = check_block_size(block_size, bt.shape[1], "k", multiple=1)
        if num_blocks == 0:
            raise LaunchError("k and v hold no blocks (k.shape[0] == 0)")
        bt_ptr, bt_sb = bt.ptr, bt.strides[0]
    else:
        num_blocks = block_size = bt_ptr = bt_sb = 0
        total_k = ki.shape[0]
    if total_q >= 2 ** 31 or total_k >= 2 ** 31:
        raise LaunchError(f"total_q={total_q} / total_k={total_k}: at most 2^31 - 1 rows (int32 cu_seqlens)")
    mcode, left, right = mask_and_window(causal, window)
    return_lse = bool(return_lse)
    scale = checked_scale(default_scale(sm_scale, d))
    cap_u, inv_cap_u, alibi_ptr, alibi_sb = (extras(softcap, alibi_slopes, batch, h, qi, sm_scale)
                                             if softcap or alibi_slopes is not None else NO_EXTRAS)
    sinks_at = sinks_ptr(sinks, h, qi)
    key = (d, qi.dtype, qi.device, mcode, return_lse, spec, qi.kind, bool(softcap), alibi_ptr != 0,
           page_layout(block_size) if paged else VARLEN, dv, sinks is not None, *mods_key(mods, scale))
    plan = plan_for(key)
    kv8 = ()  # an fp8 cache's scales (Fp8Scales' fields), after every other field
    if kv is not None or k_scale is not None or v_scale is not None:  # (a scale without an fp8 cache: refused)
        k_mul, kv8 = fp8_op.cache_scales(k_scale, v_scale, kv, hk, qi)
        scale *= k_mul
    if out is None:
        out = plan.alloc(total_q, h, dv)
        optr, ostrides = data_ptr(out, qi.kind), (h * dv, dv)
    else:
        optr, ostrides = out_of(out, qi, dv)
    if return_lse and lse is None:
        lse = plan.alloc_f32(h, total_q)
    if total_q == 0 or batch == 0 or h == 0:
        return (out, lse) if return_lse else out

    kern = plan.kernel or plan.kernel_for(size or max(1, total_q // max(batch, 1)))  # (choose.Problem.size)
    check_q_scaled(kern.spec, scale)
    kern, maps = plan.tma_maps(kern, qi, ki, vi)  # the packed tensors as TMA maps, or the cp.async kernel
    layout, maps = (PARAMS_EXT, ()) if maps is None else (PARAMS_EXT_TMA, (maps,))
    if sinks_at or mods:  # batch_count (unread), then the sinks' pointer
        layout = PARAMS_EXT_SINKS if layout is PARAMS_EXT else PARAMS_EXT_TMA_SINKS
    # the snippets' aux tensors after every other field (params.cuh, ModArgs)
    mod_vals = () if mods is None else (*pack_aux(kern.spec.aux, mods[3], qi), *NO_POOL)
    if mods:
        layout = mods_layout(layout)
    grid = varlen_grid(total_q, batch, h, kern.spec)
    max_items = grid[0]
    splits = kern.spec.v_splits  # the chunked kernel past 640 columns of v: CTAs a query tile's O is split over
    if grid[1] > 65535:
        raise LaunchError(f"heads={h} exceed the grid's y limit (65535 / {splits} with this kernel)")
    stream = plan.stream(qi.device)
    if order is not None and order.tiles == order_tiles(kern.spec) and order.max_items >= max_items:
        wp = data_ptr(order.ws, qi.kind)
        max_items = order.max_items  # (the count follows the list's slots)
    else:
        ws = plan.alloc_index(2 * max_items + 1 + batch + 1)  # work items, their count, per-sequence tile offsets
        wp = data_ptr(ws, qi.kind)
        launch_order(kern, stream, wp, max_items, cq.ptr, ck.ptr, left, right, batch, total_q, total_k, paged,
                     order.skip_q_le if order is not None else 0)
    qs, ks, vs = qi.strides, ki.strides, vi.strides
    if kv8:  # the fp8 rows as 16-bit pairs (templates/prefill/traits.cuh, KV8); batch_count and sinks unread
        ks, vs = [x // 2 for x in ks], [x // 2 for x in vs]
        layout, mod_vals = fp8_op.PARAMS_KV8_TMA if maps else fp8_op.PARAMS_KV8, (0, 0, *kv8)
    lse_ptr = data_ptr(lse, qi.kind) if return_lse else 0
    kern.launch_struct(
        layout, grid, stream, *maps,
        qi.ptr, ki.ptr, vi.ptr, optr, lse_ptr,
        0, qs[0], qs[1],
        ks[0] if paged else 0, ks[-3], ks[-2], vs[0] if paged else 0, vs[-3], vs[-2],
        0, ostrides[0], ostrides[1],
        0, 0, h, h // hk, scale, scale * LOG2E, left, right, cap_u, inv_cap_u, alibi_ptr, alibi_sb,
        cq.ptr, ck.ptr, bt_ptr, wp, wp + 8 * max_items, 0, 0, 0,
        bt_sb, 0,
        block_size, num_blocks, total_q, total_k, 0, 0, 0, 0, 0,
        *((0, sinks_at) if sinks_at or mods else ()), *mod_vals,
    )
    return (out, lse) if return_lse else out
