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
import re
import tarfile
import uuid
from pathlib import Path

from .__version__ import __version__
from .cache import DiskCache
from .errors import CacheError

BUNDLE_FORMAT = 1
MANIFEST = "attngen-bundle.json"
_KEY = re.compile(r"[0-9a-f]{64}")


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def export_bundle(disk: DiskCache, path: "str | Path") -> dict:
    """Write every valid entry of ``disk`` into a bundle at ``path`` (atomically, 0600); returns
    the manifest."""
    from .compiler import nvrtc_version

    path = Path(path)
    entries, payload = [], []
    for e in disk.entries():
        files = disk.entry_files(e.key)
        if files is None:
            continue  # damaged or not to be trusted: not exported
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
    return manifest


def import_bundle(disk: DiskCache, path: "str | Path") -> dict:
    """Commit every entry of the bundle at ``path`` that passes its checks into ``disk``; returns
    {"imported", "present", "rejected": [(key or member, why)], "other_versions"}. A file that is
    not a bundle of this format is a ``CacheError``."""
    from .compiler import nvrtc_version

    path = Path(path)
    try:
        tar = tarfile.open(path, mode="r:*")
    except (OSError, tarfile.TarError) as e:
        raise CacheError(f"{path} is not a readable attngen bundle: {e}") from None
    rejected: list[tuple[str, str]] = []
    files: dict[str, dict[str, bytes]] = {}
    manifest = None
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
    if manifest is None:
        raise CacheError(f"{path} has no {MANIFEST}: not an attngen bundle")
    if not disk.usable():
        raise CacheError(f"the cache root {disk.root} cannot be used (see the warning above); nothing imported")
    imported = present = 0
    for e in manifest["entries"]:
        key, want, got = e.get("key"), e.get("files") or {}, files.get(e.get("key"), {})
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            rejected.append((str(key), "not a cache key"))
            continue
        bad = sorted(n for n in DiskCache.ENTRY_FILES if n not in got or _sha(got[n]) != want.get(n))
        if bad:
            rejected.append((key, f"{', '.join(bad)} missing or not matching the bundle's checksums"))
            continue
        if not _entry_ok(key, got):
            rejected.append((key, "its meta.json does not name this key and this cubin"))
            continue
        if disk.get(key) is not None:
            present += 1
        elif disk.put_files(key, got) and disk.get(key) is not None:
            imported += 1
        else:
            raise CacheError(f"could not write the entry {key} into {disk.root}")
    other = manifest.get("nvrtc") != nvrtc_version() or manifest.get("attngen") != __version__
    return {"imported": imported, "present": present, "rejected": rejected, "bundle_attngen": manifest.get("attngen"),
            "bundle_nvrtc": manifest.get("nvrtc"), "other_versions": other}


def _load_manifest(raw: bytes, path: Path) -> dict:
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise CacheError(f"{path}: {MANIFEST} is not JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != BUNDLE_FORMAT or not isinstance(m.get("entries"), list):
        raise CacheError(f"{path}: {MANIFEST} is not a format-{BUNDLE_FORMAT} bundle manifest")
    return m


def _entry_ok(key: str, files: dict[str, bytes]) -> bool:
    """The cache's own check of an entry: its meta names the key and the cubin's checksum."""
    try:
        meta = json.loads(files["meta.json"])
    except ValueError:
        return False
    return isinstance(meta, dict) and meta.get("key") == key and meta.get("cubin_sha256") == _sha(files["kernel.cubin"])


def verify(disk: DiskCache) -> dict:
    """Check every entry under ``disk``: {"checked", "valid", "damaged": [(key, path)]}."""
    damaged = []
    ents = disk.entries()
    for e in ents:
        if disk.get(e.key) is None:
            damaged.append((e.key, str(e.path)))
    return {"checked": len(ents), "valid": len(ents) - len(damaged), "damaged": damaged}


__all__ = ["export_bundle", "import_bundle", "verify"]
