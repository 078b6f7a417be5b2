"""``attngen.decode``: attention of a few new tokens against a KV cache (FlashAttention's
``flash_attn_with_kvcache`` conventions), contiguous or paged, GQA-packed, split-KV."""

from __future__ import annotations

import functools
import math
import os
import struct

from ... import runtime as _rt
from ...errors import LaunchError
from ...runtime import (TunedKernels, allocator, current_stream, data_ptr, keep_call, register_dependent_cache,
                         tensor_info, torch_stream_getter)
from ...spec import DType, spec_of_text
from ..score_mods import NO_EXTRAS, checked_scale, extras
from ..split_kv import (CLUSTER_MAX, cache_lengths, check_index, check_rows, checked_splits, choose_splits,
                        ctas_per_sm, paged_table, saturating_share, sm_count)
from .spec import MERGE_THREADS, DecodeSpec, Variant

# DecodeParams in templates/decode/fwd.cuh: 12 pointers, 14 strides, 9 ints, an unsigned
# (block_mul), 2 floats, 2 floats (softcap), the ALiBi slopes' pointer and batch stride.
_PARAMS = struct.Struct("<12Q14q9iI2f2fQq")
_LOG2E = 1.4426950408889634
MAX_Q_LEN = 8
MAX_GROUP = 16
VARIANTS = ("auto", "fused", "unfused")
_CACHE_DIMS = "[cache_batch, max_seqlen, kv_heads, head_dim] or, paged, [num_blocks, block_size, kv_heads, head_dim]"


@functools.lru_cache(maxsize=None)
def _spec_for(head_dim: int, dtype: str, q_rows: int, paged: bool, variant: str, user: DecodeSpec | None,
              softcap: bool = False, alibi: bool = False):
    fields = dict(head_dim=head_dim, dtype=DType(dtype), q_rows=q_rows, paged=paged, variant=Variant(variant),
                  softcap=softcap, alibi=alibi)
    return DecodeSpec(**fields) if user is None else user.replace(**fields)


class _Plan(TunedKernels):
    """What a call needs that depends only on its plan key (head_dim, dtype, device, q_rows, paged,
    variant, the user's spec, array kind, softcap, alibi): the kernel, or the winners ``attngen tune
    decode`` stored for this GPU by cache capacity (``kernel_for``), allocators, the stream getter
    and the SM count. Made once per key, so a call does its checks, one lookup, the allocations
    and the launches."""

    __slots__ = ("alloc", "alloc_f32", "stream", "sms")


_plans: dict[tuple, _Plan] = register_dependent_cache({})


def _make_plan(key: tuple) -> _Plan:
    d, dtype, device, q_rows, paged, variant, spec, kind, softcap, alibi = key
    base = _spec_for(d, dtype, q_rows, paged, variant, spec, softcap, alibi)
    plan = _Plan()
    plan.choose(base, device, use_tuned=spec is None)  # winners by cache capacity, if stored
    plan.alloc = allocator(kind, dtype, device)
    plan.alloc_f32 = allocator(kind, "fp32", device)
    plan.stream = torch_stream_getter() if kind == "torch" else functools.partial(current_stream, "cupy")
    plan.sms = sm_count(device)
    _plans[key] = plan
    return plan


def _check_operands(qi, ki, vi) -> None:
    """Ranks, contiguous last dims and 16-byte alignment of q and the caches (``check_rows``'s
    rules): one arithmetic test for the common case, the named checks for the message."""
    for t in (qi, ki, vi):
        st = t.strides
        if len(st) != 4 or st[3] != 1 or (t.ptr & 15) | ((st[0] | st[1] | st[2]) & 7):
            check_rows(qi, "q", 4, "[batch, q_len, heads, head_dim]")
            check_rows(ki, "k_cache", 4, _CACHE_DIMS)
            check_rows(vi, "v_cache", 4, _CACHE_DIMS)


def decode(q, k_cache, v_cache, *, cache_seqlens, cache_batch_idx=None, block_table=None, num_splits: int = 0,
           sm_scale: float | None = None, return_lse: bool = False, out=None, variant: str = "auto",
           spec: DecodeSpec | None = None, softcap: float = 0.0, alibi_slopes=None):
    """Attention of q_len new tokens per sequence against a KV cache.

    q ``[batch, q_len, heads, head_dim]`` (q_len 1..8). Contiguous cache: k_cache, v_cache
    ``[cache_batch, max_seqlen, kv_heads, head_dim]``, batch row b reading cache row
    ``cache_batch_idx[b]`` (int32; default b). Paged cache (``block_table`` int32
    ``[batch, max_blocks]``): k_cache, v_cache ``[num_blocks, block_size, kv_heads, head_dim]``,
    key j of row b at ``k_cache[block_table[b, j // block_size], j % block_size]``.
    ``cache_seqlens`` (int32 ``[batch]`` or an int) is each row's length including the new
    tokens, whose K/V are already in the cache: token i sits at position L - q_len + i and sees
    keys 0..L - q_len + i. Lengths past the cache's capacity are clamped to it; out-of-range
    cache rows or blocks are clamped to the pool (they are read on the device, never checked on
    the host). ``num_splits`` 0 chooses the split-KV count, a positive number forces it.
    ``variant``: "auto", "fused" or "unfused". ``spec`` (a spec or its text) overrides the tuning fields; without it, a
    configuration ``attngen tune decode`` stored for this GPU (nearest tuned cache capacity) is
    used where there is one, else the arch's default. Returns ``out`` (q's dtype and kind), with
    ``return_lse`` also the fp32 LSE ``[batch, heads, q_len]``; a token that sees no key gives
    zeros and LSE -inf. ``softcap`` and ``alibi_slopes`` (fp32 ``[heads]`` or ``[batch, heads]``)
    act as in ``attngen.prefill``.
    """
    if _rt.tracing is not None and _rt.tracing():
        return _rt.traced_ops["decode"](
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
            block_table=block_table, num_splits=num_splits, sm_scale=sm_scale, return_lse=return_lse, out=out,
            variant=variant, spec=spec, softcap=softcap, alibi_slopes=alibi_slopes)
    qi = tensor_info(q, "q")
    ki = tensor_info(k_cache, "k_cache")
    vi = tensor_info(v_cache, "v_cache")
    # The call's key: the operands' infos and every other argument as a value. Scalars of other
    # classes (a bool, a 0-dim tensor whose value may change) are never remembered; arguments that
    # are no array, or unhashable, go to the checks, which say what is wrong.
    try:
        key = (qi, ki, vi,
               cache_seqlens if cache_seqlens.__class__ is int else tensor_info(cache_seqlens, "cache_seqlens"),
               None if cache_batch_idx is None else tensor_info(cache_batch_idx, "cache_batch_idx"),
               None if block_table is None else tensor_info(block_table, "block_table"),
               None if alibi_slopes is None else tensor_info(alibi_slopes, "alibi_slopes"),
               None if out is None else tensor_info(out, "out"),
               num_splits, sm_scale, softcap, return_lse, variant, spec)
        call = _calls.get(key)
    except (LaunchError, TypeError):
        key = call = None
    if call is None:
        call = _prepare(qi, ki, vi, cache_seqlens, cache_batch_idx, block_table, num_splits, sm_scale, return_lse,
                        out, variant, spec, softcap, alibi_slopes)
        keep_call(_calls, key, call, flags=(return_lse,), numbers=(num_splits, sm_scale, softcap))
    plan, kind = call.plan, qi.kind
    if out is None:
        out = plan.alloc(*call.out_shape)
        optr = data_ptr(out, kind)
    else:
        optr = call.out_ptr
    lse = plan.alloc_f32(*call.lse_shape) if return_lse else None
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
    values = (qi.ptr, ki.ptr, vi.ptr, optr, 0 if lse is None else data_ptr(lse, kind), *call.indices,
              w0, w1, w2, w3, *call.tail)
    kern, grid = call.kern, call.grid
    stream = plan.stream(qi.device)
    kern.launch_struct(_PARAMS, grid, stream, *values, cluster_x=call.cluster)  # a cluster: no _pv, no merge
    if call.unfused:
        kern.launch_struct(_PARAMS, grid, stream, *values, entry="_pv")
    if call.merge_grid is not None:
        kern.launch_struct(_PARAMS, call.merge_grid, stream, *values, entry="_merge")
    return (out, lse) if return_lse else out


class _Call:
    """What a decode call with a given key launches, worked out once: its plan and kernel, the
    shapes it allocates (or the caller's ``out``), the workspace's size and the offsets of its
    pieces (bytes; -1 where a piece is not used), the parameters that are not pointers of this
    call's own allocations, the grids and the cluster size (0: none)."""

    __slots__ = ("plan", "kern", "cluster", "out_shape", "out_ptr", "lse_shape", "work", "offsets", "indices",
                 "tail", "grid", "merge_grid", "unfused")


_calls: dict[tuple, _Call] = register_dependent_cache({})  # key -> _Call (runtime.keep_call)
# The merge launch in a CUDA graph, in the tile steps of choose_splits (a step: every resident CTA reading one K and V
# tile): about three (choose_splits counts one).
MERGE_LAUNCH_STEPS = 3.0


def grid_steps(ctas: int, tiles: int, splits: int, slots: int, share: float) -> float:
    """Tile steps of a grid of ``ctas`` x ``splits`` CTAs over ``tiles`` tiles a row, with ``slots``
    resident at once: its waves of ceil(tiles / splits) steps, or, where more CTAs read at once than
    the memory serves at full rate (``share``, split_kv.saturating_share, of the SMs), the tiles over
    that many; plus 2 for the ring's fill."""
    waves = -(-ctas * splits // slots)
    return max(waves * -(-tiles // splits), ctas * tiles / (share * slots)) + 2


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
    """The most splits of a row that a grid of ``ctas`` (batch x KV heads) CTAs of ``kern`` merges in
    one cluster of them; 0 where it merges through the workspace and a merge launch. Clusters need
    sm_90 (``Kernel.max_clusters``), the fused kernel, room for the output rows in its shared memory,
    one CTA an SM with a ring of 4 stages or more, and are taken where their CTAs reach a third of the
    SMs or more (a paged cache: 90%). Measured on an H100 (b=1, 32k keys) against the merge launch:
    1.00-1.04x faster with 64 CTAs of head_dim 128, 4 stages (8 KV heads, 8 splits against 33); 1.6x
    slower with 32 CTAs (4 KV heads); 1.4x slower with head_dim 256's 2- and 3-stage rings (137 against
    99 us), whose CTAs read too slowly for half the SMs to keep up. Paged (blocks of 64, head_dim 128):
    64 CTAs at b=1 with 8 KV heads 1.02-1.09x slower from 4k keys (58.2 against 53.4 us at 32k), 128
    at b=16 with 4 KV heads 1.03-1.06x faster. Where the call's split count is automatic, a cluster is
    also weighed against the merge launch's uncapped count (``grid_steps``).

    Every one of the ``ctas`` clusters must be resident at once (``Kernel.max_clusters``, which counts
    the SMs of each GPC: 30 clusters of 4 and 15 of 8 on an H100, not 33 and 16): a cluster size with
    fewer runs the last clusters as a second wave, 1.3-1.45x slower than the merge launch (b=4-8 with
    4-8 KV heads), so the size is the largest whose clusters all fit."""
    rs = kern.spec
    if (rs.variant is Variant.UNFUSED or rs.num_stages < 4
            or rs.cluster_merge_bytes() > rs.smem_bytes() or ctas_per_sm(kern) != 1):
        return 0
    cmax = _cluster_merge[0]
    while cmax > 1 and kern.max_clusters(cmax) < ctas:
        cmax -= 1
    # A paged CTA reads more slowly (its table lookups): a paged grid clusters only where its clusters fill 90% of
    # the SMs or more.
    need = 0.9 if rs.paged else 1 / 3
    return cmax if cmax > 1 and ctas * cmax >= need * sm_count(kern.device) else 0


def _prepare(qi, ki, vi, cache_seqlens, cache_batch_idx, block_table, num_splits, sm_scale, return_lse, out, variant,
             spec, softcap, alibi_slopes) -> _Call:
    """Check a call's arguments and work out its ``_Call``."""
    if spec.__class__ is str:
        spec = spec_of_text(spec, "decode")
    _check_operands(qi, ki, vi)
    if not (qi.kind == ki.kind == vi.kind and qi.device == ki.device == vi.device):
        raise LaunchError(f"q, k_cache, v_cache must be of one kind on one device; got {qi.kind}:{qi.device}, "
                          f"{ki.kind}:{ki.device}, {vi.kind}:{vi.device}")
    dtype = qi.dtype
    if dtype != "bf16" and dtype != "fp16":
        raise LaunchError(f"q has dtype {dtype}; allowed: fp16, bf16")
    if ki.dtype != dtype or vi.dtype != dtype:
        raise LaunchError(f"q, k_cache, v_cache must share a dtype; got {dtype}, {ki.dtype}, {vi.dtype}")
    if ki.shape != vi.shape:
        raise LaunchError(f"k_cache {ki.shape} and v_cache {vi.shape} must have the same shape")
    b, q_len, h, d = qi.shape
    pool, cache_len, hk, dk = ki.shape
    if not 1 <= q_len <= MAX_Q_LEN:
        raise LaunchError(f"q_len={q_len} (q.shape[1]) is not supported; allowed: 1 to {MAX_Q_LEN}")
    if d not in DecodeSpec.HEAD_DIMS:
        raise LaunchError(f"head_dim={d} is not supported; allowed: {', '.join(map(str, DecodeSpec.HEAD_DIMS))}")
    if dk != d:
        raise LaunchError(f"head_dim mismatch: q has {d}, k_cache/v_cache have {dk}")
    if hk == 0 or h % hk:
        raise LaunchError(f"heads={h} must be a multiple of kv_heads={hk} (GQA/MQA)")
    group = h // hk
    if group > MAX_GROUP:
        raise LaunchError(f"heads/kv_heads = {group} is not supported; allowed: a GQA group of 1 to {MAX_GROUP}")
    if variant not in VARIANTS:
        raise LaunchError(f"variant={variant!r} is not allowed; allowed: {', '.join(VARIANTS)}")
    if num_splits.__class__ is not int or num_splits:
        checked_splits(num_splits)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else checked_scale(sm_scale)

    kind, dev = qi.kind, qi.device
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise LaunchError("cache_batch_idx cannot be combined with block_table (a paged cache names its "
                              "blocks per row already)")
        block_size = cache_len
        capacity, bt_ptr, bt_sb = paged_table(block_table, b, block_size, kind, dev, "q", "k_cache")
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
    cap_u, inv_cap_u, alibi_ptr, alibi_sb = (extras(softcap, alibi_slopes, b, h, qi, sm_scale)
                                             if softcap or alibi_slopes is not None else NO_EXTRAS)
    pkey = (d, dtype, dev, DecodeSpec.rows_for(group, q_len), paged, "fused" if variant == "auto" else variant,
            spec, kind, bool(softcap), alibi_ptr != 0)
    call = _Call()
    call.plan = plan = _plans.get(pkey) or _make_plan(pkey)
    call.out_shape, call.lse_shape = (b, q_len, h, d), (b, h, q_len)
    if out is None:
        ostrides = (q_len * h * d, h * d, d)
    else:
        oi = tensor_info(out, "out")
        if oi.kind != kind or oi.shape != qi.shape or oi.dtype != dtype or oi.device != dev:
            raise LaunchError(f"out must match q: {kind} {qi.shape} {dtype} on device {dev}; got "
                              f"{oi.kind} {oi.shape} {oi.dtype} on device {oi.device}")
        check_rows(oi, "out", 4, "[batch, q_len, heads, head_dim]")
        ostrides, call.out_ptr = oi.strides, oi.ptr
    call.grid = None
    if b == 0:
        return call
    if b > 65535:
        raise LaunchError(f"batch={b} exceeds 65535 (the grid's z limit)")

    call.kern = kern = plan.kernel or plan.kernel_for(capacity)
    rs = kern.spec
    call.unfused = unfused = rs.variant is Variant.UNFUSED
    # The fused kernel on sm_90 merges the splits of a row in a cluster of them (cluster_limit), where
    # its epilogue's shared memory holds the output rows: no workspace and no merge launch.
    per_sm = ctas_per_sm(kern)
    cmax = cluster_limit(kern, b * hk)
    if num_splits == 0:
        num_splits = choose_splits(b * hk, capacity, rs.cta_tile_kv, plan.sms, per_sm, 4 * rs.cta_tile_kv * d,
                                   4 * b * q_len * h * d)
        if num_splits > 1 and cmax:
            # A cluster caps the split count. It is taken where its fewer CTAs read about as fast as the merge
            # launch's more, counting what the launch costs (grid_steps); a long cache at batch 1 needs the SMs a
            # cluster leaves idle (H200: 1.3x slower at 32k keys with 8 KV heads).
            capped = choose_splits(b * hk, capacity, rs.cta_tile_kv, plan.sms, per_sm, 4 * rs.cta_tile_kv * d, 0,
                                   max_splits=cmax)
            tiles, slots, share = -(-capacity // rs.cta_tile_kv), plan.sms * per_sm, saturating_share(qi.device)
            if (grid_steps(b * hk, tiles, capped, slots, share)
                    <= grid_steps(b * hk, tiles, num_splits, slots, share) + MERGE_LAUNCH_STEPS):
                num_splits = capped
            else:
                cmax = 0
    call.cluster = num_splits if 1 < num_splits <= cmax else 0
    merged = num_splits > 1 and not call.cluster  # by the merge launch
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
    call.tail = (
        qi.strides[0], qi.strides[1], qi.strides[2],
        ki.strides[0], ki.strides[1], ki.strides[2],
        vi.strides[0], vi.strides[1], vi.strides[2],
        ostrides[0], ostrides[1], ostrides[2],
        bt_sb, scores_ld,
        b, q_len, h, group,
        num_splits, block_size, capacity, pool,
        seq_fixed, -(-(1 << (31 + (block_size - 1).bit_length())) // block_size) if block_size else 0,
        scale, scale * _LOG2E,
        cap_u, inv_cap_u, alibi_ptr, alibi_sb,
    )
    call.grid = (num_splits, hk, b)
    call.merge_grid = (-(-b * q_len * h // (MERGE_THREADS // 32)), 1, 1) if merged else None
    return call
