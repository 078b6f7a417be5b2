"""Loading binaries onto a device and launching them; tensor interop. The only GPU-touching module.

Kernels take one parameter struct passed by value; ``Kernel.launch`` receives it packed as
bytes, so the runtime stays family-agnostic. Launches go on the caller's current stream.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

from .arch import Arch, arch_for_capability, get_arch
from .cache import BuildResult, build
from .compiler import Binary
from ._driver import driver
from .errors import LaunchError
from .render import MERGE_THREADS
from .spec import Spec


def _cupy():
    try:
        import cupy
    except Exception as e:  # pragma: no cover - depends on the install
        raise LaunchError(f"CuPy is needed for CuPy arrays: {e}") from e
    return cupy


def device_arch(device: int) -> Arch:
    """The arch whose cubins run on ``device``."""
    return arch_for_capability(*driver().capability(device))


@dataclass
class Kernel:
    """A binary loaded on one device."""

    spec: Spec
    binary: Binary
    key: str
    device: int
    module: int
    func_ptr: int
    smem_bytes: int
    threads: int
    origin: str
    # Further entries of the module (e.g. a decode module's "_merge"): suffix -> (function, threads, smem).
    extra: "dict[str, tuple[int, int, int]] | None" = None

    def launch(self, grid: tuple[int, int, int], params: bytes, stream: int, entry: str = "") -> None:
        """Enqueue one launch with ``params`` (the packed parameter struct) on ``stream``; ``entry``
        names a further entry of the module by its suffix ("_merge"), default the main one."""
        func, threads, smem = (self.func_ptr, self.threads, self.smem_bytes) if not entry else self.extra[entry]
        drv = driver()
        buf = ctypes.create_string_buffer(params, len(params))
        argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
        pushed = drv.push(self.device)
        try:
            rc = drv.lib.cuLaunchKernel(func, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream, argv, None)
        finally:
            if pushed:
                drv.pop()
        if rc != 0:
            try:
                drv.check(rc, "cuLaunchKernel")
            except LaunchError as e:
                raise LaunchError(f"launch of {self.binary.kernel_name}{entry} (grid {grid}, {threads} threads, "
                                  f"{smem} bytes shared memory) failed: {e}") from None


def load(result: BuildResult, device: int) -> Kernel:
    """Load a built binary on ``device`` with every entry of its module, and raise their dynamic
    shared-memory limits."""
    spec = result.spec
    smem = spec.smem_bytes()
    main = result.binary.kernel_name
    names = tuple(getattr(spec, "entries", (main,)))
    # Entries past the main one: the unfused decode's "_pv" shares its launch shape; "_merge"
    # runs MERGE_THREADS threads and no dynamic shared memory.
    shapes = {"_pv": (spec.threads, smem), "_merge": (MERGE_THREADS, 0)}
    suffixes = [n[len(main):] for n in names[1:]]
    try:
        mod, fns = driver().load_functions(device, result.binary.cubin, names,
                                           (smem,) + tuple(shapes[x][1] for x in suffixes))
    except LaunchError as e:
        raise LaunchError(f"could not load {main} ({result.binary.arch}) on device {device}: {e}") from None
    extra = {x: (fn,) + shapes[x] for x, fn in zip(suffixes, fns[1:])}
    return Kernel(spec=spec, binary=result.binary, key=result.key, device=device, module=mod,
                  func_ptr=fns[0], smem_bytes=smem, threads=spec.threads, origin=result.origin, extra=extra)


_kernels: dict[tuple, Kernel] = {}
_kernels_lock = threading.Lock()


def get_kernel(spec: Spec, arch: "str | Arch | None" = None, device: int | None = None) -> Kernel:
    """A loaded kernel for ``spec`` on ``device`` (default: the current one).

    Repeated requests are one dictionary lookup; the first goes through the memory and disk
    caches and compiles only on a miss. ``arch`` defaults to the device's own.
    """
    if device is None:
        device = driver().current_device()
    k = (spec, arch, device)
    kern = _kernels.get(k)
    if kern is not None:
        return kern
    with _kernels_lock:
        a = get_arch(arch) if arch is not None else device_arch(device)
        canonical = (spec, a.name, device)
        kern = _kernels.get(canonical)
        if kern is None:
            kern = load(build(spec, a), device)
            _kernels[canonical] = kern
        _kernels[k] = kern
    return kern


def clear_loaded() -> None:
    with _kernels_lock:
        _kernels.clear()


# --- tensors -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    kind: str             # "torch" or "cupy"
    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    dtype: str            # "fp16", "bf16", "fp32" or the library's own name
    device: int


_TORCH_DTYPES = {"torch.float16": "fp16", "torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.int32": "int32"}
_CUPY_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "int32"}


def tensor_info(x: Any, name: str) -> TensorInfo:
    mod = type(x).__module__
    if mod.startswith("torch"):
        if not x.is_cuda:
            raise LaunchError(f"{name} is on {x.device}; attngen runs on CUDA tensors")
        return TensorInfo("torch", x.data_ptr(), tuple(x.shape), tuple(x.stride()),
                          _TORCH_DTYPES.get(str(x.dtype), str(x.dtype)), x.device.index)
    if mod.startswith("cupy"):
        item = x.dtype.itemsize
        return TensorInfo("cupy", x.data.ptr, tuple(x.shape), tuple(s // item for s in x.strides),
                          _CUPY_DTYPES.get(x.dtype.name, x.dtype.name), x.device.id)
    raise LaunchError(f"{name} is a {type(x).__module__}.{type(x).__name__}; attngen takes torch tensors "
                      f"or CuPy arrays on a CUDA device")


def current_stream(kind: str, device: int) -> int:
    """The caller's current stream on ``device``, as a raw handle."""
    if kind == "torch":
        import torch

        return torch.cuda.current_stream(device).cuda_stream
    return _cupy().cuda.get_current_stream(device).ptr


def empty_like_kind(kind: str, shape: tuple[int, ...], dtype: str, device: int):
    """A new contiguous array of ``kind`` on ``device``."""
    if kind == "torch":
        import torch

        tdt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        return torch.empty(shape, dtype=tdt, device=f"cuda:{device}")
    cp = _cupy()
    with cp.cuda.Device(device):
        return cp.empty(shape, dtype={"fp16": cp.float16, "fp32": cp.float32}.get(dtype, dtype))
