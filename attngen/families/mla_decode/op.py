"""``attngen.mla_decode``: MLA decode (DeepSeek-V2/V3's absorbed form) against one shared compressed
cache, contiguous or paged, split-KV with an LSE merge, CUDA-graph safe (no host sync)."""

from __future__ import annotations

import struct
from collections.abc import Mapping

from ... import runtime as _rt
from ...errors import LaunchError
from ...runtime import data_ptr, get_kernel, tensor_info
from ...spec import Mma, Pipeline, op_spec
from ..host import LOG2E, OpMemo, Plan
from ..score_mods import checked_scale
from ..split_kv import cache_lengths, check_rows, checked_splits, paged_table
from ..tma import tiled_map
from . import choose as _choose
from . import fp8 as _fp8
from .spec import MlaDecodeSpec

# MlaParams in templates/mla_decode/params.cuh: 10 pointers, 14 strides, 9 ints, 2 floats, 1 int; a
# pipeline=tma kernel takes MlaTmaParams: the ckv and kpe tensor maps first.
_PARAMS = struct.Struct("<10Q14q9i2fi")
_PARAMS_TMA = struct.Struct("<256s10Q14q9i2fi")
# An fp8 cache's kernel takes MlaFp8Params (mla_decode/fp8.cuh): MlaParams, then k_scale's pointer and number; on the
# wgmma kernel (TMA) MlaFp8TmaParams: the maps of the fp8 ckv and kpe first.
_PARAMS_FP8 = struct.Struct("<10Q14q9i2fiQf4x")
_PARAMS_FP8_TMA = struct.Struct("<256s10Q14q9i2fiQf4x")
MAX_Q_LEN = 4
MAX_HEADS = 128
# Paged blocks: at most this many positions, the sizes its tests cover (decode and prefill take more).
MAX_BLOCK = 256
# The choice of kernel and launch (and the constants of its rules) lives in choose.py.


def _make_plan(key: tuple) -> Plan:
    """The plan of (dtype, device, array kind): the device's facts, allocators and the stream getter. The
    kernel is chosen per call (its rules read the call's sizes)."""
    dtype, device, kind = key
    plan = Plan()
    plan.setup(None, device, kind, dtype)
    return plan


_memo = OpMemo(_make_plan)


def _tensor_maps(cv, pe, spec: MlaDecodeSpec, block_size: int, fallback_ptr: int) -> bytes:
    """The TMA kernel's maps of ckv and kpe: 3-d (columns, positions or paged slots, cache rows or
    blocks), boxes of 64 columns (kpe's zero-filled past rope_dim) and of the rows the kernel issues
    at once: the whole tile, or paged the largest power of two dividing the block size. An fp8 cache's (bytes,
    unswizzled): boxes of at most 32 rows (mla_decode/fp8_wgmma.cuh lands them by runs of 32 keys)."""
    most = 32 if spec.fp8 else spec.cta_tile_kv
    rows = min(most, block_size & -block_size) if block_size else most
    width = 1 if spec.fp8 else 2

    def one(t, name):
        return tiled_map(t.dtype, t.ptr or fallback_ptr, (t.shape[2], max(t.shape[1], 1), max(t.shape[0], 1)),
                         (width * t.strides[1], width * t.strides[0]), (64, rows, 1),
                         lambda e: f"pipeline=tma: no TMA tensor map for {name} of shape {t.shape} with strides "
                                   f"{t.strides}: {e}; use a spec with pipeline=sync")
    return one(cv, "ckv_cache") + one(pe, "kpe_cache")


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, *, cache_seqlens, sm_scale: float, block_table=None,
               num_splits: int = 0, return_lse: bool = False, out=None,
               spec: MlaDecodeSpec | str | Mapping | None = None, score_mod: str = "", mask_mod: str = "", aux=None,
               k_scale=None):
    """MLA decode: q_len new tokens per sequence, every head against one shared compressed cache.

    q_nope ``[batch, q_len, heads, kv_lora_rank]`` and q_pe ``[batch, q_len, heads, rope_dim]``
    (q_len 1..4, heads 1..128; 512/64 and 256/32 supported). Contiguous cache: ckv_cache
    ``[batch, max_seqlen, kv_lora_rank]`` and kpe_cache ``[batch, max_seqlen, rope_dim]``. Paged
    (``block_table`` int32 ``[batch, max_blocks]``): ``[num_blocks, block_size, ...]`` with key j of
    row b at block ``block_table[b, j // block_size]``, slot ``j % block_size`` (block sizes 1 to 256;
    those that are not a multiple of 16, such as SGLang's 1, run the cp.async kernels that look up every key row's
    block, spec ``page_rows``). ``cache_seqlens`` (int32 ``[batch]`` or an int) is each row's
    length including the new tokens, whose entries are already in the cache: token i sits at
    position L - q_len + i and sees keys 0..L - q_len + i. Lengths past the capacity are clamped
    to it; out-of-range blocks are clamped to the pool on the device.

    Scores are ``(q_nope . ckv + q_pe . kpe) * sm_scale``; the output ``[batch, q_len, heads, kv_lora_rank]`` (q's
    dtype and kind) is their softmax times ckv. ``num_splits`` 0 chooses the split-KV count, a positive number
    forces it. ``spec`` (a spec, its text or a dict of its fields) pins tuning fields (``qk_shard``,
    ``cta_tile_kv``, ``num_warps``, ``num_stages``, ``mma``, ``pipeline``).

    Some choices depend on whether the GPU has *fast memory*: memory whose peak bandwidth takes 60% or more
    of the SMs streaming to reach (an H200, about 70%; not an H100, about 49%). Left at ``auto``,
    ``qk_shard`` becomes ``alternate`` on sm_90a where each CTA gets at least 32 tiles of 64 keys and the
    packed query rows (heads x q_len) fill two 64-row blocks or more, or one such block on fast memory with
    a batch of 64 or more; on fast memory, with two blocks or more and the keys not split, from 8 tiles of
    64 keys on. A call with 32 packed query rows (32 heads, or 16 heads x 2 tokens), a contiguous
    cache (or paged blocks of a multiple of 64) and no pinned tuning field runs them as one 64-row block of
    sm_90a's wgmma kernel on fast memory. With ``return_lse`` also the fp32 LSE ``[batch, heads, q_len]``;
    a token that sees no key gives zeros and LSE -inf.

    An fp8 cache: ckv_cache and kpe_cache as ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (or uint8 bytes
    with a ``spec`` whose ``kv_dtype`` names the format), both of one format, with ``k_scale`` the one
    dequantisation scale of both (the cache holds values / k_scale): a number, or an fp32 device tensor of shape
    [] or [1]; q stays fp16 or bf16 and the output is q's dtype. 64 packed query rows and more (64 or 128 heads) on
    sm_90a run the wgmma kernel, whose producer warpgroup widens each tile into fp16 in shared memory (its TMA ring
    needs the caches as TMA maps: where the driver refuses them, the mma.sync kernel runs); every other call runs the
    mma.sync kernel on the cp.async ring, which widens the cache to fp16 in registers; no cluster merge. Both run
    their MMAs in fp16, a bf16 q carried into fp16 by a power of two.

    ``score_mod``, ``mask_mod`` and ``aux`` (attngen.prefill's and attngen.decode's user variants) are refused here:
    the MLA kernels have no snippet site.
    """
    for name, value in (("score_mod", score_mod), ("mask_mod", mask_mod), ("aux", aux)):
        if value:
            raise LaunchError(f"attngen.mla_decode({name}=...) is not supported: the MLA kernels run no score_mod or "
                              "mask_mod; allowed: '' / None (attngen.decode and attngen.prefill take them)")
    if _rt.tracing is not None and _rt.tracing():
        if k_scale is not None:
            raise LaunchError("attngen.mla_decode(k_scale=...) (an fp8 cache) is not supported under torch.compile "
                              "(its custom op takes no scale); call it outside the compiled region")
        return _rt.traced_ops["mla_decode"](
            q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens=cache_seqlens, sm_scale=sm_scale,
            block_table=block_table, num_splits=num_splits, return_lse=return_lse, out=out, spec=spec)
    if spec is not None and spec.__class__ is not MlaDecodeSpec:
        spec = op_spec(spec, "mla_decode", "attngen.mla_decode")
    qn = tensor_info(q_nope, "q_nope")
    qp = tensor_info(q_pe, "q_pe")
    cv = tensor_info(ckv_cache, "ckv_cache")
    pe = tensor_info(kpe_cache, "kpe_cache")
    check_rows(qn, "q_nope", 4, "[batch, q_len, heads, kv_lora_rank]")
    check_rows(qp, "q_pe", 4, "[batch, q_len, heads, rope_dim]")
    cache_dims = "[batch, max_seqlen, dim] or, paged, [num_blocks, block_size, dim]"
    check_rows(cv, "ckv_cache", 3, cache_dims)
    check_rows(pe, "kpe_cache", 3, cache_dims)
    infos = (qn, qp, cv, pe)
    if len({t.kind for t in infos}) != 1 or len({t.device for t in infos}) != 1:
        raise LaunchError("q_nope, q_pe, ckv_cache, kpe_cache must be of one kind on one device; got "
                          + ", ".join(f"{t.kind}:{t.device}" for t in infos))
    if qn.dtype not in ("fp16", "bf16"):
        raise LaunchError(f"q_nope has dtype {qn.dtype}; allowed: fp16, bf16")
    if qp.dtype != qn.dtype:
        raise LaunchError(f"q_nope and q_pe must share a dtype; got {qn.dtype}, {qp.dtype}")
    kv = None
    if cv.dtype != qn.dtype or pe.dtype != qn.dtype or (spec is not None and spec.kv_dtype is not None):
        kv = _fp8.cache_format(qn, cv, pe, None if spec is None else spec.kv_dtype)
    if kv is not None:
        _fp8.check_rows(cv, "ckv_cache")
        _fp8.check_rows(pe, "kpe_cache")
    b, q_len, h, rank = qn.shape
    rope = qp.shape[3]
    if qp.shape[:3] != (b, q_len, h):
        raise LaunchError(f"q_pe has shape {qp.shape}; its first three dims must match q_nope's {qn.shape[:3]}")
    if rank not in MlaDecodeSpec.KV_LORA_RANKS:
        raise LaunchError(f"kv_lora_rank={rank} (q_nope.shape[3]) is not supported; allowed: "
                          f"{', '.join(map(str, MlaDecodeSpec.KV_LORA_RANKS))}")
    if rope not in MlaDecodeSpec.ROPE_DIMS:
        raise LaunchError(f"rope_dim={rope} (q_pe.shape[3]) is not supported; allowed: "
                          f"{', '.join(map(str, MlaDecodeSpec.ROPE_DIMS))}")
    if cv.shape[2] != rank or pe.shape[2] != rope or cv.shape[:2] != pe.shape[:2]:
        raise LaunchError(f"ckv_cache {cv.shape} and kpe_cache {pe.shape} must be [..., {rank}] and [..., {rope}] "
                          f"with the same first two dims")
    if not 1 <= q_len <= MAX_Q_LEN:
        raise LaunchError(f"q_len={q_len} (q_nope.shape[1]) is not supported; allowed: 1 to {MAX_Q_LEN}")
    if not 1 <= h <= MAX_HEADS:
        raise LaunchError(f"heads={h} (q_nope.shape[2]) is not supported; allowed: 1 to {MAX_HEADS}")
    checked_splits(num_splits)
    scale = checked_scale(sm_scale)
    kind, dev = qn.kind, qn.device
    k_ptr, k_num = _fp8.scale_args(k_scale, kv, kind, dev)

    pool, cache_len = cv.shape[0], cv.shape[1]
    paged = block_table is not None
    if paged:
        block_size = cache_len
        capacity, bt_ptr, bt_sb = paged_table(block_table, b, block_size, kind, dev, "q_nope", "ckv_cache",
                                               MAX_BLOCK, multiple=1)
    else:
        if pool < b:
            raise LaunchError(f"ckv_cache has {pool} cache rows for batch {b}")
        block_size, capacity, bt_ptr, bt_sb = 0, cache_len, 0, 0
    seq_ptr, seq_fixed = cache_lengths(cache_seqlens, b, kind, dev, "q_nope")

    plan = _memo.plan((qn.dtype, dev, kind))
    shape = (b, q_len, h, rank)
    if out is None:
        out = plan.alloc(*shape)
    oi = tensor_info(out, "out")
    if oi.kind != kind or oi.shape != shape or oi.dtype != qn.dtype or oi.device != dev:
        raise LaunchError(f"out must be {kind} {shape} {qn.dtype} on device {dev}; got "
                          f"{oi.kind} {oi.shape} {oi.dtype} on device {oi.device}")
    check_rows(oi, "out", 4, "[batch, q_len, heads, kv_lora_rank]")
    lse = plan.alloc_f32(b, h, q_len) if return_lse else None
    if b == 0:
        return (out, lse) if return_lse else out
    if b > 65535:
        raise LaunchError(f"batch={b} exceeds 65535 (the grid's z limit)")

    # Blocks that are not a multiple of 16 positions: the kernels that look up every key row (spec page_rows).
    problem = _choose.Problem(rank, rope, qn.dtype, q_len, h, b, capacity, paged, block_size, spec, num_splits,
                              kv_dtype=kv, page_rows=paged and block_size % 16 != 0)
    facts = plan.facts
    choice = _choose.choose(problem, facts)
    rs = choice.spec
    maps = None
    if rs.tma and not rs.page_rows:  # (page_rows gathers its tiles into the TMA ring by cp.async: no maps)
        try:
            maps = _tensor_maps(cv, pe, rs, block_size, qn.ptr)
        except LaunchError:
            if spec is not None and (spec.pipeline is Pipeline.TMA or (rs.fp8 and spec.mma is Mma.WGMMA)):
                raise
            choice = _choose.choose(_choose.refused(problem), facts)  # the cp.async form of the same tiles
            rs = choice.spec
    kern = get_kernel(rs, device=dev)
    lc = choice.launch
    num_splits, cluster = lc.num_splits, lc.cluster
    part_ptr = lse_part_ptr = 0
    if lc.merge_grid is not None:
        n_out = num_splits * b * q_len * h
        work = plan.alloc_f32(n_out * rank + n_out)
        part_ptr = data_ptr(work, kind)
        lse_part_ptr = part_ptr + 4 * n_out * rank

    values = (
        qn.ptr, qp.ptr, cv.ptr, pe.ptr, oi.ptr, data_ptr(lse, kind) if lse is not None else 0,
        seq_ptr, bt_ptr, part_ptr, lse_part_ptr,
        qn.strides[0], qn.strides[1], qn.strides[2],
        qp.strides[0], qp.strides[1], qp.strides[2],
        cv.strides[0], cv.strides[1], pe.strides[0], pe.strides[1],
        oi.strides[0], oi.strides[1], oi.strides[2],
        bt_sb,
        b, q_len, h, num_splits,
        block_size, capacity, pool,
        seq_fixed, (block_size.bit_length() - 1) if block_size and not block_size & (block_size - 1) else -1,
        scale, scale * LOG2E, int(lc.evict_first),
    )
    stream = plan.stream(dev)
    if rs.fp8 and maps is not None:
        kern.launch_struct(_PARAMS_FP8_TMA, lc.grid(b), stream, maps, *values, k_ptr, k_num, cluster_x=cluster)
    elif rs.fp8:
        kern.launch_struct(_PARAMS_FP8, lc.grid(b), stream, *values, k_ptr, k_num, cluster_x=cluster)
    elif maps is None:
        kern.launch_struct(_PARAMS, lc.grid(b), stream, *values, cluster_x=cluster)
    else:
        kern.launch_struct(_PARAMS_TMA, lc.grid(b), stream, maps, *values, cluster_x=cluster)
    if lc.merge_grid is not None:
        kern.launch_struct(_PARAMS, lc.merge_grid, stream, *values, entry=lc.merge_entry)
    return (out, lse) if return_lse else out
