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

A root is a trust boundary (``attngen.fs``): everything created under it is private (0700/0600),
a root or entry owned by another user or writable by group/others is neither read nor written
(one WARNING names the path and the fix), links inside it are not followed, and nothing
CPU-executable is read from it.

An entry appears only through ``os.rename`` of a complete directory, so a reader sees a whole
entry or none. A reader that finds a checksum mismatch or an unreadable entry treats it as a
miss. Processes that miss on the same key compile once: the lookup is repeated under the key's
lock. A root that cannot be written still works: binaries are compiled and kept in memory.

Bump ``LAYOUT_VERSION`` when the on-disk layout changes (old entries are then ignored) and
``KEY_SCHEMA`` when what goes into the key changes.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import filelock

from . import fs
from .__version__ import __version__
from .arch import Arch, get_arch
from .compiler import Binary, Resources, compile as nvrtc_compile, compile_options, nvrtc_version
from .errors import CacheError
from .family import family_of
from .spec import Spec, resolve

LAYOUT_VERSION = "v1"
# 2: the template files and template-context code are hashed instead of the rendered source.
# 3: kernels are named by their spec's readable parts and an 8-digit digest (SpecBase.kernel_name), and the
#    template files are named by their paths under templates/<family>/ and templates/common/.
KEY_SCHEMA = 3
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


def cache_layers() -> list[Path]:
    """Read-only layers below the root, looked up in order after it: ``ATTNGEN_CACHE_LAYERS``
    (folders separated by ``os.pathsep``), read each time it is used."""
    return [Path(p).expanduser() for p in os.environ.get("ATTNGEN_CACHE_LAYERS", "").split(os.pathsep) if p.strip()]


class DiskCache:
    """The on-disk store under one root. Safe across threads and processes.

    ``layer=True``: a read-only layer (a fleet's unpacked bundle, a system folder): never written,
    and trusted when owned by you or by root (not writable by group/others either way)."""

    def __init__(self, root: "str | Path | None" = None, *, layer: bool = False):
        self.root = Path(root) if root is not None else cache_root()
        self.layer = layer

    @property
    def base(self) -> Path:
        return self.root / LAYOUT_VERSION

    def entry_path(self, key: str) -> Path:
        return self.base / key[:2] / key

    def lock_path(self, key: str) -> Path:
        return self.base / "locks" / f"{key}.lock"

    def usable(self) -> bool:
        """Whether the root may be read and written (see ``attngen.fs``); warns once where not."""
        why = fs.root_problem(self.root, self.layer)
        if why is None:
            try:
                if os.path.lexists(self.base):
                    fs.check_dir(self.base, self.layer)
            except OSError as e:
                why = f"{self.base} is {'a symbolic link' if e.errno == errno.ELOOP else 'not to be trusted'}: {e.strerror}"
        if why is None:
            return True
        fs.warn_once(self.root, f"not using the cache root {self.root}: {why}. Kernels are compiled and kept in "
                                f"memory only. Fix: point ATTNGEN_CACHE_DIR at a folder of your own that only you "
                                f"can write (chmod 700), or fix this one's owner and mode.")
        return False

    # --- reading ---------------------------------------------------------------------------
    def get(self, key: str) -> Binary | None:
        """The entry's binary, or None for a miss (absent, incomplete, corrupt, unreadable, or not
        to be trusted: a link, another user's, writable by others)."""
        path = self.entry_path(key)
        try:
            if not os.path.lexists(path):
                return None
            if not self.usable():
                return None
            fs.check_dir(path.parent, self.layer)
            fs.check_dir(path, self.layer)
            meta = json.loads(fs.read_private(path / _META, self.layer))
            cubin = fs.read_private(path / _CUBIN, self.layer)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EPERM):
                fs.warn_once(path, f"ignoring the cache entry {path}: {e.strerror}; remove it "
                                   f"('attngen cache clear') to let attngen rebuild it")
            return None
        except ValueError:
            return None
        if not isinstance(meta, dict):
            return None
        if meta.get("key") != key or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256"):
            return None
        if not self.layer:
            try:  # last use, for prune's least-recently-used order (read-only roots stay as they are)
                os.utime(path / _META)
            except OSError:
                pass
        try:
            return Binary(cubin=cubin, kernel_name=meta["kernel_name"], arch=meta["arch"],
                          options=tuple(meta["options"]), nvrtc_version=meta["nvrtc"],
                          resources=Resources.from_dict(meta["resources"]), log=meta.get("log", ""),
                          compile_seconds=float(meta.get("compile_seconds", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def source(self, key: str) -> str | None:
        try:
            return fs.read_private(self.entry_path(key) / _SOURCE, self.layer).decode()
        except (OSError, UnicodeDecodeError):
            return None

    # --- writing ---------------------------------------------------------------------------
    def put(self, key: str, binary: Binary, source: str, material: dict, spec: Spec) -> bool:
        """Commit an entry atomically (``put_files``). Returns False where the root cannot be written."""
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
        return self.put_files(key, {_CUBIN: binary.cubin, _SOURCE: source.encode(),
                                    _META: json.dumps(meta, indent=1, sort_keys=True).encode()})

    ENTRY_FILES = (_CUBIN, _SOURCE, _META)

    def put_files(self, key: str, files: "dict[str, bytes]") -> bool:
        """Commit an entry's files (``ENTRY_FILES``, meta.json last: it marks completeness) atomically.

        They are written whole under ``tmp/`` and renamed into place; an existing valid entry is
        kept, a corrupt one is moved aside first. Returns False where the root cannot be written.
        """
        final = self.entry_path(key)
        if self.layer or not self.usable():
            return False
        tmp_root = self.base / "tmp"
        try:
            fs.make_dirs(self.root, tmp_root)
            self._sweep_tmp(tmp_root)
            tmp = tmp_root / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
            os.mkdir(tmp, 0o700)
        except OSError as e:
            self._unwritable(e)
            return False
        try:
            for name in sorted(files, key=lambda n: n == _META):
                fs.write_private(tmp / name, files[name])
            fs.make_dirs(self.root, final.parent)
            if os.path.lexists(final):
                if self.get(key) is not None:
                    fs.remove_tree(tmp)
                    return True
                # A damaged entry (or a link planted where the entry goes) is moved aside, never followed.
                aside = tmp_root / f"corrupt.{key}.{uuid.uuid4().hex[:8]}"
                os.rename(final, aside)
                if not fs.remove_tree(aside):
                    os.unlink(aside)
            os.rename(tmp, final)
            return True
        except OSError as e:
            fs.remove_tree(tmp)
            self._unwritable(e)
            return False

    def entry_files(self, key: str) -> "dict[str, bytes] | None":
        """The files of a valid entry (``get`` passes), or None."""
        if self.get(key) is None:
            return None
        try:
            return {n: fs.read_private(self.entry_path(key) / n, self.layer) for n in self.ENTRY_FILES}
        except OSError:
            return None

    def _unwritable(self, e: OSError) -> None:
        fs.warn_once(f"{self.root} (write)", f"cannot write the cache root {self.root}: "
                                             f"{e.strerror or e}{f' ({e.filename})' if e.filename else ''}. Kernels "
                                             f"are compiled and kept in memory only, so every new process compiles "
                                             f"them again. Fix: make it writable, or point ATTNGEN_CACHE_DIR at a "
                                             f"folder you can write.")

    # Temporaries older than this belong to a process that died mid-write (a write takes
    # milliseconds); the next put removes them.
    STALE_TMP_SECONDS = 3600

    def _sweep_tmp(self, tmp_root: Path) -> None:
        now = time.time()
        for d in fs.real_subdirs(tmp_root):
            try:
                if now - os.lstat(d).st_mtime > self.STALE_TMP_SECONDS:
                    fs.remove_tree(d)
            except OSError:
                continue

    def lock(self, key: str) -> "filelock.BaseFileLock | None":
        """The key's file lock, or None where the root cannot hold lock files (read-only, or not
        to be trusted). A lock file that is a link, or another user's, is a ``CacheError``."""
        path = self.lock_path(key)
        if self.layer or not self.usable():
            return None
        try:
            fs.make_dirs(self.root, path.parent)
            if not os.access(path.parent, os.W_OK):
                raise OSError(errno.EACCES, "not writable", str(path.parent))
        except OSError as e:
            self._unwritable(e)
            return None
        try:
            fs.open_lock_file(path)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EPERM):
                raise CacheError(f"the lock file {path} is not to be trusted: "
                                 f"{'it is a symbolic link' if e.errno == errno.ELOOP else e.strerror}; "
                                 f"remove it (attngen recreates it)") from None
            self._unwritable(e)
            return None
        return filelock.FileLock(str(path), timeout=lock_timeout(), mode=0o600)

    # --- listing and housekeeping ------------------------------------------------------------
    def entries(self) -> list[Entry]:
        """Every entry folder under the root; links (to folders or not) are never followed."""
        out = []
        if not self.base.is_dir() or os.path.islink(self.base):
            return out
        for shard in fs.real_subdirs(self.base):
            if len(shard.name) != 2:
                continue
            for d in fs.real_subdirs(shard):
                try:
                    meta = json.loads(fs.read_private(d / _META, self.layer))
                except (OSError, ValueError):
                    meta = {}
                if not isinstance(meta, dict):
                    meta = {}
                out.append(Entry(d.name, d, meta))
        return out

    def prune(self, max_bytes: "int | None" = None, older_than: "float | None" = None) -> list[tuple[str, int]]:
        """Remove entries unused for ``older_than`` seconds, then the least recently used ones until
        the entries take at most ``max_bytes``; an entry whose lock another process holds (being
        built or replaced) is never removed. Returns the (key, bytes) removed."""
        now = time.time()
        ents = []
        for e in self.entries():
            try:
                ents.append((os.lstat(e.path / _META).st_mtime, e.size, e))
            except OSError:
                ents.append((0.0, 0, e))  # no meta: an incomplete entry, the oldest of all
        ents.sort(key=lambda x: x[0])
        total = sum(size for _, size, _ in ents)
        removed: list[tuple[str, int]] = []
        for used, size, e in ents:
            stale = older_than is not None and now - used > older_than
            over = max_bytes is not None and total > max_bytes
            if not (stale or over):
                continue
            if self._locked(e.key):
                continue
            if fs.remove_tree(e.path):
                removed.append((e.key, size))
                total -= size
        return removed

    def _locked(self, key: str) -> bool:
        path = self.lock_path(key)
        if not os.path.lexists(path):
            return False
        try:
            lock = filelock.FileLock(str(path), timeout=0, mode=0o600)
            lock.acquire()
        except (filelock.Timeout, OSError):
            return True
        lock.release()
        return False


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
        """Remove every entry, the temporaries and the shard folders left empty; returns how many
        entries were removed. Only real folders under the root are touched: a link is left
        where it is, and nothing it points to is removed."""
        n = 0
        for e in self.entries():
            fs.remove_tree(e.path)
            n += 1
        fs.remove_tree(self.base / "tmp")
        # Jinja's bytecode cache of earlier versions lived here; it held Python code objects.
        fs.remove_tree(self.base / "jinja")
        for shard in fs.real_subdirs(self.base) if not os.path.islink(self.base) else ():
            if len(shard.name) == 2:
                try:
                    os.rmdir(shard)  # only when empty
                except OSError:
                    pass
        return n


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
    fast_key = (spec, a.name, str(cache.root), os.environ.get("ATTNGEN_CACHE_LAYERS", ""))
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
    if binary is None and not fresh:
        for layer in cache_layers():
            binary = DiskCache(layer, layer=True).get(key)
            if binary is not None:
                log.debug("cache hit (layer %s): %s for %s", layer, spec.to_text(), a.name)
                break
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
    res = (f"{r.registers} registers, {r.spill_stores}/{r.spill_loads} bytes spilled (stores/loads)" if r.known else
           f"{r.registers} registers and a {r.stack_frame}-byte stack frame (from the cubin; NVRTC's log held no "
           f"spill report)")
    log.info("compiled %s for %s in %.2f s: %s", spec.to_text(), a.name, b.compile_seconds, res)
    if b.compile_seconds > 1.0 and not _slow_compile_told[0]:
        _slow_compile_told[0] = True
        log.info("a kernel compile blocked this call for %.1f s; 'attngen prewarm' fills the cache ahead of "
                 "time (ATTNGEN_CACHE_DIR)", b.compile_seconds)
