"""The cache's configuration, read from the environment each time it is used (never at import):
``ATTNGEN_CACHE_DIR`` / ``XDG_CACHE_HOME``, ``ATTNGEN_CACHE_LAYERS``, ``ATTNGEN_LOCK_TIMEOUT``,
``ATTNGEN_ALWAYS_COMPILE`` and ``ATTNGEN_LOG``. A value that cannot be meant is refused by name
(``ATTNGEN_LOG``, ``ATTNGEN_LOCK_TIMEOUT``) or warned about (a layer that is not a folder), never
passed over in silence."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from . import fs
from .errors import AttngenError, CacheError

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
    level = _LOG_LEVELS.get(value)
    if level is None:
        if value:  # a misspelt level would otherwise hide every record it was set to show
            raise AttngenError(f"ATTNGEN_LOG={value!r:.60} is not allowed; allowed: {', '.join(_LOG_LEVELS)} "
                               f"(or unset: logging is left to the application)")
        _log_setting[0] = value
        return
    _log_setting[0] = value
    log.setLevel(level)
    _own_handler()


class _Prefixed(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"attngen: {record.levelname.lower()}: {record.getMessage()}"


def _own_handler() -> "logging.Handler | None":
    if any(getattr(h, "_attngen", False) for h in log.handlers):
        return None
    h = logging.StreamHandler()
    h.setFormatter(_Prefixed())
    h._attngen = True
    log.addHandler(h)
    return h


def prefixed_warnings():
    """For the command line and its workers, whose users read stderr: the ``attngen`` logger's
    warnings (a refused root, a skipped layer, a broken lock) as ``attngen: warning: ...`` lines,
    not the bare messages of Python's last-resort handler (``ATTNGEN_LOG`` still sets the level).
    Returns a function that undoes it."""
    h = _own_handler()
    level = log.level
    if level == logging.NOTSET:
        log.setLevel(logging.WARNING)

    def undo() -> None:
        if h is not None:
            log.removeHandler(h)
        log.setLevel(level)

    return undo


def always_compile() -> bool:
    """``ATTNGEN_ALWAYS_COMPILE=1``: compile every request afresh, bypassing the memory and disk
    caches (as Triton's TRITON_ALWAYS_COMPILE does); the result is still stored."""
    return os.environ.get("ATTNGEN_ALWAYS_COMPILE", "").strip().lower() not in ("", "0", "false", "no")


def cache_root() -> Path:
    """The cache root, read from the environment each time it is asked for."""
    env = os.environ.get("ATTNGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: a relative path in the variable is invalid and is ignored.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "attngen"


def lock_timeout() -> float:
    """``ATTNGEN_LOCK_TIMEOUT``: seconds to wait for a cache lock (default 600; empty is unset)."""
    raw = os.environ.get("ATTNGEN_LOCK_TIMEOUT", "").strip()
    if not raw:
        return 600.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise CacheError(f"ATTNGEN_LOCK_TIMEOUT={raw[:40]!r}{'...' if len(raw) > 40 else ''} is not allowed; "
                         f"allowed: seconds to wait for a cache lock, a finite number >= 0 (default 600)")
    return value


def cache_layers() -> list[Path]:
    """Read-only layers below the root, looked up in order after it: ``ATTNGEN_CACHE_LAYERS``
    (folders separated by ``os.pathsep``), read each time it is used."""
    out = []
    for p in os.environ.get("ATTNGEN_CACHE_LAYERS", "").split(os.pathsep):
        if not p.strip():
            continue
        path = Path(p).expanduser()
        if not path.is_dir():  # a layer not mounted yet, or a typo: said once, not silently passed over
            fs.warn_once(f"{path} (layer)", f"ATTNGEN_CACHE_LAYERS names {path}, which is "
                                            f"{'not a folder' if path.exists() else 'missing'}; it is skipped")
            continue
        out.append(path)
    return out


