"""Decode family on the CPU: the spec, its fit rules, its module's entries, the split heuristic."""

from __future__ import annotations

import pytest

from attngen.arch import ARCHS
from attngen.compiler import compile
from attngen.errors import SpecError
from attngen.families.split_kv import MAX_SPLITS, choose_splits
from attngen.render import render
from attngen.spec import parse_spec, resolve, validate
from attngen import DecodeSpec, Variant


def test_text_form_round_trips_and_names_the_family():
    s = parse_spec("decode:head_dim=64,dtype=fp16,q_rows=32,paged=true,variant=unfused")
    assert isinstance(s, DecodeSpec)
    assert (s.head_dim, s.dtype.value, s.q_rows, s.paged, s.variant) == (64, "fp16", 32, True, Variant.UNFUSED)
    assert parse_spec(s.to_text()) == s
    assert parse_spec(s.to_dict()) == s
    assert s.kernel_name.startswith("attngen_decode_")


@pytest.mark.parametrize("field,value", [("head_dim", 100), ("q_rows", 8), ("variant", "split"),
                                         ("cta_tile_kv", 48), ("num_stages", 5), ("paged", "maybe")])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(SpecError) as ei:
        DecodeSpec(**{field: value})
    assert ei.value.field == field


@pytest.mark.parametrize("group,q_len,rows", [(1, 1, 16), (4, 1, 16), (16, 1, 16), (8, 4, 32), (16, 4, 64),
                                              (16, 8, 128), (3, 7, 32)])
def test_rows_for_packs_group_times_q_len(group, q_len, rows):
    assert DecodeSpec.rows_for(group, q_len) == rows


def test_rows_for_rejects_more_than_128_rows():
    with pytest.raises(SpecError) as ei:
        DecodeSpec.rows_for(16, 9)
    assert ei.value.field == "q_rows"


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_decode_spec_resolves_on_every_arch(arch):
    if not ARCHS[arch].has_mma_m16n8k16:
        pytest.skip("no mma.sync m16n8k16")
    for d in DecodeSpec.HEAD_DIMS:
        for rows in DecodeSpec.Q_ROWS:
            for paged in (False, True):
                for v in Variant:
                    if d == 512 and (v is Variant.UNFUSED or ARCHS[arch].smem_per_block < 144 * 1024):
                        # fused only; on the 99 KB archs 16 rows need a 64-key tile of K and V (128 KB)
                        if v is Variant.FUSED and rows == 16:
                            with pytest.raises(SpecError):
                                resolve(DecodeSpec(head_dim=d, q_rows=rows, paged=paged, variant=v), arch)
                        continue
                    r = resolve(DecodeSpec(head_dim=d, q_rows=rows, paged=paged, variant=v), arch)
                    assert r.is_resolved
                    assert r.smem_bytes() <= ARCHS[arch].smem_per_block
                    assert r.warps_m * r.warps_n == r.num_warps
                    assert r.cta_tile_kv // r.warps_n >= 16


@pytest.mark.parametrize("paged", [False, True])
def test_many_packed_rows_take_two_warps_across_the_keys(paged):
    # 64 packed rows at head_dim 128 (fused): 64x8x3 where it fits (TUNED_ROWS), the 16-row default elsewhere;
    # the unfused variant and 32 rows keep the head dim's list; 16 rows on a paged cache take 64x4x3 (TUNED_PLAIN).
    def cfg(rows, arch, variant=Variant.FUSED):
        r = resolve(DecodeSpec(head_dim=128, q_rows=rows, paged=paged, variant=variant), arch)
        return r.cta_tile_kv, r.num_warps, r.num_stages
    for arch in ("sm_80", "sm_90a", "sm_100"):
        assert cfg(64, arch) == (64, 8, 3)
        assert cfg(32, arch) == (64, 4, 4) and cfg(16, arch) == ((64, 4, 3) if paged else (64, 4, 4))
        assert cfg(64, arch, Variant.UNFUSED) != (64, 8, 3)
    for arch in ("sm_86", "sm_89", "sm_120"):  # 99 KB: three stages of 64 rows do not fit
        assert cfg(64, arch) == cfg(32, arch)


def test_a_packed_q_over_an_fp8_cache_takes_128_key_tiles_on_sm_90a():
    """The serving step's decode rows over an fp8 cache (head_dim 128, 32 rows, paged, sm_90a): two stages of 128-key
    tiles, before TUNED_VARLEN's 16-bit choice; the 16-bit cache, other archs and other head dims keep theirs."""
    def cfg(arch, d=128, **kw):
        r = resolve(DecodeSpec(head_dim=d, q_rows=32, paged=True, varlen_q=True, **kw), arch)
        return r.cta_tile_kv, r.num_warps, r.num_stages
    for kw in ({}, {"tree": True}, {"sinks": True}, {"local": True}):
        assert cfg("sm_90a", kv_dtype="fp8_e4m3", **kw) == (128, 4, 2), kw
    assert cfg("sm_90a") == (32, 4, 4)
    assert cfg("sm_80", kv_dtype="fp8_e4m3") != (128, 4, 2)
    assert cfg("sm_90a", d=112, kv_dtype="fp8_e4m3") != (128, 4, 2)


def test_a_warp_split_too_thin_names_cta_tile_kv():
    s = DecodeSpec(head_dim=128, q_rows=16, cta_tile_kv=32, num_warps=4, num_stages=2)
    with pytest.raises(SpecError) as ei:
        validate(s, "sm_90")
    assert ei.value.field == "cta_tile_kv" and "multiple of 64" in str(ei.value)


def test_too_much_shared_memory_names_num_stages():
    s = DecodeSpec(head_dim=256, q_rows=16, cta_tile_kv=64, num_warps=4, num_stages=4)
    with pytest.raises(SpecError) as ei:
        validate(s, "sm_86")
    assert ei.value.field == "num_stages" and "sm_86" in str(ei.value)


@pytest.mark.parametrize("variant,suffixes", [("fused", ("", "_merge")), ("unfused", ("", "_pv", "_merge"))])
def test_module_holds_every_entry(variant, suffixes):
    s = resolve(DecodeSpec(head_dim=128, variant=variant, paged=True), "sm_90")
    assert s.entries == tuple(s.kernel_name + x for x in suffixes)
    b = compile(render(s), "sm_90", kernel_name=s.kernel_name, entries=s.entries)
    for name in s.entries:
        assert b".text." + name.encode() + b"\x00" in b.cubin
    r = b.resources
    assert r.known and (r.spill_stores, r.spill_loads) == (0, 0)


def test_split_heuristic():
    sms, per = 132, 1
    # A grid that already fills the GPU is not split.
    assert choose_splits(64 * 8, 4096, 128, sms, per, 4 * 128 * 128, 4 * 64 * 1 * 32 * 128) == 1
    # One long sequence on 8 KV heads is spread over about every SM.
    s = choose_splits(1 * 8, 32768, 128, sms, per, 4 * 128 * 128, 4 * 1 * 1 * 32 * 128)
    assert 8 <= s <= 32 and 8 * s <= 2 * sms
    # Never more splits than tiles, never more than the cap.
    assert choose_splits(1 * 1, 100, 64, sms, per, 4 * 64 * 128, 4 * 1 * 1 * 8 * 128) <= 2
    assert choose_splits(1 * 1, 1 << 22, 16, 10000, 4, 4 * 16 * 128, 4 * 1 * 1 * 8 * 128) <= MAX_SPLITS
    # More SMs never mean fewer splits for the same problem.
    assert choose_splits(1 * 8, 32768, 128, 264, per, 4 * 128 * 128, 4 * 1 * 1 * 32 * 128) >= s


def test_saturating_share_from_the_drivers_memory(monkeypatch):
    """The share of SMs whose reads saturate the memory: peak bandwidth (2 x memory clock x bus width)
    over SM_STREAM_BYTES_PER_S an SM; 0.5 where the driver reports no memory clock."""
    from attngen.families import split_kv

    class Drv:
        def __init__(self, khz, bits):
            self.values = {split_kv.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: khz,
                           split_kv.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: bits}

        def attribute(self, attr, device):
            return self.values[attr]

    share = split_kv.saturating_share.__wrapped__
    monkeypatch.setattr(split_kv, "sm_count", lambda device: 132)
    for (khz, bits), want in (((2619000, 5120), 0.488), ((3200000, 6144), 0.716), ((0, 0), 0.5)):
        monkeypatch.setattr(split_kv, "driver", lambda: Drv(khz, bits))
        assert share(0) == pytest.approx(want, abs=2e-3), (khz, bits)


def test_cluster_weighed_against_the_merge_launch():
    """grid_steps decides where a cluster's capped split count pays (head_dim 128's 64-key tiles, 132 SMs, one
    CTA an SM), as measured: at batch 1 with 8 KV heads, a cluster of 8 at 1k keys on both GPUs; the merge launch's
    16 splits from 8k keys on an H200 (share 0.70), the cluster still at 32k on an H100 (0.49)."""
    from attngen.families.decode.choose import MERGE_LAUNCH_STEPS, grid_steps

    def cluster(keys, share):
        tiles = keys // 64
        return grid_steps(8, tiles, 8, 132, share) <= grid_steps(8, tiles, 16, 132, share) + MERGE_LAUNCH_STEPS

    assert cluster(1024, 0.70) and cluster(1024, 0.49)
    assert not cluster(8192, 0.70) and not cluster(32768, 0.70)
    assert cluster(32768, 0.49)


def test_spilling_configs_come_last():
    """A config SPILLS_ON lists for an arch is not a default there while another fits, a spec that pins it whole
    still gets it, and other archs keep it in its place: paged head_dim 64 at 64 rows on sm_90a (8 warps on
    128-key tiles spill there, 16 bytes)."""
    spec = DecodeSpec(head_dim=64, q_rows=64, paged=True)
    r = resolve(spec, "sm_90a")
    assert (r.cta_tile_kv, r.num_warps, r.num_stages) == (128, 4, 2)
    r = resolve(spec, "sm_80")
    assert (r.cta_tile_kv, r.num_warps, r.num_stages) == (128, 8, 2)
    r = resolve(spec.replace(cta_tile_kv=128, num_warps=8, num_stages=2), "sm_90a")
    assert (r.cta_tile_kv, r.num_warps, r.num_stages) == (128, 8, 2)
