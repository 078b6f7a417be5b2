"""Files under a cache root, handled so that the root cannot be turned against its user.

A cache root is often shared (CI, NFS, a team's home), the way pip's and ssh's folders are, so
the same rules hold: what attngen creates is private (folders 0700, files 0600, whatever the
umask); a folder or file owned by another user, or writable by group or others, is not trusted
for reading or writing; symbolic links inside the root are never followed (the root itself may
be a link: the user named it). Nothing executable on the CPU is ever read from a root.

Each refusal is logged once per path as a WARNING of the ``attngen`` logger, naming the path,
what is wrong and the fix; callers treat a refused path as absent (a cache miss, a write that
does not happen).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import threading
from pathlib import Path

log = logging.getLogger("attngen")

_told: set[str] = set()
_told_lock = threading.Lock()


def warn_once(path: "str | Path", message: str) -> None:
    """Log ``message`` as a WARNING the first time ``path`` is refused in this process."""
    key = str(path)
    with _told_lock:
        if key in _told:
            return
        _told.add(key)
    log.warning("%s", message)


def forget_warnings() -> None:
    with _told_lock:
        _told.clear()


def distrust(st: os.stat_result, root_ok: bool = False) -> "str | None":
    """Why a file or folder with this status is not to be trusted, or None. ``root_ok``: owned by
    root is fine too (read-only cache layers a system installs)."""
    uid = os.geteuid()
    if st.st_uid != uid and not (root_ok and st.st_uid == 0):
        return f"it is owned by uid {st.st_uid}, not by you (uid {uid})" + (" or root" if root_ok else "")
    if st.st_mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("others", 0o002)) if st.st_mode & bit)
        return f"it is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def root_problem(root: Path, root_ok: bool = False) -> "str | None":
    """Why ``root`` (followed if it is a link) cannot serve as a cache root, or None; a root that
    does not exist yet is fine (attngen creates it private)."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    return distrust(st, root_ok)


def check_dir(path: Path, root_ok: bool = False) -> None:
    """Raise OSError unless ``path`` is a real folder (not a link) that can be trusted."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise OSError(errno.ELOOP, "a symbolic link inside the cache root; attngen does not follow it", str(path))
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(errno.ENOTDIR, "not a folder", str(path))
    why = distrust(st, root_ok)
    if why:
        raise OSError(errno.EPERM, why, str(path))


def make_dirs(root: Path, path: Path) -> None:
    """Create ``path`` (inside ``root``) and the folders between, each 0700; every folder on the way
    from ``root`` down must be a trusted real folder. ``root`` itself is created 0700 if missing, and
    so are the folders above it that do not exist yet (a fresh machine has no ``~/.cache``)."""
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        missing = []
        p = root
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                pass
    rel = path.relative_to(root)
    p = root
    for part in rel.parts:
        p = p / part
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            check_dir(p)


def write_private(path: Path, data: bytes) -> None:
    """Write a new file 0600 (never through a link, never over an existing file), synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_private(path: Path, root_ok: bool = False) -> bytes:
    """Read a file that is not a link and is owned by you and not writable by others; OSError
    otherwise (a caller treats that as absent)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        why = distrust(os.fstat(f.fileno()), root_ok)
        if why:
            raise OSError(errno.EPERM, why, str(path))
        return f.read()


def open_lock_file(path: Path) -> None:
    """Create (or check) a lock file: 0600, not a link, yours; OSError otherwise."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        why = distrust(os.fstat(fd))
        if why:
            raise OSError(errno.EPERM, why, str(path))
    finally:
        os.close(fd)


def remove_tree(path: Path) -> bool:
    """Remove a folder attngen made, without following links: a link or a non-folder at ``path`` is
    left alone (False). shutil.rmtree walks by file descriptor and does not follow links inside."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    if not stat.S_ISDIR(st.st_mode):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def real_subdirs(path: Path) -> list[Path]:
    """The folders directly inside ``path`` that are real folders (links are skipped), sorted."""
    out = []
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    out.append(Path(e.path))
    except OSError:
        return []
    return sorted(out)
