"""``DecodeSpec``: the decode family's spec, its fit rules, its template context and its entries.

The text of this module feeds the cache key (it decides what the template context holds); the
measured per-arch defaults live in ``defaults.py``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from ...arch import Arch
from ...errors import SpecError
from .. import snippets
from ...spec import DType, SpecBase, check_smem, coerce_bool, coerce_enum, coerce_int, variant_list

# Threads of a decode module's `_merge` entry: one warp per output row.
MERGE_THREADS = 128

HEAD_DIMS_TEXT = "a multiple of 8 from 32 to 256, or 512"


def coerce_kv_dtype(value) -> KVDType | None:
    """None (also the text "none", as ``to_text(full=True)`` writes it) or an fp8 format."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "none"):
        return None
    return coerce_enum(KVDType, "kv_dtype", value)


def head_dim_refusal(d: int) -> str:
    """Why ``d`` is not a decode head dim (for a ``head_dim`` error)."""
    if d > 256:
        return "past 256 the output columns are split between two CTAs a KV head, which only 512 was built for"
    return "rows are copied and multiplied in 8-column (16-byte) chunks, at least 4 of them"


class KVDType(enum.Enum):
    """The K/V cache's format where it is not q's dtype: 8-bit floats, widened to fp16 on the chip."""

    FP8_E4M3 = "fp8_e4m3"  # 1-4-3, max 448 (no infinities)
    FP8_E5M2 = "fp8_e5m2"  # 1-5-2, max 57344


# What an fp8 cache runs with: the fused kernel (fp8 tiles in its ring, widened as the warps read them), head dims
# a multiple of 16 (16-byte chunks of 16 keys' bytes) up to 256, no softcap or ALiBi (their per-call
# constants are in units of the raw score, which the per-head k_scale changes).
FP8_HEAD_DIMS_TEXT = "a multiple of 16 from 32 to 256"


class Variant(enum.Enum):
    FUSED = "fused"      # one kernel: S = Q K^T, online softmax and O += P V per KV tile
    UNFUSED = "unfused"  # QK^T + per-row max/sum to a workspace, then a second kernel for P V


@dataclass(frozen=True)
class DecodeSpec(SpecBase):
    """Decode against a KV cache: q_len 1..8 new tokens per sequence, GQA-packed.

    One CTA serves every query head of one KV head (``q_rows`` = group x q_len packed rows,
    rounded up to a multiple of 16) over one split of the cache, so each K/V byte is read
    once per split. ``paged`` addresses the cache through a block table. Partial results of
    several splits are merged through their LSE by the module's ``_merge`` entry.
    Tuning fields (``cta_tile_kv``, ``num_warps``, ``num_stages``) take 0 for the arch's default.
    """

    family: ClassVar[str] = "decode"
    # Not the merge: launched early, its CTAs sit on the SMs while the split kernel still runs, which
    # cost more on a paged cache with many rows a CTA than it gained elsewhere.
    PDL_ENTRIES: ClassVar[tuple[str, ...]] = ("", "_pv")

    # Multiples of 64 keep swizzled rows; the other multiples of 8 a padded row (decode/params.cuh). At 512 (Gemma's
    # global layers) two CTAs share each KV head, each computing half the output columns (``d_parts``).
    HEAD_DIMS: ClassVar[tuple[int, ...]] = (*range(32, 257, 8), 512)
    Q_ROWS: ClassVar[tuple[int, ...]] = (16, 32, 64, 128)
    KV_DTYPES: ClassVar[tuple] = (None, *KVDType)
    CTA_TILE_KV: ClassVar[tuple[int, ...]] = (0, 16, 32, 64, 128)
    NUM_WARPS: ClassVar[tuple[int, ...]] = (0, 4, 8)
    NUM_STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2, 3, 4)
    TUNING_FIELDS: ClassVar[tuple[str, ...]] = ("cta_tile_kv", "num_warps", "num_stages")
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("head_dim", "dtype", "q_rows", "paged", "variant")

    head_dim: int = 128
    dtype: DType = DType.BF16
    q_rows: int = 16
    paged: bool = False
    variant: Variant = Variant.FUSED
    softcap: bool = False   # logit capping cap * tanh(s / cap); the cap is a call argument
    alibi: bool = False     # ALiBi bias -slope * |i - j|; the per-head slopes are a call argument
    # per-row key bounds: a sliding window (left, right) about each query's position and a left pad
    # (the row's first cache position); both are call arguments
    local: bool = False
    # attention sinks (gpt-oss): a per-query-head logit that joins each row's softmax denominator and adds no value;
    # the sinks are a call argument
    sinks: bool = False
    # None: the cache holds q's dtype; else its fp8 format (the scales are call arguments). Left out of
    # to_dict while None, so the specs (names, keys, stored tunings) of caches in q's dtype stay as they were.
    kv_dtype: KVDType | None = None
    # A packed, ragged q (``cu_seqlens_q``): each CTA reads its request's token count and its first q row on the
    # device, and the LSE is [heads, total_q]; ``tree`` adds per-token 64-bit masks over the request's draft tokens
    # (speculative decoding). Both left out of to_dict while off, so every other spec keeps its name and key.
    varlen_q: bool = False
    tree: bool = False
    # Paged caches: each key row finds its block in the table (``pos / block_size``), so blocks of any size (1, 24,
    # ...) work; off, one lookup serves a 16-row group of a tile, which needs blocks of a multiple of 16 positions.
    # The fp8 kernels and the padded-row kernels (head dims not a multiple of 64, and 192) look up every row
    # either way. Left out of to_dict while off, so every other spec keeps its name and key.
    page_rows: bool = False
    cta_tile_kv: int = 0
    num_warps: int = 0
    num_stages: int = 0
    # A user's variant (attngen/families/snippets.py, docs/variants.md), as PrefillSpec's: "" (off) is left out
    # of the spec's dict and key. The fused kernel on a cache in q's dtype runs them.
    score_mod: str = ""
    mask_mod: str = ""
    aux: str = ""

    def __post_init__(self):
        s = object.__setattr__
        d = self.head_dim
        if isinstance(d, int) and not isinstance(d, bool) and d.bit_length() <= 64 and d not in self.HEAD_DIMS:
            raise SpecError("head_dim", d, HEAD_DIMS_TEXT, reason=head_dim_refusal(d))
        s(self, "head_dim", coerce_int("head_dim", d, self.HEAD_DIMS))
        s(self, "dtype", coerce_enum(DType, "dtype", self.dtype))
        s(self, "q_rows", coerce_int("q_rows", self.q_rows, self.Q_ROWS))
        s(self, "paged", coerce_bool("paged", self.paged))
        s(self, "variant", coerce_enum(Variant, "variant", self.variant))
        s(self, "softcap", coerce_bool("softcap", self.softcap))
        s(self, "alibi", coerce_bool("alibi", self.alibi))
        s(self, "local", coerce_bool("local", self.local))
        s(self, "sinks", coerce_bool("sinks", self.sinks))
        s(self, "kv_dtype", coerce_kv_dtype(self.kv_dtype))
        s(self, "varlen_q", coerce_bool("varlen_q", self.varlen_q))
        s(self, "tree", coerce_bool("tree", self.tree))
        s(self, "page_rows", coerce_bool("page_rows", self.page_rows))
        if self.page_rows and not self.paged:
            raise SpecError("page_rows", True, "false with paged=false", reason="a contiguous cache has no blocks")
        s(self, "cta_tile_kv", coerce_int("cta_tile_kv", self.cta_tile_kv, self.CTA_TILE_KV))
        s(self, "num_warps", coerce_int("num_warps", self.num_warps, self.NUM_WARPS))
        s(self, "num_stages", coerce_int("num_stages", self.num_stages, self.NUM_STAGES))
        if self.d_parts > 1 and self.variant is Variant.UNFUSED:
            raise SpecError("variant", self.variant.value, "fused", reason=f"head_dim={self.head_dim} splits the output "
                            "columns between CTAs, which only the fused kernel does")
        if self.kv_dtype is not None:
            self._check_fp8()
        if self.varlen_q or self.tree:
            self._check_varlen_q()
        score_mod, mask_mod, aux = snippets.check_spec_fields(self)
        s(self, "score_mod", score_mod)
        s(self, "mask_mod", mask_mod)
        s(self, "aux", aux)
        if score_mod or mask_mod or aux:
            for name, value, bad in (("variant", self.variant.value, self.variant is Variant.UNFUSED),
                                     ("kv_dtype", getattr(self.kv_dtype, "value", None), self.kv_dtype is not None)):
                if bad:
                    raise SpecError(name, value, "fused" if name == "variant" else "unset (the cache in q's dtype)",
                                    reason="score_mod, mask_mod and aux run in the fused kernel on a cache in q's "
                                           "dtype only")

    def _check_fp8(self) -> None:
        """What an fp8 cache runs with (see FP8_HEAD_DIMS_TEXT): each refusal names kv_dtype and the other field."""
        kv = self.kv_dtype.value
        for bad, why in (
                (self.head_dim % 16 or self.head_dim > 256, f"with head_dim={self.head_dim}, which is not "
                 f"{FP8_HEAD_DIMS_TEXT} (fp8 rows are copied in 16-byte chunks, one CTA a KV head)"),
                (self.variant is Variant.UNFUSED, "with variant=unfused (an fp8 cache runs the fused kernel)"),
                (self.softcap, "with softcap=true (not built for fp8 caches)"),
                (self.alibi, "with alibi=true (not built for fp8 caches)")):
            if bad:
                raise SpecError("kv_dtype", kv, f"unset (the cache in q's dtype), or an fp8 cache with head_dim "
                                f"{FP8_HEAD_DIMS_TEXT}, variant=fused, softcap=false, alibi=false", reason=why)

    def _check_varlen_q(self) -> None:
        """What a packed, ragged q runs with: the fused kernel (on a cache in q's dtype or fp8), head dims up to 256
        (one CTA a KV head), no user snippets; a tree needs the packed q and no window (the tree replaces
        causality)."""
        for name, value, bad, allowed in (
                ("tree", self.tree, self.tree and not self.varlen_q, "false without varlen_q=true"),
                ("variant", self.variant.value, self.variant is Variant.UNFUSED, "fused"),
                ("head_dim", self.head_dim, self.d_parts > 1, "at most 256"),
                ("local", self.local, self.tree and self.local, "false with tree=true"),
                ("score_mod", self.score_mod, bool(self.score_mod or self.mask_mod or self.aux), "empty")):
            if bad:
                raise SpecError(name, value, allowed, reason="with varlen_q (a packed, ragged q) and tree")

    def to_dict(self) -> dict:
        d = super().to_dict()
        if d["kv_dtype"] is None:
            del d["kv_dtype"]
        for name in ("varlen_q", "tree", "page_rows"):
            if not d[name]:
                del d[name]
        return d

    def untuned_dict(self) -> dict:
        d = self.to_dict()
        return {k: v for k, v in d.items() if k != "family" and k not in self.TUNING_FIELDS}

    @property
    def kv_itemsize(self) -> int:
        """Bytes of a cache element."""
        return 1 if self.kv_dtype is not None else self.dtype.itemsize

    @property
    def fp8_row_bytes(self) -> int:
        """Bytes of an fp8 K or V row in the ring (decode/fp8_consumer.cuh's ROW_BYTES): the head dim where its
        16-byte chunks are a power of two (swizzled rows), else padded to an odd number of chunks."""
        chunks = self.head_dim // 16
        return self.head_dim if chunks & (chunks - 1) == 0 else (chunks | 1) * 16

    @staticmethod
    def rows_for(group: int, q_len: int) -> int:
        """The smallest q_rows that holds group x q_len packed query rows."""
        need = group * q_len
        for r in DecodeSpec.Q_ROWS:
            if need <= r:
                return r
        raise SpecError("q_rows", need, "at most 128 packed rows (GQA group x q_len)")

    # --- derived: how the warps split the CTA's work ----------------------------------------
    @property
    def warps_m(self) -> int:
        """Warps along the packed query rows; the rest split each KV tile's keys."""
        self._require_resolved("warps_m")
        return min(self.num_warps, self.q_rows // 16)

    @property
    def warps_n(self) -> int:
        return self.num_warps // self.warps_m

    @property
    def m_tiles(self) -> int:
        return self.q_rows // 16 // self.warps_m

    @property
    def q_in_regs(self) -> bool:
        return self.head_dim * self.m_tiles <= 128

    @property
    def d_parts(self) -> int:
        """CTAs a KV head, each holding ``d_out`` of the output columns (2 past head_dim 256: a row's fp32 output
        would pass a thread's registers)."""
        return 2 if self.head_dim > 256 else 1

    @property
    def d_out(self) -> int:
        return self.head_dim // self.d_parts

    @property
    def row_elems(self) -> int:
        """Elements of a Q, K or V row in shared memory: the head dim (swizzled rows, multiples of 64),
        else padded to an odd number of 16-byte chunks past the next multiple of 16 (``DecodeShape::ROW_ELEMS``)."""
        d = self.head_dim
        return d if d % 64 == 0 else -(-d // 16) * 16 + 8

    @property
    def threads(self) -> int:
        self._require_resolved("threads")
        return 32 * self.num_warps

    def smem_bytes(self) -> int:
        """The Q tile and the cp.async ring (K and V tiles; for the unfused kernels, V tiles with
        their fp32 scores) during the KV loop; after it, the same bytes hold the per-row max/sum
        of every warp and the fp32 partial outputs of the warps past the first along the keys."""
        self._require_resolved("smem_bytes")
        row = self.row_elems * self.dtype.itemsize
        q = self.q_rows * row
        ring = self.num_stages * self.cta_tile_kv * row * 2
        if self.kv_dtype is not None:
            # the ring holds fp8 K and V rows, which the warps widen in registers
            ring = self.num_stages * self.cta_tile_kv * self.fp8_row_bytes * 2
        if self.variant is Variant.UNFUSED:
            # the P V kernel stages fp32 scores (q_rows x cta_tile_kv, padded) next to each V tile
            ring = self.num_stages * (self.cta_tile_kv * row + self.q_rows * (self.cta_tile_kv + 4) * 4)
        combine = ((self.warps_n - 1) * self.q_rows * (self.d_out + 4) + 2 * self.warps_n * self.q_rows) * 4
        return max(q + ring, combine)

    def cluster_merge_bytes(self) -> int:
        """The shared memory the fused kernel's epilogue uses when the splits of a (batch, kv head)
        run as one cluster and merge there (sm_90): the combine area above, rounded to 16 bytes,
        then the CTA's normalised fp32 output rows and their LSE (``PART_AT`` in decode/end.cuh)."""
        self._require_resolved("cluster_merge_bytes")
        combine = 2 * self.warps_n * self.q_rows + (self.warps_n - 1) * self.q_rows * (self.head_dim + 4)
        return 4 * (-(-combine // 4) * 4 + self.q_rows * self.head_dim + self.q_rows)

    def name_parts(self) -> tuple[str, ...]:
        """Head dim, dtype, packed rows, paged, the unfused variant, score flags, per-row key bounds, sinks, the fp8
        cache format, KV tile, warps and stages."""
        return (f"d{self.head_dim}", self.dtype.value, f"rows{self.q_rows}", "paged" if self.paged else "",
                "unfused" if self.variant is Variant.UNFUSED else "", "cap" if self.softcap else "",
                "alibi" if self.alibi else "", "local" if self.local else "", "sinks" if self.sinks else "",
                "smod" if self.score_mod else "", "mmod" if self.mask_mod else "",
                self.kv_dtype.value[4:] if self.kv_dtype is not None else "", "varlenq" if self.varlen_q else "",
                "tree" if self.tree else "", "prow" if self.page_rows else "", self.name_piece("k{}", self.cta_tile_kv),
                self.name_piece("w{}s{}", self.num_warps, self.num_stages))

    def launch_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """The main entry; for the unfused variant its ``_pv`` kernel (same launch shape); and the
        ``_merge`` entry (MERGE_THREADS threads, no dynamic shared memory)."""
        main = ("", self.threads, self.smem_bytes())
        pv = (("_pv", self.threads, self.smem_bytes()),) if self.variant is Variant.UNFUSED else ()
        return (main, *pv, ("_merge", MERGE_THREADS, 0))

    def compile_error(self, error):
        return snippets.snippet_error(error, self) if self.score_mod or self.mask_mod else None

    def template_context(self) -> dict:
        ctx = super().template_context()
        ctx.update(snippets.template_context(self.score_mod, self.mask_mod, self.aux))
        ctx.update(logits_variants=variant_list(("Softcap", self.softcap), ("Alibi", self.alibi)))
        ctx.update(varlen_q=self.varlen_q, tree=self.tree, page_rows=self.page_rows)
        ctx.update(q_in_regs=self.q_in_regs, warps_m=self.warps_m, merge_threads=MERGE_THREADS,
                   kv_fp8=0 if self.kv_dtype is None else 1 + list(KVDType).index(self.kv_dtype))
        return ctx

    # --- fit ---------------------------------------------------------------------------------
    def check(self, a: Arch) -> None:
        keys_per_warp = self.cta_tile_kv // self.warps_n
        if keys_per_warp < 16 or keys_per_warp % 16:
            raise SpecError("cta_tile_kv", self.cta_tile_kv, f"a multiple of {16 * self.warps_n}",
                            reason=f"{self.warps_n} warps split each KV tile and each needs whole 16-key steps "
                                   f"(q_rows={self.q_rows}, num_warps={self.num_warps})")
        acc = self.m_tiles * 4 * (self.d_out // 8 + keys_per_warp // 8)
        if self.q_in_regs:
            acc += self.m_tiles * 4 * -(-self.head_dim // 16)
        # Decode keeps more live state per accumulator than prefill (row limits, per-row addresses of
        # the packed heads); past ~136 ptxas spilled (NVRTC 13.5, sm_90, every q_rows x head_dim).
        if acc > 136:
            raise SpecError("num_warps", self.num_warps, "more warps (8), a smaller cta_tile_kv or a smaller q_rows",
                            reason=f"needs about {acc} accumulator registers per thread (limit 136) with "
                                   f"head_dim={self.head_dim}, q_rows={self.q_rows}")
        check_smem(self, a, "num_stages", "a smaller num_stages or cta_tile_kv")
