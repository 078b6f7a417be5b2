"""Specs: validation messages, the text form, serialization, and per-arch resolution."""

import dataclasses
import itertools
import json

import pytest

from attngen import ARCHS, AttngenError, SpecError
from attngen.arch import get_arch
from attngen.spec import DType, parse_spec, resolve, validate
from attngen import MaskMode, PrefillSpec

ALL_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")
TUNING = ("cta_tile_q", "cta_tile_kv", "num_warps", "num_stages")


# --- validation errors ------------------------------------------------------------------------

def test_spec_error_is_a_value_error_and_an_attngen_error():
    with pytest.raises(SpecError) as ei:
        PrefillSpec(head_dim=100)
    assert isinstance(ei.value, ValueError)
    assert isinstance(ei.value, AttngenError)


def test_bad_head_dim_message_names_field_value_and_allowed_set():
    with pytest.raises(SpecError) as ei:
        PrefillSpec(head_dim=100)
    allowed = ("a multiple of 8 from 32 to 256 (whole rows), or 320, 384, 448, 512, 576, 640, 768, 1024 (the chunked "
               "kernel)")
    assert str(ei.value) == f"head_dim=100 is not allowed; allowed: {allowed}"
    assert ei.value.field == "head_dim"
    assert ei.value.value == 100
    assert ei.value.allowed == allowed


def test_bad_dtype_message_is_pinned():
    with pytest.raises(SpecError) as ei:
        PrefillSpec(dtype="fp32")
    assert str(ei.value) == "dtype='fp32' is not allowed; allowed: fp16, bf16"
    assert ei.value.field == "dtype"


def test_bad_mask_from_text_form_names_the_allowed_masks():
    with pytest.raises(SpecError) as ei:
        parse_spec("prefill:mask=diagonal")
    assert ei.value.field == "mask"
    assert ei.value.value == "diagonal"
    assert "none, causal, sliding_window" in str(ei.value)


@pytest.mark.parametrize("field, value, allowed", [
    ("cta_tile_q", 96, "0, 32, 64, 128, 192"),
    ("cta_tile_kv", 16, "0, 32, 64, 80, 96, 112, 128, 144, 160, 176, 192"),
    ("num_warps", 2, "0, 4, 8, 12"),
    ("num_stages", 9, "0, 1, 2, 3, 4, 5, 6, 7, 8"),
])
def test_every_int_field_is_checked_against_its_allowed_set(field, value, allowed):
    with pytest.raises(SpecError) as ei:
        PrefillSpec(**{field: value})
    assert ei.value.field == field
    assert str(ei.value).startswith(f"{field}={value} is not allowed")
    assert str(ei.value).endswith(f"allowed: {allowed}")


@pytest.mark.parametrize("field", ["head_dim", "cta_tile_q", "cta_tile_kv", "num_warps", "num_stages"])
def test_bools_are_not_accepted_as_ints(field):
    # True == 1 in Python; a spec must not take it for a number.
    with pytest.raises(SpecError) as ei:
        PrefillSpec(**{field: True})
    assert ei.value.field == field
    assert "must be an integer" in str(ei.value)


def test_floats_are_not_accepted_as_ints():
    with pytest.raises(SpecError, match="head_dim=128.0 is not allowed: must be an integer"):
        PrefillSpec(head_dim=128.0)


def test_bad_bool_names_field():
    with pytest.raises(SpecError) as ei:
        PrefillSpec(return_lse="maybe")
    assert ei.value.field == "return_lse"
    assert str(ei.value) == "return_lse='maybe' is not allowed; allowed: true, false"


def test_num_warps_must_divide_cta_tile_q_over_16():
    with pytest.raises(SpecError) as ei:
        PrefillSpec(cta_tile_q=64, num_warps=8)
    assert ei.value.field == "num_warps"
    assert ei.value.value == 8
    assert "cta_tile_q/16 = 4" in str(ei.value)
    # The consistent combinations construct.
    PrefillSpec(cta_tile_q=64, num_warps=4)
    PrefillSpec(cta_tile_q=128, num_warps=4)
    PrefillSpec(cta_tile_q=128, num_warps=8)


def test_specs_are_frozen_and_hashable():
    s = PrefillSpec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.head_dim = 64  # type: ignore[misc]
    assert hash(s) == hash(PrefillSpec())
    assert {s: 1}[PrefillSpec()] == 1


def test_replace_revalidates():
    with pytest.raises(SpecError, match="head_dim=100"):
        PrefillSpec().replace(head_dim=100)


# --- the text form ------------------------------------------------------------------------------

def test_parse_text_form():
    s = parse_spec("prefill:head_dim=128,dtype=bf16,mask=causal")
    assert s == PrefillSpec(head_dim=128, dtype=DType.BF16, mask=MaskMode.CAUSAL)
    assert isinstance(s.head_dim, int) and s.dtype is DType.BF16 and s.mask is MaskMode.CAUSAL
    assert s.to_text() == "prefill:head_dim=128,dtype=bf16,mask=causal"
    assert parse_spec(s.to_text()) == s


def test_text_form_tolerates_spaces_and_case():
    assert parse_spec(" prefill: head_dim = 64 , dtype = FP16 , return_lse = True ") == \
        PrefillSpec(head_dim=64, dtype=DType.FP16, return_lse=True)


def test_fields_left_out_take_defaults():
    s = parse_spec("prefill:head_dim=64")
    d = PrefillSpec()
    assert s == PrefillSpec(head_dim=64)
    for f in dataclasses.fields(PrefillSpec):
        if f.name != "head_dim":
            assert getattr(s, f.name) == getattr(d, f.name), f.name
    assert parse_spec("prefill") == PrefillSpec()
    assert parse_spec("prefill:") == PrefillSpec()
    assert d.head_dim == 128 and d.dtype is DType.BF16 and d.mask is MaskMode.NONE and d.return_lse is False
    assert all(getattr(d, k) == 0 for k in TUNING)


@pytest.mark.parametrize("spec", [
    PrefillSpec(),
    PrefillSpec(head_dim=96, dtype=DType.FP16, mask=MaskMode.SLIDING_WINDOW, return_lse=True),
    PrefillSpec(head_dim=256, cta_tile_q=64, cta_tile_kv=32, num_warps=4, num_stages=3),
])
def test_text_round_trip(spec):
    assert parse_spec(spec.to_text()) == spec
    assert parse_spec(spec.to_text(full=True)) == spec


def test_unknown_field():
    with pytest.raises(SpecError) as ei:
        parse_spec("prefill:head_dim=128,block=64")
    assert ei.value.field == "block"
    assert "unknown field of a prefill spec" in str(ei.value)
    assert "head_dim" in ei.value.allowed and "num_stages" in ei.value.allowed


def test_duplicate_field():
    with pytest.raises(SpecError) as ei:
        parse_spec("prefill:head_dim=128,head_dim=64")
    assert ei.value.field == "head_dim"
    assert "given twice" in str(ei.value)


@pytest.mark.parametrize("text", ["nosuch:head_dim=128", "head_dim=128", "", "prefil:head_dim=64"])
def test_bad_family(text):
    with pytest.raises(SpecError) as ei:
        parse_spec(text)
    assert ei.value.field == "family"
    assert ei.value.allowed == "decode, merge, mla_decode, prefill"


def test_family_names_and_values_are_case_insensitive_alike():
    assert parse_spec("Prefill:head_dim=64,dtype=BF16,mask=Causal") == parse_spec("prefill:head_dim=64,mask=causal")
    assert parse_spec({"family": "DECODE", "head_dim": 64}) == parse_spec("decode:head_dim=64")


@pytest.mark.parametrize("item", ["head_dim", "=128", "head_dim:128"])
def test_malformed_pair(item):
    with pytest.raises(SpecError) as ei:
        parse_spec(f"prefill:dtype=bf16,{item}")
    assert ei.value.field == "spec"
    assert "name=value pairs" in str(ei.value)


def test_parse_spec_passes_specs_through_and_takes_dicts():
    s = PrefillSpec(head_dim=64)
    assert parse_spec(s) is s
    assert parse_spec({"family": "prefill", "head_dim": 64}) == s
    with pytest.raises(SpecError) as ei:
        parse_spec({"head_dim": 64})
    assert ei.value.field == "family"


# --- serialization ------------------------------------------------------------------------------

def test_to_dict_holds_plain_values_only():
    d = PrefillSpec(head_dim=64, mask=MaskMode.CAUSAL).to_dict()
    assert d == {"family": "prefill", "head_dim": 64, "dtype": "bf16", "mask": "causal", "return_lse": False,
                 "cta_tile_q": 0, "cta_tile_kv": 0, "num_warps": 0, "num_stages": 0, "mma": "auto", "softcap": False,
                 "alibi": False, "sinks": False, "custom_mask": False, "varlen": False, "paged": False, "head_dim_v": 0,
                 "head_dim_chunk": 0, "pipeline": "auto", "schedule": "auto",
                 "persistent": "auto"}
    assert json.loads(json.dumps(d)) == d


@pytest.mark.parametrize("spec", [
    PrefillSpec(),
    PrefillSpec(head_dim=192, dtype=DType.FP16, mask=MaskMode.CAUSAL, return_lse=True,
                cta_tile_q=64, cta_tile_kv=32, num_warps=4, num_stages=2),
])
def test_dict_and_json_round_trip(spec):
    assert PrefillSpec.from_dict(spec.to_dict()) == spec
    assert PrefillSpec.from_dict(json.loads(spec.canonical_json())) == spec
    assert parse_spec(json.loads(spec.canonical_json())) == spec


def test_canonical_json_is_sorted_and_compact():
    s = PrefillSpec(head_dim=64)
    cj = s.canonical_json()
    assert cj == json.dumps(json.loads(cj), sort_keys=True, separators=(",", ":"))
    assert " " not in cj
    assert cj.startswith('{"alibi":false,"cta_tile_kv":0,"cta_tile_q":0,')
    # Construction order and value spelling do not matter.
    assert PrefillSpec.from_dict({"mask": "none", "head_dim": "64", "dtype": "BF16"}).canonical_json() == cj


def test_from_dict_errors():
    with pytest.raises(SpecError) as ei:
        PrefillSpec.from_dict({"family": "decode"})
    assert ei.value.field == "family"
    with pytest.raises(SpecError) as ei:
        PrefillSpec.from_dict({"head_dim": 64, "tile": 3})
    assert ei.value.field == "tile"


# --- resolution per arch ------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ALL_ARCHS)
def test_resolve_fills_tuning_and_fits_every_arch(arch):
    a = get_arch(arch)
    for head_dim, dtype, mask, lse in itertools.product(PrefillSpec.HEAD_DIMS, DType, MaskMode, (False, True)):
        spec = PrefillSpec(head_dim=head_dim, dtype=dtype, mask=mask, return_lse=lse)
        r = resolve(spec, arch)
        assert r.is_resolved, r
        for k in TUNING:
            # head_dim_chunk 0 is the whole-row kernel's value
            assert getattr(r, k) > 0 or (k == "head_dim_chunk" and not r.chunked), (k, r)
        # Only tuning fields change.
        for k in ("head_dim", "dtype", "mask", "return_lse"):
            assert getattr(r, k) == getattr(spec, k)
        assert r.smem_bytes() <= a.smem_per_block, (arch, r.to_text())
        assert r.threads == 32 * r.num_warps + (128 if r.tma else 0)  # TMA: the producer warpgroup
        # the whole-row kernel's warps own 16-row tiles; the chunked one's 32-row groups
        assert (r.cta_tile_q // r.num_warps) % 16 == 0 if not r.chunked else r.cta_tile_q % 32 == 0
        validate(r, arch)
        assert resolve(r, arch) == r  # resolving is idempotent


def test_resolve_keeps_user_fixed_tuning_fields():
    r = resolve(PrefillSpec(head_dim=64, cta_tile_kv=32, num_stages=3), "sm_80")
    assert r.cta_tile_kv == 32 and r.num_stages == 3
    r = resolve(PrefillSpec(head_dim=128, cta_tile_q=64), "sm_90")
    assert r.cta_tile_q == 64 and r.num_warps == 4


def test_pinning_a_tuning_field_to_its_default_resolves_the_same():
    """Writing down the value resolve would choose anyway must give the same kernel."""
    wrong = []
    for arch, head_dim in itertools.product(ALL_ARCHS, PrefillSpec.HEAD_DIMS):
        auto = resolve(PrefillSpec(head_dim=head_dim), arch)
        for k in TUNING:
            pinned = PrefillSpec(head_dim=head_dim, **{k: getattr(auto, k)})
            try:
                got = resolve(pinned, arch)
            except SpecError as e:
                got = f"SpecError: {e}"
            if got != auto:
                wrong.append(f"{arch} {pinned.to_text()}: {got}  (unpinned: {auto.to_text(full=True)})")
    assert not wrong, "\n".join(wrong)


def test_resolve_fills_around_any_one_value_of_a_config_that_fits():
    """cta_tile_q=64, cta_tile_kv=32, num_warps=4, num_stages=2 fits every arch at head_dim 192
    and 256 (it is what resolve picks on the small-shared-memory archs): fixing any one of those
    values must leave resolve a valid spec to return, never an error about a field left at 0."""
    wrong = []
    for arch, head_dim in itertools.product(ALL_ARCHS, (192, 256)):
        fits = PrefillSpec(head_dim=head_dim, cta_tile_q=64, cta_tile_kv=32, num_warps=4, num_stages=2,
                           mma="mma_sync")
        validate(fits, arch)
        for k in TUNING:
            spec = PrefillSpec(head_dim=head_dim, **{k: getattr(fits, k)})
            try:
                r = resolve(spec, arch)
            except SpecError as e:
                wrong.append(f"{arch} {spec.to_text()}: {e}")
                continue
            assert getattr(r, k) == getattr(fits, k)
    assert not wrong, "\n".join(wrong)


def test_resolve_tuning_differs_where_shared_memory_differs():
    # Defaults are per arch, not the lowest common denominator: head_dim=256 takes bigger tiles
    # where the arch has the shared memory for them.
    big = resolve(PrefillSpec(head_dim=256), "sm_90")
    small = resolve(PrefillSpec(head_dim=256), "sm_86")
    assert big != small
    assert small.smem_bytes() <= get_arch("sm_86").smem_per_block < big.smem_bytes()


def test_validate_rejects_spec_over_shared_memory_on_sm86():
    spec = PrefillSpec(head_dim=256, cta_tile_q=64, cta_tile_kv=128, num_stages=4, num_warps=4, mma="mma_sync")
    with pytest.raises(SpecError) as ei:
        validate(spec, "sm_86")
    e = ei.value
    assert e.field == "cta_tile_kv" and e.value == 128
    assert f"needs {spec.smem_bytes()} bytes of shared memory" in str(e)
    assert f"sm_86 allows {get_arch('sm_86').smem_per_block} per block" in str(e)
    # resolve validates too: the fixed fields are kept, not silently shrunk.
    with pytest.raises(SpecError, match="cta_tile_kv=128"):
        resolve(PrefillSpec(head_dim=256, cta_tile_kv=128, num_stages=4), "sm_86")


def test_fits_on_sm90_but_not_sm86():
    spec = PrefillSpec(head_dim=128, cta_tile_q=128, cta_tile_kv=64, num_warps=8, num_stages=3, mma="mma_sync")
    validate(spec, "sm_90")
    with pytest.raises(SpecError) as ei:
        validate(spec, "sm_86")
    assert ei.value.field == "cta_tile_kv"


def test_validate_rejects_register_hungry_tiles():
    spec = PrefillSpec(head_dim=256, cta_tile_q=128, cta_tile_kv=64, num_warps=4, num_stages=2, mma="mma_sync")
    with pytest.raises(SpecError) as ei:
        validate(spec, "sm_90")
    assert ei.value.field == "cta_tile_q"
    assert "accumulator registers" in str(ei.value)


def test_wgmma_rules():
    ok = PrefillSpec(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, mma="wgmma")
    validate(ok, "sm_90a")
    for arch in ("sm_80", "sm_90", "sm_100", "sm_120"):
        with pytest.raises(SpecError) as ei:
            validate(ok, arch)
        assert ei.value.field == "mma" and "needs sm_90a" in str(ei.value)
    with pytest.raises(SpecError) as ei:
        validate(ok.replace(head_dim=96), "sm_90a")
    assert ei.value.field == "head_dim"
    with pytest.raises(SpecError) as ei:  # one warpgroup per 64 query rows
        validate(ok.replace(num_warps=4), "sm_90a")
    assert ei.value.field == "cta_tile_q" and "64 with num_warps=4" in str(ei.value)
    with pytest.raises(SpecError) as ei:
        validate(ok.replace(head_dim=256), "sm_90a")
    assert ei.value.field == "cta_tile_kv" and "accumulator registers" in str(ei.value)
    with pytest.raises(SpecError) as ei:
        validate(ok.replace(num_stages=4), "sm_90a")
    assert ei.value.field == "cta_tile_kv" and "shared memory" in str(ei.value)
    # resolve: wgmma where it applies on sm_90a, mma.sync elsewhere and where pinned
    assert resolve(PrefillSpec(head_dim=192), "sm_90a").mma.value == "wgmma"
    assert resolve(PrefillSpec(head_dim=96), "sm_90a").mma.value == "mma_sync"
    assert resolve(PrefillSpec(head_dim=128, mma="mma_sync"), "sm_90a").mma.value == "mma_sync"
    assert resolve(PrefillSpec(head_dim=128, num_warps=4), "sm_90a").cta_tile_q == 64
    assert not PrefillSpec(head_dim=128, cta_tile_q=64, cta_tile_kv=64, num_warps=4, num_stages=2).is_resolved


def test_validate_needs_a_resolved_spec():
    with pytest.raises(SpecError) as ei:
        validate(PrefillSpec(head_dim=64), "sm_90")
    assert ei.value.field == "spec"
    assert "attngen.resolve" in str(ei.value)
    with pytest.raises(SpecError):
        PrefillSpec().smem_bytes()


def test_bad_arch_names_the_known_archs():
    with pytest.raises(SpecError) as ei:
        resolve(PrefillSpec(), "sm_75")
    assert ei.value.field == "arch"
    assert ei.value.allowed == ", ".join(ARCHS)
    assert set(ALL_ARCHS) == set(ARCHS)


@pytest.mark.parametrize("name, expect", [("sm_90", "sm_90"), ("90", "sm_90"), ("9.0", "sm_90"),
                                          ("SM_90A", "sm_90a"), ("compute_80", "sm_80"), ("120", "sm_120")])
def test_arch_spellings(name, expect):
    assert get_arch(name).name == expect
