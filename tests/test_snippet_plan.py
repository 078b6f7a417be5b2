"""A mask_mod's block plan without a GPU: the rule that decides whether a plan is per batch row / per head (the
snippet's C tokens name ``b`` / ``h``), the kernels that build and walk it with NVRTC (mma.sync on sm_80, wgmma with
the TMA pipeline and with cp.async on sm_90a), its parameter layout, that kernels without a mask_mod render as they
did, and the op's refusals (the host path on the stub driver: tests/host_path_snippets.py)."""

from __future__ import annotations

import pytest

from attngen import PrefillSpec
from attngen.compiler import compile
from attngen.errors import LaunchError, SpecError
from attngen.families import snippets
from attngen.families.prefill import masks
from attngen.families.prefill.op import plan_mode
from attngen.render import render
from attngen.spec import parse_spec, resolve

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


@pytest.mark.parametrize("text, aux, pooled", [
    (DOC, "doc:int32:2", True),
    ("return (kv_idx <= q_idx) | (kv_idx < prefix(b));", "prefix:int32:1", True),
    ("return q_idx - kv_idx < 256 || kv_idx < 4;", "", False),  # index arithmetic: cheaper than the bits' loads
    ("return q_idx > 0; // doc(b, kv_idx)", "doc:int32:2", False),  # an aux the snippet never reads
    ("return docs(b, kv_idx) > 0;", "doc:int32:2;docs:int32:2", True),
])
def test_a_mod_plan_keeps_a_pool_where_the_snippet_reads_aux(text, aux, pooled):
    assert snippets.reads_aux(text, aux) == pooled


FORMS = [  # the custom-mask kernels a mask_mod's plan runs on
    ("sm_80", PrefillSpec(head_dim=64, mask="causal", custom_mask=True, mask_mod=DOC, aux="doc:int32:2")),
    ("sm_90a", PrefillSpec(head_dim=128, custom_mask=True, sinks=True, score_mod="return score * 0.5f;",
                           mask_mod="return span(h) > q_idx - kv_idx;", aux="span:int32:1")),  # TMA, ping-pong
    ("sm_90a", PrefillSpec(head_dim=64, mask="sliding_window", custom_mask=True, mma="wgmma", pipeline="sync",
                           mask_mod="return q_idx >= 300;")),
    # the forms that read every partial tile's bits from the plan (mod_bits): TMA ping-pong, and cp.async
    ("sm_90a", PrefillSpec(head_dim=128, mask="causal", custom_mask=True, mask_mod=DOC, aux="doc:int32:2",
                           mod_bits=True)),
    ("sm_80", PrefillSpec(head_dim=64, custom_mask=True, mask_mod=DOC, aux="doc:int32:2", mod_bits=True,
                          score_mod="return score * 0.5f;")),
]


@pytest.mark.parametrize("arch, spec", FORMS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(FORMS)])
def test_plan_kernels_compile_and_take_the_hosts_layout(arch, spec):
    r = resolve(spec, arch)
    assert r.custom_mask and ("_modtiles", 256, 0) in r.launch_shapes()
    source = render(r)
    assert "mod_tiles<" in source and "mod_full" in source
    layout = masks._mod_plan_layout()  # PlanParams, ModArgs, then the pool's fields
    assert layout.format.startswith(snippets.mod_layout(masks.PLAN_PARAMS).format)
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


def test_mod_bits_leaves_mask_mod_to_the_plan():
    mixed = PrefillSpec(head_dim=128, mask="causal", custom_mask=True, mask_mod=DOC, aux="doc:int32:2")
    bits = mixed.replace(mod_bits=True)
    in_kernel = "UserMods::keep(p, {}"  # the step's mask_mod (the plan's is UserMods::keep(mp, ...))
    a, b = render(resolve(mixed, "sm_90a")), render(resolve(bits, "sm_90a"))
    assert in_kernel in a and in_kernel not in b and "mod_tiles<" in b and "mod_slot >= 0" in b
    assert "mod_bits" not in mixed.to_dict() and bits.to_dict()["mod_bits"] is True
    assert "_mbits_" in resolve(bits, "sm_90a").kernel_name and "mbits" not in resolve(mixed, "sm_90a").kernel_name
    # (attngen inspect --mask-mod-file: the snippet's source given beside the text, checked with it)
    assert parse_spec("prefill:mask=causal,custom_mask=true,aux=doc:int32:2,mod_bits=true", mask_mod=DOC) == bits
    for wrong in (dict(), dict(custom_mask=True), dict(mask_mod=DOC, aux="doc:int32:2"),
                  dict(custom_mask=True, mask_mod="return q_idx - kv_idx < 256;")):  # (no aux read)
        with pytest.raises(SpecError, match="mod_bits=True is not allowed: the keep bits come from the block plan"):
            PrefillSpec(mod_bits=True, **wrong)


@pytest.mark.parametrize("cells, tiles, aux, want", [  # (no aux read: no pool, test_a_mod_plan_keeps_a_pool...)
    (4096, (128, 128), "doc:int32:2", (True, 4096)),  # 4 x 4096 tokens of documents: 8 MiB of bits
    (32768, (128, 128), "doc:int32:2", (True, 32768)),  # 64 MiB: the most a pool takes
    (32769, (128, 128), "doc:int32:2", (False, 8192)),  # past it: a quarter of the cells in the mixed form
    (100, (128, 128), "doc:int32:2", (True, 100)),
    (10 ** 6, (64, 64), "doc:int32:2", (False, 131072)),  # 512 B a tile: the 64 MiB bound
])
def test_a_mod_plans_pool_and_the_kernels_form(cells, tiles, aux, want):
    spec = PrefillSpec(head_dim=128, custom_mask=True, mask_mod=DOC, aux=aux, cta_tile_q=tiles[0],
                       cta_tile_kv=tiles[1])
    form = masks.bits_form(spec, cells)
    assert (form, masks.pool_slots(spec.replace(mod_bits=form), cells)) == want


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
