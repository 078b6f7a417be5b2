"""``PrefillSpec``: the prefill family's spec, the fit rules every form shares (the chunked and wgmma kernels' own in
``fit.py``) and its template context.

The text of this module feeds the cache key (it decides what the template context holds); the
measured per-arch defaults live in ``defaults.py``, which reaches the key only through the
resolved spec.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import ClassVar

from ...arch import Arch, get_arch
from ...errors import SpecError
from . import fit, fp8
from .rows import _mma_dim, _row, _smem_row
from .. import snippets
from ...spec import (DType, Mma, Pipeline, SpecBase, allowed_text, check_smem, check_wgmma_arch, coerce_bool,
                     coerce_enum, coerce_int, variant_list)

# The TMA kernels' arch: where a persistent kernel's O tile of its own does not fit, O goes into Q's (o_in_q).
_SM90A_SMEM = get_arch("sm_90a").smem_per_block


class MaskMode(enum.Enum):
    NONE = "none"
    CAUSAL = "causal"
    SLIDING_WINDOW = "sliding_window"


class Schedule(enum.Enum):
    """How the TMA kernel's consumer warpgroups order a KV tile's work. ``auto`` lets ``resolve`` choose;
    the cp.async pipeline has ``serial`` only."""

    AUTO = "auto"
    SERIAL = "serial"      # S = Q K^T, its softmax, then O += P V, each waited for before the next
    OVERLAP = "overlap"    # the next tile's S = Q K^T and this tile's P V run under the softmax
    PINGPONG = "pingpong"  # overlap, and the two consumer warpgroups take turns at the tensor cores

    def __bool__(self) -> bool:
        return self is not Schedule.AUTO


class Persistent(enum.Enum):
    """Whether the TMA kernel is persistent: a grid of at most the CTAs the SMs hold walks the query tiles
    (``true``), or one CTA a query tile (``false``). ``auto`` lets ``resolve`` choose; every other kernel is
    ``false``. In spec text ``true``/``false`` (a Python bool is taken too)."""

    AUTO = "auto"
    ON = "true"
    OFF = "false"

    def __bool__(self) -> bool:
        return self is not Persistent.AUTO


def _persistent(value) -> Persistent:
    if isinstance(value, Persistent):
        return value
    if isinstance(value, str) and value.strip().lower() == "auto":
        return Persistent.AUTO
    try:
        return Persistent.ON if coerce_bool("persistent", value) else Persistent.OFF
    except SpecError:
        raise SpecError("persistent", value, "auto, true, false") from None


# templates/prefill/plan.cuh: threads of the plan builders and of the work-list sort, and the most requests the
# serving plan sorts into a decode order (its keys in the sort's static shared memory).
PLAN_THREADS = 256
ORDER_THREADS = 1024
ORDER_SORT_MAX = 4096


def _head_dim(name: str, value, allowed, text: str) -> int:
    """``coerce_int`` with the allowed head dims said as a rule rather than listed one by one."""
    try:
        return coerce_int(name, value, allowed)
    except SpecError as e:
        raise SpecError(name, e.value, text, reason=e.reason) from None


# The template's MASK constant per mode.
MASK_CODES = {MaskMode.NONE: 0, MaskMode.CAUSAL: 1, MaskMode.SLIDING_WINDOW: 2}


@dataclass(frozen=True)
class PrefillSpec(SpecBase):
    """FlashAttention-2-style forward pass (prefill).

    Tuning fields (``cta_tile_q``, ``cta_tile_kv``, ``num_warps``, ``num_stages``, ``mma``) take 0
    (``auto``) for "choose for the arch"; ``resolve`` turns them into values.
    """

    family: ClassVar[str] = "prefill"

    # Up to WHOLE_MAX the FlashAttention-2 kernel holds whole Q, K and V rows in shared memory (V's
    # rows may be narrower: head_dim_v <= head_dim, e.g. DeepSeek's 192/128); past it (or with V
    # wider than Q and K) the chunked kernel streams them in head_dim chunks.
    # Whole rows: every multiple of 8 from 32 to 256 (the mma.sync kernel on every arch; wgmma and TMA take
    # multiples of 64, whole 128-byte swizzle rows). Past 256, the chunked kernel's list (its measured dims).
    WHOLE_DIMS: ClassVar[tuple[int, ...]] = tuple(range(32, 257, 8))
    CHUNKED_DIMS: ClassVar[tuple[int, ...]] = (320, 384, 448, 512, 576, 640, 768, 1024)
    HEAD_DIMS: ClassVar[tuple[int, ...]] = (*WHOLE_DIMS, *CHUNKED_DIMS)
    # What the chunked kernel was built and measured for, of either operand (a head_dim_chunk may bring a
    # whole-row head dim to it): the head dims of the list before any multiple of 8 was taken.
    CHUNKED_TAKES: ClassVar[tuple[int, ...]] = (64, 96, 128, 192, 256, *CHUNKED_DIMS)
    HEAD_DIMS_TEXT: ClassVar[str] = ("a multiple of 8 from 32 to 256 (whole rows), or 320, 384, 448, 512, 576, 640, "
                                     "768, 1024 (the chunked kernel)")
    WHOLE_MAX: ClassVar[int] = 256
    # The chunked kernel's wgmma form: one CTA computes O's columns up to here, two past it.
    WGMMA_ONE_CTA_MAX: ClassVar[int] = 640
    HEAD_DIM_V: ClassVar[tuple[int, ...]] = (0, *HEAD_DIMS)
    # 192-row tiles on 12 warps: the TMA kernel's three consumer warpgroups (FlashAttention-3's form at head_dim 64)
    CTA_TILE_Q: ClassVar[tuple[int, ...]] = (0, 32, 64, 128, 192)
    # Key tiles between the powers of two (multiples of 16 up to 192, as FlashAttention-3 takes 80 at head_dim
    # 256 and 176 at 128) are the wgmma whole-row kernel's on the dense layout: wgmma's N is any multiple of 8.
    CTA_TILE_KV_POW2: ClassVar[tuple[int, ...]] = (32, 64, 128)
    CTA_TILE_KV_WIDE: ClassVar[tuple[int, ...]] = (80, 96, 112, 144, 160, 176, 192)
    CTA_TILE_KV: ClassVar[tuple[int, ...]] = (0, *sorted(CTA_TILE_KV_POW2 + CTA_TILE_KV_WIDE))
    NUM_WARPS: ClassVar[tuple[int, ...]] = (0, 4, 8, 12)
    NUM_STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2, 3, 4, 5, 6, 7, 8)
    # The chunk width of the chunked kernel; 0 (or the head_dim itself) keeps rows whole (the
    # FlashAttention-2 kernel) where that can run, and means "choose" where it cannot.
    HEAD_DIM_CHUNK: ClassVar[tuple[int, ...]] = (0, 32, 64, 96, 128, 192, 256)
    CHUNKS: ClassVar[tuple[int, ...]] = (32, 64, 128)
    TILE_FIELDS: ClassVar[tuple[str, ...]] = ("cta_tile_q", "cta_tile_kv", "num_warps", "num_stages", "mma")
    TUNING_FIELDS: ClassVar[tuple[str, ...]] = (*TILE_FIELDS, "head_dim_chunk", "pipeline", "schedule", "persistent")
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("head_dim", "dtype", "mask")
    OFF_UNSHOWN: ClassVar[tuple[str, ...]] = ("qkv_dtype", "kv_dtype")

    head_dim: int = 128     # of q and k (the QK head dim)
    head_dim_v: int = 0     # of v and the output; 0: head_dim
    dtype: DType = DType.BF16
    mask: MaskMode = MaskMode.NONE
    return_lse: bool = False
    cta_tile_q: int = 0
    cta_tile_kv: int = 0
    num_warps: int = 0
    num_stages: int = 0
    mma: Mma = Mma.AUTO
    softcap: bool = False   # logit capping cap * tanh(s / cap); the cap is a call argument
    alibi: bool = False     # ALiBi bias -slope * |i - j|; the per-head slopes are a call argument
    sinks: bool = False     # a per-head sink logit in the softmax denominator (gpt-oss); the sinks are a call argument
    custom_mask: bool = False  # a mask tensor, walked through its plan's lists of live KV tiles
    varlen: bool = False    # packed sequences of different lengths (cu_seqlens), a work list per call
    paged: bool = False     # (varlen) k/v in a paged cache through a block table
    # (paged) every key row looks up its block, so blocks of any size work; off, a tile's 16-row groups share one
    # lookup (blocks a multiple of 16). Left out of the spec's dict and key while off.
    page_rows: bool = False
    head_dim_chunk: int = 0  # 32/64: the chunked kernel; 0: whole rows (FlashAttention-2) where they fit
    pipeline: Pipeline = Pipeline.AUTO  # tma: a producer warpgroup loads the tiles with TMA (wgmma, dense)
    schedule: Schedule = Schedule.AUTO  # overlap, pingpong: the TMA kernel's softmax under its GEMMs
    persistent: Persistent = Persistent.AUTO  # the TMA kernel: at most the CTAs the SMs hold walk the query tiles
    # A user's variant (attngen/families/snippets.py, docs/variants.md): device-function bodies, and the aux
    # tensors' signature "name:dtype:ndim;..." they read. "" (off) is left out of the spec's dict and key.
    score_mod: str = ""
    mask_mod: str = ""
    aux: str = ""
    # (custom_mask with a mask_mod that reads aux) every tile mask_mod keeps in part has its keep bits in the block
    # plan's pool, so the kernel reads them and never runs mask_mod itself (prefill/step.cuh.jinja): a module with
    # one copy of the snippet, the plan's. Left out of the spec's dict and key while off.
    mod_bits: bool = False
    # (score_mod, wgmma) Q's tile times sm_scale in registers before S = Q K^T, so that score_mod takes the MMA's
    # scores as logits with no multiply; a call's sm_scale must be a power of two (then the product is exact). Calls
    # without a spec take it where it fits (choose.table). Left out of the spec's dict and key while off.
    q_scaled: bool = False
    # q, k and v in fp8 (fp8_e4m3; dtype is then the output's), with descales; or (kv_dtype) a varlen/paged fp8 cache
    # widened in shared memory: attngen/families/prefill/fp8.py. Off ("", None) each is left out of the dict and key.
    qkv_dtype: str = ""
    kv_dtype: str = ""

    def __post_init__(self):
        s = object.__setattr__
        s(self, "head_dim", _head_dim("head_dim", self.head_dim, self.HEAD_DIMS, self.HEAD_DIMS_TEXT))
        s(self, "head_dim_v", _head_dim("head_dim_v", self.head_dim_v, self.HEAD_DIM_V,
                                        f"0 (head_dim), {self.HEAD_DIMS_TEXT}"))
        if self.head_dim_v == self.head_dim:
            s(self, "head_dim_v", 0)  # one spec (and one cache key) per kernel
        s(self, "head_dim_chunk", coerce_int("head_dim_chunk", self.head_dim_chunk, self.HEAD_DIM_CHUNK))
        if self.head_dim_chunk and self.head_dim_chunk not in self.CHUNKS and self.head_dim_chunk != self.head_dim:
            raise SpecError("head_dim_chunk", self.head_dim_chunk,
                            f"{allowed_text(self.CHUNKS)} (the chunked kernel)"
                            + (f" or {self.head_dim} (whole rows)" if self.whole_allowed else ""),
                            reason=f"with head_dim={self.head_dim}")
        if self.head_dim_chunk == self.head_dim:
            if not self.whole_allowed:
                raise SpecError("head_dim_chunk", self.head_dim_chunk, f"{allowed_text(self.CHUNKS)} (the chunked kernel)",
                                reason=f"whole rows need head_dim <= {self.WHOLE_MAX} and head_dim_v at most head_dim; "
                                       f"head_dim={self.head_dim}, head_dim_v={self.dim_v}")
            s(self, "head_dim_chunk", 0)  # whole rows: one spec (and one cache key) per kernel
        if self.head_dim_chunk and self.head_dim % self.head_dim_chunk:
            raise SpecError("head_dim_chunk", self.head_dim_chunk, "a divisor of head_dim among "
                            + allowed_text(self.CHUNKS), reason=f"head_dim={self.head_dim}")
        if self.chunked:
            for name, d in (("head_dim", self.head_dim), ("head_dim_v", self.dim_v)):
                if d not in self.CHUNKED_TAKES:
                    raise SpecError(name, d, allowed_text(self.CHUNKED_TAKES) + " with the chunked kernel",
                                    reason="the chunked kernel (head_dim above 256, head_dim_v above head_dim or a "
                                           "head_dim_chunk) runs its measured head dims only; other multiples of 8 "
                                           "up to 256 take whole rows")
        s(self, "dtype", coerce_enum(DType, "dtype", self.dtype))
        s(self, "mask", coerce_enum(MaskMode, "mask", self.mask))
        s(self, "mma", coerce_enum(Mma, "mma", self.mma))
        s(self, "return_lse", coerce_bool("return_lse", self.return_lse))
        s(self, "softcap", coerce_bool("softcap", self.softcap))
        s(self, "alibi", coerce_bool("alibi", self.alibi))
        s(self, "sinks", coerce_bool("sinks", self.sinks))
        s(self, "custom_mask", coerce_bool("custom_mask", self.custom_mask))
        s(self, "varlen", coerce_bool("varlen", self.varlen))
        s(self, "paged", coerce_bool("paged", self.paged))
        s(self, "page_rows", coerce_bool("page_rows", self.page_rows))
        if self.page_rows and not self.paged:
            raise SpecError("page_rows", True, "false with paged=false", reason="a contiguous cache has no blocks")
        s(self, "pipeline", coerce_enum(Pipeline, "pipeline", self.pipeline))
        s(self, "schedule", coerce_enum(Schedule, "schedule", self.schedule))
        s(self, "persistent", _persistent(self.persistent))
        score_mod, mask_mod, aux = snippets.check_spec_fields(self)
        s(self, "score_mod", score_mod)
        s(self, "mask_mod", mask_mod)
        s(self, "aux", aux)
        s(self, "mod_bits", coerce_bool("mod_bits", self.mod_bits))
        if self.mod_bits and not (self.custom_mask and snippets.reads_aux(self.mask_mod, self.aux)):
            raise SpecError("mod_bits", True, "false without custom_mask=true and a mask_mod that reads an aux tensor",
                            reason="the keep bits come from the block plan of a mask_mod that reads aux (one of "
                                   "index arithmetic alone runs in the kernel)")
        s(self, "qkv_dtype", fp8.check_fields(self))
        s(self, "kv_dtype", fp8.check_kv_fields(self))
        s(self, "q_scaled", coerce_bool("q_scaled", self.q_scaled))
        fit.check_q_scaled_fields(self)
        if self.is_persistent and self.pipeline is Pipeline.SYNC:
            raise SpecError("persistent", "true", "false with pipeline=sync",
                            reason="the persistent kernel's producer warpgroup loads each next query tile by TMA")
        if self.overlapped and self.pipeline is Pipeline.SYNC:
            raise SpecError("schedule", self.schedule.value, "serial with pipeline=sync",
                            reason="overlap and ping-pong are built on the TMA pipeline")
        # The field that asks for the TMA pipeline, named by its refusals: the pipeline, or a schedule only it runs.
        tma_ask = (("pipeline", "tma", "sync") if self.tma or not (self.overlapped or self.is_persistent) else
                   ("schedule", self.schedule.value, "serial") if self.overlapped else ("persistent", "true", "false"))
        if self.overlapped or self.is_persistent:
            s(self, "pipeline", Pipeline.TMA)  # the only pipeline they run on
        if self.tma:
            if self.page_rows:
                raise SpecError(tma_ask[0], tma_ask[1], f"{tma_ask[2]} with page_rows=true",
                                reason="the TMA pipeline copies a paged cache's keys a block's rows at a time, in "
                                       "boxes of a multiple of 16 rows")
            for name in ("varlen", "custom_mask"):
                if getattr(self, name) and self.is_persistent:
                    raise SpecError("persistent", "true", f"false with {name}=true",
                                    reason="a work list (the sequences' or the mask plan's) gives each CTA one query "
                                           "tile")
        if self.paged and not self.varlen:
            raise SpecError("paged", True, "false, or true with varlen=true",
                            reason="a paged prefill takes its sequences' lengths from cu_seqlens (prefill_varlen)")
        if self.custom_mask and self.varlen:
            raise SpecError("custom_mask", True, "false with varlen=true",
                            reason="a mask tensor has the dense [.., seqlen_q, seqlen_k] layout")
        s(self, "cta_tile_q", coerce_int("cta_tile_q", self.cta_tile_q, self.CTA_TILE_Q))
        s(self, "cta_tile_kv", coerce_int("cta_tile_kv", self.cta_tile_kv, self.CTA_TILE_KV))
        s(self, "num_warps", coerce_int("num_warps", self.num_warps, self.NUM_WARPS))
        s(self, "num_stages", coerce_int("num_stages", self.num_stages, self.NUM_STAGES))
        tiles_pinned = all(getattr(self, f) for f in self.TILE_FIELDS)
        if not self.pipeline and tiles_pinned:
            # Every tile field pinned and no pipeline: the cp.async one, what such a spec meant before the
            # field existed (stored tuning winners, users' specs); one spec a kernel.
            s(self, "pipeline", Pipeline.SYNC)
        if not self.schedule and (self.pipeline is Pipeline.SYNC or self.pipeline and tiles_pinned):
            # The cp.async pipeline has one schedule; a spec pinning every tile field and the pipeline means
            # what it meant before the field existed (the serial one).
            s(self, "schedule", Schedule.SERIAL)
        if not self.persistent and (self.pipeline is Pipeline.SYNC or self.pipeline and tiles_pinned):
            # Likewise: one CTA a query tile, what such a spec meant before the field.
            s(self, "persistent", Persistent.OFF)
        if self.chunked:
            if self.tma and self.varlen:
                raise SpecError(tma_ask[0], tma_ask[1], f"{tma_ask[2]} with varlen=true and the chunked kernel "
                                f"(head_dim above {self.WHOLE_MAX}, head_dim_v above head_dim or head_dim_chunk < "
                                "head_dim)", reason="the chunked kernel's TMA form reads the dense layout only")
            for name in ("custom_mask", "paged"):
                if getattr(self, name):
                    raise SpecError(name, True, "false with the chunked kernel (head_dim above "
                                    f"{self.WHOLE_MAX}, head_dim_v above head_dim or head_dim_chunk < head_dim)",
                                    reason=f"the chunked kernel has no {name.replace('_', '-')} form yet")
            if self.overlapped or self.is_persistent:
                name, value, allowed = (("schedule", self.schedule.value, "serial") if self.overlapped
                                        else ("persistent", "true", "false"))
                raise SpecError(name, value, f"{allowed} with the chunked kernel (head_dim above {self.WHOLE_MAX}, "
                                "head_dim_v above head_dim or head_dim_chunk < head_dim)",
                                reason="the chunked kernel's TMA form has the serial schedule, one CTA a query tile")
            for name in ("score_mod", "mask_mod", "aux"):
                if getattr(self, name):
                    raise SpecError(name, snippets.short(getattr(self, name)) if name != "aux" else self.aux, "'' (off) with the chunked kernel "
                                    f"(head_dim above {self.WHOLE_MAX}, head_dim_v above head_dim or head_dim_chunk < "
                                    "head_dim)", reason="snippets run in the whole-row kernels (head dims up to "
                                    f"{self.WHOLE_MAX}) only")
        elif self.cta_tile_q and self.num_warps and self.cta_tile_q % (16 * self.num_warps):
            raise SpecError("num_warps", self.num_warps,
                            f"a divisor of cta_tile_q/16 = {self.cta_tile_q // 16}",
                            reason=f"each warp owns a whole number of 16-row tiles of cta_tile_q={self.cta_tile_q}")

    def to_dict(self) -> dict:
        d = super().to_dict()
        for name in ("page_rows", "mod_bits", "q_scaled"):
            if not d[name]:
                del d[name]  # off: every other spec keeps its JSON, its key and its kernel's name
        return d

    # --- derived ---------------------------------------------------------------------------
    @property
    def dim_v(self) -> int:
        """The head dim of v and the output."""
        return self.head_dim_v or self.head_dim

    @property
    def tma(self) -> bool:
        """The TMA pipeline (templates/prefill/fwd.cuh.jinja, TMA): a producer warpgroup more."""
        return self.pipeline is Pipeline.TMA

    @property
    def is_persistent(self) -> bool:
        """The persistent TMA kernel (persistent=true)."""
        return self.persistent is Persistent.ON

    @property
    def overlapped(self) -> bool:
        """The schedule runs the softmax under the GEMMs (overlap or pingpong; the TMA pipeline only)."""
        return self.schedule in (Schedule.OVERLAP, Schedule.PINGPONG)

    @property
    def tma_ctas(self) -> int:
        """The CTAs an SM the TMA kernel splits its registers for (0 without TMA): two with one consumer
        warpgroup up to head_dim 128 (128 registers a thread at launch); one otherwise (ptxas cannot fit
        wider heads' wgmma in 128)."""
        if not self.tma:
            return 0
        return 2 if self.num_warps == 4 and self.head_dim <= 128 else 1

    @property
    def whole_allowed(self) -> bool:
        """Whether the FlashAttention-2 kernel (whole rows in shared memory) can run this spec: it
        stages O in Q's tile, so V's rows may be narrower than Q's but not wider."""
        return self.head_dim <= self.WHOLE_MAX and self.dim_v <= self.head_dim

    @property
    def chunked(self) -> bool:
        """The chunked kernel: head_dim chunks stream through shared memory (templates/prefill/
        chunked.cuh.jinja). Chosen where whole rows cannot run or a chunk width is given."""
        return not self.whole_allowed or bool(self.head_dim_chunk)

    @functools.cached_property
    def is_resolved(self) -> bool:
        # head_dim_chunk 0 is a value (whole rows) where the FlashAttention-2 kernel runs
        return all(getattr(self, f) for f in self.TUNING_FIELDS if f != "head_dim_chunk") and (
            bool(self.head_dim_chunk) or not self.chunked)

    @property
    def chunk_grid(self) -> dict:
        """The chunked kernel's warp grid and V steps (see prefill/chunked_consumer.cuh): WARPS_N column
        groups, ON output columns per warp, SN keys of S per warp, per V step VK keys x VCW
        columns per warp (the widest VCW, fewest loads per mma, whose step fits the QK step),
        and the elements of one ring slot (the larger of the two steps; TMA: a QK step's slot holds K's
        chunk alone, Q having a tile of its own, while VK is chosen as for the cp.async ring, so both
        rings take the same V steps). With wgmma the column groups are the two warpgroups, the tiles
        dense 64-column blocks, and VCW whole blocks (a V step at most 256 columns wide, so a copying
        thread steps down whole swizzle atoms)."""
        self._require_resolved("chunk_grid")
        if self.mma is Mma.WGMMA:
            warps_n, widths, step_keys, row = 2, (128, 64), (128, 64, 32, 16), (lambda e: e)
        else:
            warps_n, widths, step_keys, row = self.num_warps // (self.cta_tile_q // 32), (64, 32, 16), (64, 32, 16), _row
        on = self.dim_v_padded // warps_n
        qk_elems = (self.cta_tile_q + self.cta_tile_kv) * row(self.head_dim_chunk)
        full = on - (32 if self.v_tail else 0)  # the columns of the whole-width V steps
        vcw = next((w for w in widths if full % w == 0), widths[-1])  # a power-of-two count of 16-byte chunks
        vk = next((k for k in step_keys if self.cta_tile_kv % k == 0 and k * row(vcw * warps_n) <= qk_elems), 16)
        if self.tma:
            qk_elems = self.cta_tile_kv * row(self.head_dim_chunk)
        return dict(warps_n=warps_n, on=on, sn=self.cta_tile_kv // warps_n, vk=vk, vcw=vcw,
                    stage_elems=max(qk_elems, vk * row(vcw * warps_n)))

    @property
    def v_splits(self) -> int:
        """CTAs a query tile's O columns are split over (the chunked kernel's wgmma form past head_dim_v
        640, where one CTA's registers cannot hold O: each split repeats the QK work); 1 otherwise."""
        self._require_resolved("v_splits")
        return 2 if self.chunked and self.mma is Mma.WGMMA and self.dim_v > self.WGMMA_ONE_CTA_MAX else 1

    @property
    def qk_pair(self) -> bool:
        """The two V splits of a query tile form a cluster that splits the QK work (each CTA computes S
        over half of head_dim and adds the other's; see prefill/chunked_consumer.cuh) rather than repeating it:
        where each half is at least two whole chunks and the repeated QK work would exceed a CTA's PV
        work (head_dim above its V columns): at 768 and 1024 the halved QK work outweighs the exchange of S;
        where the QK work only equals the PV work (512/1024), or at 640 split into a pair, the exchange costs
        more than it saves."""
        self._require_resolved("qk_pair")
        half = self.head_dim // 2
        return (self.v_splits == 2 and half % self.head_dim_chunk == 0 and half // self.head_dim_chunk >= 2
                and self.head_dim > self.dim_v_padded)

    @property
    def v_tail(self) -> bool:
        """The chunked wgmma kernel's V columns a warpgroup end 32 columns into a 64-column block (a CTA's
        split of head_dim_v is 320, 448, 576, ...): a last, 32-column V step takes them, no padding."""
        self._require_resolved("v_tail")
        if not (self.chunked and self.mma is Mma.WGMMA):
            return False
        per_cta = self.dim_v // self.v_splits
        return per_cta >= 192 and per_cta % 64 == 0 and (per_cta // 2) % 64 == 32

    @property
    def dim_v_padded(self) -> int:
        """The head dim of v one CTA of the chunked kernel computes: with wgmma, its split of V's columns,
        padded to whole 64-column blocks per warpgroup (zeros loaded, never stored) unless each
        warpgroup's ends in a 32-column tail (``v_tail``); otherwise ``dim_v``."""
        self._require_resolved("dim_v_padded")
        if not (self.chunked and self.mma is Mma.WGMMA):
            return self.dim_v
        if self.v_tail:
            return self.dim_v // self.v_splits
        return -(-self.dim_v // self.v_splits // 128) * 128

    @property
    def q_in_regs(self) -> bool:
        """Q fragments stay in registers for the whole KV loop while they take at most 32 per thread
        (head_dim/4 per 16-row m-tile); otherwise they are re-read from shared memory per tile."""
        self._require_resolved("q_in_regs")
        if self.mma is Mma.WGMMA:
            return False  # wgmma reads Q from shared memory through a descriptor
        m_tiles = self.cta_tile_q // self.num_warps // 16
        return _mma_dim(self.head_dim) * m_tiles <= 128

    @property
    def smem_row_elems(self) -> int:
        """Elements per shared-memory row of Q and K (of V: ``_smem_row(dim_v, swizzled_rows)``)."""
        return _smem_row(self.head_dim, self.swizzled_rows)

    @property
    def swizzled_rows(self) -> bool:
        """Whether tiles of a multiple of 64 elements a row may be swizzled: not where either head dim is 8 mod 16,
        whose pad chunk the mma.sync GEMMs read from padded rows (so 128 with a v of 72 pads both)."""
        return _mma_dim(self.head_dim) == self.head_dim and _mma_dim(self.dim_v) == self.dim_v

    def smem_bytes(self, own_o: bool | None = None) -> int:
        """Shared memory of the main entry. ``own_o``: the whole-row persistent kernel's O in a tile of its own
        (True) or in Q's (False); None, as ``o_in_q`` chooses."""
        self._require_resolved("smem_bytes")
        if self.qkv_dtype:
            return fp8.smem_bytes(self)
        if self.kv_dtype:
            return fp8.kv_smem_bytes(self)
        if self.chunked:
            # the ring of equal steps, P (16-bit) and the row-max exchange (fp32, a row per warp column)
            # (wgmma: dense tiles, P in whole 64-key blocks, and slack to align the ring to the 1024-byte
            # swizzle atom)
            cg = self.chunk_grid
            wgmma = self.mma is Mma.WGMMA
            p = self.cta_tile_q * (-(-self.cta_tile_kv // 64) * 64 if wgmma else _row(self.cta_tile_kv))
            # (qk_pair: two slots of the fp32 partial S exchanged across the cluster, and their mbarriers)
            exchange = 2 * 4 * self.cta_tile_q * self.cta_tile_kv + 16 if self.qk_pair else 0  # (+ a barrier a slot)
            # (TMA: Q's tile of its own, the CTA's QK columns; a full and an empty barrier a slot, and Q's)
            q_tile = self.cta_tile_q * self.head_dim // (2 if self.qk_pair else 1) if self.tma else 0
            bars = 16 * self.num_stages + 8 if self.tma else 0
            return 2 * (self.num_stages * cg["stage_elems"] + q_tile + p) + 4 * cg["warps_n"] * self.cta_tile_q \
                + (1024 if wgmma else 0) + exchange + bars
        row, row_v = (_smem_row(d, self.swizzled_rows) * self.dtype.itemsize for d in (self.head_dim, self.dim_v))
        # wgmma's tiles are dense (head dims are multiples of 64 there): only slack to align the first
        # one to the 1024-byte swizzle atom is added; TMA's mbarriers follow the tiles (Q's, then three a slot,
        # four with an overlapped schedule: K's and V's slots are emptied apart)
        slack = 1024 if self.mma is Mma.WGMMA else 0
        # (persistent: and Q's empty one, after O's own staging tile where it has one)
        bars = 8 * (1 + (4 if self.overlapped else 3) * self.num_stages + self.is_persistent) if self.tma else 0
        base = row * (self.cta_tile_q + self.num_stages * self.cta_tile_kv) \
            + row_v * self.num_stages * self.cta_tile_kv + slack + bars
        if own_o is None:
            own_o = self.is_persistent and not self.o_in_q
        return base + (row_v * self.cta_tile_q if own_o else 0)

    @property
    def o_in_q(self) -> bool:
        """The persistent TMA kernel stages O in Q's tile, not a tile of its own, where the latter does not
        fit sm_90a's shared memory (head_dim 256's 128x64-80 tiles): the next query tile's Q then loads once
        the epilogue has read O out, after the first key tiles of that query tile."""
        return self.is_persistent and self.smem_bytes(own_o=True) > _SM90A_SMEM

    @property
    def threads(self) -> int:
        self._require_resolved("threads")
        return 32 * self.num_warps + (128 if self.tma else 0)  # TMA: the producer warpgroup

    def launch_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """The main entry; a custom-mask module adds its plan builders (``_mtiles``, ``_mlists``; with a mask_mod
        its block plan's ``_modtiles`` too) and a custom-mask or varlen module its work-list sort (``_order``):
        PLAN_THREADS and ORDER_THREADS in templates/prefill/plan.cuh, static shared memory only. A module with
        snippets leaves the mask tensor's ``_mtiles`` out: it is about half of such a module's compile, and the
        kernel of the same spec without snippets builds the same plan (masks.tensor_plan_kernel)."""
        main = ("", self.threads, self.smem_bytes())
        snippets = bool(self.score_mod or self.mask_mod or self.aux)
        plan = ((*((("_mtiles", PLAN_THREADS, 0),) if not snippets else ()), ("_mlists", PLAN_THREADS, 0))
                if self.custom_mask else ())
        if self.custom_mask and self.mask_mod:
            plan = (*plan, ("_modtiles", PLAN_THREADS, 0))
        order = (("_order", ORDER_THREADS, 0),) if self.custom_mask or self.varlen else ()
        vt = (("_vt", fp8.VT_THREADS, 0),) if self.qkv_dtype else ()  # V transposed for fp8 wgmma
        return (main, *plan, *order, *vt)

    def name_parts(self) -> tuple[str, ...]:
        """d128 (d192v128: split head dims), dtype, mask, layout and score flags, tiles, warps and stages,
        chunk width, mma, pipeline, schedule, persistence; defaults and unset tuning fields left out."""
        flags = (("cmask", self.custom_mask), ("varlen", self.varlen), ("paged", self.paged), ("prow", self.page_rows),
                 ("lse", self.return_lse),
                 ("cap", self.softcap), ("alibi", self.alibi), ("sinks", self.sinks), ("smod", self.score_mod),
                 ("mmod", self.mask_mod), ("mbits", self.mod_bits), ("qs", self.q_scaled),
                 ("e4m3", self.qkv_dtype),
                 (f"kv{self.kv_dtype[4:]}", self.kv_dtype))
        return (f"d{self.head_dim}" + self.name_piece("v{}", self.head_dim_v), self.dtype.value,
                {MaskMode.CAUSAL: "causal", MaskMode.SLIDING_WINDOW: "swa"}.get(self.mask, ""),
                *(name for name, on in flags if on), self.name_piece("q{}k{}", self.cta_tile_q, self.cta_tile_kv),
                self.name_piece("w{}s{}", self.num_warps, self.num_stages), self.name_piece("c{}", self.head_dim_chunk),
                {Mma.SYNC: "mma", Mma.WGMMA: "wgmma"}.get(self.mma, ""), "tma" if self.pipeline is Pipeline.TMA else "",
                {Schedule.OVERLAP: "ov", Schedule.PINGPONG: "pp"}.get(self.schedule, ""),
                "pers" if self.persistent is Persistent.ON else "")

    def compile_error(self, error):
        return snippets.snippet_error(error, self) if self.score_mod or self.mask_mod else None

    def template_context(self) -> dict:
        ctx = super().template_context()
        ctx.update(snippets.template_context(self.score_mod, self.mask_mod, self.aux))
        ctx.update(logits_variants=variant_list(("Softcap", self.softcap), ("Alibi", self.alibi)))
        ctx.update(dim_v=self.dim_v, mask_mode=MASK_CODES[self.mask], tma=self.tma, overlap=self.overlapped,
                   pingpong=self.schedule is Schedule.PINGPONG, persistent=self.is_persistent, qk_pair=self.qk_pair,
                   o_in_q=self.o_in_q, page_rows=self.page_rows, fp8=bool(self.qkv_dtype),
                   kv8=fp8.KV_CODES.get(self.kv_dtype, 0), q16=fp8.computes_fp16(self), mod_bits=self.mod_bits,
                   q_scaled=self.q_scaled)
        if self.chunked:
            cg = self.chunk_grid
            ctx.update(chunked=True, wgmma=self.mma is Mma.WGMMA, chunk_vk=cg["vk"], chunk_vcw=cg["vcw"],
                       v_splits=self.v_splits, v_tail=self.v_tail)
            return ctx
        ctx.update(
            chunked=False,
            q_in_regs=self.q_in_regs,
            smem_row_elems=self.smem_row_elems,
            tma_ctas=self.tma_ctas,
            smem_row_elems_v=_smem_row(self.dim_v, self.swizzled_rows),
            swizzle=self.swizzled_rows and self.head_dim % 64 == 0,
            swizzle_v=self.swizzled_rows and self.dim_v % 64 == 0,
            wgmma=self.mma is Mma.WGMMA,
        )
        if self.qkv_dtype:
            ctx.update(fp8.layout_context(self))  # rows of 16-bit pairs
        return ctx

    # --- fit ---------------------------------------------------------------------------------
    def check(self, a: Arch) -> None:
        if self.qkv_dtype:
            fp8.check_fit(self, a)
            return
        if self.kv_dtype:
            fp8.check_kv_fit(self, a)
        if self.cta_tile_q == 192 or self.num_warps == 12:
            # the fields that rule three consumer warpgroups out, the first one named
            ruled_out = [("pipeline", self.pipeline.value)] if not self.tma else []
            ruled_out += [("mma", self.mma.value)] if self.mma is not Mma.WGMMA else []
            ruled_out += [("head_dim_chunk", self.head_dim_chunk)] if self.chunked else []
            if ruled_out:
                name, value = ("cta_tile_q", 192) if self.cta_tile_q == 192 else ("num_warps", 12)
                raise SpecError(name, value, allowed_text((32, 64, 128) if name == "cta_tile_q" else (4, 8)),
                                reason="192-row tiles on 12 warps are the TMA kernel's three consumer warpgroups "
                                       f"(pipeline=tma, mma=wgmma, whole rows); this spec has "
                                       f"{ruled_out[0][0]}={ruled_out[0][1]}")
        if self.cta_tile_kv in self.CTA_TILE_KV_WIDE:
            # the fields that rule the widths out, the first one named
            ruled_out = [("mma", self.mma.value)] if self.mma is not Mma.WGMMA else []
            ruled_out += [(n, "true") for n in ("custom_mask", "varlen") if getattr(self, n)]
            ruled_out += [("head_dim_chunk", self.head_dim_chunk)] if self.chunked else []
            if ruled_out:
                name, value = ruled_out[0]
                raise SpecError("cta_tile_kv", self.cta_tile_kv, allowed_text(self.CTA_TILE_KV_POW2),
                                reason=f"key tiles of {allowed_text(self.CTA_TILE_KV_WIDE)} are the wgmma whole-row "
                                       f"kernel's on the dense layout (sm_90a); this spec has {name}={value}")
        if self.num_stages > 4 and not (self.chunked and self.mma is Mma.WGMMA):
            raise SpecError("num_stages", self.num_stages, "1, 2, 3, 4",
                            reason="deeper rings (up to 8 stages) are the chunked kernel's wgmma form's only")
        if self.tma and self.mma is not Mma.WGMMA:
            raise SpecError("pipeline", "tma", "sync with mma=mma_sync",
                            reason="the TMA pipeline is built on wgmma (sm_90a)")
        if self.q_scaled and not self.tma:
            raise SpecError("q_scaled", True, "false with " + ("pipeline=sync" if self.mma is Mma.WGMMA else
                                                               "mma=mma_sync"), reason=fit.Q_SCALED_KERNELS)
        if self.chunked:
            fit.check_chunked(self, a)
            return
        if self.mma is Mma.WGMMA:
            fit.check_wgmma(self, a)
            return
        fit.check_mma_sync(self, a)
