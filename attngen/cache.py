"""The cubin cache: an in-process layer over an on-disk store.

Layout under the root (``ATTNGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/attngen``, else
``~/.cache/attngen``)::

    v1/<key[:2]>/<key>/kernel.cubin   the object code
                      /kernel.cu      the rendered source it came from
                      /meta.json      spec, arch, versions, options, checksum, resources, timings
    v1/locks/<key>.lock               one file lock per key
    v1/tmp/                           entries being written; renamed into place when complete
    v1/tuned/<arch>.json              tuning winners of ``attngen tune`` (``attngen.tuned``)
    v1/locks/tuned-<arch>.lock        the lock of that file's read-modify-write

The key hashes the resolved spec and the family's template files and template-context code
(``render.family_digests``), not the rendered source, so a hit neither renders nor imports
Jinja; the source is rendered on a miss and stored beside the cubin.

An entry appears only through ``os.rename`` of a complete directory, so a reader sees a whole
entry or none. A reader that finds a checksum mismatch or an unreadable entry treats it as a
miss. Processes that miss on the same key compile once: the lookup is repeated under the key's
lock. A root that cannot be written still works: binaries are compiled and kept in memory.

Bump ``LAYOUT_VERSION`` when the on-disk layout changes (old entries are then ignored) and
``KEY_SCHEMA`` when what goes into the key changes.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import filelock

from .__version__ import __version__
from .arch import Arch, get_arch
from .compiler import Binary, Resources, compile as nvrtc_compile, compile_options, nvrtc_version
from .errors import CacheError
from .family import family_of
from .spec import Spec, resolve

LAYOUT_VERSION = "v1"
# 2: the template files and template-context code are hashed instead of the rendered source.
KEY_SCHEMA = 2
_CUBIN, _SOURCE, _META = "kernel.cubin", "kernel.cu", "meta.json"


log = logging.getLogger("attngen")
# The ATTNGEN_LOG value the "attngen" logger was last set up for (None: not yet looked at).
_log_setting: list = [None]
_LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging() -> None:
    """Apply ``ATTNGEN_LOG`` (debug, info, warning, error) to the ``attngen`` logger, with a
    stderr handler of its own, when the variable is set; read when a build is asked for, and
    applied again only when it changed. Without it, logging is left to the application."""
    value = os.environ.get("ATTNGEN_LOG", "").strip().lower()
    if value == _log_setting[0]:
        return
    _log_setting[0] = value
    level = _LOG_LEVELS.get(value)
    if level is None:
        return
    log.setLevel(level)
    if not any(getattr(h, "_attngen", False) for h in log.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("attngen: %(levelname)s: %(message)s"))
        h._attngen = True
        log.addHandler(h)


def always_compile() -> bool:
    """``ATTNGEN_ALWAYS_COMPILE=1``: compile every request afresh, bypassing the memory and disk
    caches (as Triton's TRITON_ALWAYS_COMPILE does); the result is still stored."""
    return os.environ.get("ATTNGEN_ALWAYS_COMPILE", "").strip().lower() not in ("", "0", "false", "no")


def cache_root() -> Path:
    """The cache root, read from the environment each time it is asked for."""
    env = os.environ.get("ATTNGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "attngen"


def lock_timeout() -> float:
    return float(os.environ.get("ATTNGEN_LOCK_TIMEOUT", "600"))


def key_material(spec: Spec, arch: Arch, options: tuple[str, ...], digests: "dict[str, str] | None" = None) -> dict:
    """Everything that can change the binary: the resolved spec, the digests of the family's
    template files and template-context code (default: ``render.family_digests``), the options,
    the NVRTC version, the arch, attngen's version and the key schema. The key is the SHA-256 of
    its canonical JSON."""
    if digests is None:
        from .render import family_digests

        digests = family_digests(family_of(spec))
    return {
        "schema": KEY_SCHEMA,
        "attngen": __version__,
        "spec": spec.to_dict(),
        "templates_sha256": digests["templates"],
        "code_sha256": digests["code"],
        "options": list(options),
        "nvrtc": nvrtc_version(),
        "arch": arch.name,
    }


def key_of(material: dict) -> str:
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    meta: dict

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


@dataclass(frozen=True)
class BuildResult:
    binary: Binary
    key: str
    spec: Spec
    origin: str  # "memory", "disk" or "compiled"
    stored: bool  # whether the disk now holds it (False on a read-only root)

    @property
    def source(self) -> str:
        """The CUDA source of the binary, rendered on request (a hit does not render it)."""
        from .render import render

        return render(self.spec)


class DiskCache:
    """The on-disk store under one root. Safe across threads and processes."""

    def __init__(self, root: "str | Path | None" = None):
        self.root = Path(root) if root is not None else cache_root()

    @property
    def base(self) -> Path:
        return self.root / LAYOUT_VERSION

    def entry_path(self, key: str) -> Path:
        return self.base / key[:2] / key

    def lock_path(self, key: str) -> Path:
        return self.base / "locks" / f"{key}.lock"

    # --- reading ---------------------------------------------------------------------------
    def get(self, key: str) -> Binary | None:
        """The entry's binary, or None for a miss (absent, incomplete, corrupt or unreadable)."""
        path = self.entry_path(key)
        try:
            meta = json.loads((path / _META).read_text())
            cubin = (path / _CUBIN).read_bytes()
        except (OSError, ValueError):
            return None
        if not isinstance(meta, dict):
            return None
        if meta.get("key") != key or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
            return None
        try:
            return Binary(cubin=cubin, kernel_name=meta["kernel_name"], arch=meta["arch"],
                          options=tuple(meta["options"]), nvrtc_version=meta["nvrtc"],
                          resources=Resources.from_dict(meta["resources"]), log=meta.get("log", ""),
                          compile_seconds=float(meta.get("compile_seconds", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def source(self, key: str) -> str | None:
        try:
            return (self.entry_path(key) / _SOURCE).read_text()
        except OSError:
            return None

    # --- writing ---------------------------------------------------------------------------
    def put(self, key: str, binary: Binary, source: str, material: dict, spec: Spec) -> bool:
        """Commit an entry atomically. Returns False where the root cannot be written.

        The entry is written whole under ``tmp/`` and renamed into place; an existing valid
        entry is kept, a corrupt one is moved aside first.
        """
        final = self.entry_path(key)
        try:
            tmp_root = self.base / "tmp"
            tmp_root.mkdir(parents=True, exist_ok=True)
            tmp = tmp_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
        except OSError:
            return False
        try:
            meta = {
                "key": key,
                "key_material": material,
                "spec": spec.to_dict(),
                "spec_text": spec.to_text(full=True),
                "kernel_name": binary.kernel_name,
                "arch": binary.arch,
                "options": list(binary.options),
                "nvrtc": binary.nvrtc_version,
                "attngen": __version__,
                "cubin_sha256": hashlib.sha256(binary.cubin).hexdigest(),
                "cubin_bytes": len(binary.cubin),
                "resources": binary.resources.to_dict(),
                "smem_dynamic": spec.smem_bytes(),
                "threads": spec.threads,
                "compile_seconds": round(binary.compile_seconds, 4),
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "log": binary.log,
            }
            _write(tmp / _CUBIN, binary.cubin)
            _write(tmp / _SOURCE, source.encode())
            _write(tmp / _META, json.dumps(meta, indent=1, sort_keys=True).encode())  # last: marks completeness
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                if self.get(key) is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                    return True
                aside = tmp_root / f"corrupt.{key}.{uuid.uuid4().hex[:8]}"
                os.rename(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.rename(tmp, final)
            return True
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            return False

    def lock(self, key: str) -> "filelock.BaseFileLock | None":
        """The key's file lock, or None where the root cannot hold lock files (read-only)."""
        path = self.lock_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK):
                return None
        except OSError:
            return None
        return filelock.FileLock(str(path), timeout=lock_timeout())

    # --- listing and housekeeping ------------------------------------------------------------
    def entries(self) -> list[Entry]:
        out = []
        if not self.base.is_dir():
            return out
        for shard in sorted(self.base.iterdir()):
            if len(shard.name) != 2 or not shard.is_dir():
                continue
            for d in sorted(shard.iterdir()):
                try:
                    meta = json.loads((d / _META).read_text())
                except (OSError, ValueError):
                    meta = {}
                if not isinstance(meta, dict):
                    meta = {}
                out.append(Entry(d.name, d, meta))
        return out

    def stats(self) -> dict:
        ents = self.entries()
        valid = [e for e in ents if self.get(e.key) is not None]
        by_arch: dict[str, int] = {}
        for e in valid:
            by_arch[e.meta.get("arch", "?")] = by_arch.get(e.meta.get("arch", "?"), 0) + 1
        return {
            "root": str(self.root),
            "entries": len(valid),
            "invalid": len(ents) - len(valid),
            "bytes": sum(e.size for e in ents),
            "by_arch": dict(sorted(by_arch.items())),
            "compile_seconds": round(sum(float(e.meta.get("compile_seconds", 0)) for e in valid), 3),
        }

    def clear(self) -> int:
        """Remove every entry (and stale temporaries); returns how many entries were removed."""
        n = 0
        for e in self.entries():
            shutil.rmtree(e.path, ignore_errors=True)
            n += 1
        shutil.rmtree(self.base / "tmp", ignore_errors=True)
        # Jinja's bytecode cache of earlier versions lived here; it held Python code objects.
        shutil.rmtree(self.base / "jinja", ignore_errors=True)
        return n


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


# --- the in-process layer and the build path ---------------------------------------------------
_memory: dict[str, Binary] = {}  # key -> binary, whatever root it came from
_stored: dict[tuple[str, str], bool] = {}  # (root, key) -> whether that root holds it
# (spec, arch name, root) -> result: repeated requests skip resolve, render and hashing (~200 us).
_built: dict[tuple, BuildResult] = {}
_memory_lock = threading.Lock()


def clear_memory() -> None:
    with _memory_lock:
        _memory.clear()
        _built.clear()
        _stored.clear()
    from .render import clear_digests

    clear_digests()


def build(spec: Spec, arch: "str | Arch", *, cache: DiskCache | None = None) -> BuildResult:
    """spec + arch -> a Binary: from memory, from disk, or compiled once and stored.

    Never needs a GPU. Concurrent callers (threads or processes) that miss on the same key
    compile once. ``stored`` says whether the root in use (``cache``, else the environment's)
    holds the entry.
    """
    a = get_arch(arch)
    cache = cache or DiskCache()
    fast_key = (spec, a.name, str(cache.root))
    fresh = always_compile()
    fast = None if fresh else _built.get(fast_key)
    if fast is not None:
        return BuildResult(fast.binary, fast.key, fast.spec, "memory", True)
    configure_logging()
    result = _build(spec, a, cache, fresh)
    if result.stored and not fresh:  # ATTNGEN_ALWAYS_COMPILE: every request compiles again
        _built[fast_key] = result
    return result


def _remember(root: str, key: str, binary: Binary, stored: bool) -> None:
    with _memory_lock:
        _memory[key] = binary
        _stored[(root, key)] = stored


def _build(spec: Spec, a: Arch, cache: DiskCache, fresh: bool = False) -> BuildResult:
    """The build path; ``fresh`` (ATTNGEN_ALWAYS_COMPILE) skips every lookup and compiles."""
    spec = resolve(spec, a)
    options = compile_options(a)
    material = key_material(spec, a, options)
    key = key_of(material)
    root = str(cache.root)
    with _memory_lock:
        hit = None if fresh else _memory.get(key)
        hit_stored = _stored.get((root, key), False)
    if hit is not None and hit_stored:
        return BuildResult(hit, key, spec, "memory", True)
    binary = None if fresh else cache.get(key)
    if binary is not None:
        _remember(root, key, binary, True)
        log.debug("cache hit (disk): %s for %s, key %s", spec.to_text(), a.name, key[:16])
        return BuildResult(binary, key, spec, "disk" if hit is None else "memory", True)
    log.debug("cache miss: %s for %s, key %s under %s", spec.to_text(), a.name, key[:16], root)

    def produce() -> tuple[Binary, str, str]:
        from .render import render

        source = render(spec)
        if hit is not None:  # compiled earlier in this process, for another root
            return hit, source, "memory"
        b = nvrtc_compile(source, a, kernel_name=spec.kernel_name, entries=spec.entries)
        _log_compile(spec, a, b)
        return b, source, "compiled"

    lock = cache.lock(key)
    if lock is None:  # read-only root: compile, keep in memory only
        binary, _, origin = produce()
        _remember(root, key, binary, False)
        return BuildResult(binary, key, spec, origin, False)
    try:
        with lock:
            binary = None if fresh else cache.get(key)  # another process may have built it while we waited
            if binary is not None:
                origin, stored = "disk", True
            else:
                binary, source, origin = produce()
                stored = cache.put(key, binary, source, material, spec)
    except filelock.Timeout:
        raise CacheError(f"timed out after {lock_timeout():g}s waiting for the cache lock "
                         f"{cache.lock_path(key)} (another process holds it; set ATTNGEN_LOCK_TIMEOUT "
                         f"or remove a stale lock)") from None
    _remember(root, key, binary, stored)
    return BuildResult(binary, key, spec, origin, stored)


_slow_compile_told = [False]


def _log_compile(spec: Spec, a: Arch, b: Binary) -> None:
    """One INFO record per compile; the first compile of a process that took over a second also
    says how to avoid it."""
    r = b.resources
    res = (f"{r.registers} registers, {r.spill_stores}/{r.spill_loads} bytes spilled (stores/loads)"
           if r.known else "resources not reported")
    log.info("compiled %s for %s in %.2f s: %s", spec.to_text(), a.name, b.compile_seconds, res)
    if b.compile_seconds > 1.0 and not _slow_compile_told[0]:
        _slow_compile_told[0] = True
        log.info("a kernel compile blocked this call for %.1f s; 'attngen prewarm' fills the cache ahead of "
                 "time (ATTNGEN_CACHE_DIR)", b.compile_seconds)
