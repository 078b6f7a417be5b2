"""Whole-row head dims: every multiple of 8 from 32 to 256 (the mma.sync kernel; a head dim of 8 mod 16 computes
over one zeroed chunk more), tiles from the nearest measured head dim at or above (``defaults.neighbour``), and the
rest refused naming the field, its value and the rule. The compile checks are real NVRTC builds."""

from __future__ import annotations

import pytest

from attngen.arch import get_arch
from attngen.compiler import compile
from attngen.errors import SpecError
from attngen.families.prefill import defaults
from attngen.families.prefill.spec import PrefillSpec, _smem_row
from attngen.render import render
from attngen.spec import Mma, parse_spec, resolve, validate

NEW = [d for d in range(32, 257, 8) if d not in (64, 96, 128, 192, 256)]


def test_every_multiple_of_8_from_32_to_256_is_a_whole_row_head_dim():
    assert PrefillSpec.WHOLE_DIMS == tuple(range(32, 257, 8))
    for d in PrefillSpec.WHOLE_DIMS:
        s = PrefillSpec(head_dim=d)
        assert not s.chunked and s.head_dim == d
    assert PrefillSpec(head_dim=120, head_dim_v=40).dim_v == 40


@pytest.mark.parametrize("field,value", [("head_dim", 59), ("head_dim", 111), ("head_dim", 24), ("head_dim", 16),
                                         ("head_dim", 264), ("head_dim", 300), ("head_dim", 2048),
                                         ("head_dim_v", 59), ("head_dim_v", 8)])
def test_other_head_dims_are_refused_by_name(field, value):
    with pytest.raises(SpecError) as e:
        PrefillSpec(**{field: value})
    assert e.value.field == field and e.value.value == value
    assert f"{field}={value}" in str(e.value) and "a multiple of 8 from 32 to 256 (whole rows)" in str(e.value)
    assert "320, 384, 448, 512, 576, 640, 768, 1024 (the chunked kernel)" in str(e.value)


@pytest.mark.parametrize("text,field", [("head_dim=160,head_dim_chunk=32", "head_dim"),
                                        ("head_dim=320,head_dim_v=40", "head_dim_v"),
                                        ("head_dim=80,head_dim_v=96", "head_dim")])
def test_the_chunked_kernel_keeps_its_measured_head_dims(text, field):
    with pytest.raises(SpecError) as e:
        parse_spec("prefill:" + text)
    assert e.value.field == field and "with the chunked kernel" in str(e.value)


@pytest.mark.parametrize("d", [40, 80, 160, 224])
def test_wgmma_refuses_a_head_dim_that_is_not_a_multiple_of_64_and_sm90a_defaults_to_mma_sync(d):
    with pytest.raises(SpecError) as e:
        validate(PrefillSpec(head_dim=d, mma="wgmma").replace(cta_tile_q=64, cta_tile_kv=64, num_warps=4,
                                                              num_stages=2), "sm_90a")
    assert e.value.field == "head_dim" and "whole 128-byte swizzle rows" in str(e.value)
    for layout in ({}, {"varlen": True}, {"varlen": True, "paged": True}, {"custom_mask": True}):
        r = resolve(PrefillSpec(head_dim=d, mask="causal", **layout), "sm_90a")
        assert r.mma is Mma.SYNC and not r.tma, r.to_text()


@pytest.mark.parametrize("d,want", [(32, 64), (40, 64), (56, 64), (64, 64), (72, 96), (80, 96), (96, 96),
                                    (104, 128), (120, 128), (128, 128), (136, 192), (160, 192), (192, 192),
                                    (200, 256), (224, 256), (248, 256), (256, 256)])
def test_tile_rule_takes_the_nearest_measured_head_dim_at_or_above(d, want):
    assert defaults.neighbour(d) == want
    assert defaults.tuned_sync(d) == defaults.TUNED[want]


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"])
def test_every_new_head_dim_resolves_and_fits_every_arch(arch):
    for d in NEW:
        for layout in ({}, {"varlen": True}, {"varlen": True, "paged": True}, {"custom_mask": True}):
            for mask in ("none", "causal", "sliding_window"):
                r = resolve(PrefillSpec(head_dim=d, mask=mask, **layout), arch)
                assert r.mma is Mma.SYNC and not r.chunked, r.to_text()
                assert r.smem_bytes() <= get_arch(arch).smem_per_block, (arch, r.to_text())


def test_rows_are_padded_to_the_gemm_width_and_stay_staggered():
    for d in PrefillSpec.WHOLE_DIMS:
        row = _smem_row(d)
        if d % 64 == 0:
            assert row == d  # swizzled, as before
        else:
            assert row >= -(-d // 16) * 16 + 8 and (row * 2 // 16) % 2 == 1, d  # an odd count of 16-byte chunks
    assert [_smem_row(d) for d in (96, 160, 40, 72)] == [104, 168, 56, 88]


def test_padded_head_dims_render_the_pad_code_and_others_do_not():
    pad = render(resolve(PrefillSpec(head_dim=40), "sm_80"))
    assert "constexpr int HEAD_DIM = 40;" in pad and "constexpr int ROW_ELEMS = 56;" in pad
    assert "constexpr int ROW_ELEMS = 88;" in render(resolve(PrefillSpec(head_dim=80), "sm_80"))


# One representative of each class (8 mod 16 small and large, multiples of 16 small and large), a layout each.
REPRESENTATIVES = [("head_dim=40,mask=causal", {}), ("head_dim=80", {"varlen": True, "paged": True}),
                   ("head_dim=200,mask=causal", {"custom_mask": True}), ("head_dim=224,mask=causal", {"varlen": True}),
                   ("head_dim=120,head_dim_v=72", {})]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("text,layout", REPRESENTATIVES)
def test_new_head_dim_defaults_compile_spill_free(arch, text, layout, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    s = resolve(parse_spec("prefill:" + text).replace(**layout), arch)
    r = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries).resources
    assert r.known and (r.spill_stores, r.spill_loads) == (0, 0), (arch, s.to_text())


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("d,dv", [(128, 72), (64, 40), (72, 64), (256, 136)])
def test_a_swizzled_head_dim_beside_one_of_8_mod_16_pads_both_and_compiles(arch, d, dv):
    """The pad chunk of a head dim of 8 mod 16 is read from padded rows, so the other side's tiles are padded
    too, not swizzled (which the template refuses beside a pad chunk)."""
    r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv), arch)
    assert not r.swizzled_rows and r.mma is Mma.SYNC
    src = render(r)
    assert "constexpr bool SWIZZLE = false;" in src and "constexpr bool SWIZZLE_V = false;" in src
    assert compile(src, arch, kernel_name=r.kernel_name, entries=r.entries).cubin  # NVRTC, for real
    assert resolve(PrefillSpec(head_dim=128, head_dim_v=64), arch).swizzled_rows  # both 16-multiples: as before
