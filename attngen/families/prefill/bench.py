"""``attngen bench prefill``: attngen.prefill vs PyTorch SDPA's backends.

Runs attngen and ``torch.nn.functional.scaled_dot_product_attention`` with each selected
backend (flash = FlashAttention-2, cudnn, efficient) on the same inputs in one process, over
FlashAttention's standard sweep: batch x seqlen = 16384 tokens, heads = 2048 / head_dim,
head_dim 64/128/256, causal and not, bf16 and fp16. Every shape is checked first (attngen vs
the flash backend, output poisoned with NaN), then timed with CUDA events (warm-up first,
median of many repeats). Rows stream to stdout; the JSON is rewritten after every shape, so a
run cut short still leaves its results.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import attngen
from attngen.families.prefill.op import kernel_for
from attngen.spec import spec_of_text
from attngen.bench import core
from attngen.bench import flashinfer as fi
from attngen.bench.core import (_CAUSAL, BACKENDS, CHECK_TOL, DTYPES, _backend_list, _dtype_list, _fmt,
                                _head_dim_list, _int_list, _replay_or_gpu_check, _save_figure, _say, _sdpa_backend,
                                _short_error, attention_flops, env_lines, pyplot, ratio_summary, tflops, write_json)

# --- the sweep ------------------------------------------------------------------------------------

TOKENS = 16384          # batch * seqlen
HIDDEN = 2048           # heads * head_dim
# Warm-up per column (ms). With a short warm-up the column timed first after a shape's check read faster than the
# same kernel timed as a later column: the GPU's clocks fall under a sustained load. With 300 every column is timed
# at that load's clocks, and the same kernel in two columns reads the same.
WARMUP_MS = 300.0
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)
QUICK = dict(seqlens=(1024, 4096), head_dims=(64, 128), dtypes=("bf16",))
SDPA_NOTE = ("SDPA is given [B, H, S, D] views made by .transpose(1, 2) of the [B, S, H, D] tensors attngen "
             "takes, which is how FlashAttention-layout users call it.")
SDPA_CONTIG_NOTE = ("SDPA is given contiguous [B, H, S, D] copies of the inputs (--sdpa-layout contiguous); "
                    "attngen gets [B, S, H, D].")
FLOP_NOTE = ("FLOPs = 4*B*H*Sq*Sk*D (2*B*H*Sq*Sk*(D+DV) for split head dims D/DV), halved for causal "
             "(FlashAttention's convention).")


@dataclass(frozen=True)
class Shape:
    dtype: str
    head_dim: int
    causal: bool
    batch: int
    seqlen: int
    heads: int
    head_dim_v: int = 0  # of v and the output; 0: head_dim
    kv_heads: int = 0    # of k and v; 0: heads (fewer: GQA, as --shapes 1x32/8x4096 asks)

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal,
                               self.head_dim_v)

    def label(self) -> str:
        return (f"{self.dtype} d={dims_text(asdict(self))} {'causal' if self.causal else 'full'} "
                f"b={self.batch} s={self.seqlen} h={heads_text(asdict(self))}")


def heads_text(r: dict) -> str:
    """A record's heads: ``32``, or ``32/8`` when k and v have fewer."""
    hk = r.get("kv_heads") or 0
    return f"{r['heads']}/{hk}" if hk and hk != r["heads"] else str(r["heads"])


def dims_text(r: dict) -> str:
    """A record's head dims: ``128``, or ``192/128`` when v's differs."""
    dv = r.get("head_dim_v") or 0
    return f"{r['head_dim']}/{dv}" if dv and dv != r["head_dim"] else str(r["head_dim"])


def make_sweep(head_dims: Iterable[int | tuple[int, int]] = HEAD_DIMS, seqlens: Iterable[int] = SEQLENS,
               dtypes: Iterable[str] = DTYPES, causal: Iterable[bool] = (False, True),
               tokens: int = TOKENS, hidden: int = HIDDEN,
               shapes: Iterable[tuple[int, ...]] = ()) -> list[Shape]:
    """The shapes, in the order they run: dtype, mask, head_dim, seqlen. A head dim is D or (D, DV).
    ``shapes`` (batch, heads, seqlen[, kv_heads]) replace the seqlen sweep where given."""
    shapes = tuple(shapes)
    out = []
    for dt in dtypes:
        for c in causal:
            for hd in head_dims:
                d, dv = (hd, hd) if isinstance(hd, int) else hd
                dv = 0 if dv == d else dv
                if shapes:
                    out.extend(Shape(dt, d, c, b, s, h, dv, hk[0] if hk and hk[0] != h else 0)
                               for b, h, s, *hk in shapes)
                    continue
                for s in seqlens:
                    out.append(Shape(dt, d, c, max(1, tokens // s), s, max(1, hidden // d), dv))
    return out


def _shape_list(text: str) -> tuple[tuple[int, int, int, int], ...]:
    """``1x48x8192,1x32/8x4096`` -> ((1, 48, 8192, 48), (1, 32, 4096, 8)): batch x heads[/kv_heads] x seqlen."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            b, heads, n = part.lower().split("x")
            h, _, hk = heads.partition("/")
            b, h, n, hk = int(b), int(h), int(n), int(hk or h)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not BATCHxHEADSxSEQLEN or BATCHxHEADS/KV_HEADSxSEQLEN "
                                             "(e.g. 1x48x8192, 1x32/8x4096)") from None
        if min(b, h, n, hk) < 1 or h % hk:
            raise argparse.ArgumentTypeError(f"{part!r}: batch, heads and seqlen must be >= 1, and kv_heads must "
                                             "divide heads")
        out.append((b, h, n, hk))
    return tuple(out)


def _variant(text: str) -> tuple[str, str]:
    """``persist=persistent=true`` -> ("persist", "persistent=true"): a column name and the spec fields it
    times (checked here, so a typo is argparse's one-line error rather than a column of failures)."""
    name, sep, fields = text.partition("=")
    if not sep or not name or not fields:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=FIELDS (e.g. persist=persistent=true)")
    try:
        spec_of_text("prefill:" + fields, "prefill")
    except attngen.SpecError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return name, fields


def sweep_from_args(args: argparse.Namespace) -> list[Shape]:
    q = QUICK if args.quick else {}
    return make_sweep(
        head_dims=args.head_dims or q.get("head_dims", HEAD_DIMS),
        seqlens=args.seqlens or q.get("seqlens", SEQLENS),
        dtypes=args.dtypes or q.get("dtypes", DTYPES),
        causal=_CAUSAL[args.causal],
        tokens=args.tokens, hidden=args.hidden, shapes=args.shapes or (),
    )


def add_parser(sub) -> None:
    pp = sub.add_parser("prefill", help="attngen.prefill vs SDPA's flash / cudnn / efficient backends",
                        description="attngen.prefill vs torch SDPA backends on FlashAttention's standard sweep "
                                    f"(batch*seqlen={TOKENS}, heads={HIDDEN}/head_dim). {SDPA_NOTE} {FLOP_NOTE}")
    pp.add_argument("--head-dims", type=_head_dim_list, default=None,
                    help="e.g. 64,128 or 192/128 for a v of its own head dim (default 64,128,256)")
    pp.add_argument("--seqlens", type=_int_list, default=None, help="e.g. 512,2k (default 512..16k)")
    pp.add_argument("--dtypes", type=_dtype_list, default=None, help="bf16,fp16 (default both)")
    pp.add_argument("--causal", choices=sorted(_CAUSAL), default="both", help="masks to run (default both)")
    pp.add_argument("--backends", type=_backend_list, default=BACKENDS,
                    help="SDPA backends to compare with (default flash,cudnn,efficient)")
    pp.add_argument("--shapes", type=_shape_list, default=None, metavar="BxHxS,...",
                    help="batch x heads x seqlen per head dim instead of the 16k-token sweep, e.g. "
                         "1x48x8192,4x16x2048; HEADS/KV_HEADS for GQA, e.g. 1x32/8x4096")
    pp.add_argument("--chunked-too", action="store_true",
                    help="for head dims up to 256, also time the chunked kernel (head_dim_chunk=64) as "
                         "'chunked': where the two kernels cross over")
    pp.add_argument("--sync-too", action="store_true",
                    help="also time the cp.async pipeline (pipeline=sync) as 'sync': on sm_90a, what the TMA "
                         "pipeline of the default buys")
    pp.add_argument("--serial-too", action="store_true",
                    help="also time the serial schedule (schedule=serial) as 'serial': on sm_90a, what the default's "
                         "ping-pong or overlap buys at the same tiles")
    pp.add_argument("--also", action="append", type=_variant, default=[], metavar="NAME=FIELDS",
                    help="also time attngen with these spec fields as column NAME (repeatable), e.g. "
                         "persist=persistent=true or kv64=cta_tile_kv=64,num_stages=3")
    pp.add_argument("--interleave", action="store_true",
                    help="time every column twice, in one order and then the reverse, keeping the mean: every column's "
                         "mean place in each shape's sequence is the same (clocks drift over it; twice the time)")
    pp.add_argument("--quick", action="store_true",
                    help="a small subset: seqlens 1k,4k, head_dims 64,128, bf16 (explicit options still win)")
    pp.add_argument("--tokens", type=int, default=TOKENS, help=argparse.SUPPRESS)
    pp.add_argument("--hidden", type=int, default=HIDDEN, help=argparse.SUPPRESS)
    pp.add_argument("--out", type=Path, default=None, help="folder for bench_prefill.json and bench_prefill.png")
    pp.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown to FILE")
    pp.add_argument("--warmup-ms", type=float, default=WARMUP_MS,
                    help=f"warm-up per measurement (ms, default {WARMUP_MS:g}: long enough that every column is timed "
                         "at the clocks a sustained load runs at)")
    pp.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms, default 100)")
    pp.add_argument("--reps", type=int, default=None,
                    help="a fixed number of timed repeats instead of --rep-ms (own CUDA-event loop)")
    pp.add_argument("--sdpa-layout", choices=("view", "contiguous"), default="view",
                    help="view (default): SDPA gets .transpose(1, 2) views of attngen's [B, S, H, D] inputs; "
                         "contiguous: SDPA gets its own contiguous [B, H, S, D] copies (its preferred layout)")
    pp.add_argument("--no-check", action="store_true", help="skip the correctness check")
    pp.add_argument("--seed", type=int, default=0)
    fi.add_argument(pp)
    pp.add_argument("--from-json", type=Path, default=None,
                    help="re-render table/Markdown/plot from a saved bench_prefill.json (no GPU)")
    pp.set_defaults(func=cmd_prefill)
    from . import bench_fp8, bench_serving, bench_variants

    bench_serving.add_parser(sub)  # mask, varlen
    bench_variants.add_parser(sub)
    bench_fp8.add_parser(sub)  # prefill-fp8


# --- measuring ------------------------------------------------------------------------------------

def run_shape(shape: Shape, backends: tuple[str, ...], *, check: bool = True, warmup_ms: float = WARMUP_MS,
              rep_ms: float = 100.0, reps: int | None = None, seed: int = 0, sdpa_layout: str = "view",
              chunked_too: bool = False, sync_too: bool = False, serial_too: bool = False,
              also: tuple[tuple[str, str], ...] = (), interleave: bool = False, flashinfer: bool = False) -> dict:
    """Check and time one shape: attngen and each SDPA backend on the same inputs (``interleave``: each column
    twice, in one order and then the other, the mean kept); ``flashinfer``: FlashInfer too, planned and run once
    (its first call timed apart) before any timing."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    b, s, h, d, causal = shape.batch, shape.seqlen, shape.heads, shape.head_dim, shape.causal
    dv, hk = shape.head_dim_v or d, shape.kv_heads or shape.heads
    gen = torch.Generator(device=core.DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, w, device=core.DEVICE, dtype=tdt, generator=gen) for n, w in ((h, d), (hk, d),
                                                                                                  (hk, dv)))
    gqa = {"enable_gqa": True} if hk != h else {}
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views: FA-layout users' call
    if sdpa_layout == "contiguous":
        qt, kt, vt = (x.contiguous() for x in (qt, kt, vt))

    rec: dict[str, Any] = {**asdict(shape), "flops": shape.flops, "ms": {}, "tflops": {}, "errors": {},
                           "timer": None}

    def attngen_fn():
        return attngen.prefill(q, k, v, causal=causal)

    def sdpa_fn():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)

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
        out = torch.full((b, s, h, dv), float("nan"), dtype=tdt, device=q.device)
        attngen.prefill(q, k, v, causal=causal, out=out)
        torch.cuda.synchronize()
        # the kernel the call ran (a tuned winner, or the default for its length)
        kern = kernel_for(q, k, v, causal=causal)
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
    peer = (fi.attempt(rec, fi.prefill, q, k, v, causal=causal, attngen_out=out, nulls=("ms", "tflops"))
            if flashinfer else None)
    del out
    peer_out.clear()

    # Timing. The same inputs through other attngen kernels are columns of their own, not peers: the chunked
    # kernel where whole rows also run; the cp.async pipeline (its own default tiles); the serial schedule (the
    # default's tiles).
    variants = [("chunked", "prefill:head_dim_chunk=64")] if chunked_too and d <= attngen.PrefillSpec.WHOLE_MAX else []
    variants += [("sync", "prefill:pipeline=sync")] if sync_too else []
    variants += [("serial", "prefill:schedule=serial")] if serial_too else []
    variants += [(name, "prefill:" + fields) for name, fields in also]

    def sdpa_timed(name):
        def fn():
            with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend(name)):
                warnings.simplefilter("ignore")
                return core.bench_ms(sdpa_fn, warmup_ms, rep_ms, reps)
        return fn

    columns = [("attngen", lambda: core.bench_ms(attngen_fn, warmup_ms, rep_ms, reps))]
    columns += [(name, sdpa_timed(name)) for name in backends]
    columns += [(fi.NAME, lambda: core.bench_ms(peer.call, warmup_ms, rep_ms, reps))] if peer else []
    columns += [(name, lambda spec=spec: core.bench_ms(lambda: attngen.prefill(q, k, v, causal=causal, spec=spec),
                                                        warmup_ms, rep_ms, reps)) for name, spec in variants]
    # interleave: each column timed again in the reverse order and the mean of its two kept, so that every column's
    # mean place is the same (a column timed first reads faster than the same kernel timed later; keeping the
    # faster of the two would still give the first column its place)
    order = columns + columns[::-1] if interleave else columns
    times: dict[str, list[float]] = {}
    for name, timed in order:
        if name in rec["errors"] and rec["ms"].get(name) is None:
            continue
        try:
            ms, timer = timed()
        except Exception as e:
            rec["errors"][name] = _short_error(e)
            rec["ms"][name] = rec["tflops"][name] = None
            times.pop(name, None)
            continue
        times.setdefault(name, []).append(ms)
        rec["timer"] = rec["timer"] or timer
    for name, ms_list in times.items():
        ms = sum(ms_list) / len(ms_list)
        rec["ms"][name], rec["tflops"][name] = ms, tflops(shape.flops, ms)
    a = rec["tflops"].get("attngen")
    rec["ratio"] = {n: (a / rec["tflops"][n] if a and rec["tflops"].get(n) else None)
                    for n in (*backends, *(n for n, _ in variants), *([fi.NAME] if flashinfer else []))}
    return rec


# --- reporting ------------------------------------------------------------------------------------

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
            + [f"/{n}" for n in backends] + ["check"] + ([fi.DELTA_COLUMN] if fi.NAME in backends else []))


def table_row(r: dict, backends: list[str]) -> list[str]:
    tf, ratio = r.get("tflops", {}), r.get("ratio", {})
    return ([r["dtype"], dims_text(r), "yes" if r["causal"] else "no", str(r["batch"]), str(r["seqlen"]),
             heads_text(r), _fmt(tf.get("attngen"))]
            + [_fmt(tf.get(n)) for n in backends]
            + [_fmt(ratio.get(n), ".2f") for n in backends]
            + [_check_cell(r)] + ([fi.delta_cell(r)] if fi.NAME in backends else []))


_WIDTHS = {"dtype": 5, "D": 7, "causal": 6, "B": 3, "S": 6, "H": 5, "check": 12}


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
        out[n] = ratio_summary(pairs, lambda wr: {k: wr.get(k, 0) for k in ("dtype", "head_dim", "head_dim_v", "causal",
                                                                             "batch", "seqlen", "heads", "kv_heads")})
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
        lines.append(f"attngen/{n}: min {s['min']:.3f} at {at['dtype']} D={dims_text(at)} "
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
        + [f"attngen/{n}" for n in backends] + ["check (rel L2 vs flash)"] \
        + (["FlashInfer max abs diff vs attngen"] if fi.NAME in backends else [])
    lines = ["## Prefill: attngen vs PyTorch SDPA", ""]
    lines += [f"- {ln}" for ln in env_lines(env)]
    cfg = data.get("config", {})
    lines += [f"- timing: median of CUDA-event timings ({cfg.get('timer') or 'triton.do_bench'}), warm-up "
              f"{cfg.get('warmup_ms', '?')} ms, repeats {cfg.get('reps') or str(cfg.get('rep_ms', '?')) + ' ms'}; "
              f"JIT compile and module load are outside the timings",
              f"- {FLOP_NOTE}",
              f"- {cfg.get('sdpa_note') or SDPA_NOTE}",
              "- — = the backend refused that shape.",
              *([f"- {first}"] if (first := fi.first_call_line(data)) else []),
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
    plt = pyplot()
    if plt is None:
        return None
    records = data.get("results", [])
    if not records:
        return None
    backends = _impls(records, data.get("config", {}).get("backends"))
    impls = ["attngen"] + backends
    masks = sorted({r["causal"] for r in records})
    dims = sorted({(r["head_dim"], r.get("head_dim_v") or 0) for r in records})
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in records)]
    styles = {"bf16": "-", "fp16": "--"}
    colors = {"attngen": "tab:red", "flash": "tab:blue", "cudnn": "tab:green", "efficient": "tab:orange",
              "chunked": "tab:purple", "sync": "tab:brown", fi.NAME: "black"}
    fig, axes = plt.subplots(len(masks), len(dims), figsize=(4.2 * len(dims), 3.4 * len(masks)), squeeze=False,
                             sharex=True)
    for i, c in enumerate(masks):
        for j, d in enumerate(dims):
            ax = axes[i][j]
            for impl in impls:
                for dt in dtypes:
                    pts = sorted((r["seqlen"], r["tflops"].get(impl)) for r in records
                                 if r["causal"] == c and (r["head_dim"], r.get("head_dim_v") or 0) == d
                                 and r["dtype"] == dt)
                    pts = [(x, y) for x, y in pts if y]
                    if not pts:
                        continue
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles.get(dt, ":"), marker="o", ms=3,
                            color=colors.get(impl), label=f"{impl} {dt}", linewidth=2.2 if impl == "attngen" else 1.4)
            ax.set_xscale("log", base=2)
            xs = sorted({r["seqlen"] for r in records})
            ax.set_xticks(xs, [f"{x // 1024}k" if x >= 1024 and x % 1024 == 0 else str(x) for x in xs])
            ax.minorticks_off()
            ax.set_title(f"head_dim {dims_text(dict(head_dim=d[0], head_dim_v=d[1]))}, "
                         f"{'causal' if c else 'no mask'}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if i == len(masks) - 1:
                ax.set_xlabel("seqlen (shapes as listed)" if data.get("config", {}).get("explicit_shapes")
                              else "seqlen (batch = 16384 / seqlen)")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
    return _save_figure(plt, fig, axes, data, "prefill", path, bottom=0.06, dpi=130)


def _finish_prefill(data: dict, args: argparse.Namespace, print_table: bool) -> None:
    args.result = data  # what --json prints
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
    first = fi.first_call_line(data)
    if first:
        _say(first)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(prefill_markdown(data))
        _say(f"wrote {args.markdown}")
    if args.out:
        p = plot_prefill(data, Path(args.out) / "bench_prefill.png")
        if p:
            _say(f"wrote {p}")


# --- the command ----------------------------------------------------------------------------------

def cmd_prefill(args: argparse.Namespace) -> int:
    done = _replay_or_gpu_check("prefill", args, _finish_prefill)
    if done is not None:
        return done
    shapes = sweep_from_args(args)
    backends = list(args.backends) + [name for name, on in (("chunked", args.chunked_too), ("sync", args.sync_too),
                                                            ("serial", args.serial_too)) if on]
    backends += [name for name, _ in args.also]
    fi_note = fi.wanted(args)
    backends += [fi.NAME] if fi_note is None else []
    env = core.environment(gpu=True)
    timer = "cuda-events" if args.reps is not None or core._triton_do_bench() is None else "triton.do_bench"
    data: dict[str, Any] = {
        "benchmark": "prefill", "complete": False, "env": env,
        "config": {"shapes": len(shapes), "backends": backends, "warmup_ms": args.warmup_ms,
                   "rep_ms": args.rep_ms, "reps": args.reps, "timer": timer, "seed": args.seed,
                   "check": not args.no_check, "check_tolerance_rel_l2": CHECK_TOL, "tokens": args.tokens,
                   "hidden": args.hidden, "sdpa_layout": args.sdpa_layout, "interleave": args.interleave,
                   "explicit_shapes": [list(x) for x in args.shapes or ()],
                   "sdpa_note": SDPA_NOTE if args.sdpa_layout == "view" else SDPA_CONTIG_NOTE, "flops": FLOP_NOTE,
                   fi.NAME: fi.config(args)},
        "results": [],
    }
    json_path = Path(args.out) / "bench_prefill.json" if args.out else None
    for ln in env_lines(env):
        _say(ln)
    _say(f"{len(shapes)} shapes x (attngen + {', '.join(backends)}); timer {timer}, warm-up {args.warmup_ms} ms, "
         f"repeats {args.reps if args.reps is not None else str(args.rep_ms) + ' ms'}; TFLOP/s; /peer = attngen/peer")
    _say(data["config"]["sdpa_note"])
    if fi_note:
        _say(fi_note)
    if json_path is None:
        _say("(no --out: the JSON and the plot are not written)")
    _say(text_header(backends))
    t0 = time.perf_counter()
    for i, shape in enumerate(shapes):
        try:
            rec = run_shape(shape, tuple(args.backends), check=not args.no_check, warmup_ms=args.warmup_ms,
                            rep_ms=args.rep_ms, reps=args.reps, seed=args.seed + i, sdpa_layout=args.sdpa_layout,
                            chunked_too=args.chunked_too, sync_too=args.sync_too, serial_too=args.serial_too,
                            also=tuple(args.also), interleave=args.interleave, flashinfer=fi_note is None)
        except Exception as e:  # e.g. out of memory: keep the sweep going
            rec = {**asdict(shape), "flops": shape.flops, "ms": {}, "tflops": {}, "ratio": {},
                   "errors": {"shape": _short_error(e)}}
            core.release_gpu_memory()
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
