"""Which kernel ``attngen.prefill`` (and ``prefill_varlen``, ``mask_plan``) runs, and how it is launched: one pure
function, ``choose(problem, device, tuned) -> Choice(spec, launch)``.

The spec: the caller's spec resolved for the arch where one is given; else the winners ``attngen tune`` stored
for this GPU (by the call's query rows, nearest by log distance); else the arch's default (``resolve``, over
``defaults.candidates``), which on sm_90a at head dims 64, 128 and 256 depends on the query rows (``BY_ROWS``).
The launch: the grid (query tiles x heads x batch; the persistent kernel's CTAs the SMs hold; a varlen batch's
work-list slots; a custom mask's comes from its plan). ``reachable`` lists every spec ``choose`` can return for a
manifest line, so that prewarming it covers what the op runs.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from ...arch import Arch
from ...errors import SpecError
from ...spec import DType, replaced_if_valid, resolve
from ..choice import Choice, DeviceFacts, SizeTable
from ..snippets import mods_fields
from .spec import MaskMode, Mma, Persistent, Pipeline, PrefillSpec, Schedule

# What a kernel reads its inputs as.
# VARLEN_PAGE_ROWS: a paged cache whose blocks are not a multiple of 16 positions (spec page_rows).
DENSE, CUSTOM_MASK, VARLEN, VARLEN_PAGED, VARLEN_PAGE_ROWS = range(5)

# sm_90a, the dense layout, head dims 64, 128 and 256: the default depends on the call's query rows. Per
# (head_dim, head_dim_v, mask), from how many rows on each config runs; None: the resolved default (at 64 and 128
# the 128-row ping-pong persistent kernel, at 256 128x64 serial one CTA a tile). Each was measured against the
# default at the rows it takes (BENCHMARKS.md):
# - head dim 64, long rows: three consumer warpgroups (192x128 tiles on 12 warps, ping-pong among the three, one
#   CTA a query tile); a 192-row tile wastes more of a short row, and one CTA a tile has no persistent walk, so
#   short rows keep the default. Their persistent form spills at 128-key tiles. Causal from 8k rows: past the
#   diagonal most of a row's tiles are whole, and there the wider tile pays as it does without a mask.
# - head dim 64, short causal rows: 64x64 tiles on one warpgroup (the cp.async ring, 4 stages): less of the
#   diagonal tile is masked work. Without a mask no 64-row config gained enough to be taken.
# - head dim 256: 128x80 tiles in ping-pong (FlashAttention-3's) from 1k rows (causal: 2k, persistent, with O
#   staged in Q's tile); at fewer rows they lose to the default. Without a mask persistent did not gain.
# - head dim 128, short causal rows: 64x64 tiles on one consumer warpgroup of the TMA ring (serial, persistent:
#   two CTAs an SM walk the tiles).
# - head dim 128 without a mask, from 8k rows: 128x192 tiles (FlashInfer's fa3 tile there), ping-pong, persistent:
#   a key tile's fixed work (turns, barriers, descriptors) spread over more keys. Below 8k the last key tile's
#   padding costs what the wider tiles save.
THREE_GROUPS = dict(cta_tile_q=192, cta_tile_kv=128, num_warps=12, num_stages=2, mma=Mma.WGMMA, pipeline=Pipeline.TMA,
                    schedule=Schedule.PINGPONG, persistent=Persistent.OFF)
SHORT_CAUSAL = dict(cta_tile_q=64, cta_tile_kv=64, num_warps=4, num_stages=4, mma=Mma.WGMMA, pipeline=Pipeline.SYNC,
                    schedule=Schedule.SERIAL, persistent=Persistent.OFF)
KV80_PINGPONG = dict(cta_tile_q=128, cta_tile_kv=80, num_warps=8, num_stages=2, mma=Mma.WGMMA, pipeline=Pipeline.TMA,
                     schedule=Schedule.PINGPONG, persistent=Persistent.OFF)
KV80_PINGPONG_PERSISTENT = {**KV80_PINGPONG, "persistent": Persistent.ON}
KV192_PINGPONG_PERSISTENT = {**KV80_PINGPONG_PERSISTENT, "cta_tile_kv": 192}
SHORT_CAUSAL_TMA = dict(cta_tile_q=64, cta_tile_kv=64, num_warps=4, num_stages=2, mma=Mma.WGMMA, pipeline=Pipeline.TMA,
                        schedule=Schedule.SERIAL, persistent=Persistent.ON)
BY_ROWS = {
    (64, 64, MaskMode.NONE): ((0, None), (2048, THREE_GROUPS)),
    (64, 64, MaskMode.CAUSAL): ((0, SHORT_CAUSAL), (1024, None), (8192, THREE_GROUPS)),
    (128, 128, MaskMode.NONE): ((0, None), (8192, KV192_PINGPONG_PERSISTENT)),
    (128, 128, MaskMode.CAUSAL): ((0, SHORT_CAUSAL_TMA), (768, None)),
    (256, 256, MaskMode.NONE): ((0, None), (1024, KV80_PINGPONG)),
    (256, 256, MaskMode.CAUSAL): ((0, None), (2048, KV80_PINGPONG_PERSISTENT)),
}


def by_rows(resolved, arch) -> tuple[list[int], list[PrefillSpec]] | None:
    """(bounds, specs): what a call of the default ``resolved`` (no spec of the caller's, no tuned winner) runs by
    its query rows, ``specs[i]`` from ``bounds[i - 1]`` rows on; None where one kernel runs every length. A config
    that does not validate on ``arch`` leaves the default in its place."""
    table = BY_ROWS.get((resolved.head_dim, resolved.dim_v, resolved.mask))
    if (table is None or not resolved.tma or resolved.chunked or resolved.varlen or resolved.custom_mask
            or resolved.qkv_dtype):
        return None
    specs = [resolved if fields is None else replaced_if_valid(resolved, arch, **fields) or resolved
             for _, fields in table]
    return [rows for rows, _ in table[1:]], specs


class Problem(NamedTuple):
    """A prefill call as the choice sees it. ``rows``: the query rows of a sequence (dense, custom mask) or of
    the whole packed batch (varlen, whose choice reads ``rows // batch``); ``spec``: the caller's, if any."""

    head_dim: int
    dtype: str = "bf16"
    mask: MaskMode = MaskMode.NONE
    head_dim_v: int = 0  # 0: head_dim
    return_lse: bool = False
    softcap: bool = False
    alibi: bool = False
    layout: int = DENSE
    spec: PrefillSpec | None = None
    rows: int = 1
    heads: int = 1
    batch: int = 1
    sinks: bool = False

    @property
    def size(self) -> int:
        """What the kernel depends on: a sequence's query rows (a varlen batch's mean)."""
        return max(1, self.rows // max(self.batch, 1)) if self.layout >= VARLEN else self.rows


class Launch(NamedTuple):
    """The grid: dense, (query tiles, heads x v_splits, batch), or where ``persistent`` the CTAs the SMs hold
    (each walking units of two query tiles); varlen, (work-list slots, heads x v_splits, 1); a custom mask's
    comes from its plan, ``()``."""

    grid: tuple
    persistent: bool = False


@functools.lru_cache(maxsize=None)
def base_spec(head_dim: int, dtype: str, mask: MaskMode, return_lse: bool, user, softcap: bool, alibi: bool,
              layout: int, head_dim_v: int, sinks: bool = False, mods: tuple = ()) -> PrefillSpec:
    """The spec of a problem's fields, its tuning fields the caller's (``user``) or unresolved. ``mods``: a call's
    snippets, (score_mod, mask_mod, aux text), or () for none."""
    fields = dict(head_dim=head_dim, head_dim_v=head_dim_v or head_dim, dtype=DType(dtype), mask=mask,
                  return_lse=return_lse, softcap=softcap, alibi=alibi, sinks=sinks, custom_mask=layout == CUSTOM_MASK,
                  varlen=layout >= VARLEN, paged=layout >= VARLEN_PAGED,
                  page_rows=layout == VARLEN_PAGE_ROWS,
                  **{"score_mod": "", "mask_mod": "", "aux": "", **mods_fields(mods)})
    return PrefillSpec(**fields) if user is None else user.replace(**fields)


def base_of(p: Problem) -> PrefillSpec:
    return base_spec(p.head_dim, p.dtype, p.mask, p.return_lse, p.spec, p.softcap, p.alibi, p.layout, p.head_dim_v,
                     p.sinks)


def scales_exactly(sm_scale: float) -> bool:
    """Whether q times ``sm_scale`` is exact in 16 bits (spec q_scaled): a power of two from 2^-14 to 1, which moves
    the exponent alone and never overflows. (In fp16 a q below 2^-14 / sm_scale lands among the subnormals and rounds
    at 2^-24, far below the fp32 sum's own rounding; bf16's range has no such q in practice.)"""
    mantissa, exp = math.frexp(sm_scale)
    return mantissa == 0.5 and -13 <= exp <= 1


@functools.lru_cache(maxsize=1024)
def table(base: PrefillSpec, arch: Arch, default: bool, tuned: tuple = (), scaled: bool = False) -> SizeTable:
    """The specs a problem of ``base`` runs by its query rows: with ``default`` (no spec of the caller's) the
    stored winners ``tuned`` where there are any, else the arch's default and its rule by rows (``by_rows``);
    the caller's spec resolved otherwise. Raises ``resolve``'s SpecError where nothing fits. ``scaled`` (a score_mod
    call whose sm_scale ``scales_exactly``): with ``default``, each TMA spec takes q_scaled where it fits (its tiles
    kept), so that score_mod's logits come out of the MMA (the TMA kernels': fit.Q_SCALED_KERNELS)."""
    if default and tuned:
        found = SizeTable.tuned(tuned)
    else:
        resolved = resolve(base, arch)
        rows = by_rows(resolved, arch) if default else None
        found = SizeTable.one(resolved) if rows is None else SizeTable.from_rows(*rows)
    if not (scaled and default):
        return found
    return SizeTable(found.bounds, tuple(_q_scaled(s, arch) for s in found.specs))


def _q_scaled(spec: PrefillSpec, arch: Arch) -> PrefillSpec:
    """``spec`` with q_scaled where that validates on ``arch``, else ``spec``."""
    try:
        return replaced_if_valid(spec, arch, q_scaled=True) or spec
    except SpecError:  # a field q_scaled does not take (the softcap or ALiBi switch, the cp.async pipeline)
        return spec


def table_of(p: Problem, arch: Arch, tuned=()) -> SizeTable:
    return table(base_of(p), arch, p.spec is None, tuple(tuned) if p.spec is None else ())


def launch(p: Problem, spec: PrefillSpec, device: DeviceFacts) -> Launch:
    """The launch of ``spec`` for ``p`` (its TMA maps made: a persistent kernel's grid assumes them)."""
    if p.layout == CUSTOM_MASK:
        return Launch(())
    if p.layout >= VARLEN:
        return Launch(varlen_grid(p.rows, p.batch, p.heads, spec))
    if spec.tma and spec.is_persistent:
        return Launch(persistent_grid(p.rows, p.heads, p.batch, spec, device), True)
    return Launch(dense_grid(p.rows, p.heads, p.batch, spec))


def dense_grid(rows: int, heads: int, batch: int, spec: PrefillSpec) -> tuple:
    """One CTA a query tile of a head (of each of the chunked kernel's ``v_splits`` column parts)."""
    return (-(-rows // spec.cta_tile_q), heads * spec.v_splits, batch)


def persistent_grid(rows: int, heads: int, batch: int, spec: PrefillSpec, device: DeviceFacts) -> tuple:
    """As many CTAs as the SMs hold at once, or one a unit of two query tiles (the kernel's TileWalk)."""
    units = (-(-rows // spec.cta_tile_q) + 1) // 2 * heads * batch
    return (min(units, device.sm_count * max(1, device.occupancy(spec))), 1, 1)


def varlen_grid(total: int, batch: int, heads: int, spec: PrefillSpec) -> tuple:
    """One CTA a work-list slot: a sequence has at most ceil(len / tile) query tiles, so the batch fewer than
    total / tile + batch."""
    return (-(-total // spec.cta_tile_q) + batch, heads * spec.v_splits, 1)


def choose(p: Problem, device: DeviceFacts, tuned=()) -> Choice:
    """The resolved spec ``p`` runs on ``device`` and its launch. ``tuned``: the stored winners that apply
    (``tuned.tuned_choices``' (size, spec) list; read only where ``p`` has no spec of the caller's)."""
    spec = table_of(p, device.arch, tuned).spec_for(p.size)
    return Choice(spec, launch(p, spec, device))


def sync_twin(spec: PrefillSpec) -> PrefillSpec:
    """The cp.async kernel of a pipeline=tma ``spec``'s tiles, for inputs no TMA map can describe; of its KV tiles
    on two warpgroups where it has three (the cp.async kernel has no 12-warp form)."""
    twin = spec.replace(pipeline=Pipeline.SYNC, schedule=Schedule.SERIAL, persistent=Persistent.OFF)
    if twin.num_warps == 12:
        twin = twin.replace(cta_tile_q=128, num_warps=8)
    return twin.replace(q_scaled=False)  # (q_scaled: the TMA kernels')


def reachable(spec: PrefillSpec, arch: Arch) -> set:
    """Every resolved spec ``choose`` can return for a problem of ``spec``'s fields on ``arch`` (no stored winners):
    ``spec`` resolved, and where it pins no tuning field, each spec of its rule by rows."""
    resolved = resolve(spec, arch)
    if spec.pins_tuning:
        return {resolved}
    rows = by_rows(resolved, arch)
    return {resolved} if rows is None else {resolved, *rows[1]}
