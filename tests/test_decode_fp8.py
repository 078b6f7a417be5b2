"""fp8 KV caches in the decode family, on the CPU: the spec's kv_dtype (text, dict, name, refusals), the fit of its
shared memory on every arch, the exact widening of every fp8 value (the bit-level form sm_80/86 run, emulated), a
real NVRTC build for every manifest arch, and the op's host path on the stub driver (tests/host_path_fp8.py)."""

from __future__ import annotations

import json

import pytest

from attngen.arch import ARCHS
from attngen.errors import SpecError
from attngen.manifest import load_manifest
from attngen.spec import parse_spec, resolve
from attngen import DecodeSpec
from attngen.families.decode.spec import KVDType

from tests import fake_cuda
from tests.cache_support import ROOT


def test_kv_dtype_round_trips_and_names_the_kernel():
    s = parse_spec("decode:head_dim=128,dtype=fp16,paged=true,kv_dtype=fp8_e5m2")
    assert s.kv_dtype is KVDType.FP8_E5M2
    assert "kv_dtype=fp8_e5m2" in s.to_text()
    for form in (s.to_text(), s.to_text(full=True), s.to_dict(), json.loads(s.canonical_json())):
        assert parse_spec(form) == s
    assert "_e5m2_" in s.kernel_name and "_e4m3_" in s.replace(kv_dtype="fp8_e4m3").kernel_name
    assert s.replace(kv_dtype=None) == DecodeSpec(head_dim=128, dtype="fp16", paged=True)


def test_unset_kv_dtype_leaves_the_spec_as_it_was():
    # not shown, not in the dict or the canonical JSON (a 16-bit cache's spec reads as before the field)
    s = DecodeSpec(head_dim=64, dtype="bf16", q_rows=32)
    assert "kv_dtype" not in s.to_text() and "kv_dtype" not in s.to_dict() and "kv_dtype" not in s.canonical_json()
    assert "kv_dtype=None" in s.to_text(full=True) and parse_spec(s.to_text(full=True)) == s
    assert DecodeSpec(kv_dtype="none") == DecodeSpec() == DecodeSpec.from_dict({"kv_dtype": None})
    assert s.kernel_name.startswith("attngen_decode_d64_bf16_rows32_")
    assert s.canonical_json() == ('{"alibi":false,"cta_tile_kv":0,"dtype":"bf16","family":"decode","head_dim":64,'
                                  '"local":false,"num_stages":0,"num_warps":0,"paged":false,"q_rows":32,'
                                  '"sinks":false,"softcap":false,"variant":"fused"}')


@pytest.mark.parametrize("kw,other", [(dict(head_dim=512), "head_dim=512"), (dict(head_dim=72), "head_dim=72"),
                                      (dict(variant="unfused"), "variant=unfused"),
                                      (dict(softcap=True), "softcap=true"), (dict(alibi=True), "alibi=true")])
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
    for d in (32, 48, 64, 80, 96, 112, 128, 144, 160, 192, 224, 240, 256):
        for rows in DecodeSpec.Q_ROWS:
            for paged in (False, True):
                r = resolve(DecodeSpec(head_dim=d, q_rows=rows, paged=paged, kv_dtype="fp8_e4m3"), arch)
                # fp8 K and V slots: rows of d bytes where d / 16 is a power of two (swizzled), else padded to an
                # odd number of 16-byte chunks; nothing else beside Q (the fragments are widened in registers)
                chunks = d // 16
                row = d if chunks & (chunks - 1) == 0 else (chunks | 1) * 16
                assert r.fp8_row_bytes == row
                ring = r.num_stages * r.cta_tile_kv * row * 2
                assert r.smem_bytes() >= rows * r.row_elems * 2 + ring
                assert r.smem_bytes() <= a.smem_per_block, (d, rows, paged, r)


def _widen_bits_e4m3(b):
    """templates/decode/fp8.cuh's e4m3x2_to_f16x2_bits, one value at a time, in numpy's fp16 (subnormals kept)."""
    import numpy as np

    h = (b.astype(np.uint16) << 8).astype(np.uint16)
    mag = ((h >> 1) & 0x3F80).astype(np.uint16)
    v = ((mag | (h & 0x8000)).view(np.float16) * np.float16(256)).astype(np.float16).view(np.uint16)
    return np.where(mag == 0x3F80, v | 0x7E00, v).astype(np.uint16).view(np.float16)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_the_bit_level_widening_is_exact_for_every_value(fmt):
    torch = pytest.importorskip("torch")
    import numpy as np

    b = np.arange(256, dtype=np.uint8)
    tdt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    ref = torch.from_numpy(b).view(tdt).to(torch.float32).numpy()
    got = _widen_bits_e4m3(b) if fmt == "e4m3" else (b.astype(np.uint16) << 8).astype(np.uint16).view(np.float16)
    got = got.astype(np.float32)
    nan = np.isnan(ref)
    assert (np.isnan(got) == nan).all() and (got[~nan] == ref[~nan]).all()
    # and fp16 -> bf16 (through fp32) keeps every one: at most 4 significant bits, exponents in bf16's range
    assert (torch.from_numpy(got[~nan]).to(torch.bfloat16).float().numpy() == ref[~nan]).all()


MANIFEST_ARCHS = [a.name for a in load_manifest(ROOT / "cache" / "default.toml").archs]


@pytest.mark.parametrize("arch", MANIFEST_ARCHS)
def test_fp8_kernels_build_for_every_manifest_arch(arch):
    from attngen.compiler import compile
    from attngen.render import render

    # both formats with both q dtypes; swizzled rows (64, 128, 256) and padded ones with an odd chunk count (80,
    # 144: the x2 fragment reads), paged, 32 rows, per-row key bounds and sinks
    cases = [dict(kv_dtype="fp8_e4m3", dtype="bf16"), dict(kv_dtype="fp8_e4m3", dtype="fp16"),
             dict(kv_dtype="fp8_e5m2", dtype="bf16", head_dim=64, paged=True, q_rows=32),
             dict(kv_dtype="fp8_e5m2", dtype="fp16", head_dim=256, paged=True, local=True),
             dict(kv_dtype="fp8_e4m3", dtype="bf16", head_dim=80, sinks=True),
             dict(kv_dtype="fp8_e5m2", dtype="fp16", head_dim=144, q_rows=32)]
    for kw in cases:
        r = resolve(DecodeSpec(**kw), arch)
        src = render(r)
        assert "DecodeFp8<DecodeShape<" in src and "kv_dtype=" in src
        b = compile(src, arch, kernel_name=r.kernel_name)
        assert b.cubin[:4] == b"\x7fELF"
        assert not b.resources.spill_stores, (arch, r.to_text(), b.resources)


def test_a_16bit_spec_renders_no_fp8_code():
    from attngen.render import render

    src = render(resolve(DecodeSpec(), "sm_90a"))
    assert "DecodeFp8" not in src and "kv_dtype" not in src and "using Kernel = Decode<DecodeShape<" in src


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_fp8_decode_host_path_on_stub_driver(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_fp8.py", tmp_path)


def test_stored_tunings_of_16bit_caches_do_not_apply_to_fp8():
    # an entry stored before kv_dtype existed (its fields without it) keeps matching its own spec, not an fp8 one
    from attngen.arch import get_arch
    from attngen.tuned import tuned_choices

    base = DecodeSpec(head_dim=128, dtype="bf16")
    entry = {"family": "decode", "fields": {k: v for k, v in base.untuned_dict().items()}, "arch": "sm_90a",
             "gpu": "G", "nvrtc": "N", "attngen": "V", "seqlen": 4096,
             "tuning": {"cta_tile_kv": 128, "num_warps": 4, "num_stages": 2}}
    assert "kv_dtype" not in entry["fields"]
    got = tuned_choices(base, get_arch("sm_90a"), "G", [entry], nvrtc="N", version="V")
    assert [s.cta_tile_kv for _, s in got] == [128]
    assert tuned_choices(base.replace(kv_dtype="fp8_e4m3"), get_arch("sm_90a"), "G", [entry], nvrtc="N",
                         version="V") == []


def test_paged_offsets_past_32_bits_are_refused_by_name():
    # the fp8 kernel forms a paged row's offsets from 32-bit strides and its table index in 32 bits
    from types import SimpleNamespace

    from attngen.errors import LaunchError
    from attngen.families.decode.fp8 import check_paged

    ok = SimpleNamespace(strides=(16 * 8 * 128, 8 * 128, 128, 1))
    check_paged(ok, ok, 4, 2 ** 20, 2 ** 20)
    check_paged(ok, ok, 2, 2 ** 31, 2 ** 31)  # the last entry is 2^32 - 1 from the start
    with pytest.raises(LaunchError, match=r"block_table \(with an fp8 cache\) spans 4294967297 entries"):
        check_paged(ok, ok, 2, 2 ** 31, 2 ** 31 + 1)
    wide = SimpleNamespace(strides=(2 ** 32, 8 * 128, 128, 1))
    with pytest.raises(LaunchError, match=r"v_cache \(fp8, paged\) has strides \(4294967296, 1024, 128, 1\)"):
        check_paged(ok, wide, 1, 16, 16)
