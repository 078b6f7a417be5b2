"""The few CUDA driver calls the runtime needs, through ctypes on libcuda.

Loading and launching through the driver directly keeps CuPy's import (hundreds of ms) off the
path of a warm kernel request, and keeps one launch to a few microseconds of Python. Modules are
loaded into each device's primary context, the one the CUDA runtime (torch, CuPy) uses.
"""

from __future__ import annotations

import ctypes
import functools
import threading

from .errors import LaunchError

CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36  # kHz
CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37  # bits
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_CUDA_ERROR_INVALID_CONTEXT = 201

_vp = ctypes.c_void_p


class Driver:
    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise LaunchError(f"the CUDA driver (libcuda.so.1) is not available: {e}") from None
        lib = self.lib
        lib.cuLaunchKernel.argtypes = [_vp, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                                       ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, _vp, _vp, _vp]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(_vp)]
        lib.cuCtxPushCurrent_v2.argtypes = [_vp]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(_vp)]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(_vp), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(_vp), _vp, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [_vp, ctypes.c_int, ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(_vp), ctypes.c_int]
        lib.cuDeviceGetName.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
        # The launch path's own bindings, without argtypes: ctypes then converts nothing but what it
        # is handed (ints as C ints, c_void_p objects as pointers), about 0.8 us less per launch than
        # the checked binding above. Callers pass pointers only as c_void_p (or None) and every int
        # below 2**31 (grid, block and shared-memory sizes are). Pointer arguments are not checked.
        self.raw_launch = ctypes.CFUNCTYPE(ctypes.c_int)(("cuLaunchKernel", lib))
        self.raw_ctx_get_current = ctypes.CFUNCTYPE(ctypes.c_int)(("cuCtxGetCurrent", lib))
        # cuLaunchKernelEx (CUDA 11.8+), for launches with attributes (programmatic dependent
        # launch); None where the driver lacks it.
        try:
            self.raw_launch_ex = ctypes.CFUNCTYPE(ctypes.c_int)(("cuLaunchKernelEx", lib))
        except AttributeError:
            self.raw_launch_ex = None
        try:
            lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), _vp, _vp]
            self._max_clusters = lib.cuOccupancyMaxActiveClusters
        except AttributeError:
            self._max_clusters = None
        self.check(lib.cuInit(0), "cuInit")
        self._encode_tiled = None  # cuTensorMapEncodeTiled, bound on first use
        self._primary: dict[int, int] = {}
        self._lock = threading.Lock()

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise LaunchError(f"{what} failed: {(name.value or b'CUDA error').decode()} ({rc})")

    def version(self) -> int:
        """The driver's CUDA version, as 1000 * major + 10 * minor (13000 for 13.0)."""
        v = ctypes.c_int()
        self.check(self.lib.cuDriverGetVersion(ctypes.byref(v)), "cuDriverGetVersion")
        return v.value

    def device_count(self) -> int:
        n = ctypes.c_int()
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def attribute(self, attr: int, device: int) -> int:
        v = ctypes.c_int()
        self.check(self.lib.cuDeviceGetAttribute(ctypes.byref(v), attr, device), "cuDeviceGetAttribute")
        return v.value

    def capability(self, device: int) -> tuple[int, int]:
        return (self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
                self.attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device))

    def device_name(self, device: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.check(self.lib.cuDeviceGetName(buf, 256, device), "cuDeviceGetName")
        return buf.value.decode(errors="replace").strip()

    def current_device(self) -> int:
        """The device of the calling thread's current context; 0 when none is current."""
        d = ctypes.c_int()
        rc = self.lib.cuCtxGetDevice(ctypes.byref(d))
        return d.value if rc == 0 else 0

    def current_context(self) -> int:
        c = _vp()
        self.lib.cuCtxGetCurrent(ctypes.byref(c))
        return c.value or 0

    def primary_context(self, device: int) -> int:
        ctx = self._primary.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._primary.get(device)
                if ctx is None:
                    if not 0 <= device < self.device_count():
                        raise LaunchError(f"device={device} does not exist; {self.device_count()} CUDA devices")
                    c = _vp()
                    self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(c), device), "cuDevicePrimaryCtxRetain")
                    ctx = self._primary[device] = c.value
        return ctx

    def max_active_clusters(self, func, device: int, config) -> int:
        """How many clusters of ``func`` (a c_void_p) the device holds at once, launched as ``config``
        (a CUlaunchConfig with the cluster's dimensions, by pointer) gives them; 0 where none fits or
        the driver cannot say."""
        if self._max_clusters is None:
            return 0
        n = ctypes.c_int(0)
        pushed = self.push(device)
        try:
            rc = self._max_clusters(ctypes.byref(n), func, config)
        finally:
            if pushed:
                self.pop()
        return n.value if rc == 0 else 0

    def blocks_per_sm(self, func, device: int, threads: int, smem: int) -> int:
        """How many CTAs of ``func`` (a c_void_p) of ``threads`` threads and ``smem`` bytes of dynamic
        shared memory one SM of ``device`` holds at once (registers, threads, shared memory)."""
        fn = self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor  # bound on first use
        fn.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        n = ctypes.c_int(0)
        pushed = self.push(device)
        try:
            self.check(fn(ctypes.byref(n), func, threads, smem), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        finally:
            if pushed:
                self.pop()
        return n.value

    def push(self, device: int) -> bool:
        """Make ``device``'s primary context current if it is not; True if it was pushed."""
        ctx = self.primary_context(device)
        if self.current_context() == ctx:
            return False
        self.check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")
        return True

    def pop(self) -> None:
        c = _vp()
        self.check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(c)), "cuCtxPopCurrent")

    def encode_tiled(self, dtype_code: int, addr: int, dims: "tuple[int, ...]", strides: "tuple[int, ...]",
                     box: "tuple[int, ...]", swizzle: int, l2_promotion: int) -> bytes:
        """A CUtensorMap (128 bytes) for TMA copies of ``box``-shaped tiles of a tensor at ``addr``
        (``dims`` innermost first, ``strides`` in bytes for every dim but the first; zero fill past the
        ends), from cuTensorMapEncodeTiled. Raises LaunchError naming the driver's error."""
        fn = self._encode_tiled
        if fn is None:
            u64, u32 = ctypes.c_uint64, ctypes.c_uint32
            fn = self.lib.cuTensorMapEncodeTiled  # CUDA 12.0+
            fn.argtypes = [_vp, ctypes.c_int, u32, _vp, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u32),
                           ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
            self._encode_tiled = fn
        n = len(dims)
        buf = ctypes.create_string_buffer(128 + 64)  # the map must be 64-byte aligned
        at = (ctypes.addressof(buf) + 63) & ~63
        rc = fn(at, dtype_code, n, addr, (ctypes.c_uint64 * n)(*dims), (ctypes.c_uint64 * (n - 1))(*strides),
                (ctypes.c_uint32 * n)(*box), (ctypes.c_uint32 * n)(*([1] * n)), 0, swizzle, l2_promotion, 0)
        self.check(rc, f"cuTensorMapEncodeTiled(dims={tuple(dims)}, byte strides={tuple(strides)}, box={tuple(box)})")
        return ctypes.string_at(at, 128)

    def load_functions(self, device: int, cubin: bytes, names: "tuple[str, ...]",
                       dynamic_smem: "tuple[int, ...]") -> tuple[int, tuple[int, ...]]:
        """Load ``cubin`` on ``device``; returns the module and one function handle per name, each
        allowed the dynamic shared memory given for it."""
        pushed = self.push(device)
        try:
            mod = _vp()
            self.check(self.lib.cuModuleLoadData(ctypes.byref(mod), cubin), f"cuModuleLoadData({names[0]})")
            fns = []
            for name, smem in zip(names, dynamic_smem):
                fn = _vp()
                self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), mod, name.encode()),
                           f"cuModuleGetFunction({name})")
                self.check(self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                           f"cuFuncSetAttribute({name}: max dynamic shared memory = {smem})")
                fns.append(fn.value)
            return mod.value, tuple(fns)
        finally:
            if pushed:
                self.pop()


@functools.lru_cache(maxsize=1)
def driver() -> Driver:
    return Driver()
