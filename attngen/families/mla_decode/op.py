"""``attngen.mla_decode``: MLA decode (DeepSeek-V2/V3's absorbed form) against one shared compressed
cache, contiguous or paged, split-KV with an LSE merge, CUDA-graph safe (no host sync)."""

from __future__ import annotations

import functools
import struct

from ... import runtime as _rt
from ...errors import LaunchError
from ...runtime import current_stream, data_ptr, empty_like_kind, get_kernel, tensor_info
from ...spec import DType, Pipeline, replaced_if_valid, spec_of_text
from ..score_mods import checked_scale
from ..split_kv import (CLUSTER_MAX, cache_lengths, check_rows, checked_splits, choose_splits, ctas_per_sm,
                        paged_table, saturating_share, sm_count)
from ..tma import tiled_map
from .spec import MERGE_COLS, MERGE_THREADS, MlaDecodeSpec, QkShard

# MlaParams in templates/mla_decode/params.cuh: 10 pointers, 14 strides, 9 ints, 2 floats, 1 int; a
# pipeline=tma kernel takes MlaTmaParams: the ckv and kpe tensor maps first.
_PARAMS = struct.Struct("<10Q14q9i2fi")
_PARAMS_TMA = struct.Struct("<256s10Q14q9i2fi")
_LOG2E = 1.4426950408889634
MAX_Q_LEN = 4
MAX_HEADS = 128
# qk_shard=auto on sm_90a: alternate tiles where a sequence's rows fill two 64-row blocks or more (128 heads)
# and each CTA gets at least this many 64-key tiles; the sharded form elsewhere. On the lent H100
# (BENCHMARKS.md, 2026-11-24) alternate tiles ran 1.07-1.30x the sharded form at 128 heads, batch 64-768 with
# 8k+ tokens, and 1.08x at batch 8 with 32k tokens (64 tiles a CTA), but 0.92-0.96x with 8-16 tiles a CTA
# (batch 1-8, 8k-32k tokens), and 0.90-1.01x at 64 heads.
ALTERNATE_MIN_TILES = 32
# The three rules below take effect only on a device whose memory needs FAST_MEMORY_SHARE of its SMs or more to reach
# its bandwidth (split_kv.saturating_share: about 0.70 on an H200, 0.49 on an H100). There the default kernels cannot
# keep up with the memory; on the H100 each rule's kernel read 0.87-1.06x the default (BENCHMARKS.md, 2026-11-26).
FAST_MEMORY_SHARE = 0.6
# One 64-row block (64 heads) takes alternate tiles too on fast memory (FAST_MEMORY_SHARE) and where the batch fills
# ALTERNATE_ONE_BLOCK_MIN_BATCH row blocks. On an H200 (2026-11-26, best of three rounds) at 64 heads: 1.01-1.15x the
# sharded form at batch 64-768 with 8k-32k keys, paged (blocks of 64) 1.09-1.26x; at batch 8 0.84-1.00x.
ALTERNATE_ONE_BLOCK_MIN_BATCH = 64
# 16 rows on the TMA ring, 64-key tiles, a contiguous cache or paged blocks of whole tiles (measured: blocks of 64):
# one stage on four warps where the grid holds at least ONE_STAGE_MIN_TILES tiles an SM and the device's memory needs
# FAST_MEMORY_SHARE of its SMs or more to reach its bandwidth. One stage leaves room for two CTAs an SM, whose loads
# and math then overlap each other's. BENCHMARKS.md, 2026-11-26: on an H200 (0.7) 1.05-1.19x the two-stage default
# from 31 tiles an SM, 0.86-0.90x at 4-8; on an H100 (0.49) 0.98-1.01x. Paged (blocks of 64, H200, the same day):
# 1.08-1.20x at batch 8-768 with 8k-32k keys.
ONE_STAGE_MIN_TILES = 16
# The most splits of a row block merged in a cluster on sm_90 (0 or 1: every split count through the
# workspace and a merge launch), and the share of the SMs the row blocks must fill for a cluster (batch
# 64 at 16 heads on 132 SMs; batch 32 was not measured).
MERGE_CLUSTER_MAX = CLUSTER_MAX
CLUSTER_MIN_FILL = 0.4
# The merge takes its wide entry (MERGE_WIDE_WARPS warps a chunk of a row) from this many splits, four
# groups of the partial rows a warp of the narrow entry loads at once, where the GPU holds the wide grid
# at once (H200, 2026-11-26: 1.15-1.20x a batch-1 step at 16 heads with 64 and 128 splits; with its grid
# three waves deep, 0.86-0.87x at 16 heads x 8 rows and at 128 heads x 1 row).
MERGE_WIDE_SPLITS = 32
# The TMA kernels load ckv and kpe as first out of L2 (kv_evict_first) from this many splits. H100, 2026-11-26
# (BENCHMARKS.md), against plain loads: 1.01-1.12x at batch 1-8 with 4-128 splits at 16-64 heads, contiguous and
# paged, 1.00-1.06x at 128 heads; 0.98x at batch 64 with 64 heads and 2 splits.
EVICT_FIRST_MIN_SPLITS = 4


def kv_evict_first(tma: bool, alternate: bool, num_splits: int, cluster: int) -> bool:
    """Whether a TMA kernel loads ckv and kpe as the first lines out of L2: where at least EVICT_FIRST_MIN_SPLITS
    splits' partials go through the merge launch, which then finds more of them in L2. Not for alternate tiles
    (long runs a CTA, where two row blocks' second reads of a tile hit L2: 0.97x at 128 heads, batch 8, 32k keys);
    their kernels keep the plain loads' code."""
    return tma and not alternate and num_splits >= EVICT_FIRST_MIN_SPLITS and not cluster


@functools.lru_cache(maxsize=None)
def _spec_for(rank: int, rope: int, dtype: str, q_rows: int, paged: bool, user: MlaDecodeSpec | None):
    fields = dict(kv_lora_rank=rank, rope_dim=rope, dtype=DType(dtype), q_rows=q_rows, paged=paged)
    return MlaDecodeSpec(**fields) if user is None else user.replace(**fields)


# ``rs`` with fields replaced where that fits ``arch``, else None; remembered (the host path asks per call)
_if_it_fits = functools.lru_cache(maxsize=None)(replaced_if_valid)


def merge_entry(kern, chunks: int, num_splits: int) -> str:
    """The merge entry of ``kern``'s module for ``chunks`` (rows x MERGE_COLS-column chunks) of
    ``num_splits`` partials: ``_merge_wide`` (a CTA a chunk, its warps over the splits) from
    MERGE_WIDE_SPLITS splits where the device holds all its CTAs at once, else ``_merge`` (a warp a
    chunk)."""
    if num_splits >= MERGE_WIDE_SPLITS and chunks <= kern.occupancy("_merge_wide") * sm_count(kern.device):
        return "_merge_wide"
    return "_merge"


def _tensor_maps(cv, pe, spec: MlaDecodeSpec, block_size: int, fallback_ptr: int) -> bytes:
    """The TMA kernel's maps of ckv and kpe: 3-d (columns, positions or paged slots, cache rows or
    blocks), boxes of 64 columns (kpe's zero-filled past rope_dim) and of the rows the kernel issues
    at once: the whole tile, or paged the largest power of two dividing the block size."""
    rows = min(spec.cta_tile_kv, block_size & -block_size) if block_size else spec.cta_tile_kv

    def one(t, name):
        return tiled_map(t.dtype, t.ptr or fallback_ptr, (t.shape[2], max(t.shape[1], 1), max(t.shape[0], 1)),
                         (2 * t.strides[1], 2 * t.strides[0]), (64, rows, 1),
                         lambda e: f"pipeline=tma: no TMA tensor map for {name} of shape {t.shape} with strides "
                                   f"{t.strides}: {e}; use a spec with pipeline=sync")
    return one(cv, "ckv_cache") + one(pe, "kpe_cache")


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, *, cache_seqlens, sm_scale: float, block_table=None,
               num_splits: int = 0, return_lse: bool = False, out=None, spec: MlaDecodeSpec | str | None = None):
    """MLA decode: q_len new tokens per sequence, every head against one shared compressed cache.

    q_nope ``[batch, q_len, heads, kv_lora_rank]`` and q_pe ``[batch, q_len, heads, rope_dim]``
    (q_len 1..4, heads 1..128; 512/64 and 256/32 supported). Contiguous cache: ckv_cache
    ``[batch, max_seqlen, kv_lora_rank]`` and kpe_cache ``[batch, max_seqlen, rope_dim]``. Paged
    (``block_table`` int32 ``[batch, max_blocks]``): ``[num_blocks, block_size, ...]`` with key j of
    row b at block ``block_table[b, j // block_size]``, slot ``j % block_size`` (block sizes: a
    multiple of 16 from 16 to 256). ``cache_seqlens`` (int32 ``[batch]`` or an int) is each row's
    length including the new tokens, whose entries are already in the cache: token i sits at
    position L - q_len + i and sees keys 0..L - q_len + i. Lengths past the capacity are clamped
    to it; out-of-range blocks are clamped to the pool on the device.

    Scores are ``(q_nope . ckv + q_pe . kpe) * sm_scale``; the output ``[batch, q_len, heads, kv_lora_rank]`` (q's
    dtype and kind) is their softmax times ckv. ``num_splits`` 0 chooses the split-KV count, a positive number
    forces it. ``spec`` (a spec or its text) pins tuning fields (``qk_shard``, ``cta_tile_kv``, ``num_warps``,
    ``num_stages``, ``mma``, ``pipeline``); left at ``auto``, ``qk_shard`` becomes ``alternate`` on sm_90a for two
    64-row blocks or more (or one, where the memory needs ``FAST_MEMORY_SHARE`` of the SMs and the batch holds
    ``ALTERNATE_ONE_BLOCK_MIN_BATCH`` such blocks) with at least ``ALTERNATE_MIN_TILES`` tiles a CTA. A call with 32
    packed query rows (32 heads, or 16 heads x 2 tokens), a contiguous cache (or paged blocks of a multiple of 64)
    and no pinned tuning field runs them as one 64-row block of sm_90a's wgmma kernel on a GPU whose memory needs
    ``FAST_MEMORY_SHARE`` of its SMs to reach its bandwidth (an H200, not an H100). With ``return_lse`` also the
    fp32 LSE ``[batch, heads, q_len]``; a token that sees no key gives zeros and LSE -inf.
    """
    if _rt.tracing is not None and _rt.tracing():
        return _rt.traced_ops["mla_decode"](
            q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens=cache_seqlens, sm_scale=sm_scale,
            block_table=block_table, num_splits=num_splits, return_lse=return_lse, out=out, spec=spec)
    if spec.__class__ is str:
        spec = spec_of_text(spec, "mla_decode")
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
    if any(t.dtype != qn.dtype for t in infos):
        raise LaunchError("q_nope, q_pe, ckv_cache, kpe_cache must share a dtype; got "
                          + ", ".join(t.dtype for t in infos))
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

    pool, cache_len = cv.shape[0], cv.shape[1]
    paged = block_table is not None
    if paged:
        block_size = cache_len
        capacity, bt_ptr, bt_sb = paged_table(block_table, b, block_size, kind, dev, "q_nope", "ckv_cache")
    else:
        if pool < b:
            raise LaunchError(f"ckv_cache has {pool} cache rows for batch {b}")
        block_size, capacity, bt_ptr, bt_sb = 0, cache_len, 0, 0
    seq_ptr, seq_fixed = cache_lengths(cache_seqlens, b, kind, dev, "q_nope")

    shape = (b, q_len, h, rank)
    if out is None:
        out = empty_like_kind(kind, shape, qn.dtype, dev)
    oi = tensor_info(out, "out")
    if oi.kind != kind or oi.shape != shape or oi.dtype != qn.dtype or oi.device != dev:
        raise LaunchError(f"out must be {kind} {shape} {qn.dtype} on device {dev}; got "
                          f"{oi.kind} {oi.shape} {oi.dtype} on device {oi.device}")
    check_rows(oi, "out", 4, "[batch, q_len, heads, kv_lora_rank]")
    lse = empty_like_kind(kind, (b, h, q_len), "fp32", dev) if return_lse else None
    if b == 0:
        return (out, lse) if return_lse else out
    if b > 65535:
        raise LaunchError(f"batch={b} exceeds 65535 (the grid's z limit)")

    rows = MlaDecodeSpec.rows_for(h, q_len)
    fast_memory = saturating_share(dev) >= FAST_MEMORY_SHARE
    kern = get_kernel(_spec_for(rank, rope, qn.dtype, rows, paged, spec), device=dev)
    rs = kern.spec
    whole_tiles = not paged or block_size % 64 == 0  # TMA boxes of whole 64-key tiles (what the rules measured)
    # 32 rows (32 heads, or 16 x 2 tokens) as one 64-row block of the wgmma kernel, half its rows empty, where the
    # device's memory needs FAST_MEMORY_SHARE of its SMs or more, on a contiguous cache or paged blocks of whole
    # 64-key tiles (measured: blocks of 64). The 32-row mma.sync kernel cannot keep up with such memory: on an H200
    # (0.7) it reached 0.64-0.67 of the bare read at batch 64-768 with 8k-32k keys, and the wgmma kernel ran
    # 1.11-1.31x it at batch 8-768 from 8k keys and at batch 256-768 with 1k, 1.02x at batch 8 and 0.975x at batch 64
    # with 1k; on an H100 (0.49), 0.87-1.04x (BENCHMARKS.md, 2026-11-26). Paged (blocks of 64, H200): 1.08-1.19x,
    # 0.97x at b=64 1k.
    if (rows == 32 and whole_tiles and rs.tma and fast_memory
            and (spec is None or not any(getattr(spec, f) for f in spec.TUNING_FIELDS))):
        wide = get_kernel(_spec_for(rank, rope, qn.dtype, 64, paged, spec), device=dev)
        if wide.spec.wgmma:
            rows, kern, rs = 64, wide, wide.spec
    maps = None
    if rs.tma:
        try:
            maps = _tensor_maps(cv, pe, rs, block_size, qn.ptr)
        except LaunchError:
            if spec is not None and spec.pipeline is Pipeline.TMA:
                raise
            kern = get_kernel(rs.replace(pipeline=Pipeline.SYNC), device=dev)  # the same tiles
            rs = kern.spec
    row_blocks = -(-h * q_len // rows)
    if (rows == 16 and rs.tma and whole_tiles and rs.cta_tile_kv == 64 and rs.num_stages == 2
            and (spec is None or not (spec.num_stages or spec.num_warps))
            and b * row_blocks * -(-capacity // rs.cta_tile_kv) >= ONE_STAGE_MIN_TILES * sm_count(dev)
            and fast_memory):
        one = _if_it_fits(rs, kern.binary.arch, num_stages=1, num_warps=4)  # two CTAs an SM
        if one is not None:  # before the split count, which counts the CTAs an SM holds
            kern = get_kernel(one, device=dev)
            rs = kern.spec
    if num_splits == 0:
        # Each split reads its rows of Q and writes a partial the merge reads back, both about a tile's
        # bytes for a 64-row block: weighted twice (fitted on the H100, BENCHMARKS.md 2026-11-24).
        num_splits = choose_splits(b * row_blocks, capacity, rs.cta_tile_kv, sm_count(dev), ctas_per_sm(kern),
                                   2 * rs.cta_tile_kv * (rank + rope), 4 * b * q_len * h * rank,
                                   q_bytes=2 * b * row_blocks * rows * (rank + rope), side_weight=2.0, out_passes=2)
    many_rows = row_blocks >= 2 or (b * row_blocks >= ALTERNATE_ONE_BLOCK_MIN_BATCH and fast_memory)
    if (many_rows and rs.qk_shard is QkShard.TRUE and (spec is None or not spec.qk_shard)
            and -(-capacity // rs.cta_tile_kv) >= ALTERNATE_MIN_TILES * num_splits):
        alt = _if_it_fits(rs, kern.binary.arch, qk_shard=QkShard.ALTERNATE)
        if alt is not None:  # the same shared memory and grid: the split stands
            kern = get_kernel(alt, device=dev)
            rs = kern.spec
    # sm_90: the splits of each row block as one cluster that merges them in shared memory (no workspace,
    # no merge launch), where the row blocks alone fill CLUSTER_MIN_FILL of the SMs and every cluster is
    # resident at once. H100 (2026-11-26): 1.01-1.09x at batch 64 and 16 heads; at batch 1-8 (1k keys)
    # 0.77-0.96x, the few CTAs of each cluster merging many rows, one DSMEM load after another.
    cluster = 0
    if (1 < num_splits <= MERGE_CLUSTER_MAX and b * row_blocks >= CLUSTER_MIN_FILL * sm_count(dev)
            and rs.cluster_merge_fits()
            and kern.max_clusters(num_splits) >= b * row_blocks):
        cluster = num_splits
    part_ptr = lse_part_ptr = 0
    evict_first = kv_evict_first(maps is not None, rs.qk_shard is QkShard.ALTERNATE, num_splits, cluster)
    if num_splits > 1 and not cluster:
        n_out = num_splits * b * q_len * h
        work = empty_like_kind(kind, (n_out * rank + n_out,), "fp32", dev)
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
        scale, scale * _LOG2E, int(evict_first),
    )
    stream = current_stream(kind, dev)
    if maps is None:
        kern.launch_struct(_PARAMS, (num_splits, row_blocks, b), stream, *values, cluster_x=cluster)
    else:
        kern.launch_struct(_PARAMS_TMA, (num_splits, row_blocks, b), stream, maps, *values, cluster_x=cluster)
    if num_splits > 1 and not cluster:
        chunks = b * q_len * h * (rank // MERGE_COLS)
        entry = merge_entry(kern, chunks, num_splits)
        grid = chunks if entry == "_merge_wide" else -(-chunks // (MERGE_THREADS // 32))
        kern.launch_struct(_PARAMS, (grid, 1, 1), stream, *values, entry=entry)
    return (out, lse) if return_lse else out
