"""Which kernel ``attngen.decode`` runs, and how it is launched: one pure function,
``choose(problem, device, tuned) -> Choice(spec, launch)``.

The spec: the caller's spec resolved for the arch where one is given; else the winners ``attngen tune decode``
stored for this GPU (by the cache's capacity, nearest by log distance); else the arch's default (``resolve``,
over ``defaults.candidates``). The launch: the split count (the caller's; one for short rows on a full grid on
sm_90, ``short_keys``; else ``split_kv.choose_splits``' cost model), and on sm_90 whether a row's splits merge in
a thread-block cluster (no workspace, no merge launch) or through the merge launch.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ...arch import Arch
from ...spec import DType, resolve
from ..choice import Choice, DeviceFacts, SizeTable
from ..snippets import mods_fields
from ..split_kv import CLUSTER_MAX, choose_splits
from .spec import MERGE_THREADS, DecodeSpec, KVDType, Variant

# The merge launch in a CUDA graph, in the tile steps of choose_splits (a step: every resident CTA reading one K and V
# tile): about three (choose_splits counts one).
MERGE_LAUNCH_STEPS = 3.0

# Rows of at most SHORT_KEYS keys on a grid that already puts a CTA on FULL_GRID of the SMs or more take one split on
# sm_90: there a split's fixed costs (the merge, the extra CTAs' prologues) outweigh its shorter rows, which
# choose_splits, counting a second resident CTA an SM as free and the merge as one step, does not see. Measured on
# an H200 (GQA 32/8, head dims 64/128/256, bf16 and e4m3 caches, contiguous and pages of 16, b16-128 x 1k, against
# the cost model's 2-3 splits): up to 1.27x (e4m3 b16-64), 1.11x (bf16 d128 b16 paged); one row 0.99 (d64 bf16
# paged b16). Past 1k the best count differs by kernel: d64 and fp8 gain from splits, a 16-bit cache at head dim 128
# does not up to 2k (SHORT_KEYS_D128: b16 paged, one split against the model's two, 1.05x at 2k and 1.07x at 1.5k on
# an H200, bf16 and fp16, 1.06x at 2k on an H100; contiguous and b32 the model already takes one; at 4k its two
# splits lead, 0.98x).
SHORT_KEYS = 1024
SHORT_KEYS_D128 = 2048
FULL_GRID = 0.9


def short_keys(rs: DecodeSpec) -> int:
    """The most keys a row of ``rs``'s kernel reads in one split on a full sm_90 grid (SHORT_KEYS)."""
    return SHORT_KEYS_D128 if rs.head_dim == 128 and rs.kv_dtype is None else SHORT_KEYS


class Problem(NamedTuple):
    """A decode call as the choice sees it. ``capacity``: the cache's positions a row (paged: its table's blocks
    times the block size); ``variant``: "auto" (the fused kernel), "fused" or "unfused"; ``num_splits``: 0
    (chosen) or the caller's; ``cluster_max``: the most splits merged in one cluster (``op.set_cluster_merge``);
    ``local``: per-row key bounds (a window, several tokens without causality, left pads: the ``local`` kernels);
    ``live``: the most keys a row's tokens see where a window bounds them (0: the capacity), what the split count
    is chosen for, as the kernel splits only them; ``sinks``: attention sinks (the ``sinks`` kernels);
    ``kv_dtype``: the cache's fp8 format, None for q's dtype; ``varlen_q``, ``tree``: a packed, ragged q (``q_len`` its
    most tokens a request) and its tree masks."""

    head_dim: int
    dtype: str = "bf16"
    q_len: int = 1
    heads: int = 1
    kv_heads: int = 1
    batch: int = 1
    capacity: int = 1
    paged: bool = False
    variant: str = "auto"
    spec: DecodeSpec | None = None
    softcap: bool = False
    alibi: bool = False
    num_splits: int = 0
    cluster_max: int = CLUSTER_MAX
    local: bool = False
    live: int = 0
    sinks: bool = False
    kv_dtype: KVDType | None = None
    page_rows: bool = False
    varlen_q: bool = False
    tree: bool = False

    @property
    def q_rows(self) -> int:
        return DecodeSpec.rows_for(self.heads // self.kv_heads, self.q_len)


class Launch(NamedTuple):
    """``num_splits`` CTAs a (KV head, batch row): grid (num_splits, kv_heads, batch); ``cluster``: the splits
    merged in one cluster of them (0: none); ``merge_grid``: the merge launch's grid, None where there is none."""

    num_splits: int
    cluster: int
    grid: tuple
    merge_grid: tuple | None


@functools.lru_cache(maxsize=None)
def base_spec(head_dim: int, dtype: str, q_rows: int, paged: bool, variant: str, user: DecodeSpec | None,
              softcap: bool = False, alibi: bool = False, local: bool = False, sinks: bool = False,
              kv_dtype: KVDType | None = None, mods: tuple = (), *, varlen_q: bool = False,
              tree: bool = False, page_rows: bool = False) -> DecodeSpec:
    """The spec of a problem's fields (``variant`` "fused" or "unfused"), its tuning fields the caller's or
    unresolved. ``mods``: a call's snippets, (score_mod, mask_mod, aux text), or () for none; ``varlen_q``, ``tree``:
    a packed, ragged q and its tree masks; ``page_rows``: a paged cache whose blocks are not a multiple of 16
    positions (every key row looks up its block)."""
    fields = dict(head_dim=head_dim, dtype=DType(dtype), q_rows=q_rows, paged=paged, variant=Variant(variant),
                  softcap=softcap, alibi=alibi, local=local, sinks=sinks, kv_dtype=kv_dtype, varlen_q=varlen_q,
                  tree=tree, page_rows=page_rows,
                  **{"score_mod": "", "mask_mod": "", "aux": "", **mods_fields(mods)})
    return DecodeSpec(**fields) if user is None else user.replace(**fields)


def base_of(p: Problem) -> DecodeSpec:
    return base_spec(p.head_dim, p.dtype, p.q_rows, p.paged, "fused" if p.variant == "auto" else p.variant, p.spec,
                     p.softcap, p.alibi, p.local, p.sinks, p.kv_dtype, varlen_q=p.varlen_q, tree=p.tree,
                     page_rows=p.page_rows)


@functools.lru_cache(maxsize=1024)
def table(base: DecodeSpec, arch: Arch, default: bool, tuned: tuple = ()) -> SizeTable:
    """The specs a problem of ``base`` runs by its cache's capacity: with ``default`` (no spec of the caller's)
    the stored winners ``tuned`` where there are any, else one resolved spec."""
    if default and tuned:
        return SizeTable.tuned(tuned)
    return SizeTable.one(resolve(base, arch))


def table_of(p: Problem, arch: Arch, tuned=()) -> SizeTable:
    return table(base_of(p), arch, p.spec is None, tuple(tuned) if p.spec is None else ())


def grid_steps(ctas: int, tiles: int, splits: int, slots: int, share: float) -> float:
    """Tile steps of a grid of ``ctas`` x ``splits`` CTAs over ``tiles`` tiles a row, with ``slots``
    resident at once: its waves of ceil(tiles / splits) steps, or, where more CTAs read at once than
    the memory serves at full rate (``share``, split_kv.saturating_share, of the SMs), the tiles over
    that many; plus 2 for the ring's fill."""
    waves = -(-ctas * splits // slots)
    return max(waves * -(-tiles // splits), ctas * tiles / (share * slots)) + 2


def cluster_limit(rs: DecodeSpec, ctas: int, device: DeviceFacts, cluster_max: int = CLUSTER_MAX) -> int:
    """The most splits of a row that a grid of ``ctas`` (batch x KV heads) CTAs of ``rs``'s kernel merges in
    one cluster of them; 0 where it merges through the workspace and a merge launch. Clusters need
    sm_90 (``DeviceFacts.max_clusters``), the fused kernel, room for the output rows in its shared memory,
    one CTA an SM with a ring of 4 stages or more (a shallower ring's CTAs read too slowly for the SMs a
    cluster leaves to keep up), and are taken where their CTAs reach a third of the SMs or more (a paged
    cache, whose CTAs read more slowly for their table lookups: 90%). Where the call's split count is
    automatic, a cluster is also weighed against the merge launch's uncapped count (``grid_steps``).

    Every one of the ``ctas`` clusters must be resident at once (the driver's count knows how SMs group
    into GPCs: fewer clusters than SMs / size where a GPC's SMs do not divide into whole clusters): a
    cluster size with fewer runs the last clusters as a second wave, slower than the merge launch, so the
    size is the largest whose clusters all fit (BENCHMARKS.md)."""
    if (rs.variant is Variant.UNFUSED or rs.d_parts > 1 or rs.num_stages < 4
            or rs.cluster_merge_bytes() > rs.smem_bytes() or max(1, device.occupancy(rs)) != 1):
        return 0
    cmax = cluster_max
    while cmax > 1 and device.max_clusters(rs, cmax) < ctas:
        cmax -= 1
    need = 0.9 if rs.paged else 1 / 3
    return cmax if cmax > 1 and ctas * cmax >= need * device.sm_count else 0


def launch(p: Problem, rs: DecodeSpec, device: DeviceFacts) -> Launch:
    """The launch of ``rs`` for ``p``."""
    b, hk, d = p.batch, p.kv_heads * rs.d_parts, p.head_dim  # hk: CTAs a split of a row
    per_sm = max(1, device.occupancy(rs))
    cmax = cluster_limit(rs, b * hk, device, p.cluster_max)
    num_splits = p.num_splits
    keys = p.live or p.capacity  # what the kernel splits
    if num_splits == 0 and keys <= short_keys(rs) and b * hk >= FULL_GRID * device.sm_count and device.arch.major == 9:
        num_splits = 1
    elif num_splits == 0:
        num_splits = choose_splits(b * hk, keys, rs.cta_tile_kv, device.sm_count, per_sm,
                                   4 * rs.cta_tile_kv * d, 4 * b * p.q_len * p.heads * d)
        if num_splits > 1 and cmax:
            # A cluster caps the split count. It is taken where its fewer CTAs read about as fast as the merge
            # launch's more, counting what the launch costs (grid_steps); a long cache at batch 1 needs the SMs a
            # cluster leaves idle.
            capped = choose_splits(b * hk, keys, rs.cta_tile_kv, device.sm_count, per_sm,
                                   4 * rs.cta_tile_kv * d, 0, max_splits=cmax)
            tiles, slots = -(-keys // rs.cta_tile_kv), device.sm_count * per_sm
            if (grid_steps(b * hk, tiles, capped, slots, device.memory_share)
                    <= grid_steps(b * hk, tiles, num_splits, slots, device.memory_share) + MERGE_LAUNCH_STEPS):
                num_splits = capped
            else:
                cmax = 0
    cluster = num_splits if 1 < num_splits <= cmax else 0
    merged = num_splits > 1 and not cluster
    merge_grid = (-(-b * p.q_len * p.heads // (MERGE_THREADS // 32)), 1, 1) if merged else None
    return Launch(num_splits, cluster, (num_splits, hk, b), merge_grid)


def choose(p: Problem, device: DeviceFacts, tuned=()) -> Choice:
    """The resolved spec ``p`` runs on ``device`` and its launch. ``tuned``: the stored winners that apply
    (``tuned.tuned_choices``' (size, spec) list; read only where ``p`` has no spec of the caller's)."""
    spec = table_of(p, device.arch, tuned).spec_for(p.capacity)
    return Choice(spec, launch(p, spec, device))


def reachable(spec: DecodeSpec, arch: Arch) -> set:
    """Every resolved spec ``choose`` can return for a problem of ``spec``'s fields on ``arch`` (no stored
    winners): ``spec`` resolved (the decode kernel does not change with the sizes)."""
    return {resolve(spec, arch)}
