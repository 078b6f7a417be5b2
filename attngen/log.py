"""The ``attngen`` logger's setup: ``ATTNGEN_LOG`` (read when a build is asked for) and the
``attngen: warning: ...`` lines of the command line. Nothing here runs at import."""

from __future__ import annotations

import logging
import os

from .errors import AttngenError

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
