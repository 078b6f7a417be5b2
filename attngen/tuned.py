"""Tuned configurations: the winners ``attngen tune`` stores, and how an op picks one.

``attngen tune`` stores the winner of a search per (family, untuned spec fields, arch, GPU name,
NVRTC version, attngen version, size): one JSON file per arch under the cache root,
``{"format": 1, "entries": [...]}``, rewritten whole (temp file + os.replace) under a file lock.
The size is the family's tuning size (prefill: seqlen; decode: the cache length), stored as
``seqlen``. A reader that finds the file missing, unreadable or malformed sees no entries; a
malformed entry is skipped alone. Tuning results are not compiled code: ``DiskCache.clear``
keeps them, ``TunedStore.clear`` removes them. Bump ``TUNED_FORMAT`` when an entry's meaning
changes (files of another format are then ignored).
"""

from __future__ import annotations

import bisect
import errno
import json
import math
import os
import threading
import uuid
from pathlib import Path

from .__version__ import __version__
from .arch import Arch, get_arch
from . import fs, runtime
from .cache import LAYOUT_VERSION
from .cache_env import cache_root, lock_timeout
from .cache_entry import load_json
from .compiler import nvrtc_version
from .errors import AttngenError, CacheError, SpecError
from .spec import Spec, resolve, validate

TUNED_FORMAT = 1
# What must agree for a stored winner to apply; "seqlen" is the bucket within a match.
TUNED_MATCH = ("family", "fields", "arch", "gpu", "nvrtc", "attngen")

# (root, arch) -> entries of that file, read once per process (a lookup is then a filter in memory).
_tuned_memo: dict[tuple[str, str], list[dict]] = {}
_tuned_lock = threading.Lock()


def clear_tuned_memo() -> None:
    with _tuned_lock:
        _tuned_memo.clear()


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

    def path(self, arch: Arch) -> Path:
        return self.base / f"{arch.name}.json"

    def lock_path(self, arch: Arch) -> Path:
        return self.root / LAYOUT_VERSION / "locks" / f"tuned-{arch.name}.lock"

    def read(self, arch: Arch) -> list[dict]:
        """Every well-formed entry of ``arch``'s file; [] when it is missing, unreadable or malformed."""
        try:
            data = load_json(fs.read_private(self.path(arch)))
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
                arch = get_arch(f.stem)  # a file's name is data: read back into an Arch here
            except AttngenError:  # a file named after no arch: not ours
                continue
            out += self.read(arch)
        return out

    def put(self, entry: dict) -> Path:
        """Store ``entry``, replacing the one with the same match fields and seqlen; returns the file.

        Raises ``CacheError`` where the root cannot be written or the lock is not had in time.
        """
        import filelock  # here, not at the top: its import is a good part of attngen's, and only a write locks

        if not _valid_tuned(entry):
            raise CacheError(f"not a tuned entry: {json.dumps(entry, sort_keys=True)[:300]}")
        arch = get_arch(entry["arch"])  # the entry's arch is data (text): read into an Arch once
        path, lock_path = self.path(arch), self.lock_path(arch)
        try:
            why = fs.root_problem(self.root)
            if why:
                raise OSError(errno.EPERM, f"the cache root is not to be trusted: {why}", str(self.root))
            fs.make_dirs(self.root, lock_path.parent)
            fs.make_dirs(self.root, path.parent)
            fs.open_lock_file(lock_path)
            with filelock.FileLock(str(lock_path), timeout=lock_timeout(), mode=0o600):
                ident = _tuned_identity(entry)
                entries = [e for e in self.read(arch) if _tuned_identity(e) != ident] + [entry]
                entries.sort(key=lambda e: _tuned_identity(e))
                tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
                try:
                    fs.write_private(tmp, (json.dumps({"format": TUNED_FORMAT, "entries": entries}, indent=1, sort_keys=True)
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
        with _tuned_lock:
            _tuned_memo[(str(self.root), arch.name)] = entries
        return path

    def clear(self) -> int:
        """Remove every tuned entry; returns how many there were."""
        why = fs.root_problem(self.root)
        if why:
            raise CacheError(f"refusing to clear the tuned configurations under {self.root}: {why}")
        n = len(self.entries())
        fs.remove_tree(self.base, self.root)
        with _tuned_lock:
            for k in [k for k in _tuned_memo if k[0] == str(self.root)]:
                del _tuned_memo[k]
        return n


def tuned_entries(arch: Arch, root: "str | Path | None" = None) -> list[dict]:
    """``arch``'s tuned entries under ``root`` (default: the environment's), read once per process."""
    store = TunedStore(root)
    k = (str(store.root), arch.name)
    got = _tuned_memo.get(k)
    if got is None:
        got = store.read(arch)
        with _tuned_lock:
            _tuned_memo[k] = got
    return got


def match_tuned(entries: list[dict], **match) -> list[dict]:
    """The entries whose ``TUNED_MATCH`` fields equal ``match``'s (every one of them must be given)."""
    missing = set(TUNED_MATCH) - set(match)
    if missing:
        raise TypeError(f"match_tuned needs {', '.join(sorted(missing))}")
    return [e for e in entries if all(e.get(k) == match[k] for k in TUNED_MATCH)]


# --- how an op picks a stored winner -------------------------------------------------------------

def tuned_disabled() -> bool:
    """``ATTNGEN_NO_TUNED=1``: ignore stored winners (read when an op makes a plan)."""
    return os.environ.get("ATTNGEN_NO_TUNED", "").strip().lower() not in ("", "0", "false", "no")


def tuned_choices(base: Spec, arch: Arch, gpu: str, entries: list[dict], *,
                  nvrtc: str, version: str = __version__) -> list[tuple[int, Spec]]:
    """(size, spec) of every stored winner that applies to ``base``'s untuned fields on this arch,
    GPU, NVRTC and attngen version, sorted by size. Entries whose tuning does not make a valid
    spec for ``arch`` (hand-edited, or from another version's rules) are skipped."""
    # Fields added to the spec after an entry was stored take their defaults (the behaviour the
    # entry was measured with), so a new field does not orphan every stored winner.
    defaults = type(base)().to_dict()
    untuned = base.untuned_dict()

    def filled(e):
        if e.get("family") != base.family or not isinstance(e.get("fields"), dict):
            return e
        # (.get: a field a spec leaves out of its dict while unset, as decode's kv_dtype, defaults to None)
        return {**e, "fields": {**{k: defaults.get(k) for k in untuned if k not in e["fields"]}, **e["fields"]}}

    found = match_tuned([filled(e) for e in entries], family=base.family, fields=untuned, arch=arch.name, gpu=gpu,
                        nvrtc=nvrtc, attngen=version)
    out: dict[int, Spec] = {}
    for e in found:
        try:
            t = {k: e["tuning"].get(k, defaults[k]) for k in base.TUNING_FIELDS}
            spec = base.replace(**t)
            if not spec.is_resolved:
                continue
            validate(spec, arch)
        except (KeyError, TypeError, SpecError):
            continue
        out[e["seqlen"]] = spec
    return sorted(out.items())


def stored_choices(base: Spec, device: int) -> list[tuple[int, Spec]]:
    """``tuned_choices`` for ``device`` from the environment's store; [] when tuning is disabled or
    the store cannot be read (it is an optimisation: a failed lookup means the default)."""
    if tuned_disabled():
        return []
    arch = runtime.device_arch(device)
    try:
        return tuned_choices(base, arch, runtime.driver().device_name(device), tuned_entries(arch), nvrtc=nvrtc_version())
    except (AttngenError, OSError):
        return []


def bucket_bounds(sizes: list[int]) -> list[float]:
    """Boundaries between neighbouring tuned sizes: their geometric means. With
    ``bisect_right(bounds, s)`` a size goes to the nearest tuned one by log distance (a tie to
    the larger)."""
    return [math.sqrt(a * b) for a, b in zip(sizes, sizes[1:])]


def choose_spec(base: Spec, arch: Arch, size: int, choices: list[tuple[int, Spec]]) -> Spec:
    """The spec a call of ``size`` runs: the tuned winner of the nearest size bucket (``choices``
    from ``tuned_choices``), else the arch's default for ``base``."""
    if not choices:
        return resolve(base, arch)
    i = bisect.bisect_right(bucket_bounds([s for s, _ in choices]), size)
    return choices[i][1]
