"""A stand-in for libcuda.so.1 on machines without a GPU: the host path of a launch, timed and checked.

``install()`` compiles a small C library (gcc) that exports the driver calls attngen uses, with
the soname ``libcuda.so.1``, and loads it globally: ``ctypes.CDLL("libcuda.so.1")`` in
``attngen._driver`` then finds it by soname. Each call costs what a real ctypes call costs, so
the Python side of ``attngen.prefill`` can be timed; the launch itself is a no-op that records
its arguments. Device 0 reports compute capability 9.0, 132 SMs and an H200's memory, and its primary context
is current.

Use it only in a process of its own (a subprocess or a tool): once loaded, CUDA libraries that
look for libcuda in the same process (CuPy, torch) would find the stub.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef int CUresult;
static void *primary = (void *)0x1000;
static void *current = (void *)0x1000;
static long launches, pushes, pops, ctx_queries;
static unsigned last_grid[3], last_block;
static unsigned last_smem;
static void *last_stream, *last_func;
static int last_pdl;  /* the last launch asked for programmatic stream serialization */
static int last_cluster;  /* the last launch's cluster size along x (0: no cluster) */
static unsigned char last_params[1024];

CUresult cuInit(unsigned f) { return 0; }
CUresult cuGetErrorName(CUresult rc, const char **s) { *s = rc == 201 ? "CUDA_ERROR_INVALID_CONTEXT" : "CUDA_ERROR_STUB"; return 0; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return 0; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    /* sm_90 with 132 SMs; an H200's memory (3.2 GHz, 6144 bits: 4.9 TB/s) */
    *v = attr == 75 ? 9 : attr == 76 ? 0 : attr == 16 ? 132 : attr == 36 ? 3200000 : attr == 37 ? 6144 : 0;
    return dev == 0 ? 0 : 101;
}
CUresult cuDeviceGetName(char *name, int len, int dev) { strncpy(name, "Fake GPU (attngen stub)", len); return 0; }
CUresult cuCtxGetDevice(int *d) { *d = 0; return current ? 0 : 201; }
CUresult cuCtxGetCurrent(void **c) { ctx_queries++; *c = current; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int dev) { *c = primary; return 0; }
CUresult cuCtxPushCurrent_v2(void *c) { pushes++; current = c; return 0; }
CUresult cuCtxPopCurrent_v2(void **c) { pops++; if (c) *c = current; current = 0; return 0; }
CUresult cuModuleLoadData(void **m, const void *img) { *m = (void *)0x2000; return 0; }
CUresult cuModuleGetFunction(void **f, void *m, const char *name) { *f = (void *)0x3000; return 0; }
CUresult cuFuncSetAttribute(void *f, int attr, int v) { return 0; }
CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, void *stream, void **params, void **extra) {
    if (current != primary) return 201;
    launches++; last_func = f; last_grid[0] = gx; last_grid[1] = gy; last_grid[2] = gz; last_block = bx;
    last_smem = smem; last_stream = stream;
    memcpy(last_params, params[0], sizeof last_params);
    last_pdl = 0; last_cluster = 0;
    return 0;
}
/* CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out */
typedef struct { int id; int pad; int value[16]; } Attr;
typedef struct { unsigned gx, gy, gz, bx, by, bz, smem; void *stream; Attr *attrs; unsigned n; } Config;
CUresult cuLaunchKernelEx(const Config *c, void *f, void **params, void **extra) {
    CUresult rc = cuLaunchKernel(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->smem, c->stream, params, extra);
    for (unsigned i = 0; i < c->n; i++)
        if (c->attrs[i].id == 6) last_pdl = c->attrs[i].value[0];
        else if (c->attrs[i].id == 4) last_cluster = c->attrs[i].value[0];  /* the cluster's x */
    return rc;
}
/* Clusters of up to 8 CTAs fit, 120 CTAs of them at once (an H100 holds 30 of 4 and 15 of 8). */
CUresult cuOccupancyMaxActiveClusters(int *n, void *f, const Config *c) {
    unsigned x = 1;
    for (unsigned i = 0; i < c->n; i++)
        if (c->attrs[i].id == 4) x = (unsigned)c->attrs[i].value[0];
    *n = x <= 8 ? 120 / x : 0;
    return 0;
}
/* The CTAs an SM holds, by threads (2048) and shared memory (228 KB, 1 KB of it a CTA's) alone: the stub
   does not know a kernel's registers. */
CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int *n, void *f, int threads, size_t smem) {
    int by_threads = 2048 / threads, by_smem = (int)(233472 / (smem + 1024));
    *n = by_threads < by_smem ? by_threads : by_smem;
    return 0;
}
/* A tensor map: 128 bytes naming what it was built from (the address and the first two dims), so that a
   test can tell maps apart; never read by a kernel here. */
CUresult cuTensorMapEncodeTiled(void *map, int dtype, unsigned rank, void *addr, const uint64_t *dims,
                                const uint64_t *strides, const unsigned *box, const unsigned *elem_strides,
                                int interleave, int swizzle, int l2, int oob) {
    uint64_t words[16] = {(uint64_t)(uintptr_t)addr, dims[0], rank > 1 ? dims[1] : 0, (uint64_t)dtype};
    memcpy(map, words, 128);
    return 0;
}
/* for tests */
void stub_set_current(void *c) { current = c; }
long stub_count(int what) { return what == 0 ? launches : what == 1 ? pushes : what == 2 ? pops : ctx_queries; }
const unsigned char *stub_last_params(void) { return last_params; }
void stub_last_launch(unsigned *out) { out[0] = last_grid[0]; out[1] = last_grid[1]; out[2] = last_grid[2];
                                       out[3] = last_block; out[4] = last_smem; out[5] = (unsigned)(uintptr_t)last_stream;
                                       out[6] = (unsigned)last_pdl; out[7] = (unsigned)last_cluster; }
"""

_lib = None


def available() -> bool:
    return shutil.which("gcc") is not None


# What the tools and tests here run: head_dim 64, (dtype, mask, return_lse).
PREBUILD = (("bf16", "none", False), ("bf16", "causal", False), ("bf16", "none", True),
            ("fp16", "sliding_window", True))


def prebuild(variants=PREBUILD, head_dim: int = 64, arch: str = "sm_90a", extra=()) -> None:
    """Compile (into the cache root in use) the default kernels the stub's device will be asked for.

    ``extra``: more specs, as (class name in ``attngen``, keyword arguments). The builds run in a
    child process: on a machine with a GPU a compile (CuPy) loads the real libcuda, and once that is
    in this process the stub cannot stand in for it. Misses after ``install`` compile in a child too.
    """
    specs = [("PrefillSpec", dict(head_dim=head_dim, dtype=dt, mask=mask, return_lse=lse))
             for dt, mask, lse in variants]
    specs += [(name, dict(kw)) for name, kw in extra]
    code = ("import json, sys\nimport attngen\n"
            "for name, kw in json.loads(sys.argv[1]):\n    attngen.build(getattr(attngen, name)(**kw), sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", code, json.dumps(specs), arch], check=True, env=_child_env())


def _child_env() -> dict:
    """This process's environment, with the checkout first on PYTHONPATH: a child imports the same attngen."""
    root = str(Path(__file__).resolve().parent.parent)
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))


def install() -> ctypes.CDLL:
    """Build (once per source version, in the temp dir) and load the stub; returns it."""
    global _lib
    if _lib is not None:
        return _lib
    tag = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]
    d = Path(tempfile.gettempdir()) / f"attngen-fake-cuda-{os.getuid()}"
    d.mkdir(exist_ok=True)
    so = d / f"libcuda-{tag}.so"
    if not so.exists():
        src = d / f"fake_cuda-{tag}.c"
        src.write_text(_SOURCE)
        tmp = d / f"libcuda-{tag}.{os.getpid()}.so"
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(src)],
                       check=True, capture_output=True)
        os.replace(tmp, so)
    lib = ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
    if not hasattr(ctypes.CDLL("libcuda.so.1"), "stub_count"):  # found by soname: the first one loaded wins
        raise RuntimeError("a real libcuda.so.1 was loaded in this process before the stub, so the stub cannot "
                           "stand in for it: install the stub before anything that loads the driver (CuPy, torch)")
    _compile_out_of_process()
    lib.stub_set_current.argtypes = [ctypes.c_void_p]
    lib.stub_count.restype = ctypes.c_long
    lib.stub_last_params.restype = ctypes.POINTER(ctypes.c_ubyte * 1024)
    _lib = lib
    return lib


_COMPILE_CHILD = """
import pickle, sys
from attngen.compiler import compile
args, kw = pickle.load(sys.stdin.buffer)
sys.stdout.buffer.write(pickle.dumps(compile(*args, **kw)))
"""


def _compile_out_of_process() -> None:
    """Compile a cache miss in a child process: NVRTC, run beside the stub in this one, crashes
    where the real driver is installed too (a GPU machine)."""
    import pickle

    from attngen import builder

    def compile_in_child(*args, **kw):
        p = subprocess.run([sys.executable, "-c", _COMPILE_CHILD], input=pickle.dumps((args, kw)), env=_child_env(),
                           capture_output=True, check=False)
        if p.returncode != 0:
            raise RuntimeError(f"the compile child failed: {p.stderr.decode()[-2000:]}")
        return pickle.loads(p.stdout)

    builder.nvrtc_compile = compile_in_child


def last_params(n: int) -> bytes:
    return bytes(_lib.stub_last_params().contents[:n])


def last_launch() -> dict:
    out = (ctypes.c_uint * 8)()
    _lib.stub_last_launch(out)
    return {"grid": (out[0], out[1], out[2]), "threads": out[3], "smem": out[4], "stream": out[5], "pdl": out[6],
            "cluster": out[7]}


def counts() -> dict:
    return {name: _lib.stub_count(i) for i, name in enumerate(("launches", "pushes", "pops", "ctx_queries"))}


def refused(fn, *texts, error: str = "AttngenError") -> None:
    """``fn()`` raises attngen's ``error`` (a class name) whose message holds every one of ``texts``, and launched
    nothing before it (for scripts run under ``stub_session``)."""
    import attngen

    n0 = counts()["launches"]
    try:
        fn()
    except getattr(attngen, error) as e:
        for text in texts:
            assert text in str(e), (text, str(e))
    else:
        raise AssertionError(f"no {error} for {texts}")
    assert counts()["launches"] == n0, "a refused call launched"


def make_current(ctx: int | None) -> None:
    _lib.stub_set_current(ctx)


def patch_torch_cuda(propagate: bool = False):
    """Make CPU torch tensors pass for CUDA tensors of device 0 (a torch without CUDA is fine).

    Returns ``cuda_tensor(t)``, which wraps a CPU tensor. ``torch.empty(..., device=cuda...)``
    returns wrapped CPU tensors; the current stream is 0. The wrapper is a Tensor subclass with
    torch-function dispatch off, so attribute access costs what it costs on a plain tensor
    (``as_subclass`` in ``torch.empty`` adds ~0.3 us that a real CUDA allocation does not pay,
    and a real ``torch.empty`` on CUDA and stream queries cost more than these stand-ins).
    ``propagate``: dispatch on, so that what torch computes from a wrapped tensor is wrapped too
    (host code that does arithmetic on device tensors, as the KV-cache call's append does).
    """
    import types

    import torch

    cuda0 = torch.device("cuda", 0)

    def wrapping(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            r = func(*args, **(kwargs or {}))
        if isinstance(r, torch.Tensor) and type(r) is torch.Tensor:
            return r.as_subclass(cls)
        return r

    class CudaLike(torch.Tensor):
        __torch_function__ = classmethod(wrapping) if propagate else torch._C._disabled_torch_function_impl
        is_cuda = True

        def get_device(self):
            return 0

        def __getitem__(self, index):  # a view of a device tensor is one too (FlashAttention's packed qkv)
            return torch.Tensor.__getitem__(self, index).as_subclass(CudaLike)

        @property
        def device(self):
            return cuda0

    CudaLike.__module__ = "torch"  # what attngen's kind dispatch looks at

    def on_device(make):
        """``make`` (a torch factory) with ``device=`` honoured by a CPU tensor dressed as a device one."""
        def made(*args, device=None, **kw):
            t = make(*args, **kw)
            return t.as_subclass(CudaLike) if device is not None else t
        return made

    stream = types.SimpleNamespace(cuda_stream=0)
    torch.empty = on_device(torch.empty)
    torch.full = on_device(torch.full)  # the KV-cache call's append builds its positions with these
    torch.arange = on_device(torch.arange)
    torch.cuda.current_stream = lambda device=None: stream
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    return lambda t: t.as_subclass(CudaLike)


def stub_session(prefix: str, propagate: bool = False):
    """What a host-path check on the stub starts with: a fresh cache (``prefix`` names its temporary folder), no
    tuned store, the stub driver loaded and torch.cuda patched (``patch_torch_cuda``). Returns ``(wrap, rand,
    i32)``: the wrapper, a bf16 normal tensor of a shape, and an int32 tensor of values, both wrapped."""
    os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix=prefix)
    os.environ["ATTNGEN_NO_TUNED"] = "1"
    install()
    wrap = patch_torch_cuda(propagate=propagate)

    import torch

    def rand(*shape):
        return wrap(torch.randn(*shape).to(torch.bfloat16))

    def i32(values):
        return wrap(torch.tensor(values, dtype=torch.int32))

    return wrap, rand, i32


def run_check(script: str, tmp_path, timeout: float = 600, keep_tuned: bool = False) -> None:
    """Run ``tests/<script>`` (a stub-driver check: it installs the stub, so it needs a process of its own) with
    the checkout on PYTHONPATH and temporary files under ``tmp_path``; assert it exits 0 and prints "ok" last.
    ``keep_tuned``: the child does not inherit ATTNGEN_NO_TUNED (a check of the tuned store's use)."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), TMPDIR=str(tmp_path))
    if keep_tuned:
        env.pop("ATTNGEN_NO_TUNED", None)
    p = subprocess.run([sys.executable, str(root / "tests" / script)], cwd=root, env=env, capture_output=True,
                       text=True, timeout=timeout)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-3000:]
