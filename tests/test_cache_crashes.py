"""The cubin cache under concurrent processes, crashes mid-write and corrupt entries: one compile for a cold key
however many processes race on it, nothing served from a write a kill cut short, a corrupt entry a miss that is
rebuilt and replaced. Real NVRTC compiles, real processes and a real disk (cache_support.py, conftest's fixtures)."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attngen.builder import build, clear_memory
from attngen.cache import DiskCache

from cache_support import (ARCH, BUILD_AND_REPORT, ROOT, SPEC, SPEC_TEXT, child_env, flip_cubin, key_for, populate,
                           run_child, sha)


# --- concurrent processes ----------------------------------------------------------------------------

RACER = f"""
import hashlib, json, sys, time
from pathlib import Path
from attngen.builder import build
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
import attngen.builder as c
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
    # (tmp/ itself stays: a concurrent writer may be about to make its temporary there)
    assert not any((cache_dir / "v1" / "tmp").iterdir())


# --- corrupt entries -------------------------------------------------------------------------------

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


CORRUPTIONS = [flip_cubin, _truncate_cubin, _delete_cubin, _truncate_meta, _garble_meta, _empty_meta,
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
