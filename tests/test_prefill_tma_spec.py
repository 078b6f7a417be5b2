"""The TMA prefill pipeline's spec (``pipeline=tma``) and its compiles (NVRTC, no GPU)."""

import pytest

from attngen import PrefillSpec, SpecError, resolve
from attngen.compiler import compile
from attngen.render import render


def test_tma_is_the_sm90a_dense_default():
    r = resolve(PrefillSpec(head_dim=128), "sm_90a")
    assert r.tma and r.mma.value == "wgmma"
    assert r.threads == 32 * r.num_warps + 128  # the producer warpgroup
    assert r.smem_bytes() == r.replace(pipeline="sync").smem_bytes() + 8 * (1 + 3 * r.num_stages)
    # elsewhere, and for the layouts it has no form for, the cp.async pipeline
    for arch in ("sm_80", "sm_90", "sm_120"):
        assert resolve(PrefillSpec(head_dim=128), arch).pipeline.value == "sync"
        with pytest.raises(SpecError):
            resolve(PrefillSpec(head_dim=128, pipeline="tma"), arch)
    for fields in (dict(varlen=True), dict(custom_mask=True), dict(head_dim=512), dict(head_dim=96)):
        assert not resolve(PrefillSpec(**{"head_dim": 128, **fields}), "sm_90a").tma
    # tiles pinned without a pipeline: the cp.async one (what such specs meant before the field)
    pinned = PrefillSpec(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=3, mma="wgmma")
    assert pinned.pipeline.value == "sync" and pinned.is_resolved


@pytest.mark.parametrize("d, warps, ctas", [(64, 4, 2), (128, 4, 2), (256, 4, 1), (128, 8, 1), (256, 8, 1)])
def test_tma_ctas_an_sm_reach_the_launch_bounds(d, warps, ctas):
    r = resolve(PrefillSpec(head_dim=d, pipeline="tma", num_warps=warps, cta_tile_kv=64), "sm_90a")
    assert r.tma_ctas == ctas and r.replace(pipeline="sync").tma_ctas == 0
    src = render(r)
    assert f"__launch_bounds__({r.threads}{', 2' if ctas == 2 else ''})" in src
    assert f"MASK_LIST, {ctas}>(params.p, params.maps)" in src


@pytest.mark.parametrize("fields, field", [
    (dict(mma="mma_sync"), "mma"),  # "no configuration with mma=mma_sync, pipeline=tma; allowed: wgmma"
    (dict(varlen=True), "pipeline"),
    (dict(custom_mask=True), "pipeline"),
    (dict(head_dim=512), "pipeline"),
])
def test_tma_refusals_name_the_field(fields, field):
    with pytest.raises(SpecError) as e:
        resolve(PrefillSpec(**{"head_dim": 128, "pipeline": "tma", **fields}), "sm_90a")
    assert e.value.field == field


def test_tma_text_round_trip():
    s = PrefillSpec(head_dim=128, pipeline="tma", mma="wgmma")
    assert "pipeline=tma" in s.to_text()
    assert "pipeline" not in PrefillSpec(head_dim=128).to_text()


@pytest.mark.parametrize("text", [
    "prefill:head_dim=64,dtype=fp16,mask=causal,return_lse=true,pipeline=tma",
    "prefill:head_dim=128,dtype=bf16,pipeline=tma",
    "prefill:head_dim=128,dtype=bf16,mask=sliding_window,num_warps=4,cta_tile_q=64,pipeline=tma",
    "prefill:head_dim=192,head_dim_v=128,dtype=bf16,mask=causal,pipeline=tma",
    "prefill:head_dim=256,dtype=bf16,mask=causal,softcap=true,alibi=true,pipeline=tma",
])
def test_tma_kernels_compile_spill_free(text):
    from attngen.spec import parse_spec

    spec = resolve(parse_spec(text), "sm_90a")
    source = render(spec)
    assert "__grid_constant__" in source
    b = compile(source, "sm_90a", kernel_name=spec.kernel_name, want_ptx=True)
    r = b.resources
    assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), (text, r, b.log)
    assert r.smem_static + spec.smem_bytes() <= 232448
    for instr in ("cp.async.bulk.tensor.4d", "setmaxnreg.dec", "setmaxnreg.inc", "mbarrier.try_wait.parity"):
        assert instr in b.ptx, instr
    assert "cp.async.cg.shared.global" not in b.ptx  # every copy is TMA's


def test_tensor_maps_keep_the_drivers_refusals(monkeypatch):
    # A default call falls back to the cp.async kernel where no map can be built; asking the driver again
    # on every such call would put its failure on the host path.
    from attngen.errors import LaunchError
    from attngen.families.prefill import tma
    from attngen.runtime import TensorInfo

    calls = []

    class Refusing:
        def encode_tiled(self, *args):
            calls.append(args)
            raise LaunchError("cuTensorMapEncodeTiled failed: CUDA_ERROR_INVALID_VALUE (1)")

    monkeypatch.setattr(tma, "driver", lambda: Refusing())
    monkeypatch.setattr(tma, "_kept", {})
    t = TensorInfo("torch", 1 << 20, (2, 100, 4, 128), (0, 512, 128, 1), "bf16", 0)
    for _ in range(3):
        with pytest.raises(LaunchError, match="pipeline=sync") as e:
            tma._map(t, 128, t.ptr)
        assert "CUDA_ERROR_INVALID_VALUE" in str(e.value)
    assert len(calls) == 1
