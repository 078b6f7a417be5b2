"""The cubin cache: an in-process layer over an on-disk store.

Layout under the root (``ATTNGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/attngen``, else
``~/.cache/attngen``)::

    v1/<key[:2]>/<key>/kernel.cubin   the object code
                      /kernel.cu      the rendered source it came from
                      /meta.json      spec, arch, versions, options, checksum, resources, timings
    v1/locks/<key>.lock               one file lock per key
    v1/tmp/                           entries being written; renamed into place when complete
    v1/tuned/<arch>.json              tuning winners of ``attngen tune`` (see "tuned configurations")
    v1/locks/tuned-<arch>.lock        the lock of that file's read-modify-write
    v1/jinja/                         compiled templates (Jinja's bytecode cache, checksummed by source)

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
from .errors import AttngenError, CacheError
from .render import bytecode_dir, render
from .spec import Spec, resolve

LAYOUT_VERSION = "v1"
KEY_SCHEMA = 1
_CUBIN, _SOURCE, _META = "kernel.cubin", "kernel.cu", "meta.json"


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


def key_material(spec: Spec, arch: Arch, source: str, options: tuple[str, ...]) -> dict:
    """Everything that can change the binary. The key is the SHA-256 of its canonical JSON."""
    return {
        "schema": KEY_SCHEMA,
        "attngen": __version__,
        "spec": spec.to_dict(),
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
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
    source: str
    spec: Spec
    origin: str  # "memory", "disk" or "compiled"
    stored: bool  # whether the disk now holds it (False on a read-only root)


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
        _tuned_memo.clear()


def build(spec: Spec, arch: "str | Arch", *, cache: DiskCache | None = None) -> BuildResult:
    """spec + arch -> a Binary: from memory, from disk, or compiled once and stored.

    Never needs a GPU. Concurrent callers (threads or processes) that miss on the same key
    compile once. ``stored`` says whether the root in use (``cache``, else the environment's)
    holds the entry.
    """
    a = get_arch(arch)
    cache = cache or DiskCache()
    fast_key = (spec, a.name, str(cache.root))
    fast = _built.get(fast_key)
    if fast is not None:
        return BuildResult(fast.binary, fast.key, fast.source, fast.spec, "memory", True)
    result = _build(spec, a, cache)
    if result.stored:
        _built[fast_key] = result
    return result


def _remember(root: str, key: str, binary: Binary, stored: bool) -> None:
    with _memory_lock:
        _memory[key] = binary
        _stored[(root, key)] = stored


def _build(spec: Spec, a: Arch, cache: DiskCache) -> BuildResult:
    spec = resolve(spec, a)
    source = render(spec, bytecode=bytecode_dir(cache.root))
    options = compile_options(a)
    material = key_material(spec, a, source, options)
    key = key_of(material)
    root = str(cache.root)
    with _memory_lock:
        hit = _memory.get(key)
        hit_stored = _stored.get((root, key), False)
    if hit is not None and hit_stored:
        return BuildResult(hit, key, source, spec, "memory", True)
    binary = cache.get(key)
    if binary is not None:
        _remember(root, key, binary, True)
        return BuildResult(binary, key, source, spec, "disk" if hit is None else "memory", True)

    def produce() -> tuple[Binary, str]:
        if hit is not None:  # compiled earlier in this process, for another root
            return hit, "memory"
        return nvrtc_compile(source, a, kernel_name=spec.kernel_name, entries=spec.entries), "compiled"

    lock = cache.lock(key)
    if lock is None:  # read-only root: compile, keep in memory only
        binary, origin = produce()
        _remember(root, key, binary, False)
        return BuildResult(binary, key, source, spec, origin, False)
    try:
        with lock:
            binary = cache.get(key)  # another process may have built it while we waited
            if binary is not None:
                origin, stored = "disk", True
            else:
                binary, origin = produce()
                stored = cache.put(key, binary, source, material, spec)
    except filelock.Timeout:
        raise CacheError(f"timed out after {lock_timeout():g}s waiting for the cache lock "
                         f"{cache.lock_path(key)} (another process holds it; set ATTNGEN_LOCK_TIMEOUT "
                         f"or remove a stale lock)") from None
    _remember(root, key, binary, stored)
    return BuildResult(binary, key, source, spec, origin, stored)


# --- tuned configurations ----------------------------------------------------------------------
#
# ``attngen tune`` stores the winner of a search per (family, untuned spec fields, arch, GPU name,
# NVRTC version, attngen version, seqlen): one JSON file per arch, ``{"format": 1, "entries": [...]}``,
# rewritten whole (temp file + os.replace) under a file lock. A reader that finds the file
# missing, unreadable or malformed sees no entries; a malformed entry is skipped alone. Tuning
# results are not compiled code: ``DiskCache.clear`` keeps them, ``TunedStore.clear`` removes them.
# Bump ``TUNED_FORMAT`` when an entry's meaning changes (files of another format are then ignored).

TUNED_FORMAT = 1
# What must agree for a stored winner to apply; "seqlen" is the bucket within a match.
TUNED_MATCH = ("family", "fields", "arch", "gpu", "nvrtc", "attngen")

# (root, arch) -> entries of that file, read once per process (a lookup is then a filter in memory).
_tuned_memo: dict[tuple[str, str], list[dict]] = {}


def _valid_tuned(e) -> bool:
    return (isinstance(e, dict) and all(isinstance(e.get(k), str) for k in ("family", "arch", "gpu", "nvrtc", "attngen"))
            and isinstance(e.get("fields"), dict) and isinstance(e.get("tuning"), dict)
            and isinstance(e.get("seqlen"), int) and not isinstance(e.get("seqlen"), bool) and e["seqlen"] > 0)


def _tuned_identity(e: dict) -> tuple:
    return tuple(json.dumps(e.get(k), sort_keys=True) for k in TUNED_MATCH + ("seqlen",))


class TunedStore:
    """The tuning winners under one cache root."""

    def __init__(self, root: "str | Path | None" = None):
        self.root = Path(root) if root is not None else cache_root()

    @property
    def base(self) -> Path:
        return self.root / LAYOUT_VERSION / "tuned"

    def path(self, arch: str) -> Path:
        return self.base / f"{get_arch(arch).name}.json"

    def lock_path(self, arch: str) -> Path:
        return self.root / LAYOUT_VERSION / "locks" / f"tuned-{get_arch(arch).name}.lock"

    def read(self, arch: str) -> list[dict]:
        """Every well-formed entry of ``arch``'s file; [] when it is missing, unreadable or malformed."""
        try:
            data = json.loads(self.path(arch).read_text())
        except (OSError, ValueError, UnicodeDecodeError):
            return []
        if not isinstance(data, dict) or data.get("format") != TUNED_FORMAT or not isinstance(data.get("entries"), list):
            return []
        return [e for e in data["entries"] if _valid_tuned(e)]

    def entries(self) -> list[dict]:
        """Every entry of every arch's file."""
        out: list[dict] = []
        try:
            files = sorted(self.base.glob("*.json"))
        except OSError:
            return out
        for f in files:
            try:
                out += self.read(f.stem)
            except AttngenError:  # a file named after no arch: not ours
                continue
        return out

    def put(self, entry: dict) -> Path:
        """Store ``entry``, replacing the one with the same match fields and seqlen; returns the file.

        Raises ``CacheError`` where the root cannot be written or the lock is not had in time.
        """
        if not _valid_tuned(entry):
            raise CacheError(f"not a tuned entry: {json.dumps(entry, sort_keys=True)[:300]}")
        arch = entry["arch"]
        path, lock_path = self.path(arch), self.lock_path(arch)
        try:
            lock_path.parent.mkdir(parents=True, exist_ok=True)
            path.parent.mkdir(parents=True, exist_ok=True)
            with filelock.FileLock(str(lock_path), timeout=lock_timeout()):
                ident = _tuned_identity(entry)
                entries = [e for e in self.read(arch) if _tuned_identity(e) != ident] + [entry]
                entries.sort(key=lambda e: _tuned_identity(e))
                tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
                try:
                    _write(tmp, (json.dumps({"format": TUNED_FORMAT, "entries": entries}, indent=1, sort_keys=True)
                                 + "\n").encode())
                    os.replace(tmp, path)
                finally:
                    if tmp.exists():
                        tmp.unlink()
        except filelock.Timeout:
            raise CacheError(f"timed out after {lock_timeout():g}s waiting for the lock {lock_path} (another "
                             f"process holds it; set ATTNGEN_LOCK_TIMEOUT or remove a stale lock)") from None
        except OSError as e:
            raise CacheError(f"could not store the tuned configuration in {path}: {e}") from None
        with _memory_lock:
            _tuned_memo[(str(self.root), get_arch(arch).name)] = entries
        return path

    def clear(self) -> int:
        """Remove every tuned entry; returns how many there were."""
        n = len(self.entries())
        shutil.rmtree(self.base, ignore_errors=True)
        with _memory_lock:
            for k in [k for k in _tuned_memo if k[0] == str(self.root)]:
                del _tuned_memo[k]
        return n


def tuned_entries(arch: str, root: "str | Path | None" = None) -> list[dict]:
    """``arch``'s tuned entries under ``root`` (default: the environment's), read once per process."""
    store = TunedStore(root)
    k = (str(store.root), get_arch(arch).name)
    got = _tuned_memo.get(k)
    if got is None:
        got = store.read(arch)
        with _memory_lock:
            _tuned_memo[k] = got
    return got


def match_tuned(entries: list[dict], **match) -> list[dict]:
    """The entries whose ``TUNED_MATCH`` fields equal ``match``'s (every one of them must be given)."""
    missing = set(TUNED_MATCH) - set(match)
    if missing:
        raise TypeError(f"match_tuned needs {', '.join(sorted(missing))}")
    return [e for e in entries if all(e.get(k) == match[k] for k in TUNED_MATCH)]
