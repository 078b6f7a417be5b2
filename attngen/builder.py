"""The build path: spec + arch -> a ``BuildResult``, from memory, from disk, or rendered, compiled
once and stored (``attngen.build``).

The store (``attngen.cache``) keeps entries and knows nothing of rendering or compiling; this
module asks it for a key's entry, compiles on a miss under the key's lock (processes that miss on
the same key compile once: the lookup is repeated under the lock), stores the result, and keeps
repeated requests of one process from resolving, rendering and hashing again.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .arch import Arch, get_arch
from .cache import DiskCache, memory
from .cache_env import always_compile, cache_layers, lock_timeout
from .cache_key import key_material, key_of
from .cache_lock import LockTimeout
from .compiler import Binary, compile as nvrtc_compile, compile_options
from .errors import CacheError, CompileError
from .log import configure_logging
from .render import clear_digests, render
from .spec import Spec, as_spec, resolve

log = logging.getLogger("attngen")


@dataclass(frozen=True)
class BuildResult:
    """What ``attngen.build`` returns: a compiled kernel and where it came from.

    - ``binary``: the ``Binary`` (cubin bytes, kernel name, arch, ptxas' ``Resources``);
    - ``key``: the cache key (SHA-256 hex) the binary is stored under;
    - ``spec``: the resolved spec it was built from (its tuning fields filled for the arch);
    - ``origin``: ``"memory"``, ``"disk"`` or ``"compiled"``;
    - ``stored``: whether the cache root in use now holds it (False on a read-only root);
    - ``source`` (property): the CUDA source, rendered on request.
    """

    binary: Binary
    key: str
    spec: Spec
    origin: str  # "memory", "disk" or "compiled"
    stored: bool  # whether the disk now holds it (False on a read-only root)

    def __repr__(self) -> str:
        # Short, never the cubin's bytes: a result printed at a REPL says what it is.
        return (f"BuildResult(spec='{self.spec}', {self.binary.summary()}, origin='{self.origin}', "
                f"stored={self.stored}, key='{self.key[:12]}...')")

    @property
    def source(self) -> str:
        """The CUDA source of the binary, rendered on request (a hit does not render it)."""
        return render(self.spec)


# (spec, arch name, root, layers) -> result: repeated requests skip resolve, render and hashing (~200 us).
_built: dict[tuple, BuildResult] = {}
_built_lock = threading.Lock()


def clear_memory() -> None:
    """Forget what this process built or loaded: the store's memory layer, the repeated-request
    results and the template digests (tests, and benchmarks of a cold build)."""
    memory.clear()
    with _built_lock:
        _built.clear()
    clear_digests()


def build(spec: Spec | str | Mapping, arch: "str | Arch", *, cache: DiskCache | None = None) -> BuildResult:
    """spec + arch -> a ``BuildResult`` (its ``binary``): from memory, from disk, or compiled once and stored.

    ``spec``: a spec object, its text or a dict of its fields (as ``parse_spec`` takes); unresolved
    tuning fields are filled for ``arch``. Never needs a GPU. Concurrent callers (threads or
    processes) that miss on the same key compile once. ``stored`` says whether the root in use
    (``cache``, else the environment's) holds the entry.
    """
    spec = as_spec(spec)
    a = get_arch(arch)
    cache = cache or DiskCache()
    fast_key = (spec, a.name, str(cache.root), os.environ.get("ATTNGEN_CACHE_LAYERS", ""))
    fresh = always_compile()
    fast = None if fresh else _built.get(fast_key)
    if fast is not None:
        return BuildResult(fast.binary, fast.key, fast.spec, "memory", True)
    configure_logging()
    result = _build(spec, a, cache, fresh)
    if result.stored and not fresh:  # ATTNGEN_ALWAYS_COMPILE: every request compiles again
        with _built_lock:
            _built[fast_key] = result
    return result


def _build(spec: Spec, a: Arch, cache: DiskCache, fresh: bool = False) -> BuildResult:
    """The build path; ``fresh`` (ATTNGEN_ALWAYS_COMPILE) skips every lookup and compiles."""
    spec = resolve(spec, a)
    options = compile_options(a)
    material = key_material(spec, a, options)
    key = key_of(material)
    root = str(cache.root)
    hit, hit_stored = (None, False) if fresh else memory.get(root, key)
    if hit is not None and hit_stored:
        return BuildResult(hit, key, spec, "memory", True)
    binary = None if fresh else _named(cache.get(key), spec)
    if binary is None and not fresh:
        for layer in cache_layers():
            binary = _named(DiskCache(layer, layer=True).get(key), spec)
            if binary is not None:
                log.debug("cache hit (layer %s): %s for %s", layer, spec.to_text(), a.name)
                break
    if binary is not None:
        memory.put(root, key, binary, True)
        log.debug("cache hit (disk): %s for %s, key %s", spec.to_text(), a.name, key[:16])
        return BuildResult(binary, key, spec, "disk" if hit is None else "memory", True)
    log.debug("cache miss: %s for %s, key %s under %s", spec.to_text(), a.name, key[:16], root)

    def produce() -> tuple[Binary, str, str]:
        source = render(spec)
        if hit is not None:  # compiled earlier in this process, for another root
            return hit, source, "memory"
        try:
            b = nvrtc_compile(source, a, kernel_name=spec.kernel_name, entries=spec.entries)
        except CompileError as e:
            refused = spec.compile_error(e)  # e.g. NVRTC's error at a line of a user's snippet
            if refused is not None:
                raise refused from e
            raise
        _log_compile(spec, a, b)
        return b, source, "compiled"

    lock = cache.lock(key)
    if lock is None:  # read-only root: compile, keep in memory only
        binary, _, origin = produce()
        memory.put(root, key, binary, False)
        return BuildResult(binary, key, spec, origin, False)
    try:
        with lock:
            binary = None if fresh else _named(cache.get(key), spec)  # another process may have built it meanwhile
            if binary is not None:
                origin, stored = "disk", True
            else:
                binary, source, origin = produce()
                stored = cache.put(key, binary, source, material, spec)
    except LockTimeout:
        raise CacheError(f"timed out after {lock_timeout():g}s waiting for the cache lock "
                         f"{cache.lock_path(key)} (another process holds it; set ATTNGEN_LOCK_TIMEOUT "
                         f"or remove a stale lock)") from None
    memory.put(root, key, binary, stored)
    return BuildResult(binary, key, spec, origin, stored)


def _named(binary: "Binary | None", spec: Spec) -> "Binary | None":
    """``binary`` when it is the kernel ``spec`` names, else None (a miss): an entry's own checks
    cannot tell a consistent entry of another kernel from the one its key asks for."""
    return binary if binary is None or binary.kernel_name == spec.kernel_name else None


_slow_compile_told = [False]


def _log_compile(spec: Spec, a: Arch, b: Binary) -> None:
    """One INFO record per compile; the first compile of a process that took over a second also
    says how to avoid it."""
    r = b.resources
    res = (f"{r.registers} registers, {r.spill_stores}/{r.spill_loads} bytes spilled (stores/loads)" if r.known else
           f"{r.registers} registers and a {r.stack_frame}-byte stack frame (from the cubin; NVRTC's log held no "
           f"spill report)")
    log.info("compiled %s for %s in %.2f s: %s", spec.to_text(), a.name, b.compile_seconds, res)
    if b.compile_seconds > 1.0 and not _slow_compile_told[0]:
        _slow_compile_told[0] = True
        log.info("a kernel compile blocked this call for %.1f s; 'attngen prewarm' fills the cache ahead of "
                 "time (ATTNGEN_CACHE_DIR)", b.compile_seconds)
