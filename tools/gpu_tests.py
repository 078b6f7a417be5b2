"""Run the GPU tests as several pytest processes at once on one GPU, and print one table.

A GPU test run is bound by NVRTC compiles on the host (one core each), not by the GPU: the suite's ~4,000 tests
in one process take far longer than a lent machine's session allows, while its 16 cores sit idle. This collects
the tests, cuts the list into ``--workers`` contiguous parts (neighbouring tests share kernels, and the disk cache
they share hands a kernel one process built to the others), runs each part in its own pytest process under one
time limit, and prints per part: passed, failed, errors, skipped, seconds, then every failure's node id. A part
that reaches the limit is interrupted (SIGINT), so pytest still prints what it had found; the table then names the
test each such part was in, and every test left unrun is written to ``not_run.txt`` in --out, for a later call.

    PYTHONPATH=. python3 tools/gpu_tests.py [--workers 8] [--timeout 540] [--out DIR] [-k EXPR] \
        [tests/test_gpu_x.py ...]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collect(paths: list[str], keyword: str = "") -> list[str]:
    """The node ids pytest collects from ``paths`` (all of tests/test_gpu*.py by default), those ``keyword``
    selects where given (pytest's -k expression)."""
    select = ["-k", keyword] if keyword else []
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *select,
                        *paths], cwd=ROOT, capture_output=True, text=True)
    ids = [line.strip() for line in r.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected from {paths}{f' with -k {keyword!r}' if keyword else ''}:\n"
                         f"{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return ids


def parts(ids: list[str], n: int) -> list[list[str]]:
    """``ids`` in ``n`` contiguous parts of nearly equal size (none empty)."""
    n = max(1, min(n, len(ids)))
    size, extra = divmod(len(ids), n)
    out, at = [], 0
    for i in range(n):
        k = size + (1 if i < extra else 0)
        out.append(ids[at:at + k])
        at += k
    return out


def _default_sigint() -> None:
    # A background job's children inherit SIGINT ignored; the limit below interrupts with it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def counts(text: str) -> dict[str, int]:
    """passed/failed/errors/skipped from pytest's last summary line (0 where absent)."""
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    got = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tail)}
    got["errors"] = got.pop("error", 0) + got.get("errors", 0)
    return {k: got.get(k, 0) for k in ("passed", "failed", "errors", "skipped")}


_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)


def finished(text: str) -> set[str]:
    """The node ids pytest -v reported a result for (a test with a failing teardown is reported twice)."""
    return {m.group(1) for m in _RESULT.finditer(text)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="*", help="test files or node ids (default: tests/test_gpu*.py)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--timeout", type=float, default=540.0, help="seconds each part may run")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_tests_out")))
    p.add_argument("-k", dest="keyword", default="", help="only the tests this pytest -k expression selects")
    args = p.parse_args(argv)
    paths = args.paths or sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_gpu*.py"))
    ids = collect(paths, args.keyword)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs = []
    for i, part in enumerate(parts(ids, args.workers)):
        log = open(args.out / f"part{i}.txt", "w")
        # -v: a line a test, so that a part stopped at the limit tells which of its tests ran
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "--tb=short", "-p", "no:cacheprovider", *part]
        procs.append((i, part, log, subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                                     preexec_fn=_default_sigint)))
    deadline = t0 + args.timeout
    rows, failures, stopped, not_run = [], [], [], []
    for i, part, log, proc in procs:
        n = len(part)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # pytest ends the session and prints its summary
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        text = (args.out / f"part{i}.txt").read_text(errors="replace")
        c = counts(text)
        failures += [line.split(" - ")[0] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        done = finished(text)
        left = [t for t in part if t not in done]
        if left and proc.returncode != 0:
            stopped.append((i, left[0], len(left)))
            not_run += left
        rows.append((i, n, proc.returncode, c, time.monotonic() - t0))
    print(f"{len(ids)} tests in {len(rows)} parts, {time.monotonic() - t0:.0f} s; logs in {args.out}")
    print(f"{'part':>4} {'tests':>6} {'rc':>4} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8}")
    for i, n, rc, c, _ in rows:
        print(f"{i:>4} {n:>6} {rc:>4} {c['passed']:>7} {c['failed']:>7} {c['errors']:>7} {c['skipped']:>8}")
    total = {k: sum(r[3][k] for r in rows) for k in ("passed", "failed", "errors", "skipped")}
    print(f" all {len(ids):>6}      {total['passed']:>7} {total['failed']:>7} {total['errors']:>7} {total['skipped']:>8}"
          f"  (not run: {len(ids) - sum(total.values())})")
    for i, running, k in stopped:
        print(f"part {i} stopped in {running}: {k} of its tests not run")
    listed = args.out / "not_run.txt"
    if not_run:
        listed.write_text("\n".join(not_run) + "\n")
        print(f"the {len(not_run)} tests not run: {listed}")
    else:
        listed.unlink(missing_ok=True)  # an earlier run's list would read as this one's
    for f in failures:
        print(f)
    return 0 if not failures and all(r[2] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
