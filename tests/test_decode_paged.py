"""Paged decode kernels on the CPU: a real NVRTC build of the paged copies (templates/decode/producer.cuh) for every
manifest arch, free of spills, at the layouts of a thread's rows in a 16-row group that the copies distinguish (one
row a group, rows 16 or 32 apart; two or four rows a group)."""

from __future__ import annotations

import pytest

from attngen import DecodeSpec
from attngen.compiler import compile
from attngen.manifest import load_manifest
from attngen.render import render
from attngen.spec import resolve

from tests.cache_support import ROOT

ARCHS = [a.name for a in load_manifest(ROOT / "cache" / "default.toml").archs]

# head_dim 128 at 16 rows (two rows a group, the kernel most paged calls run) on every arch; beside it one more a
# arch, rotating through head_dim 64 (8 warps: rows 32 apart), 256 (four rows a group), the unfused variant and
# 32 packed rows.
MAIN = dict(head_dim=128, dtype="bf16", q_rows=16)
ROTATING = [dict(head_dim=64, dtype="fp16", q_rows=16), dict(head_dim=256, dtype="bf16", q_rows=16),
            dict(head_dim=128, dtype="fp16", q_rows=32), dict(head_dim=128, dtype="bf16", q_rows=16, variant="unfused"),
            dict(head_dim=64, dtype="bf16", q_rows=32), dict(head_dim=256, dtype="fp16", q_rows=32)]


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_kernels_build_without_spills_for_every_manifest_arch(arch):
    assert len(ARCHS) <= len(ROTATING)
    for kw in (MAIN, ROTATING[ARCHS.index(arch)]):
        r = resolve(DecodeSpec(paged=True, **kw), arch)
        src = render(r)
        assert "paged=true" in src.splitlines()[1]
        b = compile(src, arch, kernel_name=r.kernel_name, entries=r.entries)
        assert b.cubin[:4] == b"\x7fELF"
        assert (b.resources.spill_stores, b.resources.spill_loads) == (0, 0), (arch, r.to_text(), b.resources)
