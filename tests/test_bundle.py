"""Cache bundles (attngen cache export/import) and attngen cache verify: a CI job builds once, nodes
unpack; nothing damaged or planted in a bundle reaches the cache."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from attngen import PrefillSpec
from attngen.bundle import MANIFEST, export_bundle, import_bundle
from attngen.builder import build, clear_memory
from attngen.cache import DiskCache
from attngen.cli import main
from attngen.errors import CacheError

SPECS = [PrefillSpec(head_dim=64, dtype="fp16"), PrefillSpec(head_dim=128, dtype="bf16", mask="causal")]
ARCH = "sm_80"


def _populate():
    return [build(s, ARCH) for s in SPECS]


def _rewrite(src, dst, edit):
    """Copy bundle ``src`` to ``dst`` with ``edit(name, data) -> (name, data) | None`` per member;
    ``edit`` may also return a list of extra TarInfo/data pairs under the name "extra"."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w") as tout:
        for m in tin:
            got = edit(m.name, tin.extractfile(m).read())
            if got is None:
                continue
            name, data = got
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tout.addfile(info, io.BytesIO(data))


def test_export_then_import_into_an_empty_root_gives_disk_hits(cache_dir, tmp_path, monkeypatch):
    built = _populate()
    bundle = tmp_path / "kernels.tar.gz"
    m = export_bundle(DiskCache(), bundle)
    assert len(m["entries"]) == 2 and (bundle.stat().st_mode & 0o777) == 0o600
    node = tmp_path / "node"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(node))
    clear_memory()
    r = import_bundle(DiskCache(), bundle)
    assert (r["imported"], r["present"], r["rejected"], r["other_versions"]) == (2, 0, [], False)
    for s, b in zip(SPECS, built):
        hit = build(s, ARCH)
        assert (hit.origin, hit.key, hit.binary.cubin) == ("disk", b.key, b.binary.cubin)
    assert import_bundle(DiskCache(), bundle)["present"] == 2  # idempotent


def test_a_tampered_or_planted_member_is_rejected_and_nothing_else_is_lost(cache_dir, tmp_path, monkeypatch):
    built = _populate()
    good = tmp_path / "good.tar"
    export_bundle(DiskCache(), good)
    bad = tmp_path / "bad.tar"
    victim = built[0].key

    def edit(name, data):
        if name == f"{victim}/kernel.cubin":
            return name, data[:-16] + b"\0" * 16  # a flipped cubin: its checksum no longer matches
        return name, data

    _rewrite(good, bad, edit)
    with tarfile.open(bad, "a") as t:  # plus a member that tries to escape the entry folders
        info = tarfile.TarInfo("../../outside.txt")
        info.size = 3
        t.addfile(info, io.BytesIO(b"bad"))
        link = tarfile.TarInfo(f"{built[1].key}/kernel.cu")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(link)
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "node"))
    clear_memory()
    r = import_bundle(DiskCache(), bad)
    whats = {w for w, _ in r["rejected"]}
    assert victim in whats and "../../outside.txt" in whats and f"{built[1].key}/kernel.cu" in whats
    assert r["imported"] == 1  # the untouched entry still goes in
    assert not (tmp_path / "outside.txt").exists()
    assert DiskCache().get(victim) is None and DiskCache().get(built[1].key) is not None


def test_not_a_bundle_is_a_cache_error(tmp_path, cache_dir):
    p = tmp_path / "x.tar"
    p.write_bytes(b"not a tar")
    with pytest.raises(CacheError, match="not a readable attngen bundle"):
        import_bundle(DiskCache(), p)
    with tarfile.open(p, "w") as t:
        info = tarfile.TarInfo(MANIFEST)
        data = json.dumps({"format": 99}).encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    with pytest.raises(CacheError, match="format-1"):
        import_bundle(DiskCache(), p)


def test_cli_verify_export_import(cache_dir, tmp_path, capsys, monkeypatch):
    built = _populate()
    assert main(["cache", "verify"]) == 0
    assert "verified 2 entries" in capsys.readouterr().out
    bundle = tmp_path / "b.tar"
    assert main(["cache", "export", str(bundle), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["entries"] == 2
    # Damage one entry: verify names it and exits 1.
    cubin = DiskCache().entry_path(built[0].key) / "kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[:100])
    assert main(["cache", "verify", "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and [k for k, _ in out["damaged"]] == [built[0].key]
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "node"))
    clear_memory()
    assert main(["cache", "import", str(bundle)]) == 0
    assert "imported 2 entries" in capsys.readouterr().out
    assert main(["cache", "import", str(tmp_path / "missing.tar")]) == 2
    assert capsys.readouterr().err.startswith("attngen: error: ")
