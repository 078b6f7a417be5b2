"""The chunked prefill kernel's spec side (head dims above 256, V wider than Q/K): routing,
fit rules, errors, flat shared memory, rendering. Compiles for every manifest arch are in
test_manifest_build (the default manifest lists these head dims)."""

from __future__ import annotations

import itertools

import pytest

from attngen import PrefillSpec, SpecError, parse_spec, resolve, validate
from attngen.families.prefill.spec import Mma
from attngen.render import render

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120")
LARGE = (320, 384, 448, 512, 576, 640, 768, 1024)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d", LARGE)
def test_large_head_dims_resolve_to_the_chunked_kernel(arch, d):
    s = resolve(PrefillSpec(head_dim=d, mask="causal"), arch)
    # sm_90a: the wgmma form (past 640 columns of v split over two CTAs)
    wgmma = arch == "sm_90a"
    assert s.chunked and s.mma is (Mma.WGMMA if wgmma else Mma.SYNC) and s.head_dim_chunk in PrefillSpec.CHUNKS
    assert s.smem_bytes() <= __import__("attngen").get_arch(arch).smem_per_block


@pytest.mark.parametrize("d", (64, 128, 256))
def test_head_dims_up_to_256_keep_the_whole_row_kernel(d):
    s = resolve(PrefillSpec(head_dim=d), "sm_80")
    assert not s.chunked and s.head_dim_chunk == 0
    # ... unless the chunk width asks for the chunked one (the crossover benchmark)
    if d > 64:
        c = resolve(PrefillSpec(head_dim=d, head_dim_chunk=64), "sm_80")
        assert c.chunked


def test_shared_memory_does_not_grow_with_head_dim():
    cfg = dict(cta_tile_q=32, cta_tile_kv=128, num_warps=8, num_stages=3, mma="mma_sync", head_dim_chunk=64)
    # every head dim whose V splits into 8 warp columns of a multiple of 16, 320 and 1024 among them
    sizes = {d: PrefillSpec(head_dim=d, head_dim_v=dv, **cfg).smem_bytes()
             for d, dv in ((320, 384), (384, 384), (512, 512), (640, 640), (768, 768), (1024, 1024))}
    assert len(set(sizes.values())) == 1, sizes
    for d in (320, 1024):
        resolve(PrefillSpec(head_dim=d, head_dim_v=1024, **cfg), "sm_90a")  # fits: the one config serves both
    cfg64 = dict(cfg, cta_tile_q=64)
    sizes64 = {d: PrefillSpec(head_dim=d, **cfg64).smem_bytes() for d in (320, 384, 448, 512)}
    assert len(set(sizes64.values())) == 1, sizes64


@pytest.mark.parametrize("d,dv", [(576, 512), (320, 1024), (128, 256)])
def test_split_head_dims(d, dv):
    s = PrefillSpec(head_dim=d, head_dim_v=dv)
    assert s.dim_v == dv and s.chunked
    r = resolve(s, "sm_90a")
    src = render(r)
    assert f"constexpr int HEAD_DIM_V = {dv};" in src and "prefill_chunked<" in src
    assert parse_spec(r.to_text()) == r


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("d,dv", [(192, 128), (256, 128), (128, 64), (128, 96), (96, 64), (256, 192)])
def test_narrower_v_keeps_the_whole_row_kernel(arch, d, dv):
    """V narrower than Q/K up to head_dim 256 (DeepSeek's 192/128) runs the whole-row kernel: wgmma
    on sm_90a where both dims are multiples of 64, every form (paged, custom masks) accepted, and V's
    tiles take less shared memory than a V as wide as K."""
    r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mask="causal"), arch)
    assert not r.chunked and r.dim_v == dv
    assert (r.mma is Mma.WGMMA) == (arch == "sm_90a" and d % 64 == 0 and dv % 64 == 0)
    src = render(r)
    assert f"constexpr int HEAD_DIM_V = {dv};" in src and "prefill_fwd<" in src and "prefill_chunked<" not in src
    assert r.smem_bytes() < r.replace(head_dim_v=0).smem_bytes()
    for extra in (dict(varlen=True, paged=True), dict(custom_mask=True)):
        assert not resolve(PrefillSpec(head_dim=d, head_dim_v=dv, **extra), arch).chunked


def test_narrower_v_with_wgmma_needs_whole_swizzle_rows():
    s = PrefillSpec(head_dim=128, head_dim_v=96, mma="wgmma", cta_tile_q=128, cta_tile_kv=64, num_warps=8,
                    num_stages=2)
    with pytest.raises(SpecError) as e:
        validate(s, "sm_90a")
    assert e.value.field == "head_dim_v" and "96" in str(e.value)
    with pytest.raises(SpecError) as e:  # left to resolve: no wgmma config fits, mma_sync is named
        resolve(s.replace(cta_tile_q=0), "sm_90a")
    assert e.value.field == "mma" and "mma_sync" in str(e.value)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90a", "sm_120"])
def test_varlen_reaches_the_chunked_kernel(arch):
    """head_dim above 256 and V wider than 256 take varlen (not paged): the chunked kernel reads the
    work list and the sequences' row offsets, and the module carries the _order entry."""
    for text in ("prefill:head_dim=512,varlen=true,mask=causal", "prefill:head_dim=576,head_dim_v=512,varlen=true"):
        s = resolve(parse_spec(text), arch)
        assert s.chunked and s.varlen and s.entries[1].endswith("_order")
        src = render(s)
        assert "constexpr bool VARLEN = true;" in src and "prefill_chunked<" in src


def test_equal_head_dim_v_is_the_same_spec():
    assert PrefillSpec(head_dim=512, head_dim_v=512) == PrefillSpec(head_dim=512)
    assert "head_dim_v" not in PrefillSpec(head_dim=512, head_dim_v=512).to_text()


@pytest.mark.parametrize("text,field", [
    ("prefill:head_dim=512,head_dim_chunk=48", "head_dim_chunk"),
    ("prefill:head_dim=512,head_dim_chunk=256", "head_dim_chunk"),
    ("prefill:head_dim=320,head_dim_v=128,head_dim_chunk=128", "head_dim_chunk"),
    ("prefill:head_dim=128,head_dim_v=256,head_dim_chunk=128", "head_dim_chunk"),
    ("prefill:head_dim=512,varlen=true,paged=true", "paged"),
    ("prefill:head_dim=576,head_dim_v=512,custom_mask=true", "custom_mask"),
    ("prefill:head_dim=2048", "head_dim"),
    ("prefill:head_dim=512,head_dim_v=100", "head_dim_v"),
])
def test_bad_specs_name_the_field(text, field):
    with pytest.raises(SpecError) as e:
        parse_spec(text)
    assert e.value.field == field


@pytest.mark.parametrize("text,field", [
    ("prefill:head_dim=640,mma=wgmma,cta_tile_kv=128", "cta_tile_kv"),  # 64 keys fit
    ("prefill:head_dim=512,mma=wgmma,num_stages=2", "num_stages"),
    ("prefill:head_dim=512,mma=wgmma,head_dim_chunk=32,cta_tile_q=64,cta_tile_kv=64,num_warps=8,num_stages=4",
     "head_dim_chunk"),
    ("prefill:head_dim=512,mma=wgmma,cta_tile_q=32", "cta_tile_q"),
    ("prefill:head_dim=512,cta_tile_q=128", "cta_tile_q"),
    ("prefill:head_dim=1024,cta_tile_q=64,mma=mma_sync", "cta_tile_q"),  # (the wgmma form splits O over two CTAs)
    ("prefill:head_dim=512,num_stages=1", "num_stages"),
    ("prefill:head_dim=320,head_dim_chunk=64,cta_tile_q=32,cta_tile_kv=64", "cta_tile_kv"),
    ("prefill:head_dim=512,num_warps=4", "num_warps"),
])
def test_what_does_not_fit_is_refused_by_field(text, field):
    with pytest.raises(SpecError) as e:
        resolve(parse_spec(text), "sm_90a")
    assert e.value.field == field, str(e.value)


def test_small_smem_archs_fit_every_default():
    for arch, d in itertools.product(("sm_86", "sm_89", "sm_120"), LARGE):
        s = resolve(PrefillSpec(head_dim=d, mask="none"), arch)
        assert s.smem_bytes() <= 101376


def test_chunked_wgmma_form():
    """On sm_90a the chunked kernel has a wgmma form (two warpgroups over 64 query rows, dense swizzled
    tiles); elsewhere mma=wgmma is refused by field. Its shared memory does not grow with head_dim either."""
    s = resolve(parse_spec("prefill:head_dim=576,head_dim_v=512,mma=wgmma,mask=causal"), "sm_90a")
    assert s.chunked and s.mma is Mma.WGMMA and s.num_stages >= 3 and s.cta_tile_q == 64
    src = render(s)
    assert "constexpr bool WGMMA = true;" in src and "wgmma.mma_async" in src and "prefill_chunked<" in src
    assert s.smem_bytes() <= __import__("attngen").get_arch("sm_90a").smem_per_block
    cfg = dict(cta_tile_q=64, cta_tile_kv=64, num_warps=8, num_stages=4, mma="wgmma", head_dim_chunk=64)
    sizes = {d: PrefillSpec(head_dim=d, head_dim_v=dv, **cfg).smem_bytes()
             for d, dv in ((384, 384), (512, 512), (576, 512), (640, 640), (1024, 512))}
    assert len(set(sizes.values())) == 1, sizes
    # the TMA form holds Q's tile whole (64 rows of head_dim, loaded once): all else stays flat
    tma = {d: PrefillSpec(head_dim=d, head_dim_v=dv, pipeline="tma", **cfg).smem_bytes() - 2 * 64 * d
           for d, dv in ((384, 384), (512, 512), (576, 512), (640, 640), (1024, 512))}
    assert len(set(tma.values())) == 1, tma
    # past 640 columns two CTAs split O's columns (each repeating the QK work); the grid's y doubles
    for d, dv, per in ((768, 768, 384), (1024, 1024, 512), (320, 1024, 512)):
        r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mma="wgmma"), "sm_90a")
        assert r.v_splits == 2 and r.dim_v_padded == per and "constexpr int V_SPLITS = 2;" in render(r)
    assert resolve(PrefillSpec(head_dim=640, mma="wgmma"), "sm_90a").v_splits == 1
    # V's columns: each warpgroup's whole 64-column blocks plus, where its half ends 32 columns into one,
    # a 32-column tail step (320, 448, 576; not padded); 96 columns are padded to two warpgroups' blocks
    for d, dv, pad, tail in ((320, 0, 320, True), (448, 0, 448, True), (576, 0, 576, True), (512, 0, 512, False),
                             (640, 192, 192, True), (512, 96, 128, False), (384, 0, 384, False)):
        r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv), "sm_90a")
        assert r.mma is Mma.WGMMA and r.dim_v_padded == pad and r.chunk_grid["on"] == pad // 2 and r.v_tail is tail
        # the whole-width steps' columns divide the warpgroup's, the tail aside
        assert (pad // 2 - (32 if tail else 0)) % r.chunk_grid["vcw"] == 0
        assert f"constexpr int HEAD_DIM_V = {dv or d};" in render(r)
    for arch in ("sm_80", "sm_89", "sm_100", "sm_120"):
        with pytest.raises(SpecError) as e:
            validate(PrefillSpec(head_dim=512, **cfg), arch)
        assert e.value.field == "mma"
    # the mma.sync form keeps its padded tiles and its rules
    m = resolve(parse_spec("prefill:head_dim=512,mma=mma_sync"), "sm_90a")
    assert "constexpr bool WGMMA = false;" in render(m)


def test_op_spec_text_keeps_a_128_wide_chunk():
    """An op's spec text names no head_dim (the op takes its tensors'): a pinned head_dim_chunk of 128 is
    kept for the tensors' head dim, not read as "whole rows" at the default head_dim 128 and dropped."""
    from attngen.spec import spec_of_text

    s = spec_of_text("prefill:cta_tile_kv=128,head_dim_chunk=128,num_stages=4", "prefill")
    assert s.head_dim_chunk == 128
    assert s.replace(head_dim=512).head_dim_chunk == 128
    assert s.replace(head_dim=128).head_dim_chunk == 0  # whole rows there, as before
    with pytest.raises(SpecError) as e:
        s.replace(head_dim=320)
    assert e.value.field == "head_dim_chunk"
    r = resolve(s.replace(head_dim=512), "sm_90a")
    assert (r.cta_tile_kv, r.num_stages, r.head_dim_chunk) == (128, 4, 128)
    # fields only the chunked kernel takes (eight warps over 64 rows) are not checked at head_dim 128 first
    t = spec_of_text("prefill:cta_tile_q=64,num_warps=8,mma=wgmma,cta_tile_kv=64,head_dim_chunk=128", "prefill")
    assert (t.num_warps, t.head_dim_chunk) == (8, 128)
    with pytest.raises(SpecError) as e:
        spec_of_text("decode:head_dim=64", "prefill")
    assert e.value.field == "family"


def test_deeper_rings_are_the_chunked_wgmma_forms_only():
    r = resolve(parse_spec("prefill:head_dim=512,num_stages=8,head_dim_chunk=64"), "sm_90a")
    assert r.chunked and r.mma is Mma.WGMMA and r.num_stages == 8
    assert r.smem_bytes() <= __import__("attngen").get_arch("sm_90a").smem_per_block
    assert "constexpr int NUM_STAGES = 8;" in render(r)
    for text, arch in (("prefill:head_dim=128,num_stages=6", "sm_90a"),
                       ("prefill:head_dim=512,num_stages=6", "sm_80"),
                       ("prefill:head_dim=512,num_stages=6,mma=mma_sync", "sm_90a")):
        with pytest.raises(SpecError) as e:
            resolve(parse_spec(text), arch)
        assert e.value.field == "num_stages", str(e.value)
    whole = PrefillSpec(head_dim=128, cta_tile_q=128, cta_tile_kv=64, num_warps=8, num_stages=6, mma="wgmma",
                        pipeline="tma", schedule="serial", persistent="false")
    with pytest.raises(SpecError) as e:
        validate(whole, "sm_90a")
    assert e.value.field == "num_stages" and "1, 2, 3, 4" in str(e.value)


@pytest.mark.parametrize("d, dv, want, tma", [
    (320, 320, (128, 6, 64), True), (384, 384, (128, 4, 128), True), (448, 448, (128, 6, 64), True),
    (512, 512, (128, 4, 128), True), (576, 512, (128, 6, 64), True), (576, 576, (128, 5, 64), True),
    (640, 640, (64, 8, 128), True), (768, 768, (128, 6, 64), True), (1024, 1024, (128, 5, 64), True),
    (1024, 512, (128, 4, 64), True),
])
def test_chunked_wgmma_defaults_per_head_dims(d, dv, want, tma):
    """The sm_90a defaults the H100 sweeps chose per head dims (the generic first config elsewhere), on the TMA
    ring; varlen on the cp.async ring."""
    for mask in ("none", "causal"):
        r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mask=mask), "sm_90a")
        assert (r.cta_tile_kv, r.num_stages, r.head_dim_chunk, r.tma) == (*want, tma)
        assert not resolve(PrefillSpec(head_dim=d, head_dim_v=dv, mask=mask, varlen=True), "sm_90a").tma


def test_chunked_varlen_defaults_step_around_their_spills():
    """512 causal and 640 windowed take their dense defaults' configs but for varlen, where ptxas spills them."""
    dense = resolve(PrefillSpec(head_dim=512, mask="causal"), "sm_90a")
    varlen = resolve(PrefillSpec(head_dim=512, mask="causal", varlen=True), "sm_90a")
    assert dense.head_dim_chunk == 128 and varlen.head_dim_chunk == 64
    assert resolve(PrefillSpec(head_dim=640, mask="sliding_window", varlen=True), "sm_90a").head_dim_chunk == 64
    assert resolve(PrefillSpec(head_dim=640, mask="causal", varlen=True), "sm_90a").head_dim_chunk == 128


def test_split_pairs_share_the_qk_work():
    """Past 640 columns of v, where each half of head_dim is two whole chunks or more and head_dim exceeds a
    CTA's columns of v, the two CTAs of a query tile are a cluster splitting the QK work (its exchange in
    shared memory); else they repeat it."""
    for d, dv, pair in ((768, 768, True), (1024, 1024, True), (512, 1024, False), (320, 1024, False),
                        (640, 640, False), (512, 512, False)):
        r = resolve(PrefillSpec(head_dim=d, head_dim_v=dv), "sm_90a")
        assert r.qk_pair is pair, (d, dv)
        src = render(r)
        # (the kernel's QK_PAIR argument; then its TMA one, the default on sm_90a, and the tensor maps)
        assert ("__cluster_dims__(1, 2, 1)" in src) is pair and f"{str(pair).lower()}, true>(params.p, params.maps);" in src
        if pair:
            alone = r.smem_bytes() - 2 * 4 * r.cta_tile_q * r.cta_tile_kv
            assert alone > 0 and r.smem_bytes() <= __import__("attngen").get_arch("sm_90a").smem_per_block
