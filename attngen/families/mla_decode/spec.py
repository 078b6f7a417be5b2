"""``MlaDecodeSpec``: the MLA decode family's spec, its fit rules and its template context.

The text of this module feeds the cache key (it decides what the template context holds); the
per-arch defaults live in ``defaults.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from ...arch import ARCHS, Arch
from ...errors import SpecError
from ...spec import DType, Mma, Pipeline, SpecBase, check_smem, check_wgmma_arch, coerce_bool, coerce_enum, coerce_int
from ..decode.spec import KVDType, coerce_kv_dtype

# The module's `_merge` entry: 4 warps per CTA, each merging MERGE_COLS columns of an output row. A warp's
# fixed work (its row's LSEs, their max and weights) is as many instructions as reading two splits of 64
# columns, and the merge is bound by instructions: 256 columns a warp merged two splits of 128 heads (batch 32)
# in 0.85x the time of 64.
MERGE_THREADS = 128
MERGE_COLS = 256
# Its `_merge_wide` entry: the MERGE_WIDE_WARPS warps of a CTA share one row's MERGE_WIDE_COLS columns, each
# taking a share of the splits, with registers for four CTAs an SM (a batch-1 step of 16 heads has 128 such
# chunks and 64-132 splits; one warp a chunk waited on memory once every 8 splits). It keeps 64 columns: a
# batch-1 step has few rows, and wider chunks left SMs idle (256 columns: 1.08x the time at 128 heads, 8k keys).
MERGE_WIDE_COLS = 64
MERGE_WIDE_WARPS = 8
# Its `_merge_fine` entry: `_merge` over MERGE_FINE_COLS columns a warp, for launches of few rows, where 256 columns
# a warp leave too few warps to keep the memory busy (128 heads, batch 1, 32 splits: 1.08x the time of 64).
MERGE_FINE_COLS = 64
# The merge entries that launch with programmatic dependent launch (MlaDecodeSpec.PDL_ENTRIES).
PDL_MERGE_ENTRIES = ("_merge", "_merge_fine", "_merge_wide")
# Accumulator registers per thread (O slice + S) past which ptxas spilled in the chunked prefill
# kernel of the same shape of loop (NVRTC 13.5); the MLA kernel keeps less besides.
MAX_ACC_REGS = 176


class QkShard(enum.Enum):
    """How the warps of one row tile make S. ``auto`` (the default) lets ``resolve`` choose for
    the arch, so it is falsy like the other unresolved tuning fields."""

    AUTO = "auto"
    TRUE = "true"    # the tile's keys split over the warps; P all-gathered through shared memory
    FALSE = "false"  # every warp computes S for the whole tile; no exchange
    ALTERNATE = "alternate"  # wgmma: the two warpgroups take alternate tiles whole, trading P and the row max

    def __bool__(self) -> bool:
        return self is not QkShard.AUTO


def _coerce_shard(value) -> QkShard:
    if isinstance(value, bool):
        return QkShard.TRUE if value else QkShard.FALSE
    if isinstance(value, str) and value.strip().lower() in ("1", "yes", "0", "no"):
        return QkShard.TRUE if value.strip().lower() in ("1", "yes") else QkShard.FALSE
    return coerce_enum(QkShard, "qk_shard", value)


@dataclass(frozen=True)
class MlaDecodeSpec(SpecBase):
    """MLA decode (DeepSeek-V2/V3's absorbed form): every query head against one shared cache of
    ``kv_lora_rank`` (ckv) + ``rope_dim`` (kpe) columns per token; the output is ``kv_lora_rank``
    wide.

    One CTA takes ``q_rows`` packed query rows (token x head) of one sequence over one split of the
    cache. Tuning fields (``qk_shard``, ``cta_tile_kv``, ``num_warps``, ``num_stages``, ``mma``)
    take 0 / ``auto`` for the arch's default, chosen from its shared memory. ``mma=wgmma``
    (sm_90a, 64 rows, 8 warps: two warpgroups, one per half of the output columns) reads Q and the
    cache tile from shared memory through descriptors instead of per-warp ``ldmatrix``.
    ``pipeline=tma`` (sm_90a, the default there with either ``mma``) has one thread load the cache
    tiles as TMA boxes into an mbarrier ring instead of every thread issuing cp.async.
    ``kv_dtype`` (``fp8_e4m3``, ``fp8_e5m2``; None: the cache in q's dtype) reads an fp8 cache: the mma.sync kernel
    on the cp.async ring widens it to fp16 in registers (any arch), the wgmma kernel on the TMA ring (sm_90a, 64
    rows, 32- or 64-key tiles) into fp16 in shared memory, by a producer warpgroup of its own (128 threads
    more). ``cluster_merge`` (the wgmma kernel with ``qk_shard=true`` over a 16-bit cache only) compiles in the merge
    of a row block's splits in the shared memory of their thread-block cluster, which the mma.sync kernels always
    have where it fits; ``attngen.mla_decode`` takes that form where it merges in a cluster.
    """

    family: ClassVar[str] = "mla_decode"

    KV_LORA_RANKS: ClassVar[tuple[int, ...]] = (256, 512)
    KV_DTYPES: ClassVar[tuple] = (None, *KVDType)
    ROPE_DIMS: ClassVar[tuple[int, ...]] = (32, 64)
    Q_ROWS: ClassVar[tuple[int, ...]] = (16, 32, 64)
    CTA_TILE_KV: ClassVar[tuple[int, ...]] = (0, 16, 32, 64)
    NUM_WARPS: ClassVar[tuple[int, ...]] = (0, 4, 8)
    NUM_STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2, 3, 4)
    TUNING_FIELDS: ClassVar[tuple[str, ...]] = ("qk_shard", "cta_tile_kv", "num_warps", "num_stages", "mma", "pipeline")
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("kv_lora_rank", "rope_dim", "dtype", "q_rows", "paged")

    kv_lora_rank: int = 512
    rope_dim: int = 64
    dtype: DType = DType.BF16
    q_rows: int = 64
    paged: bool = False
    # None: the cache holds q's dtype; else its fp8 format (the scale is a call argument). Left out of to_dict
    # while None, so the specs (names, keys) of caches in q's dtype stay as they were.
    kv_dtype: KVDType | None = None
    qk_shard: QkShard = QkShard.AUTO
    cta_tile_kv: int = 0
    num_warps: int = 0
    num_stages: int = 0
    mma: Mma = Mma.AUTO
    pipeline: Pipeline = Pipeline.AUTO
    # The wgmma kernel (sharded S, 16-bit cache) with the splits' cluster merge compiled in (the mma.sync kernels
    # always have it where it fits). Compiled into the plain wgmma kernel, the path slowed that kernel's other
    # launches, so it is a kernel of its own, which mla_decode's choice takes where it merges in a cluster. Left out
    # of to_dict while false, so the other specs' names and keys stay as they were.
    cluster_merge: bool = False
    # Paged blocks of any size (SGLang's page 1, 8, 24, ...): a table lookup for every key row of a tile (the other
    # kernels look up one block per 16-row group, so their blocks are whole multiples of 16), the rows copied by
    # cp.async. With pipeline=tma (sm_90a) the ring is the TMA kernels' mbarrier ring, but a producer warpgroup of its
    # own gathers each tile into it by cp.async (a TMA box per key row would be a copy per row and column block);
    # with pipeline=sync every thread copies, as in the cp.async kernels. Left out of to_dict while false.
    page_rows: bool = False
    # Paged blocks smaller than a tile on the TMA ring (blocks of 16, 32, 48, ...: several TMA boxes a tile): a warp
    # issues each tile's boxes, a lane a box looking up its own block, where one thread otherwise looks the blocks up
    # one after another. A kernel of its own: compiled into the kernel of whole-tile blocks, the path slowed its
    # launches over blocks of 64 by 2-8% (128 heads). Left out of to_dict while false.
    box_lanes: bool = False

    def __post_init__(self):
        s = object.__setattr__
        s(self, "kv_lora_rank", coerce_int("kv_lora_rank", self.kv_lora_rank, self.KV_LORA_RANKS))
        s(self, "rope_dim", coerce_int("rope_dim", self.rope_dim, self.ROPE_DIMS))
        s(self, "dtype", coerce_enum(DType, "dtype", self.dtype))
        s(self, "q_rows", coerce_int("q_rows", self.q_rows, self.Q_ROWS))
        s(self, "paged", coerce_bool("paged", self.paged))
        s(self, "kv_dtype", coerce_kv_dtype(self.kv_dtype))
        s(self, "qk_shard", _coerce_shard(self.qk_shard))
        s(self, "cta_tile_kv", coerce_int("cta_tile_kv", self.cta_tile_kv, self.CTA_TILE_KV))
        s(self, "num_warps", coerce_int("num_warps", self.num_warps, self.NUM_WARPS))
        s(self, "num_stages", coerce_int("num_stages", self.num_stages, self.NUM_STAGES))
        s(self, "mma", coerce_enum(Mma, "mma", self.mma))
        s(self, "pipeline", coerce_enum(Pipeline, "pipeline", self.pipeline))
        s(self, "cluster_merge", coerce_bool("cluster_merge", self.cluster_merge))
        s(self, "page_rows", coerce_bool("page_rows", self.page_rows))
        if self.page_rows and not self.paged:
            raise SpecError("page_rows", True, "false with paged=false", reason="a contiguous cache has no blocks")
        s(self, "box_lanes", coerce_bool("box_lanes", self.box_lanes))
        if self.box_lanes and not self.paged:
            raise SpecError("box_lanes", True, "false with paged=false", reason="a contiguous cache has no blocks")
        # (pins that contradict each other only; a resolved spec's pair is checked by check)
        if self.fp8 and (self.alternate or (self.wgmma and self.pipeline is Pipeline.SYNC)
                         or (self.tma and self.mma is Mma.SYNC)):
            self._refuse_fp8()

    def _refuse_fp8(self):
        raise SpecError("kv_dtype", self.kv_dtype.value, "unset (the cache in q's dtype), or an fp8 cache with "
                        "mma=mma_sync and pipeline=sync, or mma=wgmma and pipeline=tma, and qk_shard true or false",
                        reason=f"fp8 tiles are read by the mma.sync kernel on the cp.async ring or, widened in shared "
                               f"memory, by the wgmma kernel on the TMA ring; the spec has mma={self.mma.value}, "
                               f"pipeline={self.pipeline.value}, qk_shard={self.qk_shard.value}")

    @staticmethod
    def rows_for(heads: int, q_len: int) -> int:
        """The q_rows a CTA takes for heads x q_len packed rows: the smallest that holds them all,
        else 64 (the rows are then cut into several blocks, each reading the cache)."""
        need = heads * q_len
        return next((r for r in MlaDecodeSpec.Q_ROWS if need <= r), MlaDecodeSpec.Q_ROWS[-1])

    def to_dict(self) -> dict:
        d = super().to_dict()
        if d["kv_dtype"] is None:
            del d["kv_dtype"]
        if not d["cluster_merge"]:
            del d["cluster_merge"]
        if not d["page_rows"]:
            del d["page_rows"]
        if not d["box_lanes"]:
            del d["box_lanes"]
        return d

    @property
    def fp8(self) -> bool:
        return self.kv_dtype is not None

    @property
    def fp8_row_bytes(self) -> int:
        """Bytes of an fp8 cache row (ckv then kpe) in the ring: an odd number of 16-byte chunks
        (``FP8_ROW_BYTES`` in mla_decode/fwd.cuh)."""
        return ((self.kv_lora_rank + self.rope_dim) // 16 | 1) * 16

    # --- derived: the warp grid (see mla_decode/fwd.cuh) -----------------------------------------
    @property
    def sharded(self) -> bool:
        return self.qk_shard is QkShard.TRUE

    @property
    def wgmma(self) -> bool:
        return self.mma is Mma.WGMMA

    @property
    def alternate(self) -> bool:
        return self.qk_shard is QkShard.ALTERNATE

    @property
    def tma(self) -> bool:
        return self.pipeline is Pipeline.TMA

    @property
    def warps_m(self) -> int:
        """Row tiles of 16: one warp each."""
        return self.q_rows // 16

    @property
    def warps_n(self) -> int:
        self._require_resolved("warps_n")
        return self.num_warps // self.warps_m

    @property
    def producer_wg(self) -> bool:
        """A producer warpgroup past the num_warps consumer warps (``PRODUCER_WG`` in mla_decode/fwd.cuh): an fp8
        cache on the wgmma kernel (it loads and widens the tiles), or page_rows on the TMA ring (it gathers them)."""
        return (self.fp8 and self.wgmma) or self.gather

    @property
    def gather(self) -> bool:
        """page_rows on the TMA ring: a producer warpgroup gathers each tile's key rows by cp.async (``GATHER`` in
        mla_decode/fwd.cuh, mla_decode/gather.cuh)."""
        return self.page_rows and self.tma

    @property
    def threads(self) -> int:
        self._require_resolved("threads")
        return 32 * self.num_warps + (128 if self.producer_wg else 0)

    def smem_bytes(self) -> int:
        """Q, the ring of cache tiles (ckv and kpe in one row), P when sharded, and the row exchange
        (WARPS_N x q_rows floats). mma_sync pads each row by 8 elements; wgmma stores 64-column
        blocks of 128-byte rows (the last block whole even when the row ends inside it), P in one
        such block, and keeps 1024 bytes of slack to align the first tile to a swizzle atom (mma_sync on the
        TMA ring: its tiles as wgmma's, Q and P padded, Q to a whole 1024-byte atom); TMA adds
        one 8-byte mbarrier a stage (two with qk_shard=alternate, one per half of the tile; two with page_rows, full
        and read; four with both, each half's full and free). Alternate
        tiles keep P of one warpgroup where Q's rope block was (that block moves to registers), of the
        other in its own block, and four floats a row for the row maxima and their rescale factors. An fp8 cache's
        mma.sync ring holds rows of ``fp8_row_bytes``, its Q (fp16) and P as the 16-bit kernel's; on the wgmma kernel
        everything is the 16-bit kernel's (the fp8 tile lands inside the slot it is widened in) but three mbarriers a
        stage."""
        self._require_resolved("smem_bytes")
        q_elems, row, p_row, slack = self._layout()
        elems = q_elems + (self.num_stages * self.cta_tile_kv * self.fp8_row_bytes // 2 if self.fp8 and not self.wgmma
                           else self.num_stages * self.cta_tile_kv * row)
        if self.sharded or self.alternate:
            elems += self.q_rows * p_row
        floats = self.warps_n * self.q_rows + (4 * self.q_rows if self.alternate else 0)
        bars = self.num_stages * (4 if self.alternate and self.gather else 2 if self.alternate or self.gather
                                  else 3 if self.producer_wg else 1) if self.tma else 0
        return 2 * elems + 4 * floats + slack + 8 * bars

    def _layout(self) -> tuple[int, int, int, int]:
        """(Q's elements, a ring row's elements, a P row's elements, alignment slack in bytes)."""
        dqk = self.kv_lora_rank + self.rope_dim
        blocks = -(-dqk // 64) * 64
        if self.wgmma:
            return self.q_rows * blocks, blocks, 64, 1024
        if self.tma:  # mma.sync on the TMA ring: swizzled tiles, Q padded to a whole 1024-byte atom
            return -(-self.q_rows * (dqk + 8) // 512) * 512, blocks, self.cta_tile_kv + 8, 1024
        return self.q_rows * (dqk + 8), dqk + 8, self.cta_tile_kv + 8, 0

    def cluster_merge_fits(self) -> bool:
        """Whether the splits of a row block may merge in one cluster (sm_90): an mma_sync kernel, or the wgmma
        kernel with ``cluster_merge``, over whose Q and ring its normalised fp32 rows fit with their LSE (32 rows
        or more: the rows a CTA merges, from up to 8 splits; ``CLUSTER_FITS`` in mla_decode/fwd.cuh); never over
        fp8 tiles (not built there)."""
        self._require_resolved("cluster_merge_fits")
        q_elems, row, _, _ = self._layout()
        rows = self.q_rows + (7 if self.q_rows >= 32 else 0)
        return ((not self.wgmma or self.cluster_merge) and not self.fp8 and not self.gather
                and 4 * rows * (self.kv_lora_rank + 1) <= 2 * (q_elems + self.num_stages * self.cta_tile_kv * row))

    def name_parts(self) -> tuple[str, ...]:
        """Latent and rope dims, dtype, packed rows, paged, the fp8 cache format, how S is split, KV tile, warps
        and stages, mma, pipeline; unset tuning fields left out."""
        shard = {QkShard.TRUE: "qkshard", QkShard.FALSE: "qkwhole", QkShard.ALTERNATE: "qkalt"}
        return (f"ckv{self.kv_lora_rank}", f"kpe{self.rope_dim}", self.dtype.value, f"rows{self.q_rows}",
                "paged" if self.paged else "", self.kv_dtype.value[4:] if self.fp8 else "",
                shard.get(self.qk_shard, ""), self.name_piece("k{}", self.cta_tile_kv),
                self.name_piece("w{}s{}", self.num_warps, self.num_stages),
                {Mma.SYNC: "mma", Mma.WGMMA: "wgmma"}.get(self.mma, ""), "tma" if self.pipeline is Pipeline.TMA else "",
                "clmerge" if self.cluster_merge else "", "prow" if self.page_rows else "",
                "blanes" if self.box_lanes else "")

    def launch_shapes(self) -> tuple[tuple[str, int, int], ...]:
        return (("", self.threads, self.smem_bytes()), ("_merge", MERGE_THREADS, 0),
                ("_merge_fine", MERGE_THREADS, 0), ("_merge_wide", 32 * MERGE_WIDE_WARPS, 0))

    @property
    def PDL_ENTRIES(self) -> tuple[str, ...]:  # noqa: N802 (Spec.PDL_ENTRIES, per spec here)
        """The merge entries launch with programmatic dependent launch on sm_90 and newer for the mma.sync kernels'
        row blocks (16 and 32 rows), whose main entry lets them start launching as soon as its CTAs have all started:
        the merge's launch then overlaps the split launch's tail. Not for 64-row blocks (the wgmma kernel), where the
        merge edge measured slower with it (BENCHMARKS, levers)."""
        return PDL_MERGE_ENTRIES if self.q_rows <= 32 else ()

    def template_context(self) -> dict:
        ctx = super().template_context()
        ctx.update(pdl_merge=bool(self.PDL_ENTRIES),
                   merge_threads=MERGE_THREADS, merge_cols=MERGE_COLS, merge_fine_cols=MERGE_FINE_COLS,
                   merge_wide_cols=MERGE_WIDE_COLS,
                   merge_wide_warps=MERGE_WIDE_WARPS,
                   wgmma=self.wgmma, tma=self.tma, alternate=self.alternate,
                   kv_fp8=0 if self.kv_dtype is None else 1 + list(KVDType).index(self.kv_dtype),
                   cluster_fits=self.cluster_merge_fits(), cluster_wgmma=self.cluster_merge,
                   one_cta=self.one_cta_an_sm(), two_ctas=self.two_ctas(), page_rows=self.page_rows,
                   box_lanes=self.box_lanes)
        return ctx

    def two_ctas(self) -> bool:
        """Whether the gather kernel (``gather``) holds two CTAs an SM: four consumer warps and shared memory for two,
        its launch bounds then asking ptxas for that many and its warpgroups' register counts halving the file
        (mla_decode/gather.cuh)."""
        return self.gather and self.num_warps == 4 and not self.one_cta_an_sm()

    def one_cta_an_sm(self) -> bool:
        """Whether the kernel's shared memory (with the 1 KB an SM reserves for each CTA) leaves no room for a second
        CTA on any arch's SM. Such a kernel says so to ptxas (``__launch_bounds__``' minimum of one block): left to
        guess, ptxas aimed some 256-thread kernels at two CTAs an SM, held them to 128 registers a thread and
        spilled."""
        return 2 * (self.smem_bytes() + 1024) > max(a.smem_per_sm for a in ARCHS.values())

    # --- fit ---------------------------------------------------------------------------------
    def check(self, a: Arch) -> None:
        if self.num_warps < self.warps_m:
            raise SpecError("num_warps", self.num_warps, f"at least {self.warps_m}",
                            reason=f"each warp takes 16 of the q_rows={self.q_rows} rows")
        wn = self.warps_n
        if self.sharded and (self.cta_tile_kv // wn) % 8:
            raise SpecError("qk_shard", "true", f"false, or a cta_tile_kv that is a multiple of {8 * wn}",
                            reason=f"sharding splits each KV tile's keys over the {wn} warps of a row tile and "
                                   f"each needs whole 8-key MMA columns (cta_tile_kv={self.cta_tile_kv})")
        out_cols = self.kv_lora_rank // wn
        keys = self.cta_tile_kv // wn if self.sharded else self.cta_tile_kv
        acc = out_cols // 2 + keys // 2
        if acc > MAX_ACC_REGS:
            raise SpecError("num_warps", self.num_warps, "more warps (8), a smaller cta_tile_kv or a smaller q_rows",
                            reason=f"needs about {acc} accumulator registers per thread (limit {MAX_ACC_REGS}): "
                                   f"{out_cols} output columns and {keys} keys of S per warp")
        if self.alternate and not (self.wgmma and self.tma and self.cta_tile_kv == 64 and self.num_stages == 2):
            raise SpecError("qk_shard", "alternate", "true, false",
                            reason=f"alternate tiles are a form of the wgmma kernel with the TMA ring, 64-key tiles "
                                   f"and two stages (mma=wgmma, pipeline=tma, cta_tile_kv=64, num_stages=2); the spec "
                                   f"has mma={self.mma.value}, pipeline={self.pipeline.value}, "
                                   f"cta_tile_kv={self.cta_tile_kv}, num_stages={self.num_stages}")
        if self.fp8 and self.wgmma != self.tma:
            self._refuse_fp8()
        if self.page_rows and self.fp8 and self.tma:
            raise SpecError("page_rows", "true", "false (blocks of a multiple of 16)",
                            reason=f"blocks of any size are gathered by a producer warpgroup into the TMA ring for "
                                   f"the 16-bit kernels, or read by the mma.sync kernel on the cp.async ring for an "
                                   f"fp8 cache; the spec has pipeline={self.pipeline.value}, "
                                   f"kv_dtype={self.kv_dtype.value}")
        if self.box_lanes and not (self.tma and not self.page_rows and not self.fp8):
            raise SpecError("box_lanes", "true", "false",
                            reason=f"box_lanes is a form of the kernels that load a paged 16-bit cache as TMA boxes "
                                   f"(pipeline=tma, page_rows=false, kv_dtype unset); the spec has "
                                   f"pipeline={self.pipeline.value}, page_rows={str(self.page_rows).lower()}, "
                                   f"kv_dtype={self.kv_dtype.value if self.fp8 else 'unset'}")
        if self.cluster_merge and not (self.wgmma and self.sharded and not self.fp8):
            raise SpecError("cluster_merge", "true", "false",
                            reason=f"cluster_merge is a form of the wgmma kernel with qk_shard=true over a 16-bit "
                                   f"cache (the mma.sync kernels merge in a cluster without it); the spec has "
                                   f"mma={self.mma.value}, qk_shard={self.qk_shard.value}, "
                                   f"kv_dtype={self.kv_dtype.value if self.fp8 else 'unset'}")
        if self.wgmma:
            self._check_wgmma(a)
        elif self.tma and not a.has_wgmma:
            raise SpecError("pipeline", "tma", "sync", reason=f"the TMA ring needs sm_90a; the target is {a.name}")
        check_smem(self, a, "num_stages", "a smaller num_stages or cta_tile_kv, or qk_shard=false")

    def _check_wgmma(self, a: Arch) -> None:
        check_wgmma_arch(self, a)
        if self.q_rows != 64 or self.num_warps != 8:
            raise SpecError("mma", self.mma.value, "mma_sync",
                            reason=f"wgmma takes q_rows=64 on num_warps=8 (two warpgroups of 64 rows, one per half "
                                   f"of the output columns); the spec has q_rows={self.q_rows}, "
                                   f"num_warps={self.num_warps}")
        if self.fp8 and self.cta_tile_kv < 32:
            raise SpecError("cta_tile_kv", self.cta_tile_kv, "32, 64",
                            reason="an fp8 tile is widened by runs of 32 keys (mla_decode/fp8_wgmma.cuh)")
        keys = self.cta_tile_kv // 2 if self.sharded else self.cta_tile_kv
        if keys < 16:
            raise SpecError("cta_tile_kv", self.cta_tile_kv, "32, 64" if self.sharded else "16, 32, 64",
                            reason=f"each warpgroup's part of S is a wgmma at least 16 keys wide (qk_shard="
                                   f"{self.qk_shard.value})")
