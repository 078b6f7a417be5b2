"""score_mod / mask_mod snippets without a GPU: the spec fields (off by default and then out of the spec's dict, shown
by hash in its text, by content in its key), the aux signature's checks, the kernels they build with NVRTC (prefill
on mma.sync, wgmma and TMA, varlen, paged and custom-mask; decode), NVRTC's errors at the user's own lines, attngen
inspect's snippet files, and the host paths on the stub driver (tests/host_path_snippets*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from attngen import DecodeSpec, PrefillSpec, build
from attngen.cache_key import key_material, key_of
from attngen.compiler import compile, compile_options
from attngen.errors import LaunchError, SpecError
from attngen.families import snippets
from attngen.arch import get_arch
from attngen.render import render
from attngen.spec import parse_spec, resolve
from tests import fake_cuda

ROOT = Path(__file__).resolve().parent.parent
ALIBI = "return score - slope(h) * fabsf((float)(q_idx - kv_idx));"
DOC = "return doc(b, q_idx) == doc(b, kv_idx);"


def test_off_by_default_and_left_out_of_the_dict():
    for spec in (PrefillSpec(), DecodeSpec()):
        assert not {"score_mod", "mask_mod", "aux"} & set(spec.to_dict())
        assert "smod" not in spec.kernel_name and "score_mod" not in spec.to_text()
    on = PrefillSpec(score_mod=ALIBI, aux="slope:fp32:1")
    assert on.to_dict()["score_mod"] == ALIBI and on.to_dict()["aux"] == "slope:fp32:1"
    assert PrefillSpec.from_dict(on.to_dict()) == on
    assert "_smod_" in on.kernel_name and "_mmod_" in PrefillSpec(mask_mod=DOC, aux="doc:int32:2").kernel_name
    # whitespace only is off
    assert PrefillSpec(score_mod="  \n") == PrefillSpec()


@pytest.mark.parametrize("spec", [PrefillSpec(head_dim=128, mask="causal"), PrefillSpec(head_dim=64, varlen=True),
                                  PrefillSpec(head_dim=96, custom_mask=True), DecodeSpec(head_dim=128, paged=True)])
def test_a_kernel_without_snippets_has_none_of_their_code(spec):
    # (the default kernels' machine code stays as it was: tools/cubin_digests.py; here, their source's part of it)
    source = render(resolve(spec, "sm_90a"))
    # the plain headers' snippet code (the UserMods variant, decode's user_mods) is compiled only where ATTNGEN_MODS
    # is defined; prefill's steps have none at all
    assert "#define ATTNGEN_MODS" not in source and "ModArgs mods;" in source
    if spec.family == "prefill":
        assert "#ifdef ATTNGEN_MODS\n// The user's snippets" in source and "user_score_mod(p.mods" in source
        assert "UserMods::" not in source
    on = render(resolve(spec.replace(mask_mod="return true;"), "sm_90a"))
    assert "#define ATTNGEN_MODS 1" in on and "UserMods::keep(" in on
    assert on.count("user_mask_mod(") >= 3  # declared, defined, called by UserMods::keep


def test_text_shows_a_hash_that_is_not_read_back():
    on = PrefillSpec(score_mod=ALIBI, aux="slope:fp32:1")
    text = on.to_text()
    assert "score_mod=sha:" in text and ALIBI not in text and "aux=slope:fp32:1" in text
    with pytest.raises(SpecError) as e:
        parse_spec(text)
    assert e.value.field == "score_mod" and "pass the source through" in str(e.value)


def test_the_key_holds_the_snippet_by_content():
    arch = get_arch("sm_80")

    def key(**kw):
        spec = resolve(PrefillSpec(head_dim=64, **kw), arch)
        return key_of(key_material(spec, arch, compile_options(arch)))

    a = key(score_mod="return score * 0.5f;")
    assert a == key(score_mod="return score * 0.5f;")
    assert len({a, key(score_mod="return score * 0.25f;"), key(mask_mod="return score * 0.5f;"), key()}) == 4
    assert key(score_mod=ALIBI, aux="slope:fp32:1") != key(score_mod=ALIBI, aux="slope:fp16:1")


@pytest.mark.parametrize("aux, text", [
    ("x:fp64:1", "dtype 'fp64'"),
    ("x:fp32:5", "ndim 1 to 4"),
    ("x:fp32", "'name:dtype:ndim:wide' items"),
    ("x:fp32:1:64", "'name:dtype:ndim:wide' items"),
    ("x:fp32:1:wide:wide", "'name:dtype:ndim:wide' items"),
    ("int:fp32:1", "C identifier"),
    ("q_idx:fp32:1", "C identifier"),
    ("mods_:fp32:1", "C identifier"),
    ("__x:fp32:1", "C identifier"),
    ("a:fp32:1;a:fp16:1", "each name once"),
    ("a:fp32:1;c:fp32:1;d:fp32:1;e:fp32:1;f:fp32:1", "at most 4"),
])
def test_aux_signature_refusals(aux, text):
    with pytest.raises(SpecError) as e:
        PrefillSpec(score_mod="return score;", aux=aux)
    assert e.value.field == "aux" and text in str(e.value)


def test_aux_signature_is_canonical():
    assert PrefillSpec(score_mod="return score;", aux=" z:int64:1 ; a:bf16:3").aux == "a:bf16:3;z:int64:1"
    assert PrefillSpec(score_mod="return score;", aux="z:int64:1: wide;a:bf16:3").aux == "a:bf16:3;z:int64:1:wide"


@pytest.mark.parametrize("shape, strides, wide", [
    ((2**31,), (1,), False),             # the last element is 2^31 - 1 from the first
    ((2**31 + 1,), (1,), True),
    ((2, 2**30 + 1), (2**30 + 1, 1), True),
    ((2, 2**30), (2**30, 1), False),
    ((2**40, 8), (0, 1), False),         # expanded: every row the same memory
    ((0, 2**40), (2**40, 1), False),     # empty: nothing is read
    ((2, 2**31), (-(2**31), 1), True),   # each reach apart: back 2^31 from the first, forward 2^31 - 1
    ((2, 2**31 - 1), (-(2**31), 1), True),
    ((3, 5), (-4, 1), False),
    ((1, 7), (2**40, 1), False),         # a dim of one: its stride is never multiplied by more than 0
])
def test_a_tensor_is_wide_where_an_offset_leaves_32_bits(shape, strides, wide):
    assert snippets.needs_wide(shape, strides) is wide


def test_a_mask_mod_reading_aux_takes_whole_rows_of_reads_at_once_on_the_two_warpgroup_kernel():
    """mask_mod_aux: whether mask_mod names an aux tensor (not in a comment, not score_mod's); the step then reads a
    128-key tile's columns in one chunk on the 8-warp wgmma kernel, and keeps 8 a chunk otherwise."""
    doc, aux = "return doc(b, q_idx) == doc(b, kv_idx);", "doc:int32:2"
    assert snippets.template_context("", doc, aux)["mask_mod_aux"] is True
    assert snippets.template_context("", "return kv_idx <= q_idx; // doc(b, q_idx)", aux)["mask_mod_aux"] is False
    assert snippets.template_context("return score + doc(b, kv_idx);", "return true;", aux)["mask_mod_aux"] is False
    spec = dict(head_dim=128, dtype="bf16", mask="causal", custom_mask=True, cta_tile_q=128, cta_tile_kv=128,
                num_warps=8, num_stages=2, mma="wgmma", pipeline="tma", schedule="pingpong", persistent=False)
    assert "constexpr bool WIDE = true && WGMMA" in render(PrefillSpec(mask_mod=doc, aux=aux, **spec), "sm_90a")
    window = render(PrefillSpec(mask_mod="return q_idx - kv_idx < 1024;", **spec), "sm_90a")
    assert "constexpr bool WIDE = false && WGMMA" in window


def test_the_accessor_takes_offsets_in_the_width_the_aux_item_says():
    ctx = snippets.template_context("return score + t(h, q_idx) + u(kv_idx);", "", "t:fp32:2;u:fp16:1:wide")
    defs = ctx["mods_defs"]
    assert "auto t = [&](int i0, int i1) -> float" in defs and "i1 * (int)mods_.stride[0][1]" in defs
    assert "auto u = [&](long long i0) -> float" in defs and "i0 * mods_.stride[1][0])" in defs


class _Info(NamedTuple):
    kind: str
    ptr: int
    shape: tuple
    strides: tuple
    dtype: str
    device: int


def test_a_wide_tensor_needs_a_wide_item():
    """The launch's guard: pack_aux refuses a tensor past 2^31 elements for a 32-bit item, by name; a caller's spec
    and the call agree on the mark both ways (check_spec_mods)."""
    q = _Info("torch", 1, (4, 8), (8, 1), "fp16", 0)
    big = _Info("torch", 2, (2, 2**31), (2**31, 1), "uint8", 0)
    small = _Info("torch", 3, (2, 16), (16, 1), "uint8", 0)
    with pytest.raises(LaunchError, match=r"aux\['keep'\] .*2\^31 or more apart.*keep:...:wide"):
        snippets.pack_aux("keep:uint8:2", (("keep", big),), q)
    assert snippets.pack_aux("keep:uint8:2:wide", (("keep", big),), q)[:2] == (2, 0)
    assert snippets.pack_aux("keep:uint8:2:wide", (("keep", small),), q)[0] == 3
    mask = "return keep(0, kv_idx) != 0;"
    spec = PrefillSpec(mask_mod=mask, aux="keep:uint8:2")
    with pytest.raises(LaunchError, match="32-bit offsets"):
        snippets.check_spec_mods(spec, ("", mask, "keep:uint8:2:wide", (("keep", big),)))
    with pytest.raises(LaunchError, match="marks it wide"):
        snippets.check_spec_mods(spec.replace(aux="keep:uint8:2:wide"), ("", mask, "keep:uint8:2", (("keep", small),)))
    snippets.check_spec_mods(spec, ("", mask, "keep:uint8:2", (("keep", small),)))


def test_refused_where_not_built():
    with pytest.raises(SpecError) as e:
        PrefillSpec(head_dim=512, score_mod="return score;")
    assert e.value.field == "score_mod" and "chunked kernel" in str(e.value)
    with pytest.raises(SpecError) as e:
        DecodeSpec(variant="unfused", mask_mod="return true;")
    assert e.value.field == "variant" and "fused kernel" in str(e.value)
    with pytest.raises(SpecError) as e:
        DecodeSpec(kv_dtype="fp8_e4m3", score_mod="return score;")
    assert e.value.field == "kv_dtype"
    with pytest.raises(SpecError) as e:
        PrefillSpec(score_mod=42)
    assert e.value.field == "score_mod"


# Each form of kernel a snippet runs in, with every aux dtype read somewhere.
FORMS = [
    ("sm_80", PrefillSpec(head_dim=128, mask="causal", score_mod=ALIBI, mask_mod=DOC, aux="doc:int32:2;slope:fp32:1")),
    ("sm_80", PrefillSpec(head_dim=64, varlen=True, paged=True, sinks=True, softcap=True,
                          score_mod="return score + (float)bias(h, q_idx - kv_idx + 4096);", aux="bias:bf16:2:wide")),
    ("sm_86", PrefillSpec(head_dim=96, custom_mask=True, mask="sliding_window",
                          mask_mod="return keep(q_idx, kv_idx) != 0;", aux="keep:uint8:2")),
    ("sm_90a", PrefillSpec(head_dim=128, mma="wgmma", pipeline="sync", score_mod=ALIBI, aux="slope:fp16:1")),
    ("sm_90a", PrefillSpec(head_dim=128, mask="causal", score_mod=ALIBI, mask_mod="return doc(kv_idx) >= 0;",
                           aux="doc:int64:1;slope:fp32:1")),  # the TMA ping-pong persistent kernel
    ("sm_90a", PrefillSpec(head_dim=64, varlen=True, mask_mod=DOC, aux="doc:int32:2")),
    ("sm_90a", PrefillSpec(head_dim=128, custom_mask=True, sinks=True, mask_mod=DOC, aux="doc:int32:2")),
    ("sm_80", DecodeSpec(head_dim=128, q_rows=16, score_mod=ALIBI, mask_mod=DOC, aux="doc:int32:2;slope:fp32:1")),
    ("sm_90a", DecodeSpec(head_dim=64, q_rows=32, paged=True, local=True, sinks=True, mask_mod=DOC,
                          aux="doc:int32:2")),
    ("sm_90a", DecodeSpec(head_dim=512, q_rows=16, score_mod="return score * 0.5f;")),
]


@pytest.mark.parametrize("arch, spec", FORMS, ids=[f"{a}-{s.family}-{i}" for i, (a, s) in enumerate(FORMS)])
def test_snippet_kernels_compile(arch, spec):
    r = resolve(spec, arch)
    source = render(r)
    for field in ("score_mod", "mask_mod"):
        text = getattr(spec, field)
        if text:
            assert f'#line 1 "{field}"\n{text}\n' in source
    b = compile(source, arch, kernel_name=r.kernel_name, entries=r.entries)
    assert b.cubin


def _layouts():
    from attngen.families.decode import op as dop
    from attngen.families.prefill import op as pop

    m = pop.mods_layout  # prefill: ModArgs, then a mask_mod plan's pool and slots
    return [
        (PrefillSpec(head_dim=64, mask_mod="return true;"), "sm_80", "PrefillParams", m(pop._PARAMS_SINKS)),
        (PrefillSpec(head_dim=64, mask_mod="return true;", varlen=True), "sm_80", "PrefillParams",
         m(pop.PARAMS_EXT_SINKS)),
        (PrefillSpec(head_dim=128, mask_mod="return true;"), "sm_90a", "PrefillTmaParams", m(pop._PARAMS_TMA_SINKS)),
        (PrefillSpec(head_dim=128, mask_mod="return true;", custom_mask=True), "sm_90a", "PrefillTmaParams",
         m(pop.PARAMS_EXT_TMA_SINKS)),
        (DecodeSpec(head_dim=128, mask_mod="return true;"), "sm_80", "DecodeParams",
         snippets.mod_layout(dop._PARAMS)),
    ]


@pytest.mark.parametrize("case", range(5))
def test_the_host_packs_modargs_where_the_kernel_reads_them(case):
    spec, arch, struct_name, layout = _layouts()[case]
    r = resolve(spec, arch)
    tma = getattr(r, "tma", False)
    assert tma == (struct_name == "PrefillTmaParams")
    p = "p." if tma else ""
    # ModArgs is 160 bytes; prefill's struct ends with the pool's two pointers after it
    at = {"mods": layout.size - 160} if struct_name == "DecodeParams" else \
        {"mods": layout.size - 176, "mod_bits": layout.size - 16, "mod_slots": layout.size - 8}
    check = "".join(f"\nstatic_assert(__builtin_offsetof(attngen::{struct_name}<attngen::elem_t>, {p}{member}) == "
                    f"{offset}, \"{member}'s offset\");\n" for member, offset in at.items())
    compile(render(r) + check, arch, kernel_name=r.kernel_name, entries=r.entries)


def test_the_mod_plan_packs_its_pool_where_the_plan_kernel_reads_it():
    from attngen.families.prefill import masks

    spec = PrefillSpec(head_dim=128, mask_mod="return true;", custom_mask=True)
    r = resolve(spec, "sm_90a")
    size = masks._mod_plan_layout().size
    check = "".join(f"\nstatic_assert(__builtin_offsetof(attngen::ModPlanParams, {member}) == {offset}, \"{member}\");"
                    for member, offset in (("pool", size - 32), ("slots", size - 24), ("pool_used", size - 16),
                                           ("pool_tiles", size - 8)))
    check += f"\nstatic_assert(sizeof(attngen::ModPlanParams) == {size}, \"size\");\n"
    compile(render(r) + check, "sm_90a", kernel_name=r.kernel_name, entries=r.entries)


def test_an_nvrtc_error_is_a_spec_error_at_the_users_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec = PrefillSpec(head_dim=64, score_mod="float x = score;\nreturn x + not_declared;")
    with pytest.raises(SpecError) as e:
        build(spec, "sm_80")
    assert e.value.field == "score_mod" and e.value.value == "line 2: return x + not_declared;"
    assert 'score_mod(2): identifier "not_declared" is undefined' in str(e.value)
    spec = DecodeSpec(head_dim=64, mask_mod="bool keep = kv_idx < 4\nreturn keep;")
    with pytest.raises(SpecError) as e:
        build(spec, "sm_90a")
    assert e.value.field == "mask_mod" and "mask_mod(2)" in str(e.value)


def test_an_undefined_aux_read_is_a_launch_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec = PrefillSpec(head_dim=64, score_mod="return score + bias(h);", mask_mod="return doc(q_idx) == 0;",
                       aux="bias:fp32:1")
    with pytest.raises(LaunchError) as e:
        build(spec, "sm_80")
    assert "aux['doc'] is missing" in str(e.value) and "mask_mod line 1" in str(e.value) and "bias" in str(e.value)
    # and with no aux at all, the message says there is none
    with pytest.raises(LaunchError) as e:
        build(PrefillSpec(head_dim=64, score_mod="return score + bias(h);"), "sm_80")
    assert "aux['bias'] is missing: score_mod line 1 reads bias(...), and the kernel has no aux tensors" in str(e.value)
    assert "the call's aux= (or named in the spec's aux)" in str(e.value)


def test_call_checks_without_a_device():
    with pytest.raises(LaunchError, match="without a score_mod or mask_mod"):
        snippets.call_mods("", "", {"x": None})
    with pytest.raises(LaunchError, match="aux must be a dict"):
        snippets.call_mods("return score;", "", [1])
    with pytest.raises(LaunchError, match="aux name 'q_idx'"):
        snippets.call_mods("return score;", "", {"q_idx": None})
    with pytest.raises(SpecError, match="score_mod"):
        snippets.call_mods("sha:12345678", "", None)


def test_a_manifest_cannot_carry_a_snippet():
    from attngen.manifest import manifest_from_dict

    for field, value in (("score_mod", "return score;"), ("mask_mod", "return true;"), ("aux", "x:fp32:1")):
        with pytest.raises(SpecError) as e:
            manifest_from_dict({"archs": ["sm_80"], "kernel": [{"family": "prefill", "head_dim": 64, field: value}]})
        assert e.value.field == field and "never from a manifest" in str(e.value)


def test_mla_decode_refuses_snippets_by_name():
    from attngen.families.mla_decode.op import mla_decode

    for kw in (dict(score_mod="return score;"), dict(mask_mod="return true;"), dict(aux={"x": None})):
        with pytest.raises(LaunchError, match=f"mla_decode\\({next(iter(kw))}=...\\) is not supported"):
            mla_decode(None, None, None, None, cache_seqlens=1, sm_scale=1.0, **kw)


def test_inspect_shows_a_snippet_from_a_file(tmp_path):
    body = tmp_path / "alibi.cu"
    body.write_text(ALIBI + "\n")
    env = {"PYTHONPATH": str(ROOT), "ATTNGEN_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "attngen", "inspect", "prefill:head_dim=128,aux=slope:fp32:1",
                        "--score-mod-file", str(body), "--arch", "sm_90a", "--json"], capture_output=True, text=True,
                       env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert f'#line 1 "score_mod"\n{ALIBI}\n' in out["source"] and "score_mod=sha:" in out["spec"]
    p = subprocess.run([sys.executable, "-m", "attngen", "inspect", "prefill:head_dim=128", "--mask-mod-file",
                        str(tmp_path / "missing.cu")], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode != 0 and "--mask-mod-file" in p.stderr


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
@pytest.mark.parametrize("script", ["host_path_snippets.py", "host_path_snippets_decode.py"])
def test_snippets_through_every_entry_point_on_stub_driver(script, tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check(script, tmp_path)
