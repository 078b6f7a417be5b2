"""``attngen bench prefill-fp8``: attngen.prefill with fp8 (e4m3) q, k and v against the same call in bf16, cuDNN's
SDPA in bf16 and FlashInfer's fp8 prefill (where flashinfer imports), on the same values in one run.

Each shape draws bf16 q, k, v, quantises them to e4m3 under one descale a KV head (amax / 448, as a model's
per-head quantisation does; FlashInfer's scales are per head, so both take the same values), and gives the bf16
columns the dequantised tensors: every column computes the same attention. The fp8 call's output is checked
against attngen's bf16 output before any timing (NaN never passes; a relative L2 over FP8_TOL fails the shape), and
FlashInfer's against attngen's fp8 output. Timing as ``attngen bench prefill``: CUDA events, warm-up, median. The
fp8 time is one ``attngen.prefill`` call: V's transpose into the kernel's scratch is inside it.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from ...bench import core
from ...bench import flashinfer as fi
from ...bench.core import (_CAUSAL, _fmt, _int_list, _rel_check, _replay_or_gpu_check, _say, _short_error,
                           attention_flops, env_lines, ratio_summary, tflops, write_json)
WARMUP_MS = 300.0  # warm-up per column, as `attngen bench prefill` takes it

# batch x seqlen, and heads / kv_heads, every pair run at each head dim and mask
SHAPES = ((1, 4096), (1, 8192), (1, 16384), (8, 2048))
HEADS = ((32, 8), (16, 16))
HEAD_DIMS = (128, 256)
E4M3_MAX = 448.0
FP8_TOL = 0.06  # rel L2 of fp8 against bf16 output: P is rounded to e4m3 for P V (tests/test_gpu_prefill_fp8.py)
COLUMNS = ("fp8", "bf16", "cudnn", fi.NAME)  # timed; ratios are fp8 over each of the others
FLOP_NOTE = "FLOPs = 4*B*H*S*S*D, halved for causal (FlashAttention's convention)."
JSON_NAME = "bench_prefill_fp8.json"


def _pairs(text: str, what: str) -> tuple[tuple[int, int], ...]:
    """``1x4096,8x2048`` (BATCHxSEQLEN) or ``32/8,16/16`` (HEADS/KV_HEADS) as int pairs."""
    sep = "x" if what == "shapes" else "/"
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            a, b = (int(x) for x in part.lower().split(sep))
        except ValueError:
            form = "BATCHxSEQLEN (e.g. 1x4096)" if what == "shapes" else "HEADS/KV_HEADS (e.g. 32/8)"
            raise argparse.ArgumentTypeError(f"{part!r} is not {form}") from None
        if min(a, b) < 1 or (what == "heads" and a % b):
            raise argparse.ArgumentTypeError(f"{part!r}: both must be >= 1" + (", and kv_heads must divide heads"
                                                                               if what == "heads" else ""))
        out.append((a, b))
    return tuple(out)


def add_parser(sub) -> None:
    p = sub.add_parser("prefill-fp8", help="attngen.prefill with fp8 q/k/v vs bf16, cuDNN and FlashInfer fp8",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=lambda t: _pairs(t, "shapes"), default=SHAPES, metavar="BxS,...",
                   help="batch x seqlen (default 1x4096,1x8192,1x16384,8x2048)")
    p.add_argument("--heads", type=lambda t: _pairs(t, "heads"), default=HEADS, metavar="H/HKV,...",
                   help="heads / kv_heads (default 32/8,16/16)")
    p.add_argument("--head-dims", type=_int_list, default=HEAD_DIMS,
                   help="128 and/or 256, the head dims fp8 prefill runs (default both)")
    p.add_argument("--causal", choices=sorted(_CAUSAL), default="both", help="masks to run (default both)")
    p.add_argument("--no-cudnn", action="store_true", help="leave out SDPA's cuDNN backend (bf16)")
    p.add_argument("--warmup-ms", type=float, default=WARMUP_MS, help=f"warm-up per column (ms, default {WARMUP_MS:g})")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms, default 100)")
    p.add_argument("--reps", type=int, default=None, help="a fixed number of timed repeats instead of --rep-ms")
    p.add_argument("--out", type=Path, default=None, help=f"folder for {JSON_NAME}")
    p.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown to FILE")
    p.add_argument("--seed", type=int, default=0)
    fi.add_argument(p)
    p.add_argument("--from-json", type=Path, default=None, help=f"re-render a saved {JSON_NAME} (no GPU)")
    p.set_defaults(func=run_fp8)


def sweep(args) -> list[dict]:
    """The shapes in the order they run: head dim, mask, heads, batch x seqlen."""
    return [dict(head_dim=d, causal=c, heads=h, kv_heads=hk, batch=b, seqlen=s)
            for d in args.head_dims for c in _CAUSAL[args.causal] for h, hk in args.heads for b, s in args.shapes]


# --- measuring ----------------------------------------------------------------------------------------------------

def quantised(torch, x, group: int):
    """``x`` [B, S, H, D] -> (e4m3 tensor, fp32 descale [H // group] one a KV head (amax / 448), the dequantised
    bf16 tensor)."""
    b, s, h, d = x.shape
    amax = x.float().abs().reshape(b, s, h // group, group, d).amax(dim=(0, 1, 3, 4))
    descale = (amax / E4M3_MAX).clamp_min(1e-12)
    per_head = descale.repeat_interleave(group)[None, None, :, None]
    x8 = (x.float() / per_head).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, descale, (x8.float() * per_head).to(torch.bfloat16)


def run_shape(shape: dict, args, *, seed: int, flashinfer: bool) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen

    b, s, h, hk, d, causal = (shape[k] for k in ("batch", "seqlen", "heads", "kv_heads", "head_dim", "causal"))
    group = h // hk
    flops = attention_flops(b, h, s, s, d, causal)
    rec: dict[str, Any] = {**shape, "flops": flops, "ms": {}, "tflops": {}, "ratio": {}, "errors": {}, "check": {}}
    gen = torch.Generator(device=core.DEVICE).manual_seed(seed)
    raw = [torch.randn(b, s, n, d, device=core.DEVICE, dtype=torch.bfloat16, generator=gen) for n in (h, hk, hk)]
    (q8, qs, qd), (k8, ks, kd), (v8, vs, vd) = (quantised(torch, x, g) for x, g in zip(raw, (group, 1, 1)))
    del raw
    scales = dict(q_descale=qs, k_descale=ks, v_descale=vs)  # [kv_heads]: q's indexed by its query head's KV head

    def fp8_fn():
        return attngen.prefill(q8, k8, v8, causal=causal, **scales)

    def bf16_fn():
        return attngen.prefill(qd, kd, vd, causal=causal)

    qt, kt, vt = (x.transpose(1, 2) for x in (qd, kd, vd))
    gqa = {"enable_gqa": True} if group > 1 else {}

    def cudnn_fn():
        with warnings.catch_warnings(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            warnings.simplefilter("ignore")
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)

    # the check, before any timing: fp8 into a NaN-poisoned out, against the bf16 call on the dequantised values
    fp8_out = None
    try:
        fp8_out = torch.full((b, s, h, d), float("nan"), dtype=torch.bfloat16, device=core.DEVICE)
        attngen.prefill(q8, k8, v8, causal=causal, out=fp8_out, **scales)
        ref = bf16_fn()
        torch.cuda.synchronize()
        chk = _rel_check(fp8_out, ref.float())
        chk.update(reference="attngen bf16 on the dequantised inputs", tolerance_rel_l2=FP8_TOL,
                   ok=bool(chk["nan_count"] == 0 and chk["rel_l2"] <= FP8_TOL))
        rec["check"]["fp8"] = chk
        del ref
    except Exception as e:
        rec["errors"]["fp8"] = _short_error(e)
        fp8_out = None
    columns = [("fp8", fp8_fn), ("bf16", bf16_fn)]
    if not args.no_cudnn:
        columns.append(("cudnn", cudnn_fn))
    if flashinfer:
        peer = fi.attempt(rec, fi.prefill_fp8, q8, k8, v8, qs.repeat_interleave(group), ks, vs, causal=causal,
                          out_dtype=torch.bfloat16, attngen_out=fp8_out, nulls=("ms", "tflops"))
        if peer is not None:
            columns.append((fi.NAME, peer.call))
            c = rec[fi.NAME].get("vs_attngen")
            if c:  # two fp8 kernels, each within FP8_TOL of the exact result
                rec["check"][fi.NAME] = {**c, "tolerance_rel_l2": 2 * FP8_TOL,
                                         "ok": bool(not c["nan_count"] and c["rel_l2"] <= 2 * FP8_TOL)}
    del fp8_out
    for name, fn in columns:
        if name in rec["errors"]:
            rec["ms"][name] = rec["tflops"][name] = None
            continue
        try:
            ms, timer = core.bench_ms(fn, args.warmup_ms, args.rep_ms, args.reps)
        except Exception as e:  # a backend that refuses the shape: a null column
            rec["errors"][name] = _short_error(e)
            rec["ms"][name] = rec["tflops"][name] = None
            torch.cuda.synchronize()
            continue
        rec["ms"][name], rec["tflops"][name] = ms, tflops(flops, ms)
        rec["timer"] = timer
    a = rec["tflops"].get("fp8")
    rec["ratio"] = {n: (a / rec["tflops"][n] if a and rec["tflops"].get(n) else None) for n in COLUMNS[1:]
                    if n in rec["tflops"]}
    return rec


# --- reporting ----------------------------------------------------------------------------------------------------

def _columns(records: list[dict]) -> list[str]:
    """The timed columns some record has, in COLUMNS' order."""
    return [n for n in COLUMNS if any(n in r.get("tflops", {}) for r in records)]


def table_header(cols: list[str]) -> list[str]:
    return (["D", "causal", "B", "S", "H"] + [f"{n} TFLOP/s" for n in cols]
            + [f"fp8/{n}" for n in cols if n != "fp8"] + ["check"])


def _check_cell(r: dict) -> str:
    c = r.get("check", {}).get("fp8")
    if not c:
        return "—" if "fp8" not in r.get("errors", {}) else "FAIL (error)"
    if c.get("nan_count"):
        return f"FAIL {c['nan_count']} NaN"
    return f"{c['rel_l2']:.1e}" + ("" if c.get("ok") else " FAIL")


def table_row(r: dict, cols: list[str]) -> list[str]:
    heads = f"{r['heads']}/{r['kv_heads']}" if r["kv_heads"] != r["heads"] else str(r["heads"])
    return ([str(r["head_dim"]), "yes" if r["causal"] else "no", str(r["batch"]), str(r["seqlen"]), heads]
            + [_fmt(r["tflops"].get(n)) for n in cols]
            + [_fmt(r.get("ratio", {}).get(n), ".2f") for n in cols if n != "fp8"] + [_check_cell(r)])


def summarize(records: list[dict]) -> dict:
    where = lambda r: {k: r[k] for k in ("head_dim", "causal", "batch", "seqlen", "heads", "kv_heads")}  # noqa: E731
    # (by the peer's name, as each record's ratios: `attngen bench record` counts the shapes at or above 1 from them)
    out: dict[str, Any] = {"ratio": {}}
    for n in COLUMNS[1:]:
        s = ratio_summary([(r["ratio"][n], r) for r in records if r.get("ratio", {}).get(n)], where)
        if s:
            out["ratio"][n] = s
    checks = [c for r in records for c in r.get("check", {}).values()]
    out["checks"] = {"run": len(checks), "failed": sum(1 for c in checks if not c.get("ok")),
                     "max_rel_l2": max((c["rel_l2"] for c in checks if isinstance(c.get("rel_l2"), float)),
                                       default=None)}
    return out


def summary_lines(summary: dict) -> list[str]:
    lines = [f"fp8/{k}: min {v['min']:.3f} at {v['min_at']}; geomean {v['geomean']:.3f} over {v['shapes']} shapes"
             for k, v in (summary.get("ratio") or {}).items()]
    c = summary.get("checks") or {}
    if c.get("run"):
        lines.append(f"checks: {c['run']} run, {c['failed']} failed, max rel L2 {_fmt(c.get('max_rel_l2'), '.1e')}")
    return lines


def fp8_markdown(data: dict) -> str:
    records = data.get("results", [])
    cols = _columns(records)
    head = table_header(cols)
    lines = ["## Prefill, fp8 (e4m3) q/k/v: attngen vs bf16, cuDNN and FlashInfer", ""]
    lines += [f"- {ln}" for ln in env_lines(data.get("env", {}))]
    lines += [f"- {FLOP_NOTE}", "- fp8: one attngen.prefill call (V's transpose pre-pass included); bf16 and cuDNN "
              "run on the dequantised inputs; check: rel L2 of fp8 against attngen bf16.", "- — = refused or absent.",
              ""]
    if not data.get("complete", True):
        lines += ["**Partial run**: the sweep did not finish.", ""]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" if i < 2 else "---:" for i in range(len(head))) + "|")
    lines += ["| " + " | ".join(table_row(r, cols)) + " |" for r in records]
    lines += [""] + [f"- {ln}" for ln in summary_lines(data.get("summary") or summarize(records))]
    return "\n".join(lines) + "\n"


def _text(cells: list[str]) -> str:
    return "  ".join(c.rjust(max(6, len(c))) for c in cells)


def _finish(data: dict, args, print_table: bool) -> None:
    args.result = data
    records = data.get("results", [])
    cols = _columns(records)
    if print_table:
        for ln in env_lines(data.get("env", {})):
            _say(ln)
        _say(_text(table_header(cols)))
        for r in records:
            _say(_text(table_row(r, cols)))
    _say("")
    for ln in summary_lines(data.get("summary") or summarize(records)):
        _say(ln)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(fp8_markdown(data))
        _say(f"wrote {args.markdown}")


def run_fp8(args: argparse.Namespace) -> int:
    """The command: every shape checked, then timed; rows stream to stdout and the JSON is rewritten after each."""
    done = _replay_or_gpu_check("prefill-fp8", args, _finish)
    if done is not None:
        return done
    shapes = sweep(args)
    fi_note = fi.wanted(args)
    env = core.environment(gpu=True)
    data: dict[str, Any] = {
        "benchmark": "prefill-fp8", "complete": False, "env": env,
        "config": {"shapes": len(shapes), "warmup_ms": args.warmup_ms, "rep_ms": args.rep_ms, "reps": args.reps,
                   "seed": args.seed, "cudnn": not args.no_cudnn, "fp8_tolerance_rel_l2": FP8_TOL,
                   "descales": "one a KV head (amax / 448)", "flops": FLOP_NOTE, fi.NAME: fi.config(args)},
        "results": [],
    }
    json_path = Path(args.out) / JSON_NAME if args.out else None
    for ln in env_lines(env):
        _say(ln)
    _say(f"{len(shapes)} shapes; TFLOP/s; fp8/x = attngen fp8 over x. {FLOP_NOTE}")
    if fi_note:
        _say(fi_note)
    cols = [n for n in COLUMNS if (n != "cudnn" or not args.no_cudnn) and (n != fi.NAME or fi_note is None)]
    _say(_text(table_header(cols)))
    t0 = time.perf_counter()
    for i, shape in enumerate(shapes):
        try:
            rec = run_shape(shape, args, seed=args.seed + i, flashinfer=fi_note is None)
        except Exception as e:  # out of memory, say: keep the sweep going
            rec = {**shape, "flops": attention_flops(shape["batch"], shape["heads"], shape["seqlen"], shape["seqlen"],
                                                     shape["head_dim"], shape["causal"]),
                   "ms": {}, "tflops": {}, "ratio": {}, "check": {}, "errors": {"shape": _short_error(e)}}
            core.release_gpu_memory()
        data["results"].append(rec)
        _say(_text(table_row(rec, cols)))
        for n, err in rec["errors"].items():
            _say(f"    {n}: {err}")
        if json_path:
            data["elapsed_s"] = round(time.perf_counter() - t0, 1)
            write_json(json_path, data)
    data["complete"] = True
    data["elapsed_s"] = round(time.perf_counter() - t0, 1)
    data["summary"] = summarize(data["results"])
    if json_path:
        write_json(json_path, data)
        _say(f"wrote {json_path}")
    _finish(data, args, print_table=False)
    failed = [r for r in data["results"] if "fp8" in r["errors"] or "shape" in r["errors"]
              or not r["check"].get("fp8", {}).get("ok", False)]
    if failed:
        _say(f"{len(failed)} shape(s) failed the fp8 check or did not run it", file=sys.stderr)
        return 1
    return 0
