"""``attngen bench jit``: the latency of the JIT pipeline against its targets.

A cold NVRTC compile (works without a GPU given ``--arch``), a warm load from the disk cache in
a fresh process, a repeated in-process request, and the host-side overhead of one
``attngen.prefill`` call. Writes a table, JSON (``--out``) and Markdown (``--markdown``), and
re-renders a saved JSON with ``--from-json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import attngen
from attngen import builder as _builder, cache as _cache
from attngen.compiler import include_dirs, nvrtc_version

from . import core
from .core import _CAUSAL, _int_list, _say, _sdpa_backend, _short_error, env_lines, have_gpu, write_json

TARGET_COLD_S = 2.0
TARGET_WARM_S = 0.020
TARGET_REPEAT_US = 10.0
TARGET_OVERHEAD_US = 15.0
HEAD_DIMS = (64, 128, 256)   # the default specs: prefill at each head_dim of its benchmark's sweep


def add_parser(sub) -> None:
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


def default_jit_specs(head_dims: Iterable[int] = HEAD_DIMS, causal: Iterable[bool] = (False, True)) -> list:
    return [attngen.PrefillSpec(head_dim=d, dtype="bf16", mask="causal" if c else "none")
            for d in head_dims for c in causal]


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


# --- measuring ------------------------------------------------------------------------------------

def measure_cold(specs: list, arch: str, reps: int = 1) -> list[dict]:
    """Cold build per spec: empty disk cache (a fresh temp root) and cleared in-process layer."""
    nvrtc_version()   # load the NVRTC library once, outside the timings
    include_dirs()
    rows = []
    for spec in specs:
        totals, nvrtcs, res = [], [], None
        for _ in range(max(1, reps)):
            with tempfile.TemporaryDirectory(prefix="attngen-cold-") as tmp:
                _builder.clear_memory()
                t0 = time.perf_counter()
                r = _builder.build(spec, arch, cache=_cache.DiskCache(tmp))
                totals.append(time.perf_counter() - t0)
                if r.origin != "compiled":
                    raise RuntimeError(f"cold build of {spec.to_text()} came from {r.origin}, not a compile")
                nvrtcs.append(r.binary.compile_seconds)
                res = r.binary.resources
        _builder.clear_memory()
        spill = f"{res.spill_stores} B spill" if res.known else "spills not reported"
        note = f"NVRTC {statistics.median(nvrtcs):.3f} s; {res.registers} regs, {spill}"
        rows.append(_row(f"cold compile ({arch})", spec.to_text(), statistics.median(totals), "s",
                         TARGET_COLD_S, note))
    return rows


# Run in a fresh process, through public names only: it times what a user's first request pays.
_WARM_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import attngen
t1 = time.perf_counter()
spec, arch, build_arch = attngen.parse_spec(sys.argv[1]), (sys.argv[2] or None), sys.argv[3]
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
    from attngen.compiler import nvrtc_version
    t = time.perf_counter()
    nvrtc_version()
    out["nvrtc_load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rs = attngen.resolve(spec, build_arch)
    attngen.render(rs)
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
    root = str(Path(attngen.__file__).resolve().parent.parent)   # this attngen, not another installed one
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def measure_warm(specs: list, gpu: bool, build_arch: str) -> list[dict]:
    """Warm load from a populated disk cache, each spec in a fresh process.

    With ``gpu``, the fresh process times ``get_kernel(spec)`` (the device's arch, which is
    ``build_arch``); without, the disk hit of ``build(spec, build_arch)``.
    """
    rows = []
    with tempfile.TemporaryDirectory(prefix="attngen-warm-") as tmp:
        dc = _cache.DiskCache(tmp)
        for spec in specs:
            _builder.build(spec, build_arch, cache=dc)
        _builder.clear_memory()
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
    spec = specs[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="attngen-repeat-") as tmp, _cache_env(tmp):
        if gpu:
            import cupy

            get_kernel = attngen.get_kernel   # bound once: the loop times get_kernel, not an attribute lookup
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
            _builder.build(spec, build_arch)
            n = max(1, min(calls, 2000))
            t0 = time.perf_counter()
            for _ in range(n):
                r = _builder.build(spec, build_arch)
            us = (time.perf_counter() - t0) / n * 1e6
            rows.append(_row("repeat cache.build (memory hit; get_kernel needs a GPU of this arch)", spec.to_text(),
                             us, "µs", None, f"{n} calls, origin {r.origin}; build() re-renders and re-hashes each call, "
                                   "get_kernel's own dict skips that"))
        _builder.clear_memory()
    return rows


def measure_overhead(calls: int, batches: int) -> list[dict]:
    """Host time per call of attngen.prefill vs SDPA on tiny inputs (B=1, S=128, H=8, D=64, bf16)."""
    import torch
    import torch.nn.functional as F

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
            rows.append(_row(f"host time per call: {label}", "B=1 S=128 H=8 D=64 bf16",
                             core.host_time_us(fn, calls, batches), "µs", target,
                             f"{calls} calls x {batches} batches, median"))
        except Exception as e:
            rows.append(_row(f"host time per call: {label}", "B=1 S=128 H=8 D=64 bf16", None, "µs", target,
                             f"failed: {_short_error(e)}"))
    # How long the GPU work is: if it exceeds the host time, the queue fills and the host time is GPU time.
    try:
        ms, _ = core.bench_ms(lambda: attngen.prefill(q, k, v, out=out), 10, 50)
        rows.append(_row("GPU time per call: attngen.prefill (for reference)", "B=1 S=128 H=8 D=64 bf16",
                         ms * 1e3, "µs", None, "if this exceeds the host time, the host numbers are GPU-bound"))
    except Exception:
        pass
    return rows


# --- reporting ------------------------------------------------------------------------------------

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
    args.result = data  # what --json prints
    for ln in jit_text(data):
        _say(ln)
    for s in data.get("skipped") or []:
        _say(f"skipped: {s}")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(jit_markdown(data))
        _say(f"wrote {args.markdown}")


# --- the command ----------------------------------------------------------------------------------

def cmd_jit(args: argparse.Namespace) -> int:
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        for ln in env_lines(data.get("env", {})):
            _say(ln)
        _finish_jit(data, args)
        return 0
    measures = {m.strip() for m in args.measure.split(",") if m.strip()}
    unknown = measures - {"cold", "warm", "repeat", "overhead"}
    if unknown:
        _say(f"--measure: unknown {', '.join(sorted(unknown))}; allowed: cold, warm, repeat, overhead",
             file=sys.stderr)
        return 2
    try:
        specs = ([attngen.parse_spec(s) for s in args.spec] if args.spec
                 else default_jit_specs(args.head_dims or HEAD_DIMS, _CAUSAL[args.causal]))
        arch = attngen.get_arch(args.arch).name if args.arch else None
    except attngen.AttngenError as e:
        _say(f"attngen: error: {e}", file=sys.stderr)
        return 2
    gpu = have_gpu()
    if gpu:
        try:
            import cupy

            dev_arch = attngen.runtime.device_arch(cupy.cuda.runtime.getDevice()).name
        except Exception as e:
            _say(f"attngen: error: cannot query the GPU: {e}", file=sys.stderr)
            return 2
    else:
        dev_arch = None
    build_arch = arch or dev_arch
    gpu_load = gpu and build_arch == dev_arch   # can this GPU load what is built? else measure build() alone
    if build_arch is None:
        _say("attngen: error: no GPU here: pass --arch (e.g. --arch sm_90) to measure the cold compile", file=sys.stderr)
        return 2
    env = core.environment(gpu=gpu)
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
            for spec in specs[:1]:
                with tempfile.TemporaryDirectory(prefix="attngen-coldget-") as tmp, _cache_env(tmp):
                    _builder.clear_memory()
                    attngen.runtime.clear_loaded()
                    t0 = time.perf_counter()
                    k = attngen.get_kernel(spec)
                    dt = time.perf_counter() - t0
                    attngen.runtime.clear_loaded()
                    _builder.clear_memory()
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
