"""``attngen bench mla``: MLA decode against a bare read of the same bytes and what a user writes today.

Every shape is one decode step: ``batch`` sequences of ``seqlen`` cached tokens, ``heads`` query
heads, q_len 1, kv_lora_rank 512 + rope 64. The cache is stored as FlashMLA stores it, one
[batch, seqlen, 576] tensor whose first 512 columns are ckv (attngen reads it through two views).
Rows:
- attngen: the arch's default config; and pinned variants: ``shard`` (qk_shard=true), ``no shard``
  (qk_shard=false), ``mma_sync`` (mma=mma_sync: what sm_90a's 64-row blocks ran before wgmma; the
  default elsewhere), ``sm89 fit`` (qk_shard=false, cta_tile_kv=16, num_stages=1, mma_sync: what a
  99 KB arch gets, run on this GPU to show its cost), ``cp.async`` (pipeline=sync: the wgmma kernel
  with every thread issuing cp.async, what sm_90a ran before the TMA ring), ``alternate``
  (qk_shard=alternate: the warpgroups take alternate tiles whole; sm_90a, 64-row blocks);
- read: one kernel that streams every byte of the cache once (the ceiling);
- torch: bmm + softmax + bmm in the cache's dtype (fp32 softmax), as a model's eager code does;
- sdpa_eff: SDPA's memory-efficient backend on the same problem as MQA (K = the 576 columns,
  V = the first 512, broadcast over the heads);
- flashinfer, where it is installed: FlashInfer's MLA wrapper (fa3 on sm_90) on the same cache, read
  as pages of 64 tokens in order; its first call (JIT build) timed apart, never in a timing.
Timing: one CUDA graph of back-to-back calls over rotated copies of the cache (no L2 flush), as
``attngen bench decode --rotate``; GB/s = cache bytes / time per call.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable

from ...bench import core
from ...bench import flashinfer as fi
from ...bench.core import _fmt, _int_list, _say, _short_error, env_lines, gbps, ratio_summary, write_json

RANK, ROPE = 512, 64
BATCHES = (1, 8, 64, 128)
SEQLENS = (1024, 8192, 32768)
HEADS = (16, 128)
VARIANTS = {  # row -> spec text pinned on top of the call's own fields
    "shard": "mla_decode:qk_shard=true",
    "no shard": "mla_decode:qk_shard=false",
    "mma_sync": "mla_decode:mma=mma_sync",
    "sm89 fit": "mla_decode:qk_shard=false,cta_tile_kv=16,num_stages=1,mma=mma_sync",
    "cp.async": "mla_decode:pipeline=sync",
    "alternate": "mla_decode:qk_shard=alternate",
}
PEERS = ("read", "torch", "sdpa_eff")
MEM_MARGIN = 3 << 29
TARGETS = {"read_frac_large": 0.90, "read_frac_small_batch": 0.80, "shard_speedup": 1.15}


def add_parser(sub) -> None:
    p = sub.add_parser("mla", help="attngen.mla_decode vs a bare read, torch bmm+softmax and SDPA efficient (GB/s)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=_int_list, default=BATCHES, help="default 1,8,64,128")
    p.add_argument("--seqlens", type=_int_list, default=SEQLENS, help="default 1k,8k,32k")
    p.add_argument("--heads", type=_int_list, default=HEADS, help="query heads (default 16,128)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--no-variants", action="store_true", help="only the default attngen row")
    p.add_argument("--no-peers", action="store_true", help="only the bare read besides attngen")
    p.add_argument("--out", type=Path, default=None, help="folder for bench_mla.json and bench_mla.png")
    p.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown to FILE")
    p.add_argument("--warmup-ms", type=float, default=25.0)
    p.add_argument("--rep-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    fi.add_argument(p)
    p.add_argument("--from-json", type=Path, default=None, help="re-render from a saved bench_mla.json (no GPU)")
    p.set_defaults(func=cmd_mla)


def _rows(args) -> list[str]:
    return (["attngen"] + ([] if args.no_variants else list(VARIANTS)) + (["read"] if args.no_peers else list(PEERS))
            + ([fi.NAME] if fi.wanted(args) is None else []))


def _main_spec(launch) -> str | None:
    """The spec text of a main-entry launch (merge entries: None): what a call ran after the op's per-call
    choices, which the spec it started from does not say."""
    return None if launch.entry else launch.kernel.spec.to_text()


def run_shape(batch: int, seqlen: int, heads: int, dtype: str, rows: list[str], read, *, warmup_ms: float,
              rep_ms: float, seed: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen
    from ... import runtime
    from ..decode.bench import rotate_copies

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, 1, heads, RANK + ROPE, device="cuda", dtype=tdt, generator=g)
    kv = torch.randn(batch, seqlen, RANK + ROPE, device="cuda", dtype=tdt, generator=g)
    scale = 1.0 / math.sqrt(192)
    nbytes = kv.numel() * kv.element_size()
    lens = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    rec: dict[str, Any] = {"batch": batch, "seqlen": seqlen, "heads": heads, "bytes": nbytes, "us": {},
                           "gbps": {}, "checks": {}, "errors": {}, "specs": {}}

    # fp32 reference on the first rows only (memory); every row's output is checked against it.
    nref = min(batch, 2)
    qf, kf = q[:nref, 0].float(), kv[:nref].float()
    ref = torch.softmax(torch.einsum("bhd,bnd->bhn", qf, kf) * scale, -1) @ kf[..., :RANK]

    def attngen_call(spec):
        def make(c):
            qn, qp = q[..., :RANK], q[..., RANK:]
            return lambda: attngen.mla_decode(qn, qp, c[..., :RANK], c[..., RANK:], cache_seqlens=lens,
                                              sm_scale=scale, spec=spec)
        return make

    def torch_call(c):
        qq = q[:, 0]
        return lambda: torch.softmax(torch.bmm(qq, c.transpose(1, 2)).float() * scale, -1).to(tdt) @ c[..., :RANK]

    def sdpa_call(c):
        qq = q.transpose(1, 2)  # [b, h, 1, 576]
        k = c.unsqueeze(1).expand(batch, heads, seqlen, RANK + ROPE)
        v = c[..., :RANK].unsqueeze(1).expand(batch, heads, seqlen, RANK)

        def call():
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                return F.scaled_dot_product_attention(qq, k, v, scale=scale).transpose(1, 2)
        return call

    makers: dict[str, Callable] = {}
    for name in rows:
        if name == "attngen":
            makers[name] = attngen_call(None)
        elif name in VARIANTS:
            makers[name] = attngen_call(VARIANTS[name])
        elif name == "torch":
            makers[name] = torch_call
        elif name == "sdpa_eff":
            makers[name] = sdpa_call
        elif name == "read":
            makers[name] = lambda c: (lambda: read(c, c[:0]))
    if fi.NAME in rows:  # planned and run once here, on attngen's output, before any check or timing
        try:
            ag = attngen_call(None)(kv)()
        except Exception:   # attngen's own error is the check's to record, below
            ag = None
        peer = fi.attempt(rec, fi.mla, q[:, 0, :, :RANK], q[:, 0, :, RANK:], kv, lens, rank=RANK, sm_scale=scale,
                          attngen_out=ag)
        del ag
        if peer:
            makers[fi.NAME] = lambda c, call=peer.call: (lambda: call(kv=c))
    # Check every row that produces an output once, on copy 0.
    for name, make in list(makers.items()):
        if name == "read":
            continue
        try:
            with warnings.catch_warnings(), runtime.recorded_launches(_main_spec) as ran:
                warnings.simplefilter("ignore")
                o = make(kv)()
            torch.cuda.synchronize()
            o = o[:nref].reshape(nref, heads, RANK).float()
            err = (torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref)).item()
            rec["checks"][name] = {"rel_l2": err, "ok": bool(err < core.CHECK_TOL)}
            if ran:  # the kernel the call launched, after the op's per-call choices
                rec["specs"][name] = ran[-1]
        except Exception as e:
            rec["errors"][name] = _short_error(e)
            makers.pop(name)
            torch.cuda.synchronize()
    del ref
    copies = [kv] + [kv.clone() for _ in range(rotate_copies(nbytes, torch.cuda.mem_get_info()[0]) - 1)]
    rec["copies"] = len(copies)
    for name, make in makers.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                replay = core._graphed(*(make(c) for c in copies))
                ms = core._event_bench(replay, warmup_ms, rep_ms, None, flush=False) / len(copies)
            rec["us"][name] = 1e3 * ms
            rec["gbps"][name] = gbps(nbytes, ms)
        except Exception as e:
            rec["errors"][name] = _short_error(e)
            torch.cuda.synchronize()
    us = rec["us"]
    if us.get(fi.NAME) and us.get("attngen"):
        rec["ratio"] = {fi.NAME: us[fi.NAME] / us["attngen"]}   # > 1: attngen faster
    return rec


def _table(data: dict) -> list[str]:
    rows = data["config"]["rows"]
    with_fi = fi.NAME in rows   # runs from before the FlashInfer column have neither of its columns
    head = ("| batch | seqlen | heads | MB | " + " | ".join(f"{r} GB/s" for r in rows) + " | attngen / read |"
            + (f" attngen / flashinfer | {fi.DELTA_COLUMN} |" if with_fi else ""))
    out = [head, "|" + "---|" * (5 + len(rows) + 2 * with_fi)]
    for r in data["results"]:
        g = r.get("gbps", {})
        frac = g.get("attngen") / g["read"] if g.get("attngen") and g.get("read") else None
        out.append(f"| {r['batch']} | {r['seqlen']} | {r['heads']} | {r['bytes'] / 1e6:.0f} | "
                   + " | ".join(_fmt(g.get(n), ".0f") for n in rows) + f" | {_fmt(frac, '.2f')} |"
                   + (f" {_fmt((r.get('ratio') or {}).get(fi.NAME), '.2f')} | {fi.delta_cell(r)} |" if with_fi else ""))
    return out


def summary(data: dict) -> dict:
    res = [r for r in data["results"] if r.get("gbps")]

    def frac(r, name="attngen"):
        g = r["gbps"]
        return g.get(name) / g["read"] if g.get(name) and g.get("read") else None

    large = [frac(r) for r in res if r["batch"] >= 64 and r["seqlen"] >= 1024 and frac(r)]
    small = [frac(r) for r in res if r["batch"] <= 8 and r["seqlen"] >= 8192 and frac(r)]
    shard = [r["gbps"]["shard"] / r["gbps"]["no shard"] for r in res
             if r["gbps"].get("shard") and r["gbps"].get("no shard")]
    fails = [f"b={r['batch']} L={r['seqlen']} h={r['heads']} {n}" for r in data["results"]
             for n, c in r.get("checks", {}).items() if not c["ok"]]
    out = {"read_frac_large_min": min(large, default=None), "read_frac_small_batch_min": min(small, default=None),
           "shard_over_no_shard": [min(shard, default=None), max(shard, default=None)],
           "failed_checks": [f for f in fails if not f.endswith(" " + fi.NAME)]}
    ratios = [(r["ratio"][fi.NAME], r) for r in res if (r.get("ratio") or {}).get(fi.NAME)]
    if ratios:  # FlashInfer's time / attngen's: the summary `attngen bench record` turns into a row
        out["ratio"] = {fi.NAME: ratio_summary(ratios, lambda wr: {k: wr[k] for k in ("batch", "seqlen", "heads")})}
        out["flashinfer_failed_checks"] = [f for f in fails if f.endswith(" " + fi.NAME)]
    return out


def _plot(data: dict, path: Path) -> Path | None:
    plt = core.pyplot()
    if plt is None:
        return None
    heads = sorted({r["heads"] for r in data["results"]})
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.2), squeeze=False)
    for ax, h in zip(axes[0], heads):
        res = [r for r in data["results"] if r["heads"] == h and r.get("gbps")]
        labels = [f"b{r['batch']}\nL{r['seqlen'] // 1024}k" for r in res]
        for name in data["config"]["rows"]:
            ax.plot(range(len(res)), [r["gbps"].get(name) or float("nan") for r in res], marker="o", label=name,
                    linestyle="--" if name in PEERS else "-")
        ax.set_xticks(range(len(res)), labels, fontsize=7)
        ax.set_title(f"{h} query heads, one 576-wide cache")
        ax.set_ylabel("GB/s of cache read")
        ax.grid(alpha=0.3)
    return core._save_figure(plt, fig, axes, data, "mla_decode", path, bottom=0.1, dpi=110)


def _finish(data: dict, args, print_table: bool) -> None:
    table = _table(data)
    if print_table:
        for ln in table:
            _say(ln)
    s = data.get("summary") or summary(data)
    _say(f"attngen / read: min {_fmt(s['read_frac_large_min'], '.2f')} at batch >= 64 (target "
         f"{TARGETS['read_frac_large']}), min {_fmt(s['read_frac_small_batch_min'], '.2f')} at batch <= 8, seqlen >= 8k "
         f"(target {TARGETS['read_frac_small_batch']}); shard / no shard {_fmt(s['shard_over_no_shard'][0], '.2f')}-"
         f"{_fmt(s['shard_over_no_shard'][1], '.2f')}; failed checks: {len(s['failed_checks'])}")
    x = (s.get("ratio") or {}).get(fi.NAME)
    if x:
        at = " ".join(f"{k}={v}" for k, v in x["min_at"].items())
        _say(f"attngen / flashinfer (its time / attngen's): min {x['min']:.2f} at {at}, geomean {x['geomean']:.2f} "
             f"over {x['shapes']} shapes; FlashInfer's failed checks: {len(s.get('flashinfer_failed_checks', []))}")
    first = fi.first_call_line(data)
    if first:
        _say(first)
    if args.markdown:
        env = data["env"]
        md = [f"GPU: {env.get('gpu')}; {env.get('date', '')[:10]}; torch {env.get('torch')}; NVRTC {env.get('nvrtc')}; "
              f"attngen {env.get('attngen_commit')} (source {env.get('attngen_source')}); {data['config']['timer']}", ""] + table
        md += ["", first] if first else []
        Path(args.markdown).write_text("\n".join(md) + "\n")
    if args.out:
        p = _plot(data, Path(args.out) / "bench_mla.png")
        if p:
            _say(f"wrote {p}")
    args.result = data


def cmd_mla(args: argparse.Namespace) -> int:
    done = core._replay_or_gpu_check("mla", args, _finish)
    if done is not None:
        return done
    import torch

    rows = _rows(args)
    env = core.environment(gpu=True)
    data: dict[str, Any] = {
        "benchmark": "mla", "complete": False, "env": env,
        "config": {"rows": rows, "dtype": args.dtype, "rank": RANK, "rope": ROPE, "q_len": 1,
                   "variants": VARIANTS, "targets": TARGETS, fi.NAME: fi.config(args),
                   "timer": "cuda-events, no flush, CUDA-graph replays over rotated cache copies; us per call"},
        "results": [],
    }
    for ln in env_lines(env):
        _say(ln)
    note = fi.wanted(args)
    if note:
        _say(note)
    read = core.stream_reader()
    t0 = time.perf_counter()
    shapes = [(h, b, n) for h in args.heads for b in args.batches for n in args.seqlens]
    for i, (h, b, n) in enumerate(shapes):
        need = 2 * b * n * (RANK + ROPE) * 2 + MEM_MARGIN
        torch.cuda.empty_cache()
        if need > torch.cuda.mem_get_info()[0]:
            rec = {"batch": b, "seqlen": n, "heads": h, "bytes": b * n * (RANK + ROPE) * 2, "skipped": "memory"}
        else:
            try:
                rec = run_shape(b, n, h, args.dtype, rows, read, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                                seed=args.seed + i)
            except Exception as e:
                rec = {"batch": b, "seqlen": n, "heads": h, "bytes": b * n * (RANK + ROPE) * 2,
                       "errors": {"shape": _short_error(e)}}
            core.release_gpu_memory()
        data["results"].append(rec)
        g = rec.get("gbps", {})
        _say(f"b={b} L={n} h={h}: " + "  ".join(f"{k} {v:.0f}" for k, v in g.items() if v)
             + ("  errors: " + json.dumps(rec["errors"]) if rec.get("errors") else ""))
        if args.out:
            write_json(Path(args.out) / "bench_mla.json", data)
    data["complete"] = True
    data["elapsed_s"] = round(time.perf_counter() - t0, 1)
    data["summary"] = summary(data)
    if args.out:
        write_json(Path(args.out) / "bench_mla.json", data)
    _finish(data, args, print_table=True)
    return 1 if data["summary"]["failed_checks"] else 0

