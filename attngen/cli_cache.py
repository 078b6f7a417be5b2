"""``attngen cache``: list, summarise, clear, verify, export and import the cubin cache."""

from __future__ import annotations

import argparse
import json
import math
import sys

from . import cache as _cache
from . import tuned as _tuned
from .bundle import export_bundle, import_bundle, verify
from .compiler import REPORT_ONLY
from .errors import AttngenError, CacheError
from .spec import parse_spec

PROG = "attngen"
# Entries ``cache import --verify`` rebuilds (a compile each, about a second).
VERIFY_SAMPLE = 8


def print_json(obj) -> None:
    """One JSON object on stdout, as every attngen command's --json prints it."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def aligned(rows) -> list[str]:
    """Rows of cells as text lines, every column but the last padded to its widest cell."""
    rows = [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in rows]


def add_cache_parser(sub) -> None:
    c = sub.add_parser("cache", help="list, summarise, clear, verify, export or import the cubin cache",
                       description="The on-disk cache under ATTNGEN_CACHE_DIR (else the user cache directory).")
    csub = c.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    for name, func, text in (("ls", cmd_cache_ls, "list entries"),
                             ("stats", cmd_cache_stats, "count entries, bytes and compile time"),
                             ("clear", cmd_cache_clear, "remove every compiled entry (tuned configs stay unless --tuned)"),
                             ("verify", cmd_cache_verify, "check every entry's checksums; exit 1 on damage"),
                             ("export", cmd_cache_export, "write every valid entry into one bundle FILE"),
                             ("import", cmd_cache_import, "add the entries of a bundle FILE, each checked first"),
                             ("prune", cmd_cache_prune, "remove unused entries: older than an age, least recently "
                                                        "used first down to a size")):
        sp = csub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        if name in ("export", "import"):
            sp.add_argument("file", metavar="FILE", help="the bundle (a tar file; gzip when it ends in .gz)")
        sp.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        if name == "prune":
            sp.add_argument("--max-size", type=_size_arg, metavar="SIZE",
                            help="keep the entries within SIZE (e.g. 500M, 10G), removing the least recently used")
            sp.add_argument("--older-than", type=_age_arg, metavar="AGE",
                            help="remove entries unused for AGE (e.g. 12h, 30d)")
        if name == "import":
            sp.add_argument("--verify", action="store_true",
                            help=f"first rebuild a random sample of {VERIFY_SAMPLE} entries and compare the bytes; "
                                 f"any difference refuses the whole bundle")
            sp.add_argument("--verify-all", action="store_true", help="as --verify, rebuilding every entry")
        if name == "clear":
            sp.add_argument("--tuned", action="store_true",
                            help="also remove the configurations stored by 'attngen tune'")
        sp.set_defaults(func=func)



def _entry_row(disk: "_cache.DiskCache", e: "_cache.Entry") -> dict:
    # A damaged entry (meta.json that is not an object, fields of the wrong type) is listed as
    # invalid rather than taking the whole listing down.
    meta = e.meta if isinstance(e.meta, dict) else {}
    res = meta.get("resources") if isinstance(meta.get("resources"), dict) else {}
    if res.get("known", True) is False:  # NVRTC's log held no report: registers are the cubin's, the rest not known
        res = {**res, **dict.fromkeys(REPORT_ONLY)}
    try:
        valid = disk.get(e.key) is not None
    except Exception:
        valid = False
    try:
        text = parse_spec(meta["spec"]).to_text()
    except (AttngenError, KeyError, TypeError):
        text = meta.get("spec_text")
    try:
        size = e.size
    except OSError:  # removed while we listed it
        size = 0
    return {
        "key": e.key,
        "valid": valid,
        "spec": text,
        "arch": meta.get("arch"),
        "kernel_name": meta.get("kernel_name"),
        "registers": res.get("registers"),
        "smem_static": res.get("smem_static"),
        "smem_dynamic": meta.get("smem_dynamic"),
        "spill_stores": res.get("spill_stores"),
        "spill_loads": res.get("spill_loads"),
        "bytes": size,
        "compile_seconds": meta.get("compile_seconds"),
        "created": meta.get("created"),
        "path": str(e.path),
    }


def cmd_cache_ls(args: argparse.Namespace) -> int:
    disk = _cache.DiskCache()
    disk.require("list")
    rows = [_entry_row(disk, e) for e in disk.entries()]
    if args.json:
        print_json({"ok": True, "root": str(disk.root), "entries": rows})
        return 0
    if not rows:
        print(f"no entries in {disk.root}", file=sys.stderr)
        return 0
    table = [("KEY", "ARCH", "REGS", "SPILLS", "SIZE", "CREATED", "SPEC")]
    for r in rows:
        spills = "?" if r["spill_stores"] is None else f"{r['spill_stores']}/{r['spill_loads']}"
        table.append((r["key"][:12], r["arch"] or "?", "?" if r["registers"] is None else str(r["registers"]),
                      spills, _size(r["bytes"]), r["created"] or "?",
                      (r["spec"] or "?") + ("" if r["valid"] else "  [invalid]")))
    for line in aligned(table):
        print(line)
    return 0


def cmd_cache_stats(args: argparse.Namespace) -> int:
    disk = _cache.DiskCache()
    disk.require("summarise")
    stats = disk.stats()
    stats["tuned"] = len(_tuned.TunedStore().entries())
    if args.json:
        print_json({"ok": True, **stats})
        return 0
    print(f"root             {stats['root']}")
    print(f"entries          {stats['entries']}" + (f" (+{stats['invalid']} invalid)" if stats["invalid"] else ""))
    print(f"size             {_size(stats['bytes'])}")
    print("by arch          " + (", ".join(f"{a}: {n}" for a, n in stats["by_arch"].items()) or "-"))
    print(f"compile seconds  {stats['compile_seconds']}")
    print(f"tuned configs    {stats['tuned']}")
    return 0


def cmd_cache_clear(args: argparse.Namespace) -> int:
    disk = _cache.DiskCache()
    report: dict = {}
    removed = disk.clear(report)
    if report["failed"]:
        # Removal ignores errors one by one; an entry it could not remove is a failure, not a quiet success.
        raise CacheError(f"cache clear removed {removed} entries under {disk.root}; {len(report['failed'])} could "
                         f"not be removed (permissions?), e.g. {report['failed'][0]}")
    added = len(disk.entries())  # committed by a concurrent build after clear passed it: not a failure
    tuned = None
    if args.tuned:
        store = _tuned.TunedStore(disk.root)
        tuned = store.clear()
        if store.entries():
            raise CacheError(f"cache clear --tuned could not remove the tuned configurations in {store.base}")
    if args.json:
        print_json({"ok": True, "root": str(disk.root), "removed": removed, "added_meanwhile": added,
                    "writes_in_progress": report["live_tmp"], "locks_removed": report["locks_removed"],
                    "repaired": report["repaired"], **({"removed_tuned": tuned} if tuned is not None else {})})
        return 0
    print(f"removed {removed} entries from {disk.root}" + (f" and {tuned} tuned configurations" if tuned is not None else ""))
    if added:
        print(f"  {added} {'entry was' if added == 1 else 'entries were'} added by another process while clearing")
    if report["live_tmp"]:
        n = report["live_tmp"]
        print(f"  left {n} {'write' if n == 1 else 'writes'} in progress in {disk.base / 'tmp'} (another process's)")
    for p in report["repaired"]:
        print(f"  removed an odd object: {p}")
    return 0


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            break
    return f"{size:.1f} {unit}"


def cmd_cache_verify(args: argparse.Namespace) -> int:
    disk = _cache.DiskCache()
    disk.require("verify")
    r = verify(disk)
    if args.json:
        print_json({"ok": not r["damaged"], "root": str(disk.root), **r})
    else:
        whys = dict(r["problems"])
        for key, path in r["damaged"]:
            print(f"damaged: {key} ({path}): {whys.get(path, 'incomplete')}")
        odd = [(p, why) for p, why in r["problems"] if p not in {path for _, path in r["damaged"]}]
        for path, why in odd:
            print(f"odd: {path}: {why}")
        print(f"verified {r['checked']} entries under {disk.root}: {r['valid']} valid, {len(r['damaged'])} damaged"
              + (f", {len(odd)} odd objects in the layout" if odd else "")
              + ("; 'attngen cache clear' removes them, or a build replaces each" if r["damaged"] or odd else ""))
    return 1 if r["problems"] else 0


def cmd_cache_export(args: argparse.Namespace) -> int:
    disk = _cache.DiskCache()
    disk.require("export")
    m = export_bundle(disk, args.file)
    for key, why in m["skipped"]:
        print(f"{PROG}: warning: not exported: {key}: {why}", file=sys.stderr)
    if args.json:
        print_json({"ok": True, "file": args.file, "entries": len(m["entries"]), "attngen": m["attngen"],
                     "nvrtc": m["nvrtc"], "skipped": m["skipped"]})
    else:
        print(f"exported {len(m['entries'])} entries from {disk.root} to {args.file} "
              f"(attngen {m['attngen']}, NVRTC {m['nvrtc']})")
    return 0


def cmd_cache_import(args: argparse.Namespace) -> int:
    disk = _cache.DiskCache()
    r = import_bundle(disk, args.file, rebuild=None if args.verify_all else (VERIFY_SAMPLE if args.verify else 0))
    if r["refused"]:
        print(f"{PROG}: error: {args.file} is refused whole: an entry rebuilt here differs from it, so nothing of "
              f"it is imported", file=sys.stderr)
    for what, why in r["rejected"]:
        print(f"attngen: error: rejected {what} from {args.file}: {why}", file=sys.stderr)
    if r["other_versions"]:
        print(f"attngen: warning: {args.file} was built by attngen {r['bundle_attngen']} with NVRTC {r['bundle_nvrtc']}; "
              f"this install's requests will not find its entries (rebuild the bundle with this version)",
              file=sys.stderr)
    if args.json:
        print_json({"ok": not r["rejected"], "file": args.file, "root": str(disk.root), **r})
    else:
        print(f"imported {r['imported']} entries into {disk.root} ({r['present']} already there, "
              f"{len(r['rejected'])} rejected)")
        if r["rebuilt"]:
            bad = sum(1 for _, why in r["rejected"] if "rebuil" in why)
            print(f"rebuilt {r['rebuilt']} of {r['imported'] + r['present'] + bad if not r['refused'] else r['rebuilt']} "
                  f"entries here to compare: {r['rebuilt'] - bad} identical, {bad} not")
    return 1 if r["rejected"] else 0


def _number(text: str) -> float:
    """A finite number >= 0 from ``text``, else -1 (inf, nan, negatives and 5000-digit strings included)."""
    if len(text) > 30:
        return -1
    try:
        n = float(text)
    except ValueError:
        return -1
    return n if math.isfinite(n) and n >= 0 else -1


def _size_arg(text: str) -> int:
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = s[-1] if s and s[-1] in units else ""
    n = _number(s[:-1] if unit else s)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not allowed; allowed: a size such as 500M or 10G")
    return int(n * units[unit])


def _age_arg(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    s = text.strip().lower()
    unit = s[-1] if s and s[-1] in units else ""
    n = _number(s[:-1] if unit else s)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not allowed; allowed: an age such as 12h or 30d "
                                         f"(not negative)")
    return n * units.get(unit, 1)


def cmd_cache_prune(args: argparse.Namespace) -> int:
    if args.max_size is None and args.older_than is None:
        raise CacheError("cache prune needs --max-size SIZE and/or --older-than AGE")
    disk = _cache.DiskCache()
    removed = disk.prune(args.max_size, args.older_than)
    freed = sum(n for _, n in removed)
    if args.json:
        print_json({"ok": True, "root": str(disk.root), "removed": len(removed), "bytes": freed,
                    "keys": [k for k, _ in removed]})
    else:
        print(f"removed {len(removed)} entries ({_size(freed)}) from {disk.root}")
    return 0
