"""``attngen bench report`` and ``attngen bench record``: BENCHMARKS.md from small JSON files.

The results live in ``benchmarks/<gpu>/<family>.json`` (one file per GPU and family, each a list of
sections: what was measured, at which commit, with which versions and command, a table and a few
notes) and ``benchmarks/levers.json`` (the levers tried and not kept, one row each). ``report``
renders them into one Markdown page, the same bytes for the same files; ``report --check`` says
whether a page is what the files render. ``record`` turns the JSON a benchmark writes (``--out``)
into a section of such a file, so a new run replaces the numbers it measured.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from . import flashinfer

FORMAT = 1
# Families first in the order the README lists them; anything else (jit, host) after, by name.
FAMILY_ORDER = ("prefill", "decode", "mla_decode")
# A section names the versions it ran with; FlashInfer's only where the run had its column.
VERSION_NAMES = {"driver": "driver", "torch": "torch", "cudnn": "cuDNN", "nvrtc": "NVRTC", "flashinfer": "FlashInfer"}
LEVERS = "levers.json"


class ReportError(ValueError):
    """A results file is malformed: names the file, the field and what was expected."""


# --- reading and checking ---------------------------------------------------------------------------

def _need(obj: dict, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ReportError(f"{where}: field {key!r} is missing")
    val = obj[key]
    if not isinstance(val, kind) or isinstance(val, bool):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ReportError(f"{where}: field {key!r} is {type(val).__name__} {val!r}; expected {names}")
    return val


def _check_table(obj: dict, where: str) -> None:
    cols = _need(obj, "columns", list, where)
    if not cols or not all(isinstance(c, str) for c in cols):
        raise ReportError(f"{where}: field 'columns' must be a non-empty list of strings")
    for i, row in enumerate(_need(obj, "rows", list, where)):
        if not isinstance(row, list) or len(row) != len(cols):
            raise ReportError(f"{where}: rows[{i}] has {len(row) if isinstance(row, list) else 'no'} cells; "
                              f"expected {len(cols)} (one a column)")
        if not all(isinstance(c, (str, int, float)) and not isinstance(c, bool) for c in row):
            raise ReportError(f"{where}: rows[{i}] holds a cell that is not a string or a number")


def _check_object(data: Any, where: str) -> None:
    """What every benchmarks/ file starts with: a JSON object of this FORMAT."""
    if not isinstance(data, dict):
        raise ReportError(f"{where}: expected a JSON object, found {type(data).__name__}")
    if _need(data, "format", int, where) != FORMAT:
        raise ReportError(f"{where}: field 'format' is {data['format']!r}; expected {FORMAT}")


def check_results(data: Any, where: str) -> dict:
    """A results file's content, checked; raises ReportError naming the field."""
    _check_object(data, where)
    _need(data, "gpu", str, where)
    _need(data, "family", str, where)
    sections = _need(data, "sections", list, where)
    if not sections:
        raise ReportError(f"{where}: field 'sections' is empty; a GPU and family without results has no file")
    for i, s in enumerate(sections):
        w = f"{where} sections[{i}]"
        for key in ("title", "commit", "date", "command"):
            _need(s, key, str, w)
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", s["date"]):
            raise ReportError(f"{w}: field 'date' is {s['date']!r}; expected YYYY-MM-DD")
        versions = _need(s, "versions", dict, w)
        unknown = sorted(set(versions) - set(VERSION_NAMES))
        if unknown:
            raise ReportError(f"{w}: field 'versions' has {unknown}; allowed: {', '.join(VERSION_NAMES)}")
        _check_table(s, w)
        if not all(isinstance(n, str) for n in s.get("notes", [])):
            raise ReportError(f"{w}: field 'notes' must be a list of strings")
    return data


def check_levers(data: Any, where: str) -> dict:
    _check_object(data, where)
    _need(data, "title", str, where)
    _check_table(data, where)
    return data


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e})") from None


def _family_key(path: Path) -> tuple:
    fam = path.stem
    return (FAMILY_ORDER.index(fam), "") if fam in FAMILY_ORDER else (len(FAMILY_ORDER), fam)


def load(root: Path) -> tuple[list[tuple[str, list[dict]]], dict | None]:
    """([(gpu folder, [results, ...]), ...], levers or None), in the order the page shows them."""
    if not root.is_dir():
        raise ReportError(f"{root}: no such folder (expected benchmarks/<gpu>/<family>.json)")
    gpus = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(d.glob("*.json"), key=_family_key)
        results = []
        for f in files:
            data = check_results(_read(f), str(f))
            if data["family"] != f.stem:
                raise ReportError(f"{f}: field 'family' is {data['family']!r}; the file's name says {f.stem!r}")
            results.append(data)
        if results:
            gpus.append((d.name, results))
    levers = root / LEVERS
    return gpus, (check_levers(_read(levers), str(levers)) if levers.exists() else None)


# --- rendering ----------------------------------------------------------------------------------------

def _cell(x: Any) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(_cell(c) for c in columns) + " |",
           "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return out


def _section(family: str, s: dict) -> list[str]:
    versions = ", ".join(f"{VERSION_NAMES[k]} {v}" for k, v in s["versions"].items())
    meta = f"{s['date']}, commit `{s['commit']}`" + (f"; {versions}" if versions else "") + f"; `{s['command']}`"
    out = [f"### {family}: {s['title']}", "", meta, ""]
    out += _table(s["columns"], s["rows"])
    notes = s.get("notes", [])
    if notes:
        out += [""] + [f"- {n}" for n in notes]
    return out + [""]


def render(root: Path) -> str:
    """The page for the results under ``root``: the same bytes for the same files."""
    gpus, levers = load(root)
    out = ["# Benchmarks", "",
           f"Generated by `python3 -m attngen bench report` from `{root.name}/`: one JSON file per GPU and family",
           "(`<gpu>/<family>.json`, written or updated by `attngen bench record` from a benchmark's `--out` JSON) and",
           f"`{LEVERS}`. Edit those and render again; a test fails when this page and the files disagree.",
           "Each section names its date, the commit measured, the versions and the command. Ratios above 1 favour",
           "attngen. The measurements' history (methods, probes, raw runs) is in the git history of this file.", ""]
    for gpu, results in gpus:
        out += [f"## {results[0]['gpu']}", ""]
        for data in results:
            for s in data["sections"]:
                out += _section(data["family"], s)
    if levers is not None:
        out += [f"## {levers['title']}", ""]
        if levers.get("note"):
            out += [levers["note"], ""]
        out += _table(levers["columns"], levers["rows"]) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


# --- a benchmark's JSON as a section --------------------------------------------------------------

def _cudnn(v: Any) -> str | None:
    """torch reports cuDNN as one integer (91900 for 9.19.0)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v // 10000}.{v % 10000 // 100}"
    return str(v) if v else None


def _summaries(node: Any, path: tuple[str, ...] = ()):
    """(path, {geomean, min, shapes, min_at}) for every ratio summary in a benchmark's ``summary``."""
    if not isinstance(node, dict):
        return
    if "geomean" in node and "min" in node:
        yield path, node
        return
    for k in sorted(node):
        yield from _summaries(node[k], path + (str(k),))


def _where(at: Any) -> str:
    if isinstance(at, dict):
        return " ".join(f"{k}={v}" for k, v in at.items())
    return "" if at is None else str(at)


def record_section(run: dict, *, title: str, command: str | None = None) -> dict:
    """A section of a results file from the JSON a benchmark writes (its environment and its summary)."""
    where = "benchmark JSON"
    env = _need(run, "env", dict, where)
    bench = _need(run, "benchmark", str, where)
    rows = []
    results = run.get("results") if isinstance(run.get("results"), list) else []
    for path, s in _summaries(run.get("summary")):
        peer = path[-1] if path else ""
        ratios = [r["ratio"][peer] for r in results if isinstance(r, dict) and isinstance(r.get("ratio"), dict)
                  and isinstance(r["ratio"].get(peer), (int, float))]
        label = " / ".join(p for p in path if p not in ("ratio", "impls")) or "all"
        rows.append([label, str(s.get("shapes", "")), f"{s['geomean']:.3f}", f"{s['min']:.3f}",
                     str(sum(1 for x in ratios if x >= 1.0)) if ratios else "", _where(s.get("min_at"))])
    if not rows:
        raise ReportError(f"{where}: its 'summary' holds no ratio summary (geomean and min); "
                          "nothing to record for this benchmark")
    config = run.get("config") if isinstance(run.get("config"), dict) else {}
    peer = config.get(flashinfer.NAME) if isinstance(config.get(flashinfer.NAME), dict) else {}
    versions = {"driver": env.get("driver"), "torch": env.get("torch"), "cudnn": _cudnn(env.get("cudnn")),
                "nvrtc": env.get("nvrtc"), "flashinfer": peer.get("version") if peer.get("present") else None}
    date = str(env.get("date", ""))[:10]
    first = flashinfer.first_call_line(run)
    return {"title": title, "commit": str(env.get("attngen_commit") or env.get("attngen_source") or "unknown"),
            "date": date, "versions": {k: str(v) for k, v in versions.items() if v},
            "command": command or f"attngen bench {bench}",
            "columns": ["attngen against", "shapes", "geomean", "min", "at or above 1", "min at"], "rows": rows,
            **({"notes": [first]} if first else {})}


def gpu_folder(name: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``: the model's first letter-and-digits word, lower case."""
    m = re.search(r"\b([A-Z]+\d+[A-Za-z]*)\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")).lower()


def record(run: dict, root: Path, *, family: str, gpu: str | None = None, title: str | None = None,
           command: str | None = None) -> Path:
    """Add (or replace, by title) the run's section in ``root/<gpu>/<family>.json``; returns that path."""
    env = run.get("env") if isinstance(run.get("env"), dict) else {}
    gpu_name = str(env.get("gpu") or "")
    if not gpu and not gpu_name:
        raise ReportError("benchmark JSON: env has no 'gpu'; pass --gpu")
    folder = gpu or gpu_folder(gpu_name)
    section = record_section(run, title=title or f"attngen bench {run.get('benchmark')}", command=command)
    path = root / folder / f"{family}.json"
    if path.exists():
        data = check_results(_read(path), str(path))
        data["sections"] = [s for s in data["sections"] if s["title"] != section["title"]] + [section]
    else:
        data = {"format": FORMAT, "gpu": gpu_name.replace("NVIDIA ", "") or folder, "family": family,
                "sections": [section]}
    check_results(data, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


# --- the commands ---------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    p = sub.add_parser("report", help="render BENCHMARKS.md from benchmarks/<gpu>/<family>.json and levers.json",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("benchmarks"), help="the results folder (default benchmarks)")
    p.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"), help="the page (default BENCHMARKS.md)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if --out differs from the rendering")
    p.set_defaults(func=cmd_report)
    r = sub.add_parser("record", help="add a benchmark's --out JSON to benchmarks/<gpu>/<family>.json",
                       description="Add the ratio summary of a benchmark's JSON (bench_prefill.json, ...) as a "
                                   "section of benchmarks/<gpu>/<family>.json; a section of the same title is replaced.")
    r.add_argument("run", type=Path, help="the JSON a benchmark wrote with --out")
    r.add_argument("--family", required=True, help="the results file's name (prefill, decode, mla_decode, jit, ...)")
    r.add_argument("--gpu", default=None, help="the GPU folder (default: from the run's GPU name, e.g. h100)")
    r.add_argument("--title", default=None, help="the section's title (default: the benchmark's command)")
    r.add_argument("--command", default=None, help="the command line that produced the run, as shown on the page")
    r.add_argument("--dir", type=Path, default=Path("benchmarks"), help="the results folder (default benchmarks)")
    r.set_defaults(func=cmd_record)


def cmd_report(args: argparse.Namespace) -> int:
    try:
        text = render(args.dir)
    except ReportError as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        if not same:
            print(f"attngen: {args.out} is not what {args.dir}/ renders; run "
                  f"`python3 -m attngen bench report --dir {args.dir} --out {args.out}`", file=sys.stderr)
        args.result = {"ok": same, "out": str(args.out)}
        return 0 if same else 1
    args.out.write_text(text)
    print(f"wrote {args.out} ({text.count(chr(10))} lines)")
    args.result = {"ok": True, "out": str(args.out), "lines": text.count("\n")}
    return 0


def cmd_record(args: argparse.Namespace) -> int:
    try:
        path = record(_read(args.run), args.dir, family=args.family, gpu=args.gpu, title=args.title,
                      command=args.command)
    except (ReportError, OSError) as e:
        print(f"attngen: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    args.result = {"ok": True, "path": str(path)}
    return 0
