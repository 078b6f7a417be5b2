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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
# Deeper than any layout attngen makes; a tree planted deeper is left where it is.
_MAX_DEPTH = 32


def open_under(root: Path, parts: "tuple[str, ...]") -> int:
    """A file descriptor of the folder ``root/parts...``, opened from ``root``'s descriptor one
    component at a time with O_NOFOLLOW, so that no component below the root is a link (the root
    itself may be one: the user named it). OSError (ELOOP for a link) otherwise; the caller closes it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts:
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def _rmtree_at(parent_fd: int, name: str, st: os.stat_result, depth: int = 0) -> None:
    """Remove the folder ``name`` of ``parent_fd`` whose lstat is ``st``; links inside are unlinked,
    never followed. Errors leave what could not be removed in place (the caller checks)."""
    if depth > _MAX_DEPTH:
        return
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return
    try:
        if not os.path.samestat(st, os.fstat(fd)):  # swapped for something else since it was looked at
            return
        with os.scandir(fd) as it:
            children = list(it)
        for e in children:
            try:
                est = e.stat(follow_symlinks=False)
                if stat.S_ISDIR(est.st_mode):
                    _rmtree_at(fd, e.name, est, depth + 1)
                else:
                    os.unlink(e.name, dir_fd=fd)
            except OSError:
                continue
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent_fd)
    except OSError:
        pass


def remove_tree(path: Path, root: "Path | None" = None, *, odd: bool = False) -> bool:
    """Remove the folder ``path`` inside ``root`` (default: ``path``'s parent) without ever leaving
    ``root``: every component from the root down is opened from its parent's descriptor with
    O_NOFOLLOW, and a link at any level, ``path``'s own parents included, stops the removal there.
    Inside the folder, links are unlinked, never followed. ``odd``: a file or link at ``path``
    itself is unlinked too (a repair; unlinking a link never touches what it points to); else it is
    left alone. True when nothing is left at ``path``."""
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return False
    if not parts:
        return False
    try:
        pfd = open_under(root, parts[:-1])
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        try:
            st = os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        if stat.S_ISDIR(st.st_mode):
            _rmtree_at(pfd, parts[-1], st)
        elif odd:
            try:
                os.unlink(parts[-1], dir_fd=pfd)
            except OSError:
                pass
        else:
            return False
        try:
            os.stat(parts[-1], dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError:
            pass
        return False
    finally:
        os.close(pfd)


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


def cupy_cache_dir() -> None:
    """Make sure importing CuPy cannot fail on its kernel cache folder. CuPy creates that folder
    (``CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``) when it is imported, and the import fails
    where it cannot (a container run under an arbitrary user, with no writable home). attngen
    compiles through NVRTC directly and never uses that cache, so there CuPy is pointed at a
    private temporary folder instead."""
    if os.environ.get("CUPY_CACHE_DIR"):
        return
    try:
        os.makedirs(os.path.expanduser(os.path.join("~", ".cupy", "kernel_cache")), exist_ok=True)
    except OSError:
        import tempfile

        os.environ["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-cupy-")
