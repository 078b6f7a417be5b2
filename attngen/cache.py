"""The cubin store: an in-process memory layer over an on-disk store of entries by key.

Layout under the root (``ATTNGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/attngen``, else
``~/.cache/attngen``)::

    v1/<key[:2]>/<key>/kernel.cubin   the object code
                      /kernel.cu      the rendered source it came from, gzip-compressed (plain text
                                      in entries of earlier versions, which read as well)
                      /meta.json      spec, arch, versions, options, checksum, resources, timings
    v1/locks/<key>.lock               one file lock per key
    v1/tmp/                           entries being written; renamed into place when complete
    v1/tuned/<arch>.json              tuning winners of ``attngen tune`` (``attngen.tuned``)
    v1/locks/tuned-<arch>.lock        the lock of that file's read-modify-write

The key (``attngen.cache_key``) hashes the resolved spec and the family's template files and
template-context code, not the rendered source, so a hit neither renders nor imports Jinja; the
build path (``attngen.builder``) renders the source on a miss and stores it beside the cubin. This
module is the store alone: it never renders or compiles.

A root is a trust boundary (``attngen.fs``): everything created under it is private (0700/0600),
a root or entry owned by another user or writable by group/others is neither read nor written
(one WARNING names the path and the fix), links inside it are not followed, and nothing
CPU-executable is read from it.

An entry appears only through ``os.rename`` of a complete directory, so a reader sees a whole
entry or none. A reader treats as a miss an entry that is unreadable, fails its checksum, or
fails the checks of ``attngen.cache_entry`` (field types; metadata against the key; the cubin's
SM, kernel symbol and register count). The lock of a key is ``attngen.cache_lock``'s; the layout
around the entries (odd objects, temporaries, lock files) is ``attngen.cache_layout``'s. A root
that cannot be written still works: ``lock`` and ``put`` say so, and the build path keeps its
binaries in ``memory`` only.

Bump ``LAYOUT_VERSION`` when the on-disk layout changes (old entries are then ignored) and
``cache_key.KEY_SCHEMA`` when what goes into the key changes.
"""

from __future__ import annotations

import datetime as _dt
import errno
import hashlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from . import cache_layout, fs
from .cache_lock import KeyLock, is_held
from .cache_env import cache_root, lock_timeout
from .cache_entry import entry_problem, load_json, pack_source, unpack_source
from .cache_key import KEY_SCHEMA, key_material, key_of  # noqa: F401 (the store's keys, named here too)
from .__version__ import __version__
from .compiler import Binary, Resources
from .errors import CacheError
from .spec import Spec

LAYOUT_VERSION = "v1"
_CUBIN, _SOURCE, _META = "kernel.cubin", "kernel.cu", "meta.json"


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    meta: dict

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


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

    def problem(self) -> "str | None":
        """Why the root may not be read or written (see ``attngen.fs``), or None."""
        why = fs.root_problem(self.root, self.layer)
        if why is None:
            try:
                if os.path.lexists(self.base):
                    fs.check_dir(self.base, self.layer)
            except OSError as e:
                why = f"{self.base} is {'a symbolic link' if e.errno == errno.ELOOP else 'not to be trusted'}: {e.strerror}"
        return why

    def advice(self, why: str) -> str:
        if why == "it is not a folder":
            return "point ATTNGEN_CACHE_DIR at a folder of your own that only you can write"
        return ("point ATTNGEN_CACHE_DIR at a folder of your own that only you can write (chmod 700), or fix this "
                "one's owner and mode")

    def usable(self) -> bool:
        """Whether the root may be read and written (see ``attngen.fs``); warns once where not."""
        why = self.problem()
        if why is None:
            return True
        fs.warn_once(self.root, f"not using the cache root {self.root}: {why}. Kernels are compiled and kept in "
                                f"memory only. Fix: {self.advice(why)}.")
        return False

    def require(self, doing: str) -> None:
        """Raise ``CacheError`` where the root is one that builds refuse: a command that lists,
        checks or deletes says so instead of acting on (or reporting nothing of) a root not to be trusted.
        A ``v1`` that is a file or a link is not the root's fault: ``verify`` flags it, ``clear`` unlinks it."""
        why = fs.root_problem(self.root, self.layer)
        if why is not None:
            raise CacheError(f"refusing to {doing} the cache root {self.root}: {why}; builds do not use it either. "
                             f"Fix: {self.advice(why)}")

    # --- reading ---------------------------------------------------------------------------
    def get(self, key: str) -> Binary | None:
        """The entry's binary, or None for a miss (absent, incomplete, corrupt, unreadable, not
        to be trusted: a link, another user's, writable by others; or failing ``check``)."""
        return self.check(key)[0]

    def check(self, key: str) -> "tuple[Binary | None, str | None]":
        """(binary, None) for an entry to serve; (None, why) otherwise (why is None when there is no
        entry at all). Beyond the checksum, ``cache_entry.entry_problem``: field types, the key's
        material, the ELF's SM against the key's arch, the kernel's symbol and register count."""
        path = self.entry_path(key)
        try:
            if not os.path.lexists(path):
                return None, None
            if not self.usable():
                return None, "the cache root is refused"
            fs.check_dir(path.parent, self.layer)
            fs.check_dir(path, self.layer)
            meta = load_json(fs.read_private(path / _META, self.layer))
            cubin = fs.read_private(path / _CUBIN, self.layer)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EPERM):
                fs.warn_once(path, f"ignoring the cache entry {path}: {e.strerror}; remove it "
                                   f"('attngen cache clear') to let attngen rebuild it")
            return None, f"{Path(e.filename).name if e.filename else 'the entry'}: {e.strerror or e}"
        except ValueError as e:
            return None, f"meta.json does not parse ({e})"
        why = entry_problem(key, meta, cubin)
        if why:
            return None, why
        if not self.layer:
            try:  # last use, for prune's least-recently-used order (read-only roots stay as they are)
                os.utime(path / _META)
            except OSError:
                pass
        return Binary(cubin=cubin, kernel_name=meta["kernel_name"], arch=meta["arch"],
                      options=tuple(meta["options"]), nvrtc_version=meta["nvrtc"],
                      resources=Resources.from_dict(meta["resources"]), log=meta.get("log", ""),
                      compile_seconds=float(meta.get("compile_seconds", 0.0))), None

    def source(self, key: str) -> str | None:
        """The stored source of the entry (compressed or, from earlier versions, plain), or None."""
        try:
            return unpack_source(fs.read_private(self.entry_path(key) / _SOURCE, self.layer))
        except OSError:
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
        return self.put_files(key, {_CUBIN: binary.cubin, _SOURCE: pack_source(source),
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
            tmp = tmp_root / cache_layout.tmp_name(key)
            os.mkdir(tmp, 0o700)
        except OSError as e:
            self._unwritable(e)
            return False
        try:
            for name in sorted(files, key=lambda n: n == _META):
                fs.write_private(tmp / name, files[name])
            fs.make_dirs(self.root, final.parent)
            if os.path.lexists(final):
                there = self.get(key)
                if there is not None and there.kernel_name == _kernel_name_of(files.get(_META, b"")):
                    fs.remove_tree(tmp, self.root)
                    return True
                # A damaged entry, one of another kernel, or a link planted where the entry goes, is
                # moved aside, never followed.
                aside = tmp_root / f"corrupt.{key}.{uuid.uuid4().hex[:8]}"
                os.rename(final, aside)
                fs.remove_tree(aside, self.root, odd=True)
            os.rename(tmp, final)
            return True
        except OSError as e:
            fs.remove_tree(tmp, self.root)
            self._unwritable(e)
            return False

    def entry_files(self, key: str) -> "dict[str, bytes] | None":
        """The files of a valid entry (``get`` passes), or None."""
        return self.entry_files_checked(key)[0]

    def entry_files_checked(self, key: str) -> "tuple[dict[str, bytes] | None, str | None]":
        """(files, None) for a valid entry with all of ``ENTRY_FILES``; (None, why) otherwise."""
        binary, why = self.check(key)
        if binary is None:
            return None, why or "incomplete"
        try:
            return {n: fs.read_private(self.entry_path(key) / n, self.layer) for n in self.ENTRY_FILES}, None
        except OSError as e:
            return None, f"{Path(e.filename).name if e.filename else 'a file'}: {e.strerror or e}"

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
        for d in fs.real_subdirs(tmp_root):
            try:
                if not cache_layout.tmp_is_live(d.name, os.lstat(d).st_mtime, self.STALE_TMP_SECONDS):
                    fs.remove_tree(d, self.root)
            except OSError:
                continue

    def lock(self, key: str) -> "KeyLock | None":
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
        timeout = lock_timeout()
        try:
            fs.open_lock_file(path)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EPERM):
                raise CacheError(f"the lock file {path} is not to be trusted: "
                                 f"{'it is a symbolic link' if e.errno == errno.ELOOP else e.strerror}; "
                                 f"remove it (attngen recreates it)") from None
            self._unwritable(e)
            return None
        return KeyLock(path, timeout)

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
                    meta = load_json(fs.read_private(d / _META, self.layer))
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
        self.require("prune")
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
            if fs.remove_tree(e.path, self.root):
                removed.append((e.key, size))
                total -= size
        return removed

    def _locked(self, key: str) -> bool:
        return is_held(self.lock_path(key))

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

    def clear(self, report: "dict | None" = None) -> int:
        """Remove every entry, stale temporaries, free lock files, odd objects and the shard folders
        left empty (``cache_layout.clear``); returns how many entries were removed, and fills
        ``report`` with the details. Refused (``CacheError``) on a root that builds refuse. Only
        what is inside the root is touched: links are unlinked, never followed."""
        self.require("clear")
        got = cache_layout.clear(self)
        if report is not None:
            report.update(got)
        return got["removed"]

    def layout_problems(self) -> "list[tuple[str, str]]":
        """(path, why) of every odd object in the layout (``cache_layout``)."""
        return cache_layout.layout_problems(self.base)


# --- the in-process layer -----------------------------------------------------------------------
class MemoryLayer:
    """Binaries this process built or loaded, by key, whatever root they came from, and which
    roots hold them. Safe across threads."""

    def __init__(self):
        self._binaries: dict[str, Binary] = {}
        self._stored: dict[tuple[str, str], bool] = {}  # (root, key) -> whether that root holds it
        self._lock = threading.Lock()

    def get(self, root: str, key: str) -> "tuple[Binary | None, bool]":
        """(the binary of ``key`` or None, whether ``root`` holds it)."""
        with self._lock:
            return self._binaries.get(key), self._stored.get((root, key), False)

    def put(self, root: str, key: str, binary: Binary, stored: bool) -> None:
        with self._lock:
            self._binaries[key] = binary
            self._stored[(root, key)] = stored

    def clear(self) -> None:
        with self._lock:
            self._binaries.clear()
            self._stored.clear()

    def __len__(self) -> int:
        return len(self._binaries)


memory = MemoryLayer()


def _kernel_name_of(meta_bytes: bytes) -> "str | None":
    try:
        meta = load_json(meta_bytes)
    except ValueError:
        return None
    return meta.get("kernel_name") if isinstance(meta, dict) else None
