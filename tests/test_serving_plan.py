"""The serving step's plan on the host (no GPU): the ``_order`` entry's parameters as launch_order packs them, their
layout against the compiled PlanParams, and the batch bound BatchAttention.plan refuses beyond (the GPU tests:
tests/test_gpu_serving.py)."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from attngen import PrefillSpec
from attngen.compiler import compile
from attngen.errors import LaunchError
from attngen.families.prefill import masks
from attngen.families.prefill.spec import ORDER_SORT_MAX, ORDER_THREADS
from attngen.families.prefill.varlen import launch_order
from attngen.render import render
from attngen.spec import resolve

PLAN_CUH = Path(__file__).resolve().parents[1] / "templates" / "prefill" / "plan.cuh"
# PlanParams' fields in order, as the host packs them (masks.PLAN_PARAMS)
FIELDS = ("mask bits states tiles counts work work_count flags cu_q cu_k scratch m_sb m_sh m_sq bits_su mask_kind "
          "seqlen_q seqlen_k units_b units_h num_q_tiles num_kv_tiles bits_words win_left win_right batch total_q "
          "total_k paged seqlens cu_k_out decode_order max_decode_q_len").split()


class _Recorder:
    """A kernel that records its launches' packed parameters by field name."""

    def __init__(self):
        self.launches = []

    def launch_struct(self, layout, grid, stream, *values, entry=""):
        raw = layout.pack(*values)
        self.launches.append((entry, grid, dict(zip(FIELDS, masks.PLAN_PARAMS.unpack(raw)))))


def _offsets() -> dict:
    """Each field's byte offset in the host's layout (its format's prefix before the field)."""
    codes = re.findall(r"(\d*)([Qqi])", masks.PLAN_PARAMS.format)
    flat = [c for n, c in codes for _ in range(int(n or 1))]
    return {name: struct.calcsize("<" + "".join(flat[:i])) for i, name in enumerate(FIELDS)}


def test_the_host_layout_names_every_field():
    assert masks.PLAN_PARAMS.size == 208 and len(masks.PLAN_PARAMS.unpack(bytes(208))) == len(FIELDS)


def test_the_serving_plan_packs_its_own_fields():
    kern = _Recorder()
    launch_order(kern, 7, 0x1000, 40, 0x2000, 0x3000, -1, 0, 512, 900, 1 << 20, True, 8, seqlens_ptr=0x4000,
                 decode_order_ptr=0x5000)
    ((entry, grid, p),) = kern.launches
    assert entry == "_order" and grid == (1, 1, 1)
    assert (p["seqlens"], p["cu_k_out"], p["decode_order"], p["max_decode_q_len"]) == (0x4000, 0x3000, 0x5000, 8)
    assert p["seqlen_q"] == 0  # the split bound has its own field
    assert (p["work"], p["work_count"], p["scratch"]) == (0x1000, 0x1000 + 8 * 40, 0x1000 + 8 * 40 + 4)
    assert (p["cu_q"], p["cu_k"], p["batch"], p["total_q"], p["total_k"], p["paged"]) == (
        0x2000, 0x3000, 512, 900, 1 << 20, 1)


def test_prefill_varlen_plans_leave_the_serving_fields_empty():
    kern = _Recorder()
    launch_order(kern, 7, 0x1000, 40, 0x2000, 0x3000, -1, -1, 3, 90, 300, False)
    p = kern.launches[0][2]
    assert (p["seqlens"], p["cu_k_out"], p["decode_order"], p["max_decode_q_len"]) == (0, 0, 0, 0)
    kern = _Recorder()
    launch_order(kern, 7, 0x1000, 40, 0x2000, 0x3000, -1, -1, 3, 90, 300, True, 4, seqlens_ptr=0x4000)
    p = kern.launches[0][2]
    assert (p["seqlens"], p["cu_k_out"], p["decode_order"], p["max_decode_q_len"]) == (0x4000, 0x3000, 0, 4)


def test_launch_order_refuses_what_the_kernel_cannot_do():
    kern = _Recorder()
    with pytest.raises(LaunchError, match=f"batch={ORDER_SORT_MAX + 1}: .* at most {ORDER_SORT_MAX}"):
        launch_order(kern, 7, 0x1000, 40, 0x2000, 0x3000, -1, 0, ORDER_SORT_MAX + 1, 900, 1 << 20, True, 8,
                     seqlens_ptr=0x4000, decode_order_ptr=0x5000)
    with pytest.raises(LaunchError, match="seqlens_ptr is for a paged cache"):
        launch_order(kern, 7, 0x1000, 40, 0x2000, 0x3000, -1, 0, 4, 900, 1 << 20, False, 8, seqlens_ptr=0x4000)
    assert not kern.launches
    # the most the sort takes is accepted
    launch_order(kern, 7, 0x1000, 40, 0x2000, 0x3000, -1, 0, ORDER_SORT_MAX, 900, 1 << 20, True, 8,
                 seqlens_ptr=0x4000, decode_order_ptr=0x5000)
    assert len(kern.launches) == 1


def test_the_templates_constants_are_the_hosts():
    text = PLAN_CUH.read_text()
    for name, value in (("ORDER_SORT_MAX", ORDER_SORT_MAX), ("ORDER_THREADS", ORDER_THREADS)):
        assert re.search(rf"constexpr int {name} = {value};", text), name
    buckets = int(re.search(r"constexpr int ORDER_BUCKETS = (\d+);", text).group(1))
    # the sort's keys, the histogram and the scan's warps in the 48 KiB of static shared memory
    assert 8 * ORDER_SORT_MAX + 4 * buckets + 4 * 32 <= 48 * 1024


@pytest.mark.parametrize("arch, spec", [
    ("sm_80", PrefillSpec(head_dim=64, mask="causal", varlen=True, paged=True)),
    ("sm_90a", PrefillSpec(head_dim=128, mask="causal", varlen=True, paged=True, page_rows=True)),
])
def test_plan_params_compile_with_the_hosts_layout(arch, spec):
    r = resolve(spec, arch)
    assert ("_order", ORDER_THREADS, 0) in r.launch_shapes()
    off = _offsets()
    check = "".join(f"\nstatic_assert(__builtin_offsetof(attngen::PlanParams, {name}) == {off[name]}, \"{name}\");"
                    for name in ("cu_q", "m_sb", "mask_kind", "paged", "seqlens", "cu_k_out", "decode_order",
                                 "max_decode_q_len"))
    check += f"\nstatic_assert(sizeof(attngen::PlanParams) == {masks.PLAN_PARAMS.size}, \"PlanParams' size\");\n"
    b = compile(render(r) + check, arch, kernel_name=r.kernel_name, entries=r.entries)
    assert b.cubin and r.kernel_name + "_order" in r.entries
