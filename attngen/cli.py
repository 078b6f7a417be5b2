"""The ``attngen`` command: ``prewarm``, ``inspect``, ``cache ls|stats|clear``, ``tune`` and ``bench``.

Exit codes: 0 success; 1 some kernel of a ``prewarm`` failed to build, or a ``tune`` found no
correct candidate for some seqlen; 2 the request itself
was refused (bad spec, arch, manifest or option; compile or cache errors of ``inspect``), as
argparse does for usage errors. An error is always printed on stderr and never exits 0; with
``--json`` the error is also printed on stdout as ``{"ok": false, "error": {...}}`` so that a
machine reading stdout sees it.

Everything that depends on the environment (cache root, CPU count, terminal) is read when a
command runs, never at import.
"""

from __future__ import annotations

import argparse
import enum
import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from . import builder as _builder, cache as _cache, cache_key as _cache_key, log as _log
from . import tuned as _tuned
from .__version__ import __version__
from .arch import ARCHS, DEFAULT_ARCH, Arch, get_arch, parse_arch_list, target_arch
from .compiler import compile as nvrtc_compile, compile_options, note_codes, performance_notes
from .errors import AttngenError, CacheError, CompileError, SpecError
from .family import families, get_family
from .manifest import ManifestError, default_manifest_path, expand, load_manifest
from .cli_cache import add_cache_parser, aligned, print_json as _print_json
from .prewarm import Progress, _indent, run_prewarm, summarize
from .spec import Spec, parse_spec, resolve
from .tune import positive_int as _positive_int

PROG = "attngen"


# --- entry point -----------------------------------------------------------------------------

def main(argv: "list[str] | None" = None) -> int:
    undo = _log.prefixed_warnings()
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (attngen cache ls | head -1): end quietly, as git does. Later writes,
        # the interpreter's last flush included, go to /dev/null instead of raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the signal
    finally:
        undo()


def _main(argv: "list[str] | None") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # bench owns its whole argument list (its own options and --help), so it bypasses argparse.
    if argv and argv[0] == "bench":
        return _run_bench(argv[1:])
    try:
        parser = build_parser()  # loads the families, ATTNGEN_FAMILIES' modules too
    except AttngenError as e:
        _report_error(e, "--json" in argv)
        return 2
    try:
        args = parser.parse_args(_attached(argv))
    except SystemExit as e:  # usage errors (2) and --help/--version (0), returned rather than raised
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    as_json = bool(getattr(args, "json", False))
    try:
        return int(args.func(args))
    except AttngenError as e:
        _report_error(e, as_json)
        return 2
    except BrokenPipeError:
        raise
    except OSError as e:  # e.g. a cache root that cannot be listed or removed
        _report_error(e, as_json)
        return 2
    except KeyboardInterrupt as e:  # SIGINT, or SIGTERM where a command turns it into one (prewarm)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{PROG}: interrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum


# Options whose value may begin with "-": a negative value is then refused by its own check, not read
# by argparse as another option ("expected one argument").
_VALUE_OPTIONS = ("--older-than", "--max-size")


def _attached(argv: list[str]) -> list[str]:
    out = []
    it = iter(range(len(argv)))
    for i in it:
        if argv[i] in _VALUE_OPTIONS and i + 1 < len(argv) and argv[i + 1].startswith("-") and argv[i + 1] != "--":
            out.append(f"{argv[i]}={argv[i + 1]}")
            next(it, None)
        else:
            out.append(argv[i])
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Attention kernels generated from specs: pre-warm, inspect and manage the cubin cache.")
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    pw = sub.add_parser("prewarm", help="compile every kernel of a manifest into the cache",
                        description="Compile every spec of a TOML manifest for each of its archs, in parallel, "
                                    "into the cache (ATTNGEN_CACHE_DIR). Exits 1 if any kernel failed.")
    pw.add_argument("--manifest", metavar="FILE",
                    help="TOML manifest (default: the shipped default manifest)")
    pw.add_argument("--arch", type=_arch_list, metavar="ARCHS",
                    help="comma-separated archs, e.g. sm_80,sm_90; replaces the manifest's archs")
    pw.add_argument("--jobs", "-j", type=_positive_int, metavar="N",
                    help="parallel compile processes (default: the number of CPUs)")
    pw.add_argument("--json", action="store_true", help="print one JSON object (summary and items) on stdout")
    pw.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    pw.set_defaults(func=cmd_prewarm)

    ins = sub.add_parser("inspect", help="show a kernel's source, PTX, resources or cache key",
                         description="Show what attngen builds for SPEC on ARCH. Without a flag: the rendered "
                                     "CUDA source. Flags combine.")
    ins.add_argument("spec", metavar="SPEC", help="e.g. prefill:head_dim=128,dtype=bf16,mask=causal")
    ins.add_argument("--arch", type=_one_arch, metavar="ARCH",
                     help=f"target arch (default: {DEFAULT_ARCH}, what an H100/H200 runs; as attngen.render's)")
    ins.add_argument("--source", action="store_true", help="the rendered CUDA source (the default)")
    ins.add_argument("--ptx", action="store_true", help="the PTX NVRTC generates (not cached)")
    ins.add_argument("--resources", action="store_true",
                     help="registers, shared memory and spills (builds through the cache)")
    ins.add_argument("--key", action="store_true", help="the cache key and the material it hashes")
    ins.add_argument("--json", action="store_true", help="one JSON object on stdout")
    for field in ("score_mod", "mask_mod"):
        ins.add_argument(f"--{field.replace('_', '-')}-file", metavar="PATH",
                         help=f"the spec's {field}: a snippet's source (a device-function body, docs/variants.md) "
                              "read from PATH; its aux tensors' signature goes in SPEC, e.g. aux=bias:fp32:2")
    ins.set_defaults(func=cmd_inspect)

    add_cache_parser(sub)

    t = sub.add_parser("tune", help="search tile configurations on this GPU; store the fastest",
                       description="Search a spec's tuning space on the current GPU and store the winner in "
                                   "the cache root, where the family's op finds it in later processes.")
    tsub = t.add_subparsers(dest="tune_command", metavar="FAMILY", required=True)
    for fam in families():
        if fam.tuning:
            _add_tune_parser(tsub, fam)
    tl = tsub.add_parser("ls", help="list the stored winners",
                         description="List the configurations 'attngen tune' stored under the cache root.")
    tl.add_argument("--json", action="store_true", help="one JSON object on stdout")
    tl.set_defaults(func=cmd_tune_ls)

    fl = sub.add_parser("families", help="list the kernel families and their spec fields",
                        description="List every registered kernel family: its spec fields with their values and "
                                    "defaults, its template, and whether it can be tuned and benchmarked.")
    fl.add_argument("--json", action="store_true", help="one JSON object on stdout")
    fl.set_defaults(func=cmd_families)

    # Listed for --help only: main() hands "bench ..." to attngen.bench before argparse runs.
    sub.add_parser("bench", help="benchmarks (arguments go to attngen.bench)", add_help=False)
    return p


def _arch_list(text: str) -> list[Arch]:
    try:
        return parse_arch_list(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _one_arch(text: str) -> Arch:
    try:
        return get_arch(text)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seqlen_list(text: str) -> tuple[int, ...]:
    vals = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = 1024 if p.endswith("k") else 1
        try:
            n = int(p[:-1] if mult > 1 else p) * mult
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not allowed; allowed: positive integers, "
                                             f"e.g. 512,2k,16384")
        vals.append(n)
    if not vals:
        raise argparse.ArgumentTypeError("empty list; allowed: positive integers, e.g. 512,2k,16384")
    return tuple(vals)


def _report_error(e: BaseException, as_json: bool) -> None:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    if as_json:
        err: dict[str, Any] = {"type": type(e).__name__, "message": str(e)}
        if isinstance(e, SpecError):
            err.update(field=e.field, value=e.value, allowed=e.allowed, reason=e.reason)
        _print_json({"ok": False, "error": err})


# --- prewarm ---------------------------------------------------------------------------------

def cmd_prewarm(args: argparse.Namespace) -> int:
    manifest_path = args.manifest if args.manifest is not None else default_manifest_path()
    manifest = load_manifest(manifest_path)
    items = expand(manifest, args.arch)
    if not items:
        asked = ", ".join(a.name for a in args.arch) if args.arch else "its archs"
        raise ManifestError(f"manifest {manifest_path} gives nothing to build for {asked}")
    _check_root_for_prewarm()
    jobs = args.jobs or os.cpu_count() or 1
    progress = Progress(len(items), sys.stderr, enabled=not args.quiet)
    t0 = time.perf_counter()
    try:
        results = run_prewarm(items, jobs=jobs, on_result=progress.update)
    finally:
        progress.close()
    wall = time.perf_counter() - t0
    summary = summarize(results, wall)
    summary.update(manifest=str(manifest_path), cache_root=str(_cache.cache_root()), jobs=min(jobs, len(items)),
                   archs=list(dict.fromkeys(r["arch"] for r in results)))
    failures = [r for r in results if r["error"]]
    for r in failures:
        print(f"{PROG}: failed: {r['spec']} on {r['arch']}:\n{_indent(r['error'])}", file=sys.stderr)
    if args.json:
        _print_json({**summary, "items": results})
    else:
        print(f"prewarm: {summary['total']} kernels for {', '.join(summary['archs'])} from {manifest_path}")
        print(f"  compiled {summary['compiled']}, cache hits {summary['cache_hits']}, failed {summary['failed']}")
        print(f"  wall {summary['wall_seconds']:.1f} s with {summary['jobs']} jobs; "
              f"compile time summed {summary['compile_seconds']:.1f} s")
        print(f"  cache: {summary['cache_root']}")
        if summary["with_ptxas_notes"]:
            print(f"  ptxas notes on {summary['with_ptxas_notes']} kernels (setmaxnreg ignored or wgmma serialised; "
                  "--json lists them):")
            for r in [r for r in results if r.get("ptxas_notes")][:5]:
                print(f"    {r['arch']} {r['spec']}: {note_codes(r['ptxas_notes'])}")
    return 1 if failures else 0


def _check_root_for_prewarm() -> None:
    """A prewarm exists for its disk copy: a root that builds would refuse or could not write is an
    error before the first compile, not a report of every kernel as compiled but not stored."""
    from . import fs

    disk = _cache.DiskCache()
    why = disk.problem()
    if why is None:
        try:
            fs.make_dirs(disk.root, disk.base / "tmp")
            if not os.access(disk.base / "tmp", os.W_OK):
                raise OSError(errno.EACCES, "not writable", str(disk.base / "tmp"))
        except OSError as e:
            why = f"it cannot be written ({e.strerror or e}{f': {e.filename}' if e.filename else ''})"
    if why is not None:
        raise CacheError(f"prewarm would store nothing in the cache root {disk.root}: {why}. Fix: {disk.advice(why)}")


# --- inspect ---------------------------------------------------------------------------------

def _read_snippet(path: str, option: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(option, path, "a readable UTF-8 text file", reason=str(e)) from None


def cmd_inspect(args: argparse.Namespace) -> int:
    arch = target_arch(args.arch)  # the one default, attngen.render's
    snippets = {field: _read_snippet(path, f"--{field.replace('_', '-')}-file")
                for field, path in (("score_mod", args.score_mod_file), ("mask_mod", args.mask_mod_file)) if path}
    spec = parse_spec(args.spec, **snippets)
    resolved = resolve(spec, arch)
    from .render import render

    source = render(resolved)
    want_source = args.source or not (args.ptx or args.resources or args.key)
    out: dict[str, Any] = {"ok": True, "spec": spec.to_text(), "spec_resolved": resolved.to_text(full=True),
                           "arch": arch.name, "kernel_name": resolved.kernel_name}
    sections: list[tuple[str, str]] = []
    from . import tune

    by_size = tune.defaults_by_size(spec, arch)
    if by_size:
        # the op runs other kernels at other sizes for a spec that pins no tuning field: said, not hidden
        out["defaults_by_size"] = [{"from": lo, "spec": s.to_text()} for lo, s in by_size]
        counts = getattr(tune.tuning_module(spec), "BY_SIZE", "size")
        sys.stderr.write(f"note: {spec.family}'s op runs this spec by size ({counts}) without a spec of "
                         f"the caller's or a tuned winner:\n"
                         + "".join(f"  from {lo}: {s.to_text()}\n" for lo, s in by_size))
    if want_source:
        out["source"] = source
        sections.append(("source", source))
    if args.ptx:
        ptx = nvrtc_compile(source, arch, kernel_name=resolved.kernel_name, want_ptx=True).ptx
        if not ptx:
            raise CompileError(f"NVRTC returned no PTX for {resolved.kernel_name} on {arch.name}",
                               name=resolved.kernel_name)
        out["ptx"] = ptx
        sections.append(("ptx", ptx))
    if args.resources:
        r = _builder.build(resolved, arch)
        res = r.binary.resources
        notes = performance_notes(r.binary.log)
        out["resources"] = {**res.to_dict(), "smem_dynamic": resolved.smem_bytes(), "threads": resolved.threads,
                            "key": r.key, "origin": r.origin, "stored": r.stored,
                            "compile_seconds": round(r.binary.compile_seconds, 4), "ptxas_notes": list(notes)}
        sections.append(("resources", "\n".join([
            f"spec        {resolved.to_text(full=True)}",
            f"arch        {arch.name}",
            f"kernel      {resolved.kernel_name}",
            f"registers   {res.registers} per thread ({resolved.threads} threads per block)",
            f"smem        {resolved.smem_bytes()} B dynamic{f' + {res.smem_static} B static' if res.known else ''} "
            f"(limit {arch.smem_per_block} B per block)",
            f"spills      {res.spill_stores} B stores, {res.spill_loads} B loads" if res.known else
            "spills      not reported (NVRTC's log held no report; registers and stack frame are the cubin's, "
            "and a 0-byte frame means none)",
            f"stack frame {res.stack_frame} B",
            *(f"ptxas note  {n}" for n in notes),
            f"cache       {r.origin} ({r.key})",
        ]) + "\n"))
    if args.key:
        material = _cache_key.key_material(resolved, arch, compile_options(arch))
        key = _cache_key.key_of(material)
        out["key"] = key
        out["key_material"] = material
        sections.append(("key", f"key {key}\nmaterial\n" + json.dumps(material, indent=2, sort_keys=True) + "\n"))
    if args.json:
        _print_json(out)
        return 0
    for name, text in sections:
        if len(sections) > 1:
            sys.stdout.write(f"== {name} ==\n")
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    sys.stdout.flush()
    return 0


def cmd_families(args: argparse.Namespace) -> int:
    rows = []
    for fam in families():
        default = fam.spec()
        fields_ = []
        for name, value in default.to_dict().items():
            if name == "family":
                continue
            allowed = [v.value if isinstance(v, enum.Enum) else v for v in fam.spec.allowed_values(name)]
            fields_.append({"name": name, "default": value, "allowed": allowed,
                            "tuning": name in fam.spec.TUNING_FIELDS})
        rows.append({"name": fam.name, "summary": fam.summary, "template": fam.template,
                     "tune": bool(fam.tuning), "bench": bool(fam.bench), "fields": fields_})
    if args.json:
        _print_json({"ok": True, "families": rows})
        return 0
    for r in rows:
        extras = ", ".join(x for x, on in (("attngen tune", r["tune"]), ("attngen bench", r["bench"])) if on)
        print(f"{r['name']}: {r['summary']}")
        print(f"  template {r['template']}" + (f"; {extras}" if extras else ""))
        for f in r["fields"]:
            vals = ", ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in f["allowed"]) or "?"
            dflt = str(f["default"]).lower() if isinstance(f["default"], bool) else f["default"]
            print(f"  {f['name']:<12} {vals}  (default {dflt}{'; tuning, 0/auto = the arch default' if f['tuning'] else ''})")
    return 0


# --- tune ------------------------------------------------------------------------------------

def _add_tune_parser(tsub, fam) -> None:
    import importlib

    mod = importlib.import_module(fam.tuning)
    fields = ", ".join(fam.spec.TUNING_FIELDS)
    tp = tsub.add_parser(
        fam.name, help=f"tune a {fam.name} spec",
        description=f"Try every tile configuration ({fields}) that fits the GPU's arch and agrees with the fields "
                    f"SPEC pins, on random inputs; reject any whose output differs from the default config's; "
                    f"time the rest with CUDA events; store the fastest for SPEC's other fields, this GPU and each "
                    f"--seqlen ({mod.SIZE}). attngen.{fam.name} uses the winner of the nearest tuned size (by "
                    f"ratio) when called without spec= (ATTNGEN_NO_TUNED=1 turns that off). Exits 1 if some "
                    f"size had no correct candidate.")
    tp.add_argument("spec", metavar="SPEC", help=f"e.g. {fam.spec().to_text()}")
    tp.add_argument("--seqlen", action="append", type=_seqlen_list, required=True, metavar="N[,N...]",
                    help=f"{mod.SIZE} to tune for; repeatable or a comma list, e.g. 1k,4k")
    tp.add_argument("--batch", type=_positive_int, metavar="B", help="batch (default: the family's for the size)")
    tp.add_argument("--heads", type=_positive_int, metavar="H", help="query heads (default: the family's)")
    before = {a.dest for a in tp._actions}
    mod.add_arguments(tp)
    extra = tuple(a.dest for a in tp._actions if a.dest not in before)  # the family's problem options
    tp.add_argument("--max-candidates", type=_positive_int, metavar="N",
                    help="try only the first N configs (the default config is always first)")
    tp.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up per candidate (ms, default 25)")
    tp.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per candidate (ms, default 100)")
    tp.add_argument("--dry-run", action="store_true",
                    help="list the candidates and exit; no GPU needed (with --arch)")
    tp.add_argument("--compile", action="store_true",
                    help="with --dry-run: also build each candidate (through the cache) and show its resources")
    tp.add_argument("--arch", type=_one_arch, metavar="ARCH",
                    help="with --dry-run: the arch to list for (default: the current GPU's)")
    tp.add_argument("--no-store", action="store_true", help="search and report, but store nothing")
    tp.add_argument("--json", action="store_true", help="one JSON object on stdout")
    tp.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    tp.set_defaults(func=cmd_tune, family=fam.name, problem_options=extra)


def cmd_tune(args: argparse.Namespace) -> int:
    from . import tune

    spec = parse_spec(args.spec)
    if spec.family != args.family:
        raise SpecError("family", spec.family, args.family,
                        reason=f"attngen tune {args.family} takes a {args.family} spec")
    sizes = list(dict.fromkeys(n for group in args.seqlen for n in group))
    if args.compile and not args.dry_run:
        raise SpecError("--compile", True, "--compile together with --dry-run",
                        reason="a real search compiles every candidate anyway")
    if args.arch is not None and not args.dry_run:
        raise SpecError("--arch", args.arch.name, "--arch together with --dry-run",
                        reason="a search runs on the current GPU, whose arch it uses")
    if args.dry_run:
        return _tune_dry_run(args, spec, sizes)
    options = {k: getattr(args, k) for k in args.problem_options}

    def progress(i: int, n: int, row) -> None:
        what = f"{row.ms:.4f} ms, {row.rate:.1f}" if row.status == "ok" else f"{row.status}: {row.error}"
        print(f"  [{i + 1}/{n}] {tune.config_text(row.spec)}{' (default)' if row.default else ''}: {what}",
              file=sys.stderr, flush=True)

    results = []
    for n in sizes:
        if not args.quiet:
            b, h = tune.problem_size(spec, n, args.batch, args.heads)
            print(f"tune {spec.to_text()} seqlen={n} batch={b} heads={h}", file=sys.stderr, flush=True)
        results.append(tune.run(spec, n, batch=args.batch, heads=args.heads, max_candidates=args.max_candidates,
                                warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, store=not args.no_store,
                                on_row=None if args.quiet else progress, **options))
    missing = [r["seqlen"] for r in results if r["winner"] is None]
    if args.json:
        _print_json({"ok": not missing, "spec": spec.to_text(), "results": results})
    else:
        for r in results:
            print(f"{r['spec']}  seqlen={r['seqlen']} batch={r['batch']} heads={r['heads']}  "
                  f"{r['gpu']} ({r['arch']}), NVRTC {r['nvrtc']}")
            for line in tune.table(r["rows"], r["winner"], r["unit"]):
                print("  " + line)
            w = r["winner"]
            if w is None:
                print("  no correct candidate: nothing stored")
                continue
            vs = f" ({r['default_ms'] / w['ms']:.2f}x the default)" if r["default_ms"] and w["ms"] else ""
            print(f"  winner {w['config']}: {w['ms']:.4f} ms{vs}"
                  + (f"; stored in {r['stored']}" if r["stored"] else "; not stored (--no-store)"))
    for n in missing:
        print(f"{PROG}: error: no correct candidate at seqlen {n}; nothing stored for it", file=sys.stderr)
    return 1 if missing else 0


def _tune_dry_run(args: argparse.Namespace, spec: Spec, sizes: list[int]) -> int:
    from . import tune

    arch = args.arch
    if arch is None:
        from .runtime import device_arch, driver

        try:
            arch = device_arch(driver().current_device())
        except AttngenError as e:
            raise SpecError("--arch", None, ", ".join(ARCHS),
                            reason=f"no GPU to take the arch from ({e}); pass --arch with --dry-run") from None
    specs = tune.plan(spec, arch, args.max_candidates)
    rows = (tune.compile_rows(specs, arch) if args.compile else [tune.Row(s, default=(i == 0)) for i, s in enumerate(specs)])
    problems = [dict(zip(("seqlen", "batch", "heads"), (n, *tune.problem_size(spec, n, args.batch, args.heads))))
                for n in sizes]
    if args.json:
        _print_json({"ok": True, "dry_run": True, "spec": spec.to_text(), "arch": arch.name, "problems": problems,
                     "candidates": [r.to_dict() for r in rows]})
        return 0
    print(f"{spec.to_text()} on {arch.name}: {len(rows)} candidates"
          + (f" (--max-candidates {args.max_candidates})" if args.max_candidates else ""))
    for p in problems:
        print(f"  would run seqlen={p['seqlen']} batch={p['batch']} heads={p['heads']}")
    for line in tune.table([r.to_dict() for r in rows]):
        print("  " + line)
    return 1 if any(r.status == "failed" for r in rows) else 0


def cmd_tune_ls(args: argparse.Namespace) -> int:
    from . import tune

    store = _tuned.TunedStore()
    entries = store.entries()
    if args.json:
        _print_json({"ok": True, "root": str(store.root), "entries": entries})
        return 0
    if not entries:
        print(f"no tuned configurations in {store.root}", file=sys.stderr)
        return 0
    table = [("ARCH", "GPU", "NVRTC", "ATTNGEN", "SEQLEN", "CONFIG", "MS", "FIELDS")]
    for e in entries:
        try:
            cfg = tune.config_text(get_family(e["family"]).spec(**e["fields"], **e["tuning"]))
        except (AttngenError, TypeError):  # written by another version: show the fields as stored
            cfg = " ".join(f"{k}={v}" for k, v in e["tuning"].items())
        fields = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in e["fields"].items())
        ms = e.get("ms")
        table.append((e["arch"], e["gpu"], e["nvrtc"], e["attngen"], str(e["seqlen"]), cfg,
                      f"{ms:.4f}" if isinstance(ms, (int, float)) else "?", f"{e['family']}:{fields}"))
    for line in aligned(table):
        print(line)
    return 0


# --- bench -----------------------------------------------------------------------------------

def _run_bench(argv: list[str]) -> int:
    import importlib

    try:
        bench = importlib.import_module("attngen.bench")
    except ModuleNotFoundError as e:
        if e.name == "attngen.bench":
            print(f"{PROG}: error: 'attngen bench' is not available in this install (no module attngen.bench)",
                  file=sys.stderr)
        else:
            print(f"{PROG}: error: 'attngen bench' needs the module {e.name!r}, which is not installed",
                  file=sys.stderr)
        return 2
    entry = getattr(bench, "main", None)
    if not callable(entry):
        print(f"{PROG}: error: attngen.bench has no main(argv) function", file=sys.stderr)
        return 2
    try:
        rc = entry(argv)
    except AttngenError as e:
        _report_error(e, False)
        return 2
    except SystemExit as e:  # a bench built on argparse exits on usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    return int(rc or 0)
