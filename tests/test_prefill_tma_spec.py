"""The TMA prefill pipeline's spec (``pipeline=tma``, its ``schedule``) and its compiles (NVRTC, no GPU)."""

import itertools
import types

import pytest

from attngen import PrefillSpec, SpecError, resolve
from attngen.arch import get_arch
from attngen.compiler import compile
from attngen.families.prefill.choose import by_rows
from attngen.render import render


def test_tma_is_the_sm90a_dense_default():
    r = resolve(PrefillSpec(head_dim=128), "sm_90a")
    assert r.tma and r.mma.value == "wgmma"
    assert r.threads == 32 * r.num_warps + 128  # the producer warpgroup
    assert r.schedule.value == "pingpong"  # H100, 2026-11-23: 2-10% over serial at head_dim 64 and 128
    assert r.is_persistent  # H100, 2026-11-24: 1.02-1.11x at seqlen 512-4096, even at 8k-16k
    one = r.replace(persistent="false")  # one CTA a query tile
    bars = 8 * (1 + 4 * one.num_stages)  # Q's; per slot K full, V full, K empty, V empty
    assert one.smem_bytes() == one.replace(pipeline="sync", schedule="serial").smem_bytes() + bars
    assert one.replace(schedule="serial").smem_bytes() == one.smem_bytes() - 8 * one.num_stages
    # head_dim 256: one CTA a tile by default; persistent, O is staged in Q's tile (its own does not fit 128x64)
    r256 = resolve(PrefillSpec(head_dim=256), "sm_90a")
    assert not r256.is_persistent and not r256.o_in_q
    p256 = r256.replace(persistent=True)
    assert p256.o_in_q and p256.smem_bytes() == r256.smem_bytes() + 8  # Q's empty barrier, no O tile
    assert p256.smem_bytes(own_o=True) > 227 * 1024
    assert not r.o_in_q and r.smem_bytes() == r.smem_bytes(own_o=True)  # where O's own tile fits, it has one
    # a sliding window keeps one CTA a tile (measured even to 0.94x); causal and no mask are persistent
    for d in (64, 128, 192):
        assert resolve(PrefillSpec(head_dim=d, mask="causal"), "sm_90a").is_persistent
        assert not resolve(PrefillSpec(head_dim=d, mask="sliding_window"), "sm_90a").is_persistent
        assert resolve(PrefillSpec(head_dim=d, mask="sliding_window", persistent=True), "sm_90a").is_persistent
    # elsewhere, and for the layouts it has no form for, the cp.async pipeline
    for arch in ("sm_80", "sm_90", "sm_120"):
        assert resolve(PrefillSpec(head_dim=128), arch).pipeline.value == "sync"
        with pytest.raises(SpecError):
            resolve(PrefillSpec(head_dim=128, pipeline="tma"), arch)
    # (a paged cache in blocks of a multiple of 16 rows takes the varlen TMA kernels; other block sizes do not)
    assert resolve(PrefillSpec(head_dim=128, varlen=True, paged=True), "sm_90a").tma
    with pytest.raises(SpecError, match="page_rows"):
        resolve(PrefillSpec(head_dim=128, varlen=True, paged=True, page_rows=True, pipeline="tma"), "sm_90a")
    for fields in (dict(varlen=True, paged=True, page_rows=True), dict(head_dim=64, custom_mask=True, mask="causal"),
                   dict(head_dim=512, head_dim_v=96),
                   dict(head_dim=512, varlen=True), dict(head_dim=96), dict(head_dim=64, mask="causal", varlen=True)):
        assert not resolve(PrefillSpec(**{"head_dim": 128, **fields}), "sm_90a").tma
    # tiles pinned without a pipeline: the cp.async one (what such specs meant before the field)
    pinned = PrefillSpec(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=3, mma="wgmma")
    assert pinned.pipeline.value == "sync" and pinned.is_resolved


def _flat(src):
    """The source with each run of whitespace one space (the entry's arguments wrap)."""
    return " ".join(src.split())


def _entry_args(ctas, *flags):
    """The TMA entry's last template arguments: MASK_LIST, the CTAs an SM, OVERLAP, PINGPONG, PERSISTENT, O_IN_Q."""
    return f"MASK_LIST, {ctas}, {', '.join(str(f).lower() for f in flags)}>(params.p, params.maps)"


@pytest.mark.parametrize("d, warps, ctas", [(64, 4, 2), (128, 4, 2), (256, 4, 1), (128, 8, 1), (256, 8, 1)])
def test_tma_ctas_an_sm_reach_the_launch_bounds(d, warps, ctas):
    r = resolve(PrefillSpec(head_dim=d, pipeline="tma", num_warps=warps, cta_tile_kv=64), "sm_90a")
    assert r.tma_ctas == ctas and r.replace(pipeline="sync").tma_ctas == 0
    src = render(r)
    assert f"__launch_bounds__({r.threads}, {ctas})" in src  # one said too: ptxas then honours setmaxnreg
    assert _entry_args(ctas, False, False, r.is_persistent, r.o_in_q) in _flat(src)


@pytest.mark.parametrize("fields, field", [
    (dict(mma="mma_sync"), "mma"),  # "no configuration with mma=mma_sync, pipeline=tma; allowed: wgmma"
    (dict(varlen=True, paged=True, page_rows=True), "pipeline"),  # blocks not a multiple of 16 rows: no boxes
    (dict(head_dim=512, head_dim_v=96), "pipeline"),  # the chunked kernel: v's 96 columns padded to 128
    (dict(head_dim=512, schedule="pingpong"), "schedule"),  # its TMA form is serial, one CTA a tile
    (dict(head_dim=512, persistent=True), "persistent"),
    (dict(head_dim=512, varlen=True), "pipeline"),
])
def test_tma_refusals_name_the_field(fields, field):
    with pytest.raises(SpecError) as e:
        resolve(PrefillSpec(**{"head_dim": 128, "pipeline": "tma", **fields}), "sm_90a")
    assert e.value.field == field


def test_custom_masks_run_on_the_tma_pipeline_when_asked():
    for sched in ("serial", "pingpong"):
        r = resolve(PrefillSpec(head_dim=128, custom_mask=True, pipeline="tma", schedule=sched), "sm_90a")
        assert r.tma and r.custom_mask and not r.is_persistent and r.schedule.value == sched
        src = render(r)
        assert "constexpr bool MASK_LIST = true;" in src and "PrefillTmaParams" in src
        assert all(f"{r.kernel_name}{e}(" in src for e in ("_mtiles", "_mlists", "_order"))
    # the defaults at head_dim 128 and, without a causal mask, 64 (TUNED_TMA_MASK); elsewhere the cp.async kernels'
    # 64-row tiles stay first
    r = resolve(PrefillSpec(head_dim=128, custom_mask=True, mask="causal"), "sm_90a")
    assert r.tma and r.schedule.value == "pingpong" and r.cta_tile_q == 128 and not r.is_persistent
    assert by_rows(r, get_arch("sm_90a")) is None  # (the dense default's rule by rows is not a mask's)
    r = resolve(PrefillSpec(head_dim=64, custom_mask=True), "sm_90a")
    assert r.tma and (r.cta_tile_q, r.cta_tile_kv, r.schedule.value) == (64, 128, "overlap")
    for fields in (dict(head_dim=64, mask="causal"), dict(head_dim=64, mask="sliding_window"), dict(head_dim=256)):
        r = resolve(PrefillSpec(custom_mask=True, **fields), "sm_90a")
        assert not r.tma and r.cta_tile_q == 64, fields


def test_contiguous_varlen_runs_on_the_tma_pipeline_when_asked():
    for sched in ("serial", "overlap", "pingpong"):
        r = resolve(PrefillSpec(head_dim=128, varlen=True, pipeline="tma", schedule=sched), "sm_90a")
        assert r.tma and r.varlen and not r.is_persistent and r.schedule.value == sched
        src = render(r)
        assert "constexpr bool VARLEN = true;" in src and "PrefillTmaParams" in src and f"{r.kernel_name}_order(" in src
    # the default where measured faster (TUNED_TMA_VARLEN): one CTA a work-list slot, never by rows
    for d, dv, mask, sched in ((64, 0, "none", "overlap"), (128, 0, "causal", "pingpong"), (192, 0, "none", "serial"),
                               (192, 128, "causal", "pingpong"), (256, 0, "sliding_window", "serial")):
        r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mask=mask, varlen=True), "sm_90a")
        assert r.tma and not r.is_persistent and r.schedule.value == sched, r.to_text()
        assert by_rows(r, get_arch("sm_90a")) is None
        # a paged cache in blocks of a multiple of 16 rows takes the same kernels; one of other blocks the cp.async one
        paged = resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mask=mask, varlen=True, paged=True), "sm_90a")
        stages = 3 if (d, dv, mask) == (128, 0, "causal") else r.num_stages  # (TUNED_TMA_PAGED)
        assert paged == r.replace(paged=True, num_stages=stages), paged.to_text()
        assert "constexpr bool PAGED = true;" in render(paged)
        rows = resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mask=mask, varlen=True, paged=True, page_rows=True),
                       "sm_90a")
        assert not rows.tma
    # head dim 64 under a mask: a contiguous batch keeps the cp.async kernel, a paged one takes the TMA ring
    assert not resolve(PrefillSpec(head_dim=64, mask="causal", varlen=True), "sm_90a").tma
    paged64 = resolve(PrefillSpec(head_dim=64, mask="causal", varlen=True, paged=True), "sm_90a")
    assert paged64.tma and paged64.schedule.value == "overlap" and paged64.cta_tile_q == 64


def test_tma_text_round_trip():
    s = PrefillSpec(head_dim=128, pipeline="tma", mma="wgmma")
    assert "pipeline=tma" in s.to_text()
    assert "pipeline" not in PrefillSpec(head_dim=128).to_text()


# ---- schedules: serial, overlap (the softmax under the GEMMs), pingpong (two warpgroups take turns) ----

def test_schedule_resolves_with_the_tma_pipeline():
    for sched in ("overlap", "pingpong"):
        r = resolve(PrefillSpec(head_dim=128, schedule=sched), "sm_90a")
        assert r.tma and r.schedule.value == sched and r.num_stages >= 2
        assert f"schedule={sched}" in r.to_text()
    assert resolve(PrefillSpec(head_dim=128, schedule="pingpong"), "sm_90a").num_warps == 8
    # the cp.async pipeline has the serial schedule only; a spec pinning its tiles and the TMA pipeline
    # (stored tuning winners) keeps the serial one it meant before the field
    assert resolve(PrefillSpec(head_dim=128), "sm_80").schedule.value == "serial"
    assert PrefillSpec(head_dim=128, pipeline="sync").schedule.value == "serial"
    pinned = PrefillSpec(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=3, mma="wgmma",
                         pipeline="tma")
    assert pinned.schedule.value == "serial" and pinned.is_resolved
    assert not PrefillSpec(head_dim=128, pipeline="tma").schedule  # tiles left to resolve: so is the schedule


@pytest.mark.parametrize("fields, field", [
    (dict(pipeline="sync", schedule="overlap"), "schedule"),
    (dict(schedule="overlap", varlen=True, paged=True, page_rows=True), "schedule"),
    (dict(schedule="overlap", head_dim=512), "schedule"),
    (dict(schedule="pingpong", num_warps=4), "schedule"),
    (dict(schedule="overlap", num_stages=1, cta_tile_kv=64, num_warps=8, cta_tile_q=128, mma="wgmma"), "num_stages"),
    (dict(schedule="sometimes"), "schedule"),
])
def test_schedule_refusals_name_the_field(fields, field):
    with pytest.raises(SpecError) as e:
        resolve(PrefillSpec(**{"head_dim": 128, **fields}), "sm_90a")
    assert e.value.field == field


def test_schedule_off_sm90a_is_refused():
    with pytest.raises(SpecError):
        resolve(PrefillSpec(head_dim=128, schedule="overlap"), "sm_80")


@pytest.mark.parametrize("text", [
    "prefill:head_dim=64,dtype=fp16,mask=causal,return_lse=true,pipeline=tma,schedule=serial",
    "prefill:head_dim=128,dtype=bf16,pipeline=tma",
    "prefill:head_dim=128,dtype=bf16,mask=sliding_window,num_warps=4,cta_tile_q=64,pipeline=tma",
    "prefill:head_dim=192,head_dim_v=128,dtype=bf16,mask=causal,pipeline=tma",
    "prefill:head_dim=256,dtype=bf16,mask=causal,softcap=true,alibi=true,pipeline=tma",
    "prefill:head_dim=64,dtype=bf16,schedule=overlap,num_warps=4",
    "prefill:head_dim=64,dtype=fp16,mask=causal,schedule=pingpong",
    "prefill:head_dim=128,dtype=bf16,schedule=overlap",
    "prefill:head_dim=128,dtype=bf16,mask=causal,return_lse=true,schedule=pingpong",
    "prefill:head_dim=256,dtype=bf16,schedule=pingpong",
    "prefill:head_dim=256,dtype=fp16,mask=sliding_window,softcap=true,alibi=true,schedule=overlap",
    "prefill:head_dim=64,dtype=bf16,mask=causal,persistent=true",
    "prefill:head_dim=128,dtype=fp16,persistent=true",
    "prefill:head_dim=128,dtype=bf16,mask=sliding_window,return_lse=true,schedule=serial,persistent=true",
    # key tiles between the powers of two (FlashAttention-3's widths at head dims 256, 128 and 64)
    "prefill:head_dim=256,dtype=bf16,mask=causal,cta_tile_q=128,cta_tile_kv=80,num_warps=8,num_stages=2,"
    "schedule=pingpong",
    "prefill:head_dim=128,dtype=fp16,cta_tile_q=128,cta_tile_kv=176,num_warps=8,num_stages=2,schedule=overlap",
    "prefill:head_dim=64,dtype=bf16,mask=causal,cta_tile_q=128,cta_tile_kv=192,num_warps=8,num_stages=2,"
    "schedule=pingpong,persistent=true",
    # three consumer warpgroups (192-row tiles on 12 warps), turns among three
    "prefill:head_dim=64,dtype=bf16,mask=causal,cta_tile_q=192,cta_tile_kv=128,num_warps=12,num_stages=2,"
    "schedule=pingpong,persistent=false",
    "prefill:head_dim=64,dtype=fp16,cta_tile_q=192,cta_tile_kv=96,num_warps=12,num_stages=2,schedule=pingpong,"
    "persistent=true",
    "prefill:head_dim=128,dtype=bf16,cta_tile_q=192,cta_tile_kv=64,num_warps=12,num_stages=2,schedule=overlap,"
    "persistent=false",
])
def test_tma_kernels_compile_spill_free_and_asynchronous(text):
    from attngen.spec import parse_spec

    spec = resolve(parse_spec(text), "sm_90a")
    source = render(spec)
    assert "__grid_constant__" in source
    overlap, pingpong = spec.overlapped, spec.schedule.value == "pingpong"
    assert _entry_args(spec.tma_ctas, overlap, pingpong, spec.is_persistent, spec.o_in_q) in _flat(source)
    b = compile(source, "sm_90a", kernel_name=spec.kernel_name, want_ptx=True)
    r = b.resources
    assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), (text, r, b.log)
    assert r.smem_static + spec.smem_bytes() <= 232448
    for instr in ("cp.async.bulk.tensor.4d", "setmaxnreg.dec", "setmaxnreg.inc", "mbarrier.try_wait.parity"):
        assert instr in b.ptx, instr
    assert "cp.async.cg.shared.global" not in b.ptx  # every copy is TMA's
    # ptxas serialises the wgmma of a pipeline stage it cannot prove safe (C7514 and kin): the overlap gone
    assert "serialized" not in b.log, b.log
    assert ("bar.arrive" in b.ptx) == pingpong  # the turns
    assert ("wgmma.wait_group.sync.aligned 1" in b.ptx) == overlap  # S = Q K^T waited for with P V in flight


# ---- persistent: a grid of at most the CTAs the SMs hold walks the query tiles ----

def test_persistent_resolves_with_the_tma_pipeline_and_stages_o_apart():
    r = resolve(PrefillSpec(head_dim=128, persistent=True, mask="causal"), "sm_90a")
    assert r.tma and r.is_persistent and "persistent=true" in r.to_text()
    assert PrefillSpec(head_dim=128, persistent="true") == PrefillSpec(head_dim=128, persistent=True)
    plain = r.replace(persistent=False)
    assert not plain.is_persistent and "persistent=false" in plain.to_text()
    # O's own staging tile and Q's empty mbarrier
    assert r.smem_bytes() == plain.smem_bytes() + r.cta_tile_q * r.dim_v * 2 + 8
    assert "persistent" not in PrefillSpec(head_dim=128).to_text()  # auto
    # every kernel without the TMA pipeline resolves to false, and so does a spec pinning tiles and pipeline
    # (stored tuning winners from before the field: what they were measured as)
    assert resolve(PrefillSpec(head_dim=128), "sm_80").persistent.value == "false"
    assert resolve(PrefillSpec(head_dim=128, varlen=True), "sm_90a").persistent.value == "false"
    pinned = PrefillSpec(head_dim=128, cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, mma="wgmma",
                         pipeline="tma", schedule="pingpong")
    assert pinned.persistent.value == "false" and pinned.is_resolved


@pytest.mark.parametrize("fields, field", [
    (dict(pipeline="sync"), "persistent"),
    (dict(varlen=True), "persistent"),
    (dict(custom_mask=True), "persistent"),
    (dict(head_dim=512), "persistent"),
    (dict(persistent="often"), "persistent"),
])
def test_persistent_refusals_name_the_field(fields, field):
    with pytest.raises(SpecError) as e:
        resolve(PrefillSpec(**{"head_dim": 128, "persistent": True, **fields}), "sm_90a")
    assert e.value.field == field


def test_persistent_off_sm90a_is_refused():
    with pytest.raises(SpecError):
        resolve(PrefillSpec(head_dim=128, persistent=True), "sm_80")


def test_tensor_maps_keep_the_drivers_refusals(monkeypatch):
    # A default call falls back to the cp.async kernel where no map can be built; asking the driver again
    # on every such call would put its failure on the host path.
    from attngen.errors import LaunchError
    from attngen.families import tma as maps
    from attngen.families.prefill import tma
    from attngen.runtime import TensorInfo

    calls = []

    class Refusing:
        def encode_tiled(self, *args):
            calls.append(args)
            raise LaunchError("cuTensorMapEncodeTiled failed: CUDA_ERROR_INVALID_VALUE (1)")

    monkeypatch.setattr(maps, "driver", lambda: Refusing())
    monkeypatch.setattr(maps, "_kept", {})
    t = TensorInfo("torch", 1 << 20, (2, 100, 4, 128), (0, 512, 128, 1), "bf16", 0)
    for _ in range(3):
        with pytest.raises(LaunchError, match="pipeline=sync") as e:
            tma._map(t, 128, t.ptr)
        assert "CUDA_ERROR_INVALID_VALUE" in str(e.value)
    assert len(calls) == 1


def test_launch_layouts_match_the_kernels_structs():
    # The host packs PrefillParams / PrefillTmaParams with struct layouts; a field moved on either side would
    # shift every later one. NVRTC checks the offsets the host writes against the kernel's own structs.
    from attngen.families.prefill import op

    spec = resolve(PrefillSpec(head_dim=128, persistent=True), "sm_90a")
    P, TP = "attngen::PrefillParams<attngen::elem_t>", "attngen::PrefillTmaParams<attngen::elem_t>"
    checks = {
        f"__builtin_offsetof({TP}, p)": 384,
        f"__builtin_offsetof({P}, cu_q)": op._PARAMS.size,  # the dense launch's end
        f"__builtin_offsetof({P}, mask_units_b) + 4": op.PARAMS_EXT.size,
        f"__builtin_offsetof({TP}, p) + __builtin_offsetof({P}, batch_count) + 4": op._PARAMS_TMA_PERSISTENT.size,
    }
    source = render(spec) + "".join(f'\nstatic_assert({k} == {v}, "{k}");' for k, v in checks.items()) + "\n"
    compile(source, "sm_90a", kernel_name=spec.kernel_name)  # raises with the failed assertion's text


# ---- key tiles between the powers of two (80-192): the wgmma whole-row kernel on the dense layout ----

def test_wide_kv_tiles_resolve_for_the_wgmma_kernel_and_no_default_takes_one():
    wide = PrefillSpec.CTA_TILE_KV_WIDE
    for d, kv, pipelines in ((256, 80, ("tma",)), (128, 176, ("tma",)), (64, 192, ("tma", "sync")),
                             (128, 96, ("tma", "sync"))):
        for pipeline in pipelines:
            r = resolve(PrefillSpec(head_dim=d, cta_tile_q=128, cta_tile_kv=kv, num_warps=8, pipeline=pipeline,
                                    mma="wgmma"), "sm_90a")
            assert r.cta_tile_kv == kv and r.tma == (pipeline == "tma")
    # the cp.async kernel keeps its register estimate's limit of 176 (it spilled at 180), TMA's is 200
    with pytest.raises(SpecError) as e:
        resolve(PrefillSpec(head_dim=256, cta_tile_q=128, cta_tile_kv=80, num_warps=8, pipeline="sync",
                            mma="wgmma", num_stages=2), "sm_90a")
    assert e.value.field == "cta_tile_kv" and "limit 176" in str(e.value)
    for d in (64, 128, 192, 256):
        for mask in ("none", "causal", "sliding_window"):
            assert resolve(PrefillSpec(head_dim=d, mask=mask), "sm_90a").cta_tile_kv not in wide


@pytest.mark.parametrize("fields, named", [
    (dict(mma="mma_sync"), "mma=mma_sync"),
    (dict(mma="wgmma", custom_mask=True), "custom_mask=true"),
    (dict(mma="wgmma", varlen=True), "varlen=true"),
    (dict(mma="wgmma", head_dim=512, head_dim_chunk=64, cta_tile_q=64, num_stages=3), "head_dim_chunk=64"),
])
def test_wide_kv_tiles_elsewhere_are_refused_naming_the_field(fields, named):
    tiles = dict(head_dim=128, cta_tile_q=128, cta_tile_kv=96, num_warps=8, num_stages=2, pipeline="sync")
    with pytest.raises(SpecError) as e:  # every tile field pinned: the spec's own check
        resolve(PrefillSpec(**{**tiles, **fields}), "sm_90a")
    assert e.value.field == "cta_tile_kv" and e.value.value == 96 and e.value.allowed == "32, 64, 128"
    assert named in str(e.value), str(e.value)
    with pytest.raises(SpecError) as e:  # some pinned: no default candidate has such a tile there
        resolve(PrefillSpec(**{"head_dim": 128, "cta_tile_kv": 96, **fields}), "sm_90a")
    assert e.value.field == "cta_tile_kv" and e.value.value == 96, str(e.value)
    assert {int(x) for x in e.value.allowed.split(", ")} <= {32, 64, 128}, str(e.value)


def test_tuning_tries_wide_kv_tiles_on_sm90a_only():
    from attngen.spec import tuning_candidates

    spec = PrefillSpec(head_dim=256, cta_tile_q=128, num_warps=8, num_stages=2)
    kvs = {c.cta_tile_kv for c in tuning_candidates(spec, "sm_90a")}
    assert 80 in kvs and kvs <= {32, 64, 80, 96}
    assert tuning_candidates(spec, "sm_90a")[0].cta_tile_kv == 64  # the default first
    assert {c.cta_tile_kv for c in tuning_candidates(spec.replace(mma="mma_sync"), "sm_80")} <= {32, 64, 128}


# ---- three consumer warpgroups: 192-row tiles on 12 warps, the TMA kernel's only ----

def test_three_warpgroups_resolve_for_the_tma_kernel():
    from attngen.spec import tuning_candidates

    r = resolve(PrefillSpec(head_dim=64, cta_tile_q=192, num_warps=12, cta_tile_kv=128), "sm_90a")
    assert r.tma and r.threads == 512 and r.tma_ctas == 1 and r.is_resolved
    src = render(r.replace(schedule="pingpong"))
    assert "__launch_bounds__(512, 1)" in src
    # 160 registers a thread: the estimate's limit is 128 (head_dim 64 with 128-key tiles, 128 with 80)
    with pytest.raises(SpecError) as e:
        resolve(r.replace(cta_tile_kv=144), "sm_90a")
    assert e.value.field == "cta_tile_kv" and "limit 128" in str(e.value)
    resolve(PrefillSpec(head_dim=128, cta_tile_q=192, num_warps=12, cta_tile_kv=80, num_stages=2), "sm_90a")
    with pytest.raises(SpecError) as e:
        resolve(PrefillSpec(head_dim=128, cta_tile_q=192, num_warps=12, cta_tile_kv=96, num_stages=2,
                            pipeline="tma"), "sm_90a")
    assert e.value.field == "cta_tile_kv"
    # `attngen tune` tries them (and only on sm_90a); no default takes one elsewhere
    spec = PrefillSpec(head_dim=64, mask="causal")
    assert any(c.num_warps == 12 and c.tma for c in tuning_candidates(spec, "sm_90a"))
    assert all(c.num_warps != 12 for c in tuning_candidates(spec, "sm_80"))
    for arch in ("sm_80", "sm_90", "sm_120"):
        assert resolve(PrefillSpec(head_dim=64), arch).num_warps != 12


def test_head_dims_64_128_and_256_defaults_by_rows():
    from attngen.families.prefill.choose import by_rows

    for dtype in ("bf16", "fp16"):
        for extra in ({}, dict(return_lse=True, softcap=True, alibi=True)):
            for mask, bounds in (("none", [2048]), ("causal", [1024, 8192])):
                r = resolve(PrefillSpec(head_dim=64, mask=mask, dtype=dtype, **extra), "sm_90a")
                at, specs = by_rows(r, "sm_90a")
                assert at == bounds and len(specs) == len(bounds) + 1 and all(s.is_resolved for s in specs)
                long = specs[-1]  # three consumer warpgroups, one CTA a tile (its persistent form spills)
                assert (long.cta_tile_q, long.cta_tile_kv, long.num_warps, long.schedule.value,
                        long.is_persistent) == (192, 128, 12, "pingpong", False)
                assert specs[-2] == r  # the 128-row default between
                if mask == "causal":  # short causal rows: 64x64 tiles on the cp.async ring
                    short = specs[0]
                    assert (short.cta_tile_q, short.cta_tile_kv, short.num_warps, short.num_stages,
                            short.pipeline.value) == (64, 64, 4, 4, "sync")
                for s in specs:
                    assert (s.dtype, s.mask, s.return_lse, s.softcap, s.alibi) == (r.dtype, r.mask, r.return_lse,
                                                                                   r.softcap, r.alibi)
    # head_dim 256: 128x80 tiles in ping-pong (no mask from 1024 rows, causal from 2048)
    for mask, bounds in (("none", [1024]), ("causal", [2048])):
        r = resolve(PrefillSpec(head_dim=256, mask=mask, softcap=True), "sm_90a")
        at, specs = by_rows(r, "sm_90a")
        assert at == bounds and specs[0] == r
        assert (specs[1].cta_tile_kv, specs[1].schedule.value, specs[1].softcap) == (80, "pingpong", True)
    # head_dim 128, causal: below 768 rows 64x64 tiles on one warpgroup of the TMA ring, persistent
    for extra in ({}, dict(return_lse=True, softcap=True, alibi=True, dtype="fp16")):
        r = resolve(PrefillSpec(head_dim=128, mask="causal", **extra), "sm_90a")
        at, specs = by_rows(r, "sm_90a")
        assert at == [768] and specs[1] == r
        short = specs[0]
        assert (short.cta_tile_q, short.cta_tile_kv, short.num_warps, short.num_stages, short.pipeline.value,
                short.schedule.value, short.is_persistent) == (64, 64, 4, 2, "tma", "serial", True)
        assert (short.dtype, short.return_lse, short.softcap, short.alibi) == (r.dtype, r.return_lse, r.softcap,
                                                                               r.alibi)
    # head_dim 128 without a mask: from 8192 rows 128x192 tiles in ping-pong, persistent
    for extra in ({}, dict(return_lse=True, softcap=True, alibi=True, dtype="fp16")):
        r = resolve(PrefillSpec(head_dim=128, **extra), "sm_90a")
        at, specs = by_rows(r, "sm_90a")
        assert at == [8192] and specs[0] == r
        wide = specs[1]
        assert (wide.cta_tile_q, wide.cta_tile_kv, wide.num_warps, wide.num_stages, wide.pipeline.value,
                wide.schedule.value, wide.is_persistent) == (128, 192, 8, 2, "tma", "pingpong", True)
        assert (wide.dtype, wide.return_lse, wide.softcap, wide.alibi) == (r.dtype, r.return_lse, r.softcap, r.alibi)
    # other head dims, masks, layouts and archs keep the one default
    for fields, arch in ((dict(head_dim=128), "sm_90"), (dict(head_dim=128, mask="causal"), "sm_90"),
                         (dict(head_dim=128, mask="causal", varlen=True), "sm_90a"), (dict(head_dim=64, mask="sliding_window"), "sm_90a"),
                         (dict(head_dim=192), "sm_90a"), (dict(head_dim=256, mask="sliding_window"), "sm_90a"),
                         (dict(head_dim=256), "sm_80"),
                         (dict(head_dim=64, varlen=True), "sm_90a"), (dict(head_dim=64, custom_mask=True), "sm_90a"),
                         (dict(head_dim=64), "sm_80"), (dict(head_dim=64), "sm_90"), (dict(head_dim=64), "sm_120")):
        assert by_rows(resolve(PrefillSpec(**fields), arch), arch) is None, (fields, arch)


def test_kernels_by_rows_are_in_the_default_manifest():
    from attngen.families.prefill.choose import by_rows
    from attngen.manifest import expand, load_manifest

    specs = {resolve(s, arch).to_text() for s, arch in expand(load_manifest())
             if arch.name == "sm_90a" and s.family == "prefill" and s.head_dim in (64, 128, 256)}
    for d, mask, dtype in itertools.product((64, 128, 256), ("none", "causal"), ("bf16", "fp16")):
        _, by = by_rows(resolve(PrefillSpec(head_dim=d, mask=mask, dtype=dtype), "sm_90a"), "sm_90a") or ([], [])
        for spec in by:
            assert spec.to_text() in specs, spec.to_text()


@pytest.mark.parametrize("fields, field, named", [
    (dict(pipeline="sync", mma="wgmma"), "cta_tile_q", "pipeline=sync"),
    (dict(pipeline="sync", mma="mma_sync"), "cta_tile_q", "pipeline=sync"),
    (dict(mma="mma_sync", cta_tile_q=0), "num_warps", "mma=mma_sync"),
])
def test_three_warpgroups_elsewhere_are_refused_naming_the_field(fields, field, named):
    spec = PrefillSpec(**{"head_dim": 64, "cta_tile_q": 192, "num_warps": 12, "cta_tile_kv": 128,
                          "num_stages": 2, **fields})
    with pytest.raises(SpecError) as e:
        resolve(spec, "sm_90a")
    assert e.value.field == field, str(e.value)
    assert named in str(e.value) or field == "num_warps", str(e.value)
    with pytest.raises(SpecError):  # no wgmma there at all
        resolve(PrefillSpec(head_dim=64, cta_tile_q=192, num_warps=12), "sm_80")


def test_pingpong_with_one_warpgroup_is_refused():
    with pytest.raises(SpecError) as e:
        resolve(PrefillSpec(head_dim=64, cta_tile_q=64, num_warps=4, schedule="pingpong"), "sm_90a")
    assert e.value.field in ("schedule", "num_warps"), str(e.value)


# ---- the chunked kernel's TMA form (head dims above 256 whose V columns a warpgroup are whole boxes) ----

@pytest.mark.parametrize("d, dv", [(384, 384), (512, 512), (576, 512), (640, 640), (768, 768), (1024, 1024),
                                   (512, 1024), (320, 1024), (320, 320), (448, 448), (576, 576), (640, 192)])
def test_chunked_defaults_take_the_tma_ring_on_sm90a(d, dv):
    for mask in ("none", "causal", "sliding_window"):
        r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mask=mask), "sm_90a")
        assert r.chunked and r.tma and r.threads == 384 and r.schedule.value == "serial" and not r.is_persistent
        src = render(r)
        assert f"__launch_bounds__(384, 1){' __cluster_dims__(1, 2, 1)' if r.qk_pair else ''}" in src
        assert "true>(params.p, params.maps)" in src and "prefill_chunked<" in src
        # a warpgroup's V columns ending 32 into a box: a fourth map, of the tails
        assert f"PrefillTmaParams<attngen::elem_t, {4 if r.v_tail else 3}> params" in src
        # against the cp.async kernel of the same tiles: Q's tile of its own (the CTA's QK columns), a QK slot
        # without Q's chunk, and the mbarriers (a full and an empty a slot, and Q's)
        sync = r.replace(pipeline="sync")
        cg, sync_cg = r.chunk_grid, sync.chunk_grid
        q_cols = r.head_dim // (2 if r.qk_pair else 1)
        tma_slot = max(r.cta_tile_kv * r.head_dim_chunk, cg["vk"] * 2 * cg["vcw"])
        assert cg["stage_elems"] == tma_slot and cg["vk"] == sync_cg["vk"]  # the same V steps on both rings
        assert r.smem_bytes() - sync.smem_bytes() == 2 * (r.num_stages * (tma_slot - sync_cg["stage_elems"])
                                                          + r.cta_tile_q * q_cols) + 16 * r.num_stages + 8
        assert r.smem_bytes() <= 232448
    # elsewhere, varlen, and where a warpgroup's columns would be padded: the cp.async ring
    for fields in (dict(head_dim=d, head_dim_v=dv, varlen=True), dict(head_dim=512, head_dim_v=96)):
        assert not resolve(PrefillSpec(**fields), "sm_90a").tma
    for arch in ("sm_80", "sm_89", "sm_100"):
        assert not resolve(PrefillSpec(head_dim=d, head_dim_v=dv), arch).tma


def test_chunked_tma_maps_box_a_v_step(monkeypatch):
    """The chunked kernel's v map boxes a V step's keys (chunk_grid's vk), q's the query tile, k's the key tile."""
    from attngen.families.prefill import tma

    r = resolve(PrefillSpec(head_dim=512), "sm_90a")
    seen = []
    monkeypatch.setattr(tma, "_map", lambda t, rows, fallback, item=2: seen.append(rows) or b"")
    info = types.SimpleNamespace(ptr=1 << 20)
    tma.tensor_maps(info, info, info, r)
    assert seen == [r.cta_tile_q, r.cta_tile_kv, r.chunk_grid["vk"]] and r.chunk_grid["vk"] < r.cta_tile_kv


def test_chunked_tma_tail_map(monkeypatch):
    """Where a warpgroup's V columns end 32 into a box (320: 160 a warpgroup), a fourth map boxes the tails:
    5-d (32 columns, keys, the two halves, heads, batch) from 32 columns before the first half's end."""
    from attngen.families.prefill import tma

    r = resolve(PrefillSpec(head_dim=320), "sm_90a")
    assert r.tma and r.v_tail
    calls = []
    monkeypatch.setattr(tma, "_map", lambda t, rows, fallback, item=2: b"m" * 128)
    monkeypatch.setattr(tma, "tiled_map", lambda *a: calls.append(a) or b"t" * 128)
    info = types.SimpleNamespace(ptr=1 << 20, shape=(2, 100, 4, 320), strides=(100 * 4 * 328, 4 * 328, 328, 1),
                                 dtype="bf16")
    maps = tma.tensor_maps(info, info, info, r)
    assert len(maps) == 512 and maps.endswith(b"t" * 128)
    dtype, ptr, dims, strides, box = calls[0][:5]
    assert ptr == (1 << 20) + 2 * (160 - 32) and dims == (32, 100, 2, 4, 2)
    assert strides == (2 * 4 * 328, 2 * 160, 2 * 328, 2 * 100 * 4 * 328) and box == (32, r.chunk_grid["vk"], 2, 1, 1)


def test_a_paged_box_lies_in_one_block_and_tiles_a_key_tile():
    from attngen.families.prefill.tma import page_box_rows
    for bs, tile, rows in ((16, 128, 16), (48, 128, 16), (80, 64, 16), (32, 128, 32), (64, 128, 64), (96, 128, 32),
                           (256, 128, 128), (512, 64, 64), (64, 80, 16), (128, 96, 32), (256, 112, 16)):
        got = page_box_rows(bs, tile)
        assert got == rows and bs % got == 0 and tile % got == 0, (bs, tile, got)


def test_paged_default_is_tma_on_sm90a():
    """Without a spec, a paged cache of 16-row blocks runs the TMA kernel on sm_90a (and blocks of other sizes the
    cp.async kernel that looks up every row): the op's choice, from the block size's layout on."""
    from attngen.families.prefill import choose as ch
    from attngen.families.prefill.varlen import page_layout
    arch = get_arch("sm_90a")
    for bs, tma in ((16, True), (24, False)):
        problem = ch.Problem(128, mask=ch.MaskMode.CAUSAL, layout=page_layout(bs), rows=2048)
        spec = ch.table_of(problem, arch).spec_for(2048)
        assert spec.tma is tma, spec.to_text()
