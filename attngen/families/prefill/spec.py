"""``PrefillSpec``: the prefill family's spec, its fit rules and its template context.

The text of this module feeds the cache key (it decides what the template context holds); the
measured per-arch defaults live in ``defaults.py``, which reaches the key only through the
resolved spec.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from ...arch import Arch
from ...errors import SpecError
from ...spec import DType, SpecBase, check_smem, coerce_bool, coerce_enum, coerce_int


class Mma(enum.Enum):
    """Which tensor-core instruction the prefill kernel is built on. ``auto`` (the default) lets
    ``resolve`` choose for the arch, so it is falsy like the other unresolved tuning fields."""

    AUTO = "auto"
    SYNC = "mma_sync"  # mma.sync m16n8k16 per warp: every arch from sm_80
    WGMMA = "wgmma"    # wgmma.mma_async per warpgroup of 4 warps: sm_90a only

    def __bool__(self) -> bool:
        return self is not Mma.AUTO


class MaskMode(enum.Enum):
    NONE = "none"
    CAUSAL = "causal"
    SLIDING_WINDOW = "sliding_window"


# templates/common/prefill_plan.cuh: threads of the plan builders and of the work-list sort.
PLAN_THREADS = 256
ORDER_THREADS = 1024

# The template's MASK constant per mode.
MASK_CODES = {MaskMode.NONE: 0, MaskMode.CAUSAL: 1, MaskMode.SLIDING_WINDOW: 2}


@dataclass(frozen=True)
class PrefillSpec(SpecBase):
    """FlashAttention-2-style forward pass (prefill).

    Tuning fields (``cta_tile_q``, ``cta_tile_kv``, ``num_warps``, ``num_stages``, ``mma``) take 0
    (``auto``) for "choose for the arch"; ``resolve`` turns them into values.
    """

    family: ClassVar[str] = "prefill"

    HEAD_DIMS: ClassVar[tuple[int, ...]] = (64, 96, 128, 192, 256)
    CTA_TILE_Q: ClassVar[tuple[int, ...]] = (0, 64, 128)
    CTA_TILE_KV: ClassVar[tuple[int, ...]] = (0, 32, 64, 128)
    NUM_WARPS: ClassVar[tuple[int, ...]] = (0, 4, 8)
    NUM_STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2, 3, 4)
    TUNING_FIELDS: ClassVar[tuple[str, ...]] = ("cta_tile_q", "cta_tile_kv", "num_warps", "num_stages", "mma")
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("head_dim", "dtype", "mask")

    head_dim: int = 128
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
    custom_mask: bool = False  # a mask tensor, walked through its plan's lists of live KV tiles
    varlen: bool = False    # packed sequences of different lengths (cu_seqlens), a work list per call
    paged: bool = False     # (varlen) k/v in a paged cache through a block table

    def __post_init__(self):
        s = object.__setattr__
        s(self, "head_dim", coerce_int("head_dim", self.head_dim, self.HEAD_DIMS))
        s(self, "dtype", coerce_enum(DType, "dtype", self.dtype))
        s(self, "mask", coerce_enum(MaskMode, "mask", self.mask))
        s(self, "mma", coerce_enum(Mma, "mma", self.mma))
        s(self, "return_lse", coerce_bool("return_lse", self.return_lse))
        s(self, "softcap", coerce_bool("softcap", self.softcap))
        s(self, "alibi", coerce_bool("alibi", self.alibi))
        s(self, "custom_mask", coerce_bool("custom_mask", self.custom_mask))
        s(self, "varlen", coerce_bool("varlen", self.varlen))
        s(self, "paged", coerce_bool("paged", self.paged))
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
        if self.cta_tile_q and self.num_warps and self.cta_tile_q % (16 * self.num_warps):
            raise SpecError("num_warps", self.num_warps,
                            f"a divisor of cta_tile_q/16 = {self.cta_tile_q // 16}",
                            reason=f"each warp owns a whole number of 16-row tiles of cta_tile_q={self.cta_tile_q}")

    # --- derived ---------------------------------------------------------------------------
    @property
    def q_in_regs(self) -> bool:
        """Q fragments stay in registers for the whole KV loop while they take at most 32 per thread
        (head_dim/4 per 16-row m-tile); otherwise they are re-read from shared memory per tile."""
        self._require_resolved("q_in_regs")
        if self.mma is Mma.WGMMA:
            return False  # wgmma reads Q from shared memory through a descriptor
        m_tiles = self.cta_tile_q // self.num_warps // 16
        return self.head_dim * m_tiles <= 128

    @property
    def smem_row_elems(self) -> int:
        """Elements per shared-memory row: XOR-swizzled rows are dense; others get one 16-byte pad."""
        return self.head_dim if self.head_dim % 64 == 0 else self.head_dim + 8

    def smem_bytes(self) -> int:
        self._require_resolved("smem_bytes")
        row = self.smem_row_elems * self.dtype.itemsize
        # wgmma's tiles are dense (head_dim is a multiple of 64 there): only slack to align the first
        # one to the 1024-byte swizzle atom is added
        slack = 1024 if self.mma is Mma.WGMMA else 0
        return row * (self.cta_tile_q + 2 * self.num_stages * self.cta_tile_kv) + slack

    @property
    def threads(self) -> int:
        self._require_resolved("threads")
        return 32 * self.num_warps

    def launch_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """The main entry; a custom-mask module adds its plan builders (``_mtiles``, ``_mlists``) and
        a custom-mask or varlen module its work-list sort (``_order``): PLAN_THREADS and
        ORDER_THREADS in templates/common/prefill_plan.cuh, static shared memory only."""
        main = ("", self.threads, self.smem_bytes())
        plan = (("_mtiles", PLAN_THREADS, 0), ("_mlists", PLAN_THREADS, 0)) if self.custom_mask else ()
        order = (("_order", ORDER_THREADS, 0),) if self.custom_mask or self.varlen else ()
        return (main, *plan, *order)

    def template_context(self) -> dict:
        ctx = super().template_context()
        ctx.update(
            q_in_regs=self.q_in_regs,
            mask_mode=MASK_CODES[self.mask],
            smem_row_elems=self.smem_row_elems,
            swizzle=self.head_dim % 64 == 0,
            wgmma=self.mma is Mma.WGMMA,
        )
        return ctx

    # --- fit ---------------------------------------------------------------------------------
    def check(self, a: Arch) -> None:
        if self.mma is Mma.WGMMA:
            self._check_wgmma(a)
            return
        warp_rows = self.cta_tile_q // self.num_warps
        if warp_rows % 16:
            raise SpecError("num_warps", self.num_warps, f"a divisor of cta_tile_q/16 = {self.cta_tile_q // 16}")
        # Register budget: fp32 accumulators of O (head_dim/8 tiles) and S (cta_tile_kv/8 tiles) per
        # 16-row m-tile, 4 floats each. Past ~200 the kernel spills.
        m_tiles = warp_rows // 16
        acc = m_tiles * 4 * (self.head_dim // 8 + self.cta_tile_kv // 8)
        if self.q_in_regs:
            acc += m_tiles * 4 * (self.head_dim // 16)
        if acc > 200:
            raise SpecError("cta_tile_q", self.cta_tile_q,
                            "a smaller cta_tile_q or cta_tile_kv, or more num_warps",
                            reason=f"needs about {acc} accumulator registers per thread (limit 200) "
                                   f"with head_dim={self.head_dim}, cta_tile_kv={self.cta_tile_kv}, "
                                   f"num_warps={self.num_warps}")
        check_smem(self, a, "cta_tile_kv", "a smaller cta_tile_kv, num_stages or cta_tile_q")

    def _check_wgmma(self, a: Arch) -> None:
        if not a.arch_specific or a.major != 9:
            raise SpecError("mma", self.mma.value, "mma_sync", reason=f"wgmma needs sm_90a; the target is {a.name}")
        if self.head_dim % 64:
            raise SpecError("head_dim", self.head_dim, "64, 128, 192, 256 (whole 128-byte swizzle rows) with mma=wgmma")
        if self.cta_tile_q != 16 * self.num_warps:
            raise SpecError("cta_tile_q", self.cta_tile_q, f"{16 * self.num_warps} with num_warps={self.num_warps}",
                            reason="with mma=wgmma each warpgroup of 4 warps owns 64 query rows")
        # Per thread: O (head_dim/2 floats), S (cta_tile_kv/2) and P packed to 16 bits (cta_tile_kv/4).
        # ptxas spilled past ~176 (NVRTC 13.5: head_dim 192 with 128-key tiles, estimate 192).
        acc = self.head_dim // 2 + self.cta_tile_kv // 2 + self.cta_tile_kv // 4
        if acc > 176:
            raise SpecError("cta_tile_kv", self.cta_tile_kv, "a smaller cta_tile_kv",
                            reason=f"needs about {acc} accumulator registers per thread (limit 176) with "
                                   f"head_dim={self.head_dim} and mma=wgmma")
        check_smem(self, a, "cta_tile_kv", "a smaller cta_tile_kv or num_stages")
