"""Prefill's q_scaled without a GPU: the spec field (off by default and then out of the dict and key), its refusals by
name, which kernels a call without a spec takes it in (a score_mod, an sm_scale that is a power of two, the TMA
kernels where Q's fragments fit), the launch check of the scale, and the kernels NVRTC builds: spill-free, with the
multiply by sm_scale gone from every score."""

from __future__ import annotations

import re

import pytest

from attngen import PrefillSpec
from attngen.arch import get_arch
from attngen.compiler import compile, performance_notes
from attngen.errors import LaunchError, SpecError
from attngen.families.prefill.checks import check_q_scaled
from attngen.families.prefill.choose import (CUSTOM_MASK, DENSE, SHORT_CAUSAL, THREE_GROUPS, VARLEN, base_spec,
                                             scales_exactly, sync_twin, table)
from attngen.families.prefill.plans import mods_key
from attngen.families.prefill.spec import MaskMode
from attngen.render import render
from attngen.spec import resolve

ALIBI = "return score + slope(h) * (float)(kv_idx - q_idx);"
SOFTCAP = "return 30.f * fast_tanh(score / 30.f);"
DOC = "return doc(b, q_idx) == doc(b, kv_idx);"
SM90A = get_arch("sm_90a")


def alibi(**fields) -> PrefillSpec:
    return PrefillSpec(score_mod=ALIBI, aux="slope:fp32:1", **fields)


def test_off_by_default_and_left_out_of_the_dict():
    off = alibi(head_dim=64)
    assert not off.q_scaled and "q_scaled" not in off.to_dict() and "_qs_" not in off.kernel_name
    on = off.replace(q_scaled=True)
    assert on.to_dict()["q_scaled"] is True and "_qs_" in on.kernel_name
    assert PrefillSpec.from_dict(on.to_dict()) == on
    assert "q_scaled=true" in on.to_text()


@pytest.mark.parametrize("fields, named", [
    (dict(head_dim=64, q_scaled=True), "without a score_mod"),
    (dict(head_dim=64, q_scaled=True, score_mod=ALIBI, aux="slope:fp32:1", softcap=True), "softcap=true"),
    (dict(head_dim=64, q_scaled=True, score_mod=ALIBI, aux="slope:fp32:1", alibi=True), "alibi=true"),
    (dict(head_dim=64, q_scaled="maybe", score_mod=ALIBI, aux="slope:fp32:1"), "true, false"),
])
def test_refused_by_name_where_the_fields_rule_it_out(fields, named):
    with pytest.raises(SpecError) as e:
        PrefillSpec(**fields)
    assert e.value.field == "q_scaled" and named in str(e.value)


@pytest.mark.parametrize("arch, fields, named", [
    ("sm_80", dict(head_dim=64), "mma=mma_sync"),
    ("sm_90a", dict(head_dim=64, mma="mma_sync"), "mma=mma_sync"),
    ("sm_90a", dict(head_dim=64, **{k: getattr(v, "value", v) for k, v in SHORT_CAUSAL.items()}), "pipeline=sync"),
    # three consumer warpgroups (160 registers a thread) and 128x128 tiles at head dim 128: Q's fragments spill
    ("sm_90a", dict(head_dim=64, **{k: getattr(v, "value", v) for k, v in THREE_GROUPS.items()}), "144 in all"),
    ("sm_90a", dict(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, mma="wgmma",
                    pipeline="tma", schedule="pingpong", persistent="true"), "192 in all"),
    # 128x192 at head dim 128 fits the TMA kernel's 208 without Q's fragments: q_scaled is the field named
    ("sm_90a", dict(head_dim=128, cta_tile_q=128, cta_tile_kv=192, num_warps=8, num_stages=2, mma="wgmma",
                    pipeline="tma", schedule="pingpong", persistent="true"), "240 in all"),
])
def test_refused_by_name_where_the_kernel_cannot_hold_it(arch, fields, named):
    with pytest.raises(SpecError) as e:
        resolve(alibi(mask="causal", q_scaled=True, **fields), arch)
    assert e.value.field == "q_scaled" and named in str(e.value)
    # the same spec without it is a kernel
    resolve(alibi(mask="causal", **fields), arch)


def test_scales_exactly_powers_of_two_in_fp16s_normal_range_up_to_one():
    assert all(scales_exactly(2.0 ** -e) for e in range(15))
    assert not any(scales_exactly(x) for x in (128 ** -0.5, 0.1, 2.0, 2.0 ** -15, 0.125 * (1 + 2 ** -20)))


def test_the_plan_key_marks_a_score_mod_call_whose_scale_is_exact():
    assert mods_key(None, 0.125) == ()
    mods = (ALIBI, "", "slope:fp32:1", (("slope", None),))
    assert mods_key(mods, 0.125) == ((ALIBI, "", "slope:fp32:1", True),)
    assert mods_key(mods, 128 ** -0.5) == ((ALIBI, "", "slope:fp32:1"),)
    assert mods_key(("", DOC, "doc:int32:2", ()), 0.125) == (("", DOC, "doc:int32:2"),)  # no score_mod


def _table(d, mask, layout, *, scaled=True, default=True, arch=SM90A, mods=(ALIBI, "", "slope:fp32:1"), user=None):
    base = base_spec(d, "bf16", mask, False, user, False, False, layout, d, False, mods)
    return table(base, arch, default, (), scaled)


def test_calls_without_a_spec_take_it_in_the_tma_kernels_where_it_fits():
    t = _table(64, MaskMode.CAUSAL, DENSE)  # by rows: the cp.async 64-row kernel, the 128-row TMA one, three groups
    assert [s.q_scaled for s in t.specs] == [False, True, False]
    assert not t.specs[0].tma and t.specs[1].tma and t.specs[2].num_warps == 12
    assert [s.q_scaled for s in _table(64, MaskMode.NONE, DENSE).specs] == [True, False]
    assert all(s.q_scaled for s in _table(64, MaskMode.NONE, VARLEN).specs)
    assert all(s.q_scaled for s in _table(128, MaskMode.CAUSAL, DENSE).specs[:1])  # 64-row TMA tiles, a given 1/8
    assert not any(s.q_scaled for s in _table(128, MaskMode.NONE, DENSE).specs)  # 128x128: no registers for it
    for other in (dict(scaled=False), dict(default=False), dict(arch=get_arch("sm_80")),
                  dict(mods=("", DOC, "doc:int32:2"))):
        layout = CUSTOM_MASK if other.get("mods") else DENSE
        assert not any(s.q_scaled for s in _table(64, MaskMode.NONE, layout, **other).specs), other
    # the tiles are the ones the call takes without it
    plain = _table(64, MaskMode.CAUSAL, DENSE, scaled=False)
    assert [s.replace(q_scaled=False) for s in _table(64, MaskMode.CAUSAL, DENSE).specs] == list(plain.specs)


def test_a_caller_spec_keeps_its_own_choice_and_the_cp_async_twin_leaves_it():
    tiles = dict(cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, mma="wgmma", pipeline="tma",
                 schedule="overlap", persistent="false")
    (s,) = _table(64, MaskMode.CAUSAL, DENSE, default=False, user=alibi(q_scaled=True, **tiles)).specs
    assert s.q_scaled and s.tma
    (s,) = _table(64, MaskMode.CAUSAL, DENSE, default=False, user=alibi(**tiles)).specs
    assert not s.q_scaled  # (a caller's spec: as given)
    (tma,) = [s for s in _table(64, MaskMode.NONE, DENSE).specs if s.q_scaled]
    twin = sync_twin(tma)
    assert not twin.q_scaled and not twin.tma
    resolve(twin, SM90A)


def test_a_launch_with_a_scale_it_cannot_take_is_a_launch_error():
    spec = resolve(alibi(head_dim=64, mask="causal", q_scaled=True), SM90A)
    check_q_scaled(spec, 0.125)
    check_q_scaled(spec.replace(q_scaled=False), 0.1)
    with pytest.raises(LaunchError, match=r"sm_scale=0\.1 with the spec's q_scaled=true"):
        check_q_scaled(spec, 0.1)


def _forms():
    """Every q_scaled kernel a call without a spec takes at head dims 64 and 128 (ALiBi; a document mask beside it
    in the custom-mask form)."""
    seen = {}
    for d in (64, 128):
        for mask in (MaskMode.CAUSAL, MaskMode.NONE):
            for layout in (DENSE, VARLEN, CUSTOM_MASK):
                mods = (ALIBI, DOC, "doc:int32:2;slope:fp32:1") if layout == CUSTOM_MASK else (ALIBI, "", "slope:fp32:1")
                for s in _table(d, mask, layout, mods=mods).specs:
                    if s.q_scaled:
                        seen[s.kernel_name] = s
    return list(seen.values())


FORMS = _forms()


def _f32_multiplies(ptx: str) -> int:
    return len(re.findall(r"\bmul(?:\.rn)?(?:\.ftz)?\.f32\b", ptx))


@pytest.mark.parametrize("spec", FORMS, ids=[s.kernel_name.split("_", 2)[2].rsplit("_", 1)[0] for s in FORMS])
def test_the_kernels_build_spill_free_without_the_scores_multiply(spec):
    assert len(FORMS) >= 5
    on = compile(render(spec), "sm_90a", kernel_name=spec.kernel_name, entries=spec.entries, want_ptx=True)
    r = on.resources
    assert r.known and r.spill_stores == 0 and r.spill_loads == 0 and not performance_notes(on.log)
    # Q's registers times sm_scale once: one 16-bit pair multiply a register of the warp's Q fragments
    steps = spec.head_dim // 16
    assert len(re.findall(r"mul\.rn\.bf16x2", on.ptx)) == 4 * steps
    off = spec.replace(q_scaled=False)
    base = compile(render(off), "sm_90a", kernel_name=off.kernel_name, entries=off.entries, want_ptx=True)
    # the score's multiply by sm_scale, one an element of a thread's tile (BLOCK_N / 2 of them) in each copy of the
    # step, is gone
    assert _f32_multiplies(base.ptx) - _f32_multiplies(on.ptx) >= spec.cta_tile_kv // 2
