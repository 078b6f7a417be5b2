"""The cache's configuration, read from the environment each time it is used (never at import):
``ATTNGEN_CACHE_DIR`` / ``XDG_CACHE_HOME``, ``ATTNGEN_CACHE_LAYERS``, ``ATTNGEN_LOCK_TIMEOUT`` and
``ATTNGEN_ALWAYS_COMPILE`` (``ATTNGEN_LOG`` is ``attngen.log``'s). A value that cannot be meant is
refused by name (``ATTNGEN_LOCK_TIMEOUT``) or warned about (a layer that is not a folder), never
passed over in silence."""

from __future__ import annotations

import math
import os
from pathlib import Path

from . import fs
from .errors import CacheError

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


