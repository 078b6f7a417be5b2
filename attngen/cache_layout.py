"""The layout around the entries of a cache root: what ``verify`` flags and ``clear`` repairs.

Under ``v1/`` attngen makes only folders: two-character shards holding entry folders named by
their key, ``tmp/`` (entries being written), ``locks/`` (lock files), ``tuned/`` (JSON files). A
file or a link where one of those folders belongs, a folder where a lock file belongs, or
anything attngen never makes is an *odd object*: ``verify`` names each, and ``clear`` removes it
(a link is unlinked, never followed, so nothing outside the root is touched).

``clear`` leaves alone what other processes are using: a temporary folder younger than
``DiskCache.STALE_TMP_SECONDS`` (a write in progress; it is renamed into place in milliseconds)
and a lock file that a process holds. It reports what it removed and what it left, so that an
entry a builder commits while it runs is reported as added, not as one it failed to remove.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import stat
import time
import uuid
from pathlib import Path

from . import fs
from .cache_lock import holder_state, remove_if_free

_KEY = re.compile(r"[0-9a-f]{64}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_FOLDERS = ("tmp", "locks", "tuned")


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a folder"
    if stat.S_ISREG(st.st_mode):
        return "a file"
    return "a special file"


def _children(path: Path) -> "list[tuple[str, os.stat_result]]":
    out = []
    try:
        with os.scandir(path) as it:
            for e in it:
                try:
                    out.append((e.name, e.stat(follow_symlinks=False)))
                except OSError:
                    continue
    except OSError:
        return []
    return sorted(out)


def _lstat(path: Path) -> "os.stat_result | None":
    try:
        return os.lstat(path)
    except OSError:
        return None


def layout_problems(base: Path) -> "list[tuple[str, str]]":
    """(path, why) of every odd object under ``base`` (the root's ``v1``); entries themselves are
    checked by ``DiskCache.check``."""
    st = _lstat(base)
    if st is None:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [(str(base), f"{_kind(st)} where the cache's folder belongs")]
    out = []
    for name, cst in _children(base):
        p = base / name
        if name in _FOLDERS or _SHARD.fullmatch(name):
            if not stat.S_ISDIR(cst.st_mode):
                out.append((str(p), f"{_kind(cst)} where a folder belongs"))
                continue
        elif name != "jinja":
            out.append((str(p), f"{_kind(cst)} that attngen does not make"))
            continue
        for cname, gst in _children(p) if stat.S_ISDIR(cst.st_mode) else ():
            why = _child_problem(name, cname, gst)
            if why:
                out.append((str(p / cname), why))
    return out


def _child_problem(folder: str, name: str, st: os.stat_result) -> "str | None":
    kind = _kind(st)
    if folder == "locks":
        return None if stat.S_ISREG(st.st_mode) else f"{kind} where a lock file belongs"
    if folder == "tuned":
        return None if stat.S_ISREG(st.st_mode) else f"{kind} where a tuned-configuration file belongs"
    if folder in ("tmp", "jinja"):
        return None if stat.S_ISDIR(st.st_mode) or folder == "jinja" else f"{kind} where a temporary folder belongs"
    if not stat.S_ISDIR(st.st_mode):
        return f"{kind} where an entry folder belongs"
    if not (_KEY.fullmatch(name) and name.startswith(folder)):
        return "a folder not named by a key of this shard"
    return None


def clear(disk) -> dict:
    """Remove every entry of ``disk`` (a ``DiskCache`` whose root is trusted), stale temporaries,
    free lock files and odd objects; returns {"removed", "failed": [paths], "live_tmp",
    "locks_removed", "repaired": [paths]}."""
    root, base = disk.root, disk.base
    report = {"removed": 0, "failed": [], "live_tmp": 0, "locks_removed": 0, "repaired": []}
    st = _lstat(base)
    if st is None:
        return report
    if not stat.S_ISDIR(st.st_mode):  # v1 itself a file or a link: unlinked, whatever it points to
        if fs.remove_tree(base, root, odd=True):
            report["repaired"].append(str(base))
        return report
    odd = {p for p, _ in layout_problems(base)}
    for e in disk.entries():
        if fs.remove_tree(e.path, root):
            report["removed"] += 1
        else:
            report["failed"].append(str(e.path))
    for p in sorted(odd):
        if os.path.lexists(p) and fs.remove_tree(Path(p), root, odd=True):
            report["repaired"].append(p)
    _clear_tmp(disk, report)
    # Jinja's bytecode cache of earlier versions lived here; it held Python code objects.
    fs.remove_tree(base / "jinja", root)
    _clear_locks(disk, report)
    for name, cst in _children(base):
        if _SHARD.fullmatch(name) and stat.S_ISDIR(cst.st_mode):
            try:
                os.rmdir(base / name)  # only when empty
            except OSError:
                pass
    return report


def host_tag() -> str:
    """A short tag of this host for temporary names, so that their writer's pid can be judged here."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def tmp_name(key: str) -> str:
    return f"{key}.{host_tag()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"


def tmp_is_live(name: str, mtime: float, stale_seconds: float) -> bool:
    """Whether the temporary folder ``name`` may be another process's write in progress: its writer
    (named in it) still exists on this host, or, written elsewhere or by an earlier version, it is
    younger than ``stale_seconds``."""
    parts = name.split(".")
    if len(parts) == 4 and parts[1] == host_tag() and parts[2].isdigit():
        return holder_state(int(parts[2])) != "exited"
    return time.time() - mtime < stale_seconds


def _clear_tmp(disk, report: dict) -> None:
    tmp = disk.base / "tmp"
    for name, st in _children(tmp):
        if stat.S_ISDIR(st.st_mode) and tmp_is_live(name, st.st_mtime, disk.STALE_TMP_SECONDS):
            report["live_tmp"] += 1  # another process's write in progress
            continue
        fs.remove_tree(tmp / name, disk.root, odd=True)


def _clear_locks(disk, report: dict) -> None:
    try:
        fd = fs.open_under(disk.root, (disk.base.name, "locks"))
    except OSError:
        return
    try:
        with os.scandir(fd) as it:
            names = [e.name for e in it if e.is_file(follow_symlinks=False)]
        for name in names:
            if remove_if_free(fd, name):
                report["locks_removed"] += 1
    except OSError:
        pass
    finally:
        os.close(fd)
