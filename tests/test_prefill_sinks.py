"""Attention sinks in the prefill family without a GPU: the spec switch, the kernels it builds on sm_80 and sm_90a
(every form: whole rows on mma.sync and wgmma, cp.async and TMA, serial, ping-pong and persistent; the chunked kernel
with its V tail and its pair of V splits; varlen, paged and custom-mask layouts), and the host path on the stub driver
(every entry point's sinks reach the kernel's last parameter; the checks name ``sinks``)."""

from __future__ import annotations

import pytest

from attngen import PrefillSpec
from attngen.compiler import compile
from attngen.errors import SpecError
from attngen.families.prefill import op
from attngen.render import render
from attngen.spec import parse_spec, resolve
from tests import fake_cuda


def test_sinks_is_a_switch_shown_only_when_on():
    on = PrefillSpec(head_dim=128, sinks="true")
    assert on.sinks is True and "sinks=true" in on.to_text() and "_sinks_" in resolve(on, "sm_80").kernel_name
    off = PrefillSpec(head_dim=128)
    assert off.sinks is False and "sinks" not in off.to_text()
    assert parse_spec(on.to_text()) == on and parse_spec("prefill:head_dim=128,sinks=false") == off
    with pytest.raises(SpecError, match="sinks"):
        PrefillSpec(head_dim=128, sinks="maybe")


def test_template_binds_the_switch():
    for flag in (False, True):
        src = render(resolve(PrefillSpec(head_dim=64, sinks=flag), "sm_80"))
        assert f"constexpr bool SINKS = {str(flag).lower()};" in src


# The sinks' pointer is the last field the launch packs: its offset in the kernel's parameter is the layout's size
# less 8, where the C struct must have it (asserted in each kernel's source as it builds).
_SYNC, _TMA3, _TMA4 = op._PARAMS_SINKS.size - 8, op._PARAMS_TMA_SINKS.size - 8, op._PARAMS_TMA4_SINKS.size - 8


def test_layouts_put_the_sinks_after_every_other_field():
    assert op._PARAMS_SINKS.size == op.PARAMS_EXT_SINKS.size == op.PARAMS_EXT.size + 12
    assert op._PARAMS_TMA_SINKS.size == op.PARAMS_EXT_TMA_SINKS.size == op._PARAMS_TMA_PERSISTENT.size + 8
    assert (_SYNC, _TMA3, _TMA4) == (312, 384 + 312, 512 + 312)


BUILDS = [
    ("prefill:head_dim=128,mask=causal,return_lse=true,sinks=true", "sm_80", _SYNC),
    ("prefill:head_dim=512,return_lse=true,sinks=true", "sm_80", _SYNC),  # chunked, mma.sync
    ("prefill:head_dim=96,mask=sliding_window,varlen=true,paged=true,sinks=true", "sm_80", _SYNC),
    ("prefill:head_dim=64,mask=causal,custom_mask=true,sinks=true", "sm_80", _SYNC),
    # sm_90a's defaults: TMA, ping-pong, persistent (head_dim 128), one CTA a tile (256)
    ("prefill:head_dim=128,mask=causal,return_lse=true,sinks=true", "sm_90a", _TMA3),
    # persistent with O staged in Q's tile (head_dim 256's 128x80 tiles)
    ("prefill:head_dim=256,mask=causal,return_lse=true,sinks=true,cta_tile_q=128,cta_tile_kv=80,num_warps=8,"
     "num_stages=2,mma=wgmma,pipeline=tma,schedule=pingpong,persistent=true", "sm_90a", _TMA3),
    # wgmma on the cp.async ring
    ("prefill:head_dim=64,mask=causal,sinks=true,cta_tile_q=64,cta_tile_kv=64,num_warps=4,num_stages=4,mma=wgmma,"
     "pipeline=sync,schedule=serial,persistent=false", "sm_90a", _SYNC),
    ("prefill:head_dim=128,varlen=true,sinks=true", "sm_90a", _TMA3),
    ("prefill:head_dim=128,custom_mask=true,mask=sliding_window,sinks=true", "sm_90a", _TMA3),
    # the chunked kernel on TMA: a V tail (four maps), and two V splits that pair up the QK work
    ("prefill:head_dim=576,return_lse=true,sinks=true", "sm_90a", _TMA4),
    ("prefill:head_dim=1024,mask=causal,return_lse=true,sinks=true", "sm_90a", _TMA3),
]


@pytest.mark.parametrize("text,arch,offset", BUILDS)
def test_sinks_kernels_build_spill_free_where_the_launch_packs_the_sinks(text, arch, offset):
    spec = resolve(parse_spec(text), arch)
    maps = (4 if spec.v_tail else 3) if spec.tma else 0
    assert offset == {0: _SYNC, 3: _TMA3, 4: _TMA4}[maps], "the kernel's form is not the one this case is for"
    field = "__builtin_offsetof(attngen::PrefillParams<attngen::elem_t>, sinks)"
    at = f"__builtin_offsetof(attngen::PrefillTmaParams<attngen::elem_t, {maps}>, p) + {field}" if maps else field
    source = render(spec) + f'\nstatic_assert({at} == {offset}, "the sinks are not where the launch packs them");\n'
    b = compile(source, arch, kernel_name=spec.kernel_name)
    r = b.resources
    assert (r.spill_stores, r.spill_loads) == (0, 0), (text, r, b.log)


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_sinks_through_every_entry_point_on_stub_driver(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_sinks.py", tmp_path)


def test_custom_ops_take_sinks_last_with_a_default():
    """torch.compile's ops carry sinks; calls made before the argument existed still bind."""
    pytest.importorskip("torch")
    import torch

    import attngen.torch_ops  # noqa: F401  (registers the ops)

    for op_ in (torch.ops.attngen.prefill, torch.ops.attngen.prefill_varlen):
        args = op_.default._schema.arguments
        assert (args[-1].name, str(args[-1].type), args[-1].default_value) == ("sinks", "Optional[Tensor]", None)
