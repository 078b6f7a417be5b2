"""fp8 (e4m3) q, k and v in the prefill family, on the CPU: the spec's qkv_dtype (values, text, dict, key, name), what
it refuses and on which archs, that a 16-bit spec reads as before the field, and real NVRTC builds of the fp8 kernel
for sm_90a (head_dim 128 and 256, masks, varlen, the three schedules at explicit tiles)."""

from __future__ import annotations

import json

import pytest

from attngen import PrefillSpec, SpecError
from attngen.arch import ARCHS, get_arch
from attngen.spec import parse_spec, resolve

FP8 = "fp8_e4m3"


def _value(x):
    """An enum field's text (or the field itself where it is plain)."""
    return getattr(x, "value", x)


# --- the field ----------------------------------------------------------------------------------------------------

def test_qkv_dtype_round_trips_and_names_the_kernel():
    s = parse_spec("prefill:head_dim=128,mask=causal,qkv_dtype=fp8_e4m3")
    assert _value(s.qkv_dtype) == FP8
    assert s == PrefillSpec(head_dim=128, mask="causal", qkv_dtype=FP8)
    assert "qkv_dtype=fp8_e4m3" in s.to_text()
    assert s.to_dict()["qkv_dtype"] == FP8
    for form in (s.to_text(), s.to_text(full=True), s.to_dict(), json.loads(s.canonical_json())):
        assert parse_spec(form) == s
    assert PrefillSpec.from_dict(s.to_dict()) == s
    assert s.replace(qkv_dtype=None) == PrefillSpec(head_dim=128, mask="causal")
    # the kernel's readable name says its inputs are fp8, and differs from the 16-bit kernel's
    plain = PrefillSpec(head_dim=128, mask="causal")
    assert s.kernel_name != plain.kernel_name
    assert "e4m3" in s.kernel_name or "fp8" in s.kernel_name, s.kernel_name


def test_qkv_dtype_survives_resolve():
    r = resolve(PrefillSpec(head_dim=128, qkv_dtype=FP8), "sm_90a")
    assert _value(r.qkv_dtype) == FP8 and r.is_resolved
    assert parse_spec(r.to_text()) == r
    assert r.mma.value == "wgmma"  # fp8 runs on wgmma only


# The canonical JSON of 16-bit specs before qkv_dtype existed (main at 1d81f35): their cache keys and kernel names
# must stay what they were, so every cache built before the field still serves them.
BEFORE = {
    PrefillSpec(head_dim=128): (
        '{"alibi":false,"cta_tile_kv":0,"cta_tile_q":0,"custom_mask":false,"dtype":"bf16","family":"prefill",'
        '"head_dim":128,"head_dim_chunk":0,"head_dim_v":0,"mask":"none","mma":"auto","num_stages":0,"num_warps":0,'
        '"paged":false,"persistent":"auto","pipeline":"auto","return_lse":false,"schedule":"auto","sinks":false,'
        '"softcap":false,"varlen":false}', "attngen_prefill_d128_bf16_1b837c09"),
}


def test_unset_qkv_dtype_leaves_the_spec_as_it_was():
    for s, (canonical, name) in BEFORE.items():
        assert not s.qkv_dtype
        assert "qkv_dtype" not in s.to_text() and "qkv_dtype" not in s.to_dict()
        assert s.canonical_json() == canonical
        assert s.kernel_name == name
        assert parse_spec(s.to_text(full=True)) == s
    assert PrefillSpec(qkv_dtype=None) == PrefillSpec() == PrefillSpec.from_dict({"qkv_dtype": None})


def test_qkv_dtype_feeds_the_key():
    from tests.test_key import key_for

    fp8 = resolve(PrefillSpec(head_dim=128, qkv_dtype=FP8), "sm_90a")
    assert key_for(fp8, "sm_90a") != key_for(fp8.replace(qkv_dtype=None), "sm_90a")
    assert key_for(fp8, "sm_90a") != key_for(PrefillSpec(head_dim=128), "sm_90a")


@pytest.mark.parametrize("bad", ["fp8", "e4m3", "fp8_e5m2", "bf16", "float8_e4m3fn", 8, True])
def test_a_bad_qkv_dtype_names_the_format(bad):
    # e5m2 is refused too: only e4m3 runs for now
    with pytest.raises(SpecError) as ei:
        PrefillSpec(head_dim=128, qkv_dtype=bad)
    assert ei.value.field == "qkv_dtype"
    assert FP8 in ei.value.allowed, ei.value.allowed


# --- refusals -----------------------------------------------------------------------------------------------------

REFUSED = [
    # (fields beside qkv_dtype, the other field the error must name)
    (dict(head_dim=64), "head_dim"),
    (dict(head_dim=192), "head_dim"),
    (dict(head_dim=96), "head_dim"),
    (dict(head_dim=512), "head_dim"),
    (dict(head_dim=256, head_dim_v=128), "head_dim_v"),
    (dict(head_dim=128, head_dim_v=64), "head_dim_v"),
    (dict(softcap=True), "softcap"),
    (dict(alibi=True), "alibi"),
    (dict(sinks=True), "sinks"),
    (dict(custom_mask=True), "custom_mask"),
    (dict(varlen=True, paged=True), "paged"),
    (dict(score_mod="return score * 0.5f;"), "score_mod"),
    (dict(mask_mod="return kv_idx <= q_idx;"), "mask_mod"),
]


@pytest.mark.parametrize("fields,other", REFUSED, ids=[f"{o}={f.get(o)}" for f, o in REFUSED])
def test_what_fp8_does_not_run_is_refused_naming_both_fields(fields, other):
    # refused when the spec is made or when it is resolved for sm_90a (the arch fp8 runs on), never compiled
    with pytest.raises(SpecError) as ei:
        resolve(PrefillSpec(**{"head_dim": 128, "qkv_dtype": FP8, **fields}), "sm_90a")
    assert ei.value.field in ("qkv_dtype", other), ei.value.field
    msg = str(ei.value)
    assert "qkv_dtype" in msg and other in msg, msg


@pytest.mark.parametrize("arch", [a for a in ARCHS if get_arch(a).cc < (8, 9)])
def test_archs_without_fp8_mma_refuse_qkv_dtype_naming_the_arch(arch):
    with pytest.raises(SpecError) as ei:
        resolve(PrefillSpec(head_dim=128, qkv_dtype=FP8), arch)
    assert ei.value.field == "qkv_dtype" and arch in str(ei.value), str(ei.value)


@pytest.mark.parametrize("arch", [a for a in ARCHS if get_arch(a).cc >= (8, 9) and a != "sm_90a"])
@pytest.mark.parametrize("d", [128, 256])
def test_fp8_mma_sync_form_elsewhere(arch, d):
    # sm_89, sm_90, sm_100, sm_120: the mma.sync form (m16n8k32 e4m3) on the cp.async ring, in the arch's memory
    r = resolve(PrefillSpec(head_dim=d, qkv_dtype=FP8, mask="causal"), arch)
    assert r.mma.value == "mma_sync" and r.pipeline.value == "sync"
    assert r.smem_bytes() <= get_arch(arch).smem_per_block


def test_fp8_specs_fit_sm90a_shared_memory():
    a = get_arch("sm_90a")
    for d in (128, 256):
        for mask in ("none", "causal", "sliding_window"):
            for varlen in (False, True):
                for lse in (False, True):
                    r = resolve(PrefillSpec(head_dim=d, mask=mask, varlen=varlen, return_lse=lse, qkv_dtype=FP8),
                                "sm_90a")
                    assert 0 < r.smem_bytes() <= a.smem_per_block, (r.to_text(), r.smem_bytes())
                    # fp8 tiles are half the bytes of the 16-bit kernel's at the same tiles
                    try:
                        same = resolve(r.replace(qkv_dtype=None), "sm_90a")
                    except SpecError:  # tiles the 16-bit kernel has no form for
                        continue
                    assert r.smem_bytes() < same.smem_bytes(), (r.to_text(), r.smem_bytes(), same.smem_bytes())


# --- real builds --------------------------------------------------------------------------------------------------

BUILDS = [
    dict(head_dim=128),
    dict(head_dim=128, mask="causal", return_lse=True),
    dict(head_dim=256),
    dict(head_dim=256, mask="causal", return_lse=True, dtype="fp16"),
    dict(head_dim=128, mask="sliding_window"),
    dict(head_dim=128, mask="causal", varlen=True, return_lse=True),
    dict(head_dim=256, varlen=True),
]


@pytest.mark.parametrize("fields", BUILDS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_fp8_kernels_build_for_sm90a(fields):
    from attngen.compiler import compile
    from attngen.render import render

    r = resolve(PrefillSpec(qkv_dtype=FP8, **fields), "sm_90a")
    src = render(r)
    assert "e4m3" in src  # fp8 wgmma (and the conversions) name the format
    b = compile(src, "sm_90a", kernel_name=r.kernel_name)
    assert b.cubin[:4] == b"\x7fELF"
    assert b.kernel_name == r.kernel_name
    assert not b.resources.spill_stores, (r.to_text(), b.resources)


@pytest.mark.parametrize("arch", ["sm_89", "sm_120"])
@pytest.mark.parametrize("fields", [dict(head_dim=128, mask="causal"), dict(head_dim=256, varlen=True)],
                         ids=["d128-causal", "d256-varlen"])
def test_fp8_mma_sync_kernels_build(arch, fields):
    from attngen.compiler import compile
    from attngen.render import render

    r = resolve(PrefillSpec(qkv_dtype=FP8, **fields), arch)
    assert r.mma.value == "mma_sync"
    b = compile(render(r), arch, kernel_name=r.kernel_name)
    assert b.cubin[:4] == b"\x7fELF" and not b.resources.spill_stores, (r.to_text(), b.resources)


@pytest.mark.parametrize("schedule", ["serial", "overlap", "pingpong"])
def test_fp8_schedules_build_at_explicit_tiles(schedule):
    # the tiles tests/test_gpu_prefill_fp8.py::test_schedules runs
    from attngen.compiler import compile
    from attngen.render import render

    spec = PrefillSpec(head_dim=128, qkv_dtype=FP8, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2,
                       schedule=schedule)
    r = resolve(spec, "sm_90a")
    assert (r.cta_tile_q, r.cta_tile_kv, r.num_warps, r.num_stages) == (128, 128, 8, 2)
    assert r.schedule.value == schedule
    b = compile(render(r), "sm_90a", kernel_name=r.kernel_name)
    assert b.cubin[:4] == b"\x7fELF" and not b.resources.spill_stores, (r.to_text(), b.resources)


def test_a_16bit_spec_renders_no_fp8_code():
    from attngen.render import render

    for fields in (dict(head_dim=128), dict(head_dim=256, mask="causal", varlen=True)):
        src = render(resolve(PrefillSpec(**fields), "sm_90a"))
        # (the common pieces hold fp8's MMA and packing functions, compiled only where called)
        assert "attngen:begin prefill/fp8.cuh" not in src and "_vt(" not in src


def test_stored_tunings_of_16bit_prefill_do_not_apply_to_fp8():
    # a winner stored for the 16-bit kernel (its fields without qkv_dtype) keeps matching it, not the fp8 spec
    from attngen.tuned import tuned_choices

    base = PrefillSpec(head_dim=128, dtype="bf16", mask="causal")
    entry = {"family": "prefill", "fields": dict(base.untuned_dict()), "arch": "sm_90a", "gpu": "G", "nvrtc": "N",
             "attngen": "V", "seqlen": 4096,
             "tuning": {"cta_tile_q": 128, "cta_tile_kv": 128, "num_warps": 8, "num_stages": 2, "mma": "wgmma"}}
    assert "qkv_dtype" not in entry["fields"]
    got = tuned_choices(base, get_arch("sm_90a"), "G", [entry], nvrtc="N", version="V")
    assert [s.cta_tile_kv for _, s in got] == [128]
    assert tuned_choices(base.replace(qkv_dtype=FP8), get_arch("sm_90a"), "G", [entry], nvrtc="N",
                         version="V") == []


def test_fp8_and_descales_are_refused_while_torch_compile_traces(monkeypatch):
    # the custom ops take no descales and their fake would give q's dtype: refused by name, never run wrong
    torch = pytest.importorskip("torch")
    import attngen
    from attngen import LaunchError, runtime

    monkeypatch.setattr(runtime, "tracing", lambda: True)
    q = torch.zeros(1, 4, 2, 128).to(torch.float8_e4m3fn)
    for call in (lambda: attngen.prefill(q, q, q),
                 lambda: attngen.prefill(q.to(torch.bfloat16), q, q, q_descale=0.5),
                 lambda: attngen.prefill_varlen(q[0], q[0], q[0], None, None, 4, 4, k_descale=2.0)):
        with pytest.raises(LaunchError, match="torch.compile"):
            call()



# --- an fp8 cache under a 16-bit q (kv_dtype): prefill_varlen, contiguous or paged ----------------------------------

@pytest.mark.parametrize("bad, field", [(dict(varlen=False), "kv_dtype"), (dict(qkv_dtype=FP8), "kv_dtype"),
                                        (dict(softcap=True), "kv_dtype"), (dict(head_dim=72), "kv_dtype"),
                                        (dict(pipeline="tma", cta_tile_q=64, num_warps=4), "num_warps"),
                                        (dict(pipeline="tma", cta_tile_kv=80), "cta_tile_kv")])
def test_kv_dtype_refusals_name_the_field(bad, field):
    fields = {**dict(head_dim=128, varlen=True, kv_dtype="fp8_e4m3"), **bad}
    with pytest.raises(SpecError) as ei:
        resolve(PrefillSpec(**fields), "sm_90a")
    assert ei.value.field == field, str(ei.value)


def test_kv_dtype_values():
    for v in ("fp8_e4m3", "fp8_e5m2"):
        s = PrefillSpec(head_dim=128, varlen=True, kv_dtype=v)
        assert parse_spec(s.to_text()) == s and s.to_dict()["kv_dtype"] == v
    assert "kv_dtype" not in PrefillSpec(head_dim=128, varlen=True).to_dict()
    with pytest.raises(SpecError):
        PrefillSpec(head_dim=128, varlen=True, kv_dtype="int8")


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a", "sm_120"])
@pytest.mark.parametrize("d, paged", [(128, True), (256, True), (64, False)])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fp8_cache_kernels_build_spill_free(arch, d, paged, dtype):
    if d == 256 and arch != "sm_90a":
        with pytest.raises(SpecError) as ei:  # mma.sync at 256 spilled: refused by name
            resolve(PrefillSpec(head_dim=d, varlen=True, paged=paged, kv_dtype="fp8_e4m3", dtype=dtype), arch)
        assert ei.value.field == "kv_dtype"
        return
    from attngen.compiler import compile
    from attngen.render import render

    r = resolve(PrefillSpec(head_dim=d, varlen=True, paged=paged, kv_dtype="fp8_e4m3", mask="causal", dtype=dtype),
                arch)
    assert r.tma == (arch == "sm_90a"), r.to_text()  # (sm_90a: the TMA kernel, whose producer widens)
    assert r.smem_bytes() <= get_arch(arch).smem_per_block
    b = compile(render(r), arch, kernel_name=r.kernel_name)
    assert not b.resources.spill_stores, (r.to_text(), b.resources)


def test_fp8_cache_tma_maps_are_bytes_in_boxes_of_a_unit(monkeypatch):
    # k's and v's maps over an fp8 cache: the cache's own byte strides (not doubled as a 16-bit tensor's), boxes of 64
    # bytes by at most 32 rows (a box lands in one 32-key unit of the slot, which the producer widens in place)
    from types import SimpleNamespace

    from attngen.families.prefill import tma

    calls = []
    monkeypatch.setattr(tma, "tiled_map", lambda *a: calls.append(a) or b"m" * 128)
    r = resolve(PrefillSpec(head_dim=128, varlen=True, paged=True, kv_dtype="fp8_e4m3", mask="causal"), "sm_90a")
    assert r.tma
    for block, rows in ((16, 16), (64, 32), (256, 32)):
        calls.clear()
        q = SimpleNamespace(ptr=1 << 20, shape=(100, 8, 128), strides=(8 * 128, 128, 1), dtype="torch.bfloat16")
        kv = SimpleNamespace(ptr=1 << 24, shape=(10, block, 2, 128), strides=(block * 256, 256, 128, 1),
                             dtype="torch.float8_e4m3fn")
        assert len(tma.tensor_maps(q, kv, kv, r)) == 3 * 128
        (_, _, _, qs, qbox, _), k, v = calls
        assert qs == (2 * 8 * 128, 2 * 128, 2 * 8 * 128) and qbox == (64, r.cta_tile_q, 1, 1)
        for dtype, _, dims, strides, box, _ in (k, v):
            assert dims == (128, block, 2, 10) and strides == (256, 128, block * 256) and box == (64, rows, 1, 1)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_cache_bf16_q_runs_fp16_mmas_on_the_tma_kernel(d):
    # A bf16 q over an fp8 cache on sm_90a's TMA kernel: the entry instantiates prefill_fwd with fp16 MMAs (BF16
    # false, T still bf16: q's map and O's stores), the producer carries Q into fp16 (q_tile), and the kernel's shared
    # memory holds 24 bytes more (Q's landed mbarrier, four words); an fp16 q, or the cp.async kernel, as before.
    from attngen.families.prefill import fp8
    from attngen.render import render

    spec = PrefillSpec(head_dim=d, varlen=True, paged=True, kv_dtype="fp8_e4m3", mask="causal")
    r = resolve(spec, "sm_90a")
    r16 = r.replace(dtype="fp16")
    assert r.tma and fp8.computes_fp16(r) and not fp8.computes_fp16(r16)
    assert r.smem_bytes() - r16.smem_bytes() == 24
    src, src16 = render(r), render(r16)
    assert "prefill_fwd<elem_t, false, HEAD_DIM" in src and "using elem_t = __nv_bfloat16;" in src
    assert "prefill_fwd<elem_t, IS_BF16, HEAD_DIM" in src16
    # the logits' scale and the LSE's take 2^-k back in the bf16 kernel alone
    assert src.count("FwdWiden<K>::q_unit(sV)") >= 2 and "FwdWiden<K>::q_unit(sV)" not in src16
    sync = resolve(spec.replace(pipeline="sync"), "sm_90a")
    assert not fp8.computes_fp16(sync) and "prefill_fwd<elem_t, IS_BF16, HEAD_DIM" in render(sync)
