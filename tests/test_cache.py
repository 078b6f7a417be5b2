"""The cubin cache: hits and misses, entry layout, unwritable roots, lock timeouts, listing and clearing,
logging (concurrent processes, crashes mid-write and corrupt entries: test_cache_crashes.py).

Real NVRTC compiles and a real disk throughout; compiles are kept few (head_dim=64 on sm_80
is the cheapest kernel) so the file runs in well under a minute on two cores.
"""

import dataclasses
import datetime as dt
import json
import os
import shutil
import threading
import time
from pathlib import Path

import filelock
import pytest

import attngen.cache as cache_mod
from attngen.__version__ import __version__
from attngen.arch import get_arch
from attngen.builder import build, clear_memory
from attngen.cache import DiskCache, cache_root, key_material, key_of
from attngen.compiler import Binary, Resources, compile_options, nvrtc_version
from attngen.errors import AttngenError, CacheError
from attngen.render import render
from attngen.spec import DType, parse_spec, resolve
from attngen import MaskMode, PrefillSpec

from cache_support import ARCH, SPEC, flip_cubin, key_for, populate, sha


# --- hits and misses -------------------------------------------------------------------------------

def test_miss_compile_then_disk_then_memory(cache_dir, compiles):
    r1 = build(SPEC, ARCH)
    assert (r1.origin, r1.stored) == ("compiled", True)
    assert r1.key == key_for()
    assert r1.spec == resolve(SPEC, ARCH) and r1.spec.is_resolved
    assert r1.source == render(r1.spec)
    assert r1.binary.cubin[:4] == b"\x7fELF" and r1.binary.kernel_name == r1.spec.kernel_name
    assert compiles == [r1.spec.kernel_name]

    r2 = build(SPEC, ARCH)
    assert (r2.origin, r2.key) == ("memory", r1.key)
    assert r2.binary is r1.binary

    clear_memory()  # a new process, as far as the cache can tell
    r3 = build(SPEC, ARCH)
    assert (r3.origin, r3.stored, r3.key) == ("disk", True, r1.key)
    assert r3.binary.cubin == r1.binary.cubin
    assert r3.binary.resources == r1.binary.resources
    assert r3.binary.kernel_name == r1.binary.kernel_name
    assert r3.binary.options == r1.binary.options and r3.binary.nvrtc_version == nvrtc_version()

    r4 = build(SPEC, ARCH)
    assert r4.origin == "memory" and r4.binary is r3.binary
    # The resolved spec names the same kernel as the unresolved one: one key, no compile.
    assert build(resolve(SPEC, ARCH), ARCH).origin == "memory"
    for _ in range(10):
        build(SPEC, ARCH)
    assert len(compiles) == 1


def test_cache_root_is_read_when_used(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a" and DiskCache().root == tmp_path / "a"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "b"))
    assert cache_root() == tmp_path / "b"
    monkeypatch.delenv("ATTNGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "attngen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "attngen"


def test_entry_layout(golden, cache_dir):
    res = populate(golden, cache_dir)
    disk = DiskCache()
    key = res.key
    entry = disk.entry_path(key)
    assert entry == cache_dir / "v1" / key[:2] / key
    assert sorted(p.name for p in entry.iterdir()) == ["kernel.cu", "kernel.cubin", "meta.json"]
    cubin = (entry / "kernel.cubin").read_bytes()
    assert cubin == res.binary.cubin
    assert disk.source(key) == res.source  # stored compressed
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == key
    assert meta["cubin_sha256"] == sha(cubin) and meta["cubin_bytes"] == len(cubin)
    assert meta["resources"] == res.binary.resources.to_dict()
    assert meta["resources"]["registers"] > 0
    assert meta["nvrtc"] == nvrtc_version() and meta["attngen"] == __version__
    assert meta["arch"] == ARCH and meta["options"] == list(compile_options(get_arch(ARCH)))
    assert meta["kernel_name"] == res.spec.kernel_name
    assert meta["spec"] == res.spec.to_dict() and parse_spec(meta["spec_text"]) == res.spec
    assert meta["key_material"] == key_material(res.spec, get_arch(ARCH), compile_options(get_arch(ARCH)))
    assert key_of(meta["key_material"]) == key
    assert isinstance(meta["compile_seconds"], float) and meta["compile_seconds"] > 0
    assert meta["smem_dynamic"] == res.spec.smem_bytes() and meta["threads"] == res.spec.threads
    assert dt.datetime.fromisoformat(meta["created"]).tzinfo is not None
    assert "Compiling entry function" in meta["log"]
    # Nothing half-written stays behind; the key's lock file is where lock_path says.
    assert not any((cache_dir / "v1" / "tmp").iterdir())
    assert disk.lock_path(key) == cache_dir / "v1" / "locks" / f"{key}.lock"
    assert disk.lock_path(key).exists()
    assert disk.source(key) == res.source
    got = disk.get(key)
    assert got.cubin == cubin and got.resources == res.binary.resources and got.kernel_name == res.spec.kernel_name


def test_disk_store_on_plain_bytes(golden, tmp_path):
    """The store itself needs no compiler: a cubin's bytes round-trip, checksummed and checked."""
    root, results = golden
    r = results[ARCH]
    material = json.loads((root / "v1" / r.key[:2] / r.key / "meta.json").read_text())["key_material"]
    disk = DiskCache(tmp_path / "root")
    spec = resolve(SPEC, ARCH)
    b = dataclasses.replace(r.binary, log="log", compile_seconds=0.25)
    key = r.key
    assert disk.get(key) is None
    assert disk.put(key, b, "// source", material, spec) is True
    assert disk.get(key) == b
    assert disk.source(key) == "// source"
    # An existing valid entry is kept: a second writer's bytes do not replace it.
    other = dataclasses.replace(b, log="other")
    assert disk.put(key, other, "// other", material, spec) is True
    assert disk.get(key) == b and disk.source(key) == "// source"
    # A corrupt one is replaced.
    (disk.entry_path(key) / "kernel.cubin").write_bytes(b"garbage")
    assert disk.get(key) is None
    assert disk.put(key, other, "// other", material, spec) is True
    assert disk.get(key) == other
    assert not any((disk.base / "tmp").iterdir())


def test_threads_racing_on_a_cold_key_compile_once(cache_dir, compiles):
    results, errors = [], []
    barrier = threading.Barrier(8)

    def worker():
        try:
            barrier.wait()
            results.append(build(SPEC, ARCH))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 8
    assert len(compiles) == 1
    assert sorted(r.origin for r in results).count("compiled") == 1
    assert len({sha(r.binary.cubin) for r in results}) == 1


# --- unwritable roots -------------------------------------------------------------------------------

def test_root_that_cannot_be_created_still_builds(tmp_path, monkeypatch, compiles):
    blocker = tmp_path / "file.txt"
    blocker.write_text("a regular file where the cache's parent folder should be")
    root = blocker / "cache"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(root))
    clear_memory()
    try:
        r = build(SPEC, ARCH)
        assert (r.origin, r.stored) == ("compiled", False)
        assert r.binary.cubin[:4] == b"\x7fELF" and r.binary.resources.registers > 0
        assert build(SPEC, ARCH).origin == "memory"
        assert len(compiles) == 1
        disk = DiskCache()
        assert disk.get(r.key) is None and disk.entries() == []
        with pytest.raises(CacheError, match="refusing to clear"):  # a root builds refuse is not cleared either
            disk.clear()
        assert disk.stats()["entries"] == 0
        assert blocker.read_text().startswith("a regular file")
    finally:
        clear_memory()


def test_memory_hit_on_unwritable_root_does_not_claim_stored(tmp_path, monkeypatch):
    """BuildResult.stored is "whether the disk now holds it"; a memory hit must not say so falsely."""
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(blocker / "cache"))
    clear_memory()
    try:
        first = build(SPEC, ARCH)
        assert first.stored is False
        again = build(SPEC, ARCH)
        assert again.origin == "memory"
        assert again.stored is False, "the disk does not hold this binary"
    finally:
        clear_memory()


def test_stored_means_the_root_in_use_holds_it(tmp_path, monkeypatch):
    """ATTNGEN_CACHE_DIR is read when used: after it changes (or with an explicit ``cache=``),
    a result must not claim ``stored`` for a root that does not hold the entry."""
    first, second, third = tmp_path / "first", tmp_path / "second", tmp_path / "third"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(first))
    clear_memory()
    try:
        r = build(SPEC, ARCH)
        assert r.stored and DiskCache().get(r.key) is not None
        monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(second))
        r2 = build(SPEC, ARCH)
        assert not r2.stored or DiskCache().get(r2.key) is not None, \
            f"origin {r2.origin!r} says stored, but {second} does not hold the entry"
        other = DiskCache(third)
        r3 = build(SPEC, ARCH, cache=other)
        assert not r3.stored or other.get(r3.key) is not None, \
            f"origin {r3.origin!r} says stored, but {third} does not hold the entry"
    finally:
        clear_memory()


def _make_unwritable(root: Path):
    """Make ``root`` unwritable for this process, root user included.

    chmod stops an ordinary user; root ignores it, so where we run as root the folders the
    cache writes into (``tmp/``, ``locks/`` and a fresh entry's shard) are also replaced by
    regular files, which makes every mkdir/create under them fail as it would on a read-only
    mount.
    """
    base = root / "v1"
    if os.geteuid() == 0:
        for name in ("tmp", "locks"):
            shutil.rmtree(base / name, ignore_errors=True)
            (base / name).write_text("not a folder")
    for dirpath, dirnames, filenames in os.walk(root):
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o444)
        os.chmod(dirpath, 0o555)


def _make_writable(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)


def test_populated_unwritable_root_still_serves_hits(golden, cache_dir, compiles):
    res = populate(golden, cache_dir)
    other = PrefillSpec(head_dim=64, dtype=DType.FP16, mask=MaskMode.CAUSAL)
    _make_unwritable(cache_dir)
    try:
        before = sorted(str(p) for p in cache_dir.rglob("*"))
        hit = build(SPEC, ARCH)
        assert (hit.origin, hit.key) == ("disk", res.key)
        assert hit.binary.cubin == res.binary.cubin
        assert compiles == []
        miss = build(other, ARCH)
        assert (miss.origin, miss.stored) == ("compiled", False)
        assert miss.binary.cubin[:4] == b"\x7fELF"
        assert sorted(str(p) for p in cache_dir.rglob("*")) == before, "an unwritable root was written to"
        assert DiskCache().stats()["entries"] == 2
    finally:
        _make_writable(cache_dir)


# --- locking -----------------------------------------------------------------------------------------

def test_lock_timeout_names_the_lock(cache_dir, monkeypatch, compiles):
    monkeypatch.setenv("ATTNGEN_LOCK_TIMEOUT", "0.5")
    disk = DiskCache()
    key = key_for()
    path = disk.lock_path(key)
    path.parent.mkdir(parents=True)
    held = filelock.FileLock(str(path))
    held.acquire()
    try:
        t0 = time.monotonic()
        with pytest.raises(CacheError) as ei:
            build(SPEC, ARCH)
        waited = time.monotonic() - t0
    finally:
        held.release()
    assert isinstance(ei.value, AttngenError)
    assert str(path) in str(ei.value)
    assert "ATTNGEN_LOCK_TIMEOUT" in str(ei.value)
    assert 0.5 <= waited < 30
    assert compiles == []
    assert disk.get(key) is None


def test_lock_timeout_is_read_when_used(monkeypatch):
    monkeypatch.setenv("ATTNGEN_LOCK_TIMEOUT", "2.5")
    assert cache_mod.lock_timeout() == 2.5
    monkeypatch.delenv("ATTNGEN_LOCK_TIMEOUT")
    assert cache_mod.lock_timeout() == 600


# --- listing and clearing ---------------------------------------------------------------------------

def test_entries_stats_clear(golden, cache_dir):
    populate(golden, cache_dir)
    _, results = golden
    disk = DiskCache()
    ents = disk.entries()
    assert sorted(e.key for e in ents) == sorted(r.key for r in results.values())
    for e in ents:
        assert e.path == disk.entry_path(e.key)
        assert e.meta["key"] == e.key
        assert e.size == sum(p.stat().st_size for p in e.path.iterdir())
    st = disk.stats()
    assert st["root"] == str(cache_dir)
    assert (st["entries"], st["invalid"]) == (2, 0)
    assert st["by_arch"] == {"sm_80": 1, "sm_86": 1}
    assert st["bytes"] == sum(e.size for e in ents)
    assert st["compile_seconds"] > 0

    flip_cubin(disk.entry_path(results["sm_86"].key))
    st = disk.stats()
    assert (st["entries"], st["invalid"]) == (1, 1)
    assert st["by_arch"] == {"sm_80": 1}

    assert disk.clear() == 2
    assert disk.entries() == []
    assert all(disk.get(r.key) is None for r in results.values())
    assert disk.stats()["entries"] == 0 and disk.stats()["bytes"] == 0
    assert disk.clear() == 0


def test_empty_and_missing_roots_list_nothing(tmp_path):
    for root in (tmp_path / "missing", tmp_path):
        disk = DiskCache(root)
        assert disk.entries() == []
        assert disk.stats() == {"root": str(root), "entries": 0, "invalid": 0, "bytes": 0, "by_arch": {},
                                "compile_seconds": 0}
        assert disk.clear() == 0


# --- logging and ATTNGEN_ALWAYS_COMPILE -----------------------------------------------------------

def test_a_compile_is_one_info_record_and_hits_are_debug(cache_dir, caplog):
    import logging

    spec = PrefillSpec(head_dim=64, dtype="fp16")
    with caplog.at_level(logging.DEBUG, logger="attngen"):
        build(spec, ARCH)
        clear_memory()
        build(spec, ARCH)
    info = [r for r in caplog.records if r.levelno == logging.INFO and r.getMessage().startswith("compiled ")]
    assert len(info) == 1
    msg = info[0].getMessage()
    assert spec.to_text() in msg and ARCH in msg and " s: " in msg and "registers" in msg
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(m.startswith("cache miss: ") for m in debug) and any(m.startswith("cache hit (disk): ") for m in debug)


def test_attngen_log_sets_the_level_from_the_environment(cache_dir, monkeypatch):
    import logging

    from attngen import log as log_mod

    log = logging.getLogger("attngen")
    old = log.level
    try:
        monkeypatch.setenv("ATTNGEN_LOG", "debug")
        build(PrefillSpec(head_dim=64, dtype="fp16"), ARCH)
        assert log.level == logging.DEBUG and any(getattr(h, "_attngen", False) for h in log.handlers)
        monkeypatch.setenv("ATTNGEN_LOG", "warning")
        log_mod.configure_logging()
        assert log.level == logging.WARNING
        assert sum(getattr(h, "_attngen", False) for h in log.handlers) == 1
    finally:
        log.setLevel(old)
        for h in [h for h in log.handlers if getattr(h, "_attngen", False)]:
            log.removeHandler(h)
        log_mod._log_setting[0] = None


def test_always_compile_bypasses_both_caches(cache_dir, monkeypatch):
    spec = PrefillSpec(head_dim=64, dtype="fp16")
    assert build(spec, ARCH).origin == "compiled"
    assert build(spec, ARCH).origin == "memory"
    monkeypatch.setenv("ATTNGEN_ALWAYS_COMPILE", "1")
    assert [build(spec, ARCH).origin for _ in range(2)] == ["compiled", "compiled"]
    monkeypatch.setenv("ATTNGEN_ALWAYS_COMPILE", "0")
    assert build(spec, ARCH).origin == "memory"
