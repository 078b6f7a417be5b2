"""A toy kernel family that lives outside the package, as a third party's plug-in would: y = x * scale.

It is what docs/ADDING_A_FAMILY.md walks through; tests/test_family.py registers it (importing
this package does), builds it with NVRTC, inspects, prewarms it and, on a GPU, launches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from attngen.arch import Arch
from attngen.errors import SpecError
from attngen.family import Family, register
from attngen.spec import DType, SpecBase, coerce_enum, coerce_int


@dataclass(frozen=True)
class ToySpec(SpecBase):
    """Scale a vector: ``y[i] = x[i] * scale``, one element per thread."""

    family: ClassVar[str] = "toy"
    THREADS_PER_BLOCK: ClassVar[tuple[int, ...]] = (0, 64, 128, 256, 1024)
    TUNING_FIELDS: ClassVar[tuple[str, ...]] = ("threads_per_block",)
    ALWAYS_SHOWN: ClassVar[tuple[str, ...]] = ("dtype",)

    dtype: DType = DType.BF16
    threads_per_block: int = 0

    def __post_init__(self):
        object.__setattr__(self, "dtype", coerce_enum(DType, "dtype", self.dtype))
        object.__setattr__(self, "threads_per_block",
                           coerce_int("threads_per_block", self.threads_per_block, self.THREADS_PER_BLOCK))

    @property
    def threads(self) -> int:
        self._require_resolved("threads")
        return self.threads_per_block

    def smem_bytes(self) -> int:
        return 0

    def name_parts(self) -> tuple[str, ...]:
        return (self.dtype.value, self.name_piece("t{}", self.threads_per_block))

    def check(self, a: Arch) -> None:
        # A made-up fit rule, so that resolve has something to fall through: the toy keeps
        # blocks of 1024 threads for Hopper and newer.
        if self.threads_per_block == 1024 and a.major < 9:
            raise SpecError("threads_per_block", 1024, "64, 128, 256", reason=f"the toy takes 1024 only on sm_90+, not {a.name}")


def candidates(spec: ToySpec, arch: Arch):
    """Best first: 1024 where the fit rule allows it, else 256, then the rest."""
    yield from ((1024,), (256,), (128,), (64,))


FAMILY = register(Family(
    name="toy",
    spec=ToySpec,
    candidates=candidates,
    template="toy.cu.jinja",
    template_dir=Path(__file__).resolve().parent / "templates",
    summary="a test plug-in: y = x * scale",
))
