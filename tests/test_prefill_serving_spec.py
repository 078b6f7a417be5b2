"""The prefill family's serving switches on the CPU: custom_mask, varlen, paged (fields, errors,
arch defaults, module entries, rendering). The kernels run in tests/test_gpu_prefill_serving.py."""

from __future__ import annotations

import pytest

from attngen.errors import SpecError
from attngen.families.prefill.defaults import SPILLS_ON, candidates
from attngen.families.prefill.spec import Mma, PrefillSpec
from attngen.arch import get_arch
from attngen.render import render
from attngen.spec import parse_spec, resolve


def test_paged_needs_varlen_and_custom_mask_refuses_it():
    with pytest.raises(SpecError) as e:
        PrefillSpec(paged=True)
    assert e.value.field == "paged" and "varlen" in str(e.value)
    with pytest.raises(SpecError) as e:
        PrefillSpec(custom_mask=True, varlen=True)
    assert e.value.field == "custom_mask"
    assert PrefillSpec(varlen=True, paged=True).paged


def test_fields_parse_from_text_and_show_in_the_spec_text():
    s = parse_spec("prefill:head_dim=128,custom_mask=true")
    assert s.custom_mask and "custom_mask=true" in s.to_text(full=True)
    s = parse_spec("prefill:varlen=1,paged=yes")
    assert s.varlen and s.paged


@pytest.mark.parametrize("text,entries", [
    ("prefill:", ("",)),
    ("prefill:custom_mask=true", ("", "_mtiles", "_mlists", "_order")),
    ("prefill:varlen=true", ("", "_order")),
    ("prefill:varlen=true,paged=true", ("", "_order")),
    # snippets: no mask tensor plan builder (the spec without them builds that plan)
    ({"family": "prefill", "head_dim": 128, "custom_mask": True, "mask_mod": "return kv_idx <= q_idx;"},
     ("", "_mlists", "_modtiles", "_order")),
    ({"family": "prefill", "head_dim": 128, "custom_mask": True, "score_mod": "return score;"},
     ("", "_mlists", "_order")),
])
def test_module_entries_and_their_rendered_functions(text, entries):
    r = resolve(parse_spec(text), "sm_90a")
    assert tuple(s for s, _, _ in r.launch_shapes()) == entries
    src = render(r)
    for suffix in entries:
        assert f"{r.kernel_name}{suffix}(" in src
    assert ("_order(" in src) == (len(entries) > 1)
    assert ("_mtiles(" in src) == ("_mtiles" in entries)


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"])
@pytest.mark.parametrize("d", [d for d in PrefillSpec.HEAD_DIMS if d <= PrefillSpec.WHOLE_MAX])
def test_custom_masks_take_64_row_tiles_and_skip_measured_spills(arch, d):
    spec = PrefillSpec(head_dim=d, custom_mask=True)
    r = resolve(spec, arch)
    if arch == "sm_90a" and d == 128:  # the TMA pipeline's 128-row ping-pong, measured faster (TUNED_TMA_MASK)
        assert r.tma and r.cta_tile_q == 128, r
    elif arch == "sm_90a" and d == 240:  # every 64-row config spills there (SPILLS_ON)
        assert r.cta_tile_q == 128 and r.mma is Mma.SYNC, r
    else:
        assert r.cta_tile_q == 64, r  # finer query tiles skip more of a sparse mask
    spills = [arch in SPILLS_ON["mask"].get((d, tuple(c[:4]), c[4]), ()) for c in candidates(spec, get_arch(arch))]
    assert spills == sorted(spills)  # configs measured to spill come after every other


def test_varlen_skips_configs_that_spill_only_in_its_layout():
    dense = resolve(PrefillSpec(head_dim=64), "sm_100")
    varlen = resolve(PrefillSpec(head_dim=64, varlen=True), "sm_100")
    assert (dense.cta_tile_q, dense.cta_tile_kv, dense.num_warps, dense.num_stages) == (128, 64, 4, 3)
    assert (varlen.cta_tile_q, varlen.cta_tile_kv, varlen.num_warps, varlen.num_stages) != (128, 64, 4, 3)


def test_a_pinned_config_that_spills_is_still_given():
    pinned = PrefillSpec(head_dim=64, varlen=True, cta_tile_q=128, cta_tile_kv=64, num_warps=4, num_stages=3)
    r = resolve(pinned, "sm_100")  # listed in SPILLS_ON: never a default there, but the user's choice
    assert (r.cta_tile_q, r.cta_tile_kv, r.num_warps, r.num_stages) == (128, 64, 4, 3)


def test_wgmma_paths_cover_the_new_layouts():
    for text in ("prefill:custom_mask=true", "prefill:varlen=true,paged=true", "prefill:varlen=true,mask=causal"):
        assert resolve(parse_spec(text), "sm_90a").mma is Mma.WGMMA
        assert resolve(parse_spec(text), "sm_90").mma is Mma.SYNC
