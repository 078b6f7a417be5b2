"""Cache bundles: one file that a CI job builds once and a thousand nodes unpack, so that no GPU
compiles at boot; and the check of a cache's entries.

A bundle is a tar file (gzip when its name ends in .gz) holding ``attngen-bundle.json`` first
(format, attngen and NVRTC versions, and per entry its key, arch, spec and the SHA-256 of every
file) and then each entry's files as ``<key>/<file>``. Importing trusts nothing in it: members
must be regular files with exactly the expected names (no links, no paths), every file must
match the manifest's checksum and every entry must pass the cache's own check (its meta names
its key, its cubin matches its checksum) before it is committed, atomically, like a compiled one.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import random
import re
import tarfile
import uuid
import zlib
from pathlib import Path

from .__version__ import __version__
from .cache import DiskCache
from .cache_entry import entry_problem, load_json
from .errors import CacheError

BUNDLE_FORMAT = 1
MANIFEST = "attngen-bundle.json"
_KEY = re.compile(r"[0-9a-f]{64}")


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def export_bundle(disk: DiskCache, path: "str | Path") -> dict:
    """Write every valid entry of ``disk`` into a bundle at ``path`` (atomically, 0600); returns
    the manifest, with "skipped": [(key, why)] for the entries left out."""
    from .compiler import nvrtc_version

    path = Path(path)
    if "\0" in str(path):
        raise CacheError(f"cannot write the bundle {str(path)!r}: a file name has no NUL character")
    entries, payload, skipped = [], [], []
    for e in disk.entries():
        files, why = disk.entry_files_checked(e.key)
        if files is None:
            skipped.append((e.key, why))  # damaged, incomplete or not to be trusted: not exported, but said
            continue
        entries.append({"key": e.key, "arch": e.meta.get("arch"), "spec": e.meta.get("spec_text"),
                        "files": {n: _sha(b) for n, b in sorted(files.items())}})
        payload += [(f"{e.key}/{n}", b) for n, b in sorted(files.items())]
    manifest = {"format": BUNDLE_FORMAT, "attngen": __version__, "nvrtc": nvrtc_version(),
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "entries": entries}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz" if path.name.endswith(".gz") else "w") as tar:
            for name, data in [(MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())] + payload:
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o600, 0
                tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise CacheError(f"could not write the bundle {path}: {e.strerror or e}") from None
    return {**manifest, "skipped": skipped}


def import_bundle(disk: DiskCache, path: "str | Path", *, rebuild: "int | None" = 0) -> dict:
    """Commit every entry of the bundle at ``path`` that passes its checks into ``disk``; returns
    {"imported", "present", "rejected": [(key or member, why)], "other_versions", "rebuilt"}. A file
    that is not a bundle of this format is a ``CacheError``.

    ``rebuild``: how many entries, chosen at random, to compile again here and compare byte for byte
    before anything is committed (None: all). NVRTC's output is the same in every process, so a
    difference means the cubin is not what its key's spec compiles to (a forged bundle that is
    consistent in itself); the whole bundle is then refused."""
    from .compiler import nvrtc_version

    path = Path(path)
    if "\0" in str(path):
        raise CacheError(f"{str(path)!r} is not a readable attngen bundle: a file name has no NUL character")
    try:
        tar = tarfile.open(path, mode="r:*")
    # (its message lists each compression's own error: not for a user; a gzip header that promises more bytes than
    # the file holds ends in EOFError, past tarfile's own errors)
    except (tarfile.TarError, EOFError, zlib.error):
        raise CacheError(f"{path} is not a readable attngen bundle (not a tar file, plain or gzip)") from None
    except OSError as e:
        raise CacheError(f"{path} is not a readable attngen bundle: {e.strerror or e}") from None
    rejected: list[tuple[str, str]] = []
    files: dict[str, dict[str, bytes]] = {}
    manifest = None
    try:
        with tar:
            for m in tar:
                if m.name == MANIFEST and manifest is None and m.isfile():
                    manifest = _load_manifest(tar.extractfile(m).read(), path)
                    continue
                key, _, name = m.name.partition("/")
                if not (m.isfile() and _KEY.fullmatch(key) and name in DiskCache.ENTRY_FILES):
                    rejected.append((m.name, "not a regular file named <key>/<entry file> (links and paths are refused)"))
                    continue
                files.setdefault(key, {})[name] = tar.extractfile(m).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
        raise CacheError(f"{path} is not a readable attngen bundle (truncated or damaged: "
                         f"{getattr(e, 'strerror', None) or type(e).__name__})") from None
    if manifest is None:
        raise CacheError(f"{path} has no {MANIFEST}: not an attngen bundle")
    if not disk.usable():
        raise CacheError(f"the cache root {disk.root} cannot be used (see the warning above); nothing imported")
    good: dict[str, dict[str, bytes]] = {}
    for e in manifest["entries"]:
        key = e.get("key") if isinstance(e, dict) else None
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            rejected.append((str(key if isinstance(e, dict) else e)[:80], "not a cache key"))
            continue
        want, got = e.get("files"), files.get(key, {})
        want = want if isinstance(want, dict) else {}
        bad = sorted(n for n in DiskCache.ENTRY_FILES if n not in got or _sha(got[n]) != want.get(n))
        if bad:
            rejected.append((key, f"{', '.join(bad)} missing or not matching the bundle's checksums"))
            continue
        why = _entry_problem(key, got)
        if why:
            rejected.append((key, why))
            continue
        good[key] = got
    keys = sorted(good)
    sample = keys if rebuild is None else random.SystemRandom().sample(keys, min(rebuild, len(keys)))
    forged = False
    for key in sample:
        why = rebuild_problem(key, good.get(key, {}))
        if why:
            rejected.append((key, why))
            forged |= why.startswith("rebuilt here")
            good.pop(key)
    keys = sorted(good)
    if forged:
        # One forged entry discredits the bundle's source: nothing of it is committed.
        return {"imported": 0, "present": 0, "rejected": rejected, "bundle_attngen": manifest.get("attngen"),
                "bundle_nvrtc": manifest.get("nvrtc"), "other_versions": False, "rebuilt": len(sample),
                "refused": True}
    imported = present = 0
    for key in keys:
        got = good[key]
        if disk.get(key) is not None:
            present += 1
        elif disk.put_files(key, got) and disk.get(key) is not None:
            imported += 1
        else:
            raise CacheError(f"could not write the entry {key} into {disk.root}")
    other = manifest.get("nvrtc") != nvrtc_version() or manifest.get("attngen") != __version__
    return {"imported": imported, "present": present, "rejected": rejected, "bundle_attngen": manifest.get("attngen"),
            "bundle_nvrtc": manifest.get("nvrtc"), "other_versions": other, "rebuilt": len(sample), "refused": False}


def _load_manifest(raw: bytes, path: Path) -> dict:
    try:
        m = load_json(raw)
    except ValueError as e:
        raise CacheError(f"{path}: {MANIFEST} is not JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != BUNDLE_FORMAT or not isinstance(m.get("entries"), list):
        raise CacheError(f"{path}: {MANIFEST} is not a format-{BUNDLE_FORMAT} bundle manifest")
    return m


def _entry_problem(key: str, files: dict[str, bytes]) -> "str | None":
    """The cache's own check of an entry (``cache_entry.entry_problem``), before it is committed."""
    try:
        meta = load_json(files["meta.json"])
    except ValueError as e:
        return f"its meta.json does not parse ({e})"
    why = entry_problem(key, meta, files["kernel.cubin"])
    if why:
        return why
    from .errors import AttngenError
    from .spec import parse_spec

    try:
        named = parse_spec(meta["key_material"]["spec"]).kernel_name
    except (AttngenError, KeyError, TypeError):
        return None  # another version's spec: its entries are never asked for here (see other_versions)
    if named != meta["kernel_name"]:
        return f"its kernel_name {meta['kernel_name']!r:.80} is not the one its key's spec names ({named})"
    return None


def rebuild_problem(key: str, files: dict[str, bytes]) -> "str | None":
    """Compile the entry's spec here and compare the cubin byte for byte; why it differs, or None."""
    from .arch import get_arch
    from .cache import key_material, key_of
    from .compiler import compile as nvrtc_compile, compile_options
    from .errors import AttngenError
    from .render import render
    from .spec import parse_spec

    material = load_json(files["meta.json"])["key_material"]
    try:
        a = get_arch(material["arch"])
        spec = parse_spec(material["spec"])
        if key_of(key_material(spec, a, compile_options(a))) != key:
            return ("could not be rebuilt to compare: this install's key for its spec differs (another attngen, "
                    "NVRTC or template version built it)")
        b = nvrtc_compile(render(spec), a, kernel_name=spec.kernel_name, entries=spec.entries)
    except (AttngenError, KeyError, TypeError) as e:
        return f"could not be rebuilt to compare: {e}"
    if b.cubin != files["kernel.cubin"]:
        return "rebuilt here, its cubin differs from the bundle's: not what its key's spec compiles to"
    return None


def verify(disk: DiskCache) -> dict:
    """Check every entry under ``disk`` and the layout around them: {"checked", "valid",
    "damaged": [(key, path)], "problems": [(path, why)]} (every damaged entry and every odd object)."""
    damaged, problems = [], []
    ents = disk.entries()
    for e in ents:
        binary, why = disk.check(e.key)
        if binary is None:
            damaged.append((e.key, str(e.path)))
            problems.append((str(e.path), why or "incomplete"))
    problems += disk.layout_problems()
    return {"checked": len(ents), "valid": len(ents) - len(damaged), "damaged": damaged, "problems": problems}


__all__ = ["export_bundle", "import_bundle", "verify"]
