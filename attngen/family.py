"""The family registry: each kernel family is a plug-in, registered by name.

A family is one folder (``attngen/families/<name>/``, or any importable package that calls
``register``) holding its spec class, arch defaults, template context, user-facing op, tuning
space and benchmark. The shared stages (spec parsing, render, cache, runtime, manifest, tune,
bench, CLI) find families here and never name one.

The built-in families are the subpackages of ``attngen.families``, imported on first use of
the registry, so adding one is adding its folder. Families from elsewhere register when their
module is imported; ``ATTNGEN_FAMILIES`` (comma-separated module names, read when the registry
is first used) imports them in every process, prewarm's workers included.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .errors import SpecError


@dataclass(frozen=True)
class Family:
    """What the shared stages need to know of a family.

    Modules are named, not imported: a warm cache hit must not import a family's benchmark or
    tuning code (torch, plotting).
    """

    name: str
    spec: type                      # the spec class; ``spec.family == name``
    template: str                   # its top-level template, e.g. "prefill/prefill.cu.jinja"
    # (spec, arch) -> tuning tuples in ``spec.TUNING_FIELDS`` order, best first: the arch defaults
    # and the tuning space (``attngen.spec.resolve`` takes the first that agrees and fits).
    candidates: Callable[..., Iterable[tuple]]
    summary: str = ""               # one line for ``attngen families``
    # Searched before the shipped templates/ folder, so a family from outside the package can
    # bring its own templates (and still include the shared pieces under common/).
    template_dir: Path | None = None
    tuning: str | None = None       # module with the tuning problem (``attngen tune <name>``)
    bench: str | None = None        # module with the benchmark (``attngen bench <name>``)
    # Modules whose source decides what the template context holds; their text feeds the cache
    # key (the spec class's own module always does).
    context_modules: tuple[str, ...] = field(default=())
    # Public names the family adds to the ``attngen`` namespace (its op, spec class, enums).
    exports: dict = field(default_factory=dict, compare=False, repr=False)
    # (spec, arch) -> every resolved spec the family's op can run for a call of ``spec``'s fields on ``arch``,
    # whatever the call's sizes (its choice function's ``reachable``): what prewarming a manifest line builds.
    # None: the spec resolved, alone.
    reachable: Callable[..., set] | None = None

    def __post_init__(self):
        if getattr(self.spec, "family", None) != self.name:
            raise ValueError(f"family {self.name!r}: its spec class {self.spec.__name__} says "
                             f"family={getattr(self.spec, 'family', None)!r}")


_registry: dict[str, Family] = {}
_lock = threading.RLock()
_builtin_loaded = False


def register(family: Family) -> Family:
    """Add ``family``; registering the same name twice with another spec class is an error."""
    with _lock:
        old = _registry.get(family.name)
        if old is not None and old.spec is not family.spec:
            raise ValueError(f"a family named {family.name!r} is registered already ({old.spec.__name__})")
        _registry[family.name] = family
    return family


def unregister(name: str) -> None:
    """Remove a family (tests register toy families and take them away again)."""
    with _lock:
        _registry.pop(name, None)


def _load_builtin() -> None:
    global _builtin_loaded
    if _builtin_loaded:
        return
    with _lock:
        if _builtin_loaded:
            return
        # By module name: ``attngen.families`` the attribute may be shadowed by a function of the
        # same name in a caller's namespace; the package is what is meant here.
        pkg = importlib.import_module(__name__.rsplit(".", 1)[0] + ".families")
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
            if info.ispkg:
                importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name in filter(None, (s.strip() for s in os.environ.get("ATTNGEN_FAMILIES", "").split(","))):
            try:
                importlib.import_module(name)
            except (ImportError, TypeError, ValueError) as e:  # TypeError: a relative name such as ".foo"
                raise SpecError("ATTNGEN_FAMILIES", name, "importable module names, comma-separated",
                                reason=f"the module could not be imported: {e}") from None
        _builtin_loaded = True


def families() -> tuple[Family, ...]:
    """Every registered family, built-in ones first, in name order."""
    _load_builtin()
    return tuple(_registry.values())


def get_family(name: str) -> Family:
    """The family registered as ``name`` (case-insensitive)."""
    _load_builtin()
    fam = _registry.get(name) or _registry.get(str(name).strip().lower())
    if fam is None:
        raise SpecError("family", name, ", ".join(sorted(_registry)) or "(none registered)")
    return fam


def family_of(spec) -> Family:
    """The family a spec object belongs to."""
    return get_family(spec.family)
