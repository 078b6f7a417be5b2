"""Specs: frozen, validated descriptions of the kernels attngen can build.

A spec holds only ints, bools and enums, so nothing a user types can reach a template
unvalidated. Tuning fields default to 0, meaning "the arch's default": ``resolve(spec, arch)``
fills them in, and the resolved spec is what is rendered, keyed and compiled.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Union

from .arch import Arch, get_arch
from .errors import SpecError


class DType(enum.Enum):
    FP16 = "fp16"
    BF16 = "bf16"

    @property
    def itemsize(self) -> int:
        return 2


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


def _allowed(values) -> str:
    return ", ".join(str(v.value if isinstance(v, enum.Enum) else v) for v in values)


def _coerce_enum(cls, name: str, value):
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        for member in cls:
            if member.value == value.strip().lower():
                return member
    raise SpecError(name, value, _allowed(cls))


def _coerce_int(name: str, value, allowed) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
            raise SpecError(name, value, _allowed(allowed), reason="must be an integer")
    if value not in allowed:
        raise SpecError(name, value, _allowed(allowed))
    return value


def _coerce_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise SpecError(name, value, "true, false")


class _SpecBase:
    """What every family's spec shares: the resolved check, serialization, the kernel's name."""

    family: ClassVar[str]
    TUNING_FIELDS: ClassVar[tuple[str, ...]]
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("head_dim", "dtype")

    @property
    def is_resolved(self) -> bool:
        return all(getattr(self, f) for f in self.TUNING_FIELDS)

    @property
    def entries(self) -> tuple[str, ...]:
        """Every entry function in the kernel's module, the main one first."""
        return (self.kernel_name,)

    def _require_resolved(self, what: str):
        if not self.is_resolved:
            raise SpecError("spec", self.to_text(), "a resolved spec (see attngen.resolve)",
                            reason=f"{what} needs concrete tuning fields")

    # --- serialization ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"family": self.family}
        for f in fields(self):
            v = getattr(self, f.name)
            d[f.name] = v.value if isinstance(v, enum.Enum) else v
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Spec":
        d = dict(d)
        fam = d.pop("family", cls.family)
        if fam != cls.family:
            raise SpecError("family", fam, cls.family)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecError(unknown[0], d[unknown[0]], ", ".join(sorted(known)),
                            reason=f"unknown field of a {cls.family} spec")
        return cls(**d)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def to_text(self, full: bool = False) -> str:
        """Compact form, e.g. ``prefill:head_dim=128,dtype=bf16,mask=causal``."""
        default = type(self)()
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if full or v != getattr(default, f.name) or f.name in self.ALWAYS_SHOWN:
                v = v.value if isinstance(v, enum.Enum) else v
                parts.append(f"{f.name}={str(v).lower() if isinstance(v, bool) else v}")
        return f"{self.family}:" + ",".join(parts)

    def digest(self) -> str:
        """Short stable hash of the canonical spec; feeds the kernel's symbol name."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @property
    def kernel_name(self) -> str:
        return f"attngen_{self.family}_{self.digest()}"

    def replace(self, **changes) -> "Spec":
        return dataclasses.replace(self, **changes)



@dataclass(frozen=True)
class PrefillSpec(_SpecBase):
    """FlashAttention-2-style forward pass (prefill).

    Tuning fields (``cta_tile_q``, ``cta_tile_kv``, ``num_warps``, ``num_stages``) take 0 for
    "choose for the arch"; ``resolve`` turns them into numbers.
    """

    family: ClassVar[str] = "prefill"
    template: ClassVar[str] = "prefill.cu.jinja"

    HEAD_DIMS: ClassVar[tuple[int, ...]] = (64, 96, 128, 192, 256)
    CTA_TILE_Q: ClassVar[tuple[int, ...]] = (0, 64, 128)
    CTA_TILE_KV: ClassVar[tuple[int, ...]] = (0, 32, 64, 128)
    NUM_WARPS: ClassVar[tuple[int, ...]] = (0, 4, 8)
    NUM_STAGES: ClassVar[tuple[int, ...]] = (0, 1, 2, 3, 4)

    head_dim: int = 128
    dtype: DType = DType.BF16
    mask: MaskMode = MaskMode.NONE
    return_lse: bool = False
    cta_tile_q: int = 0
    cta_tile_kv: int = 0
    num_warps: int = 0
    num_stages: int = 0
    mma: Mma = Mma.AUTO

    def __post_init__(self):
        s = object.__setattr__
        s(self, "head_dim", _coerce_int("head_dim", self.head_dim, self.HEAD_DIMS))
        s(self, "dtype", _coerce_enum(DType, "dtype", self.dtype))
        s(self, "mask", _coerce_enum(MaskMode, "mask", self.mask))
        s(self, "mma", _coerce_enum(Mma, "mma", self.mma))
        s(self, "return_lse", _coerce_bool("return_lse", self.return_lse))
        s(self, "cta_tile_q", _coerce_int("cta_tile_q", self.cta_tile_q, self.CTA_TILE_Q))
        s(self, "cta_tile_kv", _coerce_int("cta_tile_kv", self.cta_tile_kv, self.CTA_TILE_KV))
        s(self, "num_warps", _coerce_int("num_warps", self.num_warps, self.NUM_WARPS))
        s(self, "num_stages", _coerce_int("num_stages", self.num_stages, self.NUM_STAGES))
        if self.cta_tile_q and self.num_warps and self.cta_tile_q % (16 * self.num_warps):
            raise SpecError("num_warps", self.num_warps,
                            f"a divisor of cta_tile_q/16 = {self.cta_tile_q // 16}",
                            reason=f"each warp owns a whole number of 16-row tiles of cta_tile_q={self.cta_tile_q}")

    TUNING_FIELDS: ClassVar[tuple[str, ...]] = ("cta_tile_q", "cta_tile_kv", "num_warps", "num_stages", "mma")
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("head_dim", "dtype", "mask")

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

class Variant(enum.Enum):
    FUSED = "fused"      # one kernel: S = Q K^T, online softmax and O += P V per KV tile
    UNFUSED = "unfused"  # QK^T + per-row max/sum to a workspace, then a second kernel for P V


@dataclass(frozen=True)
class DecodeSpec(_SpecBase):
    """Decode against a KV cache: q_len 1..8 new tokens per sequence, GQA-packed.

    One CTA serves every query head of one KV head (``q_rows`` = group x q_len packed rows,
    rounded up to a multiple of 16) over one split of the cache, so each K/V byte is read
    once per split. ``paged`` addresses the cache through a block table. Partial results of
    several splits are merged through their LSE by the module's ``_merge`` entry.
    Tuning fields (``cta_tile_kv``, ``num_warps``, ``num_stages``) take 0 for the arch's default.
    """

    family: ClassVar[str] = "decode"
    template: ClassVar[str] = "decode.cu.jinja"

    HEAD_DIMS: ClassVar[tuple[int, ...]] = (64, 128, 256)
    Q_ROWS: ClassVar[tuple[int, ...]] = (16, 32, 64, 128)
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
    cta_tile_kv: int = 0
    num_warps: int = 0
    num_stages: int = 0

    def __post_init__(self):
        s = object.__setattr__
        s(self, "head_dim", _coerce_int("head_dim", self.head_dim, self.HEAD_DIMS))
        s(self, "dtype", _coerce_enum(DType, "dtype", self.dtype))
        s(self, "q_rows", _coerce_int("q_rows", self.q_rows, self.Q_ROWS))
        s(self, "paged", _coerce_bool("paged", self.paged))
        s(self, "variant", _coerce_enum(Variant, "variant", self.variant))
        s(self, "cta_tile_kv", _coerce_int("cta_tile_kv", self.cta_tile_kv, self.CTA_TILE_KV))
        s(self, "num_warps", _coerce_int("num_warps", self.num_warps, self.NUM_WARPS))
        s(self, "num_stages", _coerce_int("num_stages", self.num_stages, self.NUM_STAGES))

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
    def threads(self) -> int:
        self._require_resolved("threads")
        return 32 * self.num_warps

    def smem_bytes(self) -> int:
        """The Q tile and the cp.async ring (K and V tiles; for the unfused kernels, V tiles with
        their fp32 scores) during the KV loop; after it, the same bytes hold the per-row max/sum
        of every warp and the fp32 partial outputs of the warps past the first along the keys."""
        self._require_resolved("smem_bytes")
        row = self.head_dim * self.dtype.itemsize
        q = self.q_rows * row
        ring = self.num_stages * self.cta_tile_kv * row * 2
        if self.variant is Variant.UNFUSED:
            # the P V kernel stages fp32 scores (q_rows x cta_tile_kv, padded) next to each V tile
            ring = self.num_stages * (self.cta_tile_kv * row + self.q_rows * (self.cta_tile_kv + 4) * 4)
        combine = ((self.warps_n - 1) * self.q_rows * (self.head_dim + 4) + 2 * self.warps_n * self.q_rows) * 4
        return max(q + ring, combine)

    @property
    def entries(self) -> tuple[str, ...]:
        n = self.kernel_name
        return (n, n + "_pv", n + "_merge") if self.variant is Variant.UNFUSED else (n, n + "_merge")


FAMILIES: dict[str, type] = {PrefillSpec.family: PrefillSpec, DecodeSpec.family: DecodeSpec}
Spec = Union[PrefillSpec, DecodeSpec]  # the union of families


def parse_spec(text: "str | Spec | dict") -> Spec:
    """``prefill:head_dim=128,dtype=bf16,mask=causal`` -> PrefillSpec; fields left out take defaults."""
    if isinstance(text, tuple(FAMILIES.values())):
        return text
    if isinstance(text, dict):
        fam = text.get("family")
        if fam not in FAMILIES:
            raise SpecError("family", fam, ", ".join(FAMILIES))
        return FAMILIES[fam].from_dict(text)
    s = str(text).strip()
    fam, _, rest = s.partition(":")
    fam = fam.strip()
    if fam not in FAMILIES:
        raise SpecError("family", fam, ", ".join(FAMILIES),
                        reason="a spec's text form starts with its family, e.g. prefill:head_dim=128")
    d: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq or not k.strip():
            raise SpecError("spec", item, "name=value pairs separated by commas")
        k = k.strip()
        if k in d:
            raise SpecError(k, v, "each field once", reason="given twice")
        d[k] = v.strip()
    return FAMILIES[fam].from_dict(d)


# --- per-arch defaults and fit -----------------------------------------------------------

# Measured on an H200 (sm_90) with NVRTC 13.5, bf16, 16k tokens at seqlen 4096, 2026-11-22
# (tools/sweep_configs.py; BENCHMARKS.md). Archs with less shared memory take the best
# measured config that fits them.
_TUNED = {
    # head_dim: [(cta_tile_q, cta_tile_kv, num_warps, num_stages), ...] best first (mma.sync kernels)
    64: [(128, 64, 4, 3), (64, 64, 4, 3)],
    96: [(128, 64, 8, 2)],
    128: [(64, 64, 4, 3), (128, 64, 8, 2)],
    192: [(128, 32, 8, 2), (64, 32, 4, 2)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2)],
}

# sm_90a: the wgmma kernels, one warpgroup per 64 query rows (cta_tile_q = 16 x num_warps), per
# (head_dim, masked). From tools/sweep_configs.py on an H100 (NVRTC 13.5, bf16, 16k tokens at
# seqlen 4096, 2026-11-22; BENCHMARKS.md); head_dim 192 not timed yet.
_TUNED_WGMMA = {
    (64, False): [(64, 64, 4, 2), (64, 128, 4, 2)],
    (64, True): [(64, 128, 4, 2), (64, 64, 4, 3)],
    (128, False): [(128, 128, 8, 3), (64, 64, 4, 3)],
    (128, True): [(128, 128, 8, 3), (128, 128, 8, 2)],
    (192, False): [(128, 64, 8, 2)],
    (192, True): [(128, 64, 8, 2)],
    (256, False): [(128, 64, 8, 2), (64, 64, 4, 1)],
    (256, True): [(128, 64, 8, 2), (64, 64, 4, 1)],
}


# Configs ptxas spills on some archs (NVRTC 13.5): there the next tuned config is taken.
_SPILLS_ON = {
    (64, (128, 64, 4, 3)): ("sm_80", "sm_86", "sm_89", "sm_120"),
}


# Decode, per (head_dim, paged): [(cta_tile_kv, num_warps, num_stages), ...] best first. From
# tools/sweep_decode.py on an H100 (NVRTC 13.5, bf16, 2026-11-22, timed with an L2 flush): two
# stages of large tiles matched or beat deeper rings; paged caches want more CTAs per SM to hide
# the table reads.
# head_dim 128 contiguous from tools/probe_decode.py --configs (timed as a decode step) on an H200
# and an H100: four stages of 64-key tiles keep the H200's faster memory busy, where the 128-key
# two-stage ring was 8-11% slower than cuDNN, and are within 1% of the best config on the H100.
_TUNED_DECODE = {
    (64, False): [(128, 4, 2), (64, 4, 2)],
    (64, True): [(128, 4, 2), (64, 4, 3)],
    (128, False): [(64, 4, 4), (128, 4, 2), (64, 4, 2)],
    (128, True): [(64, 4, 2)],
    (256, False): [(64, 4, 2), (32, 8, 2)],
    (256, True): [(64, 4, 2), (32, 8, 2)],
}


# Decode configs ptxas spills on some archs (NVRTC 13.5), per (head_dim, paged, q_rows, variant).
_DECODE_SPILLS_ON = {
    ((256, True, 16, "fused"), (64, 4, 2)): ("sm_80",),
    ((64, True, 16, "fused"), (128, 4, 2)): ("sm_80",),
    ((64, False, 64, "unfused"), (64, 4, 2)): ("sm_86", "sm_89"),
}


def _candidates(spec: "Spec", arch: Arch):
    """Tuned configs first, then every allowed combination, larger tiles first."""
    if isinstance(spec, DecodeSpec):
        where = (spec.head_dim, spec.paged, spec.q_rows, spec.variant.value)
        every = itertools.chain(_TUNED_DECODE[(spec.head_dim, spec.paged)],
                                itertools.product((64, 128, 32, 16), (4, 8), (4, 3, 2, 1)))
        yield from (c for c in every if arch.name not in _DECODE_SPILLS_ON.get((where, c), ()))
        return
    d = spec.head_dim
    if arch.name == "sm_90a" and d % 64 == 0:
        yield from ((*c, Mma.WGMMA) for c in _TUNED_WGMMA[(d, spec.mask is not MaskMode.NONE)])
        yield from ((16 * w, kv, w, st, Mma.WGMMA) for w in (8, 4) for kv in (128, 64, 32) for st in (2, 3, 1, 4))
    yield from ((*c, Mma.SYNC) for c in _TUNED[d] if arch.name not in _SPILLS_ON.get((d, c), ()))
    yield from ((*c, Mma.SYNC) for c in itertools.product((128, 64), (64, 128, 32), (4, 8), (2, 3, 1, 4)))


def default_tuning(spec: "Spec", arch: Arch) -> dict[str, int]:
    """Tuning fields for a spec on an arch: the fastest measured config that agrees with the fields
    the user pinned and fits the arch; failing that, the first allowed combination that does."""
    names = spec.TUNING_FIELDS
    pinned = {k: getattr(spec, k) for k in names if getattr(spec, k)}
    first_error: SpecError | None = None
    for cfg in _candidates(spec, get_arch(arch)):
        t = dict(zip(names, cfg))
        if any(t[k] != v for k, v in pinned.items()):
            continue
        try:
            cand = spec.replace(**t)
        except SpecError:
            continue  # an inconsistent combination (warps vs cta_tile_q), not a reason to report
        try:
            validate(cand, arch)
        except SpecError as e:
            first_error = first_error or e  # the closest config's reason is the useful one
            continue
        return t
    if first_error is not None:
        raise first_error
    raise SpecError(", ".join(pinned), ", ".join(map(str, pinned.values())), "values some config can fit",
                    reason=f"no tile configuration fits {get_arch(arch).name}")


def tuning_candidates(spec: Spec, arch: "str | Arch") -> list[Spec]:
    """Every resolved spec the tuning space offers for ``spec`` on ``arch``: the configs that agree
    with the tuning fields ``spec`` pins and pass ``validate``. The arch's default
    (``resolve(spec, arch)``) comes first, then the measured configs, then the rest, larger tiles
    first. Raises ``resolve``'s ``SpecError`` when nothing fits."""
    a = get_arch(arch)
    default = resolve(spec, a)
    out, seen = [default], {default}
    names = spec.TUNING_FIELDS
    pinned = {k: getattr(spec, k) for k in names if getattr(spec, k)}
    for cfg in _candidates(spec, a):
        t = dict(zip(names, cfg))
        if any(t[k] != v for k, v in pinned.items()):
            continue
        try:
            cand = spec.replace(**t)
            validate(cand, a)
        except SpecError:
            continue
        if cand not in seen:
            seen.add(cand)
            out.append(cand)
    return out


def resolve(spec: Spec, arch: "str | Arch") -> Spec:
    """Fill the tuning fields left at 0 for ``arch``, then validate."""
    a = get_arch(arch)
    if not spec.is_resolved:
        spec = spec.replace(**default_tuning(spec, a))
    validate(spec, a)
    return spec


def validate(spec: Spec, arch: "str | Arch") -> None:
    """Reject what cannot compile or cannot fit on ``arch``, naming the field to change."""
    a = get_arch(arch)
    if not a.has_mma_m16n8k16:
        raise SpecError("arch", a.name, "sm_80 or newer", reason="the kernels use mma.sync m16n8k16 and cp.async")
    spec._require_resolved("validate")
    if isinstance(spec, DecodeSpec):
        _validate_decode(spec, a)
        return
    if spec.mma is Mma.WGMMA:
        _validate_wgmma(spec, a)
        return
    warp_rows = spec.cta_tile_q // spec.num_warps
    if warp_rows % 16:
        raise SpecError("num_warps", spec.num_warps, f"a divisor of cta_tile_q/16 = {spec.cta_tile_q // 16}")
    # Register budget: fp32 accumulators of O (head_dim/8 tiles) and S (cta_tile_kv/8 tiles) per
    # 16-row m-tile, 4 floats each. Past ~200 the kernel spills.
    m_tiles = warp_rows // 16
    acc = m_tiles * 4 * (spec.head_dim // 8 + spec.cta_tile_kv // 8)
    if spec.q_in_regs:
        acc += m_tiles * 4 * (spec.head_dim // 16)
    if acc > 200:
        raise SpecError("cta_tile_q", spec.cta_tile_q,
                        "a smaller cta_tile_q or cta_tile_kv, or more num_warps",
                        reason=f"needs about {acc} accumulator registers per thread (limit 200) "
                               f"with head_dim={spec.head_dim}, cta_tile_kv={spec.cta_tile_kv}, num_warps={spec.num_warps}")
    _check_smem(spec, a, "cta_tile_kv", "a smaller cta_tile_kv, num_stages or cta_tile_q")


def _check_smem(spec: Spec, a: Arch, field: str, allowed: str) -> None:
    """Reject a spec whose shared memory exceeds the arch's per-block limit, naming ``field``."""
    smem = spec.smem_bytes()
    if smem > a.smem_per_block:
        raise SpecError(field, getattr(spec, field), allowed,
                        reason=f"needs {smem} bytes of shared memory; {a.name} allows {a.smem_per_block} per block")


def _validate_wgmma(spec: PrefillSpec, a: Arch) -> None:
    if not a.arch_specific or a.major != 9:
        raise SpecError("mma", spec.mma.value, "mma_sync", reason=f"wgmma needs sm_90a; the target is {a.name}")
    if spec.head_dim % 64:
        raise SpecError("head_dim", spec.head_dim, "64, 128, 192, 256 (whole 128-byte swizzle rows) with mma=wgmma")
    if spec.cta_tile_q != 16 * spec.num_warps:
        raise SpecError("cta_tile_q", spec.cta_tile_q, f"{16 * spec.num_warps} with num_warps={spec.num_warps}",
                        reason="with mma=wgmma each warpgroup of 4 warps owns 64 query rows")
    # Per thread: O (head_dim/2 floats), S (cta_tile_kv/2) and P packed to 16 bits (cta_tile_kv/4).
    # ptxas spilled past ~176 (NVRTC 13.5: head_dim 192 with 128-key tiles, estimate 192).
    acc = spec.head_dim // 2 + spec.cta_tile_kv // 2 + spec.cta_tile_kv // 4
    if acc > 176:
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, "a smaller cta_tile_kv",
                        reason=f"needs about {acc} accumulator registers per thread (limit 176) with "
                               f"head_dim={spec.head_dim} and mma=wgmma")
    _check_smem(spec, a, "cta_tile_kv", "a smaller cta_tile_kv or num_stages")


def _validate_decode(spec: DecodeSpec, a: Arch) -> None:
    keys_per_warp = spec.cta_tile_kv // spec.warps_n
    if keys_per_warp < 16 or keys_per_warp % 16:
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, f"a multiple of {16 * spec.warps_n}",
                        reason=f"{spec.warps_n} warps split each KV tile and each needs whole 16-key steps "
                               f"(q_rows={spec.q_rows}, num_warps={spec.num_warps})")
    acc = spec.m_tiles * 4 * (spec.head_dim // 8 + keys_per_warp // 8)
    if spec.q_in_regs:
        acc += spec.m_tiles * 4 * (spec.head_dim // 16)
    # Decode keeps more live state per accumulator than prefill (row limits, per-row addresses of
    # the packed heads); past ~136 ptxas spilled (NVRTC 13.5, sm_90, every q_rows x head_dim).
    if acc > 136:
        raise SpecError("num_warps", spec.num_warps, "more warps (8), a smaller cta_tile_kv or a smaller q_rows",
                        reason=f"needs about {acc} accumulator registers per thread (limit 136) with "
                               f"head_dim={spec.head_dim}, q_rows={spec.q_rows}")
    _check_smem(spec, a, "num_stages", "a smaller num_stages or cta_tile_kv")
