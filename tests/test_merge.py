"""The merge family on the CPU: its spec and errors, the rendered source, a real NVRTC build of every manifest
entry for every arch the manifest lists, and the ops' host path on the stub driver (tests/host_path_merge.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import attngen
from attngen.arch import get_arch
from attngen.compiler import compile
from attngen.errors import SpecError
from attngen.families.choice import DeviceFacts
from attngen.families.merge.choose import Problem, choose, launch
from attngen.families.merge.spec import MergeDType, MergeSpec, States
from attngen.manifest import expand, load_manifest
from attngen.render import render
from attngen.spec import parse_spec, resolve
from tests import fake_cuda

ROOT = Path(__file__).resolve().parent.parent


def test_ops_and_spec_are_public():
    assert attngen.merge_state.__module__ == attngen.merge_states.__module__ == "attngen.families.merge.op"
    assert attngen.MergeSpec is MergeSpec and attngen.get_family("merge").spec is MergeSpec


def test_spec_text_round_trips_and_resolves_every_arch():
    s = parse_spec("merge:head_dim=256,dtype=fp32,states=many")
    assert (s.head_dim, s.dtype, s.states, s.num_warps) == (256, MergeDType.FP32, States.MANY, 0)
    assert parse_spec(str(s)) == s and MergeSpec.from_dict(s.to_dict()) == s
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"):
        r = resolve(s, arch)
        assert r.num_warps == 4 and r.threads == 128 and r.smem_bytes() == 0
    assert resolve(s.replace(num_warps=8), "sm_80").num_warps == 8


@pytest.mark.parametrize("fields, field, text", [
    (dict(head_dim=12), "head_dim", "a multiple of 8 from 8 to 1024"),
    (dict(head_dim=0), "head_dim", "a multiple of 8 from 8 to 1024"),
    (dict(head_dim=1032), "head_dim", "a multiple of 8 from 8 to 1024"),
    (dict(dtype="fp8"), "dtype", "fp16, bf16, fp32"),
    (dict(states="three"), "states", "pair, many"),
    (dict(num_warps=3), "num_warps", "0, 2, 4, 8"),
])
def test_spec_errors_name_field_value_and_allowed(fields, field, text):
    with pytest.raises(SpecError) as e:
        MergeSpec(**fields)
    assert e.value.field == field and text in str(e.value) and str(next(iter(fields.values()))) in str(e.value)


@pytest.mark.parametrize("head_dim, dtype, chunks", [
    (8, "bf16", 1), (256, "bf16", 1), (264, "fp16", 2), (1024, "bf16", 4), (128, "fp32", 1), (136, "fp32", 2),
    (1024, "fp32", 8),
])
def test_a_warp_takes_up_to_32_vectors_of_a_row(head_dim, dtype, chunks):
    s = MergeSpec(head_dim=head_dim, dtype=dtype)
    assert s.vec == (4 if dtype == "fp32" else 8) and s.chunks == chunks


def test_choice_grid_covers_every_row():
    facts = DeviceFacts(get_arch("sm_90a"))
    for tokens, heads, d, dtype in ((1, 1, 64, "bf16"), (7, 5, 1024, "fp16"), (1000, 32, 136, "fp32")):
        for states in ("pair", "many"):
            c = choose(Problem(d, dtype, states, tokens, heads), facts)
            lanes = tokens * heads * c.spec.lanes_per_row
            assert c.launch.grid[0] * c.spec.threads >= lanes > (c.launch.grid[0] - 1) * c.spec.threads
            assert launch(Problem(d, dtype, states, tokens, heads), c.spec) == c.launch
    # two states: a thread a vector (no idle lanes at head_dim 128 in bf16); several: whole warps a row
    pair = resolve(MergeSpec(head_dim=128, dtype="bf16"), "sm_90a")
    many = pair.replace(states=States.MANY)
    assert (pair.lanes_per_row, many.lanes_per_row) == (16, 32)
    assert choose(Problem(128, "bf16", "pair", 100, 8), facts).launch.grid == (100 * 8 * 16 // 128, 1, 1)


def test_kernel_names_read_the_variant():
    a = resolve(MergeSpec(head_dim=512, dtype="fp16", states="many"), "sm_90a")
    assert a.kernel_name.startswith("attngen_merge_d512_fp16_many_w4_")
    b = a.replace(states=States.PAIR)
    assert a.kernel_name != b.kernel_name


def test_render_binds_the_spec_and_includes_the_family_pieces():
    s = resolve(MergeSpec(head_dim=200, dtype="bf16", states="many"), "sm_80")
    src = render(s)
    assert f"{s.kernel_name}(const attngen::MergeParams<attngen::elem_t> params)" in src
    assert "MergeShape<elem_t, true, 200, 8, 1, 4,\n                         true>" in src
    for piece in ("common/ptx.cuh", "merge/params.cuh", "merge/vec.cuh", "merge/rows.cuh"):
        assert f"// attngen:begin {piece}" in src
    f32 = render(resolve(MergeSpec(head_dim=8, dtype="fp32"), "sm_80"))
    assert "using elem_t = float;" in f32 and "MergeShape<elem_t, false, 8, 4, 1, 4,\n                         false>" in f32


def _manifest_merges():
    return [(s, a) for s, a in expand(load_manifest(None)) if s.family == "merge"]


def test_manifest_lists_merges_for_every_arch():
    items = _manifest_merges()
    assert len(items) == 4 * 2 * 2 * 6
    assert {a.name for _, a in items} == {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"}


@pytest.mark.parametrize("spec, arch", _manifest_merges(), ids=lambda x: getattr(x, "name", None) or str(x))
def test_every_manifest_merge_compiles_without_spills(spec, arch):
    s = resolve(spec, arch)
    b = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries)
    assert b".text." + s.kernel_name.encode() + b"\x00" in b.cubin
    r = b.resources
    assert not r.known or (r.spill_stores, r.spill_loads) == (0, 0), b.log[-2000:]


@pytest.mark.parametrize("arch, fields", [
    ("sm_80", dict(head_dim=8, dtype="fp32")),                          # one vector a row, lanes past it idle
    ("sm_90a", dict(head_dim=200, dtype="fp16", states="many")),        # a part of a warp's lanes
    ("sm_100", dict(head_dim=1024, dtype="fp32", states="many", num_warps=8)),  # eight chunks a row
    ("sm_120", dict(head_dim=1024, dtype="bf16", num_warps=2)),
])
def test_representatives_compile_without_spills(arch, fields):
    s = resolve(MergeSpec(**fields), arch)
    b = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries)
    assert b".text." + s.kernel_name.encode() + b"\x00" in b.cubin
    assert b.resources.known and (b.resources.spill_stores, b.resources.spill_loads) == (0, 0), b.log[-2000:]


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_ops_host_path_on_the_stub(tmp_path):
    pytest.importorskip("torch")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "host_path_merge.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-3000:]
