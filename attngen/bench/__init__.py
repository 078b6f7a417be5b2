"""Benchmarks: each kernel family against its peers (one command per family), and the JIT pipeline (jit).

Each kernel family that has a benchmark names its module in the registry (``Family.bench``);
that module adds its subcommand with ``add_parser(subparsers)``. ``core`` is the harness they
share (timing, environment, JSON, formatting, the ``--from-json`` start); ``jit`` measures the
latency of the JIT pipeline; ``host`` the host path of one eager call; ``report`` renders
BENCHMARKS.md from the results files under benchmarks/, and ``record`` adds a run's JSON to them.

The benchmarks write their JSON (``--out DIR``) and a Markdown table (``--markdown FILE``), and
re-render from a saved JSON with ``--from-json FILE`` (no GPU needed for that).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys

# What other modules take from ``attngen.bench``: the tuner and the prefill tuning problem (timer,
# FLOP count), and tools/ (tools/probe_decode.py times graphs with the event timer and checks them).
from .core import (_event_bench, _finite, _graphed, _rel_check, attention_flops, bench_ms, env_lines,  # noqa: F401
                   environment, gbps, have_gpu, tflops, write_json)


def build_parser() -> argparse.ArgumentParser:
    from ..family import families
    from . import cascade, host, jit, report, step

    p = argparse.ArgumentParser(prog="attngen bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    # By name, so that --help lists them in one order whatever order the families registered in.
    for fam in sorted(families(), key=lambda f: f.name):
        if fam.bench:
            importlib.import_module(fam.bench).add_parser(sub)
    jit.add_parser(sub)
    host.add_parser(sub)
    step.add_parser(sub)
    cascade.add_parser(sub)
    report.add_parser(sub)
    for sp in sub.choices.values():  # one --json for every benchmark, as for every attngen command
        sp.add_argument("--json", action="store_true",
                        help="print the results as one JSON object on stdout; the table and progress go to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)  # a usage error: stderr, as argparse's own
        return 2
    try:
        if not args.json:
            return int(args.func(args) or 0)
        with contextlib.redirect_stdout(sys.stderr):
            rc = int(args.func(args) or 0)
        result = getattr(args, "result", None)
        out = _finite(result) if result is not None else {"ok": False, "exit": rc}
        sys.stdout.write(json.dumps(out, indent=1) + "\n")
        return rc
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
