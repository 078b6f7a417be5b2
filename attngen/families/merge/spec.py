"""``MergeSpec``: the merge family's spec, its fit rules, its template context and its entry.

A merge combines partial attention results, each a normalised output row with its log-sum-exp (natural log),
into the row attention over the union of their keys would give: weights exp(s_i - max s), output the weighted
mean, LSE max s + log(sum of the weights). Rows are read in 16-byte vectors: with two states a thread takes one
vector of a (token, head) row; with several a warp takes a chunk of up to 32 of them, its lanes sharing the states'
LSE through shuffles. The spec fixes the element type, the head dim and how the states are laid out.

The text of this module feeds the cache key (it decides what the template context holds).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from ...arch import Arch
from ...errors import SpecError
from ...spec import SpecBase, coerce_enum, coerce_int

MAX_HEAD_DIM = 1024
HEAD_DIMS_TEXT = f"a multiple of 8 from 8 to {MAX_HEAD_DIM}"


class MergeDType(enum.Enum):
    """The element type of the states' values and of the merged output (the LSE is always fp32)."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"

    @property
    def itemsize(self) -> int:
        return 4 if self is MergeDType.FP32 else 2


class States(enum.Enum):
    """How the states reach the kernel: two tensors (``attngen.merge_state``) or one tensor with a states dim
    (``attngen.merge_states``, their count a kernel argument)."""

    PAIR = "pair"
    MANY = "many"


@dataclass(frozen=True)
class MergeSpec(SpecBase):
    """Merge partial attention states (values and LSE) of ``head_dim`` columns in ``dtype``.

    Tuning field: ``num_warps`` (warps a CTA, 0 for the default), each warp one chunk of a row."""

    family: ClassVar[str] = "merge"
    HEAD_DIMS: ClassVar[tuple[int, ...]] = tuple(range(8, MAX_HEAD_DIM + 1, 8))
    NUM_WARPS: ClassVar[tuple[int, ...]] = (0, 2, 4, 8)
    TUNING_FIELDS: ClassVar[tuple[str, ...]] = ("num_warps",)
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("head_dim", "dtype", "states")

    head_dim: int = 128
    dtype: MergeDType = MergeDType.BF16
    states: States = States.PAIR
    num_warps: int = 0

    def __post_init__(self):
        s = object.__setattr__
        d = self.head_dim
        if isinstance(d, int) and not isinstance(d, bool) and d.bit_length() <= 64 and d not in self.HEAD_DIMS:
            raise SpecError("head_dim", d, HEAD_DIMS_TEXT,
                            reason="rows are read in 16-byte vectors (8 16-bit or 4 fp32 elements)")
        s(self, "head_dim", coerce_int("head_dim", d, self.HEAD_DIMS))
        s(self, "dtype", coerce_enum(MergeDType, "dtype", self.dtype))
        s(self, "states", coerce_enum(States, "states", self.states))
        s(self, "num_warps", coerce_int("num_warps", self.num_warps, self.NUM_WARPS))

    @property
    def vec(self) -> int:
        """Elements of one 16-byte vector."""
        return 16 // self.dtype.itemsize

    @property
    def vecs(self) -> int:
        """16-byte vectors of a (token, head) row."""
        return self.head_dim // self.vec

    @property
    def lanes_per_row(self) -> int:
        """Threads a (token, head) row: a thread a vector for two states, whole warps (``chunks``) for several."""
        return self.vecs if self.states is States.PAIR else 32 * self.chunks

    @property
    def chunks(self) -> int:
        """Warps a (token, head) row with several states: each holds up to 32 of its vectors, one a lane."""
        return -(-self.head_dim // (32 * self.vec))

    @property
    def threads(self) -> int:
        self._require_resolved("threads")
        return 32 * self.num_warps

    def smem_bytes(self) -> int:
        return 0

    def name_parts(self) -> tuple[str, ...]:
        return (f"d{self.head_dim}", self.dtype.value, self.states.value, self.name_piece("w{}", self.num_warps))

    def template_context(self) -> dict:
        ctx = super().template_context()
        elem = {"fp16": "__half", "bf16": "__nv_bfloat16", "fp32": "float"}[self.dtype.value]
        ctx.update(elem_t=elem, is_bf16=self.dtype is MergeDType.BF16, vec=self.vec, chunks=self.chunks,
                   many=self.states is States.MANY)
        return ctx

    def check(self, a: Arch) -> None:
        """Every resolved merge fits every arch attngen builds for: no shared memory, no tensor cores, a few
        registers a lane (one 16-byte vector a state in flight, ``UNROLL`` states at a time)."""
