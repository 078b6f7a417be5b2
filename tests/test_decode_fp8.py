"""fp8 KV caches in the decode family, on the CPU: the spec's kv_dtype (text, dict, name, refusals), the fit of its
shared memory on every arch."""

from __future__ import annotations

import json

import pytest

from attngen.arch import ARCHS
from attngen.errors import SpecError
from attngen.spec import parse_spec, resolve
from attngen import DecodeSpec
from attngen.families.decode.spec import KVDType


def test_kv_dtype_round_trips_and_names_the_kernel():
    s = parse_spec("decode:head_dim=128,dtype=fp16,paged=true,kv_dtype=fp8_e5m2")
    assert s.kv_dtype is KVDType.FP8_E5M2
    assert "kv_dtype=fp8_e5m2" in s.to_text()
    for form in (s.to_text(), s.to_text(full=True), s.to_dict(), json.loads(s.canonical_json())):
        assert parse_spec(form) == s
    assert "_e5m2_" in s.kernel_name and "_e4m3_" in s.replace(kv_dtype="fp8_e4m3").kernel_name
    assert s.replace(kv_dtype=None) == DecodeSpec(head_dim=128, dtype="fp16", paged=True)


def test_unset_kv_dtype_leaves_the_spec_as_it_was():
    # not shown, not in the dict or the canonical JSON (so names, keys and stored tunings of 16-bit caches stay)
    s = DecodeSpec(head_dim=64, dtype="bf16", q_rows=32)
    assert "kv_dtype" not in s.to_text() and "kv_dtype" not in s.to_dict() and "kv_dtype" not in s.canonical_json()
    assert "kv_dtype=None" in s.to_text(full=True) and parse_spec(s.to_text(full=True)) == s
    assert DecodeSpec(kv_dtype="none") == DecodeSpec() == DecodeSpec.from_dict({"kv_dtype": None})
    assert s.kernel_name.startswith("attngen_decode_d64_bf16_rows32_")
    assert s.canonical_json() == ('{"alibi":false,"cta_tile_kv":0,"dtype":"bf16","family":"decode","head_dim":64,'
                                  '"local":false,"num_stages":0,"num_warps":0,"paged":false,"q_rows":32,'
                                  '"softcap":false,"variant":"fused"}')


@pytest.mark.parametrize("kw,other", [(dict(head_dim=512), "head_dim=512"), (dict(head_dim=72), "head_dim=72"),
                                      (dict(variant="unfused"), "variant=unfused"), (dict(softcap=True), "softcap=true"),
                                      (dict(alibi=True), "alibi=true")])
def test_what_fp8_does_not_run_is_refused_naming_both_fields(kw, other):
    with pytest.raises(SpecError) as ei:
        DecodeSpec(kv_dtype="fp8_e4m3", **kw)
    assert ei.value.field == "kv_dtype" and ei.value.value == "fp8_e4m3"
    assert other in str(ei.value) and "allowed: unset" in str(ei.value)


@pytest.mark.parametrize("bad", ["fp8", "e4m3", "bf16", 8, True])
def test_a_bad_kv_dtype_names_the_formats(bad):
    with pytest.raises(SpecError) as ei:
        DecodeSpec(kv_dtype=bad)
    assert ei.value.field == "kv_dtype" and "fp8_e4m3, fp8_e5m2" in ei.value.allowed


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"])
def test_fp8_specs_resolve_within_shared_memory(arch):
    a = ARCHS[arch]
    for d in (32, 64, 96, 128, 160, 192, 256):
        for rows in DecodeSpec.Q_ROWS:
            for paged in (False, True):
                r = resolve(DecodeSpec(head_dim=d, q_rows=rows, paged=paged, kv_dtype="fp8_e4m3"), arch)
                ring = r.num_stages * r.cta_tile_kv * d * 2  # fp8 K and V slots
                widened = (2 if d <= 128 else 1) * r.cta_tile_kv * r.row_elems * 2
                assert r.smem_bytes() >= rows * r.row_elems * 2 + ring + widened
                assert r.smem_bytes() <= a.smem_per_block, (d, rows, paged, r)
