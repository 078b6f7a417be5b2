"""Pre-warming: build a list of (spec, arch) into the cache, in parallel worker processes.

``attngen prewarm`` runs this over a manifest's expansion; CI runs it for the GPUs of
production on machines with no GPU. Plain data in and out of the workers, so a failing item
never stops the others.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import shutil
import signal
import threading
import time
from typing import Callable, TextIO

from . import builder as _builder, cache as _cache, log as _log
from .arch import Arch
from .compiler import note_codes, performance_notes
from .errors import AttngenError
from .spec import Spec, parse_spec


def run_prewarm(items: "list[tuple[Spec, Arch]]", *, jobs: int | None = None,
                on_result: "Callable[[dict], None] | None" = None) -> list[dict]:
    """Build every (spec, arch) into the cache; one result dict per item, in the items' order.

    With more than one job, builds run in worker processes (spawned, so no CUDA or lock state
    is inherited); the workers read ATTNGEN_CACHE_DIR from the environment they start with. A
    failing item never stops the others.
    """
    jobs = jobs or os.cpu_count() or 1
    work = [(i, spec.to_dict(), arch.name) for i, (spec, arch) in enumerate(items)]
    results: list[dict | None] = [None] * len(work)

    def done(r: dict) -> None:
        results[r["index"]] = r
        if on_result is not None:
            on_result(r)

    workers = min(jobs, len(work))
    if workers <= 1:
        for w in work:
            done(build_item(*w))
    else:
        _run_pool(work, workers, done)
    return [r for r in results if r is not None]


class Terminated(KeyboardInterrupt):
    """SIGTERM (or another stop signal) to the prewarm process: handled as an interrupt, with its number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _run_pool(work: list, workers: int, done: "Callable[[dict], None]") -> None:
    """The items in ``workers`` spawned processes. The workers die with this process (``_worker_init``);
    SIGINT or SIGTERM here cancels what has not started and stops the workers at once."""
    ctx = multiprocessing.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                  initargs=(os.getpid(),))
    old = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise Terminated(signum)

        old = signal.signal(signal.SIGTERM, on_term)
    try:
        futures = {pool.submit(build_item, *w): w for w in work}
        for fut in cf.as_completed(futures):
            try:
                r = fut.result()
            except Exception as e:  # the worker died (BrokenProcessPool) or could not be reached
                i, spec_dict, arch = futures[fut]
                r = _failed_item(i, spec_dict, arch, f"worker process failed: {type(e).__name__}: {e}")
            done(r)
    except BaseException:
        _stop(pool)
        raise
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    pool.shutdown(wait=True)


def _stop(pool: "cf.ProcessPoolExecutor") -> None:
    """Cancel the pending items and end the workers now (a compile in flight is not waited for)."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        try:
            p.terminate()
        except (OSError, ValueError):
            pass
    for p in procs:
        try:
            p.join(timeout=5)
        except (OSError, ValueError, AssertionError):
            pass


def _worker_init(parent: int) -> None:
    """A worker ends when its parent does, however the parent ends (SIGKILL included): Linux's
    parent-death signal where there is one, else a thread that watches the parent's pid. Ctrl-C
    reaches the whole process group; the parent alone decides what it cancels."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="attngen-parent-watch").start()
    _log.prefixed_warnings()


def build_item(index: int, spec_dict: dict, arch: str) -> dict:
    """One prewarm item through ``attngen.builder.build``; runs in a worker process. Plain data in and out."""
    t0 = time.perf_counter()
    try:
        spec = parse_spec(spec_dict)
        r = _builder.build(spec, arch)
    except AttngenError as e:
        return _failed_item(index, spec_dict, arch, str(e), time.perf_counter() - t0, type(e).__name__)
    except Exception as e:  # a bug in one stage must not take the other items down with it
        return _failed_item(index, spec_dict, arch, f"{type(e).__name__}: {e}", time.perf_counter() - t0,
                            type(e).__name__)
    res = r.binary.resources.reported()  # (None where NVRTC's log held no report; registers: the cubin's)
    error = None
    if not r.stored:
        # The point of prewarm is the disk copy: a kernel that only lives in this worker's memory is lost.
        error = f"compiled but not stored: the cache root {_cache.cache_root()} cannot be written"
    return {
        "index": index,
        "spec": spec.to_text(),
        "spec_resolved": r.spec.to_text(full=True),
        "arch": arch,
        "key": r.key,
        "kernel_name": r.binary.kernel_name,
        "origin": r.origin,
        "registers": res["registers"],
        "smem_static": res["smem_static"],
        "smem_dynamic": r.spec.smem_bytes(),
        "spill_stores": res["spill_stores"],
        "spill_loads": res["spill_loads"],
        "stack_frame": res["stack_frame"],
        # ptxas' coded notes (on sm_90a setmaxnreg ignored, wgmma serialised or waited for): correct code, slower
        "ptxas_notes": list(performance_notes(r.binary.log)),
        # For a hit this is the time the original compile took, as recorded in the entry.
        "compile_seconds": round(r.binary.compile_seconds, 4),
        "seconds": round(time.perf_counter() - t0, 4),
        "error": error,
        "error_type": "CacheError" if error else None,
    }


def _failed_item(index: int, spec_dict: dict, arch: str, error: str, seconds: float = 0.0,
                 error_type: str = "Error") -> dict:
    try:
        text = parse_spec(spec_dict).to_text()
    except AttngenError:
        text = json.dumps(spec_dict, sort_keys=True)
    return {"index": index, "spec": text, "spec_resolved": None, "arch": arch, "key": None,
            "kernel_name": None, "origin": "failed", "registers": None, "smem_static": None,
            "smem_dynamic": None, "spill_stores": None, "spill_loads": None, "stack_frame": None, "ptxas_notes": None,
            "compile_seconds": None, "seconds": round(seconds, 4), "error": error, "error_type": error_type}


def summarize(results: list[dict], wall_seconds: float) -> dict:
    compiled = [r for r in results if r["origin"] == "compiled"]
    return {
        "ok": not any(r["error"] for r in results),
        "total": len(results),
        "compiled": len(compiled),
        "cache_hits": sum(1 for r in results if r["origin"] in ("disk", "memory")),
        "failed": sum(1 for r in results if r["error"]),
        "with_ptxas_notes": sum(1 for r in results if r.get("ptxas_notes")),
        "wall_seconds": round(wall_seconds, 3),
        # Only what this run compiled: with N jobs, wall is about this sum / N.
        "compile_seconds": round(sum(r["compile_seconds"] or 0 for r in compiled), 3),
    }


class Progress:
    """``[done/total]`` progress on a stream: one rewritten line on a terminal, plain lines otherwise."""

    def __init__(self, total: int, stream: TextIO, *, enabled: bool = True):
        self.total = total
        self.stream = stream
        self.enabled = enabled
        self.done = 0
        self.failed = 0
        self.tty = enabled and _isatty(stream)
        self._open = False

    def update(self, r: dict) -> None:
        self.done += 1
        self.failed += bool(r["error"])
        if not self.enabled:
            return
        status = "FAILED" if r["error"] else ("compiled" if r["origin"] == "compiled" else "hit")
        counter = f"[{self.done}/{self.total}]"
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns
            filled = self.done * 20 // max(1, self.total)
            bar = "#" * filled + "." * (20 - filled)
            fails = f" {self.failed} failed" if self.failed else ""
            line = f"{counter} {bar}{fails} {status} {r['arch']} {r['spec']}"
            line = line[: max(10, width - 1)]
            self.stream.write("\r" + line.ljust(max(10, width - 1)))
            self._open = True
        else:
            secs = r.get("seconds") or 0.0
            notes = note_codes(r.get("ptxas_notes") or ())
            self.stream.write(f"{counter} {status:8} {r['arch']:7} {r['spec']} ({secs:.2f} s)"
                              f"{f' ptxas notes {notes}' if notes else ''}\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in str(text).splitlines())
