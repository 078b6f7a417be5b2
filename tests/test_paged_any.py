"""Paged caches of any block size, what needs no GPU: the block-size check, the page_rows spec field of decode and
prefill (refused without paged, left out of the spec's dict and key while off, in the kernel's name and source
when on), the choice of the form by block size, and the manifest's page_rows kernels compiled spill-free on sm_80
and sm_90a (real NVRTC compiles). The GPU tests: tests/test_gpu_paged_any.py."""

from __future__ import annotations

import pytest

from attngen.compiler import compile
from attngen.errors import LaunchError, SpecError
from attngen.families.decode.choose import base_spec as decode_base
from attngen.families.decode.spec import DecodeSpec
from attngen.families.prefill.choose import VARLEN_PAGE_ROWS, VARLEN_PAGED, base_spec as prefill_base
from attngen.families.prefill.spec import PrefillSpec
from attngen.families.prefill.varlen import page_layout
from attngen.families.split_kv import check_block_size
from attngen.render import render
from attngen import MaskMode
from attngen.spec import parse_spec, resolve


@pytest.mark.parametrize("bs", [1, 2, 3, 8, 24, 16, 64, 256, 1000])
def test_any_positive_block_size_passes_where_rows_look_up(bs):
    assert check_block_size(bs, 5, "k_cache", multiple=1) == 5 * bs


def test_block_size_refusals_name_the_value_and_what_is_allowed():
    with pytest.raises(LaunchError, match=r"block_size=0 \(k_cache.shape\[1\]\) is not supported; allowed: a "
                                          r"positive int"):
        check_block_size(0, 5, "k_cache", multiple=1)
    with pytest.raises(LaunchError, match="allowed: a positive multiple of 16"):
        check_block_size(24, 5, "k_cache")  # the group form's rule, as MLA decode keeps it
    with pytest.raises(LaunchError, match="fewer than 2"):
        check_block_size(3, 2 ** 30, "k", multiple=1)


@pytest.mark.parametrize("cls,fields", [(DecodeSpec, {}), (PrefillSpec, {"varlen": True})])
def test_page_rows_needs_a_paged_cache(cls, fields):
    with pytest.raises(SpecError, match="page_rows"):
        cls(page_rows=True, **fields)


@pytest.mark.parametrize("spec", [DecodeSpec(paged=True), PrefillSpec(varlen=True, paged=True)])
def test_page_rows_is_left_out_while_off_and_named_when_on(spec):
    assert "page_rows" not in spec.to_dict()
    on = spec.replace(page_rows=True)
    assert on.to_dict()["page_rows"] is True
    assert "_prow" in on.kernel_name and "_prow" not in spec.kernel_name
    assert parse_spec(on.to_text()) == on


@pytest.mark.parametrize("text", ["decode:head_dim=128,paged=true", "decode:head_dim=256,paged=true,q_rows=32",
                                  "prefill:head_dim=128,mask=causal,varlen=true,paged=true,pipeline=sync"])
def test_the_row_form_is_a_define_the_default_source_lacks(text):
    spec = resolve(parse_spec(text), "sm_90a")
    rows = spec.replace(page_rows=True)
    assert "#define ATTNGEN_PAGE_ROWS" not in render(spec)
    assert "#define ATTNGEN_PAGE_ROWS 1" in render(rows)


def test_the_choice_takes_the_row_form_only_off_multiples_of_16():
    assert [page_layout(bs) for bs in (16, 32, 48, 64, 256)] == [VARLEN_PAGED] * 5
    assert [page_layout(bs) for bs in (1, 2, 3, 8, 24, 40)] == [VARLEN_PAGE_ROWS] * 6
    assert prefill_base(128, "bf16", MaskMode.CAUSAL, False, None, False, False, VARLEN_PAGE_ROWS, 128).page_rows
    assert not prefill_base(128, "bf16", MaskMode.CAUSAL, False, None, False, False, VARLEN_PAGED, 128).page_rows
    assert decode_base(128, "bf16", 16, True, "fused", None, page_rows=True).page_rows
    # a caller's spec cannot take the group form for blocks that need the row form, nor the reverse
    user = DecodeSpec(head_dim=128, paged=True, cta_tile_kv=64)
    assert decode_base(128, "bf16", 16, True, "fused", user, page_rows=True).page_rows
    assert not decode_base(128, "bf16", 16, True, "fused", user.replace(page_rows=True)).page_rows


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("text", ["decode:head_dim=128,dtype=bf16,q_rows=16,paged=true,page_rows=true",
                                  "decode:head_dim=128,dtype=fp16,q_rows=32,paged=true,page_rows=true",
                                  "prefill:head_dim=128,dtype=bf16,mask=causal,varlen=true,paged=true,page_rows=true"])
def test_manifest_row_kernels_compile_without_spills(arch, text, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    s = resolve(parse_spec(text), arch)
    r = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries).resources
    assert r.known and (r.spill_stores, r.spill_loads) == (0, 0), (text, arch, s.to_text())
