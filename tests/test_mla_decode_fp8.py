"""fp8 latent caches in the MLA decode family, on the CPU: the spec's kv_dtype (text, dict, name, refusals), the fit
of its shared memory and its kernel on every arch (mma.sync on the cp.async ring; on sm_90a at 64 rows the wgmma kernel
on the TMA ring, widening in shared memory), the choice of kernel and split, real NVRTC builds without spills or
ptxas performance notes, and the op's host path on the stub driver (tests/host_path_mla_fp8.py). The numbers are
checked on a GPU: tests/test_gpu_mla_fp8.py."""

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


@pytest.mark.parametrize("pin", ["mma=wgmma,pipeline=sync", "mma=mma_sync,pipeline=tma", "qk_shard=alternate"])
def test_what_fp8_does_not_run_is_refused_naming_both_fields(pin):
    with pytest.raises(SpecError) as ei:
        parse_spec(f"mla_decode:kv_dtype=fp8_e4m3,{pin}")
    assert ei.value.field == "kv_dtype" and ei.value.value == "fp8_e4m3"
    assert pin.replace(",", ", ") in str(ei.value) or pin in str(ei.value)
    assert "allowed: unset" in str(ei.value) and "mma=wgmma and pipeline=tma" in str(ei.value)


@pytest.mark.parametrize("text,arch,field,says", [
    # wgmma alone or the TMA ring alone, pinned: the fp8 wgmma kernel (64 rows, sm_90a) or nothing
    ("mma=wgmma,q_rows=16", "sm_90a", "mma", "q_rows=64"),
    ("pipeline=tma,q_rows=16", "sm_90a", "mma", "q_rows=64"),
    ("mma=wgmma", "sm_90", "mma", "mma_sync"),
    ("mma=wgmma", "sm_100", "mma", "mma_sync"),
    ("mma=wgmma,cta_tile_kv=16,qk_shard=false", "sm_90a", "cta_tile_kv", "allowed: 64, 32"),
])
def test_fp8_wgmma_outside_its_shapes_is_refused_by_name(text, arch, field, says):
    with pytest.raises(SpecError) as ei:
        resolve(parse_spec(f"mla_decode:kv_dtype=fp8_e5m2,{text}"), arch)
    assert ei.value.field == field and says in str(ei.value), str(ei.value)
    # resolved specs whose mma and pipeline disagree: refused by check, naming kv_dtype
    s = MlaDecodeSpec(kv_dtype="fp8_e4m3", qk_shard=True, cta_tile_kv=64, num_warps=8, num_stages=2, mma="wgmma")
    with pytest.raises(SpecError) as ei:
        s.replace(pipeline="sync").check(get_arch("sm_90a"))
    assert ei.value.field == "kv_dtype" and "mma=wgmma, pipeline=sync" in str(ei.value)
    # 16-key tiles: why, from the check itself
    with pytest.raises(SpecError) as ei:
        s.replace(pipeline="tma", qk_shard=False, cta_tile_kv=16).check(get_arch("sm_90a"))
    assert ei.value.field == "cta_tile_kv" and "runs of 32 keys" in str(ei.value)


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
                if arch == "sm_90a" and rows == 64:
                    continue  # the wgmma kernel: test_fp8_64_rows_resolve_to_wgmma_on_sm_90a
                assert (r.mma, r.pipeline) == (Mma.SYNC, Pipeline.SYNC) and r.qk_shard in (QkShard.TRUE, QkShard.FALSE)
                # one byte row a key, ckv then kpe, padded to an odd number of 16-byte chunks; Q (fp16) padded
                row = ((rank + rope) // 16 | 1) * 16
                assert r.fp8_row_bytes == row
                assert r.smem_bytes() >= 2 * rows * (rank + rope + 8) + r.num_stages * r.cta_tile_kv * row
                assert r.smem_bytes() <= get_arch(arch).smem_per_block, (rows, paged, r)
                assert not r.cluster_merge_fits()


def test_fp8_16_rows_take_four_warps_on_sm_90a_only():
    """16 rows over an fp8 cache: four warps (two CTAs an SM) on sm_90a, where it was timed; 8 elsewhere."""
    def cfg(arch, **kw):
        r = resolve(MlaDecodeSpec(q_rows=16, kv_dtype="fp8_e4m3", **kw), arch)
        return r.qk_shard, r.cta_tile_kv, r.num_warps, r.num_stages
    for kw in ({}, {"paged": True}, {"kv_lora_rank": 256, "rope_dim": 32}):
        assert cfg("sm_90a", **kw) == (QkShard.TRUE, 64, 4, 2)
        assert cfg("sm_80", **kw)[2] == cfg("sm_100", **kw)[2] == 8
    assert resolve(MlaDecodeSpec(q_rows=16), "sm_90a").num_warps == 8  # a 16-bit cache keeps its tiles
    assert resolve(MlaDecodeSpec(q_rows=32, kv_dtype="fp8_e4m3"), "sm_90a").num_warps == 8


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_64_rows_resolve_to_wgmma_on_sm_90a(kv):
    """64 rows on sm_90a: the 16-bit kernel's tiles and shared memory (the fp8 tile lands in the slot it is widened
    in), three mbarriers a stage, a producer warpgroup past the 8 consumer warps; 16 and 32 rows stay on mma.sync."""
    a = get_arch("sm_90a")
    for rank, rope in ((512, 64), (256, 32)):
        for paged in (False, True):
            for dtype in ("bf16", "fp16"):
                base = dict(kv_lora_rank=rank, rope_dim=rope, q_rows=64, paged=paged, dtype=dtype)
                r = resolve(MlaDecodeSpec(kv_dtype=kv, **base), a.name)
                b16 = resolve(MlaDecodeSpec(**base), a.name)
                assert (r.mma, r.pipeline, r.qk_shard, r.cta_tile_kv, r.num_warps, r.num_stages) == (
                    Mma.WGMMA, Pipeline.TMA, QkShard.TRUE, 64, 8, 2), r
                assert r.replace(kv_dtype=None) == b16
                assert r.smem_bytes() == b16.smem_bytes() + 8 * 2 * r.num_stages <= a.smem_per_block
                assert (r.threads, b16.threads) == (384, 256) and r.producer_wg and not b16.producer_wg
                assert not r.cluster_merge_fits()
                for rows in (16, 32):
                    assert resolve(MlaDecodeSpec(kv_dtype=kv, **{**base, "q_rows": rows}), a.name).mma is Mma.SYNC
    # pinned forms that fit: unsharded, and 32-key tiles in up to four stages
    for pins, smem in ((dict(qk_shard=False), 222768), (dict(cta_tile_kv=32), 231008)):
        r = resolve(MlaDecodeSpec(q_rows=64, kv_dtype=kv, **pins), a.name)
        assert r.wgmma and r.tma and r.smem_bytes() == smem <= a.smem_per_block, r


def test_the_choice_routes_fp8_by_rows_and_counts_its_bytes():
    """sm_90a: 64 rows and more (64, 128 heads) take the wgmma kernel, fewer the mma.sync one (no 64-row block of 32
    rows, no alternate tiles, no cluster merge); where the driver refuses the TMA maps, the mma.sync kernel."""
    f = facts("sm_90a")
    for heads, batch, cap in ((16, 1, 4096), (32, 64, 8192), (128, 1, 32768), (128, 8, 4096), (128, 64, 16384),
                              (64, 128, 8192), (64, 1, 1000)):
        bf = M.choose(M.Problem(heads=heads, batch=batch, capacity=cap), f)
        p8 = M.Problem(heads=heads, batch=batch, capacity=cap, kv_dtype=KVDType.FP8_E4M3)
        c = M.choose(p8, f)
        s, lc = c.spec, c.launch
        wide = heads >= 64
        assert s.kv_dtype is KVDType.FP8_E4M3 and s.wgmma == s.tma == wide, s
        assert (s.mma, s.pipeline) == ((Mma.WGMMA, Pipeline.TMA) if wide else (Mma.SYNC, Pipeline.SYNC)), s
        assert s.qk_shard is not QkShard.ALTERNATE and lc.cluster == 0
        assert lc.evict_first == (wide and lc.num_splits >= M.EVICT_FIRST_MIN_SPLITS)
        assert s.q_rows == MlaDecodeSpec.rows_for(heads, 1)  # no 64-row block of 32 rows
        assert (lc.merge_entry is None) == (lc.num_splits == 1)
        assert bf.spec.kv_dtype is None
        refused = M.choose(M.refused(p8), f).spec
        assert (refused.mma, refused.pipeline, refused.kv_dtype) == (Mma.SYNC, Pipeline.SYNC, KVDType.FP8_E4M3)
        assert refused == resolve(MlaDecodeSpec(q_rows=s.q_rows, kv_dtype="fp8_e4m3", mma="mma_sync",
                                                pipeline="sync"), "sm_90a")
    # the refused form keeps the caller's other pins
    pinned = MlaDecodeSpec(qk_shard=False)
    r = M.choose(M.refused(M.Problem(heads=128, capacity=4096, kv_dtype=KVDType.FP8_E4M3, spec=pinned)), f).spec
    assert (r.mma, r.qk_shard) == (Mma.SYNC, QkShard.FALSE), r
    # other archs: mma.sync at every row count
    for arch in ("sm_90", "sm_100", "sm_89"):
        s = M.choose(M.Problem(heads=128, capacity=4096, kv_dtype=KVDType.FP8_E5M2), facts(arch)).spec
        assert (s.mma, s.pipeline) == (Mma.SYNC, Pipeline.SYNC), (arch, s)
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
    fp16 q and the 256 + 32 dims: a real NVRTC compile, no spills, no ptxas performance notes (on sm_90a: setmaxnreg
    kept, wgmma not serialised), every entry in the cubin."""
    from attngen.compiler import performance_notes

    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    cases = [dict(q_rows=r, paged=p) for r in (16, 32, 64) for p in (False, True)]
    cases += [dict(kv_dtype="fp8_e5m2", dtype="fp16", q_rows=16),
              dict(kv_dtype="fp8_e5m2", dtype="fp16", q_rows=64, paged=True, kv_lora_rank=256, rope_dim=32)]
    for kw in cases:
        spec = resolve(MlaDecodeSpec(**{"kv_dtype": "fp8_e4m3", **kw}), arch)
        assert spec.wgmma == (arch == "sm_90a" and spec.q_rows == 64), spec
        b = _build(spec, arch)
        assert (b.resources.spill_stores, b.resources.spill_loads) == (0, 0), (arch, spec.to_text(), b.resources)
        assert performance_notes(b.log) == (), (arch, spec.to_text(), performance_notes(b.log))
        for entry in spec.entries:
            assert b".text." + entry.encode() + b"\x00" in b.cubin


@pytest.mark.parametrize("kw", [
    dict(kv_dtype="fp8_e5m2", dtype="bf16"), dict(kv_dtype="fp8_e4m3", dtype="fp16"),
    dict(kv_dtype="fp8_e5m2", dtype="fp16"), dict(kv_dtype="fp8_e4m3", dtype="bf16", kv_lora_rank=256, rope_dim=32),
    dict(kv_dtype="fp8_e4m3", dtype="bf16", qk_shard=False, paged=True),
    dict(kv_dtype="fp8_e5m2", dtype="fp16", cta_tile_kv=32, paged=True),
    dict(kv_dtype="fp8_e4m3", dtype="bf16", cta_tile_kv=32, num_stages=2)])
def test_fp8_wgmma_forms_compile_spill_free(kw, tmp_path, monkeypatch):
    """The wgmma kernel of an fp8 cache (sm_90a, 64 rows) in both formats, both q dtypes, both dims and its pinned
    forms: spill-free, no ptxas performance notes, 384 threads (ptxas' count: 168 registers at launch, setmaxnreg
    moves them between the producer and the consumers)."""
    from attngen.compiler import performance_notes

    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec = resolve(MlaDecodeSpec(q_rows=64, **kw), "sm_90a")
    assert spec.wgmma and spec.tma and spec.threads == 384, spec
    b = _build(spec, "sm_90a")
    assert "MlaFp8Wgmma" in render_of(spec) and "regs_dec<PRODUCER_REGS>" in render_of(spec)
    assert (b.resources.spill_stores, b.resources.spill_loads) == (0, 0), (spec.to_text(), b.resources)
    assert performance_notes(b.log) == (), (spec.to_text(), performance_notes(b.log))
    assert b.resources.registers <= 168, b.resources


def render_of(spec):
    from attngen.render import render

    return render(spec)


def test_a_16bit_spec_renders_no_fp8_code():
    from attngen.render import render

    for arch in ("sm_80", "sm_90a"):
        src = render(resolve(MlaDecodeSpec(q_rows=16), arch))
        assert "MlaFp8Params" not in src and "kv_dtype" not in src and "fp8x4_to_f16x2" not in src
    # nor the mma.sync fp8 kernel the wgmma one's producer
    src = render(resolve(MlaDecodeSpec(q_rows=64, kv_dtype="fp8_e4m3", mma="mma_sync"), "sm_90a"))
    assert "MlaFp8Params" in src and "struct MlaFp8Wgmma {" not in src


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_fp8_mla_host_path_on_stub_driver(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_mla_fp8.py", tmp_path, timeout=900)
