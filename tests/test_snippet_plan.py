"""A mask_mod's block plan without a GPU: the rule that decides whether a plan is per batch row / per head (the
snippet's C tokens name ``b`` / ``h``), the kernels that build and walk it with NVRTC (mma.sync on sm_80, wgmma with
the TMA pipeline and with cp.async on sm_90a), its parameter layout, that kernels without a mask_mod render as they
did, and the op's refusals (the host path on the stub driver: tests/host_path_snippets.py)."""

from __future__ import annotations

import pytest

from attngen import PrefillSpec
from attngen.compiler import compile
from attngen.errors import LaunchError
from attngen.families import snippets
from attngen.families.prefill import masks
from attngen.families.prefill.op import plan_mode
from attngen.render import render
from attngen.spec import resolve

DOC = "return doc(b, q_idx) == doc(b, kv_idx);"


@pytest.mark.parametrize("text, reads", [
    (DOC, (True, False)),
    ("return span(h) > q_idx - kv_idx;", (False, True)),
    ("return x(b,h) != 0;", (True, True)),
    ("return q_idx % 5 != 2;", (False, False)),
    ("return bias_h(q_idx) > 0.f && hb(kv_idx) && b2(0);", (False, False)),  # names that only contain b / h
    ("// reads h\nreturn q_idx >= 0; /* and b\n over lines */", (False, False)),  # comments
    ('printf("b=%d h\\n", 1); return true;', (False, False)),  # a string literal
    ('printf("\\"h\\"", 0); return \'\\\\\' == h;', (False, True)),  # escaped quotes end no literal early
    ("return 'h' != 0 && '\\'' && q_idx > 0x1b && kv_idx < 1e3f + 0x1.bp+3;", (False, False)),  # chars, numbers
    ("int hh = 1;\nreturn s.h + hh;", (False, True)),  # a member named h counts: the check errs on the safe side
    ("#define HEAD h\nreturn HEAD > 0;", (False, True)),  # so does a macro's body
    ("return doc(\\\nb, 0);", (True, False)),
    ("return q_idx > 0; /* unterminated b", (False, False)),
])
def test_the_plan_reads_b_and_h_by_the_snippets_tokens(text, reads):
    assert snippets.reads_batch_head(text) == reads


FORMS = [  # the custom-mask kernels a mask_mod's plan runs on
    ("sm_80", PrefillSpec(head_dim=64, mask="causal", custom_mask=True, mask_mod=DOC, aux="doc:int32:2")),
    ("sm_90a", PrefillSpec(head_dim=128, custom_mask=True, sinks=True, score_mod="return score * 0.5f;",
                           mask_mod="return span(h) > q_idx - kv_idx;", aux="span:int32:1")),  # TMA, ping-pong
    ("sm_90a", PrefillSpec(head_dim=64, mask="sliding_window", custom_mask=True, mma="wgmma", pipeline="sync",
                           mask_mod="return q_idx >= 300;")),
]


@pytest.mark.parametrize("arch, spec", FORMS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(FORMS)])
def test_plan_kernels_compile_and_take_the_hosts_layout(arch, spec):
    r = resolve(spec, arch)
    assert r.custom_mask and ("_modtiles", 256, 0) in r.launch_shapes()
    source = render(r)
    assert "mod_tiles<" in source and "mod_full" in source
    layout = snippets.mod_layout(masks.PLAN_PARAMS)
    check = ("\nstatic_assert(__builtin_offsetof(attngen::ModPlanParams, mods) == "
             f"{masks.PLAN_PARAMS.size}, \"ModArgs' offset\");\n"
             f"static_assert(sizeof(attngen::ModPlanParams) == {layout.size}, \"ModPlanParams' size\");\n")
    b = compile(source + check, arch, kernel_name=r.kernel_name, entries=r.entries)
    assert b.cubin and r.kernel_name + "_modtiles" in r.entries


@pytest.mark.parametrize("spec", [PrefillSpec(head_dim=128, custom_mask=True),
                                  PrefillSpec(head_dim=64, mask="causal", custom_mask=True,
                                              score_mod="return score;"),
                                  PrefillSpec(head_dim=64, mask="causal", mask_mod=DOC, aux="doc:int32:2")])
def test_kernels_without_a_plan_have_none_of_its_code(spec):
    r = resolve(spec, "sm_90a")
    source = render(r)
    assert "mod_tiles" not in source and "ModPlanParams" not in source
    assert ("mod_full" in source) == bool(r.mask_mod)  # (a dense kernel's: MASK_LIST false, compiled away)
    assert not [s for s in r.launch_shapes() if s[0] == "_modtiles"]
    if r.custom_mask:
        assert "if (p.tiles[list_at + it] >= 0) {" in source  # (the mask tensor's bits as they were read)


def test_plan_modes():
    mods = ("", DOC, "doc:int32:2", ())
    assert plan_mode(None, None, mods) == ("auto", None)
    assert plan_mode("off", None, mods) == ("off", None)
    assert plan_mode("auto", object(), None) == ("auto", None)
    with pytest.raises(LaunchError, match="mask_plan='full' is not allowed; allowed: a MaskPlan"):
        plan_mode("full", None, mods)
    with pytest.raises(LaunchError, match="'off' is not allowed with a mask tensor"):
        plan_mode("off", object(), mods)
    with pytest.raises(LaunchError, match=r"needs the mask it was built from \(mask=\), or the mask_mod"):
        plan_mode(object(), None, ("return score;", "", "", ()))
