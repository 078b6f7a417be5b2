"""NVRTC's C API through ctypes: which library attngen compiles with, and the few calls a compile makes.

Bound here rather than through CuPy's bindings, whose first call imports CuPy and numpy: a cost every process's
first compile paid, about a tenth of a cold first call of a new variant. (The driver is bound the same way, for the
same reason: ``_driver.py``.) ctypes releases the GIL for each call, so compiles on threads run at once.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

from .errors import CompileError

_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
_INSTALL_HINT = ("install the CUDA stack for your driver: pip install 'attngen[cu13]' (CUDA 13 drivers) or "
                 "'attngen[cu12]' (CUDA 12 drivers), or set CUDA_PATH to a toolkit")


class NvrtcFailure(Exception):
    """A program NVRTC refused: ``str(e)`` is NVRTC's result code, ``log`` its program log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def library_candidates() -> list[str]:
    """Where NVRTC is looked for, in order: the pip wheels on sys.path, CUDA_PATH, then the system's loader."""
    names = ("nvidia/cu13/lib/libnvrtc.so.13", "nvidia/cuda_nvrtc/lib/libnvrtc.so.12")
    out = [str(Path(p) / n) for p in sys.path if p for n in names if (Path(p) / n).is_file()]
    cuda_path = os.environ.get("CUDA_PATH")
    if cuda_path:
        out += [str(p) for p in sorted(Path(cuda_path).glob("lib64/libnvrtc.so.*")) if p.name.count(".") == 2]
    return out + ["libnvrtc.so.13", "libnvrtc.so.12"]


def _load_builtins_beside(library: str, major: int, minor: int) -> None:
    """Load the builtins library beside ``library`` (a path), where there is one: the 13.0 wheel's NVRTC, loaded by
    its path, did not find it by itself ("failed to open libnvrtc-builtins.so.13.0"); once loaded, it is found by
    its name."""
    if "/" not in library:
        return
    builtins = Path(library).with_name(f"libnvrtc-builtins.so.{major}.{minor}")
    if builtins.is_file():
        try:
            ctypes.CDLL(str(builtins))
        except OSError:
            pass


class Nvrtc:
    """One loaded NVRTC library: ``path``, ``version`` (major, minor) and ``compile``."""

    def __init__(self, lib: ctypes.CDLL, path: str, version: tuple[int, int]):
        self.lib, self.path, self.version = lib, path, version
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(_vp), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                           _vp, _vp]
        lib.nvrtcCompileProgram.argtypes = [_vp, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(_vp)]
        for what in ("ProgramLog", "CUBIN", "PTX"):
            getattr(lib, f"nvrtcGet{what}Size").argtypes = [_vp, ctypes.POINTER(_sz)]
            getattr(lib, f"nvrtcGet{what}").argtypes = [_vp, ctypes.c_char_p]

    def _check(self, rc: int, call: str) -> None:
        if rc != 0:
            raise NvrtcFailure(f"{call}: {self.error_name(rc)}")

    def error_name(self, rc: int) -> str:
        """NVRTC's name for a result code, with the code: ``NVRTC_ERROR_COMPILATION (6)``."""
        name = self.lib.nvrtcGetErrorString(rc)
        return f"{name.decode() if name else 'NVRTC error'} ({rc})"

    def _get(self, prog: ctypes.c_void_p, what: str) -> bytes:
        n = _sz()
        self._check(getattr(self.lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(n)), f"nvrtcGet{what}Size")
        buf = ctypes.create_string_buffer(n.value)
        self._check(getattr(self.lib, f"nvrtcGet{what}")(prog, buf), f"nvrtcGet{what}")
        return buf.raw

    def compile(self, source: str, filename: str, options: "list[str] | tuple[str, ...]",
                want_ptx: bool = False) -> tuple[bytes, str, str]:
        """(cubin, program log, PTX or "") of ``source``; NvrtcFailure, with the log, where NVRTC refuses it."""
        prog = _vp()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), filename.encode(), 0, None,
                                                None), "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            rc = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            log = self._get(prog, "ProgramLog").decode(errors="replace").rstrip("\x00")
            if rc != 0:
                raise NvrtcFailure(self.error_name(rc), log)
            cubin = self._get(prog, "CUBIN")
            ptx = self._get(prog, "PTX").decode(errors="replace").rstrip("\x00") if want_ptx else ""
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return cubin, log, ptx


def _open(path: str) -> "Nvrtc | None":
    """The NVRTC at ``path`` (a path or a library name the loader finds), or None where that is not one."""
    if not path:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    try:
        lib = ctypes.CDLL(path)
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
            return None
    except (OSError, AttributeError):  # no such library; a library without nvrtcVersion
        return None
    _load_builtins_beside(path, major.value, minor.value)
    return Nvrtc(lib, path, (major.value, minor.value))


@functools.lru_cache(maxsize=1)
def nvrtc() -> Nvrtc:
    """The NVRTC every compile and cache key uses: the first of ``library_candidates`` that loads, else the one
    cuda-pathfinder finds; CompileError naming the install where there is none."""
    for cand in library_candidates():
        found = _open(cand)
        if found is not None:
            return found
    try:
        import cuda.pathfinder as pathfinder

        found = _open(pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # pathfinder's own not-found errors, or none installed
        found = None
    if found is None:
        raise CompileError(f"NVRTC not found (looked for {', '.join(library_candidates())}); {_INSTALL_HINT}")
    return found
