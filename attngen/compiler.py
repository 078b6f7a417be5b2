"""Compiling: CUDA source + arch -> Binary (cubin bytes and ptxas' resource report), via NVRTC.

Pure: needs no GPU. NVRTC and the CUDA headers come from the pip wheels of the ``cu13`` or ``cu12``
extra (``cuda-toolkit[cudart,nvrtc]`` of that major), or from ``CUDA_PATH`` when set; NVRTC is called
through ctypes (``_nvrtc``).
"""

from __future__ import annotations

import functools
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from ._nvrtc import NvrtcFailure, nvrtc
from .arch import Arch, get_arch
from .errors import CompileError

# Options every compile gets; part of the cache key. -Xptxas -v makes NVRTC's log carry the
# resource report.
BASE_OPTIONS: tuple[str, ...] = ("--std=c++17", "-Xptxas", "-v", "--device-as-default-execution-space")


REPORT_ONLY = ("smem_static", "spill_stores", "spill_loads")  # what only ptxas' report gives


@dataclass(frozen=True)
class Resources:
    """ptxas' report for a kernel's main entry function (``Binary.resources``).

    - ``registers``: registers per thread;
    - ``smem_static``: static shared memory in bytes (the dynamic part is the spec's ``smem_bytes()``);
    - ``stack_frame``: bytes of local-memory stack frame per thread;
    - ``spill_stores`` / ``spill_loads``: bytes spilled to and reloaded from local memory;
    - ``known``: False where NVRTC's log held no report: registers and stack frame are then read from
      the cubin; static shared memory and the spill counts are not known (a spill needs a stack frame,
      so a frame of 0 still rules them out).
    """

    registers: int = 0
    smem_static: int = 0
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    known: bool = True

    def to_dict(self) -> dict:
        return dict(registers=self.registers, smem_static=self.smem_static, stack_frame=self.stack_frame,
                    spill_stores=self.spill_stores, spill_loads=self.spill_loads, known=self.known)

    def reported(self) -> dict:
        """``to_dict`` as a report shows it: static shared memory and the spill counts None where not known."""
        return self.to_dict() if self.known else {**self.to_dict(), **dict.fromkeys(REPORT_ONLY)}

    @classmethod
    def from_dict(cls, d: dict) -> "Resources":
        vals = {k: int(d.get(k, 0)) for k in cls.__dataclass_fields__ if k != "known"}
        return cls(**vals, known=bool(d.get("known", True)))


@dataclass(frozen=True)
class Binary:
    """Plain, picklable object code: what ``attngen.compile`` returns, the cache stores and the runtime loads.

    - ``cubin``: the ELF object code for exactly ``arch``;
    - ``kernel_name``: the main entry function's name (``extern "C"``);
    - ``arch``: the target, e.g. ``"sm_90a"``;
    - ``options``: the NVRTC options it was compiled with (part of the cache key);
    - ``nvrtc_version``: the NVRTC that compiled it, e.g. ``"13.0"``;
    - ``resources``: ptxas' report for the main entry (``Resources``);
    - ``log``: NVRTC's log; ``compile_seconds``: how long the compile took;
    - ``ptx``: the PTX, when asked for (``compile(..., want_ptx=True)``), else empty.

    Its ``repr`` names the kernel, arch, cubin size and resources, never the bytes.
    """

    cubin: bytes
    kernel_name: str
    arch: str
    options: tuple[str, ...]
    nvrtc_version: str
    resources: Resources
    log: str = ""
    compile_seconds: float = 0.0
    ptx: str = field(default="", repr=False)

    def summary(self) -> str:
        """One line for a repr: kernel name, arch, cubin size, resources (never the bytes or the log)."""
        r = self.resources
        res = f"registers={r.registers}, stack_frame={r.stack_frame}"
        if r.known:
            res += f", smem_static={r.smem_static}, spills={r.spill_stores}/{r.spill_loads}"
        return f"kernel_name='{self.kernel_name}', arch='{self.arch}', cubin={len(self.cubin)} bytes, {res}"

    def __repr__(self) -> str:
        return f"Binary({self.summary()})"


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    """The NVRTC version, part of every cache key: that of the library every compile uses (``_nvrtc.nvrtc``)."""
    return "{}.{}".format(*nvrtc().version)


def include_dirs() -> list[str]:
    """CUDA header folders: ``CUDA_PATH/include`` when set, else the nvidia-cuda-runtime wheel's."""
    dirs: list[str] = []
    cuda_path = os.environ.get("CUDA_PATH")
    if cuda_path and (Path(cuda_path) / "include" / "cuda_fp16.h").is_file():
        dirs.append(str(Path(cuda_path) / "include"))
    else:
        try:
            import cuda.pathfinder as pathfinder

            d = pathfinder.find_nvidia_header_directory("cudart")
        except Exception:  # pragma: no cover
            d = None
        if d:
            dirs.append(str(d))
    if not dirs:
        raise CompileError("CUDA headers not found: pip install 'attngen[cu13]' or 'attngen[cu12]' (they "
                           "bring cuda-toolkit[cudart]), or set CUDA_PATH to a toolkit with include/cuda_fp16.h")
    return dirs


def cache_options(version: str) -> tuple[str, ...]:
    """``--no-cache`` for NVRTC 12.9 and later, which otherwise keeps every program it compiles in the CUDA
    driver's compute cache (where a driver is loaded: ~/.nv/ComputeCache) and serves a repeat from there without
    running ptxas. Such a build's log has no ptxas report, so its spills and ptxas' notes go unknown, and a cold
    compile is only a lookup; and attngen's own cache already holds the cubin. Earlier NVRTCs have no such cache and
    refuse the option."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return ("--no-cache",) if (major, minor) >= (12, 9) else ()


def compile_options(arch: Arch, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The final option list for ``arch`` (without include paths, which vary by machine)."""
    return (f"--gpu-architecture={arch.name}",) + BASE_OPTIONS + cache_options(nvrtc_version()) + tuple(extra)


_RES = {
    "registers": re.compile(r"Used (\d+) registers"),
    "smem_static": re.compile(r"(\d+) bytes smem"),
    "stack_frame": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}


def parse_resources(log: str, kernel_name: str = "") -> Resources:
    """Registers / shared memory / spills from ptxas' ``-v`` report for one entry function."""
    text = log
    if kernel_name:
        i = log.find(f"Compiling entry function '{kernel_name}'")
        if i >= 0:
            text = log[i:]
            j = text.find("Compiling entry function", 10)
            text = text if j < 0 else text[:j]
    vals = {}
    for k, rx in _RES.items():
        m = rx.search(text)
        vals[k] = int(m.group(1)) if m else 0
    return Resources(**vals)


_NOTE = re.compile(r"^ptxas[^(\n]*\((C\d{4})\)\s*(.*)$", re.M)
_NOTE_LINE = re.compile(r"\bline \d+")


def performance_notes(log: str) -> tuple[str, ...]:
    """ptxas' coded notes in a build log, one line each (``C7514: ...``), in order; notes that differ only in the
    source line they name are one, with the number of places (``(3 places)``). On sm_90a they say where ptxas
    ignored setmaxnreg (C7508), or serialised wgmma or waited for it to protect accumulator registers (C7514-C7520):
    the kernel still runs correctly, with its MMAs no longer overlapped, and the log is the only sign."""
    places: dict[str, int] = {}
    for code, text in _NOTE.findall(log):
        note = f"{code}: {_NOTE_LINE.sub('line N', text.strip())}"
        places[note] = places.get(note, 0) + 1
    return tuple(n if k == 1 else f"{n} ({k} places)" for n, k in places.items())


def note_codes(notes) -> str:
    """The codes of ``performance_notes``' lines, comma-separated (``C7508, C7519``): for one-line reports."""
    return ", ".join(n.split(":", 1)[0] for n in notes)


# EIATTR codes of the cubin's .nv.info section: per function symbol, its registers and its stack frame.
_EIATTR_REGCOUNT, _EIATTR_FRAME_SIZE, _EIFMT_SVAL = 0x2F, 0x11, 4


def cubin_resources(cubin: bytes, kernel_name: str) -> Resources:
    """What the cubin itself says of entry ``kernel_name``: registers and stack frame (``.nv.info``'s
    attributes for its symbol); static shared memory and the spill counts are not there (``known`` False).
    Zeros where the cubin does not say."""
    try:
        shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

        def cstr(at: int) -> bytes:
            return cubin[at:cubin.index(b"\0", at)]

        names = [cstr(heads[shstrndx][4] + h[0]) for h in heads]
        sec = dict(zip(names, heads))
        symtab = sec[b".symtab"]
        strtab_off = heads[symtab[6]][4]  # sh_link: the symbols' names
        sym = next(i for i in range(symtab[5] // 24)
                   if cstr(strtab_off + struct.unpack_from("<I", cubin, symtab[4] + 24 * i)[0])
                   == kernel_name.encode())
        vals = {}
        info = sec.get(b".nv.info")
        p, end = (info[4], info[4] + info[5]) if info else (0, 0)
        while p + 4 <= end:
            fmt, attr, size = cubin[p], cubin[p + 1], struct.unpack_from("<H", cubin, p + 2)[0]
            if fmt != _EIFMT_SVAL:
                p += 4
                continue
            if size >= 8 and struct.unpack_from("<I", cubin, p + 4)[0] == sym:
                vals[attr] = struct.unpack_from("<I", cubin, p + 8)[0]
            p += 4 + size
    except (struct.error, ValueError, KeyError, IndexError, StopIteration):
        return Resources(known=False)
    return Resources(registers=vals.get(_EIATTR_REGCOUNT, 0), stack_frame=vals.get(_EIATTR_FRAME_SIZE, 0),
                     known=False)


def compile(source: str, arch: "str | Arch", *, kernel_name: str, extra_options: tuple[str, ...] = (),
            want_ptx: bool = False, filename: str = "attngen_kernel.cu", entries: tuple[str, ...] = ()) -> Binary:
    """Compile ``source`` to a cubin for exactly ``arch``; raise CompileError with the log on failure.

    ``kernel_name`` is the main entry (its ptxas report is kept); ``entries`` lists every entry
    the module must hold (default: the main one)."""
    lib = nvrtc()
    used = nvrtc_version()
    a = get_arch(arch)
    options = compile_options(a, extra_options)
    full = list(options) + [f"-I{d}" for d in include_dirs()]
    t0 = time.perf_counter()
    cubin, log, ptx = _run_nvrtc(lib, source, filename, full, want_ptx, kernel_name, a, options)
    secs = time.perf_counter() - t0
    # Every kernel has a section ".text.<name>" in the cubin, whatever the log says.
    for name in entries or (kernel_name,):
        if b".text." + name.encode() + b"\x00" not in cubin:
            raise CompileError(f"the source has no entry function named {name}", log=log, source=source,
                               name=kernel_name, options=options)
    # A log without ptxas' report (NVRTC's own cache served the build: cache_options turns it off) leaves the
    # registers and stack frame to the cubin, and the spills unknown.
    known = f"'{kernel_name}'" in log
    return Binary(cubin=cubin, kernel_name=kernel_name, arch=a.name, options=options,
                  nvrtc_version=used,
                  resources=parse_resources(log, kernel_name) if known else cubin_resources(cubin, kernel_name),
                  log=log, compile_seconds=secs, ptx=ptx)


def _run_nvrtc(lib, source, filename, full, want_ptx, kernel_name, a, options):
    try:
        cubin, log, ptx = lib.compile(source, filename, full, want_ptx)
    except NvrtcFailure as e:
        raise CompileError(f"NVRTC failed to compile {kernel_name} for {a.name}: {e}", log=e.log,
                           source=source, name=kernel_name, options=options) from None
    return cubin, log, ptx
