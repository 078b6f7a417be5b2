"""Decode's head dims between the measured ones and its large GQA groups, on the CPU: which head dims the spec
takes and refuses (naming head_dim), the tile rule from the measured neighbours, compiles free of spills, and
the op's refusals on the stub driver (tests/host_path_decode_dims.py)."""

from __future__ import annotations

import re

import pytest

from attngen import DecodeSpec
from attngen.compiler import compile
from attngen.errors import SpecError
from attngen.families.decode import defaults
from attngen.families.decode.defaults import TUNED, TUNED_ROWS, measured_dim
from attngen.render import render
from attngen.spec import resolve
from tests import fake_cuda


def test_every_multiple_of_8_from_32_to_256_and_512():
    assert DecodeSpec.HEAD_DIMS == (*range(32, 257, 8), 512)
    for d in DecodeSpec.HEAD_DIMS:
        assert DecodeSpec(head_dim=d).head_dim == d
        assert DecodeSpec(head_dim=str(d)).head_dim == d


@pytest.mark.parametrize("d,why", [(24, "at least 4"), (59, "8-column"), (100, "8-column"), (264, "only 512"),
                                   (384, "only 512"), (520, "only 512"), (1024, "only 512"), (0, "8-column")])
def test_other_head_dims_are_refused_by_name(d, why):
    with pytest.raises(SpecError) as ei:
        DecodeSpec(head_dim=d)
    assert ei.value.field == "head_dim" and ei.value.value == d
    assert ei.value.allowed == "a multiple of 8 from 32 to 256, or 512" and why in str(ei.value)


def test_head_dim_512_splits_the_output_columns():
    """Two CTAs a KV head at 512, each with half the output accumulators: the accumulator check counts 256
    columns, the grid has twice the KV heads, no cluster merges the halves, and the unfused kernel is refused."""
    from attngen.arch import get_arch
    from attngen.families.decode import choose

    s = resolve(DecodeSpec(head_dim=512), "sm_90a")
    assert (s.d_parts, s.d_out) == (2, 256) and (s.cta_tile_kv, s.num_warps, s.num_stages) == (64, 4, 1)
    assert DecodeSpec(head_dim=256).d_parts == 1
    with pytest.raises(SpecError) as ei:
        DecodeSpec(head_dim=512, variant="unfused")
    assert ei.value.field == "variant"
    facts = _facts(get_arch("sm_90a"))
    for splits in (1, 4):
        ln = choose.launch(choose.Problem(512, heads=16, kv_heads=4, batch=3, capacity=4096, num_splits=splits),
                           s, facts)
        assert ln.grid == (splits, 8, 3) and ln.cluster == 0 and (ln.merge_grid is None) == (splits == 1)
    assert choose.cluster_limit(s, 1, facts) == 0


def _facts(arch):
    """An H100-like device (132 SMs, one CTA an SM, clusters of up to 8 resident) for the choice, on the CPU."""
    from attngen.families.choice import DeviceFacts

    return DeviceFacts(arch, 132, 0.5, lambda s, e="": 1, lambda s, n: 120 // n if n <= 8 else 0)


def test_measured_neighbour_table():
    """The tile rule: the nearest measured head dim at or above."""
    table = {32: 64, 40: 64, 56: 64, 64: 64, 72: 128, 80: 128, 96: 128, 120: 128, 128: 128, 136: 256, 160: 256,
             192: 256, 248: 256, 256: 256, 512: 512}
    assert {d: measured_dim(d) for d in table} == table
    assert {d for d, _ in TUNED} == {64, 128, 256, 512}


def test_row_elems_pad_to_an_odd_chunk_count():
    table = {32: 40, 40: 56, 72: 88, 80: 88, 96: 104, 200: 216, 248: 264, 64: 64, 128: 128, 256: 256}
    for d, elems in table.items():
        assert DecodeSpec(head_dim=d).row_elems == elems
        if d % 64:
            assert (elems // 8) % 2 == 1 and elems >= -(-d // 16) * 16 + 8


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d", [40, 72, 80, 96, 160, 200, 248])
@pytest.mark.parametrize("paged", [False, True])
def test_new_dims_take_their_neighbours_tiles_unless_they_spill(arch, d, paged):
    """A new dim's default: the first of its measured neighbour's configs (TUNED_PLAIN, TUNED_ROWS, then TUNED) that
    SPILLS_ON does not list for it on the arch."""
    for rows in (16, 32, 64):
        s = resolve(DecodeSpec(head_dim=d, paged=paged, q_rows=rows), arch)
        where = (d, paged, rows, "fused")
        listed = [*defaults.TUNED_PLAIN.get((measured_dim(d), paged, rows), ()),
                  *TUNED_ROWS.get((measured_dim(d), paged, rows, "fused"), ()), *TUNED[(measured_dim(d), paged)]]
        fits = [c for c in listed if arch not in defaults.SPILLS_ON.get((where, c), ())]
        got = (s.cta_tile_kv, s.num_warps, s.num_stages)
        assert arch not in defaults.SPILLS_ON.get((where, got), ()), (where, got)
        if fits and got != fits[0]:
            # the neighbour's config does not fit this spec (accumulators, shared memory): the next that does
            with pytest.raises(SpecError):
                resolve(DecodeSpec(head_dim=d, paged=paged, q_rows=rows, cta_tile_kv=fits[0][0],
                                   num_warps=fits[0][1], num_stages=fits[0][2]), arch)


def test_shared_memory_counts_the_padded_rows():
    s = resolve(DecodeSpec(head_dim=72, q_rows=16, cta_tile_kv=64, num_warps=4, num_stages=4), "sm_90a")
    assert s.smem_bytes() == max((16 + 4 * 64 * 2) * 88 * 2, 0)
    u = resolve(DecodeSpec(head_dim=40, q_rows=32, variant="unfused", cta_tile_kv=64, num_warps=4, num_stages=2),
                "sm_80")
    assert u.smem_bytes() >= 32 * 56 * 2 + 2 * (64 * 56 * 2 + 32 * 68 * 4)


def test_gqa_rows_to_128():
    assert DecodeSpec.rows_for(64, 1) == 64
    assert DecodeSpec.rows_for(128, 1) == 128
    assert DecodeSpec.rows_for(64, 2) == 128
    with pytest.raises(SpecError) as ei:
        DecodeSpec.rows_for(64, 3)
    assert ei.value.field == "q_rows"


def _spills(log: str) -> set:
    return {tuple(map(int, m)) for m in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)}


@pytest.mark.parametrize("arch,fields", [
    ("sm_90a", dict(head_dim=40, paged=True)),                             # d % 16 == 8, the smallest group
    ("sm_80", dict(head_dim=80, q_rows=64, local=True)),                   # 64 query heads over one KV head
    ("sm_90a", dict(head_dim=200, variant="unfused", softcap=True)),       # the unfused kernels
    ("sm_100", dict(head_dim=192, paged=True, q_rows=32, alibi=True)),   # swizzled rows, (row, chunk) copies
    ("sm_90a", dict(head_dim=512, paged=True, local=True)),                 # two CTAs a KV head
])
def test_representatives_compile_without_spills(arch, fields):
    s = resolve(DecodeSpec(**fields), arch)
    b = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries)
    for name in s.entries:
        assert b".text." + name.encode() + b"\x00" in b.cubin
    assert b.resources.known and _spills(b.log) == {(0, 0)}, b.log[-2000:]


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_op_refuses_other_head_dims_and_groups(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_decode_dims.py", tmp_path)
