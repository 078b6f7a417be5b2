"""The MLA decode family on the CPU: its spec and text form, the fit rules per arch, the defaults each
arch's shared memory leads to, the split count, and real NVRTC compiles (spill-free)."""

from __future__ import annotations

import pytest

import attngen
from attngen.arch import ARCHS, get_arch
from attngen.families.mla_decode.spec import MlaDecodeSpec, QkShard
from attngen.families.split_kv import choose_splits
from attngen.spec import Mma, Pipeline, SpecError, parse_spec, resolve, validate


def test_text_form_and_fields():
    s = parse_spec("mla_decode:dtype=bf16,qk_shard=true,num_stages=2,cta_tile_kv=32")
    assert isinstance(s, MlaDecodeSpec)
    assert (s.qk_shard, s.num_stages, s.cta_tile_kv, s.kv_lora_rank, s.rope_dim) == (QkShard.TRUE, 2, 32, 512, 64)
    assert parse_spec(s.to_text()) == s
    assert "qk_shard=true" in s.to_text()
    assert MlaDecodeSpec(qk_shard=False).qk_shard is QkShard.FALSE
    assert MlaDecodeSpec(qk_shard="auto").qk_shard is QkShard.AUTO and not MlaDecodeSpec().is_resolved
    assert parse_spec("mla_decode:kv_lora_rank=256,rope_dim=32").kv_lora_rank == 256
    with pytest.raises(SpecError, match="qk_shard"):
        MlaDecodeSpec(qk_shard="maybe")
    with pytest.raises(SpecError, match="kv_lora_rank"):
        parse_spec("mla_decode:kv_lora_rank=384")
    with pytest.raises(SpecError, match="q_rows"):
        MlaDecodeSpec(q_rows=128)


def test_rows_for():
    assert [MlaDecodeSpec.rows_for(h, q) for h, q in ((8, 1), (16, 1), (16, 2), (32, 1), (64, 1), (128, 4))] == \
        [16, 16, 32, 32, 64, 64]


@pytest.mark.parametrize("arch", ["sm_86", "sm_89", "sm_120"])
def test_small_smem_archs_take_one_stage_of_16_unsharded(arch):
    """99-100 KB: a 64-row block leaves room for one stage of 16 keys, unsharded."""
    r = resolve(MlaDecodeSpec(q_rows=64), arch)
    assert (r.qk_shard, r.cta_tile_kv, r.num_stages) == (QkShard.FALSE, 16, 1)
    assert r.smem_bytes() <= get_arch(arch).smem_per_block
    # A size that does not fit is refused, naming a field and the bytes.
    with pytest.raises(SpecError, match="shared memory") as e:
        resolve(MlaDecodeSpec(q_rows=64, qk_shard=True, cta_tile_kv=32), arch)
    assert e.value.field in ("num_stages", "cta_tile_kv", "qk_shard")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a", "sm_100"])
def test_large_smem_archs_resolve_and_fit(arch):
    for rows in MlaDecodeSpec.Q_ROWS:
        r = resolve(MlaDecodeSpec(q_rows=rows), arch)
        assert r.smem_bytes() <= get_arch(arch).smem_per_block
        assert r.num_stages >= 2
    assert resolve(MlaDecodeSpec(q_rows=64), "sm_90a").sharded


def test_fit_rules_name_the_field():
    # Sharding 32 keys over 8 warps of one row tile leaves 4 keys each: not whole MMA columns.
    with pytest.raises(SpecError) as e:
        validate(MlaDecodeSpec(q_rows=16, qk_shard=True, cta_tile_kv=32, num_warps=8, num_stages=2, mma="mma_sync", pipeline="sync"), "sm_90a")
    assert e.value.field == "qk_shard"
    # 64 rows on 4 warps: each warp would hold all 512 output columns of its 16 rows.
    with pytest.raises(SpecError) as e:
        validate(MlaDecodeSpec(q_rows=64, qk_shard=False, cta_tile_kv=16, num_warps=4, num_stages=1, mma="mma_sync", pipeline="sync"), "sm_90a")
    assert e.value.field == "num_warps"
    with pytest.raises(SpecError) as e:
        validate(MlaDecodeSpec(q_rows=64, qk_shard=False, cta_tile_kv=64, num_warps=8, num_stages=4, mma="mma_sync", pipeline="sync"), "sm_90a")
    assert e.value.field == "num_stages" and "bytes of shared memory" in str(e.value)


def test_smem_accounting():
    s = MlaDecodeSpec(q_rows=64, qk_shard=True, cta_tile_kv=32, num_warps=8, num_stages=3, mma="mma_sync", pipeline="sync")
    row = 512 + 64 + 8
    assert s.smem_bytes() == 2 * (64 * row + 3 * 32 * row + 64 * 40) + 4 * 2 * 64
    assert MlaDecodeSpec(q_rows=64, qk_shard=False, cta_tile_kv=32, num_warps=8, num_stages=3, mma="mma_sync", pipeline="sync").smem_bytes() == \
        2 * (64 * row + 3 * 32 * row) + 4 * 2 * 64


def test_wgmma_where_it_fits():
    """sm_90a's default for 64-row blocks is wgmma; 16/32-row blocks and every other arch stay on
    mma.sync; a pinned wgmma elsewhere is refused naming mma."""
    assert resolve(MlaDecodeSpec(q_rows=64), "sm_90a").mma is Mma.WGMMA
    assert resolve(MlaDecodeSpec(q_rows=64, kv_lora_rank=256, rope_dim=32, paged=True), "sm_90a").mma is Mma.WGMMA
    for rows in (16, 32):
        assert resolve(MlaDecodeSpec(q_rows=rows), "sm_90a").mma is Mma.SYNC
    for arch in ("sm_80", "sm_90", "sm_100", "sm_120"):
        assert resolve(MlaDecodeSpec(q_rows=64), arch).mma is Mma.SYNC
    assert resolve(MlaDecodeSpec(q_rows=64, mma="mma_sync", pipeline="sync"), "sm_90a").mma is Mma.SYNC
    with pytest.raises(SpecError, match="sm_90a") as e:
        validate(MlaDecodeSpec(q_rows=64, qk_shard=True, cta_tile_kv=64, num_warps=8, num_stages=2, mma="wgmma",
                               pipeline="sync"), "sm_90")
    assert e.value.field == "mma"
    with pytest.raises(SpecError, match="q_rows=16") as e:
        resolve(MlaDecodeSpec(q_rows=16, mma="wgmma"), "sm_90a")
    assert e.value.field == "mma"
    with pytest.raises(SpecError, match="16 keys") as e:
        validate(MlaDecodeSpec(q_rows=64, qk_shard=True, cta_tile_kv=16, num_warps=8, num_stages=2, mma="wgmma",
                               pipeline="sync"), "sm_90a")
    assert e.value.field == "cta_tile_kv"
    # Q, two 64-key stages and P in 128-byte-row blocks, the row exchange and the alignment slack.
    s = MlaDecodeSpec(q_rows=64, qk_shard=True, cta_tile_kv=64, num_warps=8, num_stages=2, mma="wgmma",
                      pipeline="sync")
    assert s.smem_bytes() == 2 * (64 * 576 + 2 * 64 * 576 + 64 * 64) + 4 * 2 * 64 + 1024
    # The TMA ring adds one 8-byte mbarrier a stage.
    assert s.replace(pipeline="tma").smem_bytes() == s.smem_bytes() + 16
    # rope 32: the last 64-column block is kept whole.
    s = s.replace(kv_lora_rank=256, rope_dim=32, qk_shard=False)
    assert s.smem_bytes() == 2 * (64 * 320 + 2 * 64 * 320) + 4 * 2 * 64 + 1024


def test_tma_ring_on_sm90a():
    """sm_90a's defaults load their tiles with TMA, wgmma at 64 rows and mma.sync at 16 and 32 (every candidate's
    first form); other archs keep cp.async, and a pinned TMA there is refused naming pipeline."""
    for rows in (16, 32, 64):
        for kw in ({}, dict(paged=True), dict(kv_lora_rank=256, rope_dim=32)):
            assert resolve(MlaDecodeSpec(q_rows=rows, **kw), "sm_90a").pipeline is Pipeline.TMA, (rows, kw)
    assert resolve(MlaDecodeSpec(q_rows=64, pipeline="sync"), "sm_90a").mma is Mma.WGMMA
    assert resolve(MlaDecodeSpec(q_rows=16), "sm_90a").mma is Mma.SYNC
    # 256 + 32, 16 rows, paged: its first config's TMA form spilled until 2026-11-26 (cp.async was taken); not now.
    r = resolve(MlaDecodeSpec(q_rows=16, paged=True, kv_lora_rank=256, rope_dim=32, cta_tile_kv=64, num_warps=8,
                              num_stages=2, qk_shard=True), "sm_90a")
    assert r.pipeline is Pipeline.TMA
    for arch in ("sm_80", "sm_89", "sm_120"):
        for rows in (16, 64):
            assert resolve(MlaDecodeSpec(q_rows=rows), arch).pipeline is Pipeline.SYNC
    # mma.sync on the TMA ring: Q padded to a whole 1024-byte atom, the tiles in 64-column blocks, the slack.
    s = MlaDecodeSpec(q_rows=16, qk_shard=True, cta_tile_kv=64, num_warps=8, num_stages=2, mma="mma_sync",
                      pipeline="tma")
    validate(s, "sm_90a")
    assert s.smem_bytes() == 2 * (9728 + 2 * 64 * 576 + 16 * 72) + 4 * 8 * 16 + 1024 + 16
    with pytest.raises(SpecError, match="sm_90a") as e:
        validate(s, "sm_80")
    assert e.value.field == "pipeline"
    with pytest.raises(SpecError) as e:
        resolve(MlaDecodeSpec(q_rows=64, pipeline="tma"), "sm_80")
    assert e.value.field in ("pipeline", "mma")


def test_alternate_tiles_fit_rules():
    """qk_shard=alternate is a form of the sm_90a wgmma kernel with the TMA ring, 64-key tiles and two
    stages; anything else is refused naming qk_shard. Its shared memory: P of one warpgroup in Q's rope
    block, the other's in its own block, 4 floats a row, two mbarriers a stage."""
    r = resolve(MlaDecodeSpec(q_rows=64, qk_shard="alternate"), "sm_90a")
    assert (r.mma, r.pipeline, r.cta_tile_kv, r.num_stages) == (Mma.WGMMA, Pipeline.TMA, 64, 2)
    assert r.smem_bytes() == 2 * (64 * 576 + 2 * 64 * 576 + 64 * 64) + 4 * (2 * 64 + 4 * 64) + 1024 + 8 * 4
    assert r.smem_bytes() <= get_arch("sm_90a").smem_per_block
    for arch in ("sm_80", "sm_90", "sm_120"):
        with pytest.raises(SpecError) as e:
            resolve(MlaDecodeSpec(q_rows=64, qk_shard="alternate"), arch)
        assert e.value.field == "qk_shard"
    for bad in (dict(cta_tile_kv=32, num_stages=4), dict(cta_tile_kv=64, num_stages=1)):
        with pytest.raises(SpecError, match="alternate") as e:
            validate(MlaDecodeSpec(q_rows=64, qk_shard="alternate", num_warps=8, mma="wgmma", pipeline="tma", **bad),
                     "sm_90a")
        assert e.value.field == "qk_shard"
    with pytest.raises(SpecError) as e:
        validate(r.replace(pipeline="sync"), "sm_90a")
    assert e.value.field == "qk_shard"


@pytest.mark.parametrize("text", ["mla_decode:q_rows=64,qk_shard=alternate",
                                  "mla_decode:q_rows=64,qk_shard=alternate,paged=true,dtype=fp16",
                                  "mla_decode:q_rows=64,qk_shard=alternate,kv_lora_rank=256,rope_dim=32"])
def test_alternate_tiles_compile_spill_free(text, tmp_path, monkeypatch):
    """A real NVRTC compile for sm_90a: no spills, and no wgmma serialised by ptxas (the warpgroup branch
    must look uniform to it)."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    from attngen.compiler import compile as nvrtc
    from attngen.render import render

    s = resolve(parse_spec(text), "sm_90a")
    b = nvrtc(render(s), "sm_90a", kernel_name=s.kernel_name, entries=s.entries, want_ptx=True)
    assert b.resources.spill_stores == 0 and b.resources.spill_loads == 0
    assert "serialized" not in b.log, b.log
    assert "cp.async.bulk.tensor.3d" in b.ptx and "mbarrier.try_wait.parity" in b.ptx


def _config(r):
    return (r.qk_shard, r.cta_tile_kv, r.num_warps, r.num_stages, r.pipeline)


def test_spilling_configs_come_last():
    """A config SPILLS_ON lists for an arch is not a default there while another fits; a spec that pins it whole
    still gets it; elsewhere it keeps its place."""
    from attngen.families.mla_decode.defaults import SPILLS_ON

    listed = SPILLS_ON[(512, 16, False)]
    r = resolve(MlaDecodeSpec(q_rows=16, qk_shard=False), "sm_90a")
    assert r.qk_shard is QkShard.FALSE and _config(r) not in listed
    whole = MlaDecodeSpec(q_rows=16, qk_shard=False, cta_tile_kv=64, num_warps=8, num_stages=2, mma="mma_sync",
                          pipeline="tma")
    assert _config(resolve(whole, "sm_90a")) in listed
    # sm_120, 256 + 32, 32 rows, paged: the default (unsharded first on 99 KB arches) skips its spilling first
    # candidate there; sm_89 keeps it.
    spec = MlaDecodeSpec(q_rows=32, paged=True, kv_lora_rank=256, rope_dim=32)
    first = (QkShard.FALSE, 64, 8, 2, Pipeline.SYNC)
    assert _config(resolve(spec, "sm_120")) != first and _config(resolve(spec, "sm_89")) == first


def test_splits_spread_a_small_batch():
    sms, per = 132, 1
    tile = 2 * 32 * 576
    # batch 1, 128 heads (two row blocks), 32k cache: split across the GPU.
    s = choose_splits(2, 32768, 32, sms, per, tile, 4 * 128 * 512)
    assert 32 <= s <= 132
    # batch 128, 16 heads: the grid fills the GPU already.
    assert choose_splits(128, 4096, 32, sms, per, tile, 4 * 128 * 16 * 512) == 1


def test_mla_split_count_weighs_q_and_partials():
    """MLA's split choice counts each split's Q rows and its partial (written and read back) twice:
    without that, 64 heads at batch 64 with 1k tokens split in two (1.24x slower than one on the H100)
    and batch 1 split 128 ways (1.2x slower than 64)."""
    def mla(b, seqlen, heads):
        rows = MlaDecodeSpec.rows_for(heads, 1)
        blocks = -(-heads // rows)
        return choose_splits(b * blocks, seqlen, 64, 132, 1, 2 * 64 * 576, 4 * b * heads * 512,
                             q_bytes=2 * b * blocks * rows * 576, side_weight=2.0, out_passes=2)
    assert mla(64, 1024, 64) == 1
    assert mla(64, 1024, 16) == 2
    assert 32 <= mla(1, 8192, 64) <= 64
    assert 64 <= mla(1, 32768, 64) <= 100
    assert mla(8, 8192, 64) == 16 and mla(8, 8192, 128) == 8
    # The GQA decode family's model is unchanged by the new arguments' defaults.
    assert choose_splits(64, 1024, 64, 132, 1, 2 * 64 * 576, 4 * 64 * 64 * 512) == 2


def test_exports_and_family():
    from attngen.families.mla_decode.op import mla_decode

    assert attngen.mla_decode is mla_decode
    assert attngen.get_family("mla_decode").spec is MlaDecodeSpec
    assert attngen.MlaDecodeSpec is MlaDecodeSpec


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_default_compiles_spill_free(arch, tmp_path, monkeypatch):
    """The q_rows=64 default (the most registers) on every arch: a real NVRTC compile, no spills."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec = resolve(MlaDecodeSpec(q_rows=64, paged=True), arch)
    b = attngen.build(spec, arch).binary
    r = b.resources
    assert r.known and (r.spill_stores, r.spill_loads) == (0, 0)
    for entry in spec.entries:
        assert b".text." + entry.encode() + b"\x00" in b.cubin


def test_cluster_merge_fits_counts_the_pushed_rows():
    """sm_90a, mma.sync: 32 rows push the rows each CTA merges over its Q and ring, up to 7 more than the block
    holds where the split count does not divide it; 16 rows leave their own rows there. A one-stage ring of
    32-key tiles holds 16 rows' partials but not 32 pushed ones; 64-key tiles hold both (the compiled kernel
    asserts the same, CLUSTER_FITS)."""
    def fits(rows, tile):
        return resolve(MlaDecodeSpec(q_rows=rows, cta_tile_kv=tile, num_stages=1, num_warps=4, mma="mma_sync"),
                       "sm_90a").cluster_merge_fits()
    assert fits(16, 32) and not fits(32, 32)
    assert fits(16, 64) and fits(32, 64)
    assert not resolve(MlaDecodeSpec(q_rows=64), "sm_90a").cluster_merge_fits()  # wgmma: the merge launch


def test_cluster_merge_form_of_the_wgmma_kernel():
    """cluster_merge: the sharded wgmma kernel over a 16-bit cache with the cluster merge compiled in; a name and key
    of its own, left out of every other spec's text; refused by name on the other kernels."""
    plain = resolve(MlaDecodeSpec(q_rows=64), "sm_90a")
    cl = resolve(parse_spec("mla_decode:q_rows=64,cluster_merge=true"), "sm_90a")
    assert cl.wgmma and cl.sharded and cl.cluster_merge and cl.cluster_merge_fits()
    assert "cluster_merge" not in plain.to_text() and "cluster_merge" not in plain.to_dict()
    assert "cluster_merge=true" in cl.to_text()
    assert parse_spec(cl.to_text()) == cl and cl.kernel_name != plain.kernel_name and "clmerge" in cl.kernel_name
    assert cl.replace(cluster_merge=False) == plain and cl.smem_bytes() == plain.smem_bytes()
    for text, arch in (("qk_shard=alternate", "sm_90a"), ("kv_dtype=fp8_e4m3", "sm_90a"), ("q_rows=16", "sm_80"),
                       ("q_rows=32,mma=mma_sync", "sm_90a")):
        with pytest.raises(SpecError, match="cluster_merge"):
            resolve(parse_spec(f"mla_decode:cluster_merge=true,{text}"), arch)


def test_one_cta_an_sm_is_said_where_shared_memory_leaves_room_for_no_second():
    """A kernel whose shared memory fits one CTA an SM on every arch says so in its launch bounds (ptxas, left to
    guess, aimed 16-row kernels at two CTAs, capped them at 128 registers and spilled); one that leaves room for two
    leaves ptxas its choice."""
    from attngen.render import render

    big = resolve(parse_spec("mla_decode:q_rows=16,paged=true"), "sm_90a")
    small = resolve(parse_spec("mla_decode:kv_lora_rank=256,rope_dim=32,q_rows=16,qk_shard=false,cta_tile_kv=16,"
                               "num_warps=4,num_stages=1"), "sm_80")
    most = max(a.smem_per_sm for a in ARCHS.values())
    assert 2 * (big.smem_bytes() + 1024) > most and big.one_cta_an_sm()
    assert 2 * (small.smem_bytes() + 1024) <= most and not small.one_cta_an_sm()
    assert f"__launch_bounds__({big.threads}, 1)\n{big.kernel_name}(" in render(big)
    assert f"__launch_bounds__({small.threads})\n{small.kernel_name}(" in render(small)


@pytest.mark.parametrize("text,arch,listed", [
    ("q_rows=16,paged=true", "sm_90a", True), ("q_rows=32", "sm_90a", True),
    ("q_rows=16,kv_dtype=fp8_e4m3", "sm_80", True),
    ("q_rows=64", "sm_90a", False), ("q_rows=64,kv_dtype=fp8_e4m3", "sm_90a", False), ("q_rows=64", "sm_80", False),
])
def test_merge_entries_launch_with_pdl_below_64_rows(text, arch, listed):
    """16- and 32-row modules list their merge entries for programmatic dependent launch: each merge entry waits
    for the split launch in pdl_enter and the main entry triggers the merge's launch; 64-row modules (the wgmma
    kernel, where the merge edge measured slower with PDL) list none and render neither."""
    from attngen.render import render

    spec = resolve(parse_spec(f"mla_decode:{text}"), arch)
    src = render(spec)
    assert spec.PDL_ENTRIES == (("_merge", "_merge_fine", "_merge_wide") if listed else ())
    assert "" not in spec.PDL_ENTRIES  # the split launch itself never waits on the kernel before it
    body = src[src.index(f"{spec.kernel_name}("):]  # the entries, past the helpers' definitions
    assert body.count("attngen::pdl_trigger();") == (1 if listed else 0)
    assert body.count("attngen::pdl_enter();") == (3 if listed else 0)


def test_page_rows_fields_and_refusals():
    """page_rows (paged blocks of any size) needs a paged cache. On sm_90a it resolves to the TMA ring gathered by a
    producer warpgroup (128 threads more, two mbarriers a stage, no TMA maps, no cluster merge), with wgmma at 64 rows
    and mma.sync below; with alternate tiles, four mbarriers a stage (each half's full and free); elsewhere to the
    cp.async ring. Not with an fp8 cache on the TMA ring (refused naming page_rows): an fp8 cache takes the mma.sync
    kernel on the cp.async ring. Shown in the text form and the kernel name only when set."""
    r = resolve(MlaDecodeSpec(q_rows=64, paged=True, page_rows=True), "sm_90a")
    assert (r.mma, r.pipeline, r.page_rows, r.gather, r.producer_wg) == (Mma.WGMMA, Pipeline.TMA, True, True, True)
    assert r.threads == 384 and not r.cluster_merge_fits()
    plain = resolve(MlaDecodeSpec(q_rows=64, paged=True), "sm_90a")
    assert r.smem_bytes() == plain.smem_bytes() + 8 * plain.num_stages  # (one mbarrier more a stage)
    assert "page_rows=true" in str(r) and "prow" in r.kernel_name
    assert "page_rows" not in str(plain) and "prow" not in plain.kernel_name and "page_rows" not in plain.to_dict()
    for rows in (16, 32):
        g = resolve(MlaDecodeSpec(q_rows=rows, paged=True, page_rows=True), "sm_90a")
        assert (g.mma, g.pipeline, g.threads) == (Mma.SYNC, Pipeline.TMA, 384)
    for arch in ("sm_80", "sm_120"):
        g = resolve(parse_spec("mla_decode:q_rows=16,paged=true,page_rows=true"), arch)
        assert g.page_rows and g.pipeline is Pipeline.SYNC and not g.gather and g.threads == 32 * g.num_warps
    with pytest.raises(SpecError) as e:
        MlaDecodeSpec(q_rows=16, page_rows=True)
    assert e.value.field == "page_rows"
    alt = resolve(MlaDecodeSpec(q_rows=64, paged=True, page_rows=True, qk_shard="alternate"), "sm_90a")
    alt_tma = resolve(MlaDecodeSpec(q_rows=64, paged=True, qk_shard="alternate"), "sm_90a")
    assert alt.gather and alt.alternate and alt.threads == 384
    assert alt.smem_bytes() == alt_tma.smem_bytes() + 16 * alt.num_stages  # (two mbarriers more a stage)
    with pytest.raises(SpecError, match="alternate") as e:
        resolve(MlaDecodeSpec(q_rows=64, paged=True, page_rows=True, qk_shard="alternate", pipeline="sync"), "sm_90a")
    assert e.value.field == "qk_shard"
    with pytest.raises(SpecError, match="fp8") as e:
        validate(MlaDecodeSpec(q_rows=64, paged=True, page_rows=True, kv_dtype="fp8_e4m3", qk_shard=True,
                               cta_tile_kv=64, num_warps=8, num_stages=2, mma="wgmma", pipeline="tma"), "sm_90a")
    assert e.value.field == "page_rows"
    fp8 = resolve(MlaDecodeSpec(q_rows=64, paged=True, page_rows=True, kv_dtype="fp8_e4m3"), "sm_90a")
    assert (fp8.mma, fp8.pipeline, fp8.producer_wg) == (Mma.SYNC, Pipeline.SYNC, False)


@pytest.mark.parametrize("text,arch", [
    ("mla_decode:q_rows=16,paged=true,page_rows=true", "sm_90a"),
    ("mla_decode:q_rows=64,paged=true,page_rows=true", "sm_90a"),
    ("mla_decode:q_rows=32,paged=true,page_rows=true,dtype=fp16,kv_lora_rank=256,rope_dim=32", "sm_80"),
    ("mla_decode:q_rows=64,paged=true,page_rows=true", "sm_120"),
    ("mla_decode:q_rows=16,paged=true,page_rows=true,kv_dtype=fp8_e4m3", "sm_90a"),
    ("mla_decode:q_rows=64,paged=true,page_rows=true,kv_dtype=fp8_e5m2", "sm_89"),
    ("mla_decode:q_rows=16,paged=true,page_rows=true,cta_tile_kv=32,num_warps=4", "sm_86"),
    ("mla_decode:q_rows=32,paged=true,page_rows=true", "sm_90a"),
    ("mla_decode:q_rows=16,paged=true,page_rows=true,pipeline=sync", "sm_90a"),
    ("mla_decode:q_rows=64,paged=true,page_rows=true,qk_shard=false,kv_lora_rank=256,rope_dim=32", "sm_90a"),
    ("mla_decode:q_rows=16,paged=true,page_rows=true,num_stages=1,num_warps=4", "sm_90a"),
])
def test_page_rows_compile_spill_free(text, arch, tmp_path, monkeypatch):
    """A real NVRTC compile of each page_rows kernel form (16-bit and fp8 caches, mma.sync and wgmma, the gathered TMA
    ring and the cp.async one, 32- and 64-key tiles): no spills, every entry in the cubin; the gathered ring signals
    its mbarriers by cp.async and issues no TMA copy."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    from attngen.render import render

    spec = resolve(parse_spec(text), arch)
    src = render(spec)
    assert "page_rows=true" in src and ", true>;" in src
    from attngen.compiler import compile as nvrtc

    b = nvrtc(src, arch, kernel_name=spec.kernel_name, entries=spec.entries, want_ptx=True)
    assert b.resources.known and (b.resources.spill_stores, b.resources.spill_loads) == (0, 0)
    for entry in spec.entries:
        assert b".text." + entry.encode() + b"\x00" in b.cubin
    assert ("cp.async.mbarrier.arrive.noinc" in b.ptx) == spec.gather and "cp.async.bulk.tensor" not in b.ptx
    # two CTAs an SM: ptxas told so, and the register file split between them
    assert (".minnctapersm 2" in b.ptx) == spec.two_ctas() == (spec.gather and spec.num_warps == 4)
    if spec.two_ctas():
        assert b.resources.registers <= 128


def test_box_lanes_fields_and_refusals():
    """box_lanes (a warp issues each tile's boxes over paged blocks smaller than a tile) is a form of the TMA kernels
    over a paged 16-bit cache: shown in the text form and the kernel's name only when set; refused by name on a
    contiguous cache, on the cp.async ring, with page_rows and with an fp8 cache."""
    r = resolve(MlaDecodeSpec(q_rows=64, paged=True, box_lanes=True), "sm_90a")
    plain = resolve(MlaDecodeSpec(q_rows=64, paged=True), "sm_90a")
    assert r.box_lanes and r.replace(box_lanes=False) == plain
    assert "box_lanes=true" in str(r) and "blanes" in r.kernel_name
    assert "box_lanes" not in str(plain) and "blanes" not in plain.kernel_name and "box_lanes" not in plain.to_dict()
    assert parse_spec(str(r)) == r
    with pytest.raises(SpecError) as e:
        MlaDecodeSpec(box_lanes=True)
    assert e.value.field == "box_lanes" and "paged=false" in str(e.value)
    for bad, arch in ((dict(pipeline="sync"), "sm_90a"), (dict(), "sm_80"), (dict(page_rows=True), "sm_90a"),
                      (dict(kv_dtype="fp8_e4m3"), "sm_90a")):
        with pytest.raises(SpecError) as e:
            resolve(MlaDecodeSpec(q_rows=64, paged=True, box_lanes=True, **bad), arch)
        assert e.value.field == "box_lanes", (bad, arch)
        assert "TMA boxes" in str(e.value)


@pytest.mark.parametrize("text", ["mla_decode:q_rows=64,qk_shard=alternate,paged=true,box_lanes=true",
                                  "mla_decode:q_rows=64,paged=true,box_lanes=true,dtype=fp16,cluster_merge=true",
                                  "mla_decode:q_rows=32,paged=true,box_lanes=true",
                                  "mla_decode:q_rows=16,paged=true,box_lanes=true,cta_tile_kv=32,num_stages=4",
                                  "mla_decode:q_rows=16,paged=true,box_lanes=true,num_stages=1,num_warps=4,"
                                  "kv_lora_rank=256,rope_dim=32"])
def test_box_lanes_compile_spill_free(text, tmp_path, monkeypatch):
    """A real NVRTC compile of box_lanes forms for sm_90a (alternate tiles, the sharded wgmma kernel's cluster form,
    mma.sync at 32 and 16 rows, one to four stages): no spills, every entry in the cubin, and the kernel's template
    told so (MlaDecode's BOX_LANES)."""
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    from attngen.compiler import compile as nvrtc
    from attngen.render import render

    s = resolve(parse_spec(text), "sm_90a")
    src = render(s)
    assert "box_lanes=true" in src and ", false, true>;" in src
    b = nvrtc(src, "sm_90a", kernel_name=s.kernel_name, entries=s.entries, want_ptx=True)
    assert b.resources.known and (b.resources.spill_stores, b.resources.spill_loads) == (0, 0)
    for entry in s.entries:
        assert b".text." + entry.encode() + b"\x00" in b.cubin
    assert "serialized" not in b.log, b.log
