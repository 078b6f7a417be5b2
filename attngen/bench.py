"""Benchmarks: ``attngen bench prefill`` and ``decode`` (attngen vs PyTorch SDPA backends), ``attngen bench jit``.

``prefill`` runs attngen and ``torch.nn.functional.scaled_dot_product_attention`` with each
selected backend (flash = FlashAttention-2, cudnn, efficient) on the same inputs in one
process, over FlashAttention's standard sweep: batch x seqlen = 16384 tokens, heads = 2048 /
head_dim, head_dim 64/128/256, causal and not, bf16 and fp16. Every shape is checked first
(attngen vs the flash backend, output poisoned with NaN), then timed with CUDA events (warm-up
first, median of many repeats). Rows stream to stdout; the JSON is rewritten after every
shape, so a run cut short still leaves its results.

``decode`` runs attngen.decode and SDPA (flash, cudnn; efficient on request) on one dense KV
cache per shape (heads 32/8, 32/4, 64/8 at head_dim 128; batch 1..128; kv_len 1k..32k; q_len 1;
plus batch 4, q_len 4, 16/1 heads, 16k). A decode is bound by reading K and V, so it reports
GB/s of K+V read and the fraction of a device-to-device copy's bandwidth measured in the same
run, with the time ratios to each peer and the targets' verdicts. Each shape is spot-checked
against an fp32 reference with the output poisoned with NaN; shapes that do not fit in memory
are skipped and listed.

``jit`` measures the latency of the JIT pipeline: a cold NVRTC compile (works without a GPU
given ``--arch``), a warm load from the disk cache in a fresh process, a repeated in-process
request, and the host-side overhead of one ``attngen.prefill`` call.

All write Markdown (``--markdown FILE``) for BENCHMARKS.md, and re-render from a saved JSON
with ``--from-json FILE`` (no GPU needed for that).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import functools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

# --- the sweep ------------------------------------------------------------------------------------

TOKENS = 16384          # batch * seqlen
HIDDEN = 2048           # heads * head_dim
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "fp16")
BACKENDS = ("flash", "cudnn", "efficient")
QUICK = dict(seqlens=(1024, 4096), head_dims=(64, 128), dtypes=("bf16",))
DEVICE = "cuda"         # where prefill's inputs live (a test may point this elsewhere)
CHECK_TOL = 1e-2        # relative L2 of attngen vs the flash backend; bf16/fp16 land ~1e-3..5e-3
SDPA_NOTE = ("SDPA is given [B, H, S, D] views made by .transpose(1, 2) of the [B, S, H, D] tensors attngen "
             "takes, which is how FlashAttention-layout users call it.")
SDPA_CONTIG_NOTE = ("SDPA is given contiguous [B, H, S, D] copies of the inputs (--sdpa-layout contiguous); "
                    "attngen gets [B, S, H, D].")
FLOP_NOTE = "FLOPs = 4*B*H*Sq*Sk*D, halved for causal (FlashAttention's convention)."

# --- jit targets -------------------------------------------------------------------------------
TARGET_COLD_S = 2.0
TARGET_WARM_S = 0.020
TARGET_REPEAT_US = 10.0
TARGET_OVERHEAD_US = 15.0


@dataclass(frozen=True)
class Shape:
    dtype: str
    head_dim: int
    causal: bool
    batch: int
    seqlen: int
    heads: int

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal)

    def label(self) -> str:
        return (f"{self.dtype} d={self.head_dim} {'causal' if self.causal else 'full'} "
                f"b={self.batch} s={self.seqlen} h={self.heads}")


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs: two GEMMs of 2*Sq*Sk*D each per head; causal does half."""
    f = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return f / 2 if causal else f


def tflops(flops: float, ms: float | None) -> float | None:
    if ms is None or not ms > 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def make_sweep(head_dims: Iterable[int] = HEAD_DIMS, seqlens: Iterable[int] = SEQLENS,
               dtypes: Iterable[str] = DTYPES, causal: Iterable[bool] = (False, True),
               tokens: int = TOKENS, hidden: int = HIDDEN) -> list[Shape]:
    """The shapes, in the order they run: dtype, mask, head_dim, seqlen."""
    out = []
    for dt in dtypes:
        for c in causal:
            for d in head_dims:
                for s in seqlens:
                    out.append(Shape(dt, d, c, max(1, tokens // s), s, max(1, hidden // d)))
    return out


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attngen bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", metavar="{prefill,decode,jit}")

    pp = sub.add_parser("prefill", help="attngen.prefill vs SDPA's flash / cudnn / efficient backends",
                        description="attngen.prefill vs torch SDPA backends on FlashAttention's standard sweep "
                                    f"(batch*seqlen={TOKENS}, heads={HIDDEN}/head_dim). {SDPA_NOTE} {FLOP_NOTE}")
    pp.add_argument("--head-dims", type=_int_list, default=None, help="e.g. 64,128 (default 64,128,256)")
    pp.add_argument("--seqlens", type=_int_list, default=None, help="e.g. 512,2k (default 512..16k)")
    pp.add_argument("--dtypes", type=_dtype_list, default=None, help="bf16,fp16 (default both)")
    pp.add_argument("--causal", choices=sorted(_CAUSAL), default="both", help="masks to run (default both)")
    pp.add_argument("--backends", type=_backend_list, default=BACKENDS,
                    help="SDPA backends to compare with (default flash,cudnn,efficient)")
    pp.add_argument("--quick", action="store_true",
                    help="a small subset: seqlens 1k,4k, head_dims 64,128, bf16 (explicit options still win)")
    pp.add_argument("--tokens", type=int, default=TOKENS, help=argparse.SUPPRESS)
    pp.add_argument("--hidden", type=int, default=HIDDEN, help=argparse.SUPPRESS)
    pp.add_argument("--out", type=Path, default=None, help="folder for bench_prefill.json and bench_prefill.png")
    pp.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown to FILE")
    pp.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up per measurement (ms, default 25)")
    pp.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms, default 100)")
    pp.add_argument("--reps", type=int, default=None,
                    help="a fixed number of timed repeats instead of --rep-ms (own CUDA-event loop)")
    pp.add_argument("--sdpa-layout", choices=("view", "contiguous"), default="view",
                    help="view (default): SDPA gets .transpose(1, 2) views of attngen's [B, S, H, D] inputs; "
                         "contiguous: SDPA gets its own contiguous [B, H, S, D] copies (its preferred layout)")
    pp.add_argument("--no-check", action="store_true", help="skip the correctness check")
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--from-json", type=Path, default=None,
                    help="re-render table/Markdown/plot from a saved bench_prefill.json (no GPU)")
    pp.set_defaults(func=cmd_prefill)

    add_decode_parser(sub)

    pj = sub.add_parser("jit", help="JIT latency: cold compile, warm load, repeated request, host overhead",
                        description="Latency of the JIT pipeline against its targets. Cold compile works without "
                                    "a GPU when --arch is given.")
    pj.add_argument("--arch", default=None, help="target arch (default: the current GPU's), e.g. sm_90")
    pj.add_argument("--spec", action="append", default=None, metavar="TEXT",
                    help="a spec to measure, e.g. prefill:head_dim=64,dtype=bf16,mask=none (repeatable; "
                         "default head_dim 64/128/256 x causal and not, bf16)")
    pj.add_argument("--head-dims", type=_int_list, default=None, help="for the default specs (default 64,128,256)")
    pj.add_argument("--causal", choices=sorted(_CAUSAL), default="both", help="for the default specs")
    pj.add_argument("--measure", default="cold,warm,repeat,overhead",
                    help="which of cold,warm,repeat,overhead to run (default all)")
    pj.add_argument("--cold-reps", type=int, default=1, help="cold builds per spec, median (default 1)")
    pj.add_argument("--repeat-calls", type=int, default=10000, help="in-process requests (default 10000)")
    pj.add_argument("--overhead-calls", type=int, default=500, help="prefill calls per batch (default 500)")
    pj.add_argument("--overhead-batches", type=int, default=20, help="batches, median (default 20)")
    pj.add_argument("--out", type=Path, default=None, help="folder for bench_jit.json")
    pj.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown to FILE")
    pj.add_argument("--from-json", type=Path, default=None, help="re-render from a saved bench_jit.json")
    pj.set_defaults(func=cmd_jit)
    return p


def sweep_from_args(args: argparse.Namespace) -> list[Shape]:
    q = QUICK if args.quick else {}
    return make_sweep(
        head_dims=args.head_dims or q.get("head_dims", HEAD_DIMS),
        seqlens=args.seqlens or q.get("seqlens", SEQLENS),
        dtypes=args.dtypes or q.get("dtypes", DTYPES),
        causal=_CAUSAL[args.causal],
        tokens=args.tokens, hidden=args.hidden,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


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


def environment(gpu: bool | None = None) -> dict:
    """Where the numbers came from: GPU, driver, library versions, date."""
    from . import __version__

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
        from .compiler import nvrtc_version

        env["nvrtc"] = nvrtc_version()
    except Exception as e:
        env["nvrtc"] = f"unavailable ({e})"
    try:
        root = Path(__file__).resolve().parent.parent
        r = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=5)
        if r.returncode == 0:
            env["attngen_commit"] = r.stdout.strip()
    except Exception:
        pass
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
        from .runtime import device_arch

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
        + (f", attngen commit {env['attngen_commit']}" if env.get("attngen_commit") else ""),
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


# --- prefill --------------------------------------------------------------------------------------

def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]


def _short_error(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


def run_shape(shape: Shape, backends: tuple[str, ...], *, check: bool = True, warmup_ms: float = 25.0,
              rep_ms: float = 100.0, reps: int | None = None, seed: int = 0, sdpa_layout: str = "view") -> dict:
    """Check and time one shape: attngen and each SDPA backend on the same inputs."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    import attngen
    from . import DType, MaskMode, PrefillSpec

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    b, s, h, d, causal = shape.batch, shape.seqlen, shape.heads, shape.head_dim, shape.causal
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device=DEVICE, dtype=tdt, generator=gen) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views: FA-layout users' call
    if sdpa_layout == "contiguous":
        qt, kt, vt = (x.contiguous() for x in (qt, kt, vt))

    rec: dict[str, Any] = {**asdict(shape), "flops": shape.flops, "ms": {}, "tflops": {}, "errors": {},
                           "timer": None}

    def attngen_fn():
        return attngen.prefill(q, k, v, causal=causal)

    def sdpa_fn():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    # Peers: one call each decides supported or not (and warms up cuDNN plans / handles).
    peer_out: dict[str, Any] = {}
    for name in backends:
        try:
            with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend(name)):
                warnings.simplefilter("ignore")
                o = sdpa_fn()
            torch.cuda.synchronize()
            peer_out[name] = o
        except Exception as e:  # unsupported for this shape / dtype / layout: recorded as null
            rec["errors"][name] = _short_error(e)
            rec["ms"][name] = rec["tflops"][name] = None
            torch.cuda.synchronize()

    # Correctness: attngen into a NaN-poisoned out, vs the flash backend (else the first peer that ran).
    try:
        out = torch.full_like(q, float("nan"))
        attngen.prefill(q, k, v, causal=causal, out=out)
        torch.cuda.synchronize()
        kern = attngen.get_kernel(PrefillSpec(head_dim=d, dtype=DType(shape.dtype),
                                              mask=MaskMode.CAUSAL if causal else MaskMode.NONE),
                                  device=q.device.index)
        rec["kernel"] = {"spec": kern.spec.to_text(), "origin_first": kern.origin,
                         "resources": kern.binary.resources.to_dict(), "smem_dynamic": kern.smem_bytes,
                         "threads": kern.threads}
    except Exception as e:
        rec["errors"]["attngen"] = _short_error(e)
        rec["ms"]["attngen"] = rec["tflops"]["attngen"] = None
        out = None
    if check and out is not None:
        if "flash" not in peer_out and "flash" not in backends:
            # The reference is the flash backend even when it is not among the timed peers.
            try:
                with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend("flash")):
                    warnings.simplefilter("ignore")
                    peer_out["flash"] = sdpa_fn()
            except Exception:
                pass
        ref_name = next((n for n in ("flash", "cudnn", "efficient") if n in peer_out), None)
        chk: dict[str, Any] = {"reference": ref_name}
        nan_count = int(torch.isnan(out).sum().item())
        chk["nan_count"] = nan_count
        if ref_name is not None:
            ref = peer_out[ref_name].transpose(1, 2).float()
            diff = out.float() - ref
            chk["max_abs"] = float(diff.abs().max().item())
            chk["rel_l2"] = float((diff.norm() / ref.norm()).item())
            del ref, diff
            chk["ok"] = bool(nan_count == 0 and math.isfinite(chk["rel_l2"]) and chk["rel_l2"] <= CHECK_TOL)
        else:
            chk["ok"] = nan_count == 0
        chk["tolerance_rel_l2"] = CHECK_TOL
        rec["check"] = chk
    del out
    peer_out.clear()

    # Timing.
    if rec["errors"].get("attngen") is None:
        try:
            ms, rec["timer"] = bench_ms(attngen_fn, warmup_ms, rep_ms, reps)
            rec["ms"]["attngen"], rec["tflops"]["attngen"] = ms, tflops(shape.flops, ms)
        except Exception as e:
            rec["errors"]["attngen"] = _short_error(e)
            rec["ms"]["attngen"] = rec["tflops"]["attngen"] = None
    for name in backends:
        if name in rec["errors"]:
            continue
        try:
            with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend(name)):
                warnings.simplefilter("ignore")
                ms, timer = bench_ms(sdpa_fn, warmup_ms, rep_ms, reps)
            rec["ms"][name], rec["tflops"][name] = ms, tflops(shape.flops, ms)
            rec["timer"] = rec["timer"] or timer
        except Exception as e:
            rec["errors"][name] = _short_error(e)
            rec["ms"][name] = rec["tflops"][name] = None
    a = rec["tflops"].get("attngen")
    rec["ratio"] = {n: (a / rec["tflops"][n] if a and rec["tflops"].get(n) else None) for n in backends}
    return rec


# --- prefill reporting ----------------------------------------------------------------------------

def _impls(records: list[dict], backends: Iterable[str] | None = None) -> list[str]:
    if backends is None:
        seen: list[str] = []
        for r in records:
            for n in r.get("tflops", {}):
                if n != "attngen" and n not in seen:
                    seen.append(n)
        backends = [n for n in BACKENDS if n in seen] + [n for n in seen if n not in BACKENDS]
    return list(backends)


def _check_cell(r: dict) -> str:
    c = r.get("check")
    if not c:
        return "—"
    if c.get("nan_count"):
        return f"FAIL {c['nan_count']} NaN"
    rel = c.get("rel_l2")
    if rel is None:
        return "ok (no ref)" if c.get("ok") else "FAIL"
    return f"{rel:.1e}" + ("" if c.get("ok") else " FAIL")


def table_columns(backends: list[str]) -> list[str]:
    return (["dtype", "D", "causal", "B", "S", "H", "attngen"] + list(backends)
            + [f"/{n}" for n in backends] + ["check"])


def table_row(r: dict, backends: list[str]) -> list[str]:
    tf, ratio = r.get("tflops", {}), r.get("ratio", {})
    return ([r["dtype"], str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["batch"]), str(r["seqlen"]),
             str(r["heads"]), _fmt(tf.get("attngen"))]
            + [_fmt(tf.get(n)) for n in backends]
            + [_fmt(ratio.get(n), ".2f") for n in backends]
            + [_check_cell(r)])


_WIDTHS = {"dtype": 5, "D": 4, "causal": 6, "B": 3, "S": 6, "H": 3, "check": 12}


def _width(col: str) -> int:
    return _WIDTHS.get(col, max(9, len(col)))


def text_header(backends: list[str]) -> str:
    cols = table_columns(backends)
    return "  ".join(c.rjust(_width(c)) for c in cols)


def text_row(r: dict, backends: list[str]) -> str:
    cols = table_columns(backends)
    return "  ".join(v.rjust(_width(c)) for c, v in zip(cols, table_row(r, backends)))


def summarize(records: list[dict], backends: list[str]) -> dict:
    """Minimum and geometric-mean ratio attngen/peer across the sweep, with the worst shape."""
    out: dict[str, Any] = {}
    for n in backends:
        pairs = [(r["ratio"][n], r) for r in records if r.get("ratio", {}).get(n)]
        if not pairs:
            out[n] = None
            continue
        worst, wr = min(pairs, key=lambda p: p[0])
        gmean = math.exp(sum(math.log(p) for p, _ in pairs) / len(pairs))
        out[n] = {"min": worst, "geomean": gmean, "shapes": len(pairs),
                  "min_at": {k: wr[k] for k in ("dtype", "head_dim", "causal", "batch", "seqlen", "heads")}}
    checks = [r["check"] for r in records if r.get("check")]
    out["checks"] = {"run": len(checks), "failed": sum(1 for c in checks if not c.get("ok")),
                     "max_rel_l2": max((c["rel_l2"] for c in checks if isinstance(c.get("rel_l2"), float)),
                                       default=None)}
    return out


def summary_lines(summary: dict, backends: list[str]) -> list[str]:
    lines = []
    for n in backends:
        s = summary.get(n)
        if not s:
            lines.append(f"attngen/{n}: no shape where both ran")
            continue
        at = s["min_at"]
        lines.append(f"attngen/{n}: min {s['min']:.3f} at {at['dtype']} D={at['head_dim']} "
                     f"{'causal' if at['causal'] else 'full'} S={at['seqlen']}; geomean {s['geomean']:.3f} "
                     f"over {s['shapes']} shapes")
    c = summary.get("checks") or {}
    if c.get("run"):
        lines.append(f"checks: {c['run']} run, {c['failed']} failed, max rel L2 {_fmt(c.get('max_rel_l2'), '.1e')}")
    return lines


def prefill_markdown(data: dict) -> str:
    env, records = data.get("env", {}), data.get("results", [])
    backends = _impls(records, data.get("config", {}).get("backends"))
    cols = ["dtype", "D", "causal", "B", "S", "H", "attngen TFLOP/s"] + [f"{n} TFLOP/s" for n in backends] \
        + [f"attngen/{n}" for n in backends] + ["check (rel L2 vs flash)"]
    lines = ["## Prefill: attngen vs PyTorch SDPA", ""]
    lines += [f"- {ln}" for ln in env_lines(env)]
    cfg = data.get("config", {})
    lines += [f"- timing: median of CUDA-event timings ({cfg.get('timer') or 'triton.do_bench'}), warm-up "
              f"{cfg.get('warmup_ms', '?')} ms, repeats {cfg.get('reps') or str(cfg.get('rep_ms', '?')) + ' ms'}; "
              f"JIT compile and module load are outside the timings",
              f"- {FLOP_NOTE}",
              f"- {cfg.get('sdpa_note') or SDPA_NOTE}",
              "- — = the backend refused that shape.",
              ""]
    if not data.get("complete", True):
        lines += ["**Partial run**: the sweep did not finish.", ""]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" if i < 3 else "---:" for i in range(len(cols))) + "|")
    for r in records:
        lines.append("| " + " | ".join(table_row(r, backends)) + " |")
    summ = data.get("summary") or summarize(records, backends)
    lines += [""] + [f"- {ln}" for ln in summary_lines(summ, backends)]
    return "\n".join(lines) + "\n"


def plot_prefill(data: dict, path: Path) -> Path | None:
    """TFLOP/s vs seqlen: a panel per (mask, head_dim), a colour per implementation, a line style per dtype."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        _say(f"plot skipped: matplotlib is not available ({e})")
        return None
    records = data.get("results", [])
    if not records:
        return None
    backends = _impls(records, data.get("config", {}).get("backends"))
    impls = ["attngen"] + backends
    masks = sorted({r["causal"] for r in records})
    dims = sorted({r["head_dim"] for r in records})
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in records)]
    styles = {"bf16": "-", "fp16": "--"}
    colors = {"attngen": "tab:red", "flash": "tab:blue", "cudnn": "tab:green", "efficient": "tab:orange"}
    fig, axes = plt.subplots(len(masks), len(dims), figsize=(4.2 * len(dims), 3.4 * len(masks)), squeeze=False,
                             sharex=True)
    for i, c in enumerate(masks):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            for impl in impls:
                for dt in dtypes:
                    pts = sorted((r["seqlen"], r["tflops"].get(impl)) for r in records
                                 if r["causal"] == c and r["head_dim"] == d and r["dtype"] == dt)
                    pts = [(x, y) for x, y in pts if y]
                    if not pts:
                        continue
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(dt, ":"), marker="o", ms=3,
                            color=colors.get(impl), label=f"{impl} {dt}", linewidth=2.2 if impl == "attngen" else 1.4)
            ax.set_xscale("log", base=2)
            xs = sorted({r["seqlen"] for r in records})
            ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
            ax.minorticks_off()
            ax.set_title(f"head_dim {d}, {'causal' if c else 'no mask'}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if i == len(masks) - 1:
                ax.set_xlabel("seqlen (batch = 16384 / seqlen)")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
    return _save_figure(plt, fig, axes, data, "prefill", path, bottom=0.06, dpi=130)


def _save_figure(plt, fig, axes, data: dict, family: str, path: Path, *, bottom: float, dpi: int) -> Path:
    """One legend for every panel's lines (each label once), the title with GPU and date, and the file."""
    handles, labels = [], []
    for row in axes:
        for ax in row:
            for hnd, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(hnd)
                    labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
    env = data.get("env", {})
    fig.suptitle(f"attngen {family} vs SDPA — {env.get('gpu', '?')}, {env.get('date', '')[:10]}", fontsize=11)
    fig.tight_layout(rect=(0, bottom, 1, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _finish_prefill(data: dict, args: argparse.Namespace, print_table: bool) -> None:
    records = data.get("results", [])
    backends = _impls(records, data.get("config", {}).get("backends"))
    if print_table:
        for ln in env_lines(data.get("env", {})):
            _say(ln)
        _say(text_header(backends))
        for r in records:
            _say(text_row(r, backends))
    summ = data.get("summary") or summarize(records, backends)
    _say("")
    for ln in summary_lines(summ, backends):
        _say(ln)
    if "flash" in backends:
        s = summ.get("flash")
        _say(f"minimum ratio attngen/flash across the sweep: {_fmt(s['min'] if s else None, '.3f')}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(prefill_markdown(data))
        _say(f"wrote {args.markdown}")
    if args.out:
        p = plot_prefill(data, Path(args.out) / "bench_prefill.png")
        if p:
            _say(f"wrote {p}")


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
        _say(f"attngen bench {family} needs torch: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        _say(f"attngen bench {family} needs a CUDA GPU (torch.cuda.is_available() is False); "
             "use --from-json to re-render saved results", file=sys.stderr)
        return 2
    return None


def cmd_prefill(args: argparse.Namespace) -> int:
    done = _replay_or_gpu_check("prefill", args, _finish_prefill)
    if done is not None:
        return done
    import torch

    shapes = sweep_from_args(args)
    backends = list(args.backends)
    env = environment(gpu=True)
    timer = "cuda-events" if args.reps is not None or _triton_do_bench() is None else "triton.do_bench"
    data: dict[str, Any] = {
        "benchmark": "prefill", "complete": False, "env": env,
        "config": {"shapes": len(shapes), "backends": backends, "warmup_ms": args.warmup_ms,
                   "rep_ms": args.rep_ms, "reps": args.reps, "timer": timer, "seed": args.seed,
                   "check": not args.no_check, "check_tolerance_rel_l2": CHECK_TOL, "tokens": args.tokens,
                   "hidden": args.hidden, "sdpa_layout": args.sdpa_layout,
                   "sdpa_note": SDPA_NOTE if args.sdpa_layout == "view" else SDPA_CONTIG_NOTE, "flops": FLOP_NOTE},
        "results": [],
    }
    json_path = Path(args.out) / "bench_prefill.json" if args.out else None
    for ln in env_lines(env):
        _say(ln)
    _say(f"{len(shapes)} shapes x (attngen + {', '.join(backends)}); timer {timer}, warm-up {args.warmup_ms} ms, "
         f"repeats {args.reps if args.reps is not None else str(args.rep_ms) + ' ms'}; TFLOP/s; /peer = attngen/peer")
    _say(data["config"]["sdpa_note"])
    if json_path is None:
        _say("(no --out: the JSON and the plot are not written)")
    _say(text_header(backends))
    t0 = time.perf_counter()
    for i, shape in enumerate(shapes):
        try:
            rec = run_shape(shape, tuple(backends), check=not args.no_check, warmup_ms=args.warmup_ms,
                            rep_ms=args.rep_ms, reps=args.reps, seed=args.seed + i, sdpa_layout=args.sdpa_layout)
        except Exception as e:  # e.g. out of memory: keep the sweep going
            rec = {**asdict(shape), "flops": shape.flops, "ms": {}, "tflops": {}, "ratio": {},
                   "errors": {"shape": _short_error(e)}}
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:
                pass
        data["results"].append(rec)
        _say(text_row(rec, backends))
        for n, err in rec.get("errors", {}).items():
            if n in ("attngen", "shape"):
                _say(f"    {n} failed: {err}")
        if json_path:
            data["elapsed_s"] = round(time.perf_counter() - t0, 1)
            write_json(json_path, data)
    data["complete"] = True
    data["elapsed_s"] = round(time.perf_counter() - t0, 1)
    data["summary"] = summarize(data["results"], backends)
    if json_path:
        write_json(json_path, data)
        _say(f"wrote {json_path}")
    _say(f"sweep took {data['elapsed_s']} s")
    _finish_prefill(data, args, print_table=False)
    failed = [r for r in data["results"] if (r.get("check") and not r["check"].get("ok"))
              or "attngen" in r.get("errors", {}) or "shape" in r.get("errors", {})]
    if failed:
        _say(f"{len(failed)} shape(s) failed the check or did not run attngen", file=sys.stderr)
        return 1
    return 0


# --- decode ---------------------------------------------------------------------------------------

DECODE_HEADS = ((32, 8), (32, 4), (64, 8))      # (query heads, KV heads)
DECODE_BATCHES = (1, 16, 64, 128)
DECODE_KV_LENS = (1024, 4096, 8192, 32768)
DECODE_Q_LENS = (1,)
DECODE_HEAD_DIM = 128
# (batch, kv_len, q_len, heads, kv_heads): speculative decoding with 4 new tokens, MQA-like 16/1 heads.
DECODE_EXTRA = ((4, 16384, 4, 16, 1),)
DECODE_QUICK = dict(heads=((32, 8),), batches=(1, 64), kv_lens=(4096, 32768))
DECODE_BACKENDS = ("flash", "cudnn")
DECODE_VARIANTS = ("auto", "fused", "unfused", "both")
ITEMSIZE = {"bf16": 2, "fp16": 2}
COPY_MIB = 1024                  # the copy-bandwidth buffer: 1 GiB read + 1 GiB written
MEM_MARGIN = 3 << 29             # 1.5 GiB kept free beside a shape's own tensors
REF_CHUNK_BYTES = 1 << 30        # fp32 K+V per chunk of the spot-check reference
TARGET_COPY_FRAC = 0.90          # of the copy bandwidth, for batch >= 16 and kv_len >= 4k
TARGET_B1_CUDNN = 1.3            # batch 1 at kv_len 32k: cuDNN's time / attngen's
TARGET_FLASH = 1.0               # every shape: flash's time / attngen's
# --rotate: K/V copies walked per graph replay add up to at least this, four H100 L2s (50 MB each), so that
# when a copy comes round again the copies read since have pushed it out of L2: every call reads from DRAM.
ROTATE_BYTES = 4 * 50 * 2**20
BYTES_NOTE = ("GB/s = K + V bytes read (sum over the batch of L x kv_heads x head_dim x 2 x itemsize) / time, "
              "GB = 1e9 bytes; %copy = that over the device-to-device copy bandwidth measured in the same run "
              "(dst.copy_(src) of a 1 GiB buffer, bytes read + written / median time)")
RATIO_NOTE = "vs <peer> = peer time / attngen time (> 1: attngen faster)"
DECODE_SDPA_NOTE = ("SDPA gets q as [B, H, q_len, D] and K/V as [B, Hkv, L, D] .transpose(1, 2) views of the "
                    "dense cache attngen reads, with enable_gqa=True; q_len > 1 uses a bottom-right causal mask "
                    "(the first call form the backend accepts that matches the reference)")
DECODE_SDPA_CONTIG_NOTE = ("SDPA gets contiguous [B, Hkv, L, D] copies of the cache (--sdpa-layout contiguous) "
                           "and q as a [B, H, q_len, D] view, with enable_gqa=True")


@dataclass(frozen=True)
class DecodeShape:
    dtype: str
    batch: int
    kv_len: int
    q_len: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def kv_bytes(self) -> int:
        return decode_kv_bytes([self.kv_len] * self.batch, self.kv_heads, self.head_dim, ITEMSIZE[self.dtype])

    def label(self) -> str:
        return (f"b={self.batch} L={_klen(self.kv_len)} q={self.q_len} h={self.heads}/{self.kv_heads} "
                f"d={self.head_dim} {self.dtype}")


def _klen(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def decode_kv_bytes(lengths: Iterable[int], kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes of K and V a decode must read: every row's L keys and L values, once."""
    return sum(int(n) for n in lengths) * kv_heads * head_dim * 2 * itemsize


def gbps(nbytes: float, ms: float | None) -> float | None:
    if ms is None or not ms > 0:
        return None
    return nbytes / (ms * 1e-3) / 1e9


def make_decode_sweep(heads: Iterable[tuple[int, int]] = DECODE_HEADS, batches: Iterable[int] = DECODE_BATCHES,
                      kv_lens: Iterable[int] = DECODE_KV_LENS, q_lens: Iterable[int] = DECODE_Q_LENS,
                      head_dim: int = DECODE_HEAD_DIM, dtype: str = "bf16",
                      extra: Iterable[tuple[int, int, int, int, int]] = DECODE_EXTRA) -> list[DecodeShape]:
    """The shapes, in the order they run: heads, batch, kv_len, q_len; then the extra shapes."""
    out = [DecodeShape(dtype, b, n, ql, h, hk, head_dim)
           for h, hk in heads for b in batches for n in kv_lens for ql in q_lens]
    for b, n, ql, h, hk in extra:
        s = DecodeShape(dtype, b, n, ql, h, hk, head_dim)
        if s not in out:
            out.append(s)
    return out


def decode_sweep_from_args(args: argparse.Namespace) -> list[DecodeShape]:
    q = DECODE_QUICK if args.quick else {}
    narrowed = any(getattr(args, a) for a in ("heads", "batches", "kv_lens", "q_lens"))
    return make_decode_sweep(
        heads=args.heads or q.get("heads", DECODE_HEADS),
        batches=args.batches or q.get("batches", DECODE_BATCHES),
        kv_lens=args.kv_lens or q.get("kv_lens", DECODE_KV_LENS),
        q_lens=args.q_lens or DECODE_Q_LENS,
        head_dim=args.head_dim, dtype=args.dtype,
        extra=() if (narrowed or args.no_extra) else DECODE_EXTRA,
    )


def decode_impls(variant: str, paged: bool) -> list[tuple[str, str, bool]]:
    """attngen's rows per shape: (name, variant, paged)."""
    variants = ("fused", "unfused") if variant == "both" else (variant,)
    out = []
    for p in ((False, True) if paged else (False,)):
        for v in variants:
            name = "attngen" + ("" if v == "auto" else f"-{v}") + ("-paged" if p else "")
            out.append((name, v, p))
    return out


def decode_mem_need(shape: DecodeShape, *, paged: bool = False, sdpa_contiguous: bool = False,
                    check: bool = True, unfused: bool = False) -> int:
    """Device bytes one shape needs at its peak: caches, their copies, q/outputs, workspaces, the reference."""
    kv = shape.kv_bytes
    need = kv * (1 + int(paged) + int(sdpa_contiguous))
    rows = shape.batch * shape.q_len * shape.heads * shape.head_dim
    need += rows * ITEMSIZE[shape.dtype] * 8          # q, poisoned outs, peers' outputs
    need += rows * 4 * 64                              # split-KV partials (fp32), up to 64 splits
    if unfused:                                        # the unfused variant's fp32 score rows
        need += shape.batch * shape.heads * shape.q_len * shape.kv_len * 4
    need += shape.batch * 4 * 2                        # cache_seqlens, block table (small)
    if check:
        per_row = shape.kv_len * shape.kv_heads * shape.head_dim * 4 * 2
        need += rows * 4 * 2 + max(per_row, min(REF_CHUNK_BYTES, per_row * shape.batch)) * 2
    return need + MEM_MARGIN


def rotate_copies(kv_bytes: int, free_bytes: int | None = None) -> int:
    """How many K/V copies ``--rotate`` walks per graph replay: enough to cover ROTATE_BYTES, one where a
    single cache already does; at most ``free_bytes // (4 * kv_bytes)``, since a copy may hold a dense cache,
    a paged one and SDPA's contiguous one, and the rest is left to the graph's outputs and workspaces."""
    kv = max(1, int(kv_bytes))
    n = max(1, -(-ROTATE_BYTES // kv))
    if free_bytes is not None:
        n = min(n, max(1, int(free_bytes) // (4 * kv)))
    return n


def rotate_timer(n: int) -> str:
    return f"cuda-events, no flush, {n} calls over {n} K/V copies per CUDA-graph replay"


def _heads_list(text: str) -> tuple[tuple[int, int], ...]:
    vals = []
    for part in text.split(","):
        p = part.strip()
        if not p:
            continue
        try:
            h, hk = (int(x) for x in p.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not HEADS/KV_HEADS (e.g. 32/8)") from None
        if h <= 0 or hk <= 0 or h % hk:
            raise argparse.ArgumentTypeError(f"{part!r}: heads must be a positive multiple of kv_heads")
        vals.append((h, hk))
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return tuple(dict.fromkeys(vals))


def _q_len_list(text: str) -> tuple[int, ...]:
    vals = _int_list(text)
    bad = [v for v in vals if v > 8]
    if bad:
        raise argparse.ArgumentTypeError(f"q_len {bad[0]} is not in 1..8")
    return vals


def _one_dtype(text: str) -> str:
    vals = _dtype_list(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one dtype, bf16 or fp16")
    return vals[0]


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return v


def _block_size(text: str) -> int:
    v = _nonneg_int(text)
    if v % 16 or not 16 <= v <= 256:
        raise argparse.ArgumentTypeError(f"block size {v} must be a multiple of 16 from 16 to 256")
    return v


def add_decode_parser(sub) -> None:
    pd = sub.add_parser("decode", help="attngen.decode vs SDPA flash / cudnn on a KV cache (GB/s, %% of copy)",
                        description="attngen.decode vs torch SDPA backends on decode shapes (issue sweep: heads "
                                    "32/8, 32/4, 64/8 at head_dim 128; batch 1, 16, 64, 128; kv_len 1k..32k; "
                                    "q_len 1; plus batch 4, q_len 4, 16/1 heads, 16k). "
                                    f"{BYTES_NOTE}. {RATIO_NOTE}. {DECODE_SDPA_NOTE}.")
    pd.add_argument("--heads", type=_heads_list, default=None, help="HEADS/KV_HEADS pairs, e.g. 32/8,64/8")
    pd.add_argument("--batches", type=_int_list, default=None, help="e.g. 1,16 (default 1,16,64,128)")
    pd.add_argument("--kv-lens", type=_int_list, default=None, help="e.g. 4k,32k (default 1k,4k,8k,32k)")
    pd.add_argument("--q-lens", type=_q_len_list, default=None, help="new tokens per row, 1..8 (default 1)")
    pd.add_argument("--head-dim", type=int, choices=(64, 128, 256), default=DECODE_HEAD_DIM)
    pd.add_argument("--dtype", type=_one_dtype, default="bf16", help="bf16 (default) or fp16")
    pd.add_argument("--no-extra", action="store_true",
                    help="leave out the extra shape (batch 4, q_len 4, 16/1 heads, 16k); narrowing options "
                         "(--heads/--batches/--kv-lens/--q-lens) leave it out too")
    pd.add_argument("--quick", action="store_true",
                    help="a small subset: heads 32/8, batch 1,64, kv 4k,32k, plus the extra shape")
    pd.add_argument("--backends", type=_backend_list, default=DECODE_BACKENDS,
                    help="SDPA backends to compare with (default flash,cudnn; efficient refuses GQA)")
    pd.add_argument("--variant", choices=DECODE_VARIANTS, default="auto",
                    help="attngen variant; both = a fused and an unfused row per shape")
    pd.add_argument("--num-splits", type=_nonneg_int, default=0, help="attngen num_splits (0 = automatic)")
    pd.add_argument("--paged", action="store_true", help="also time attngen on a paged copy of the cache")
    pd.add_argument("--block-size", type=_block_size, default=64, help="paged block size (default 64)")
    pd.add_argument("--sdpa-layout", choices=("view", "contiguous"), default="view",
                    help="view (default): SDPA reads attngen's cache through .transpose(1, 2) views; "
                         "contiguous: its own [B, Hkv, L, D] copies (more memory)")
    pd.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of each call (attngen and SDPA alike), as serving engines run "
                         "decode steps: GPU time without the Python launch path")
    pd.add_argument("--rotate", action="store_true",
                    help="time a CUDA graph of back-to-back calls, each over its own copy of the inputs (copies "
                         f"adding up to {ROTATE_BYTES >> 20} MiB, past L2), with no L2 flush: a decode step's "
                         "one call per layer; ms = replay time / calls (implies --graph)")
    pd.add_argument("--json", type=Path, default=None, help="write the results as JSON to FILE")
    pd.add_argument("--out", type=Path, default=None, help="folder for bench_decode.json and bench_decode.png")
    pd.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown to FILE")
    pd.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up per measurement (ms, default 25)")
    pd.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms, default 100)")
    pd.add_argument("--reps", type=int, default=None,
                    help="a fixed number of timed repeats instead of --rep-ms (own CUDA-event loop)")
    pd.add_argument("--no-check", action="store_true", help="skip the correctness spot checks")
    pd.add_argument("--seed", type=int, default=0)
    pd.add_argument("--copy-mib", type=int, default=COPY_MIB, help=argparse.SUPPRESS)
    pd.add_argument("--from-json", type=Path, default=None,
                    help="re-render table/Markdown/plot from a saved bench_decode.json (no GPU)")
    pd.set_defaults(func=cmd_decode)


# --- decode: measuring ----------------------------------------------------------------------------

@contextlib.contextmanager
def _no_tf32():
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def decode_reference(q, k, v, sm_scale: float | None = None, chunk_bytes: int = REF_CHUNK_BYTES):
    """fp32 decode on a dense cache where every row holds all L keys: out ``[B, q_len, H, D]``.

    q ``[B, q_len, H, D]``, k/v ``[B, L, Hkv, D]``; query i sees keys ``0 .. L - q_len + i``.
    Rows go in chunks so the fp32 copies of K and V stay near ``chunk_bytes``.
    """
    import torch

    b, ql, h, d = q.shape
    n, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = d ** -0.5 if sm_scale is None else sm_scale
    out = torch.zeros(b, ql, h, d, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    pos = torch.arange(ql, device=q.device)[:, None] + (n - ql)
    keep = torch.arange(n, device=q.device)[None, :] <= pos                 # [q_len, L]
    step = max(1, chunk_bytes // max(1, n * hk * d * 4 * 2))
    with _no_tf32():
        for s0 in range(0, b, step):
            s1 = min(b, s0 + step)
            m = s1 - s0
            qf = q[s0:s1].float().reshape(m, ql, hk, g, d).permute(0, 2, 3, 1, 4).reshape(m, hk, g * ql, d)
            kf = k[s0:s1].float().permute(0, 2, 1, 3)                       # [m, Hkv, L, D]
            s = torch.matmul(qf, kf.transpose(-1, -2)).reshape(m, hk, g, ql, n) * scale
            del kf
            p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
            del s
            vf = v[s0:s1].float().permute(0, 2, 1, 3)
            o = torch.matmul(p.reshape(m, hk, g * ql, n), vf).reshape(m, hk, g, ql, d)
            out[s0:s1] = o.permute(0, 3, 1, 2, 4).reshape(m, ql, h, d)
            del p, vf, o
    return out


def paged_copy(k, v, block_size: int, seed: int = 0):
    """The dense cache ``[B, L, Hkv, D]`` as blocks scattered over a pool, with its block table.

    Returns (k_pages, v_pages ``[B * ceil(L / bs), bs, Hkv, D]``, block_table int32 ``[B, ceil(L / bs)]``);
    positions past L in a row's last block hold NaN.
    """
    import torch

    b, n, hk, d = k.shape
    bs = block_size
    nb = (n + bs - 1) // bs
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(b * nb, generator=gen)
    table = perm.view(b, nb).to(torch.int32).to(k.device)
    perm = perm.to(k.device)
    pages = []
    for src in (k, v):
        dst = torch.empty(b * nb, bs, hk, d, dtype=src.dtype, device=src.device)
        for i in range(b):
            idx = perm[i * nb:(i + 1) * nb]
            if n % bs == 0:
                dst[idx] = src[i].reshape(nb, bs, hk, d)
            else:
                tmp = torch.full((nb * bs, hk, d), float("nan"), dtype=src.dtype, device=src.device)
                tmp[:n] = src[i]
                dst[idx] = tmp.view(nb, bs, hk, d)
                del tmp
        pages.append(dst)
    return pages[0], pages[1], table


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


def run_decode_shape(shape: DecodeShape, backends: tuple[str, ...], *, impls: list[tuple[str, str, bool]],
                     num_splits: int = 0, block_size: int = 64, check: bool = True, warmup_ms: float = 25.0,
                     rep_ms: float = 100.0, reps: int | None = None, seed: int = 0, sdpa_layout: str = "view",
                     copy_gbps: float | None = None, graph: bool = False, rotate: bool = False) -> dict:
    """Check and time one shape: each attngen row and each SDPA backend, on one dense cache.
    With ``graph``, each call is captured once into a CUDA graph and its replays are timed. With
    ``rotate``, one graph holds ``rotate_copies`` calls, each over its own copy of the K/V it reads, and
    its replays are timed without an L2 flush; ms is per call."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    import attngen

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    b, n, ql, h, hk, d = shape.batch, shape.kv_len, shape.q_len, shape.heads, shape.kv_heads, shape.head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(b, ql, h, d, device=DEVICE, dtype=tdt, generator=gen)
    kc = torch.randn(b, n, hk, d, device=DEVICE, dtype=tdt, generator=gen)
    vc = torch.randn(b, n, hk, d, device=DEVICE, dtype=tdt, generator=gen)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=DEVICE)
    rec: dict[str, Any] = {**asdict(shape), "bytes": shape.kv_bytes, "impls": [name for name, _, _ in impls],
                           "backends": list(backends), "ms": {}, "gbps": {}, "frac_copy": {}, "errors": {},
                           "checks": {}, "sdpa_call": {}, "ratio": {}, "timer": None}

    def fail(name: str, e: BaseException) -> None:
        rec["errors"][name] = _short_error(e)
        rec["ms"][name] = rec["gbps"][name] = rec["frac_copy"][name] = None

    ref = decode_reference(q, kc, vc) if check else None

    # attngen: one call into a NaN-poisoned out decides supported or not, and is the spot check.
    paged = None
    fns: dict[str, Callable[[], Any]] = {}
    for name, variant, is_paged in impls:
        try:
            if is_paged:
                if paged is None:
                    paged = paged_copy(kc, vc, block_size, seed)
                kk, vv, kw = paged[0], paged[1], {"block_table": paged[2]}
            else:
                kk, vv, kw = kc, vc, {}

            def fn(kk=kk, vv=vv, kw=kw, variant=variant, out=None):
                return attngen.decode(q, kk, vv, cache_seqlens=seqlens, num_splits=num_splits, variant=variant,
                                      out=out, **kw)

            out = torch.full_like(q, float("nan"))
            fn(out=out)
            torch.cuda.synchronize()
            if ref is not None:
                rec["checks"][name] = _rel_check(out, ref)
            del out
            fns[name] = fn
        except Exception as e:
            fail(name, e)
            torch.cuda.synchronize()

    # SDPA: the first call form each backend accepts (and, with the check, gets right).
    qt = q.transpose(1, 2)
    kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
    if sdpa_layout == "contiguous":
        kt, vt = kt.contiguous(), vt.contiguous()
    gqa = {"enable_gqa": True} if h != hk else {}
    if ql == 1:
        forms = [("no mask", {})]
    else:
        mask = torch.arange(n, device=DEVICE)[None, :] <= (torch.arange(ql, device=DEVICE)[:, None] + (n - ql))
        forms = [("bottom-right bool attn_mask", {"attn_mask": mask}),
                 ("is_causal=True (bottom-right in this backend)", {"is_causal": True})]
    for name in backends:
        tried = []
        for label, kw in forms:
            def sdpa(kw=kw, kt=kt, vt=vt):
                return F.scaled_dot_product_attention(qt, kt, vt, **kw, **gqa)
            try:
                with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend(name)):
                    warnings.simplefilter("ignore")
                    o = sdpa()
                torch.cuda.synchronize()
            except Exception as e:
                torch.cuda.synchronize()
                tried.append(f"{label}: {_short_error(e)}")
                continue
            if ref is not None:
                chk = _rel_check(o.transpose(1, 2), ref)
                if not chk["ok"]:
                    tried.append(f"{label}: wrong result (rel L2 {chk['rel_l2']:.2e}, {chk['nan_count']} NaN)")
                    continue
                rec["checks"][name] = chk
            del o
            fns[name] = sdpa
            rec["sdpa_call"][name] = label if ref is not None or ql == 1 else f"{label} (unchecked: --no-check)"
            break
        else:
            rec["errors"][name] = "; ".join(tried)[:400]
            rec["ms"][name] = rec["gbps"][name] = rec["frac_copy"][name] = None
    del ref

    # Copy 0 is what the checks ran on. With rotate, the others are clones at other addresses (same values,
    # so copy 0's check speaks for them): a graph walking them reads each from DRAM, as a decode step's
    # layers do, where timing one cache again and again would read it from L2 once it fits there.
    copies = [(kc, vc, paged, kt, vt)]
    if rotate:
        for _ in range(rotate_copies(shape.kv_bytes, torch.cuda.mem_get_info()[0]) - 1):
            k2, v2 = kc.clone(), vc.clone()
            # The block table is a few KB, read-only: every copy shares it.
            p2 = None if paged is None else (paged[0].clone(), paged[1].clone(), paged[2])
            if sdpa_layout == "contiguous":
                copies.append((k2, v2, p2, kt.clone(), vt.clone()))
            else:
                copies.append((k2, v2, p2, k2.transpose(1, 2), v2.transpose(1, 2)))
        rec["rotate"] = len(copies)
    paged_rows = {name for name, _, p in impls if p}

    def on_copy(name: str, fn: Callable[..., Any], c: tuple) -> Callable[[], Any]:
        if name in backends:
            return functools.partial(fn, kt=c[3], vt=c[4])
        kk, vv = (c[2][0], c[2][1]) if name in paged_rows else (c[0], c[1])
        return functools.partial(fn, kk=kk, vv=vv)

    def timed(name: str, fn: Callable[..., Any]) -> tuple[float, str]:
        if rotate:
            replay = _graphed(*(on_copy(name, fn, c) for c in copies))
            return _event_bench(replay, warmup_ms, rep_ms, reps, flush=False) / len(copies), rotate_timer(len(copies))
        ms, timer = bench_ms(_graphed(fn) if graph else fn, warmup_ms, rep_ms, reps)
        return ms, timer + (" on CUDA-graph replays" if graph else "")

    # Timing, attngen rows first.
    for name in [i[0] for i in impls] + list(backends):
        fn = fns.get(name)
        if fn is None:
            continue
        try:
            if name in backends:   # capture and replay alike under the backend's context
                with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend(name)):
                    warnings.simplefilter("ignore")
                    ms, timer = timed(name, fn)
            else:
                ms, timer = timed(name, fn)
        except Exception as e:
            fail(name, e)
            continue
        rec["timer"] = rec["timer"] or timer
        rec["ms"][name] = ms
        rec["gbps"][name] = gbps(shape.kv_bytes, ms)
        rec["frac_copy"][name] = rec["gbps"][name] / copy_gbps if (copy_gbps and rec["gbps"][name]) else None
    for name, _, _ in impls:
        a = rec["ms"].get(name)
        rec["ratio"][name] = {p: (rec["ms"][p] / a if a and rec["ms"].get(p) else None) for p in backends}
    return rec


# --- decode: reporting ----------------------------------------------------------------------------

def _decode_shape_of(r: dict) -> DecodeShape:
    return DecodeShape(**{f: r[f] for f in ("dtype", "batch", "kv_len", "q_len", "heads", "kv_heads", "head_dim")})


def _decode_impls(records: list[dict]) -> list[str]:
    seen: list[str] = []
    for r in records:
        for n in r.get("impls", []):
            if n not in seen:
                seen.append(n)
    return seen


def _decode_backends(records: list[dict], config_backends: Iterable[str] | None = None) -> list[str]:
    if config_backends is not None:
        return list(config_backends)
    seen: list[str] = []
    for r in records:
        for n in r.get("backends", []):
            if n not in seen:
                seen.append(n)
    return seen


def _decode_check_cell(r: dict, name: str) -> str:
    c = (r.get("checks") or {}).get(name)
    if name in (r.get("errors") or {}):
        return "error"
    if not c:
        return "—"
    if c.get("nan_count"):
        return f"FAIL {c['nan_count']} NaN"
    rel = c.get("rel_l2")
    if not isinstance(rel, float):
        return "FAIL" if not c.get("ok") else "ok"
    return f"{rel:.1e}" + ("" if c.get("ok") else " FAIL")


def _fmt_gbps(x: float | None) -> str:
    return _fmt(x, ".0f" if x is not None and x >= 100 else ".1f")


def decode_columns(backends: list[str]) -> list[str]:
    return ["shape", "impl", "ms", "GB/s", "%copy"] + [f"vs {p}" for p in backends] + ["check"]


def decode_rows(r: dict, backends: list[str]) -> list[list[str]]:
    """The table rows of one shape: attngen's rows, then each peer's; the shape named on the first."""
    label = _decode_shape_of(r).label()
    if r.get("skipped"):
        return [[label, "(skipped)", "—", "—", "—"] + ["—"] * len(backends) + [r["skipped"][:60]]]
    rows = []
    for name in list(r.get("impls", [])) + list(backends):
        ms = r.get("ms", {}).get(name)
        frac = r.get("frac_copy", {}).get(name)
        ratio = r.get("ratio", {}).get(name) or {}
        cells = [label if not rows else "", name if name in r.get("impls", []) else f"sdpa-{name}",
                 _fmt(ms, ".4f"), _fmt_gbps(r.get("gbps", {}).get(name)),
                 _fmt(frac * 100 if frac is not None else None, ".1f")]
        cells += [_fmt(ratio.get(p), ".2f") for p in backends]
        cells.append(_decode_check_cell(r, name))
        rows.append(cells)
    return rows


_DECODE_WIDTHS = {"shape": 36, "impl": 22, "ms": 8, "GB/s": 6, "%copy": 6, "check": 12}


def _dw(col: str) -> int:
    return _DECODE_WIDTHS.get(col, max(8, len(col)))


def decode_text_header(backends: list[str]) -> str:
    cols = decode_columns(backends)
    return "  ".join(c.ljust(_dw(c)) if c in ("shape", "impl") else c.rjust(_dw(c)) for c in cols)


def decode_text_rows(r: dict, backends: list[str]) -> list[str]:
    cols = decode_columns(backends)
    return ["  ".join(v.ljust(_dw(c)) if c in ("shape", "impl") else v.rjust(_dw(c)) for c, v in zip(cols, row))
            for row in decode_rows(r, backends)]


def _target(name: str, values: list[tuple[float, dict]], target: float, what: str) -> dict:
    """Worst value over the shapes it applies to, against a target it must reach (>=)."""
    if not values:
        return {"target": name, "what": what, "threshold": target, "verdict": "not measured", "worst": None,
                "worst_at": None, "shapes": 0}
    worst, wr = min(values, key=lambda p: p[0])
    return {"target": name, "what": what, "threshold": target, "verdict": "met" if worst >= target else "MISSED",
            "worst": worst, "worst_at": _decode_shape_of(wr).label(), "shapes": len(values)}


def decode_summary(records: list[dict], backends: list[str]) -> dict:
    """Per attngen row: ratios to each peer (min, geomean) and the three targets; the checks."""
    ran = [r for r in records if not r.get("skipped")]
    out: dict[str, Any] = {"impls": {}}
    for name in _decode_impls(ran):
        s: dict[str, Any] = {"ratio": {}}
        for p in backends:
            pairs = [(r["ratio"][name][p], r) for r in ran if (r.get("ratio", {}).get(name) or {}).get(p)]
            if pairs:
                worst, wr = min(pairs, key=lambda x: x[0])
                s["ratio"][p] = {"min": worst, "min_at": _decode_shape_of(wr).label(), "shapes": len(pairs),
                                 "geomean": math.exp(sum(math.log(x) for x, _ in pairs) / len(pairs))}
            else:
                s["ratio"][p] = None
        fr = [(r["frac_copy"][name], r) for r in ran
              if r["batch"] >= 16 and r["kv_len"] >= 4096 and r.get("frac_copy", {}).get(name) is not None]
        b1 = [(r["ratio"][name]["cudnn"], r) for r in ran if r["batch"] == 1 and r["kv_len"] == 32768
              and (r.get("ratio", {}).get(name) or {}).get("cudnn")]
        fl = [(r["ratio"][name]["flash"], r) for r in ran if (r.get("ratio", {}).get(name) or {}).get("flash")]
        s["targets"] = [
            _target("copy", fr, TARGET_COPY_FRAC, f">= {TARGET_COPY_FRAC:.0%} of copy bandwidth at batch >= 16, "
                                                  "kv_len >= 4k"),
            _target("cudnn_b1_32k", b1, TARGET_B1_CUDNN, f">= {TARGET_B1_CUDNN}x SDPA cuDNN at batch 1, kv_len 32k"),
            _target("flash", fl, TARGET_FLASH, "never slower than SDPA flash (flash time / attngen time >= 1)"),
        ]
        out["impls"][name] = s
    checks = [(n, c) for r in ran for n, c in (r.get("checks") or {}).items()]
    mine = [c for n, c in checks if n.startswith("attngen")]
    out["checks"] = {"run": len(mine), "failed": sum(1 for c in mine if not c.get("ok")),
                     "max_rel_l2": max((c["rel_l2"] for c in mine if isinstance(c.get("rel_l2"), float)),
                                       default=None),
                     "peers_run": len(checks) - len(mine)}
    out["errors"] = sum(1 for r in ran for n in (r.get("errors") or {}) if n.startswith("attngen"))
    out["skipped"] = sum(1 for r in records if r.get("skipped"))
    return out


def decode_summary_lines(summary: dict) -> list[str]:
    lines = []
    for name, s in summary.get("impls", {}).items():
        for p, x in s.get("ratio", {}).items():
            if not x:
                lines.append(f"{name} vs {p}: no shape where both ran")
                continue
            lines.append(f"{name} vs {p}: min {x['min']:.2f} at {x['min_at']}; geomean {x['geomean']:.2f} over "
                         f"{x['shapes']} shapes")
        for t in s.get("targets", []):
            worst = ""
            if t["worst"] is not None:
                w = f"{t['worst']:.1%}" if t["target"] == "copy" else f"{t['worst']:.2f}x"
                worst = f" (worst {w} at {t['worst_at']}, {t['shapes']} shapes)"
            lines.append(f"target {name}: {t['what']}: {t['verdict']}{worst}")
    c = summary.get("checks") or {}
    if c.get("run"):
        lines.append(f"checks (attngen vs fp32, NaN-poisoned out): {c['run']} run, {c['failed']} failed, "
                     f"max rel L2 {_fmt(c.get('max_rel_l2'), '.1e')}")
    if summary.get("errors"):
        lines.append(f"attngen errors: {summary['errors']}")
    if summary.get("skipped"):
        lines.append(f"skipped shapes (memory): {summary['skipped']}")
    return lines


def _copy_line(copy: dict | None) -> str:
    if not copy or not copy.get("gbps"):
        return "copy bandwidth: not measured (%copy not computed)"
    line = (f"copy bandwidth: {copy['gbps']:.0f} GB/s (dst.copy_(src), {copy['buffer_bytes'] / 2**30:.2f} GiB "
            f"buffer, read + write, median {copy['ms']:.3f} ms)")
    end = copy.get("end_gbps")
    if end:
        line += f"; at the end of the run {end:.0f} GB/s"
    return line


def rotate_note(records: list[dict]) -> str:
    ns = sorted({r["rotate"] for r in records if r.get("rotate")})
    per = f" ({ns[0]}{'' if len(ns) == 1 else f'..{ns[-1]}'} per shape)" if ns else ""
    return ("timed as a decode step's layers run (--rotate): one CUDA graph of back-to-back calls, each over its "
            f"own K/V copy{per}, the copies adding up to >= {ROTATE_BYTES >> 20} MiB (4 H100 L2s) so every call "
            "reads K/V from DRAM; no L2 flush; ms = median replay time / calls")


def decode_markdown(data: dict) -> str:
    env, records = data.get("env", {}), data.get("results", [])
    cfg = data.get("config", {})
    backends = _decode_backends(records, cfg.get("backends"))
    lines = ["## Decode: attngen vs PyTorch SDPA", ""]
    lines += [f"- {ln}" for ln in env_lines(env)]
    lines += [f"- {_copy_line(data.get('copy'))}",
              f"- timing: median of CUDA-event timings ({cfg.get('timer') or 'triton.do_bench'}), warm-up "
              f"{cfg.get('warmup_ms', '?')} ms, repeats {cfg.get('reps') or str(cfg.get('rep_ms', '?')) + ' ms'}; "
              "JIT compile and module load are outside the timings",
              f"- attngen: variant {cfg.get('variant', 'auto')}, num_splits {cfg.get('num_splits', 0) or 'auto'}"
              + (f", paged rows with block size {cfg.get('block_size')}" if cfg.get("paged") else "")
              + "; cache_seqlens = L for every row",
              f"- {BYTES_NOTE}",
              f"- {RATIO_NOTE}",
              f"- {cfg.get('sdpa_note') or DECODE_SDPA_NOTE}",
              *([f"- {rotate_note(records)}"] if cfg.get("rotate") else
                ["- timed on CUDA-graph replays (each call captured once, attngen and SDPA alike): GPU time, "
                 "no Python launch path"] if cfg.get("graph") else []),
              "- check = rel L2 vs an fp32 reference on the first call, output poisoned with NaN; — = the backend "
              "refused that shape",
              ""]
    if not data.get("complete", True):
        lines += ["**Partial run**: the sweep did not finish.", ""]
    cols = decode_columns(backends)
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "|".join("---" if c in ("shape", "impl") else "---:" for c in cols) + "|")
    for r in records:
        for row in decode_rows(r, backends):
            lines.append("| " + " | ".join(row) + " |")
    errs = [(_decode_shape_of(r).label(), n, e) for r in records for n, e in (r.get("errors") or {}).items()]
    if errs:
        lines += ["", "Refusals and errors:", ""] + [f"- {lab}, {n}: {e}" for lab, n, e in errs]
    forms = sorted({(n, c) for r in records if r.get("q_len", 1) > 1 for n, c in (r.get("sdpa_call") or {}).items()})
    if forms:
        lines += ["", "SDPA call forms for q_len > 1: " + "; ".join(f"{n}: {c}" for n, c in forms)]
    summ = data.get("summary") or decode_summary(records, backends)
    lines += [""] + [f"- {ln}" for ln in decode_summary_lines(summ)]
    return "\n".join(lines) + "\n"


def plot_decode(data: dict, path: Path) -> Path | None:
    """GB/s vs kv_len: a panel per (heads, q_len) row and batch column, a line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        _say(f"plot skipped: matplotlib is not available ({e})")
        return None
    records = [r for r in data.get("results", []) if not r.get("skipped")]
    if not records:
        return None
    backends = _decode_backends(records, data.get("config", {}).get("backends"))
    impls = _decode_impls(records) + backends
    groups = sorted({(r["heads"], r["kv_heads"], r["q_len"], r["head_dim"]) for r in records})
    batches = sorted({r["batch"] for r in records})
    colors = {"flash": "tab:blue", "cudnn": "tab:green", "efficient": "tab:orange"}
    own = ["tab:red", "tab:purple", "tab:brown", "tab:pink"]
    fig, axes = plt.subplots(len(groups), len(batches), figsize=(3.6 * len(batches), 2.9 * len(groups)),
                             squeeze=False)
    copy = (data.get("copy") or {}).get("gbps")
    for i, grp in enumerate(groups):
        for j, bt in enumerate(batches):
            ax = axes[i][j]
            sel = [r for r in records if (r["heads"], r["kv_heads"], r["q_len"], r["head_dim"]) == grp
                   and r["batch"] == bt]
            for k, impl in enumerate(impls):
                pts = sorted((r["kv_len"], r["gbps"].get(impl)) for r in sel)
                pts = [(x, y) for x, y in pts if y]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                            color=colors.get(impl, own[k % len(own)]), label=impl,
                            linewidth=2.2 if impl.startswith("attngen") else 1.4)
            if copy:
                ax.axhline(copy, color="gray", linestyle="--", linewidth=1, label="copy")
            ax.set_xscale("log", base=2)
            xs = sorted({r["kv_len"] for r in sel})
            if xs:
                ax.set_xticks(xs, [_klen(x) for x in xs])
                ax.minorticks_off()
            ax.set_title(f"h={grp[0]}/{grp[1]} q={grp[2]} d={grp[3]} b={bt}", fontsize=9)
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("GB/s (K+V read)")
            if i == len(groups) - 1:
                ax.set_xlabel("kv_len")
    return _save_figure(plt, fig, axes, data, "decode", path, bottom=0.05, dpi=120)


def _finish_decode(data: dict, args: argparse.Namespace, print_table: bool) -> None:
    records = data.get("results", [])
    backends = _decode_backends(records, data.get("config", {}).get("backends"))
    if print_table:
        for ln in env_lines(data.get("env", {})):
            _say(ln)
        _say(_copy_line(data.get("copy")))
        if data.get("config", {}).get("rotate"):
            _say(rotate_note(records))
        _say(decode_text_header(backends))
        for r in records:
            for ln in decode_text_rows(r, backends):
                _say(ln)
    summ = data.get("summary") or decode_summary(records, backends)
    _say("")
    for ln in decode_summary_lines(summ):
        _say(ln)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(decode_markdown(data))
        _say(f"wrote {args.markdown}")
    if args.out:
        p = plot_decode(data, Path(args.out) / "bench_decode.png")
        if p:
            _say(f"wrote {p}")


def _decode_json_paths(args: argparse.Namespace) -> list[Path]:
    paths = []
    if args.json:
        paths.append(Path(args.json))
    if args.out:
        p = Path(args.out) / "bench_decode.json"
        if p not in paths:
            paths.append(p)
    return paths


def cmd_decode(args: argparse.Namespace) -> int:
    done = _replay_or_gpu_check("decode", args, _finish_decode)
    if done is not None:
        return done
    import torch

    dtype = args.dtype
    shapes = decode_sweep_from_args(args)
    backends = list(args.backends)
    impls = decode_impls(args.variant, args.paged)
    env = environment(gpu=True)
    timer = "cuda-events" if args.reps is not None or _triton_do_bench() is None else "triton.do_bench"
    if args.rotate:
        timer = "cuda-events, no flush, CUDA-graph replays over rotated K/V copies"
    data: dict[str, Any] = {
        "benchmark": "decode", "complete": False, "env": env,
        "config": {"shapes": len(shapes), "backends": backends, "impls": [i[0] for i in impls],
                   "variant": args.variant, "num_splits": args.num_splits, "paged": args.paged,
                   "block_size": args.block_size, "dtype": dtype, "warmup_ms": args.warmup_ms,
                   "rep_ms": args.rep_ms, "reps": args.reps, "timer": timer, "seed": args.seed,
                   "check": not args.no_check, "check_tolerance_rel_l2": CHECK_TOL, "sdpa_layout": args.sdpa_layout,
                   "graph": bool(getattr(args, "graph", False) or args.rotate), "rotate": bool(args.rotate),
                   "sdpa_note": DECODE_SDPA_NOTE if args.sdpa_layout == "view" else DECODE_SDPA_CONTIG_NOTE,
                   "bytes": BYTES_NOTE, "ratio": RATIO_NOTE,
                   "targets": {"copy_frac": TARGET_COPY_FRAC, "cudnn_b1_32k": TARGET_B1_CUDNN,
                               "flash": TARGET_FLASH}},
        "copy": None, "results": [],
    }
    json_paths = _decode_json_paths(args)

    def save():
        for p in json_paths:
            write_json(p, data)

    for ln in env_lines(env):
        _say(ln)
    try:
        data["copy"] = measure_copy_bandwidth(args.copy_mib, args.warmup_ms, args.rep_ms, args.reps)
    except Exception as e:
        data["copy"] = {"error": _short_error(e)}
        _say(f"copy bandwidth: failed: {_short_error(e)}")
    copy_gbps = (data["copy"] or {}).get("gbps")
    _say(_copy_line(data["copy"]))
    _say(f"{len(shapes)} shapes x ({', '.join(i[0] for i in impls)} + sdpa {', '.join(backends)}); timer {timer}, "
         f"warm-up {args.warmup_ms} ms, repeats {args.reps if args.reps is not None else str(args.rep_ms) + ' ms'}")
    _say(BYTES_NOTE)
    _say(RATIO_NOTE)
    _say(data["config"]["sdpa_note"])
    if args.rotate:
        _say(rotate_note([]))
    if not json_paths:
        _say("(no --json/--out: the JSON is not written)")
    _say(decode_text_header(backends))
    t0 = time.perf_counter()
    said: set[tuple[str, str]] = set()
    if shapes:
        # The first shape of a run came out ~2x slow for attngen on the lent H100 (2026-11-22; its
        # later shapes and the same shape elsewhere in the sweep did not): one untimed pass first.
        try:
            run_decode_shape(shapes[0], tuple(backends), impls=impls, num_splits=args.num_splits,
                             block_size=args.block_size, check=False, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                             reps=args.reps, seed=args.seed, sdpa_layout=args.sdpa_layout, copy_gbps=copy_gbps,
                             graph=args.graph, rotate=args.rotate)
        except Exception:
            pass
    for i, shape in enumerate(shapes):
        base = {**asdict(shape), "bytes": shape.kv_bytes, "impls": [x[0] for x in impls], "backends": backends}
        need = decode_mem_need(shape, paged=args.paged, sdpa_contiguous=args.sdpa_layout == "contiguous",
                               check=not args.no_check, unfused=any(v == "unfused" for _, v, _ in impls))
        try:
            torch.cuda.empty_cache()
            free, _total = torch.cuda.mem_get_info()
        except Exception:
            free = None
        if free is not None and need > free:
            rec = {**base, "skipped": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
        else:
            try:
                rec = run_decode_shape(shape, tuple(backends), impls=impls, num_splits=args.num_splits,
                                       block_size=args.block_size, check=not args.no_check,
                                       warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, reps=args.reps,
                                       seed=args.seed + i, sdpa_layout=args.sdpa_layout, copy_gbps=copy_gbps,
                                       graph=args.graph, rotate=args.rotate)
            except Exception as e:  # e.g. out of memory: keep the sweep going
                rec = {**base, "ms": {}, "gbps": {}, "frac_copy": {}, "ratio": {}, "checks": {},
                       "errors": {"shape": _short_error(e)}}
            try:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            except Exception:
                pass
        data["results"].append(rec)
        for ln in decode_text_rows(rec, backends):
            _say(ln)
        for n, err in (rec.get("errors") or {}).items():
            if n.startswith("attngen") or n == "shape" or (n, err) not in said:
                _say(f"    {n}: {err}")   # a peer's refusal once, not on every shape
                said.add((n, err))
        if rec.get("skipped"):
            _say(f"    skipped: {rec['skipped']}")
        data["elapsed_s"] = round(time.perf_counter() - t0, 1)
        save()
    if copy_gbps:
        try:
            end = measure_copy_bandwidth(args.copy_mib, args.warmup_ms, args.rep_ms, args.reps)
            data["copy"]["end_gbps"] = end["gbps"]
        except Exception:
            pass
    data["complete"] = True
    data["elapsed_s"] = round(time.perf_counter() - t0, 1)
    data["summary"] = decode_summary(data["results"], backends)
    save()
    for p in json_paths:
        _say(f"wrote {p}")
    _say(f"sweep took {data['elapsed_s']} s")
    _finish_decode(data, args, print_table=False)
    failed = [r for r in data["results"] if not r.get("skipped") and (
        any(not c.get("ok") for n, c in (r.get("checks") or {}).items() if n.startswith("attngen"))
        or any(n.startswith("attngen") or n == "shape" for n in (r.get("errors") or {})))]
    if failed:
        _say(f"{len(failed)} shape(s) failed the check or did not run attngen", file=sys.stderr)
        return 1
    return 0


# --- jit ------------------------------------------------------------------------------------------

def default_jit_specs(head_dims: Iterable[int] = HEAD_DIMS, causal: Iterable[bool] = (False, True)) -> list:
    from . import PrefillSpec

    return [PrefillSpec(head_dim=d, dtype="bf16", mask="causal" if c else "none") for d in head_dims for c in causal]


@contextlib.contextmanager
def _cache_env(path: "str | Path"):
    """Point ATTNGEN_CACHE_DIR at ``path`` for the block; restore afterwards."""
    old = os.environ.get("ATTNGEN_CACHE_DIR")
    os.environ["ATTNGEN_CACHE_DIR"] = str(path)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ATTNGEN_CACHE_DIR", None)
        else:
            os.environ["ATTNGEN_CACHE_DIR"] = old


def verdict(value: float | None, target: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if target is None:
        return "(info)"
    if value <= target:
        return "met"
    return f"missed by {value - target:.3g} {unit} ({value / target:.2f}x)"


def _row(metric: str, spec: str, value: float | None, unit: str, target: float | None, note: str = "") -> dict:
    return {"metric": metric, "spec": spec, "value": value, "unit": unit, "target": target,
            "status": verdict(value, target, unit), "note": note}


def measure_cold(specs: list, arch: str, reps: int = 1) -> list[dict]:
    """Cold build per spec: empty disk cache (a fresh temp root) and cleared in-process layer."""
    from . import cache as _cache
    from .compiler import include_dirs, nvrtc_version

    nvrtc_version()   # load the NVRTC library once, outside the timings
    include_dirs()
    rows = []
    for spec in specs:
        totals, nvrtcs, res = [], [], None
        for _ in range(max(1, reps)):
            with tempfile.TemporaryDirectory(prefix="attngen-cold-") as tmp:
                _cache.clear_memory()
                t0 = time.perf_counter()
                r = _cache.build(spec, arch, cache=_cache.DiskCache(tmp))
                totals.append(time.perf_counter() - t0)
                if r.origin != "compiled":
                    raise RuntimeError(f"cold build of {spec.to_text()} came from {r.origin}, not a compile")
                nvrtcs.append(r.binary.compile_seconds)
                res = r.binary.resources
        _cache.clear_memory()
        note = f"NVRTC {statistics.median(nvrtcs):.3f} s; {res.registers} regs, {res.spill_stores} B spill"
        rows.append(_row(f"cold compile ({arch})", spec.to_text(), statistics.median(totals), "s",
                         TARGET_COLD_S, note))
    return rows


_WARM_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import attngen
from attngen.spec import parse_spec
t1 = time.perf_counter()
spec, arch, build_arch = parse_spec(sys.argv[1]), (sys.argv[2] or None), sys.argv[3]
gpu, breakdown = sys.argv[4] == "1", sys.argv[5] == "1"
out = {"import_attngen_s": t1 - t0}
if gpu:
    t = time.perf_counter()
    import cupy
    out["import_cupy_s"] = time.perf_counter() - t
    t = time.perf_counter()
    cupy.cuda.runtime.free(cupy.cuda.runtime.malloc(256))   # creates the CUDA context
    cupy.cuda.runtime.deviceSynchronize()
    out["cuda_init_s"] = time.perf_counter() - t
if breakdown:   # the one-time steps of a first request, each timed before the request itself
    from attngen import render
    from attngen.compiler import compile_options, nvrtc_version
    from attngen.spec import resolve
    t = time.perf_counter()
    nvrtc_version()
    out["nvrtc_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rs = resolve(spec, build_arch)
    render(rs)
    out["render_s"] = time.perf_counter() - t
t = time.perf_counter()
if gpu:
    k = attngen.get_kernel(spec, arch=arch)
    origin = k.origin
else:
    origin = attngen.build(spec, build_arch).origin
out["get_kernel_s"] = time.perf_counter() - t
out["origin"] = origin
print("ATTNGEN_BENCH " + json.dumps(out))
"""


def _pythonpath_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def measure_warm(specs: list, gpu: bool, build_arch: str) -> list[dict]:
    """Warm load from a populated disk cache, each spec in a fresh process.

    With ``gpu``, the fresh process times ``get_kernel(spec)`` (the device's arch, which is
    ``build_arch``); without, the disk hit of ``build(spec, build_arch)``.
    """
    from . import cache as _cache

    rows = []
    with tempfile.TemporaryDirectory(prefix="attngen-warm-") as tmp:
        dc = _cache.DiskCache(tmp)
        for spec in specs:
            _cache.build(spec, build_arch, cache=dc)
        _cache.clear_memory()
        env = _pythonpath_env({"ATTNGEN_CACHE_DIR": tmp})
        def run(spec, breakdown: bool):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", _WARM_SCRIPT, spec.to_text(full=True), "", build_arch,
                                "1" if gpu else "0", "1" if breakdown else "0"],
                               capture_output=True, text=True, env=env, timeout=300)
            wall = time.perf_counter() - t0
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("ATTNGEN_BENCH ")), None)
            if p.returncode != 0 or line is None:
                err = (p.stderr.strip().splitlines() or ["?"])[-1]
                return None, wall, err
            return json.loads(line[len("ATTNGEN_BENCH "):]), wall, ""

        what = "get_kernel" if gpu else "build (disk hit only: no module load without a GPU of this arch)"
        for spec in specs:
            m, wall, err = run(spec, False)
            if m is None:
                rows.append(_row("warm load, fresh process", spec.to_text(), None, "ms", TARGET_WARM_S * 1e3,
                                 f"failed: {err[:200]}"))
                continue
            origin_note = "" if m["origin"] == "disk" else f"; WARNING: origin {m['origin']}, not disk"
            rows.append(_row(f"warm {what}, fresh process", spec.to_text(), m["get_kernel_s"] * 1e3, "ms",
                             TARGET_WARM_S * 1e3, f"origin {m['origin']}{origin_note}"))
            extra = (f"; import cupy {m['import_cupy_s'] * 1e3:.0f} ms and CUDA context "
                     f"{m['cuda_init_s'] * 1e3:.0f} ms not counted") if gpu else ""
            rows.append(_row("import attngen + the above", spec.to_text(),
                             (m["import_attngen_s"] + m["get_kernel_s"]) * 1e3, "ms", None,
                             f"import attngen {m['import_attngen_s'] * 1e3:.0f} ms; whole process "
                             f"{wall * 1e3:.0f} ms wall{extra}"))
        # Where a first request's time goes: the same in a fresh process, its one-time steps timed apart.
        m, wall, err = run(specs[0], True)
        if m is not None:
            rows.append(_row("first request, part: NVRTC library load (nvrtc_version for the key)",
                             specs[0].to_text(), m["nvrtc_load_s"] * 1e3, "ms", None, "diagnostic"))
            rows.append(_row("first request, part: resolve + render (Jinja load)", specs[0].to_text(),
                             m["render_s"] * 1e3, "ms", None, "diagnostic"))
            rows.append(_row(f"first request, part: the rest of {what.split(' ')[0]}", specs[0].to_text(),
                             m["get_kernel_s"] * 1e3, "ms", None, f"diagnostic; origin {m['origin']}"))
    return rows


def measure_repeat(specs: list, gpu: bool, build_arch: str, calls: int) -> list[dict]:
    """The same spec requested again and again in one process."""
    from . import cache as _cache

    spec = specs[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="attngen-repeat-") as tmp, _cache_env(tmp):
        if gpu:
            from .runtime import get_kernel

            import cupy

            dev = cupy.cuda.runtime.getDevice()
            get_kernel(spec)
            variants = [("get_kernel(spec)", lambda: get_kernel(spec)),
                        (f"get_kernel(spec, device={dev}) (as prefill calls it)", lambda: get_kernel(spec, device=dev))]
            for label, fn in variants:
                fn()
                best = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    best.append((time.perf_counter() - t0) / calls * 1e6)
                rows.append(_row(f"repeat {label}", spec.to_text(), statistics.median(best), "µs",
                                 TARGET_REPEAT_US, f"{calls} calls, median of 3"))
        else:
            _cache.build(spec, build_arch)
            n = max(1, min(calls, 2000))
            t0 = time.perf_counter()
            for _ in range(n):
                r = _cache.build(spec, build_arch)
            us = (time.perf_counter() - t0) / n * 1e6
            rows.append(_row("repeat cache.build (memory hit; get_kernel needs a GPU of this arch)", spec.to_text(),
                             us, "µs", None, f"{n} calls, origin {r.origin}; build() re-renders and re-hashes each call, "
                                   "get_kernel's own dict skips that"))
        _cache.clear_memory()
    return rows


def measure_overhead(calls: int, batches: int) -> list[dict]:
    """Host time per call of attngen.prefill vs SDPA on tiny inputs (B=1, S=128, H=8, D=64, bf16)."""
    import torch
    import torch.nn.functional as F

    import attngen

    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    out = torch.empty_like(q)
    cands = [
        ("attngen.prefill(q, k, v)", lambda: attngen.prefill(q, k, v), TARGET_OVERHEAD_US),
        ("attngen.prefill(q, k, v, out=out)", lambda: attngen.prefill(q, k, v, out=out), None),
        ("attngen.prefill(q, k, v, causal=True)", lambda: attngen.prefill(q, k, v, causal=True), None),
        ("SDPA (default dispatch)", lambda: F.scaled_dot_product_attention(qt, kt, vt), None),
    ]
    try:
        from torch.nn.attention import sdpa_kernel

        def flash():
            with sdpa_kernel(_sdpa_backend("flash")):
                return F.scaled_dot_product_attention(qt, kt, vt)

        cands.append(("SDPA in sdpa_kernel(FLASH_ATTENTION)", flash, None))
    except Exception:
        pass
    rows = []
    for label, fn, target in cands:
        try:
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            per = []
            for _ in range(batches):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                per.append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
            rows.append(_row(f"host time per call: {label}", "B=1 S=128 H=8 D=64 bf16", statistics.median(per),
                             "µs", target, f"{calls} calls x {batches} batches, median"))
        except Exception as e:
            rows.append(_row(f"host time per call: {label}", "B=1 S=128 H=8 D=64 bf16", None, "µs", target,
                             f"failed: {_short_error(e)}"))
    # How long the GPU work is: if it exceeds the host time, the queue fills and the host time is GPU time.
    try:
        ms, _ = bench_ms(lambda: attngen.prefill(q, k, v, out=out), 10, 50)
        rows.append(_row("GPU time per call: attngen.prefill (for reference)", "B=1 S=128 H=8 D=64 bf16",
                         ms * 1e3, "µs", None, "if this exceeds the host time, the host numbers are GPU-bound"))
    except Exception:
        pass
    return rows


def _value_str(r: dict) -> str:
    v = r.get("value")
    if v is None:
        return "—"
    return f"{v:.3f} s" if r["unit"] == "s" else f"{v:.2f} {r['unit']}" if v < 100 else f"{v:.0f} {r['unit']}"


def _target_str(r: dict) -> str:
    t = r.get("target")
    if t is None:
        return "—"
    return f"≤ {t:g} {r['unit']}"


def jit_text(data: dict) -> list[str]:
    rows = data.get("rows", [])
    w0 = max([len(r["metric"]) for r in rows] + [6])
    w1 = max([len(r["spec"]) for r in rows] + [4])
    lines = [f"{'metric':<{w0}}  {'spec':<{w1}}  {'value':>11}  {'target':>10}  status / note"]
    for r in rows:
        note = f"  [{r['note']}]" if r.get("note") else ""
        lines.append(f"{r['metric']:<{w0}}  {r['spec']:<{w1}}  {_value_str(r):>11}  {_target_str(r):>10}  "
                     f"{r['status']}{note}")
    return lines


def jit_markdown(data: dict) -> str:
    env = data.get("env", {})
    lines = ["## JIT latency", ""] + [f"- {ln}" for ln in env_lines(env)]
    cfg = data.get("config", {})
    lines += [f"- arch: {cfg.get('arch', '?')}; cold = fresh empty disk cache and cleared in-process layer; warm = "
              "populated disk cache, measured in a fresh Python process", ""]
    lines.append("| metric | spec | measured | target | status | note |")
    lines.append("|---|---|---:|---:|---|---|")
    for r in data.get("rows", []):
        lines.append(f"| {r['metric']} | `{r['spec']}` | {_value_str(r)} | {_target_str(r)} | {r['status']} | "
                     f"{r.get('note', '')} |")
    skipped = data.get("skipped") or []
    if skipped:
        lines += [""] + [f"- skipped: {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def _finish_jit(data: dict, args: argparse.Namespace) -> None:
    for ln in jit_text(data):
        _say(ln)
    for s in data.get("skipped") or []:
        _say(f"skipped: {s}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(jit_markdown(data))
        _say(f"wrote {args.markdown}")


def cmd_jit(args: argparse.Namespace) -> int:
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        for ln in env_lines(data.get("env", {})):
            _say(ln)
        _finish_jit(data, args)
        return 0
    from .arch import get_arch
    from .errors import AttngenError
    from .spec import parse_spec

    measures = {m.strip() for m in args.measure.split(",") if m.strip()}
    unknown = measures - {"cold", "warm", "repeat", "overhead"}
    if unknown:
        _say(f"--measure: unknown {', '.join(sorted(unknown))}; allowed: cold, warm, repeat, overhead",
             file=sys.stderr)
        return 2
    try:
        specs = ([parse_spec(s) for s in args.spec] if args.spec
                 else default_jit_specs(args.head_dims or HEAD_DIMS, _CAUSAL[args.causal]))
        arch = get_arch(args.arch).name if args.arch else None
    except AttngenError as e:
        _say(f"error: {e}", file=sys.stderr)
        return 2
    gpu = have_gpu()
    if gpu:
        try:
            import cupy

            from .runtime import device_arch

            dev_arch = device_arch(cupy.cuda.runtime.getDevice()).name
        except Exception as e:
            _say(f"error: cannot query the GPU: {e}", file=sys.stderr)
            return 2
    else:
        dev_arch = None
    build_arch = arch or dev_arch
    gpu_load = gpu and build_arch == dev_arch   # can this GPU load what is built? else measure build() alone
    if build_arch is None:
        _say("error: no GPU here: pass --arch (e.g. --arch sm_90) to measure the cold compile", file=sys.stderr)
        return 2
    env = environment(gpu=gpu)
    for ln in env_lines(env):
        _say(ln)
    order = [m for m in ("cold", "warm", "repeat", "overhead") if m in measures]
    _say(f"arch {build_arch}; {len(specs)} spec(s); measuring {', '.join(order)}")
    data: dict[str, Any] = {"benchmark": "jit", "env": env, "rows": [], "skipped": [],
                            "config": {"arch": build_arch, "specs": [s.to_text() for s in specs], "gpu": gpu,
                                       "targets": {"cold_s": TARGET_COLD_S, "warm_ms": TARGET_WARM_S * 1e3,
                                                   "repeat_us": TARGET_REPEAT_US,
                                                   "overhead_us": TARGET_OVERHEAD_US}}}
    json_path = Path(args.out) / "bench_jit.json" if args.out else None

    def save():
        if json_path:
            write_json(json_path, data)

    if "cold" in measures:
        data["rows"] += measure_cold(specs, build_arch, args.cold_reps)
        if gpu_load:
            from . import cache as _cache
            from .runtime import clear_loaded, get_kernel

            for spec in specs[:1]:
                with tempfile.TemporaryDirectory(prefix="attngen-coldget-") as tmp, _cache_env(tmp):
                    _cache.clear_memory()
                    clear_loaded()
                    t0 = time.perf_counter()
                    k = get_kernel(spec)
                    dt = time.perf_counter() - t0
                    clear_loaded()
                    _cache.clear_memory()
                data["rows"].append(_row("cold get_kernel (compile + store + load)", spec.to_text(), dt, "s", None,
                                         f"origin {k.origin}"))
        save()
    if "warm" in measures:
        data["rows"] += measure_warm(specs, gpu_load, build_arch)
        save()
    if "repeat" in measures:
        try:
            data["rows"] += measure_repeat(specs, gpu_load, build_arch, args.repeat_calls)
        except Exception as e:
            data["skipped"].append(f"repeat: {_short_error(e)}")
        if not gpu_load:
            data["skipped"].append("repeat get_kernel: needs a GPU of --arch (measured cache.build memory hits "
                                   "instead)")
        save()
    if "overhead" in measures:
        if gpu:
            try:
                import torch

                if not torch.cuda.is_available():
                    raise RuntimeError("torch.cuda.is_available() is False")
                data["rows"] += measure_overhead(args.overhead_calls, args.overhead_batches)
            except Exception as e:
                data["skipped"].append(f"prefill host overhead: {_short_error(e)}")
        else:
            data["skipped"].append("prefill host overhead: needs a GPU")
        save()
    _say("")
    _finish_jit(data, args)
    if json_path:
        _say(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
