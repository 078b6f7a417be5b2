"""Facts per compute capability, and the arch names attngen accepts.

An arch is always passed explicitly to the pure stages (validate, render, compile); only the
runtime asks a device which arch it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SpecError


@dataclass(frozen=True)
class Arch:
    name: str              # "sm_90a"
    major: int
    minor: int
    smem_per_block: int    # bytes a block may use with the opt-in attribute
    smem_per_sm: int       # bytes of shared memory per multiprocessor
    regs_per_sm: int
    max_regs_per_thread: int
    arch_specific: bool    # the "a" variants: code runs only on that exact arch

    @property
    def cc(self) -> tuple[int, int]:
        return (self.major, self.minor)

    @property
    def has_cp_async(self) -> bool:
        return self.major >= 8

    @property
    def has_mma_m16n8k16(self) -> bool:
        return self.major >= 8

    @property
    def has_fp8_mma(self) -> bool:
        """mma.sync on e4m3/e5m2 (m16n8k32): sm_89 and newer."""
        return self.cc >= (8, 9)

    @property
    def has_wgmma(self) -> bool:
        """wgmma.mma_async: only the arch-specific variant of compute capability 9.0 (sm_90a)."""
        return self.arch_specific and self.major == 9


_K = 1024
ARCHS: dict[str, Arch] = {
    a.name: a
    for a in (
        Arch("sm_80", 8, 0, 163 * _K, 164 * _K, 65536, 255, False),
        Arch("sm_86", 8, 6, 99 * _K, 100 * _K, 65536, 255, False),
        Arch("sm_89", 8, 9, 99 * _K, 100 * _K, 65536, 255, False),
        Arch("sm_90", 9, 0, 227 * _K, 228 * _K, 65536, 255, False),
        Arch("sm_90a", 9, 0, 227 * _K, 228 * _K, 65536, 255, True),
        Arch("sm_100", 10, 0, 227 * _K, 228 * _K, 65536, 255, False),
        Arch("sm_120", 12, 0, 99 * _K, 100 * _K, 65536, 255, False),
    )
}


def get_arch(name: "str | Arch") -> Arch:
    """Parse an arch name ("sm_90a", "sm90a", "90a", "9.0", "compute_90a") into its facts."""
    if isinstance(name, Arch):
        return name
    s = str(name).strip().lower().replace(".", "")
    for prefix in ("compute_", "compute", "sm_", "sm"):  # sm_90a, sm90a, compute_90a, 90a, 9.0 alike
        if s.startswith(prefix):
            s = s[len(prefix):]
            break
    s = "sm_" + s
    if s not in ARCHS:
        raise SpecError("arch", name, ", ".join(ARCHS))
    return ARCHS[s]


# The arch a spec is rendered for when the caller names none (``attngen.render`` and ``attngen
# inspect``): the H100/H200's, whose wgmma kernels are the ones a tuning default on sm_90 would miss.
DEFAULT_ARCH = "sm_90a"


def target_arch(arch: "str | Arch | None" = None) -> Arch:
    """``arch``'s facts, or those of the default target (``DEFAULT_ARCH``, sm_90a: what an
    H100/H200 runs) when it is None. The one rule for every "no arch given" path that has no device
    to ask."""
    return get_arch(DEFAULT_ARCH if arch is None else arch)


def arch_for_capability(major: int, minor: int) -> Arch:
    """The arch attngen builds for on a device of this compute capability: the exact arch's "a"
    variant where there is one (sm_90a: its wgmma kernels run only on cc 9.0, which this device
    is), else the plain arch."""
    name = f"sm_{major}{minor}"
    if name + "a" in ARCHS:
        return ARCHS[name + "a"]
    if name in ARCHS:
        return ARCHS[name]
    # Newer minor revisions run code built for the family's base arch.
    base = [a for a in ARCHS.values() if a.major == major and not a.arch_specific and a.minor <= minor]
    if base:
        return max(base, key=lambda a: a.minor)
    raise SpecError("arch", f"sm_{major}{minor}", ", ".join(ARCHS),
                    reason="this GPU's compute capability is not supported")


def parse_arch_list(text: str) -> list[Arch]:
    """"sm_80,sm_90" -> [Arch, Arch], in order, without repeats."""
    out: list[Arch] = []
    for part in str(text).split(","):
        if part.strip():
            a = get_arch(part)
            if a not in out:
                out.append(a)
    if not out:
        raise SpecError("arch", text, ", ".join(ARCHS), reason="empty list")
    return out
