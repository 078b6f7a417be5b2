"""A cache root cannot be turned against its user: private modes, owner and mode checks, no links
followed, nothing left behind by killed writes (docs/cache.md, "On disk")."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest

from attngen import CacheError, PrefillSpec, fs
from attngen.builder import build, clear_memory
from attngen.cache import DiskCache

SPEC = PrefillSpec(head_dim=64, dtype="fp16")
ARCH = "sm_80"


@pytest.fixture(autouse=True)
def _fresh_warnings():
    fs.forget_warnings()
    yield
    fs.forget_warnings()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "attngen"]


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_everything_created_is_private_whatever_the_umask(cache_dir):
    old = os.umask(0o002)
    try:
        assert build(SPEC, ARCH).stored
    finally:
        os.umask(old)
    paths = [cache_dir, *cache_dir.rglob("*")]
    dirs = [p for p in paths if p.is_dir()]
    files = [p for p in paths if p.is_file()]
    assert len(files) >= 3 and len(dirs) >= 4
    assert {_mode(d) for d in dirs} == {0o700}, {str(d): oct(_mode(d)) for d in dirs}
    assert {_mode(f) for f in files} == {0o600}, {str(f): oct(_mode(f)) for f in files}


def test_a_root_whose_parents_are_missing_is_created_private(cache_dir, monkeypatch, caplog):
    # A fresh machine has no ~/.cache: the default root's missing parents are made (0700), not a warning
    # that every process compiles again.
    root = cache_dir / "home" / ".cache" / "attngen"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(root))
    old = os.umask(0o022)
    try:
        with caplog.at_level(logging.WARNING, logger="attngen"):
            r = build(SPEC, ARCH)
    finally:
        os.umask(old)
    assert r.stored and not _warnings(caplog)
    assert [_mode(d) for d in (cache_dir / "home", cache_dir / "home" / ".cache", root)] == [0o700] * 3
    clear_memory()
    assert build(SPEC, ARCH).origin == "disk"


def test_a_root_writable_by_others_is_neither_read_nor_written(cache_dir, caplog):
    first = build(SPEC, ARCH)
    clear_memory()
    os.chmod(cache_dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="attngen"):
        r = build(SPEC, ARCH)
        clear_memory()
        build(SPEC, ARCH)
    assert (r.origin, r.stored) == ("compiled", False)  # the entry there was not loaded
    assert r.binary.cubin == first.binary.cubin
    msgs = _warnings(caplog)
    assert len(msgs) == 1, msgs  # once per root
    assert str(cache_dir) in msgs[0] and "writable by group and others (mode 0777)" in msgs[0]
    assert "ATTNGEN_CACHE_DIR" in msgs[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root (chown)")
def test_a_root_owned_by_another_user_is_refused(cache_dir, caplog):
    build(SPEC, ARCH)
    clear_memory()
    os.chown(cache_dir, 12345, -1)
    with caplog.at_level(logging.WARNING, logger="attngen"):
        r = build(SPEC, ARCH)
    assert (r.origin, r.stored) == ("compiled", False)
    assert "owned by uid 12345" in _warnings(caplog)[0]
    assert not DiskCache().usable()


def test_an_entry_writable_by_others_or_a_link_is_a_miss(cache_dir, tmp_path, caplog):
    r = build(SPEC, ARCH)
    disk = DiskCache()
    entry = disk.entry_path(r.key)
    os.chmod(entry, 0o722)
    with caplog.at_level(logging.WARNING, logger="attngen"):
        assert disk.get(r.key) is None
    assert str(entry) in _warnings(caplog)[0]
    os.chmod(entry, 0o700)
    assert disk.get(r.key) is not None
    # A file of the entry replaced by a link to a copy elsewhere: not followed.
    elsewhere = tmp_path / "elsewhere.cubin"
    elsewhere.write_bytes((entry / "kernel.cubin").read_bytes())
    (entry / "kernel.cubin").unlink()
    (entry / "kernel.cubin").symlink_to(elsewhere)
    assert disk.get(r.key) is None
    # The whole entry a link to a good copy elsewhere: not followed either; a put replaces the link.
    copy = tmp_path / "copy"
    os.rename(entry, copy)
    (copy / "kernel.cubin").unlink()
    (copy / "kernel.cubin").write_bytes(elsewhere.read_bytes())
    os.chmod(copy / "kernel.cubin", 0o600)
    entry.symlink_to(copy)
    assert disk.get(r.key) is None
    clear_memory()
    again = build(SPEC, ARCH)
    assert (again.origin, again.stored) == ("compiled", True)
    assert not entry.is_symlink() and copy.is_dir() and (copy / "kernel.cubin").exists()


def test_cache_clear_never_follows_a_link_out_of_the_root(cache_dir, tmp_path):
    build(SPEC, ARCH)
    outside = tmp_path / "precious"
    (outside / ("a" * 64)).mkdir(parents=True)
    (outside / ("a" * 64) / "meta.json").write_text("{}")
    (outside / "notes.txt").write_text("keep me")
    (cache_dir / "v1" / "ab").symlink_to(outside, target_is_directory=True)  # a shard that is a link
    disk = DiskCache()
    assert [e.path.parent.name for e in disk.entries()] != ["ab"]
    assert disk.clear() == 1
    assert (outside / "notes.txt").read_text() == "keep me" and (outside / ("a" * 64) / "meta.json").exists()
    # The link is unlinked (an odd object, repaired), never followed; the shards the clear emptied are gone too.
    assert [p.name for p in (cache_dir / "v1").iterdir() if len(p.name) == 2] == []


def test_a_lock_file_that_is_a_link_is_a_named_error(cache_dir, tmp_path):
    from attngen import get_arch, resolve
    from attngen.cache import key_material, key_of
    from attngen.compiler import compile_options

    disk = DiskCache()
    key = key_of(key_material(resolve(SPEC, ARCH), get_arch(ARCH), compile_options(get_arch(ARCH))))
    lock = disk.lock_path(key)
    fs.make_dirs(cache_dir, lock.parent)
    target = tmp_path / "victim"
    target.write_text("not a lock")
    lock.symlink_to(target)
    with pytest.raises(CacheError, match="is a symbolic link") as ei:
        build(SPEC, ARCH)
    assert str(lock) in str(ei.value)
    assert target.read_text() == "not a lock"


def test_temporaries_of_killed_writes_are_swept_by_the_next_write(cache_dir):
    build(PrefillSpec(head_dim=128, dtype="fp16"), ARCH)
    tmp = cache_dir / "v1" / "tmp"
    stale = tmp / f"{'0' * 64}.99999.deadbeef"
    fresh = tmp / f"{'1' * 64}.99998.cafef00d"
    for d in (stale, fresh):
        d.mkdir(mode=0o700)
        (d / "kernel.cubin").write_bytes(b"half")
    old = time.time() - 2 * DiskCache.STALE_TMP_SECONDS
    os.utime(stale, (old, old))
    assert build(SPEC, ARCH).stored
    assert not stale.exists() and fresh.exists()  # one being written right now is left alone


def test_an_unusable_root_says_so_once(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(blocker))
    clear_memory()
    with caplog.at_level(logging.WARNING, logger="attngen"):
        r = build(SPEC, ARCH)
        build(PrefillSpec(head_dim=128, dtype="fp16"), ARCH)
    assert (r.origin, r.stored) == ("compiled", False)
    msgs = _warnings(caplog)
    assert len(msgs) == 1 and str(blocker) in msgs[0] and "not a folder" in msgs[0], msgs
    clear_memory()
