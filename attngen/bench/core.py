"""The harness every ``attngen bench`` subcommand shares: timing, the environment record, JSON,
number formatting, the shared argument parsers, the SDPA peers, the figure footer and the
``--from-json`` / GPU check start. Nothing here knows a kernel family.

Family benchmarks call the timers, ``environment`` and ``DEVICE`` through this module
(``core.bench_ms(...)``), not through copies of the names, so that one swap here (a test on the
CPU, a host-clock timer) reaches every benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

DTYPES = ("bf16", "fp16")
BACKENDS = ("flash", "cudnn", "efficient")   # SDPA's backends, the peers every benchmark compares with
DEVICE = "cuda"         # where the benchmarks' inputs live (a test may point this elsewhere)
COPY_MIB = 1024         # the copy-bandwidth buffer: 1 GiB read + 1 GiB written
CHECK_TOL = 1e-2        # relative L2 of attngen vs its reference; bf16/fp16 land ~1e-3..5e-3


# --- argument parsing ----------------------------------------------------------------------------

def _int_list(text: str) -> tuple[int, ...]:
    vals = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = 1
        if p.endswith("k"):
            p, mult = p[:-1], 1024
        try:
            v = int(p) * mult
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not an integer (e.g. 512,2k,16384)") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{part!r} must be positive")
        vals.append(v)
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return tuple(dict.fromkeys(vals))


def _head_dims(text: str) -> tuple[int, int]:
    """``D`` or ``D/DV``: the head dims of q/k and of v."""
    parts = text.split("/")
    try:
        if len(parts) > 2:
            raise ValueError
        return int(parts[0]), int(parts[-1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected D or D/DV, e.g. 192/128") from None


def _head_dim_list(text: str) -> tuple[tuple[int, int], ...]:
    """``64,128,192/128`` -> ((64, 64), (128, 128), (192, 128)): ``_head_dims`` of each, all >= 1."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        d, dv = _head_dims(part)
        if min(d, dv) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: head dims must be >= 1")
        out.append((d, dv))
    return tuple(out)


def _choice_list(allowed: tuple[str, ...], aliases: dict[str, str] | None = None):
    aliases = aliases or {}

    def parse(text: str) -> tuple[str, ...]:
        vals = []
        for part in text.split(","):
            p = part.strip().lower()
            if not p:
                continue
            p = aliases.get(p, p)
            if p not in allowed:
                raise argparse.ArgumentTypeError(f"{part!r} is not one of {', '.join(allowed)}")
            vals.append(p)
        if not vals:
            raise argparse.ArgumentTypeError("empty list")
        return tuple(dict.fromkeys(vals))

    return parse


_dtype_list = _choice_list(DTYPES, {"bfloat16": "bf16", "float16": "fp16", "half": "fp16"})
_backend_list = _choice_list(BACKENDS, {"fa2": "flash", "flash_attention": "flash", "cudnn_attention": "cudnn",
                                        "mem_efficient": "efficient", "memory_efficient": "efficient"})
_CAUSAL = {"both": (False, True), "yes": (True,), "no": (False,), "true": (True,), "false": (False,)}


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


# --- work and rates ------------------------------------------------------------------------------

def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
                    head_dim_v: int = 0) -> float:
    """Forward FLOPs: two GEMMs per head, 2*Sq*Sk*D for Q K^T and 2*Sq*Sk*DV for P V (DV: head_dim_v,
    0 for head_dim); causal does half."""
    f = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + (head_dim_v or head_dim))
    return f / 2 if causal else f


def tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float | None) -> float | None:
    if ms is None or not ms > 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


# --- small helpers --------------------------------------------------------------------------------

def _say(*a, **kw) -> None:
    print(*a, **kw, flush=True)


def _finite(x: Any) -> Any:
    """JSON-safe: NaN/inf floats become strings, recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: Path, data: dict) -> None:
    """Atomic: a reader (or a run killed mid-write) sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(_finite(data), indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def _fmt(x: float | None, spec: str = ".1f", none: str = "—") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return none
    return format(x, spec)


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


# --- the environment record -------------------------------------------------------------------------

def have_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
        return str(getattr(m, "__version__", "?"))
    except Exception:
        return None


def source_digest() -> str:
    """12 hex digits of SHA-256 over the package's Python and templates: names the code that ran
    even where the checkout's git metadata is missing or stale (a copied tree)."""
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parents[1]
    roots = [pkg, pkg.parent / "templates" if (pkg.parent / "templates").is_dir() else pkg / "templates"]
    for root in roots:
        for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cuh", ".jinja", ".toml")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def environment(gpu: bool | None = None) -> dict:
    """Where the numbers came from: GPU, driver, library versions, date."""
    from .. import __version__

    env: dict[str, Any] = {
        "date": _now(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "attngen": __version__,
        "torch": _version("torch"),
        "cupy": _version("cupy"),
        "triton": _version("triton"),
        "numpy": _version("numpy"),
    }
    try:
        from ..compiler import nvrtc_version

        env["nvrtc"] = nvrtc_version()
    except Exception as e:
        env["nvrtc"] = f"unavailable ({e})"
    try:
        root = Path(__file__).resolve().parents[2]   # the checkout that holds attngen/bench/core.py
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=5)
        if r.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "attngen", "templates"],
                                   capture_output=True, text=True, timeout=5).stdout.strip()
            env["attngen_commit"] = r.stdout.strip() + ("+changes" if dirty else "")
    except Exception:
        pass
    env["attngen_source"] = source_digest()
    if gpu is None:
        gpu = have_gpu()
    env["gpu_present"] = bool(gpu)
    if not gpu:
        return env
    try:
        import torch

        if torch.cuda.is_available():
            dev = torch.cuda.current_device()
            prop = torch.cuda.get_device_properties(dev)
            env["gpu"] = prop.name
            env["compute_capability"] = f"{prop.major}.{prop.minor}"
            env["sm_count"] = prop.multi_processor_count
            env["gpu_memory_gib"] = round(prop.total_memory / 2**30, 1)
            env["torch_cuda"] = torch.version.cuda
            try:
                env["cudnn"] = torch.backends.cudnn.version()
            except Exception:
                pass
    except Exception:
        pass
    try:
        import cupy

        env["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
        env["cuda_runtime_cupy"] = cupy.cuda.runtime.runtimeGetVersion()
        if "gpu" not in env:
            p = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
            env["gpu"] = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
    except Exception:
        pass
    try:
        from ..runtime import device_arch

        import cupy

        env["attngen_arch"] = device_arch(cupy.cuda.runtime.getDevice()).name
    except Exception:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        fields = "name,driver_version,clocks.max.sm,clocks.sm,power.limit,temperature.gpu,persistence_mode"
        try:
            r = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=15)
            if r.returncode == 0 and r.stdout.strip():
                vals = [v.strip() for v in r.stdout.strip().splitlines()[0].split(",")]
                env["nvidia_smi"] = dict(zip(fields.split(","), vals))
                env["driver"] = env["nvidia_smi"].get("driver_version")
        except Exception:
            pass
    return env


def env_lines(env: dict) -> list[str]:
    """A short human header for tables and Markdown."""
    gpu = env.get("gpu") or ("no GPU" if not env.get("gpu_present") else "GPU ?")
    cc = f" (cc {env['compute_capability']}, {env.get('sm_count', '?')} SMs)" if env.get("compute_capability") else ""
    drv = env.get("driver") or env.get("cuda_driver_api")
    lines = [
        f"GPU: {gpu}{cc}" + (f", driver {drv}" if drv else "")
        + (f", attngen arch {env['attngen_arch']}" if env.get("attngen_arch") else ""),
        "versions: " + ", ".join(f"{k} {env[k]}" for k in ("attngen", "torch", "torch_cuda", "cudnn", "cupy",
                                                              "triton", "nvrtc", "python") if env.get(k) is not None)
        + (f", attngen commit {env['attngen_commit']}" if env.get("attngen_commit") else "")
        + (f", source {env['attngen_source']}" if env.get("attngen_source") else ""),
        f"date: {env.get('date', '?')}",
    ]
    return lines


# --- timing ---------------------------------------------------------------------------------------

def _triton_do_bench():
    try:
        from triton.testing import do_bench

        return do_bench
    except Exception:
        return None


def bench_ms(fn: Callable[[], Any], warmup_ms: float = 25.0, rep_ms: float = 100.0,
             reps: int | None = None) -> tuple[float, str]:
    """Median milliseconds of ``fn`` on the GPU, with CUDA events; returns (ms, method)."""
    if reps is None:
        do_bench = _triton_do_bench()
        if do_bench is not None:
            try:
                return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")), "triton.do_bench"
            except TypeError:
                pass
    return _event_bench(fn, warmup_ms, rep_ms, reps), "cuda-events"


ROUNDS = 3


def interleaved(fns: dict, rep_ms: float, timer=None) -> dict:
    """Each of ``fns`` timed in ROUNDS rounds whose order rotates, so that a clock's drift over the run falls on
    each alike; the median of each's. ``timer(fn, rep_ms)`` -> ms times one (default: ``bench_ms``)."""
    timer = timer or (lambda fn, ms: bench_ms(fn, rep_ms=ms)[0])
    names = list(fns)
    times: dict = {k: [] for k in names}
    for r in range(ROUNDS):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(timer(fns[k], rep_ms))
    return {k: statistics.median(v) for k, v in times.items()}


def release_gpu_memory() -> None:
    """After a shape that failed (out of memory, say): wait for the GPU and hand torch's cached
    blocks back, so the sweep's next shape starts clean; errors here are ignored."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:
        pass


def host_time_us(fn: Callable[[], Any], calls: int, batches: int) -> float:
    """Host time of one call of ``fn`` in µs: ``calls`` back-to-back calls per batch on the host
    clock, the GPU drained before and after each batch, median over ``batches`` (after 50
    warm-up calls). Meaningful where a call's GPU work is shorter than its host path."""
    import time

    import torch

    for _ in range(50):
        fn()
    per = []
    for _ in range(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def measure_copy_bandwidth(mib: int = COPY_MIB, warmup_ms: float = 25.0, rep_ms: float = 100.0,
                           reps: int | None = None) -> dict:
    """Device-to-device copy of a ``mib`` MiB buffer: (bytes read + bytes written) / median time."""
    import torch

    nbytes = int(mib) << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEVICE)   # never time on zeros
    dst = torch.empty_like(src)
    ms, timer = bench_ms(lambda: dst.copy_(src), warmup_ms, rep_ms, reps)
    return {"buffer_bytes": nbytes, "bytes_moved": 2 * nbytes, "ms": ms, "gbps": gbps(2 * nbytes, ms),
            "timer": timer}


_READ_SRC = r"""
extern "C" __global__ void stream_read(const uint4* a, long long na, const uint4* b, long long nb,
                                       unsigned* sink) {
  unsigned x = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < na + nb; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const long long j = i + u * stride;
      v[u] = j < na ? __ldcs(a + j) : (j < na + nb ? __ldcs(b + j - na) : make_uint4(0, 0, 0, 0));
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (x == 0x9e3779b9u) sink[0] = x;  // keeps the loads; practically never true
}
"""


def stream_reader() -> Callable[..., None]:
    """``read(a, b)``: one kernel on torch's current stream that loads every byte of two contiguous
    tensors once, with 16-byte loads over the whole GPU (4 CTAs x 512 threads per SM): about the
    best any one-launch memory-bound kernel could do on those bytes (the "bare read")."""
    import cupy as cp
    import torch

    kern = cp.RawKernel(_READ_SRC, "stream_read")
    sink = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    sms = torch.cuda.get_device_properties(sink.device).multi_processor_count

    def read(a, b) -> None:
        assert a.is_contiguous() and b.is_contiguous()
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kern((sms * 4,), (512,), (a.data_ptr(), a.numel() * a.element_size() // 16, b.data_ptr(),
                                      b.numel() * b.element_size() // 16, sink.data_ptr()))
    return read


_flush_buf = None


def _event_bench(fn, warmup_ms: float, rep_ms: float, reps: int | None, flush: bool = True) -> float:
    """do_bench's method without triton: L2 flushed before each timed call, one event pair each, median.

    ``flush=False`` is for callers that keep their inputs out of L2 themselves (decode's --rotate): the
    flush's zeroing leaves dirty lines whose write-back the timed call would pay."""
    import torch

    global _flush_buf
    if flush and _flush_buf is None:
        _flush_buf = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        if flush:
            _flush_buf.zero_()
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    n_warm = max(1, int(warmup_ms / est))
    n_rep = reps if reps is not None else max(1, int(rep_ms / est))
    for _ in range(n_warm):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    for i in range(n_rep):
        if flush:
            _flush_buf.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _graphed(*fns: Callable[[], Any]) -> Callable[[], Any]:
    """``fns`` captured once, in order, into one CUDA graph (after two warm-up calls of each on a side
    stream, which also compile and load what they need); returns the graph's replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    return g.replay


# --- checking ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _no_tf32():
    """fp32 matmuls without TF32 for the block, so that an fp32 reference stays fp32."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def ratio_summary(pairs: list, where) -> dict | None:
    """What ``attngen bench report`` reads of a peer column: over (ratio, record) pairs, the minimum, the geometric
    mean, the count and ``where(record)`` of the minimum's record; None where there is no pair."""
    if not pairs:
        return None
    worst, wr = min(pairs, key=lambda p: p[0])
    return {"min": worst, "geomean": math.exp(sum(math.log(x) for x, _ in pairs) / len(pairs)), "shapes": len(pairs),
            "min_at": where(wr)}


def _rel_check(out, ref) -> dict:
    """NaN count, max abs and rel L2 of ``out`` (any layout matching ``ref``) against ``ref`` fp32."""
    import torch

    nan_count = int(torch.isnan(out).sum().item())
    diff = out.float() - ref
    rel = float((torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item())
    mx = float(diff.abs().max().item()) if diff.numel() else 0.0
    ok = bool(nan_count == 0 and math.isfinite(rel) and rel <= CHECK_TOL)
    return {"reference": "fp32", "nan_count": nan_count, "max_abs": mx, "rel_l2": rel, "ok": ok,
            "tolerance_rel_l2": CHECK_TOL}


# --- reporting and the command's start ----------------------------------------------------------

def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (saying why) when matplotlib is not there."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        _say(f"plot skipped: matplotlib is not available ({e})")
        return None
    return plt


def _save_figure(plt, fig, axes, data: dict, family: str, path: Path, *, bottom: float, dpi: int,
                 ncol: int = 8) -> Path:
    """One legend for every panel's lines (each label once), the title with GPU and date, and the file."""
    handles, labels = [], []
    for row in axes:
        for ax in row:
            for hnd, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(hnd)
                    labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), ncol), fontsize=8, frameon=False)
    env = data.get("env", {})
    fig.suptitle(f"attngen {family} vs SDPA — {env.get('gpu', '?')}, {env.get('date', '')[:10]}", fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _replay_or_gpu_check(family: str, args: argparse.Namespace, finish: Callable[..., None]) -> int | None:
    """``attngen bench FAMILY``'s start: with --from-json, re-render the saved results (exit 0);
    without torch or a CUDA GPU, say why on stderr (exit 2); None when the run can go on."""
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        finish(data, args, print_table=True)
        return 0
    try:
        import torch
    except Exception as e:
        _say(f"attngen: error: attngen bench {family} needs torch ({e}); install it into this environment: "
             "python3 -m pip install torch", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        _say(f"attngen: error: attngen bench {family} needs a CUDA GPU (torch.cuda.is_available() is False); "
             "run it on a GPU machine, or pass --from-json FILE to re-render saved results", file=sys.stderr)
        return 2
    return None
