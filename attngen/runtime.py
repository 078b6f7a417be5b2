"""Loading binaries onto a device and launching them; tensor interop. The only GPU-touching module.

Kernels take one parameter struct passed by value; ``Kernel.launch`` receives it packed as
bytes, so the runtime stays family-agnostic. Launches go on the caller's current stream.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from .arch import Arch, arch_for_capability, get_arch
from .builder import BuildResult, build
from .compiler import Binary
from ._driver import driver
from .errors import LaunchError
from .spec import Spec, SpecBase, as_spec


def _cupy():
    from .fs import cupy_cache_dir

    cupy_cache_dir()
    try:
        import cupy
    except Exception as e:  # pragma: no cover - depends on the install
        raise LaunchError(f"CuPy is needed for CuPy arrays: {e}") from e
    return cupy


def device_arch(device: int) -> Arch:
    """The arch whose cubins run on ``device``."""
    return arch_for_capability(*driver().capability(device))


# Parameter bytes of one launch, per thread: the driver copies them when the launch is enqueued,
# so one buffer serves every launch of a thread (4096 bytes: the classic kernel-parameter limit).
_MAX_PARAM_BYTES = 4096
_tls = threading.local()

# Programmatic dependent launch: the entries a family lists (``Spec.PDL_ENTRIES``) are launched on
# sm_90 and newer through cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
# so that, in a stream or a CUDA graph, each may be scheduled while the kernel before it finishes
# (the kernel itself waits for that one's writes). ``ATTNGEN_PDL=0`` turns it off.
_pdl = [os.environ.get("ATTNGEN_PDL", "1").strip() != "0"]
# CUlaunchConfig up to hStream: grid x/y/z, block x/y/z, dynamic shared memory, padding, stream;
# then the attribute array's pointer and count, set once per thread.
_LAUNCH_CONFIG = struct.Struct("<7I4xQ")
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_ATTR_BYTES = 72  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union


def set_pdl(enabled: bool) -> bool:
    """Turn programmatic dependent launch on or off for later launches (benchmarks compare the
    two); returns the previous setting."""
    was, _pdl[0] = _pdl[0], bool(enabled)
    return was


def _thread_slot():
    """This thread's launch buffers: (parameters, argv pointer, current-context out-parameter, its
    byref, argv, launch config, its pointer, the PDL attribute, a cluster launch's config, its
    pointer, its attributes (the cluster's dimensions, then PDL))."""
    buf = ctypes.create_string_buffer(_MAX_PARAM_BYTES)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(buf))
    cur = ctypes.c_void_p()
    attr = ctypes.create_string_buffer(_ATTR_BYTES)
    struct.pack_into("<i4xi", attr, 0, _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    cfg = ctypes.create_string_buffer(56)
    struct.pack_into("<QI", cfg, 40, ctypes.addressof(attr), 1)
    cattrs = ctypes.create_string_buffer(2 * _ATTR_BYTES)
    struct.pack_into("<i4x3I", cattrs, 0, _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 1, 1, 1)
    struct.pack_into("<i4xi", cattrs, _ATTR_BYTES, _CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)
    ccfg = ctypes.create_string_buffer(56)
    struct.pack_into("<Q", ccfg, 40, ctypes.addressof(cattrs))
    # argv as a c_void_p holding its address: the launch binding below takes no argtypes, and a
    # ctypes object converts faster than an array. ``argv`` is kept alive alongside.
    slot = (buf, ctypes.c_void_p(ctypes.addressof(argv)), cur, ctypes.byref(cur), argv,
            cfg, ctypes.c_void_p(ctypes.addressof(cfg)), attr, ccfg, ctypes.c_void_p(ctypes.addressof(ccfg)), cattrs)
    _tls.slot = slot
    return slot


def _cluster_config(slot, grid, threads: int, smem: int, stream: int, cluster_x: int, pdl: bool) -> None:
    """Fill this thread's cluster launch config (``slot[8]``, its attributes ``slot[10]``): the grid,
    clusters of ``cluster_x`` CTAs along x, and with ``pdl`` programmatic serialization too."""
    _LAUNCH_CONFIG.pack_into(slot[8], 0, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream)
    struct.pack_into("<I", slot[10], 8, cluster_x)
    struct.pack_into("<I", slot[8], 48, 2 if pdl else 1)


@dataclass(eq=False, repr=False)
class Kernel:
    """A binary loaded on one device (what ``attngen.get_kernel`` returns): its resolved ``spec``, the
    ``binary``, the cache ``key``, the ``device``, the driver's module and function handles, the main
    entry's launch shape (``threads``, dynamic ``smem_bytes``) and the build's ``origin``."""

    spec: Spec
    binary: Binary
    key: str
    device: int
    module: int
    func_ptr: int
    smem_bytes: int
    threads: int
    origin: str
    context: int = 0  # the device's primary context, which holds the module
    # Further entries of the module (e.g. a decode module's "_merge"): suffix -> (function, threads, smem).
    extra: "dict[str, tuple[int, int, int]] | None" = None

    def __post_init__(self):
        drv = driver()
        if not self.context:
            self.context = drv.primary_context(self.device)
        self._drv = drv
        self._func = ctypes.c_void_p(self.func_ptr)
        major = get_arch(self.binary.arch).major  # a Binary names its arch as text (it is stored and pickled)
        pdl = major >= 9 and drv.raw_launch_ex is not None
        self._clusters = pdl and major == 9  # decode's cluster merge: measured on sm_90
        self._cluster_count: dict[int, int] = {}  # cluster size -> clusters held at once
        self._per_sm: dict[str, int] = {}  # entry -> CTAs an SM holds at once
        listed = self.spec.PDL_ENTRIES
        self._entries = {"": (self._func, self.threads, self.smem_bytes, pdl and "" in listed)}
        for suffix, (fn, threads, smem) in (self.extra or {}).items():
            self._entries[suffix] = (ctypes.c_void_p(fn), threads, smem, pdl and suffix in listed)
        self._ctx_current = drv.raw_ctx_get_current
        self._cu_launch = drv.raw_launch
        self._cu_launch_ex = drv.raw_launch_ex

    def __repr__(self) -> str:
        return (f"Kernel(spec='{self.spec}', {self.binary.summary()}, device={self.device}, threads={self.threads}, "
                f"smem_bytes={self.smem_bytes}, origin='{self.origin}')")

    @property
    def pdl(self) -> bool:
        """Whether the main entry launches with programmatic dependent launch."""
        return self._entries[""][3]

    def launch(self, grid: tuple[int, int, int], params: bytes, stream: int, entry: str = "") -> None:
        """Enqueue one launch with ``params`` (the packed parameter struct) on ``stream``; ``entry``
        names a further entry of the module by its suffix ("_merge"), default the main one."""
        n = len(params)
        if n > _MAX_PARAM_BYTES:
            raise LaunchError(f"{n} bytes of kernel parameters; at most {_MAX_PARAM_BYTES}")
        try:
            slot = _tls.slot
        except AttributeError:
            slot = _thread_slot()
        ctypes.memmove(slot[0], params, n)
        self._enqueue(grid, stream, slot, entry)

    def occupancy(self, entry: str = "") -> int:
        """How many CTAs of an entry (by suffix, "" the main one) one SM holds at once: the driver's
        count, from the entry's registers, threads and shared memory."""
        n = self._per_sm.get(entry)
        if n is None:
            func, threads, smem, _ = self._entries[entry]
            n = self._per_sm[entry] = self._drv.blocks_per_sm(func, self.device, threads, smem)
        return n

    def max_clusters(self, cluster_x: int) -> int:
        """How many clusters of ``cluster_x`` CTAs of the main entry the device holds at once (the
        driver's count, which knows how SMs group into GPCs: fewer than SMs / ``cluster_x`` where a
        GPC's SMs do not divide into whole clusters); 0 where clusters may not be launched."""
        if not self._clusters:
            return 0
        n = self._cluster_count.get(cluster_x)
        if n is None:
            slot = getattr(_tls, "slot", None) or _thread_slot()
            func, threads, smem, _ = self._entries[""]
            _cluster_config(slot, (cluster_x, 1, 1), threads, smem, 0, cluster_x, False)
            n = self._cluster_count[cluster_x] = self._drv.max_active_clusters(func, self.device, slot[9])
        return n

    def launch_struct(self, layout: struct.Struct, grid: tuple[int, int, int], stream: int, *values,
                      entry: str = "", cluster_x: int = 0) -> None:
        """``launch`` with the parameters packed by ``layout`` straight into this thread's buffer;
        ``cluster_x`` > 0 launches the grid's x in clusters of that many CTAs (which divides it;
        ``max_clusters`` says where that may be asked).

        The ops' hot path: no bytes object and no ctypes buffer per call, one context query, and
        the launch through a binding without argtypes (see ``_driver``).
        """
        try:
            slot = _tls.slot
        except AttributeError:
            slot = _thread_slot()
        layout.pack_into(slot[0], 0, *values)  # struct.error past the buffer's end, before any launch
        # The module lives in the device's primary context, which torch and CuPy make current on
        # their threads; it is pushed only where another context (or none) is current. One query
        # per launch, rather than a per-thread memo that a device switch would make stale.
        self._ctx_current(slot[3])
        if slot[2].value != self.context:
            return self._enqueue(grid, stream, slot, entry, cluster_x)
        self._go(grid, stream, slot, entry, cluster_x)

    def _go(self, grid, stream, slot, entry: str, cluster_x: int = 0) -> None:
        """The driver call: cuLaunchKernelEx with the cluster's dimensions (and programmatic
        serialization as below) for a cluster launch, or with programmatic serialization alone for an
        entry the family lists (while PDL is on), else cuLaunchKernel."""
        func, threads, smem, pdl = self._entries[entry]
        if cluster_x:
            _cluster_config(slot, grid, threads, smem, stream, cluster_x, pdl and _pdl[0])
            rc = self._cu_launch_ex(slot[9], func, slot[1], None)
        elif pdl and _pdl[0]:
            _LAUNCH_CONFIG.pack_into(slot[5], 0, grid[0], grid[1], grid[2], threads, 1, 1, smem, stream)
            rc = self._cu_launch_ex(slot[6], func, slot[1], None)
        else:
            rc = self._cu_launch(func, grid[0], grid[1], grid[2], threads, 1, 1, smem,
                                 ctypes.c_void_p(stream) if stream else None, slot[1], None)
        if rc:
            self._failed(rc, grid, entry)

    def _enqueue(self, grid, stream, slot, entry: str = "", cluster_x: int = 0) -> None:
        drv = self._drv
        pushed = drv.push(self.device)  # a no-op where the primary context is current already
        try:
            self._go(grid, stream, slot, entry, cluster_x)
        finally:
            if pushed:
                drv.pop()

    def _failed(self, rc: int, grid, entry: str = "") -> None:
        _, threads, smem, _ = self._entries[entry]
        try:
            self._drv.check(rc, "cuLaunchKernel")
        except LaunchError as e:
            raise LaunchError(f"launch of {self.binary.kernel_name}{entry} (grid {tuple(grid)}, {threads} threads, "
                              f"{smem} bytes shared memory) failed: {e}") from None


class Launch(NamedTuple):
    """One ``Kernel.launch_struct`` call, as ``recorded_launches`` sees it."""
    kernel: Kernel
    entry: str  # "" for the module's main entry
    grid: tuple[int, int, int]
    cluster_x: int
    values: tuple  # the parameters, in the order the layout packs them


@contextlib.contextmanager
def recorded_launches(record: Callable[[Launch], Any] | None = None, *,
                      launch_if: Callable[[Launch], bool] | None = None):
    """Within it, every ``Kernel.launch_struct`` (the ops' launches, any thread) appends to the yielded list
    ``record(launch)`` where given and not None, else the ``Launch`` itself; where ``launch_if(launch)`` is
    false the launch is left out (a probe timing part of a call). For benchmarks, tests and probes, which need
    what a call launched after its per-call choices. Outside it the host path is untouched."""
    seen: list = []
    launch = Kernel.launch_struct

    def recording(self, layout, grid, stream, *values, entry="", cluster_x=0):
        one = Launch(self, entry, tuple(grid), cluster_x, values)
        item = one if record is None else record(one)
        if item is not None:
            seen.append(item)
        if launch_if is None or launch_if(one):
            launch(self, layout, grid, stream, *values, entry=entry, cluster_x=cluster_x)

    Kernel.launch_struct = recording
    try:
        yield seen
    finally:
        Kernel.launch_struct = launch


def load(result: BuildResult, device: int) -> Kernel:
    """Load a built binary on ``device`` with every entry of its module, and raise their dynamic
    shared-memory limits. The spec says each entry's launch shape (``launch_shapes``)."""
    spec = result.spec
    main = result.binary.kernel_name
    shapes = spec.launch_shapes()
    names = tuple(main + suffix for suffix, _, _ in shapes)
    try:
        mod, fns = driver().load_functions(device, result.binary.cubin, names, tuple(smem for _, _, smem in shapes))
    except LaunchError as e:
        raise LaunchError(f"could not load {main} ({result.binary.arch}) on device {device}: {e}"
                          f"{_driver_hint(result.binary.nvrtc_version)}") from None
    (_, threads, smem), extra = shapes[0], {s: (fn, th, sm) for (s, th, sm), fn in zip(shapes[1:], fns[1:])}
    return Kernel(spec=spec, binary=result.binary, key=result.key, device=device, module=mod,
                  func_ptr=fns[0], smem_bytes=smem, threads=threads, origin=result.origin, extra=extra,
                  context=driver().primary_context(device))


def _driver_hint(nvrtc: str) -> str:
    """Why a load may fail: a driver older than the NVRTC major that built the cubin."""
    try:
        drv = driver().version()
        major = int(nvrtc.split(".")[0])
    except (LaunchError, ValueError):
        return ""
    if drv // 1000 >= major:
        return ""
    extra = f"'attngen[cu{drv // 1000}]'" if drv // 1000 in (12, 13) else "the extra for your driver's CUDA major"
    return (f"; the CUDA driver is {drv // 1000}.{drv % 1000 // 10} and cannot load cubins from NVRTC {nvrtc}: "
            f"install {extra} in place of the current CUDA extra, or upgrade the driver")


_kernels: dict[tuple, Kernel] = {}
_kernels_lock = threading.Lock()


def get_kernel(spec: Spec | str | Mapping, arch: "str | Arch | None" = None, device: int | None = None) -> Kernel:
    """A loaded kernel for ``spec`` (a spec object, its text or a dict of its fields) on ``device``
    (default: the current one).

    Repeated requests are one dictionary lookup; the first goes through the memory and disk
    caches and compiles only on a miss. ``arch`` defaults to the device's own.
    """
    if not isinstance(spec, SpecBase):
        spec = as_spec(spec)
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


class TunedKernels:
    """The base of an op's per-problem plan: its ``kernel``, or (``kernel`` None) ``specs[i]`` for sizes (a
    seqlen, a cache capacity) from ``bounds[i - 1]``, each loaded on first use: a family's ``SizeTable``
    (``attngen/families/choice.py``), which its choice function made."""

    __slots__ = ("kernel", "bounds", "specs", "kernels", "device")

    def take(self, table, device: int, load: bool = True) -> None:
        """Run ``table`` on ``device``: a table of one spec loaded now unless ``load`` is false (a call may run
        another form of it: ``spec_for``); a table by sizes loads each spec on first use, so that a first call
        compiles only the kernel its size runs."""
        self.device = device
        if load and len(table.specs) == 1:
            self.kernel = get_kernel(table.specs[0], device=device)
            return
        self.kernel = None
        self.bounds = list(table.bounds)
        self.specs = list(table.specs)
        self.kernels = [None] * len(self.specs)

    def spec_for(self, size: int):
        """The spec ``kernel_for(size)`` loads, without loading it."""
        return self.kernel.spec if self.kernel is not None else self.specs[bisect.bisect_right(self.bounds, size)]

    def kernel_for(self, size: int) -> Kernel:
        i = bisect.bisect_right(self.bounds, size)
        kern = self.kernels[i]
        if kern is None:
            kern = self.kernels[i] = get_kernel(self.specs[i], device=self.device)
        return kern


# Caches of the ops that hold Kernels (their per-problem plans); cleared along with ours.
_dependent_caches: list[dict] = []


def register_dependent_cache(d: dict) -> dict:
    """Have ``clear_loaded`` clear ``d`` too (an op's memo of kernels); returns ``d``."""
    _dependent_caches.append(d)
    return d


_NUMBERS = frozenset((int, float))
_MAX_CALLS = 256


def keep_call(memo: dict, key, call, flags: tuple = (), numbers: tuple = ()) -> None:
    """Remember ``call`` (what an op worked out for a call: checks passed, kernel, grid, parameters)
    under ``key`` in the op's memo (``register_dependent_cache``), which keeps the last few hundred.
    Only where the key was made (not None), every flag is a bool and every number None, an int or a
    float: an argument of another class (a 0-dim tensor whose value may change) is never keyed by."""
    if key is None:
        return
    for f in flags:
        if f.__class__ is not bool:
            return
    for x in numbers:
        if x is not None and x.__class__ not in _NUMBERS:
            return
    if len(memo) >= _MAX_CALLS:
        memo.clear()
    memo[key] = call


def clear_loaded() -> None:
    with _kernels_lock:
        _kernels.clear()
        for d in _dependent_caches:
            d.clear()


# While torch.compile traces, a callable that returns True (attngen.torch_ops sets it to
# torch.compiler.is_compiling when it registers the custom ops): each op then hands its call to its
# custom op. None until then, so an eager call pays one attribute read.
tracing: Callable[[], bool] | None = None
# name -> the function that hands that op's call to its custom op (filled by attngen.torch_ops).
traced_ops: dict[str, Callable[..., Any]] = {}

# --- tensors -------------------------------------------------------------------------------------

class TensorInfo(NamedTuple):
    """What a launch needs of an array. A NamedTuple: built once per argument per call, it must be cheap."""

    kind: str             # "torch" or "cupy"
    ptr: int
    shape: tuple[int, ...]    # torch.Size (a tuple) for torch tensors
    strides: tuple[int, ...]  # in elements
    dtype: str            # "fp16", "bf16", "fp32" or the library's own name
    device: int


_new_info = tuple.__new__  # TensorInfo without its Python-level __new__ (half the cost)
_CUPY_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "int32", "bool": "bool"}
_kinds: dict[type, str] = {}              # array type -> "torch" / "cupy", decided once per type
_torch_dtypes: dict[Any, str] = {}        # torch dtype object -> name (no str() per call)
_torch_dtype_objs: dict[str, Any] = {}    # name -> torch dtype object


def _torch():
    import torch

    if not _torch_dtypes:
        for obj, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16"), (torch.float32, "fp32"),
                          (torch.int32, "int32"), (torch.bool, "bool")):
            _torch_dtype_objs[name] = obj
            _torch_dtypes[obj] = name
        # bytes (fp8 prefill's scratch copy of v) can be allocated; their tensor_info name stays torch's own
        _torch_dtype_objs["uint8"] = torch.uint8
    return torch


def _kind_of(x: Any, name: str) -> str:
    tp = type(x)
    mod = tp.__module__
    if mod.startswith("torch"):
        _torch()
        kind = "torch"
    elif mod.startswith("cupy"):
        kind = "cupy"
    else:
        raise LaunchError(f"{name} is a {mod}.{tp.__name__}; attngen takes torch tensors "
                          f"or CuPy arrays on a CUDA device")
    _kinds[tp] = kind
    return kind


def tensor_info(x: Any, name: str) -> TensorInfo:
    kind = _kinds.get(type(x)) or _kind_of(x, name)
    if kind == "torch":
        if not x.is_cuda:
            raise LaunchError(f"{name} is on {x.device}; attngen runs on CUDA tensors")
        dt = x.dtype
        # get_device() is an int straight from C; x.device.index builds a torch.device first.
        return _new_info(TensorInfo, ("torch", x.data_ptr(), x.shape, x.stride(), _torch_dtypes.get(dt) or str(dt),
                                      x.get_device()))
    item = x.dtype.itemsize
    return _new_info(TensorInfo, ("cupy", x.data.ptr, x.shape, tuple(s // item for s in x.strides),
                                  _CUPY_DTYPES.get(x.dtype.name, x.dtype.name), x.device.id))


_raw_stream: "Callable[[int], int] | None" = None


def torch_stream_getter() -> Callable[[int], int]:
    """A function device -> torch's current raw stream handle on it.

    ``torch._C._cuda_getCurrentRawStream`` returns the handle as an int; the public
    ``torch.cuda.current_stream(device).cuda_stream`` builds a Stream object per call (a few us).
    The private one is used where it exists.
    """
    global _raw_stream
    if _raw_stream is None:
        torch = _torch()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _raw_stream = raw if callable(raw) else (lambda device: torch.cuda.current_stream(device).cuda_stream)
    return _raw_stream


def current_stream(kind: str, device: int) -> int:
    """The caller's current stream on ``device``, as a raw handle."""
    if kind == "torch":
        return torch_stream_getter()(device)
    return _cupy().cuda.get_current_stream(device).ptr


_allocators: dict[tuple[str, str, int], Callable] = {}


def allocator(kind: str, dtype: str, device: int) -> Callable[..., Any]:
    """A function ``(*shape)`` -> new contiguous array of ``kind``/``dtype`` on ``device``, made once
    per triple.

    For torch it binds the dtype and device objects, so a call parses no device string, and
    passes the sizes as separate ints (torch parses those ~0.7 us faster than one tuple).
    """
    key = (kind, dtype, device)
    fn = _allocators.get(key)
    if fn is not None:
        return fn
    if kind == "torch":
        torch = _torch()
        tdt, tdev, empty = _torch_dtype_objs[dtype], torch.device("cuda", device), torch.empty

        def fn(*shape):
            return empty(*shape, dtype=tdt, device=tdev)
    else:
        cp = _cupy()
        cdt = {"fp16": cp.float16, "fp32": cp.float32}.get(dtype, dtype)

        def fn(*shape):
            with cp.cuda.Device(device):
                return cp.empty(shape, dtype=cdt)
    _allocators[key] = fn
    return fn


def empty_like_kind(kind: str, shape: tuple[int, ...], dtype: str, device: int):
    """A new contiguous array of ``kind`` on ``device``."""
    return allocator(kind, dtype, device)(*shape)


def data_ptr(x, kind: str) -> int:
    """The device address of an array the op made itself (``empty_like_kind``), without building a
    ``TensorInfo`` for it."""
    return x.data_ptr() if kind == "torch" else x.data.ptr
