"""The cubin cache: hits and misses, entry layout, concurrent processes, crashes mid-write,
corrupt entries, unwritable roots, lock timeouts, listing and clearing.

Real NVRTC compiles and a real disk throughout; compiles are kept few (head_dim=64 on sm_80
is the cheapest kernel) so the file runs in well under a minute on two cores.
"""

import datetime as dt
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import filelock
import pytest

import attngen.cache as cache_mod
from attngen.__version__ import __version__
from attngen.arch import get_arch
from attngen.cache import BuildResult, DiskCache, build, cache_root, clear_memory, key_material, key_of
from attngen.compiler import Binary, Resources, compile_options, nvrtc_version
from attngen.errors import AttngenError, CacheError
from attngen.render import render
from attngen.spec import DType, parse_spec, resolve
from attngen import MaskMode, PrefillSpec

ROOT = Path(__file__).resolve().parent.parent
SPEC = PrefillSpec(head_dim=64)
SPEC_TEXT = "prefill:head_dim=64"
ARCH = "sm_80"


def key_for(spec=SPEC, arch=ARCH) -> str:
    a = get_arch(arch)
    r = resolve(spec, a)
    return key_of(key_material(r, a, compile_options(a)))


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def compiles(monkeypatch):
    """Counts real NVRTC compiles made by build() (a spy: the real compiler still runs)."""
    calls = []
    real = cache_mod.nvrtc_compile

    def counting(*args, **kwargs):
        calls.append(kwargs.get("kernel_name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cache_mod, "nvrtc_compile", counting)
    return calls


@pytest.fixture(scope="session")
def golden(tmp_path_factory):
    """A populated cache root built once: SPEC for sm_80 and sm_86. Tests copy it."""
    root = tmp_path_factory.mktemp("golden") / "cache"
    disk = DiskCache(root)
    clear_memory()
    results = {arch: build(SPEC, arch, cache=disk) for arch in ("sm_80", "sm_86")}
    clear_memory()
    assert all(r.origin == "compiled" and r.stored for r in results.values())
    return root, results


def populate(golden, dest: Path) -> BuildResult:
    root, results = golden
    shutil.copytree(root, dest)
    return results[ARCH]


def child_env(cache_dir: Path, **extra) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNGEN_CACHE_DIR=str(cache_dir))
    env.update(extra)
    return env


def run_child(code: str, cache_dir: Path, *args: str, timeout: float = 180, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=str(ROOT), env=child_env(cache_dir, **extra),
                          capture_output=True, text=True, timeout=timeout)


BUILD_AND_REPORT = f"""
import hashlib, json
from attngen.cache import build
from attngen.spec import parse_spec
r = build(parse_spec({SPEC_TEXT!r}), {ARCH!r})
print(json.dumps({{"origin": r.origin, "stored": r.stored, "key": r.key,
                  "sha": hashlib.sha256(r.binary.cubin).hexdigest()}}))
"""


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
    assert (entry / "kernel.cu").read_text() == res.source
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == key
    assert meta["cubin_sha256"] == sha(cubin) and meta["cubin_bytes"] == len(cubin)
    assert meta["resources"] == res.binary.resources.to_dict()
    assert meta["resources"]["registers"] > 0
    assert meta["nvrtc"] == nvrtc_version() and meta["attngen"] == __version__
    assert meta["arch"] == ARCH and meta["options"] == list(compile_options(ARCH))
    assert meta["kernel_name"] == res.spec.kernel_name
    assert meta["spec"] == res.spec.to_dict() and parse_spec(meta["spec_text"]) == res.spec
    assert meta["key_material"] == key_material(res.spec, get_arch(ARCH), compile_options(ARCH))
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


def test_disk_store_on_plain_bytes(tmp_path):
    """The store itself needs no compiler: any bytes round-trip, checksummed."""
    disk = DiskCache(tmp_path / "root")
    spec = resolve(SPEC, ARCH)
    b = Binary(cubin=b"\x7fELF not really a cubin", kernel_name=spec.kernel_name, arch=ARCH,
               options=compile_options(ARCH), nvrtc_version="13.5", resources=Resources(registers=42),
               log="log", compile_seconds=0.25)
    key = "ab" + "0" * 62
    assert disk.get(key) is None
    assert disk.put(key, b, "// source", {"any": "material"}, spec) is True
    assert disk.get(key) == b
    assert disk.source(key) == "// source"
    # An existing valid entry is kept: a second writer's bytes do not replace it.
    other = Binary(cubin=b"\x7fELF other", kernel_name=b.kernel_name, arch=ARCH, options=b.options,
                   nvrtc_version="13.5", resources=Resources())
    assert disk.put(key, other, "// other", {}, spec) is True
    assert disk.get(key) == b and disk.source(key) == "// source"
    # A corrupt one is replaced.
    (disk.entry_path(key) / "kernel.cubin").write_bytes(b"garbage")
    assert disk.get(key) is None
    assert disk.put(key, other, "// other", {}, spec) is True
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


# --- concurrent processes ----------------------------------------------------------------------------

RACER = f"""
import hashlib, json, sys, time
from pathlib import Path
from attngen.cache import build
from attngen.compiler import include_dirs, nvrtc_version
from attngen.spec import parse_spec
go, ready = Path(sys.argv[1]), Path(sys.argv[2])
nvrtc_version(); include_dirs()  # load NVRTC first, so the processes reach the cache together
ready.touch()
while not go.exists():
    time.sleep(0.001)
r = build(parse_spec({SPEC_TEXT!r}), {ARCH!r})
print(json.dumps({{"origin": r.origin, "stored": r.stored, "key": r.key,
                  "sha": hashlib.sha256(r.binary.cubin).hexdigest()}}))
"""


def test_eight_processes_racing_on_a_cold_key_compile_once(cache_dir, tmp_path):
    n = 8
    go = tmp_path / "go"
    readies = [tmp_path / f"ready.{i}" for i in range(n)]
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(go), str(readies[i])], cwd=str(ROOT),
                              env=child_env(cache_dir, ATTNGEN_LOCK_TIMEOUT="120"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() for r in readies):
            assert time.monotonic() < deadline, "racers never got ready"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.01)
        go.touch()
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * n, [o[1] for o in outs]
    reports = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    origins = sorted(r["origin"] for r in reports)
    assert origins == ["compiled"] + ["disk"] * (n - 1), origins
    assert all(r["stored"] for r in reports)
    assert len({r["key"] for r in reports}) == 1 and reports[0]["key"] == key_for()
    assert len({r["sha"] for r in reports}) == 1
    disk = DiskCache()
    assert [e.key for e in disk.entries()] == [reports[0]["key"]]
    assert sha(disk.get(reports[0]["key"]).cubin) == reports[0]["sha"]
    assert not any((cache_dir / "v1" / "tmp").iterdir())


DIES_WHILE_WRITING = f"""
import os, sys
import attngen.cache as c
from attngen import fs
from attngen.spec import parse_spec
target = sys.argv[1]
real_write = fs.write_private

def dying_write(path, data):
    if path.name == target:
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), 9)
    real_write(path, data)

fs.write_private = dying_write
c.build(parse_spec({SPEC_TEXT!r}), {ARCH!r})
print("survived")
"""


@pytest.mark.parametrize("target", ["kernel.cubin", "meta.json"])
def test_process_killed_mid_write_leaves_nothing_served(cache_dir, target):
    dead = run_child(DIES_WHILE_WRITING, cache_dir, target)
    assert dead.returncode == -signal.SIGKILL, (dead.returncode, dead.stdout, dead.stderr)
    assert "survived" not in dead.stdout
    # The half-written file is there, in a temporary entry, never in the entry's place.
    partial = list((cache_dir / "v1" / "tmp").glob(f"*/{target}"))
    assert len(partial) == 1
    key = key_for()
    disk = DiskCache()
    assert disk.get(key) is None
    assert not disk.entry_path(key).exists()
    assert disk.entries() == []
    assert disk.stats()["entries"] == 0

    # A later process compiles (the dead one's lock died with it) and stores a whole entry.
    later = run_child(BUILD_AND_REPORT, cache_dir, ATTNGEN_LOCK_TIMEOUT="60")
    assert later.returncode == 0, later.stderr
    rep = json.loads(later.stdout.strip().splitlines()[-1])
    assert (rep["origin"], rep["stored"], rep["key"]) == ("compiled", True, key)
    got = disk.get(key)
    assert got is not None and sha(got.cubin) == rep["sha"]
    # clear() sweeps the dead process's temporary.
    assert disk.clear() == 1
    assert not (cache_dir / "v1" / "tmp").exists()


# --- corrupt entries -------------------------------------------------------------------------------

def _flip_cubin(entry: Path):
    p = entry / "kernel.cubin"
    b = bytearray(p.read_bytes())
    mid = len(b) // 2
    b[mid:mid + 16] = bytes(x ^ 0xFF for x in b[mid:mid + 16])
    p.write_bytes(bytes(b))


def _truncate_cubin(entry: Path):
    p = entry / "kernel.cubin"
    p.write_bytes(p.read_bytes()[:100])


def _delete_cubin(entry: Path):
    (entry / "kernel.cubin").unlink()


def _truncate_meta(entry: Path):
    p = entry / "meta.json"
    p.write_text(p.read_text()[: len(p.read_text()) // 2])


def _garble_meta(entry: Path):
    (entry / "meta.json").write_bytes(b"\x00\xff\xfe{garbage")


def _empty_meta(entry: Path):
    (entry / "meta.json").write_bytes(b"")


def _meta_of_another_key(entry: Path):
    p = entry / "meta.json"
    meta = json.loads(p.read_text())
    meta["key"] = "0" * 64
    p.write_text(json.dumps(meta))


def _meta_not_an_object(entry: Path):
    (entry / "meta.json").write_text("null")


def _meta_resources_wrong_type(entry: Path):
    p = entry / "meta.json"
    meta = json.loads(p.read_text())
    meta["resources"] = [1, 2, 3]
    p.write_text(json.dumps(meta))


CORRUPTIONS = [_flip_cubin, _truncate_cubin, _delete_cubin, _truncate_meta, _garble_meta, _empty_meta,
               _meta_of_another_key, _meta_not_an_object, _meta_resources_wrong_type]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=[c.__name__.lstrip("_") for c in CORRUPTIONS])
def test_corrupt_entry_is_a_miss_then_recompiled_and_replaced(golden, cache_dir, corrupt):
    res = populate(golden, cache_dir)
    disk = DiskCache()
    entry = disk.entry_path(res.key)
    corrupt(entry)
    assert disk.get(res.key) is None
    r = build(SPEC, ARCH)
    assert (r.origin, r.stored, r.key) == ("compiled", True, res.key)
    assert r.binary.cubin == res.binary.cubin  # NVRTC is deterministic
    fixed = disk.get(res.key)
    assert fixed is not None and fixed.cubin == res.binary.cubin
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["key"] == res.key and meta["cubin_sha256"] == sha((entry / "kernel.cubin").read_bytes())
    assert not any((cache_dir / "v1" / "tmp").iterdir()), "the corrupt entry was not cleaned away"
    clear_memory()
    assert build(SPEC, ARCH).origin == "disk"


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
        assert disk.get(r.key) is None and disk.entries() == [] and disk.clear() == 0
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

    _flip_cubin(disk.entry_path(results["sm_86"].key))
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

    from attngen import cache as cache_mod

    log = logging.getLogger("attngen")
    old = log.level
    try:
        monkeypatch.setenv("ATTNGEN_LOG", "debug")
        build(PrefillSpec(head_dim=64, dtype="fp16"), ARCH)
        assert log.level == logging.DEBUG and any(getattr(h, "_attngen", False) for h in log.handlers)
        monkeypatch.setenv("ATTNGEN_LOG", "warning")
        cache_mod.configure_logging()
        assert log.level == logging.WARNING
        assert sum(getattr(h, "_attngen", False) for h in log.handlers) == 1
    finally:
        log.setLevel(old)
        for h in [h for h in log.handlers if getattr(h, "_attngen", False)]:
            log.removeHandler(h)
        cache_mod._log_setting[0] = None


def test_always_compile_bypasses_both_caches(cache_dir, monkeypatch):
    spec = PrefillSpec(head_dim=64, dtype="fp16")
    assert build(spec, ARCH).origin == "compiled"
    assert build(spec, ARCH).origin == "memory"
    monkeypatch.setenv("ATTNGEN_ALWAYS_COMPILE", "1")
    assert [build(spec, ARCH).origin for _ in range(2)] == ["compiled", "compiled"]
    monkeypatch.setenv("ATTNGEN_ALWAYS_COMPILE", "0")
    assert build(spec, ARCH).origin == "memory"
