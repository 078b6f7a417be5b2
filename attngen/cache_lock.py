"""The per-key file lock of the cache: ``flock`` on ``v1/locks/<key>.lock`` (the same lock
``filelock`` takes, so either sees the other), with the holder's pid and host written into the
file so that a waiter can tell a lock that will never be released from one that is busy.

A holder that has exited while a process it forked still holds the open file, or that is stopped
(SIGSTOP, a suspended job), would keep every other process waiting for the whole timeout. A
waiter on the same host that finds the holder so for ``STALE_GRACE`` seconds breaks the lock: it
removes the lock file (only if it is still the file the holder locked) and locks a new one. The
stale holder, if it ever runs on, commits its entry atomically like any other writer, so the
worst outcome of breaking is one compile more.

Lock files of no holder are removed by ``attngen cache clear`` (``remove_if_free``); a process
that locked a file that was removed meanwhile notices (its inode is no longer at the path) and
locks the new one.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from . import fs

log = logging.getLogger("attngen")

STALE_GRACE = 1.5  # seconds a holder must be seen dead or stopped before its lock is broken
_POLL = 0.05


class LockTimeout(Exception):
    """The lock was not had within the timeout."""


def _open(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        why = fs.distrust(os.fstat(fd))
        if why:
            raise OSError(errno.EPERM, why, str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(fd: int) -> "tuple[int, str] | None":
    try:
        pid, host = os.pread(fd, 300, 0).decode().split()
        return int(pid), host
    except (OSError, ValueError):
        return None


def holder_state(pid: int) -> str:
    """"running", "stopped" or "exited" for a process of this host."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "exited"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        except OSError:
            pass
        return "running"
    return {"T": "stopped", "t": "stopped", "Z": "exited", "X": "exited"}.get(state, "running")


def _stale(holder: "tuple[int, str] | None") -> "str | None":
    if holder is None or holder[1] != socket.gethostname() or holder[0] == os.getpid():
        return None  # another host's process (not ours to judge), or no record (another tool's lock)
    state = holder_state(holder[0])
    return None if state == "running" else f"process {holder[0]} {'has exited' if state == 'exited' else 'is stopped'}"


class KeyLock:
    """An exclusive lock on ``path`` with a ``timeout`` in seconds; a context manager."""

    def __init__(self, path: Path, timeout: float):
        self.path = Path(path)
        self.timeout = timeout
        self._fd: "int | None" = None

    def acquire(self) -> "KeyLock":
        deadline = time.monotonic() + self.timeout
        stale_since: "float | None" = None
        while True:
            fd = _open(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                why = _stale(_holder(fd))
                now = time.monotonic()
                if why is None:
                    stale_since = None
                elif stale_since is None:
                    stale_since = now
                elif now - stale_since >= STALE_GRACE:
                    self._break(fd, why)
                    stale_since = None
                os.close(fd)
                if now >= deadline:
                    raise LockTimeout(str(self.path)) from None
                time.sleep(_POLL)
                continue
            except BaseException:
                os.close(fd)
                raise
            try:
                here = os.lstat(self.path)
            except FileNotFoundError:
                here = None
            if here is None or not os.path.samestat(here, os.fstat(fd)):
                os.close(fd)  # removed or broken while we waited: lock the file now at the path
                continue
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
            self._fd = fd
            return self

    def _break(self, fd: int, why: str) -> None:
        try:
            if os.path.samestat(os.lstat(self.path), os.fstat(fd)):
                os.unlink(self.path)
                log.warning("broke the cache lock %s: its holder, %s, would never release it", self.path, why)
        except OSError:
            pass

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> "KeyLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def is_held(path: Path) -> bool:
    """Whether some process holds the lock at ``path`` (a missing file is not held)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False


def remove_if_free(dir_fd: int, name: str) -> bool:
    """Remove the lock file ``name`` of the folder ``dir_fd`` unless a process holds it; True if removed.
    It is locked while it is removed, so no process is holding it at that moment."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.path.samestat(os.stat(name, dir_fd=dir_fd, follow_symlinks=False), os.fstat(fd)):
            os.unlink(name, dir_fd=dir_fd)
            return True
        return False
    except OSError:
        return False
    finally:
        os.close(fd)
