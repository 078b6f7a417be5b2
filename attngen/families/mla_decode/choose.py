"""Which kernel ``attngen.mla_decode`` runs, and how it is launched: one pure function,
``choose(problem, device) -> Choice(spec, launch)``.

The spec: the caller's spec, or the arch's default for the call's packed query rows (``resolve``, over
``defaults.candidates``), then the rules below by the call's sizes and the device's memory, each only where
the caller pinned none of the fields it changes: 32 rows as one 64-row block of the wgmma kernel, one stage on
four warps, alternate KV tiles. The launch: the split count, a cluster merge or the merge launch (and its
entry), and whether the TMA kernels load the cache as first out of L2. ``reachable`` lists every spec
``choose`` can return for a manifest line, so that prewarming it covers what the op runs. Every rule was
measured against the default it replaces (BENCHMARKS.md); the constants say where each pays.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ...arch import Arch
from ...spec import DType, Mma, Pipeline, replaced_if_valid, resolve
from ..decode.spec import KVDType
from ..choice import Choice, DeviceFacts
from ..split_kv import CLUSTER_MAX, choose_splits
from .spec import MERGE_COLS, MERGE_FINE_COLS, MERGE_THREADS, MERGE_WIDE_COLS, MlaDecodeSpec, QkShard

# qk_shard=auto on sm_90a: alternate tiles where a sequence's rows fill two 64-row blocks or more (128 heads)
# and each CTA gets at least this many 64-key tiles; the sharded form elsewhere (with fewer tiles a CTA, or
# at 64 heads, alternate tiles did not pay).
ALTERNATE_MIN_TILES = 32
# On fast memory (FAST_MEMORY_SHARE), with two row blocks or more and the keys not split, from this many: there its
# cheaper steps pay for its longer start and end from short runs on. With split keys at 16 tiles a CTA, or one row
# block (64 heads) at 8, they did not (0.96-0.99x and 0.89-0.96x the sharded form).
ALTERNATE_MIN_TILES_UNSPLIT = 8
# The three rules below take effect only on a device whose memory needs FAST_MEMORY_SHARE of its SMs or more to
# reach its bandwidth (split_kv.saturating_share: about 0.70 on an H200, 0.49 on an H100). There the default kernels
# cannot keep up with the memory; where it needs fewer SMs, each rule's kernel ran about even with the default.
FAST_MEMORY_SHARE = 0.6
# One 64-row block (64 heads) takes alternate tiles too on fast memory (FAST_MEMORY_SHARE) and where the batch fills
# ALTERNATE_ONE_BLOCK_MIN_BATCH row blocks (at smaller batches it did not pay).
ALTERNATE_ONE_BLOCK_MIN_BATCH = 64
# 16 rows on the TMA ring, 64-key tiles: one stage on four warps where the grid holds at least ONE_STAGE_MIN_TILES
# tiles an SM and the memory is fast (FAST_MEMORY_SHARE). One stage leaves room for two CTAs an SM, whose loads and
# math then overlap each other's; with few tiles an SM it loses to the two-stage default. Paged blocks that are not
# whole tiles take it as the gather (page_rows): TMA boxes of blocks of 16 ran 1.24-1.32x the one-stage gather's time
# on an H200 (16 heads, batch 32 x 8k and 128 x 4k), and the two-stage gather 1.26-1.30x at pages of 1.
ONE_STAGE_MIN_TILES = 16
# Blocks that are not a multiple of 16 (page_rows, where the two-stage alternative is the gather too): one stage from
# this many tiles an SM. On an H200 at 16 heads, pages of 1: 1.05-1.13x the two-stage gather at 7.8 tiles an SM
# (b1-64 x 32k-1k), 1.11x at 11.6, even at 5.8, 0.92-0.97x at 3.9. (Blocks of 16 keep TMA boxes below
# ONE_STAGE_MIN_TILES: at 7.8 tiles an SM those ran 1.07x the one-stage gather.)
GATHER_ONE_STAGE_MIN_TILES = 6
# 32- and 64-row blocks of the sharded kernels on sm_90a's TMA ring over blocks that cut a 64-key tile into 16-row TMA
# boxes (16, 48, ...: an odd multiple of 16) take the producer warpgroup's gather instead, where no cluster merges
# their splits (the gather has no cluster form). On an H200, blocks of 16: 1.09-1.37x the boxes (128 heads b1-8 x
# 8k-32k, 64 heads b8 x 8k and b32 x 4k, 32 heads b8-32 x 8k); blocks of 32 ran 0.96-1.10x, and alternate tiles kept
# their boxes (gathered: 0.82-0.96x).
GATHER_BLOCK_MULTIPLE = 32
# The most splits of a row block merged in a cluster on sm_90 (0 or 1: every split count through the
# workspace and a merge launch), and the share of the SMs the row blocks must fill for a cluster (with few
# row blocks each cluster's CTAs merge many rows, one DSMEM load after another, slower than the merge launch).
MERGE_CLUSTER_MAX = CLUSTER_MAX
CLUSTER_MIN_FILL = 0.4
# The merge takes its wide entry (a CTA a chunk of a row, its warps over the splits) from this many splits, where
# the GPU holds the wide grid at once (a grid several waves deep ran slower than the narrow entry).
MERGE_WIDE_SPLITS = 32
# The split model's weight of Q and the partials (side_weight, out_passes of split_kv.choose_splits) for the
# 64-row wgmma kernel (sm_90a, 64 and 128 heads): the choice that measured fastest among 1-32 splits on all 42
# shapes of an H200 sweep (128 heads, batch 1-64 x 1k-32k keys; the old weights, (2.0, 2), missed by up to 1.26x
# at batch 32 x 1k keys).
SIDE_WEIGHT_64 = (1.0, 1)
# The narrow merge takes MERGE_FINE_COLS columns a warp where MERGE_COLS would give fewer warps an SM than this.
FINE_BELOW_WARPS = 8
# The TMA kernels load ckv and kpe as first out of L2 (kv_evict_first) from this many splits: the merge launch
# then finds more of the partials in L2.
EVICT_FIRST_MIN_SPLITS = 4


def kv_evict_first(tma: bool, alternate: bool, num_splits: int, cluster: int) -> bool:
    """Whether a TMA kernel loads ckv and kpe as the first lines out of L2: where at least EVICT_FIRST_MIN_SPLITS
    splits' partials go through the merge launch. Not for alternate tiles (long runs a CTA, where two row blocks'
    second reads of a tile hit L2); their kernels keep the plain loads' code."""
    return tma and not alternate and num_splits >= EVICT_FIRST_MIN_SPLITS and not cluster


class Problem(NamedTuple):
    """An MLA decode call as the choice sees it. ``capacity``: the cache's positions a row (paged: its table's
    blocks times ``block_size``; 0 contiguous); ``num_splits``: 0 (chosen) or the caller's; ``tma_refused``: the
    driver could not describe the cache as TMA maps (the TMA kernel's cp.async form runs; an fp8 cache: the mma.sync
    kernel); ``kv_dtype``: the cache's fp8 format, None for q's dtype; ``page_rows``: paged blocks that are not a
    multiple of 16 positions (spec page_rows: the cp.async kernels that look up every key row)."""

    kv_lora_rank: int = 512
    rope_dim: int = 64
    dtype: str = "bf16"
    q_len: int = 1
    heads: int = 16
    batch: int = 1
    capacity: int = 1
    paged: bool = False
    block_size: int = 0
    spec: MlaDecodeSpec | None = None
    num_splits: int = 0
    tma_refused: bool = False
    kv_dtype: KVDType | None = None
    page_rows: bool = False


class Launch(NamedTuple):
    """Grid (num_splits, row_blocks, batch) of ``spec.q_rows``-row blocks; ``cluster``: the splits merged in one
    cluster of them (0: none); ``evict_first``: the kernel's kv_evict_first parameter; ``merge_entry`` and
    ``merge_grid``: the merge launch, None where there is none."""

    num_splits: int
    row_blocks: int
    cluster: int
    evict_first: bool
    merge_entry: str | None
    merge_grid: tuple | None

    def grid(self, batch: int) -> tuple:
        return (self.num_splits, self.row_blocks, batch)


@functools.lru_cache(maxsize=None)
def base_spec(rank: int, rope: int, dtype: str, q_rows: int, paged: bool, user: MlaDecodeSpec | None,
              kv: KVDType | None = None, page_rows: bool = False) -> MlaDecodeSpec:
    """The spec of a problem's fields, its tuning fields the caller's or unresolved."""
    fields = dict(kv_lora_rank=rank, rope_dim=rope, dtype=DType(dtype), q_rows=q_rows, paged=paged, kv_dtype=kv,
                  page_rows=page_rows)
    return MlaDecodeSpec(**fields) if user is None else user.replace(**fields)


@functools.lru_cache(maxsize=1024)
def resolved_spec(rank: int, rope: int, dtype: str, q_rows: int, paged: bool, user, arch: str,
                  kv: KVDType | None = None, page_rows: bool = False) -> MlaDecodeSpec:
    """``base_spec`` resolved for ``arch`` (remembered by these plain values: the host path asks per call)."""
    return resolve(base_spec(rank, rope, dtype, q_rows, paged, user, kv, page_rows), arch)


# (id of a spec, arch, rule) -> (the spec, its variant or None); by identity, as the specs asked for are the
# remembered ones above and their variants (held here), and hashing a spec per call costs more.
_variants: dict = {}
_VARIANTS = {"one_stage": dict(num_stages=1, num_warps=4), "alternate": dict(qk_shard=QkShard.ALTERNATE),
             "cluster": dict(cluster_merge=True), "gather": dict(page_rows=True), "box_lanes": dict(box_lanes=True)}


def _variant(rs: MlaDecodeSpec, arch, rule: str):
    """``rs`` with ``rule``'s fields replaced where that fits ``arch``, else None."""
    k = (id(rs), arch.name, rule)
    got = _variants.get(k)
    if got is None or got[0] is not rs:
        got = _variants[k] = (rs, replaced_if_valid(rs, arch, **_VARIANTS[rule]))
    return got[1]


def merge_entry(rs: MlaDecodeSpec, rows: int, num_splits: int, device: DeviceFacts) -> tuple[str, tuple]:
    """The merge entry of ``rs``'s module for ``rows`` output rows of ``num_splits`` partials, and its grid:
    ``_merge_wide`` (a CTA a MERGE_WIDE_COLS-column chunk of a row, its warps over the splits) from
    MERGE_WIDE_SPLITS splits where the device holds all its CTAs at once; else a warp a chunk: ``_merge``
    (MERGE_COLS columns) where that gives FINE_BELOW_WARPS warps an SM or more, ``_merge_fine``
    (MERGE_FINE_COLS) where it gives fewer."""
    wide = rows * (rs.kv_lora_rank // MERGE_WIDE_COLS)
    if num_splits >= MERGE_WIDE_SPLITS and wide <= device.occupancy(rs, "_merge_wide") * device.sm_count:
        return "_merge_wide", (wide, 1, 1)
    warps, entry = rows * (rs.kv_lora_rank // MERGE_COLS), "_merge"
    if warps < FINE_BELOW_WARPS * device.sm_count:
        warps, entry = rows * (rs.kv_lora_rank // MERGE_FINE_COLS), "_merge_fine"
    return entry, (-(-warps // (MERGE_THREADS // 32)), 1, 1)


def _gathers_boxes(rs: MlaDecodeSpec) -> bool:
    """Whether ``rs`` is a kernel whose gather form (page_rows) blocks of 16-row TMA boxes take instead
    (GATHER_BLOCK_MULTIPLE): the sharded 32- or 64-row kernel on the TMA ring over a paged 16-bit cache."""
    return (rs.q_rows >= 32 and rs.tma and rs.paged and not rs.page_rows and rs.qk_shard is QkShard.TRUE
            and not rs.fp8)


def _pins_tuning(user) -> bool:
    """Whether the caller's spec (None: none) pins a tuning field, which keeps the choice's own forms away."""
    return user is not None and user.pins_tuning


def choose_spec(p: Problem, device: DeviceFacts) -> MlaDecodeSpec:
    """The spec before the rules that depend on the split count (``choose`` applies those)."""
    a, user = device.arch, p.spec
    rows = MlaDecodeSpec.rows_for(p.heads, p.q_len)
    fast_memory = device.memory_share >= FAST_MEMORY_SHARE
    rs = resolved_spec(p.kv_lora_rank, p.rope_dim, p.dtype, rows, p.paged, user, a.name, p.kv_dtype, p.page_rows)
    # TMA boxes of whole 64-key tiles (what the rules measured; page_rows kernels gather rows, whatever the block size)
    whole_tiles = not p.paged or (p.block_size % 64 == 0 and not p.page_rows)
    # 32 rows (32 heads, or 16 x 2 tokens) as one 64-row block of the wgmma kernel, half its rows empty, where the
    # memory is fast: the 32-row mma.sync kernel cannot keep up with such memory.
    if (rows == 32 and whole_tiles and rs.tma and fast_memory
            and not _pins_tuning(user)):
        wide = resolved_spec(p.kv_lora_rank, p.rope_dim, p.dtype, 64, p.paged, user, a.name, p.kv_dtype, p.page_rows)
        if wide.wgmma:
            rows, rs = 64, wide
    if rs.tma and p.tma_refused:
        if rs.fp8:  # fp8 tiles are widened for wgmma only off the TMA ring: the mma.sync kernel of the cp.async one
            sync = (user if user is not None else MlaDecodeSpec()).replace(mma=Mma.SYNC, pipeline=Pipeline.SYNC)
            rs = resolved_spec(p.kv_lora_rank, p.rope_dim, p.dtype, rows, p.paged, sync, a.name, p.kv_dtype,
                               p.page_rows)
        else:
            rs = rs.replace(pipeline=Pipeline.SYNC)  # the same tiles
    row_blocks = -(-p.heads * p.q_len // rows)
    min_tiles = GATHER_ONE_STAGE_MIN_TILES if rs.page_rows else ONE_STAGE_MIN_TILES
    if (rows == 16 and rs.tma and rs.cta_tile_kv == 64 and rs.num_stages == 2
            and (user is None or not (user.num_stages or user.num_warps))
            and p.batch * row_blocks * -(-p.capacity // rs.cta_tile_kv) >= min_tiles * device.sm_count
            and fast_memory):
        if not whole_tiles and not rs.page_rows:
            gather = None if _pins_tuning(user) else resolved_spec(p.kv_lora_rank, p.rope_dim, p.dtype, rows, p.paged,
                                                                  user, a.name, p.kv_dtype, True)
            if gather is None or not gather.gather:
                return rs
            rs = gather
        one = _variant(rs, a, "one_stage")  # two CTAs an SM
        if one is not None:  # before the split count, which counts the CTAs an SM holds
            rs = one
    return rs


def choose(p: Problem, device: DeviceFacts, tuned=()) -> Choice:
    """The resolved spec ``p`` runs on ``device`` and its launch (``tuned``: none are stored for this family)."""
    rs = choose_spec(p, device)
    b, h, q_len, rank, rope = p.batch, p.heads, p.q_len, p.kv_lora_rank, p.rope_dim
    rows = rs.q_rows
    row_blocks = -(-h * q_len // rows)
    num_splits = p.num_splits
    if num_splits == 0:
        # Each split reads its rows of Q and writes a partial the merge reads back, both about a tile's
        # bytes for a 64-row block: weighted twice (fitted to measurements, BENCHMARKS.md); 64-row blocks
        # of the wgmma kernel by SIDE_WEIGHT_64 (refitted once the merge stopped being bound by its instructions).
        weight, passes = SIDE_WEIGHT_64 if rows == 64 and rs.wgmma else (2.0, 2)
        num_splits = choose_splits(b * row_blocks, p.capacity, rs.cta_tile_kv, device.sm_count,
                                   max(1, device.occupancy(rs)), (1 if rs.fp8 else 2) * rs.cta_tile_kv * (rank + rope),
                                   4 * b * q_len * h * rank, q_bytes=2 * b * row_blocks * rows * (rank + rope),
                                   side_weight=weight, out_passes=passes)
    fast_memory = device.memory_share >= FAST_MEMORY_SHARE
    many_rows = row_blocks >= 2 or (b * row_blocks >= ALTERNATE_ONE_BLOCK_MIN_BATCH and fast_memory)
    min_tiles = ALTERNATE_MIN_TILES
    if fast_memory and row_blocks >= 2 and num_splits == 1:
        min_tiles = ALTERNATE_MIN_TILES_UNSPLIT
    # (Over the gather too, blocks of any size: at 128 heads and pages of 1 its alternate form ran 1.05-1.10x the
    # sharded gather on an H200. Blocks of 16 keep their boxes here: the gather rule below takes sharded kernels only.)
    if (many_rows and rs.qk_shard is QkShard.TRUE and not rs.fp8
            and (p.spec is None or not p.spec.qk_shard)
            and -(-p.capacity // rs.cta_tile_kv) >= min_tiles * num_splits):
        alt = _variant(rs, device.arch, "alternate")
        if alt is not None:  # the same shared memory and grid: the split stands
            rs = alt
    # sm_90: the splits of each row block as one cluster that merges them in shared memory (no workspace,
    # no merge launch), where the row blocks alone fill CLUSTER_MIN_FILL of the SMs and every cluster is
    # resident at once. A kernel without the path takes its cluster_merge form where the spec allows one (the
    # sharded wgmma kernel over a 16-bit cache; MlaDecodeSpec.check) and the caller pins no tuning field.
    cluster = 0
    if 1 < num_splits <= MERGE_CLUSTER_MAX and b * row_blocks >= CLUSTER_MIN_FILL * device.sm_count:
        cl = rs
        if not rs.cluster_merge_fits() and not _pins_tuning(p.spec):
            cl = _variant(rs, device.arch, "cluster") or rs
        if cl.cluster_merge_fits() and device.max_clusters(cl, num_splits) >= b * row_blocks:
            rs, cluster = cl, num_splits
    if not cluster and _gathers_boxes(rs) and p.block_size % GATHER_BLOCK_MULTIPLE and not _pins_tuning(p.spec):
        rs = _variant(rs, device.arch, "gather") or rs  # (the same grid and one CTA an SM: the split stands)
    # Blocks smaller than a tile (several TMA boxes a tile): the box_lanes form, a warp issuing each tile's boxes (the
    # same tiles, so whatever the spec pins): on an H100 at blocks of 16, 1.07 and 1.10x at 16 and 64 heads (b128 x 4k,
    # b64 x 4k), 1.00-1.07x at 128 heads.
    if p.paged and rs.cta_tile_kv > (p.block_size & -p.block_size):
        rs = _variant(rs, device.arch, "box_lanes") or rs
    evict_first = kv_evict_first(rs.tma, rs.qk_shard is QkShard.ALTERNATE, num_splits, cluster)
    entry = merge_grid = None
    if num_splits > 1 and not cluster:
        entry, merge_grid = merge_entry(rs, b * q_len * h, num_splits, device)
    return Choice(rs, Launch(num_splits, row_blocks, cluster, evict_first, entry, merge_grid))


def refused(p: Problem) -> Problem:
    """``p`` where the driver refused the TMA maps."""
    return p._replace(tma_refused=True)


def reachable(spec: MlaDecodeSpec, arch: Arch) -> set:
    """Every resolved spec ``choose`` can return for a problem of ``spec``'s fields on ``arch``, over every batch,
    head count, cache length and device memory: ``spec`` resolved; where it pins no tuning field and has 32 rows,
    the 64-row wgmma kernel too (``spec.paged``: blocks of whole 64-key tiles); where it pins neither num_stages
    nor num_warps, the one-stage form of 16 rows (paged, and no tuning field pinned: its gather too, for blocks that
    are not whole tiles); where it pins no qk_shard, the alternate-tile form of each (before the gather of boxes below);
    where it pins no tuning field, the cluster_merge form of the sharded wgmma kernel over a 16-bit cache, and the
    gather of the sharded 32- and 64-row kernels on the TMA ring (paged: blocks of 16-row boxes); paged, the box_lanes
    form of each TMA kernel a block smaller than its tile reaches (not the 16-row one-stage form nor 32 rows as 64,
    which blocks of whole tiles take). (A
    kernel of TMA maps the driver refuses, the cp.async form of its tiles, is not counted: such caches are not
    what a manifest prewarms for.)"""
    pinned = {f for f in spec.TUNING_FIELDS if getattr(spec, f)}
    out = {resolve(spec, arch)}
    if spec.q_rows == 32 and not pinned:
        wide = resolve(spec.replace(q_rows=64), arch)
        first = next(iter(out))
        if first.tma and wide.wgmma:
            out.add(wide)
    for rs in list(out):
        if (rs.q_rows == 16 and rs.tma and rs.cta_tile_kv == 64 and rs.num_stages == 2
                and not pinned & {"num_stages", "num_warps"}):
            forms = [rs]
            if rs.paged and not rs.page_rows and not pinned:  # (blocks that are not whole tiles: the gather)
                forms.append(resolve(spec.replace(page_rows=True), arch))
            for f in forms:
                one = replaced_if_valid(f, arch, num_stages=1, num_warps=4)
                if one is not None and (f is rs or one.gather):
                    out.add(one)
    if "qk_shard" not in pinned:
        for rs in list(out):
            if rs.qk_shard is QkShard.TRUE and not rs.fp8:  # (alternate tiles read 16-bit tiles only)
                alt = replaced_if_valid(rs, arch, qk_shard=QkShard.ALTERNATE)
                if alt is not None:
                    out.add(alt)
    if not pinned:
        for rs in list(out):
            if _gathers_boxes(rs):
                gather = replaced_if_valid(rs, arch, page_rows=True)
                if gather is not None:
                    out.add(gather)
            cl = None if rs.cluster_merge_fits() else replaced_if_valid(rs, arch, cluster_merge=True)
            if cl is not None and cl.cluster_merge_fits():  # (as choose takes it: the gather's never does)
                out.add(cl)
    for rs in list(out):  # (paged: blocks smaller than the tile; not the forms only whole tiles take)
        whole_only = rs.q_rows > spec.q_rows or (rs.num_stages == 1 and rs.q_rows == 16 and not rs.gather
                                                 and not pinned & {"num_stages", "num_warps"})
        lanes = None if whole_only or not rs.paged or rs.cta_tile_kv <= 16 else replaced_if_valid(rs, arch,
                                                                                                  box_lanes=True)
        if lanes is not None:
            out.add(lanes)
    return out
