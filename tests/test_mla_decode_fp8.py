"""fp8 latent caches in the MLA decode family, on the CPU: the spec's kv_dtype (text, dict, name, refusals), the fit
of its shared memory and its kernel on every arch (mma.sync on the cp.async ring, sm_90a too), the choice of kernel
and split, real NVRTC builds without spills, and the op's host path on the stub driver (tests/host_path_mla_fp8.py).
The numbers are checked on a GPU: tests/test_gpu_mla_fp8.py."""

from __future__ import annotations

import json

import pytest

from attngen.arch import ARCHS, get_arch
from attngen.errors import SpecError
from attngen.families.decode.spec import KVDType
from attngen.families.mla_decode import choose as M
from attngen.families.mla_decode.spec import MlaDecodeSpec, QkShard
from attngen.spec import Mma, Pipeline, parse_spec, resolve

from tests import fake_cuda
from tests.test_choose import facts


def test_kv_dtype_round_trips_and_names_the_kernel():
    s = parse_spec("mla_decode:dtype=fp16,paged=true,kv_dtype=fp8_e5m2")
    assert s.kv_dtype is KVDType.FP8_E5M2 and "kv_dtype=fp8_e5m2" in s.to_text()
    for form in (s.to_text(), s.to_text(full=True), s.to_dict(), json.loads(s.canonical_json())):
        assert parse_spec(form) == s
    assert "_e5m2_" in s.kernel_name and "_e4m3_" in s.replace(kv_dtype="fp8_e4m3").kernel_name
    assert s.replace(kv_dtype=None) == MlaDecodeSpec(dtype="fp16", paged=True)


def test_unset_kv_dtype_leaves_the_spec_as_it_was():
    s = MlaDecodeSpec(q_rows=32)
    assert "kv_dtype" not in s.to_text() and "kv_dtype" not in s.to_dict() and "kv_dtype" not in s.canonical_json()
    assert MlaDecodeSpec(kv_dtype="none") == MlaDecodeSpec() == MlaDecodeSpec.from_dict({"kv_dtype": None})
    assert s.canonical_json() == ('{"cta_tile_kv":0,"dtype":"bf16","family":"mla_decode","kv_lora_rank":512,'
                                  '"mma":"auto","num_stages":0,"num_warps":0,"paged":false,"pipeline":"auto",'
                                  '"q_rows":32,"qk_shard":"auto","rope_dim":64}')
    assert s.kernel_name.startswith("attngen_mla_decode_ckv512_kpe64_bf16_rows32_")


@pytest.mark.parametrize("pin", ["mma=wgmma", "pipeline=tma", "qk_shard=alternate"])
def test_what_fp8_does_not_run_is_refused_naming_both_fields(pin):
    with pytest.raises(SpecError) as ei:
        parse_spec(f"mla_decode:kv_dtype=fp8_e4m3,{pin}")
    assert ei.value.field == "kv_dtype" and ei.value.value == "fp8_e4m3"
    assert pin in str(ei.value) and "allowed: unset" in str(ei.value)


@pytest.mark.parametrize("bad", ["fp8", "e4m3", "bf16", 8, True])
def test_a_bad_kv_dtype_names_the_formats(bad):
    with pytest.raises(SpecError) as ei:
        MlaDecodeSpec(kv_dtype=bad)
    assert ei.value.field == "kv_dtype" and "fp8_e4m3, fp8_e5m2" in ei.value.allowed


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_fp8_specs_resolve_to_mma_sync_within_shared_memory(arch):
    for rank, rope in ((512, 64), (256, 32)):
        for rows in MlaDecodeSpec.Q_ROWS:
            for paged in (False, True):
                r = resolve(MlaDecodeSpec(kv_lora_rank=rank, rope_dim=rope, q_rows=rows, paged=paged,
                                          kv_dtype="fp8_e4m3"), arch)
                assert (r.mma, r.pipeline) == (Mma.SYNC, Pipeline.SYNC) and r.qk_shard in (QkShard.TRUE, QkShard.FALSE)
                # one byte row a key, ckv then kpe, padded to an odd number of 16-byte chunks; Q (fp16) padded
                row = ((rank + rope) // 16 | 1) * 16
                assert r.fp8_row_bytes == row
                assert r.smem_bytes() >= 2 * rows * (rank + rope + 8) + r.num_stages * r.cta_tile_kv * row
                assert r.smem_bytes() <= get_arch(arch).smem_per_block, (rows, paged, r)
                assert not r.cluster_merge_fits()


def test_the_choice_keeps_fp8_on_mma_sync_and_counts_its_bytes():
    f = facts("sm_90a")
    for heads, batch, cap in ((16, 1, 4096), (32, 64, 8192), (128, 1, 32768), (128, 64, 16384), (64, 128, 8192)):
        bf = M.choose(M.Problem(heads=heads, batch=batch, capacity=cap), f)
        c = M.choose(M.Problem(heads=heads, batch=batch, capacity=cap, kv_dtype=KVDType.FP8_E4M3), f)
        s, lc = c.spec, c.launch
        assert s.kv_dtype is KVDType.FP8_E4M3 and (s.mma, s.pipeline) == (Mma.SYNC, Pipeline.SYNC), s
        assert s.qk_shard is not QkShard.ALTERNATE and lc.cluster == 0 and not lc.evict_first
        assert s.q_rows == MlaDecodeSpec.rows_for(heads, 1)  # no 64-row block of 32 rows
        assert (lc.merge_entry is None) == (lc.num_splits == 1)
        assert bf.spec.kv_dtype is None
    # a tile of half the bytes: the split model sees that (against the same tiles in 16 bits)
    p = M.Problem(heads=16, batch=1, capacity=32768, spec=MlaDecodeSpec(qk_shard=True, cta_tile_kv=64, num_warps=8,
                                                                          num_stages=2, mma="mma_sync",
                                                                          pipeline="sync"))
    assert M.choose(p._replace(kv_dtype=KVDType.FP8_E4M3), facts("sm_80")).spec.fp8
    # every spec the op can run for an fp8 manifest line is the resolved one
    for arch in ("sm_80", "sm_89", "sm_90a", "sm_100"):
        for rows in MlaDecodeSpec.Q_ROWS:
            spec = MlaDecodeSpec(q_rows=rows, kv_dtype="fp8_e4m3")
            assert M.reachable(spec, get_arch(arch)) == {resolve(spec, arch)}


def _build(spec, arch):
    from attngen.compiler import compile as nvrtc
    from attngen.render import render

    src = render(spec)
    assert "MlaFp8Params" in src and "kv_dtype=" in src
    return nvrtc(src, arch, kernel_name=spec.kernel_name, entries=spec.entries)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a"])
def test_fp8_defaults_compile_spill_free(arch, tmp_path, monkeypatch):
    """The defaults the manifest prewarms (e4m3, bf16 q: 16, 32 and 64 rows, contiguous and paged) and e5m2 with an
    fp16 q and the 256 + 32 dims: a real NVRTC compile, no spills, every entry in the cubin."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    cases = [dict(q_rows=r, paged=p) for r in (16, 32, 64) for p in (False, True)]
    cases += [dict(kv_dtype="fp8_e5m2", dtype="fp16", q_rows=16),
              dict(kv_dtype="fp8_e5m2", dtype="fp16", q_rows=64, paged=True, kv_lora_rank=256, rope_dim=32)]
    for kw in cases:
        spec = resolve(MlaDecodeSpec(**{"kv_dtype": "fp8_e4m3", **kw}), arch)
        b = _build(spec, arch)
        assert (b.resources.spill_stores, b.resources.spill_loads) == (0, 0), (arch, spec.to_text(), b.resources)
        for entry in spec.entries:
            assert b".text." + entry.encode() + b"\x00" in b.cubin


def test_a_16bit_spec_renders_no_fp8_code():
    from attngen.render import render

    for arch in ("sm_80", "sm_90a"):
        src = render(resolve(MlaDecodeSpec(q_rows=16), arch))
        assert "MlaFp8Params" not in src and "kv_dtype" not in src and "fp8x4_to_f16x2" not in src


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_fp8_mla_host_path_on_stub_driver(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_mla_fp8.py", tmp_path, timeout=900)
