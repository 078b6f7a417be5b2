"""Read-only layers below the cache root (ATTNGEN_CACHE_LAYERS) and attngen cache prune."""

from __future__ import annotations

import os
import time

import filelock
import pytest

from attngen import PrefillSpec
from attngen.bundle import export_bundle, import_bundle
from attngen.builder import build, clear_memory
from attngen.cache import DiskCache
from attngen.cli import main

SPECS = [PrefillSpec(head_dim=64, dtype="fp16"), PrefillSpec(head_dim=128, dtype="bf16", mask="causal")]
ARCH = "sm_80"


def _layer_from_bundle(tmp_path, monkeypatch):
    """A layer folder unpacked from a bundle built in another root; returns (layer, built results)."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "ci"))
    clear_memory()
    built = [build(s, ARCH) for s in SPECS]
    export_bundle(DiskCache(), tmp_path / "b.tar")
    layer = tmp_path / "layer"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(layer))
    import_bundle(DiskCache(), tmp_path / "b.tar")
    for dirpath, _, files in os.walk(layer):  # read-only, as a mounted image would be
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o400)
        os.chmod(dirpath, 0o500)
    return layer, built


def test_a_read_only_layer_serves_hits_and_writes_go_to_the_root(tmp_path, monkeypatch):
    layer, built = _layer_from_bundle(tmp_path, monkeypatch)
    root = tmp_path / "node"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(root))
    monkeypatch.setenv("ATTNGEN_CACHE_LAYERS", os.pathsep.join([str(tmp_path / "missing"), str(layer)]))
    clear_memory()
    try:
        hit = build(SPECS[0], ARCH)
        assert (hit.origin, hit.binary.cubin) == ("disk", built[0].binary.cubin)
        miss = build(PrefillSpec(head_dim=96, dtype="fp16"), ARCH)
        assert (miss.origin, miss.stored) == ("compiled", True)
        assert DiskCache().get(miss.key) is not None and DiskCache(layer, layer=True).get(miss.key) is None
    finally:
        for dirpath, _, _ in os.walk(layer):
            os.chmod(dirpath, 0o700)


def test_a_node_with_a_layer_and_no_writable_root_still_runs(tmp_path, monkeypatch):
    layer, built = _layer_from_bundle(tmp_path, monkeypatch)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(blocker))
    monkeypatch.setenv("ATTNGEN_CACHE_LAYERS", str(layer))
    clear_memory()
    try:
        assert build(SPECS[1], ARCH).origin == "disk"
        assert build(PrefillSpec(head_dim=96, dtype="fp16"), ARCH).stored is False  # compiled, kept in memory
    finally:
        for dirpath, _, _ in os.walk(layer):
            os.chmod(dirpath, 0o700)


def test_a_layer_writable_by_others_is_not_used(tmp_path, monkeypatch):
    layer, _ = _layer_from_bundle(tmp_path, monkeypatch)
    os.chmod(layer, 0o777)
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "node"))
    monkeypatch.setenv("ATTNGEN_CACHE_LAYERS", str(layer))
    clear_memory()
    try:
        assert build(SPECS[0], ARCH).origin == "compiled"
    finally:
        for dirpath, _, _ in os.walk(layer):
            os.chmod(dirpath, 0o700)


def test_prune_by_age_then_least_recently_used_never_a_locked_entry(cache_dir, capsys):
    rs = [build(s, ARCH) for s in SPECS + [PrefillSpec(head_dim=96, dtype="fp16")]]
    disk = DiskCache()
    now = time.time()
    for r, age in zip(rs, (10 * 86400, 2 * 3600, 60)):  # last used 10 days, 2 hours, a minute ago
        m = disk.entry_path(r.key) / "meta.json"
        os.utime(m, (now - age, now - age))
    assert [k for k, _ in disk.prune(older_than=86400)] == [rs[0].key]
    sizes = {e.key: e.size for e in disk.entries()}
    # Over the cap: the least recently used goes first; a locked one is skipped even when it is older.
    with filelock.FileLock(str(disk.lock_path(rs[1].key)), timeout=1):
        gone = disk.prune(max_bytes=sizes[rs[2].key])
    assert [k for k, _ in gone] == [rs[2].key] and disk.get(rs[1].key) is not None
    assert main(["cache", "prune", "--max-size", "0", "--json"]) == 0
    assert '"removed": 1' in capsys.readouterr().out and disk.entries() == []
    assert main(["cache", "prune"]) == 2
    assert "needs --max-size" in capsys.readouterr().err


@pytest.mark.parametrize("text,ok", [("500M", True), ("10G", True), ("12h", True), ("bogus", False)])
def test_prune_option_parsing(text, ok, cache_dir, capsys):
    opt = "--older-than" if text.endswith("h") else "--max-size"
    assert (main(["cache", "prune", opt, text]) == 0) is ok
