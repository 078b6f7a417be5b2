"""The public API as a new user meets it: every function that takes a spec takes the object, its text
and a dict alike; wrong families and types are refused saying what was given; results print short;
one default arch for ``render`` and ``attngen inspect``. CPU only (one small NVRTC compile; the ops'
``spec=`` launches run on the stub driver in a process of their own)."""

from __future__ import annotations

import inspect
import json
import re

import pytest

import attngen
from attngen.cli import main as cli_main
from attngen.spec import op_spec
from tests import fake_cuda

TEXT = "prefill:head_dim=64,mask=causal,cta_tile_q=64,cta_tile_kv=64,num_warps=4,num_stages=2,mma=mma_sync"
OBJ = attngen.parse_spec(TEXT)
DICT = OBJ.to_dict()
FORMS = {"object": OBJ, "text": TEXT, "dict": DICT}
NOT_SPECS = [5, 2.5, ["prefill"], ("prefill",), object()]
OPS = {"prefill": attngen.prefill, "prefill_varlen": attngen.prefill_varlen, "mask_plan": attngen.mask_plan,
       "decode": attngen.decode, "mla_decode": attngen.mla_decode}
OP_FAMILY = {"prefill": "prefill", "prefill_varlen": "prefill", "mask_plan": "prefill", "decode": "decode",
             "mla_decode": "mla_decode"}


def test_the_forms_are_one_spec():
    assert DICT["family"] == "prefill" and attngen.parse_spec(DICT) == attngen.parse_spec(TEXT) == OBJ
    from collections import OrderedDict

    assert attngen.parse_spec(OrderedDict(DICT)) == OBJ  # any Mapping, not only dict


@pytest.mark.parametrize("form", FORMS)
def test_resolve_and_validate_take_every_form(form):
    assert attngen.resolve(FORMS[form], "sm_80") == attngen.resolve(OBJ, "sm_80")
    unresolved = {"object": attngen.PrefillSpec(head_dim=64), "text": "prefill:head_dim=64",
                  "dict": {"family": "prefill", "head_dim": 64}}[form]
    assert attngen.resolve(unresolved, "sm_90a") == attngen.resolve(attngen.PrefillSpec(head_dim=64), "sm_90a")
    attngen.validate(FORMS[form], "sm_80")  # resolved: fits
    with pytest.raises(attngen.SpecError, match="a resolved spec"):
        attngen.validate(unresolved, "sm_80")


@pytest.mark.parametrize("form", FORMS)
def test_render_takes_every_form(form):
    assert attngen.render(FORMS[form], "sm_80") == attngen.render(OBJ, "sm_80")


def test_build_takes_every_form_and_prints_short(cache_dir):
    results = {form: attngen.build(s, "sm_80") for form, s in FORMS.items()}
    assert len({r.key for r in results.values()}) == 1 and results["object"].origin == "compiled"
    small = attngen.build("prefill:head_dim=64", "sm_80")  # the example: a real NVRTC compile
    for r in (*results.values(), small):
        assert isinstance(r, attngen.BuildResult) and isinstance(r.binary.resources, attngen.Resources)
        for obj in (r, r.binary):
            text = repr(obj)
            assert len(text) < 500, text
            assert r.binary.kernel_name in text and "sm_80" in text and f"cubin={len(r.binary.cubin)} bytes" in text
            assert f"registers={r.binary.resources.registers}" in text
            assert "\\x" not in text and "ELF" not in text  # never the bytes
        assert str(r.spec) in repr(r)
    assert len(small.binary.cubin) > 1000  # the repr is short because it leaves the bytes out, not for want of them


@pytest.mark.parametrize("call", ["build", "resolve", "validate", "render", "parse_spec", "get_kernel"])
@pytest.mark.parametrize("bad", NOT_SPECS, ids=lambda b: type(b).__name__)
def test_a_value_that_is_no_spec_is_refused_naming_its_type(call, bad):
    fn = getattr(attngen, call)
    args = (bad,) if call in ("parse_spec", "render") else (bad, "sm_80")
    with pytest.raises(attngen.SpecError) as e:
        fn(*args)  # get_kernel refuses before it asks for a device: no GPU needed
    msg = str(e.value)
    assert e.value.field == "spec" and msg.startswith("spec=") and f"got type {type(bad).__name__}" in msg, msg
    assert "a spec object" in msg and "its text" in msg and "a dict of its fields" in msg, msg


@pytest.mark.parametrize("call", ["build", "resolve", "render", "get_kernel"])
def test_a_dict_without_its_family_is_refused_naming_the_families(call):
    args = ({"head_dim": 64},) if call == "render" else ({"head_dim": 64}, "sm_80")
    with pytest.raises(attngen.SpecError) as e:
        getattr(attngen, call)(*args)
    assert e.value.field == "family" and "names no family" in str(e.value)
    assert e.value.allowed == "decode, merge, mla_decode, prefill"


def test_a_refusal_does_not_print_a_whole_tensor():
    np = pytest.importorskip("numpy")
    with pytest.raises(attngen.SpecError) as e:
        attngen.build(np.zeros((1000, 1000)), "sm_80")
    assert len(str(e.value)) < 600 and "got type ndarray" in str(e.value)


def test_every_public_function_that_takes_a_spec_says_so_in_its_hints():
    functions = {n: getattr(attngen, n) for n in attngen.__all__ if inspect.isfunction(getattr(attngen, n))}
    takes_spec = {n: fn for n, fn in functions.items() if "spec" in inspect.signature(fn).parameters}
    assert set(takes_spec) == {"build", "get_kernel", "render", "resolve", "validate", *OPS}, sorted(takes_spec)
    for name, fn in takes_spec.items():
        hint = str(inspect.signature(fn).parameters["spec"].annotation)
        assert re.search(r"Spec \| str \| Mapping", hint), (name, hint)
    assert "Mapping" in str(inspect.signature(attngen.parse_spec).parameters["text"].annotation)


# --- the ops' spec= -------------------------------------------------------------------------------

@pytest.mark.parametrize("family,cls,fields", [
    ("prefill", attngen.PrefillSpec, dict(cta_tile_q=64, cta_tile_kv=32, num_warps=4, num_stages=2, mma="mma_sync")),
    ("decode", attngen.DecodeSpec, dict(cta_tile_kv=64, num_stages=2)),
    ("mla_decode", attngen.MlaDecodeSpec, dict(qk_shard="alternate", cta_tile_kv=64)),
])
def test_an_ops_spec_is_one_spec_in_every_form(family, cls, fields):
    text = f"{family}:" + ",".join(f"{k}={v}" for k, v in fields.items())
    got = {op_spec(s, family, f"attngen.{family}") for s in (cls(**fields), text, {"family": family, **fields})}
    assert got == {cls(**fields)}
    assert op_spec(None, family, f"attngen.{family}") is None


def test_an_ops_dict_keeps_a_128_wide_chunk_as_its_text_does():
    fields = dict(cta_tile_kv=128, head_dim_chunk=128, num_stages=4)
    from_text = op_spec("prefill:cta_tile_kv=128,head_dim_chunk=128,num_stages=4", "prefill", "attngen.prefill")
    assert op_spec({"family": "prefill", **fields}, "prefill", "attngen.prefill") == from_text
    assert from_text.head_dim_chunk == 128


@pytest.mark.parametrize("op,other", [(op, other) for op in ("prefill_varlen", "mask_plan", "mla_decode")
                                       for other in ("prefill", "decode", "mla_decode") if other != OP_FAMILY[op]])
@pytest.mark.parametrize("form", ["text", "dict", "object"])
def test_an_op_refuses_another_familys_spec_naming_both(op, other, form):
    """These ops read spec= before their tensors, so CPU arrays reach the check (prefill and decode:
    tests/public_api_ops_check.py, on the stub driver)."""
    family = OP_FAMILY[op]
    spec = {"text": f"{other}:", "dict": {"family": other},
            "object": attngen.get_family(other).spec()}[form]
    np = pytest.importorskip("numpy")
    x = np.zeros((1, 4, 2, 64), dtype=np.float16)
    args = {"prefill_varlen": (x[0], x[0], x[0], None, None, 4, 4), "mask_plan": (x, x, x),
            "mla_decode": (x, x, x[0], x[0])}[op]
    kw = {"mla_decode": dict(cache_seqlens=4, sm_scale=0.1)}.get(op, {})
    with pytest.raises(attngen.SpecError) as e:
        OPS[op](*args, spec=spec, **kw)
    msg = str(e.value)
    assert e.value.field == "family" and e.value.allowed == family, msg
    assert f"attngen.{op} takes a {family} spec" in msg and f"is a {other} spec" in msg, msg


@pytest.mark.parametrize("op", ["prefill_varlen", "mask_plan", "mla_decode"])
def test_an_op_refuses_a_value_that_is_no_spec(op):
    np = pytest.importorskip("numpy")
    x = np.zeros((1, 4, 2, 64), dtype=np.float16)
    args = {"prefill_varlen": (x[0], x[0], x[0], None, None, 4, 4), "mask_plan": (x, x, x),
            "mla_decode": (x, x, x[0], x[0])}[op]
    kw = {"mla_decode": dict(cache_seqlens=4, sm_scale=0.1)}.get(op, {})
    with pytest.raises(attngen.SpecError, match=r"spec=5 is not allowed: got type int"):
        OPS[op](*args, spec=5, **kw)


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_ops_take_every_form_on_the_stub_driver(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("public_api_ops_check.py", tmp_path, timeout=900)


# --- MaskPlan, docs, the default arch ---------------------------------------------------------------

def test_maskplan_is_built_by_mask_plan_only():
    with pytest.raises(TypeError, match=r"attngen.mask_plan\(mask, q, k"):
        attngen.MaskPlan()
    with pytest.raises(TypeError, match="not built directly"):
        attngen.MaskPlan(tiles=(64, 64))
    # whatever a user does to get one, its repr does not raise
    assert repr(object.__new__(attngen.MaskPlan)) == "MaskPlan(<not built>)"


@pytest.mark.parametrize("cls", [attngen.BuildResult, attngen.Binary, attngen.Resources])
def test_result_classes_document_their_fields(cls):
    doc = cls.__doc__ or ""
    for f in cls.__dataclass_fields__:
        assert f"``{f}``" in doc, (cls.__name__, f)


def test_mla_decode_docstring_names_no_private_constant():
    from attngen.families.mla_decode import choose as op  # the rules' constants live with the choice

    doc = attngen.mla_decode.__doc__
    constants = [n for n in vars(op) if re.fullmatch(r"[A-Z][A-Z0-9_]+", n)]
    assert "FAST_MEMORY_SHARE" in constants
    named = [n for n in constants if re.search(rf"\b{n}\b", doc)]
    assert not named, named
    # the numbers it gives in their place are the constants' values
    assert f"{round(op.FAST_MEMORY_SHARE * 100)}% or more" in doc
    assert f"at least {op.ALTERNATE_MIN_TILES} tiles of 64 keys and" in doc
    assert f"not split, from {op.ALTERNATE_MIN_TILES_UNSPLIT} tiles of" in doc
    assert f"a batch of {op.ALTERNATE_ONE_BLOCK_MIN_BATCH} or more" in doc


def test_render_and_inspect_share_one_default_arch(capsys):
    from attngen.arch import DEFAULT_ARCH, target_arch

    text = "prefill:head_dim=128"
    rc = cli_main(["inspect", text, "--key", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["arch"] == DEFAULT_ARCH == target_arch().name
    resolved = attngen.resolve(text, out["arch"])
    assert out["kernel_name"] == resolved.kernel_name
    assert attngen.render(text) == attngen.render(resolved)
    # the default matters here: the two archs resolve this spec to different kernels
    assert attngen.resolve(text, "sm_90") != resolved
