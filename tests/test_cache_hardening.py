"""The cache root under attack and under faults (issue 57): deletions never leave the root, every
command applies the builds' trust check, nothing a root holds crashes attngen, entries are checked
beyond their checksum, and odd objects in the layout are flagged and repaired."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from attngen import fs
from attngen.builder import build, clear_memory
from attngen.cache import DiskCache
from attngen.cli import main
from cache_support import ARCH, SPEC, child_env, other_user, populate, sha  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    fs.forget_warnings()
    yield
    fs.forget_warnings()


def _victim(tmp_path: Path) -> list[Path]:
    files = []
    for d in ("tmp", "jinja", "tuned", "ab/" + "ab" * 32):
        (tmp_path / "victim" / d).mkdir(parents=True)
        f = tmp_path / "victim" / d / "precious.txt"
        f.write_text("keep me")
        files.append(f)
    return files


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("attngen: error:")]
    assert "Traceback" not in err and lines, err
    return lines[0]


# --- 1: clear never leaves the root --------------------------------------------------------------

@pytest.mark.parametrize("where", ["v1", "shard", "tmp-parent"])
def test_clear_never_deletes_through_a_link(golden, cache_dir, tmp_path, capsys, where):
    victims = _victim(tmp_path)
    if where == "v1":  # the whole layout is a link to someone's folder
        cache_dir.mkdir()
        (cache_dir / "v1").symlink_to(tmp_path / "victim")
    else:
        populate(golden, cache_dir)
        if where == "shard":  # a shard that is a link, holding something entry-shaped
            (cache_dir / "v1" / "ab").symlink_to(tmp_path / "victim" / "ab")
        else:  # tmp's parent chain: v1 is real, but tmp is a link into the victim's tree
            shutil.rmtree(cache_dir / "v1" / "tmp", ignore_errors=True)
            (cache_dir / "v1" / "tmp").symlink_to(tmp_path / "victim" / "tmp")
    main(["cache", "clear", "--tuned"])
    capsys.readouterr()
    assert all(f.read_text() == "keep me" for f in victims)


def test_remove_tree_refuses_a_link_at_every_level(tmp_path):
    victims = _victim(tmp_path)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    (root / "v1").symlink_to(tmp_path / "victim")
    assert fs.remove_tree(root / "v1" / "tmp", root) is False
    assert fs.remove_tree(root / "v1" / "ab", root) is False
    assert all(f.read_text() == "keep me" for f in victims)


def test_clear_on_a_shared_root_never_deletes_in_the_linked_home(cache_dir, tmp_path, other_user, capsys):
    # Another user links v1 of a shared 0777 root to the victim's own folder: the victim's clear must
    # not delete there.
    victims = _victim(tmp_path)
    cache_dir.mkdir()
    os.chmod(cache_dir, 0o777)
    (cache_dir / "v1").symlink_to(tmp_path / "victim")
    os.lchown(cache_dir / "v1", *other_user)
    assert main(["cache", "clear", "--tuned"]) == 2
    assert "refus" in _one_line_error(capsys.readouterr().err)
    assert all(f.read_text() == "keep me" for f in victims)


# --- 2: clear and prune apply the builds' trust check ----------------------------------------------

@pytest.mark.parametrize("argv", [["cache", "clear"], ["cache", "clear", "--tuned"],
                                  ["cache", "prune", "--max-size", "0"], ["cache", "verify"]])
def test_a_world_writable_root_is_refused_by_every_cache_command(golden, cache_dir, capsys, argv):
    populate(golden, cache_dir)
    os.chmod(cache_dir, 0o777)
    before = sorted(str(p) for p in cache_dir.rglob("*"))
    assert main(argv) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert str(cache_dir) in err and "writable by" in err and "damaged" not in err
    assert sorted(str(p) for p in cache_dir.rglob("*")) == before


def test_a_foreign_root_is_not_cleared(golden, cache_dir, other_user, capsys):
    populate(golden, cache_dir)
    for p in [cache_dir, *cache_dir.rglob("*")]:
        os.lchown(p, *other_user)
    before = sorted(str(p) for p in cache_dir.rglob("*"))
    assert main(["cache", "clear"]) == 2
    assert f"owned by uid {other_user[0]}" in _one_line_error(capsys.readouterr().err)
    assert sorted(str(p) for p in cache_dir.rglob("*")) == before


# --- 3: nothing parsed from the root crashes attngen -------------------------------------------------

def _meta(entry: Path) -> dict:
    return json.loads((entry / "meta.json").read_text())


def _set_meta(entry: Path, meta: dict) -> None:
    (entry / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("argv", [["cache", "ls"], ["cache", "stats"], ["cache", "verify"], ["cache", "clear"],
                                  ["cache", "export", "{tmp}/b.tar"], ["tune", "ls"]])
def test_deeply_nested_json_is_a_miss_not_a_crash(golden, cache_dir, tmp_path, capsys, argv):
    r = populate(golden, cache_dir)
    entry = DiskCache().entry_path(r.key)
    (entry / "meta.json").write_text("[" * 100000)
    (cache_dir / "v1" / "tuned").mkdir(mode=0o700)
    (cache_dir / "v1" / "tuned" / "sm_80.json").write_text("[" * 100000)
    assert DiskCache().get(r.key) is None
    rc = main([a.format(tmp=tmp_path) for a in argv])
    out = capsys.readouterr()
    assert "Traceback" not in out.err and rc in (0, 1)
    if argv[1] == "verify":
        assert rc == 1 and r.key in out.out and "meta.json" in out.out


@pytest.mark.parametrize("field,value", [("log", 5), ("log", ["x"]), ("kernel_name", 7), ("options", "-O3"),
                                         ("resources", {"registers": "many"}), ("compile_seconds", "slow"),
                                         ("resources", {"registers": True})])
def test_metadata_fields_are_type_checked(golden, cache_dir, capsys, field, value):
    r = populate(golden, cache_dir)
    entry = DiskCache().entry_path(r.key)
    meta = _meta(entry)
    meta[field] = value
    _set_meta(entry, meta)
    assert DiskCache().get(r.key) is None
    assert main(["cache", "verify"]) == 1
    assert field in capsys.readouterr().out


# --- 5: integrity beyond the sidecar -------------------------------------------------------------

def _forge(entry: Path, cubin: bytes, **meta_edits) -> None:
    (entry / "kernel.cubin").write_bytes(cubin)
    meta = _meta(entry)
    meta.update(cubin_sha256=sha(cubin), cubin_bytes=len(cubin), **meta_edits)
    _set_meta(entry, meta)


def test_a_cubin_for_another_arch_is_a_miss_even_with_its_sidecar_rewritten(golden, cache_dir, capsys):
    root, results = golden
    populate(golden, cache_dir)
    disk = DiskCache()
    entry80 = disk.entry_path(results["sm_80"].key)
    cubin86 = (disk.entry_path(results["sm_86"].key) / "kernel.cubin").read_bytes()
    _forge(entry80, cubin86)
    assert disk.get(results["sm_80"].key) is None
    assert main(["cache", "verify"]) == 1
    assert "sm_86" in capsys.readouterr().out


def test_a_cubin_without_the_kernel_symbol_is_a_miss(golden, cache_dir):
    r = populate(golden, cache_dir)
    disk = DiskCache()
    entry = disk.entry_path(r.key)
    cubin = (entry / "kernel.cubin").read_bytes()
    name = r.binary.kernel_name.encode()
    _forge(entry, cubin.replace(b"\0" + name + b"\0", b"\0" + name[:-1] + b"X\0"))
    assert disk.get(r.key) is None


@pytest.mark.parametrize("field,value", [("arch", "sm_86"), ("nvrtc", "9.9"), ("kernel_name", "other_kernel"),
                                         ("resources.registers", 3)])
def test_metadata_that_disagrees_with_the_key_or_the_cubin_is_a_miss(golden, cache_dir, capsys, field, value):
    r = populate(golden, cache_dir)
    entry = DiskCache().entry_path(r.key)
    meta = _meta(entry)
    if "." in field:
        meta["resources"]["registers"] = value
    else:
        meta[field] = value
    _set_meta(entry, meta)
    assert DiskCache().get(r.key) is None
    assert main(["cache", "verify"]) == 1
    assert field.split(".")[-1] in capsys.readouterr().out


def test_a_kernel_renamed_to_pass_its_own_checks_is_refused(golden, cache_dir, tmp_path, capsys, monkeypatch):
    # The symbol and the metadata renamed together: consistent in itself, but not the kernel its key's
    # spec names. Import refuses it; a build treats it as a miss.
    r = populate(golden, cache_dir)
    disk = DiskCache()
    entry = disk.entry_path(r.key)
    name = r.binary.kernel_name
    other = name[:-1] + ("0" if name[-1] != "0" else "1")
    cubin = (entry / "kernel.cubin").read_bytes().replace(name.encode(), other.encode())
    _forge(entry, cubin, kernel_name=other)
    assert disk.get(r.key) is not None  # its own checks pass
    clear_memory()
    assert build(SPEC, ARCH).origin == "compiled"  # but a build does not serve it, and replaces it
    assert disk.get(r.key).kernel_name == name
    _forge(entry, cubin, kernel_name=other)
    bundle = tmp_path / "renamed.tar"
    assert main(["cache", "export", str(bundle)]) == 0
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "other"))
    assert main(["cache", "import", str(bundle)]) == 1
    assert "kernel_name" in capsys.readouterr().err


def _text_range(cubin: bytes, name: bytes) -> tuple[int, int]:
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strs = heads[shstrndx][4]
    for h in heads:
        if cubin[strs + h[0]:].split(b"\0", 1)[0] == b".text." + name:
            return h[4], h[5]
    raise AssertionError("no .text section")


def test_import_verify_rebuilds_and_rejects_a_forged_bundle(golden, cache_dir, tmp_path, capsys, monkeypatch):
    # Consistent in itself (checksums, meta, ELF header, symbol) but the code is not what the key's spec
    # compiles to: only a rebuild finds it.
    r = populate(golden, cache_dir)
    disk = DiskCache()
    entry = disk.entry_path(r.key)
    cubin = bytearray((entry / "kernel.cubin").read_bytes())
    off, size = _text_range(bytes(cubin), r.binary.kernel_name.encode())
    cubin[off + size // 2] ^= 0x01
    _forge(entry, bytes(cubin))
    bundle = tmp_path / "forged.tar"
    assert main(["cache", "export", str(bundle)]) == 0
    for other in ("plain", "checked"):
        monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / other))
        clear_memory()
        argv = ["cache", "import", str(bundle)] + (["--verify-all"] if other == "checked" else [])
        rc = main(argv)
        out = capsys.readouterr()
        if other == "plain":
            assert rc == 0
        else:
            assert rc == 1 and r.key in out.err and "rebuil" in out.err
            assert DiskCache().entries() == []
    # A genuine bundle passes --verify (a sample) and --verify-all.
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "genuine"))
    clear_memory()
    good = tmp_path / "good.tar"
    shutil.rmtree(cache_dir)
    populate(golden, cache_dir)
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(cache_dir))
    assert main(["cache", "export", str(good)]) == 0
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "genuine"))
    assert main(["cache", "import", str(good), "--verify"]) == 0
    assert "rebuilt 2 of 2" in capsys.readouterr().out


# --- 6: a concurrent clear ------------------------------------------------------------------------

def test_clear_leaves_live_temporaries_alone_and_says_so(golden, cache_dir, capsys):
    populate(golden, cache_dir)
    tmp = cache_dir / "v1" / "tmp"
    tmp.mkdir(mode=0o700, exist_ok=True)
    live = tmp / f"{'1' * 64}.{os.getpid()}.cafef00d"
    stale = tmp / f"{'0' * 64}.99999.deadbeef"
    for d in (live, stale):
        d.mkdir(mode=0o700)
        (d / "kernel.cubin").write_bytes(b"half")
    old = time.time() - 2 * DiskCache.STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr().out
    assert live.exists() and not stale.exists()
    assert "1 write in progress" in out


def test_clear_reports_an_entry_committed_while_it_ran(golden, cache_dir, capsys, monkeypatch):
    root, results = golden
    populate(golden, cache_dir)
    real = DiskCache.clear
    late = results["sm_86"]

    def clear_then_a_builder_commits(self, *a, **kw):
        n = real(self, *a, **kw)
        src = root / "v1" / late.key[:2] / late.key
        dst = self.entry_path(late.key)
        dst.parent.mkdir(mode=0o700, exist_ok=True)
        shutil.copytree(src, dst)
        return n

    monkeypatch.setattr(DiskCache, "clear", clear_then_a_builder_commits)
    assert main(["cache", "clear"]) == 0
    out = capsys.readouterr()
    assert "removed 2 entries" in out.out and "1 entry was added" in out.out, out


# --- 7: odd objects in the layout --------------------------------------------------------------------

@pytest.mark.parametrize("odd", ["shard-file", "shard-link", "tmp-file", "locks-link", "lock-folder", "v1-file",
                                 "entry-file"])
def test_odd_objects_are_flagged_by_verify_and_repaired_by_clear(golden, cache_dir, tmp_path, capsys, odd):
    r = populate(golden, cache_dir)
    base = cache_dir / "v1"
    (tmp_path / "elsewhere").mkdir()
    kind, what = odd.split("-")
    if kind == "v1":
        shutil.rmtree(base)
        base.write_text("x")
        path = base
    else:
        path = {"shard": base / "zz", "tmp": base / "tmp", "locks": base / "locks",
                "lock": base / "locks" / f"{r.key}.lock", "entry": base / r.key[:2] / ("ee" * 32)}[kind]
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        path.parent.mkdir(mode=0o700, exist_ok=True)
        if what == "file":
            path.write_text("x")
        elif what == "link":
            path.symlink_to(tmp_path / "elsewhere")
        else:
            path.mkdir(mode=0o700)
    assert main(["cache", "verify"]) == 1
    assert str(path) in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    capsys.readouterr()
    assert not os.path.lexists(path) or (path.is_dir() and not path.is_symlink())
    assert (tmp_path / "elsewhere").is_dir()
    assert main(["cache", "verify"]) == 0


_HOLD = """
import os, sys, time
from attngen.cache import DiskCache
disk = DiskCache()
lock = disk.lock(sys.argv[1])
lock.acquire()
if sys.argv[2] == "orphan":  # the holder exits; a child that inherited the open lock keeps it locked
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
print("held", flush=True)
if sys.argv[2] == "orphan":
    os._exit(0)
time.sleep(60)
"""


@pytest.mark.parametrize("how", ["stopped", pytest.param("orphan", marks=pytest.mark.slow)])
def test_a_lock_whose_holder_is_stopped_or_dead_is_broken(golden, cache_dir, how):
    r = populate(golden, cache_dir)
    disk = DiskCache()
    shutil.rmtree(disk.entry_path(r.key))
    p = subprocess.Popen([sys.executable, "-c", _HOLD, r.key, how], env=child_env(cache_dir),
                         stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "held"
        if how == "stopped":
            os.kill(p.pid, signal.SIGSTOP)
        else:
            p.wait(timeout=10)
        env = child_env(cache_dir, ATTNGEN_LOCK_TIMEOUT="12")
        t0 = time.monotonic()
        got = subprocess.run([sys.executable, "-c", "from attngen.builder import build; from attngen import PrefillSpec;"
                              "print(build(PrefillSpec(head_dim=64), 'sm_80').stored)"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert got.returncode == 0 and got.stdout.strip() == "True", got.stderr
        assert time.monotonic() - t0 < 10
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def test_clear_removes_lock_files_not_held(golden, cache_dir):
    r = populate(golden, cache_dir)
    disk = DiskCache()
    with disk.lock(r.key):
        pass
    assert any((cache_dir / "v1" / "locks").iterdir())
    assert main(["cache", "clear"]) == 0
    assert list((cache_dir / "v1" / "locks").iterdir()) == []


def test_export_says_which_entries_it_left_out(golden, cache_dir, tmp_path, capsys):
    root, results = golden
    populate(golden, cache_dir)
    disk = DiskCache()
    (disk.entry_path(results["sm_80"].key) / "kernel.cu").unlink()
    assert main(["cache", "export", str(tmp_path / "b.tar")]) == 0
    out = capsys.readouterr()
    assert results["sm_80"].key in out.err and "kernel.cu" in out.err
    assert "exported 1 entries" in out.out or "exported 1 entry" in out.out
