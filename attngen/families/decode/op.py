"""``attngen.decode``: attention of a few new tokens against a KV cache (FlashAttention's
``flash_attn_with_kvcache`` conventions), contiguous or paged, GQA-packed, split-KV."""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping

from ... import runtime as _rt
from ...errors import LaunchError
from ...runtime import data_ptr, tensor_info
from ...spec import op_spec
from ...tuned import stored_choices
from ..choice import device_facts
from ..head_pad import pad_widths, run_padded
from ..host import LOG2E, OpMemo, Plan
from ..score_mods import NO_EXTRAS, check_spec_sinks, checked_scale, extras, sinks_ptr as checked_sinks
from ..snippets import call_mods, check_spec_mods, mod_layout, pack_aux, refuse_traced
from ..split_kv import CLUSTER_MAX, cache_lengths, check_index, check_rows, checked_splits, paged_table
from . import choose as _choose
from . import fp8 as _fp8
from .choose import Problem, base_spec, launch, table
from .spec import HEAD_DIMS_TEXT, DecodeSpec, Variant, head_dim_refusal

# DecodeParams in templates/decode/params.cuh: 12 pointers, 14 strides, 9 ints, an unsigned
# (block_mul), 2 floats, 2 floats (softcap), the ALiBi slopes' pointer and batch stride, the left pads'
# pointer and the window's two sides (read by the `local` kernels only), the sinks' pointer (the `sinks` kernels),
# the fp8 scales' pointers, strides and v's number (read by the fp8 kernels only), padding to the struct's 8-byte
# alignment.
_PARAMS = struct.Struct("<12Q14q9iI2f2fQqQiiQQQiif4x")
# A packed, ragged q's kernels (spec varlen_q) add cu_seqlens_q's and tree_mask's pointers, the LSE's head stride,
# batch_order's pointer and min_q_len.
_PARAMS_VARLEN = struct.Struct(_PARAMS.format + "QQqQi4x")
MAX_Q_LEN = 8
# A packed, ragged q (cu_seqlens_q): at most this many tokens a request go through the decode kernels (and
# group x max_q_len packed rows at most the largest q_rows).
MAX_VARLEN_Q_LEN = 64
# GQA groups to 128 query heads a KV head (one CTA packs a group's heads x q_len rows, 128 at most).
MAX_GROUP = 128
VARIANTS = ("auto", "fused", "unfused")
_CACHE_DIMS = "[cache_batch, max_seqlen, kv_heads, head_dim] or, paged, [num_blocks, block_size, kv_heads, head_dim]"
# An unbounded side of the window, as the local kernels take it: past any cache they accept (LOCAL_MAX_KEYS).
_UNBOUNDED = 1 << 30
LOCAL_MAX_KEYS = 1 << 30


def _make_plan(key: tuple) -> Plan:
    """The plan (``host.Plan``) of a key (head_dim, dtype, device, q_rows, paged (False, True or "rows": blocks that
    are not a multiple of 16 positions, spec page_rows), variant, the user's spec, array
    kind, softcap, alibi, local, sinks, the cache's fp8 format or None, a packed q's "varlen" or "tree" or None,
    the snippets): the kernel, or the winners ``attngen tune
    decode`` stored for this GPU by cache capacity (``kernel_for``), allocators, the stream getter and the device's
    facts. Made once per key, so a call does its checks, one lookup, the allocations and the launches."""
    d, dtype, device, q_rows, paged, variant, spec, kind, softcap, alibi, local, sinks, kv, packed, *mods = key
    base = base_spec(d, dtype, q_rows, bool(paged), variant, spec, softcap, alibi, local, sinks, kv, *mods,
                     varlen_q=packed is not None, tree=packed == "tree", page_rows=paged == "rows")
    plan = Plan()
    # the choice's specs by cache capacity (choose.choose, whose size-independent part a plan keeps)
    tuned = tuple(stored_choices(base, device)) if spec is None else ()
    plan.setup(table(base, device_facts(device).arch, spec is None, tuned), device, kind, dtype)
    return plan


_memo = OpMemo(_make_plan)
_plans, _calls = _memo.plans, _memo.calls  # key -> Plan; key -> _Call (runtime.keep_call)


def block_mul(block_size: int) -> int:
    """The multiplier of Decode::block_of (templates/decode/fwd.cuh): ceil(2^(31 + ceil(log2(block_size))) /
    block_size), below 2^32 for every block size, so pos * it >> that shift is pos // block_size for every
    position below 2^31."""
    return -(-(1 << (31 + (block_size - 1).bit_length())) // block_size)


def _refuse_head_dim(d) -> None:
    raise LaunchError(f"head_dim={d} is not supported; allowed: {HEAD_DIMS_TEXT} ({head_dim_refusal(d)})")


def _check_operands(qi, ki, vi, packed: bool = False) -> None:
    """Ranks, contiguous last dims and 16-byte alignment of q and the caches (``check_rows``'s
    rules): one arithmetic test for the common case, the named checks for the message. ``packed``: q is
    [total_q, heads, head_dim] (cu_seqlens_q)."""
    for t in (qi, ki, vi):
        st = t.strides
        if len(st) != 4 - (packed and t is qi) or st[-1] != 1 or (t.ptr & 15) | (sum(x & 7 for x in st[:-1])):
            d = qi.shape[-1] if qi.shape else 0
            if d not in DecodeSpec.HEAD_DIMS:  # named before the strides it makes misaligned
                _refuse_head_dim(d)
            if packed:
                check_rows(qi, "q", 3, "[total_q, heads, head_dim] (a packed q, with cu_seqlens_q)")
            else:
                check_rows(qi, "q", 4, "[batch, q_len, heads, head_dim]")
            check_rows(ki, "k_cache", 4, _CACHE_DIMS)
            check_rows(vi, "v_cache", 4, _CACHE_DIMS)


def decode(q, k_cache, v_cache, *, cache_seqlens, cache_batch_idx=None, block_table=None, num_splits: int = 0,
           sm_scale: float | None = None, return_lse: bool = False, out=None, variant: str = "auto",
           spec: DecodeSpec | str | Mapping | None = None, softcap: float = 0.0, alibi_slopes=None,
           causal: bool = True, window: tuple[int, int] = (-1, -1), cache_leftpad=None, sinks=None, k_scale=None,
           v_scale=None, score_mod: str = "", mask_mod: str = "", aux=None, cu_seqlens_q=None,
           max_q_len: int | None = None, tree_mask=None, batch_order=None, min_q_len: int = 1, lse=None):
    """Attention of q_len new tokens per sequence against a KV cache.

    q ``[batch, q_len, heads, head_dim]`` (q_len 1..8). Contiguous cache: k_cache, v_cache
    ``[cache_batch, max_seqlen, kv_heads, head_dim]``, batch row b reading cache row
    ``cache_batch_idx[b]`` (int32; default b). Paged cache (``block_table`` int32
    ``[batch, max_blocks]``): k_cache, v_cache ``[num_blocks, block_size, kv_heads, head_dim]``,
    key j of row b at ``k_cache[block_table[b, j // block_size], j % block_size]``, block_size any positive
    int (not a multiple of 16: the kernels that look up every key row's block, spec ``page_rows``).
    ``cache_seqlens`` (int32 ``[batch]`` or an int) is each row's length including the new
    tokens, whose K/V are already in the cache: token i sits at position L - q_len + i and sees
    keys 0..L - q_len + i. Lengths past the cache's capacity are clamped to it; out-of-range
    cache rows or blocks are clamped to the pool (they are read on the device, never checked on
    the host). ``num_splits`` 0 chooses the split-KV count, a positive number forces it.
    ``variant``: "auto", "fused" or "unfused". ``spec`` (a spec, its text or a dict of its fields) overrides
    the tuning fields; without it, a configuration ``attngen tune decode`` stored for this GPU (nearest tuned
    cache capacity) is used where there is one, else the arch's default. Returns ``out`` (q's dtype and kind), with
    ``return_lse`` also the fp32 LSE ``[batch, heads, q_len]`` (``lse``: written into that fp32 tensor, contiguous,
    with ``return_lse``); a token that sees no key gives zeros and LSE -inf. ``softcap`` and ``alibi_slopes`` (fp32
    ``[heads]`` or ``[batch, heads]``) act as in ``attngen.prefill``.

    FlashAttention's key bounds, queries at the bottom right: ``window=(left, right)`` lets the token
    at position i see keys i - left .. i + right (-1: unbounded on that side; a sliding window of
    Mistral or Gemma is ``(w - 1, 0)``); ``causal`` (default True) sets right to 0, and with
    ``causal=False`` and no right bound every new token sees every key of its row. ``cache_leftpad``
    (int32 ``[batch]``) is each row's first cache position: keys before it are never seen (nor read),
    and ``cache_seqlens`` stays the row's end. Split-KV divides only the keys some token sees. These
    take the spec's ``local`` kernels; calls without them run the kernels without that switch.

    ``sinks`` (fp32 ``[heads]``, q's kind and device): attention sinks (gpt-oss), one logit a query head, in the
    units of the scaled scores, that joins each of the head's rows' softmax denominator and adds no value:
    out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)). The LSE includes it (the log of that whole
    denominator; merging partial results, give the sink to exactly one of them); a token that sees no key gives
    zeros and LSE = its sink; a sink of -inf is no sink. It takes the spec's ``sinks`` kernels.

    fp8 caches: k_cache and v_cache of ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or uint8 bytes, e.g. CuPy
    arrays, with a ``spec`` whose ``kv_dtype`` names the format), q fp16 or bf16. The kernel reads them as fp8 and
    widens them exactly to fp16 in registers (a bf16 q enters its fp16 MMAs scaled by a power of two); the keys are
    ``k_scale * k_cache``, the values ``v_scale * v_cache``. Each scale
    is a number or an fp32 device tensor of shape [] or [1] (per tensor, vLLM's) or [kv_heads] (per KV head);
    missing means 1. The fp8 kernels take head dims that are multiples of 16 up to 256, the fused variant, no
    softcap or ALiBi.

    A head dim up to 256 that is not a multiple of 8 (or is below 32) runs on a zero-padded copy (the
    output a view of its first head_dim columns); that costs a copy of q and the whole cache per call.

    ``score_mod`` / ``mask_mod``: a user's variant as CUDA device-function bodies reading the tensors of ``aux``, as
    in ``attngen.prefill`` (docs/variants.md): b is the batch row, h the query head, q_idx the token's position
    (L - q_len + i), kv_idx the key's cache position. The fused kernel on a cache in q's dtype runs them
    (``variant="unfused"`` and fp8 caches are refused).

    A packed, ragged q (a serving step's decode and speculative-verify requests): ``cu_seqlens_q`` (int32
    ``[batch + 1]`` on q's device, non-decreasing, read only on the device) with q ``[total_q, heads, head_dim]``:
    request b's tokens are q rows ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1] - 1``, the last q_len_b tokens of its
    cache (``cache_seqlens[b]`` counts them), token i at position L_b - q_len_b + i, causal within the request as above.
    ``max_q_len`` (an int, required with it, 1 to min(64, 128 // group)) sizes the kernel's rows (group x max_q_len): a
    request with more tokens than that, or fewer than ``min_q_len`` (default 1, at most max_q_len), is not computed and
    its rows of out and LSE are not written (a serving step sends the longer ones to ``attngen.prefill_varlen``, and its
    one-token requests to a kernel of fewer rows than its verify requests'). Returns out ``[total_q, heads, head_dim]``
    (``out`` the same shape, any row stride) and with ``return_lse`` the LSE ``[heads, total_q]`` (fp32, the layout of
    ``prefill_varlen``'s). ``tree_mask`` (int64 ``[total_q]`` on q's device, with ``cu_seqlens_q``): speculative
    decoding's tree; bit j (the lowest bit 0) of token i's word lets it see its request's draft token j, the key at
    position L_b - q_len_b + j (j < q_len_b; higher bits are ignored), in place of causality inside the draft block;
    every key before the block is seen. A token that sees no key gives zeros and LSE -inf (sinks: its sink). Split-KV,
    paged caches, fp8 caches, softcap, ALiBi and sinks work with a packed q, a window and ``cache_leftpad`` without a
    tree; ``variant="unfused"``, score_mod/mask_mod, head_dim 512 and torch.compile are refused with it. ``batch_order``
    (int32 ``[batch]`` on q's device, with ``cu_seqlens_q``): the order the requests' CTAs are launched in, a
    permutation of 0..batch-1 (longest first keeps a long request out of the launch's tail, as ``BatchAttention.plan``
    sorts them); entries out of range are clamped, and a request listed twice is computed twice (the same result) while
    one left out is not computed.
    """
    if _rt.tracing is not None and _rt.tracing():
        refuse_traced("attngen.decode", score_mod, mask_mod, aux)
        if (cu_seqlens_q is not None or max_q_len is not None or tree_mask is not None or batch_order is not None
                or min_q_len != 1 or lse is not None):
            raise LaunchError("cu_seqlens_q, max_q_len, min_q_len, tree_mask, batch_order and lse are not supported "
                              "under torch.compile; call attngen.decode outside the compiled region")
        if k_scale is not None or v_scale is not None:
            raise LaunchError("k_scale and v_scale are not supported under torch.compile; call attngen.decode "
                              "outside the compiled region")
        return _rt.traced_ops["decode"](
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            block_table=block_table, num_splits=num_splits, sm_scale=sm_scale, return_lse=return_lse, out=out,
            variant=variant, spec=spec, softcap=softcap, alibi_slopes=alibi_slopes, causal=causal, window=window,
            cache_leftpad=cache_leftpad, sinks=sinks)
    if spec is not None and spec.__class__ is not DecodeSpec and spec.__class__ is not str:
        # a dict, another family's spec, a wrong type: read or refused before the tensors (text is
        # kept as given, part of the call's key, and read once in _prepare)
        spec = op_spec(spec, "decode", "attngen.decode")
    qi = tensor_info(q, "q")
    ki = tensor_info(k_cache, "k_cache")
    vi = tensor_info(v_cache, "v_cache")
    # The call's key: the operands' infos and every other argument as a value. Scalars of other
    # classes (a bool, a 0-dim tensor whose value may change) are never remembered; arguments that
    # are no array, or unhashable, go to the checks, which say what is wrong.
    mods = call_mods(score_mod, mask_mod, aux) if score_mod or mask_mod or aux else None
    try:
        key = (qi, ki, vi,
               cache_seqlens if cache_seqlens.__class__ is int else tensor_info(cache_seqlens, "cache_seqlens"),
               None if cache_batch_idx is None else tensor_info(cache_batch_idx, "cache_batch_idx"),
               None if block_table is None else tensor_info(block_table, "block_table"),
               None if alibi_slopes is None else tensor_info(alibi_slopes, "alibi_slopes"),
               None if out is None else tensor_info(out, "out"),
               None if cache_leftpad is None else tensor_info(cache_leftpad, "cache_leftpad"),
               None if sinks is None else tensor_info(sinks, "sinks"),
               num_splits, sm_scale, softcap, return_lse, variant, spec, causal, window,
               _fp8.scale_key(k_scale), _fp8.scale_key(v_scale), mods,
               None if cu_seqlens_q is None else tensor_info(cu_seqlens_q, "cu_seqlens_q"), max_q_len,
               None if tree_mask is None else tensor_info(tree_mask, "tree_mask"),
               None if batch_order is None else tensor_info(batch_order, "batch_order"), min_q_len,
               None if lse is None else tensor_info(lse, "lse"))
        call = _calls.get(key)
    except (LaunchError, TypeError):
        key = call = None
    if call is None:
        widths = (pad_widths(q, k_cache, v_cache, DecodeSpec.HEAD_DIMS, v_as_k=True)
                  if len(qi.shape) == (4 if cu_seqlens_q is None else 3) else None)
        if widths is not None:  # a head dim no kernel is built for (head_pad)
            return run_padded(decode, q, k_cache, v_cache, widths, sm_scale=sm_scale, out=out, return_lse=return_lse,
                              cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, block_table=block_table,
                              num_splits=num_splits, variant=variant, spec=spec, softcap=softcap,
                              alibi_slopes=alibi_slopes, causal=causal, window=window, cache_leftpad=cache_leftpad,
                              sinks=sinks, k_scale=k_scale, v_scale=v_scale, score_mod=score_mod, mask_mod=mask_mod,
                              aux=aux, cu_seqlens_q=cu_seqlens_q, max_q_len=max_q_len, tree_mask=tree_mask,
                              batch_order=batch_order, min_q_len=min_q_len, lse=lse)
        call = _prepare(qi, ki, vi, cache_seqlens, cache_batch_idx, block_table, num_splits, sm_scale, return_lse,
                        out, variant, spec, softcap, alibi_slopes, causal, window, cache_leftpad, sinks, k_scale,
                        v_scale, mods, (cu_seqlens_q, max_q_len, tree_mask, batch_order, min_q_len), lse)
        _memo.keep(key, call, flags=(return_lse, causal), numbers=(num_splits, sm_scale, softcap,
                                                                    _fp8.scale_number(k_scale),
                                                                    _fp8.scale_number(v_scale),
                                                                    0 if max_q_len is None else max_q_len,
                                                                    min_q_len))
    plan, kind = call.plan, qi.kind
    if out is None:
        out = plan.alloc(*call.out_shape)
        optr = data_ptr(out, kind)
    else:
        optr = call.out_ptr
    if lse is not None:
        lptr = call.lse_ptr
    elif return_lse:
        lse = plan.alloc_f32(*call.lse_shape)
        lptr = data_ptr(lse, kind)
    else:
        lptr = 0
    if call.grid is None:  # an empty batch
        return (out, lse) if return_lse else out
    w0 = w1 = w2 = w3 = 0
    if call.work:
        at = data_ptr(plan.alloc_f32(call.work), kind)
        o0, o1, o2, o3 = call.offsets
        w0 = at if o0 >= 0 else 0
        w1 = at + o1 if o1 >= 0 else 0
        w2 = at + o2 if o2 >= 0 else 0
        w3 = at + o3 if o3 >= 0 else 0
    values = (qi.ptr, ki.ptr, vi.ptr, optr, lptr, *call.indices,
              w0, w1, w2, w3, *call.tail)
    kern, grid = call.kern, call.grid
    stream = plan.stream(qi.device)
    layout = call.layout
    kern.launch_struct(layout, grid, stream, *values, cluster_x=call.cluster)  # a cluster: no _pv, no merge
    if call.unfused:
        kern.launch_struct(layout, grid, stream, *values, entry="_pv")
    if call.merge_grid is not None:
        kern.launch_struct(layout, call.merge_grid, stream, *values, entry="_merge")
    return (out, lse) if return_lse else out


class _Call:
    """What a decode call with a given key launches, worked out once: its plan and kernel, the
    shapes it allocates (or the caller's ``out``), the workspace's size and the offsets of its
    pieces (bytes; -1 where a piece is not used), the parameters that are not pointers of this
    call's own allocations, the grids and the cluster size (0: none)."""

    __slots__ = ("plan", "kern", "cluster", "out_shape", "out_ptr", "lse_shape", "lse_ptr", "work", "offsets",
                 "indices", "layout", "tail", "grid", "merge_grid", "unfused")



_cluster_merge = [CLUSTER_MAX]
try:
    _cluster_merge[0] = max(0, min(CLUSTER_MAX, int(os.environ.get("ATTNGEN_DECODE_CLUSTER", CLUSTER_MAX))))
except ValueError:
    pass


def set_cluster_merge(max_splits: int) -> int:
    """The most splits of a row sm_90 decode merges in one cluster (default and most 8;
    ``ATTNGEN_DECODE_CLUSTER=N`` sets it at import); 0 or 1 merges every split count through the
    workspace and a merge launch. For calls worked out from now on (benchmarks compare the two);
    returns the previous setting."""
    was, _cluster_merge[0] = _cluster_merge[0], max(0, min(CLUSTER_MAX, int(max_splits)))
    _calls.clear()
    return was


def cluster_limit(kern, ctas: int) -> int:
    """The most splits of a row that a grid of ``ctas`` (batch x KV heads) CTAs of the loaded ``kern`` merges
    in one cluster of them; 0 where it merges through the workspace and a merge launch (``choose.cluster_limit``
    with this process's setting, ``set_cluster_merge``)."""
    return _choose.cluster_limit(kern.spec, ctas, device_facts(kern.device), _cluster_merge[0])


def window_bounds(causal, window, q_len: int) -> tuple[bool, int, int]:
    """(local, left, right) of a decode call: whether it needs the ``local`` kernels (a window, or
    keys after a token's own position for several new tokens) and the window's sides as they take
    them, an unbounded side as _UNBOUNDED. Raises LaunchError for a malformed window."""
    if causal.__class__ is not bool:
        raise LaunchError(f"causal={causal!r} must be a bool")
    try:
        left, right = window
        ok = all(x.__class__ is int and x >= -1 for x in (left, right))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise LaunchError(f"window={window!r} must be a pair (left, right) of ints >= -1, -1 for unbounded")
    right = 0 if causal else right
    local = left >= 0 or (q_len > 1 and right != 0)
    return local, (_UNBOUNDED if left < 0 else min(left, _UNBOUNDED)), (_UNBOUNDED if right < 0
                                                                         else min(right, _UNBOUNDED))


def _prepare(qi, ki, vi, cache_seqlens, cache_batch_idx, block_table, num_splits, sm_scale, return_lse, out, variant,
             spec, softcap, alibi_slopes, causal=True, window=(-1, -1), cache_leftpad=None, sinks=None, k_scale=None,
             v_scale=None, mods=None, packed_args=(None, None, None, None, 1), lse=None) -> _Call:
    """Check a call's arguments and work out its ``_Call``. ``mods``: the call's snippets (``call_mods``) or None;
    ``packed_args``: (cu_seqlens_q, max_q_len, tree_mask, batch_order, min_q_len) as given; ``lse``: the caller's
    LSE tensor or None."""
    if spec is not None and spec.__class__ is not DecodeSpec:
        spec = op_spec(spec, "decode", "attngen.decode")
    check_spec_mods(spec, mods)
    cu_seqlens_q, max_q_len, tree_mask, batch_order, min_q_len = packed_args
    packed = cu_seqlens_q is not None
    if not packed and (max_q_len is not None or tree_mask is not None or batch_order is not None or min_q_len != 1):
        name = ("max_q_len" if max_q_len is not None else "tree_mask" if tree_mask is not None else "batch_order"
                if batch_order is not None else "min_q_len")
        raise LaunchError(f"{name} is given without cu_seqlens_q; allowed: {name} only with cu_seqlens_q (a packed "
                          "q [total_q, heads, head_dim])")
    if ki.shape != vi.shape:  # first: a head dim the two caches disagree on is no head dim to name
        raise LaunchError(f"k_cache {ki.shape} and v_cache {vi.shape} must have the same shape")
    _check_operands(qi, ki, vi, packed)
    if not (qi.kind == ki.kind == vi.kind and qi.device == ki.device == vi.device):
        raise LaunchError(f"q, k_cache, v_cache must be of one kind on one device; got {qi.kind}:{qi.device}, "
                          f"{ki.kind}:{ki.device}, {vi.kind}:{vi.device}")
    dtype = qi.dtype
    if dtype != "bf16" and dtype != "fp16":
        fp8 = " (an fp8 cache takes q in fp16 or bf16)" if _fp8.is_fp8_name(dtype) else ""
        raise LaunchError(f"q has dtype {dtype}; allowed: fp16, bf16{fp8}")
    kv = None
    if ki.dtype != dtype or vi.dtype != dtype or (spec is not None and spec.kv_dtype is not None):
        kv = _fp8.cache_format(qi, ki, vi, None if spec is None else spec.kv_dtype)
        if kv is not None:
            _fp8.check_rows(ki, "k_cache")
            _fp8.check_rows(vi, "v_cache")
    if packed:
        total_q, h, d = qi.shape
        b = q_len = 1  # (read from cu_seqlens_q and max_q_len below)
    else:
        b, q_len, h, d = qi.shape
    pool, cache_len, hk, dk = ki.shape
    if not packed and not 1 <= q_len <= MAX_Q_LEN:
        raise LaunchError(f"q_len={q_len} (q.shape[1]) is not supported; allowed: 1 to {MAX_Q_LEN}")
    if d not in DecodeSpec.HEAD_DIMS:
        _refuse_head_dim(d)
    if dk != d:
        raise LaunchError(f"head_dim mismatch: q has {d}, k_cache/v_cache have {dk}")
    if hk == 0 or h % hk:
        raise LaunchError(f"heads={h} must be a multiple of kv_heads={hk} (GQA/MQA)")
    group = h // hk
    if group > MAX_GROUP:
        raise LaunchError(f"heads/kv_heads = {group} is not supported; allowed: a GQA group of 1 to {MAX_GROUP}")
    cu_ptr = tree_ptr = order_ptr = 0
    if packed:
        b, q_len, cu_ptr, tree_ptr, order_ptr = _packed_q(qi, cache_seqlens, cu_seqlens_q, max_q_len, tree_mask,
                                                          batch_order, group, d, variant, mods, min_q_len)
    if group * q_len > DecodeSpec.Q_ROWS[-1]:
        raise LaunchError(f"heads/kv_heads x q_len = {group} x {q_len} = {group * q_len} packed query rows a KV "
                          f"head is not supported; allowed: at most {DecodeSpec.Q_ROWS[-1]}")
    if variant not in VARIANTS:
        raise LaunchError(f"variant={variant!r} is not allowed; allowed: {', '.join(VARIANTS)}")
    if num_splits.__class__ is not int or num_splits:
        checked_splits(num_splits)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else checked_scale(sm_scale)
    k_mul, *fp8_tail = _fp8.scales(k_scale, v_scale, kv, hk, qi.kind, qi.device)

    kind, dev = qi.kind, qi.device
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise LaunchError("cache_batch_idx cannot be combined with block_table (a paged cache names its "
                              "blocks per row already)")
        block_size = cache_len
        capacity, bt_ptr, bt_sb = paged_table(block_table, b, block_size, kind, dev, "q", "k_cache", multiple=1)
        if kv is not None:
            _fp8.check_paged(ki, vi, b, bt_sb, capacity // block_size)
        bi_ptr = 0
    else:
        block_size, capacity, bt_ptr, bt_sb = 0, cache_len, 0, 0
        bi_ptr = 0
        if cache_batch_idx is not None:
            bix = check_index(cache_batch_idx, "cache_batch_idx", 1, kind, dev)
            if bix.shape[0] != b:
                raise LaunchError(f"cache_batch_idx has {bix.shape[0]} entries; q has batch {b}")
            bi_ptr = bix.ptr
        elif pool < b:
            raise LaunchError(f"k_cache has {pool} cache rows for batch {b}; pass cache_batch_idx to map rows")
    seq_ptr, seq_fixed = cache_lengths(cache_seqlens, b, kind, dev, "q")
    local, left, right = window_bounds(causal, window, q_len)
    pad_ptr = 0
    if cache_leftpad is not None:
        pad = check_index(cache_leftpad, "cache_leftpad", 1, kind, dev)
        if pad.shape[0] != b:
            raise LaunchError(f"cache_leftpad has {pad.shape[0]} entries; q has batch {b}")
        local, pad_ptr = True, pad.ptr
    if tree_ptr and local:
        raise LaunchError(f"tree_mask with window={window}, causal={causal}, cache_leftpad="
                          f"{'given' if pad_ptr else None} is not supported; allowed: a tree with causal=True, "
                          "window=(-1, -1) and no cache_leftpad (the tree replaces causality in the draft block)")
    if local and capacity > LOCAL_MAX_KEYS:
        raise LaunchError(f"a cache of {capacity} positions with a window or cache_leftpad; allowed: at most "
                          f"{LOCAL_MAX_KEYS}")
    cap_u, inv_cap_u, alibi_ptr, alibi_sb = (extras(softcap, alibi_slopes, b, h, qi, sm_scale)
                                             if softcap or alibi_slopes is not None else NO_EXTRAS)
    sinks_ptr = checked_sinks(sinks, h, qi)
    check_spec_sinks(spec, sinks)
    # Blocks that are not a multiple of 16 positions: the kernels that look up every key row (spec page_rows).
    page_rows = paged and block_size % 16 != 0
    layout = "rows" if page_rows else paged
    pkey = (d, dtype, dev, DecodeSpec.rows_for(group, q_len), layout, "fused" if variant == "auto" else variant,
            spec, kind, bool(softcap), alibi_ptr != 0, local, sinks_ptr != 0, kv,
            ("tree" if tree_ptr else "varlen") if packed else None, *(() if mods is None else (mods[:3],)))
    call = _Call()
    call.plan = plan = _plans.get(pkey) or _memo.plan(pkey)
    if packed:
        call.out_shape, call.lse_shape = (total_q, h, d), (h, total_q)
    else:
        call.out_shape, call.lse_shape = (b, q_len, h, d), (b, h, q_len)
    if out is None:
        ostrides = (0, h * d, d) if packed else (q_len * h * d, h * d, d)
    else:
        oi = tensor_info(out, "out")
        if oi.kind != kind or oi.shape != qi.shape or oi.dtype != dtype or oi.device != dev:
            raise LaunchError(f"out must match q: {kind} {qi.shape} {dtype} on device {dev}; got "
                              f"{oi.kind} {oi.shape} {oi.dtype} on device {oi.device}")
        if packed:
            check_rows(oi, "out", 3, "[total_q, heads, head_dim]")
            ostrides, call.out_ptr = (0, *oi.strides[:2]), oi.ptr
        else:
            check_rows(oi, "out", 4, "[batch, q_len, heads, head_dim]")
            ostrides, call.out_ptr = oi.strides, oi.ptr
    call.lse_ptr = 0
    if lse is not None:
        li = tensor_info(lse, "lse")
        want = tuple(call.lse_shape)
        dense = tuple(int(math.prod(want[i + 1:])) for i in range(len(want)))
        if not return_lse or li.kind != kind or li.device != dev or li.dtype != "fp32" or tuple(li.shape) != want or (
                li.strides != dense and math.prod(want)):
            raise LaunchError(f"lse must be a contiguous fp32 {kind} tensor of shape {list(want)} on device {dev}, "
                              f"given with return_lse=True; got {li.kind} {li.dtype} {tuple(li.shape)} strides "
                              f"{li.strides} on device {li.device}, return_lse={return_lse}")
        call.lse_ptr = li.ptr
    call.grid = None
    if b == 0 or (packed and total_q == 0):
        return call
    if b > 65535:
        raise LaunchError(f"batch={b} exceeds 65535 (the grid's z limit)")

    call.kern = kern = plan.kernel or plan.kernel_for(capacity)  # (choose.choose's spec)
    rs = kern.spec
    call.unfused = unfused = rs.variant is Variant.UNFUSED
    # The split count; the fused kernel on sm_90 merges the splits of a row in a cluster of them, where
    # its epilogue's shared memory holds the output rows: no workspace and no merge launch.
    # A window's row sees at most left + q_len keys (and one tile more where they start mid-tile): the split
    # count is chosen for those, as the kernel splits only them.
    live = min(capacity, left + q_len + rs.cta_tile_kv) if local and left < _UNBOUNDED else capacity
    problem = Problem(d, dtype, q_len, h, hk, b, capacity, paged, variant, spec, bool(softcap), alibi_ptr != 0,
                      num_splits, _cluster_merge[0], local, live, sinks_ptr != 0, kv, page_rows, packed, tree_ptr != 0)
    lc = launch(problem, rs, plan.facts)
    num_splits, call.cluster = lc.num_splits, lc.cluster
    merged = lc.merge_grid is not None  # by the merge launch
    # Else one fp32 workspace a call: split partials (outputs, then LSE), then the unfused variant's
    # scores and per-split row stats; every piece starts 16-byte aligned.
    scores_ld = 0
    sizes = [0, 0, 0, 0]
    if merged:
        sizes[0] = num_splits * b * q_len * h * d
        sizes[1] = -(-num_splits * b * h * q_len // 4) * 4
    if unfused:
        scores_ld = max(4, -(-capacity // 4) * 4)
        sizes[2] = b * hk * group * q_len * scores_ld
        sizes[3] = num_splits * b * hk * rs.q_rows * 2
    call.work = sum(sizes)
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at if n else -1)
        at += 4 * n
    call.offsets = tuple(offsets)
    call.indices = (seq_ptr, bi_ptr, bt_ptr)
    qstrides = (0, *qi.strides[:2]) if packed else qi.strides[:3]
    call.tail = (
        qstrides[0], qstrides[1], qstrides[2],
        ki.strides[0], ki.strides[1], ki.strides[2],
        vi.strides[0], vi.strides[1], vi.strides[2],
        ostrides[0], ostrides[1], ostrides[2],
        bt_sb, scores_ld,
        b, q_len, h, group,
        num_splits, block_size, capacity, pool,
        seq_fixed, block_mul(block_size) if block_size else 0,
        scale * k_mul, scale * k_mul * LOG2E,
        cap_u, inv_cap_u, alibi_ptr, alibi_sb,
        pad_ptr, left, right,
        sinks_ptr,
        *fp8_tail,
        # a packed q's fields (params.cuh, ATTNGEN_DECODE_VARLEN), then the snippets' aux tensors (ModArgs)
        *((cu_ptr, tree_ptr, total_q, order_ptr, min_q_len) if packed else ()),
        *(() if mods is None else pack_aux(rs.aux, mods[3], qi)),
    )
    call.layout = _PARAMS_VARLEN if packed else _PARAMS if mods is None else mod_layout(_PARAMS)
    call.grid, call.merge_grid = lc.grid, lc.merge_grid
    return call


def _packed_q(qi, cache_seqlens, cu_seqlens_q, max_q_len, tree_mask, batch_order, group: int, d: int, variant,
              mods, min_q_len: int = 1):
    """The checks of a packed, ragged q (``cu_seqlens_q``) against q ``[total_q, heads, head_dim]`` of ``qi``, the
    GQA group and ``min_q_len``; returns (batch, max_q_len, cu_seqlens_q's pointer, tree_mask's and batch_order's
    pointers or 0).
    What the packed kernels do not run is refused by name."""
    kind, dev = qi.kind, qi.device
    for name, bad, allowed in (("variant", variant == "unfused", "auto or fused"),
                               ("score_mod/mask_mod", mods is not None, "none"),
                               ("head_dim", d > 256, "at most 256")):
        if bad:
            value = {"variant": variant, "head_dim": d}.get(name, "given")
            raise LaunchError(f"{name}={value!r} with cu_seqlens_q is not supported; allowed with a packed q: "
                              f"{allowed}")
    cu = tensor_info(cu_seqlens_q, "cu_seqlens_q")
    if cu.kind != kind or cu.device != dev:
        raise LaunchError(f"cu_seqlens_q must be a {kind} tensor on device {dev}; got {cu.kind} on device {cu.device}")
    if cu.dtype != "int32":
        raise LaunchError(f"cu_seqlens_q has dtype {cu.dtype}; allowed: int32")
    if len(cu.shape) != 1 or cu.shape[0] < 1 or cu.strides[0] != 1:
        raise LaunchError(f"cu_seqlens_q has shape {cu.shape} and strides {cu.strides}; expected [batch + 1], "
                          "contiguous")
    b = cu.shape[0] - 1
    if cache_seqlens.__class__ is not int and not isinstance(cache_seqlens, bool):
        n = tensor_info(cache_seqlens, "cache_seqlens").shape
        if len(n) == 1 and n[0] + 1 != cu.shape[0]:
            raise LaunchError(f"cu_seqlens_q has {cu.shape[0]} entries; expected cache_seqlens.shape[0] + 1 = "
                              f"{n[0] + 1} (one a request, plus one)")
    most = min(MAX_VARLEN_Q_LEN, DecodeSpec.Q_ROWS[-1] // group)
    if max_q_len is None or max_q_len.__class__ is not int or not 1 <= max_q_len <= most:
        raise LaunchError(f"max_q_len={max_q_len!r} is not allowed with cu_seqlens_q and a GQA group of {group}; "
                          f"allowed: an int from 1 to {most} (min({MAX_VARLEN_Q_LEN}, 128 // group))")
    if min_q_len.__class__ is not int or not 1 <= min_q_len <= max_q_len:
        raise LaunchError(f"min_q_len={min_q_len!r} is not allowed with max_q_len={max_q_len}; allowed: an int from 1 "
                          f"to {max_q_len}")
    tree_ptr = 0
    if tree_mask is not None:
        t = tensor_info(tree_mask, "tree_mask")
        if t.kind != kind or t.device != dev:
            raise LaunchError(f"tree_mask must be a {kind} tensor on device {dev}; got {t.kind} on device {t.device}")
        if t.dtype not in ("int64", "torch.int64"):  # (torch's name as tensor_info gives it)
            raise LaunchError(f"tree_mask has dtype {t.dtype}; allowed: int64 (one 64-bit word a token)")
        if t.shape != (qi.shape[0],) or t.strides[0] != 1:
            raise LaunchError(f"tree_mask has shape {t.shape} and strides {t.strides}; expected [total_q] = "
                              f"({qi.shape[0]},), contiguous")
        tree_ptr = t.ptr
    order_ptr = 0
    if batch_order is not None:
        t = tensor_info(batch_order, "batch_order")
        if t.kind != kind or t.device != dev:
            raise LaunchError(f"batch_order must be a {kind} tensor on device {dev}; got {t.kind} on device {t.device}")
        if t.dtype != "int32" or t.shape != (b,) or t.strides[0] != 1:
            raise LaunchError(f"batch_order has dtype {t.dtype} and shape {t.shape}; expected int32 [batch] = ({b},), "
                              "contiguous")
        order_ptr = t.ptr
    return b, max_q_len, cu.ptr, tree_ptr, order_ptr
