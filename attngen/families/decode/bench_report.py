"""``attngen bench decode``'s report: the records of a run (live or ``--from-json``) as the text
table, the summary against the targets, Markdown for BENCHMARKS.md and the plot.

Reads only records, so a saved run re-renders without torch or a GPU.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from attngen.bench import flashinfer as fi
from attngen.bench.core import _fmt, _save_figure, _say, env_lines, pyplot, ratio_summary

ITEMSIZE = {"bf16": 2, "fp16": 2}
TARGET_COPY_FRAC = 0.90          # of the copy bandwidth, for batch >= 16 and kv_len >= 4k
TARGET_B1_CUDNN = 1.3            # batch 1 at kv_len 32k: cuDNN's time / attngen's
TARGET_FLASH = 1.0               # every shape: flash's time / attngen's
TARGET_PAGED = 0.95              # a paged row, every shape: its contiguous row's time / its own
TARGET_READ = 0.90               # --rotate, every shape: the bare read's time / attngen's (%read)
# --rotate: K/V copies walked per graph replay add up to at least this, four H100 L2s (50 MB each), so that
# when a copy comes round again the copies read since have pushed it out of L2: every call reads from DRAM.
ROTATE_BYTES = 4 * 50 * 2**20
BYTES_NOTE = ("GB/s = K + V bytes read (sum over the batch of L x kv_heads x head_dim x 2 x itemsize) / time, "
              "GB = 1e9 bytes; %copy = that over the device-to-device copy bandwidth measured in the same run "
              "(dst.copy_(src) of a 1 GiB buffer, bytes read + written / median time)")
RATIO_NOTE = "vs <peer> = peer time / attngen time (> 1: attngen faster)"
READ_NOTE = ("%read (rotated runs only) = the bare read's time / the row's time: one kernel loading the same K/V bytes once "
             "with 16-byte loads over the whole GPU, timed in the same rotated graph")
DECODE_SDPA_NOTE = ("SDPA gets q as [B, H, q_len, D] and K/V as [B, Hkv, L, D] .transpose(1, 2) views of the "
                    "dense cache attngen reads, with enable_gqa=True; q_len > 1 uses a bottom-right causal mask "
                    "(the first call form the backend accepts that matches the reference)")
DECODE_SDPA_CONTIG_NOTE = ("SDPA gets contiguous [B, Hkv, L, D] copies of the cache (--sdpa-layout contiguous) "
                           "and q as a [B, H, q_len, D] view, with enable_gqa=True")


# --- the shape record -----------------------------------------------------------------------------

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


def decode_peers(data: dict) -> list[str]:
    """The peer columns of a run: SDPA's backends, then FlashInfer where the run had it."""
    records = data.get("results", [])
    peers = _decode_backends(records, data.get("config", {}).get("backends"))
    return peers + ([fi.NAME] if fi.present(data) and fi.NAME not in peers else [])


# --- the table ------------------------------------------------------------------------------------

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
    delta = f"; {fi.DELTA_COLUMN} {fi.delta_cell(r)}" if name == fi.NAME else ""
    return f"{rel:.1e}" + ("" if c.get("ok") else " FAIL") + delta


def _fmt_gbps(x: float | None) -> str:
    return _fmt(x, ".0f" if x is not None and x >= 100 else ".1f")


def decode_columns(backends: list[str]) -> list[str]:
    return ["shape", "impl", "ms", "GB/s", "%copy", "%read"] + [f"vs {p}" for p in backends] + ["check"]


def decode_rows(r: dict, backends: list[str]) -> list[list[str]]:
    """The table rows of one shape: attngen's rows, then each peer's; the shape named on the first."""
    label = _decode_shape_of(r).label()
    if r.get("skipped"):
        return [[label, "(skipped)", "—", "—", "—", "—"] + ["—"] * len(backends) + [r["skipped"][:60]]]
    rows = []
    for name in list(r.get("impls", [])) + list(backends):
        ms = r.get("ms", {}).get(name)
        frac = r.get("frac_copy", {}).get(name)
        read = _frac_read(r, name)
        ratio = r.get("ratio", {}).get(name) or {}
        shown = name if name in r.get("impls", []) or name == fi.NAME else f"sdpa-{name}"
        cells = [label if not rows else "", shown,
                 _fmt(ms, ".4f"), _fmt_gbps(r.get("gbps", {}).get(name)),
                 _fmt(frac * 100 if frac is not None else None, ".1f"),
                 _fmt(read * 100 if read is not None else None, ".1f")]
        cells += [_fmt(ratio.get(p), ".2f") for p in backends]
        cells.append(_decode_check_cell(r, name))
        rows.append(cells)
    return rows


_DECODE_WIDTHS = {"shape": 36, "impl": 22, "ms": 8, "GB/s": 6, "%copy": 6, "%read": 6, "check": 12}


def _frac_read(r: dict, name: str) -> float | None:
    """The bare read's time over ``name``'s on this shape (--rotate runs time the read), else None."""
    read, ms = r.get("read_ms"), (r.get("ms") or {}).get(name)
    return read / ms if read and ms else None


def _dw(col: str) -> int:
    return _DECODE_WIDTHS.get(col, max(8, len(col)))


def decode_text_header(backends: list[str]) -> str:
    cols = decode_columns(backends)
    return "  ".join(c.ljust(_dw(c)) if c in ("shape", "impl") else c.rjust(_dw(c)) for c in cols)


def decode_text_rows(r: dict, backends: list[str]) -> list[str]:
    cols = decode_columns(backends)
    return ["  ".join(v.ljust(_dw(c)) if c in ("shape", "impl") else v.rjust(_dw(c)) for c, v in zip(cols, row))
            for row in decode_rows(r, backends)]


# --- the summary ----------------------------------------------------------------------------------

def _target(name: str, values: list[tuple[float, dict]], target: float, what: str) -> dict:
    """Worst value over the shapes it applies to, against a target it must reach (>=)."""
    if not values:
        return {"target": name, "what": what, "threshold": target, "verdict": "not measured", "worst": None,
                "worst_at": None, "shapes": 0}
    worst, wr = min(values, key=lambda p: p[0])
    return {"target": name, "what": what, "threshold": target, "verdict": "met" if worst >= target else "MISSED",
            "worst": worst, "worst_at": _decode_shape_of(wr).label(), "shapes": len(values)}


def decode_summary(records: list[dict], backends: list[str]) -> dict:
    """Per attngen row: ratios to each peer (min, geomean) and the three targets (a paged row: four,
    the fourth against its contiguous row); the checks."""
    ran = [r for r in records if not r.get("skipped")]
    out: dict[str, Any] = {"impls": {}}
    for name in _decode_impls(ran):
        s: dict[str, Any] = {"ratio": {}}
        for p in backends:
            pairs = [(r["ratio"][name][p], r) for r in ran if (r.get("ratio", {}).get(name) or {}).get(p)]
            s["ratio"][p] = ratio_summary(pairs, lambda wr: _decode_shape_of(wr).label())
        fr = [(r["frac_copy"][name], r) for r in ran
              if r["batch"] >= 16 and r["kv_len"] >= 4096 and r.get("frac_copy", {}).get(name) is not None]
        b1 = [(r["ratio"][name]["cudnn"], r) for r in ran if r["batch"] == 1 and r["kv_len"] == 32768
              and (r.get("ratio", {}).get(name) or {}).get("cudnn")]
        fl = [(r["ratio"][name]["flash"], r) for r in ran if (r.get("ratio", {}).get(name) or {}).get("flash")]
        rd = [(x, r) for r in ran for x in (_frac_read(r, name),) if x is not None]
        s["targets"] = [
            _target("copy", fr, TARGET_COPY_FRAC, f">= {TARGET_COPY_FRAC:.0%} of copy bandwidth at batch >= 16, "
                                                  "kv_len >= 4k"),
            _target("cudnn_b1_32k", b1, TARGET_B1_CUDNN, f">= {TARGET_B1_CUDNN}x SDPA cuDNN at batch 1, kv_len 32k"),
            _target("flash", fl, TARGET_FLASH, "never slower than SDPA flash (flash time / attngen time >= 1)"),
        ]
        if rd:
            s["targets"].append(_target("read", rd, TARGET_READ, f">= {TARGET_READ:.0%} of the bare read's speed "
                                                                 "on every shape (read time / attngen time)"))
        if name.endswith("-paged"):
            base = name[:-len("-paged")]
            pg = [(r["ms"][base] / r["ms"][name], r) for r in ran if (r.get("ms") or {}).get(name)
                  and (r.get("ms") or {}).get(base)]
            s["targets"].append(_target("paged", pg, TARGET_PAGED, f"within {TARGET_PAGED}x of {base} ({base} time "
                                                                    f"/ paged time >= {TARGET_PAGED})"))
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
                w = f"{t['worst']:.1%}" if t["target"] in ("copy", "read") else f"{t['worst']:.2f}x"
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


# --- Markdown, plot, and the end of a run ---------------------------------------------------------

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
    backends = decode_peers(data)
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
              *([f"- {READ_NOTE}"] if cfg.get("rotate") else []),
              f"- {cfg.get('sdpa_note') or DECODE_SDPA_NOTE}",
              *([f"- {rotate_note(records)}"] if cfg.get("rotate") else
                ["- timed on CUDA-graph replays (each call captured once, attngen and SDPA alike): GPU time, "
                 "no Python launch path"] if cfg.get("graph") else []),
              "- check = rel L2 vs an fp32 reference on the first call, output poisoned with NaN; — = the backend "
              "refused that shape",
              *([f"- flashinfer: FlashInfer's tensor-core paged decode on the paged copy (page = block size "
                 f"{cfg.get('block_size')}); {fi.DELTA_COLUMN} = its max abs difference from attngen's output"]
                if fi.NAME in backends else []),
              *([f"- {first}"] if (first := fi.first_call_line(data)) else []),
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
    plt = pyplot()
    if plt is None:
        return None
    records = [r for r in data.get("results", []) if not r.get("skipped")]
    if not records:
        return None
    backends = decode_peers(data)
    impls = _decode_impls(records) + backends
    groups = sorted({(r["heads"], r["kv_heads"], r["q_len"], r["head_dim"]) for r in records})
    batches = sorted({r["batch"] for r in records})
    colors = {"flash": "tab:blue", "cudnn": "tab:green", "efficient": "tab:orange", fi.NAME: "black"}
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
    args.result = data  # what --json prints
    records = data.get("results", [])
    backends = decode_peers(data)
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
    first = fi.first_call_line(data)
    if first:
        _say(first)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(decode_markdown(data))
        _say(f"wrote {args.markdown}")
    if args.out:
        p = plot_decode(data, Path(args.out) / "bench_decode.png")
        if p:
            _say(f"wrote {p}")
