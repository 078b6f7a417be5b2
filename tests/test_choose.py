"""The families' choice functions (attngen/families/<family>/choose.py), without a GPU: their decisions at the
measured rows as tables, and every kernel they choose for a manifest line within that line's expansion.

The tables were checked against the ops' launches before the choice moved out of them: on the stub driver
(tests/fake_cuda.py) the ops launched the same kernels with the same grids, clusters and parameters.
"""

from __future__ import annotations

import itertools

import pytest

from attngen.arch import get_arch
from attngen.families.choice import DeviceFacts
from attngen.families.decode import choose as D
from attngen.families.decode.spec import DecodeSpec, KVDType
from attngen.families.merge import choose as G
from attngen.families.mla_decode import choose as M
from attngen.families.mla_decode.spec import MlaDecodeSpec
from attngen.families.prefill import choose as P
from attngen.families.prefill.spec import MaskMode, PrefillSpec
from attngen.manifest import expand, load_manifest, manifest_from_dict
from attngen.spec import resolve


def facts(arch: str, share: float = 0.7, per_sm: int = 1) -> DeviceFacts:
    """An H200-like sm_90a (132 SMs; clusters of up to 8, 120 CTAs of them at once), or 108 SMs elsewhere
    (no clusters); ``per_sm`` CTAs of every kernel an SM."""
    a = get_arch(arch)
    if a.major == 9:
        return DeviceFacts(a, 132, share, lambda s, e="": per_sm, lambda s, n: 120 // n if n <= 8 else 0)
    return DeviceFacts(a, 108, share, lambda s, e="": per_sm)


def ptiles(s):
    t = f"{s.cta_tile_q}x{s.cta_tile_kv} w{s.num_warps} s{s.num_stages}"
    t += f" {s.mma.value} {s.pipeline.value} {s.schedule.value}"
    return t + (" persistent" if s.is_persistent else "")


def dtiles(s):
    return f"q{s.q_rows} kv{s.cta_tile_kv} w{s.num_warps} s{s.num_stages}"


def mtiles(s):
    return (f"q{s.q_rows} {s.qk_shard.value} kv{s.cta_tile_kv} w{s.num_warps} s{s.num_stages} {s.mma.value} "
            f"{s.pipeline.value}" + (" clmerge" if s.cluster_merge else ""))


PREFILL = [
    ("sm_80", 64, "none", 2048, "64x64 w4 s3 mma_sync sync serial", (32, 16, 2)),
    ("sm_80", 64, "causal", 1024, "64x64 w4 s3 mma_sync sync serial", (16, 16, 2)),
    ("sm_80", 128, "none", 512, "64x64 w4 s3 mma_sync sync serial", (8, 16, 2)),
    ("sm_80", 256, "none", 1024, "128x32 w8 s2 mma_sync sync serial", (8, 16, 2)),
    ("sm_80", 256, "causal", 2048, "128x32 w8 s2 mma_sync sync serial", (16, 16, 2)),
    ("sm_80", 192, "causal", 4096, "128x32 w8 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_80", 96, "sliding_window", 4096, "128x64 w8 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_86", 64, "none", 2048, "64x64 w4 s3 mma_sync sync serial", (32, 16, 2)),
    ("sm_86", 64, "causal", 1024, "64x64 w4 s3 mma_sync sync serial", (16, 16, 2)),
    ("sm_86", 128, "none", 512, "128x64 w8 s2 mma_sync sync serial", (4, 16, 2)),
    ("sm_86", 256, "none", 1024, "64x32 w4 s2 mma_sync sync serial", (16, 16, 2)),
    ("sm_86", 256, "causal", 2048, "64x32 w4 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_86", 192, "causal", 4096, "128x32 w8 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_86", 96, "sliding_window", 4096, "128x64 w8 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_90a", 64, "none", 2047, "128x128 w8 s2 wgmma tma pingpong persistent", (132, 1, 1)),
    ("sm_90a", 64, "none", 2048, "192x128 w12 s2 wgmma tma pingpong", (11, 16, 2)),
    ("sm_90a", 64, "causal", 1023, "64x64 w4 s4 wgmma sync serial", (16, 16, 2)),
    ("sm_90a", 64, "causal", 1024, "128x128 w8 s2 wgmma tma pingpong persistent", (128, 1, 1)),
    ("sm_90a", 64, "causal", 8191, "128x128 w8 s2 wgmma tma pingpong persistent", (132, 1, 1)),
    ("sm_90a", 64, "causal", 8192, "192x128 w12 s2 wgmma tma pingpong", (43, 16, 2)),
    ("sm_90a", 128, "none", 512, "128x128 w8 s2 wgmma tma pingpong persistent", (64, 1, 1)),
    ("sm_90a", 128, "causal", 767, "64x64 w4 s2 wgmma tma serial persistent", (132, 1, 1)),
    ("sm_90a", 128, "causal", 768, "128x128 w8 s2 wgmma tma pingpong persistent", (96, 1, 1)),
    ("sm_90a", 256, "none", 1023, "128x64 w8 s2 wgmma tma serial", (8, 16, 2)),
    ("sm_90a", 256, "none", 1024, "128x80 w8 s2 wgmma tma pingpong", (8, 16, 2)),
    ("sm_90a", 256, "causal", 2047, "128x64 w8 s2 wgmma tma serial", (16, 16, 2)),
    ("sm_90a", 256, "causal", 2048, "128x80 w8 s2 wgmma tma pingpong persistent", (132, 1, 1)),
    ("sm_90a", 192, "causal", 4096, "128x64 w8 s2 wgmma tma serial persistent", (132, 1, 1)),
    ("sm_90a", 96, "sliding_window", 4096, "128x64 w8 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_120", 64, "none", 2048, "64x64 w4 s3 mma_sync sync serial", (32, 16, 2)),
    ("sm_120", 64, "causal", 1024, "64x64 w4 s3 mma_sync sync serial", (16, 16, 2)),
    ("sm_120", 128, "none", 512, "128x64 w8 s2 mma_sync sync serial", (4, 16, 2)),
    ("sm_120", 256, "none", 1024, "64x32 w4 s2 mma_sync sync serial", (16, 16, 2)),
    ("sm_120", 256, "causal", 2048, "64x32 w4 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_120", 192, "causal", 4096, "128x32 w8 s2 mma_sync sync serial", (32, 16, 2)),
    ("sm_120", 96, "sliding_window", 4096, "128x64 w8 s2 mma_sync sync serial", (32, 16, 2)),
]
DECODE = [
    ("sm_90a", 0.7, 128, 1, 32, 8, 1, 4096, False, "q16 kv64 w4 s4", 8, 8, False),
    ("sm_90a", 0.7, 128, 1, 32, 8, 1, 32768, False, "q16 kv64 w4 s4", 16, 0, True),
    ("sm_90a", 0.7, 128, 4, 64, 4, 4, 16384, False, "q64 kv64 w8 s3", 8, 0, True),
    ("sm_90a", 0.7, 64, 1, 8, 8, 16, 8192, True, "q16 kv128 w8 s2", 1, 0, False),
    ("sm_90a", 0.7, 256, 1, 16, 1, 64, 2048, False, "q16 kv64 w4 s2", 2, 0, True),
    ("sm_90a", 0.7, 128, 1, 32, 8, 64, 8192, True, "q16 kv64 w4 s3", 1, 0, False),
    ("sm_90a", 0.7, 128, 1, 32, 8, 16, 4096, False, "q16 kv64 w4 s4", 1, 0, False),
    ("sm_90a", 0.49, 128, 1, 32, 8, 1, 4096, False, "q16 kv64 w4 s4", 8, 8, False),
    ("sm_90a", 0.49, 128, 1, 32, 8, 1, 32768, False, "q16 kv64 w4 s4", 8, 8, False),
    ("sm_90a", 0.49, 128, 4, 64, 4, 4, 16384, False, "q64 kv64 w8 s3", 8, 0, True),
    ("sm_90a", 0.49, 64, 1, 8, 8, 16, 8192, True, "q16 kv128 w8 s2", 1, 0, False),
    ("sm_90a", 0.49, 256, 1, 16, 1, 64, 2048, False, "q16 kv64 w4 s2", 2, 0, True),
    ("sm_90a", 0.49, 128, 1, 32, 8, 64, 8192, True, "q16 kv64 w4 s3", 1, 0, False),
    ("sm_90a", 0.49, 128, 1, 32, 8, 16, 4096, False, "q16 kv64 w4 s4", 1, 0, False),
    ("sm_80", 0.5, 128, 1, 32, 8, 1, 4096, False, "q16 kv64 w4 s4", 13, 0, True),
    ("sm_80", 0.5, 128, 1, 32, 8, 1, 32768, False, "q16 kv64 w4 s4", 13, 0, True),
    ("sm_80", 0.5, 128, 4, 64, 4, 4, 16384, False, "q64 kv64 w8 s3", 6, 0, True),
    ("sm_80", 0.5, 64, 1, 8, 8, 16, 8192, True, "q16 kv128 w8 s2", 4, 0, True),
    ("sm_80", 0.5, 256, 1, 16, 1, 64, 2048, False, "q16 kv64 w4 s2", 3, 0, True),
    ("sm_80", 0.5, 128, 1, 32, 8, 64, 8192, True, "q16 kv64 w4 s3", 4, 0, True),
    ("sm_80", 0.5, 128, 1, 32, 8, 16, 4096, False, "q16 kv64 w4 s4", 4, 0, True),
]
MLA = [
    ("sm_90a", 0.7, 16, 1, 32768, False, 0, "q16 true kv64 w8 s2 mma_sync tma", 128, 0, True, '_merge_wide'),
    ("sm_90a", 0.7, 16, 64, 8192, False, 0, "q16 true kv64 w4 s1 mma_sync tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.7, 16, 256, 8192, True, 64, "q16 true kv64 w4 s1 mma_sync tma", 1, 0, False, None),
    ("sm_90a", 0.7, 32, 64, 8192, False, 0, "q64 alternate kv64 w8 s2 wgmma tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.7, 32, 64, 8192, True, 48, "q32 true kv64 w8 s2 mma_sync tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.7, 64, 64, 8192, False, 0, "q64 alternate kv64 w8 s2 wgmma tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.7, 64, 8, 8192, False, 0, "q64 true kv64 w8 s2 wgmma tma", 16, 0, True, '_merge_fine'),
    ("sm_90a", 0.7, 128, 8, 32768, False, 0, "q64 alternate kv64 w8 s2 wgmma tma", 8, 0, False, '_merge'),
    # on fast memory, two row blocks and the keys not split: alternate tiles from 8 tiles a CTA; split, from 32
    ("sm_90a", 0.7, 128, 64, 1024, False, 0, "q64 alternate kv64 w8 s2 wgmma tma", 1, 0, False, None),
    ("sm_90a", 0.7, 128, 128, 512, False, 0, "q64 alternate kv64 w8 s2 wgmma tma", 1, 0, False, None),
    ("sm_90a", 0.7, 128, 128, 256, False, 0, "q64 true kv64 w8 s2 wgmma tma", 1, 0, False, None),
    ("sm_90a", 0.7, 128, 8, 8192, False, 0, "q64 true kv64 w8 s2 wgmma tma", 8, 0, True, '_merge'),
    ("sm_90a", 0.5, 128, 64, 1024, False, 0, "q64 true kv64 w8 s2 wgmma tma", 1, 0, False, None),
    # one row block (64 heads) stays sharded below 32 tiles
    ("sm_90a", 0.7, 64, 128, 512, False, 0, "q64 true kv64 w8 s2 wgmma tma", 1, 0, False, None),
    # the row blocks fill 0.4 of the SMs and every cluster of their splits is resident: the cluster_merge kernel
    ("sm_90a", 0.7, 128, 28, 1024, False, 0, "q64 true kv64 w8 s2 wgmma tma clmerge", 2, 2, False, None),
    ("sm_90a", 0.7, 64, 56, 1024, True, 64, "q64 true kv64 w8 s2 wgmma tma clmerge", 2, 2, False, None),
    ("sm_90a", 0.49, 16, 1, 32768, False, 0, "q16 true kv64 w8 s2 mma_sync tma", 128, 0, True, '_merge_wide'),
    ("sm_90a", 0.49, 16, 64, 8192, False, 0, "q16 true kv64 w8 s2 mma_sync tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.49, 16, 256, 8192, True, 64, "q16 true kv64 w8 s2 mma_sync tma", 1, 0, False, None),
    ("sm_90a", 0.49, 32, 64, 8192, False, 0, "q32 true kv64 w8 s2 mma_sync tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.49, 32, 64, 8192, True, 48, "q32 true kv64 w8 s2 mma_sync tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.49, 64, 64, 8192, False, 0, "q64 true kv64 w8 s2 wgmma tma", 2, 0, False, '_merge'),
    ("sm_90a", 0.49, 64, 8, 8192, False, 0, "q64 true kv64 w8 s2 wgmma tma", 16, 0, True, '_merge_fine'),
    ("sm_90a", 0.49, 128, 8, 32768, False, 0, "q64 alternate kv64 w8 s2 wgmma tma", 8, 0, False, '_merge'),
    ("sm_90a", 0.49, 128, 64, 1024, False, 0, "q64 true kv64 w8 s2 wgmma tma", 1, 0, False, None),
    ("sm_80", 0.5, 16, 1, 32768, False, 0, "q16 true kv32 w4 s2 mma_sync sync", 103, 0, False, '_merge_fine'),
    ("sm_80", 0.5, 16, 64, 8192, False, 0, "q16 true kv32 w4 s2 mma_sync sync", 5, 0, False, '_merge'),
    ("sm_80", 0.5, 16, 256, 8192, True, 64, "q16 true kv32 w4 s2 mma_sync sync", 2, 0, False, '_merge'),
    ("sm_80", 0.5, 64, 64, 8192, False, 0, "q64 false kv32 w8 s2 mma_sync sync", 3, 0, False, '_merge'),
    ("sm_80", 0.5, 64, 8, 8192, False, 0, "q64 false kv32 w8 s2 mma_sync sync", 13, 0, False, '_merge'),
    ("sm_86", 0.5, 16, 1, 32768, False, 0, "q16 false kv64 w8 s1 mma_sync sync", 103, 0, False, '_merge_fine'),
    ("sm_86", 0.5, 16, 64, 8192, False, 0, "q16 false kv64 w8 s1 mma_sync sync", 5, 0, False, '_merge'),
    ("sm_86", 0.5, 16, 256, 8192, True, 64, "q16 false kv64 w8 s1 mma_sync sync", 2, 0, False, '_merge'),
    ("sm_86", 0.5, 64, 64, 8192, False, 0, "q64 false kv16 w8 s1 mma_sync sync", 3, 0, False, '_merge'),
    ("sm_86", 0.5, 64, 8, 8192, False, 0, "q64 false kv16 w8 s1 mma_sync sync", 13, 0, False, '_merge'),]


@pytest.mark.parametrize("arch, d, mask, rows, tiles, grid", PREFILL)
def test_prefill_choice_at_the_measured_rows(arch, d, mask, rows, tiles, grid):
    """bf16, 16 heads, batch 2, no spec and no tuned winner: sm_90a's rule by rows switches at its bounds."""
    c = P.choose(P.Problem(d, "bf16", MaskMode(mask), rows=rows, heads=16, batch=2), facts(arch))
    assert (ptiles(c.spec), c.launch.grid) == (tiles, grid)
    assert c.launch.persistent == c.spec.is_persistent


@pytest.mark.parametrize("arch, share, d, q_len, h, hk, b, cap, paged, tiles, splits, cluster, merged", DECODE)
def test_decode_choice(arch, share, d, q_len, h, hk, b, cap, paged, tiles, splits, cluster, merged):
    c = D.choose(D.Problem(d, "bf16", q_len, h, hk, b, cap, paged), facts(arch, share))
    lc = c.launch
    assert (dtiles(c.spec), lc.num_splits, lc.cluster, lc.merge_grid is not None) == (tiles, splits, cluster, merged)
    assert lc.grid == (splits, hk, b)


@pytest.mark.parametrize("arch, share, h, b, cap, paged, bs, tiles, splits, cluster, evict, merge", MLA)
def test_mla_decode_choice(arch, share, h, b, cap, paged, bs, tiles, splits, cluster, evict, merge):
    """512 + 64, one token: 32 rows as a 64-row wgmma block, one stage and alternate tiles only on fast memory
    (share 0.7, not 0.49) where the sizes call for them; the 99 KB archs (sm_86) unsharded, one stage."""
    c = M.choose(M.Problem(512, 64, "bf16", 1, h, b, cap, paged, bs), facts(arch, share))
    lc = c.launch
    assert (mtiles(c.spec), lc.num_splits, lc.cluster, lc.evict_first, lc.merge_entry) == (
        tiles, splits, cluster, evict, merge)


def test_prefill_tuned_winners_and_a_callers_spec():
    """Stored winners replace the default and its rule by rows, by the nearest tuned length (log distance); a
    caller's spec is resolved and runs every length."""
    a = get_arch("sm_90a")
    small = resolve(PrefillSpec(head_dim=64, mask="causal", cta_tile_q=64, cta_tile_kv=32, num_warps=4,
                                num_stages=2, mma="mma_sync"), a)
    big = resolve(PrefillSpec(head_dim=64, mask="causal", cta_tile_q=128, cta_tile_kv=64, num_warps=8,
                              num_stages=2, mma="mma_sync"), a)
    tuned = [(512, small), (4096, big)]
    for rows, want in ((100, small), (1447, small), (1449, big), (20000, big)):  # sqrt(512 * 4096) = 1448.2
        assert P.choose(P.Problem(64, mask=MaskMode.CAUSAL, rows=rows), facts("sm_90a"), tuned).spec == want
    user = PrefillSpec(num_warps=4)
    for rows in (100, 20000):
        c = P.choose(P.Problem(64, mask=MaskMode.CAUSAL, rows=rows, spec=user), facts("sm_90a"), tuned)
        assert c.spec == resolve(PrefillSpec(head_dim=64, mask="causal", num_warps=4), a)


def test_prefill_launch_plans():
    f = facts("sm_90a", per_sm=2)
    persistent = P.choose(P.Problem(128, rows=4096, heads=32, batch=4), f)
    assert persistent.launch == P.Launch((264, 1, 1), True)  # 132 SMs x 2, below 16 x 32 x 4 units
    few = P.choose(P.Problem(128, rows=300, heads=2, batch=1), f)
    assert few.launch.grid == (2 * 1 * 2, 1, 1)  # 3 tiles: 2 units a head
    varlen = P.choose(P.Problem(128, layout=P.VARLEN, rows=1000, heads=8, batch=3), f)
    assert varlen.launch.grid == (-(-1000 // varlen.spec.cta_tile_q) + 3, 8, 1)
    assert P.choose(P.Problem(128, layout=P.CUSTOM_MASK, rows=1000), f).launch.grid == ()
    chunked = P.choose(P.Problem(768, rows=1000, heads=4, batch=2), facts("sm_80"))
    assert chunked.launch.grid == (-(-1000 // chunked.spec.cta_tile_q), 4 * chunked.spec.v_splits, 2)
    three = P.choose(P.Problem(64, rows=4096), f).spec
    assert three.num_warps == 12
    twin = P.sync_twin(three)
    assert (twin.cta_tile_q, twin.num_warps, twin.pipeline.value, twin.persistent.value) == (128, 8, "sync", "false")


def test_decode_forced_splits_and_the_cluster_setting():
    f = facts("sm_90a")
    p = D.Problem(128, q_len=1, heads=32, kv_heads=8, batch=1, capacity=4096, num_splits=4)
    assert (D.choose(p, f).launch.num_splits, D.choose(p, f).launch.cluster) == (4, 4)
    off = D.Problem(128, q_len=1, heads=32, kv_heads=8, batch=1, capacity=4096, num_splits=4, cluster_max=0)
    lc = D.choose(off, f).launch
    assert (lc.cluster, lc.merge_grid) == (0, (-(-32 // 4), 1, 1))
    unfused = D.choose(D.Problem(128, heads=32, kv_heads=8, capacity=4096, variant="unfused", num_splits=4), f)
    assert unfused.spec.variant.value == "unfused" and unfused.launch.cluster == 0


def test_decode_short_rows_on_a_full_grid_take_one_split_on_sm_90():
    # b16 x 8 KV heads = 128 CTAs (over 90% of 132 SMs) of 1024 keys: one split on sm_90, where the cost model, at 2
    # or 3 CTAs an SM, splits; past 1024 keys (2048 for a 16-bit cache at head dim 128), on a grid under 90% of the
    # SMs and elsewhere the cost model decides
    from attngen.families.split_kv import choose_splits

    def splits(arch, batch, cap, paged=True, kv=None, d=128):
        p = D.Problem(d, "bf16", 1, 32, 8, batch, cap, paged, kv_dtype=kv)
        return D.choose(p, facts(arch, per_sm=3)).launch

    for paged in (False, True):
        assert splits("sm_90a", 16, 2048, paged).num_splits == 1
        assert splits("sm_90a", 16, 2049, paged).num_splits > 1
        assert splits("sm_90a", 16, 1025, paged, KVDType.FP8_E4M3).num_splits > 1
        assert splits("sm_90a", 16, 1025, paged, d=64).num_splits > 1
        assert splits("sm_90a", 16, 1024, paged, d=64).num_splits == 1

    for kv in (None, KVDType.FP8_E4M3):
        for paged in (False, True):
            lc = splits("sm_90a", 16, 1024, paged, kv)
            assert (lc.num_splits, lc.cluster, lc.merge_grid) == (1, 0, None)
            assert splits("sm_90a", 128, 1024, paged, kv).num_splits == 1
    assert choose_splits(128, 1024, 64, 132, 3, 4 * 64 * 128, 4 * 16 * 32 * 128) > 1  # what the rule overrides
    assert splits("sm_90a", 14, 1024).num_splits > 1  # 112 CTAs: under 90% of the SMs
    c80 = D.choose(D.Problem(128, "bf16", 1, 32, 8, 16, 1024, True), facts("sm_80", per_sm=3))
    n = c80.spec.cta_tile_kv
    assert c80.launch.num_splits == choose_splits(128, 1024, n, 108, 3, 4 * n * 128, 4 * 16 * 32 * 128) > 1


def test_mla_decode_pins_and_a_refused_map():
    """A pinned field turns off the rules that would change it; a refused TMA map runs the cp.async form of the
    same tiles."""
    f = facts("sm_90a")
    wide = M.Problem(heads=32, batch=64, capacity=8192)
    assert M.choose(wide, f).spec.q_rows == 64
    pinned = M.Problem(heads=32, batch=64, capacity=8192, spec=MlaDecodeSpec(num_warps=8))
    assert M.choose(pinned, f).spec.q_rows == 32
    one = M.Problem(heads=16, batch=64, capacity=8192)
    assert M.choose(one, f).spec.num_stages == 1
    refused = M.choose(M.refused(one), f).spec
    assert (refused.pipeline.value, refused.num_stages, refused.cta_tile_kv) == ("sync", 2, 64)
    alt = M.Problem(heads=128, batch=8, capacity=32768)
    assert M.choose(alt, f).spec.qk_shard.value == "alternate"
    shard = M.Problem(heads=128, batch=8, capacity=32768, spec=MlaDecodeSpec(qk_shard="true"))
    assert M.choose(shard, f).spec.qk_shard.value == "true"
    # the cluster_merge form: not where the caller pins a tuning field (the merge launch then), nor over fp8 tiles;
    # a caller's cluster_merge spec merges in a cluster where one fits
    cl = dict(heads=128, batch=28, capacity=1024)
    for kw in (dict(spec=MlaDecodeSpec(qk_shard="true")), dict(kv_dtype=KVDType.FP8_E4M3)):
        c = M.choose(M.Problem(**cl, **kw), f)
        assert (c.spec.cluster_merge, c.launch.cluster, c.launch.merge_entry) == (False, 0, "_merge")
    c = M.choose(M.Problem(**cl, spec=MlaDecodeSpec(cluster_merge=True, qk_shard="true")), f)
    assert (c.spec.cluster_merge, c.launch.cluster, c.launch.merge_entry) == (True, 2, None)


# --- every choice for a manifest line is in that line's expansion ---------------------------------------------

ROWS = (1, 100, 511, 767, 768, 1023, 1024, 2047, 2048, 4096, 8191, 8192, 16383, 16384, 100000)


def _pinned(spec) -> bool:
    return any(getattr(spec, f) for f in spec.TUNING_FIELDS)


def _users(spec):
    """The callers' specs a line stands for: its own where it pins a tuning field; else none, or one pinning
    nothing."""
    return (spec,) if _pinned(spec) else (None, type(spec)())


def prefill_problems(s: PrefillSpec):
    layout = (P.CUSTOM_MASK if s.custom_mask else P.VARLEN_PAGE_ROWS if s.page_rows else P.VARLEN_PAGED if s.paged
              else P.VARLEN if s.varlen else P.DENSE)
    users = _users(s)
    if s.qkv_dtype or s.kv_dtype:  # fp8 operands: the ops pass a spec naming them (fp8_op.py) as the caller's
        users = (s,) if _pinned(s) else (PrefillSpec(head_dim=s.head_dim, varlen=s.varlen, qkv_dtype=s.qkv_dtype,
                                                     kv_dtype=s.kv_dtype),)
    for user, rows, (h, b) in itertools.product(users, ROWS, ((8, 1), (32, 4))):
        yield P.Problem(s.head_dim, s.dtype.value, s.mask, s.head_dim_v, s.return_lse, s.softcap, s.alibi, layout,
                        user, rows, h, b)


def decode_problems(s: DecodeSpec):
    shapes = [(g, q) for g in (1, 2, 4, 8, 16) for q in range(1, 9) if DecodeSpec.rows_for(g, q) == s.q_rows]
    variants = ("auto", "fused") if s.variant.value == "fused" else (s.variant.value,)
    for user, (g, q), v, hk, (b, cap) in itertools.product(_users(s), shapes[:3], variants, (1, 8),
                                                          ((1, 512), (1, 65536), (16, 8192), (128, 2048))):
        yield D.Problem(s.head_dim, s.dtype.value, q, g * hk, hk, b, cap, s.paged, v, user, s.softcap, s.alibi,
                        kv_dtype=s.kv_dtype, page_rows=s.page_rows, varlen_q=s.varlen_q, tree=s.tree)


def mla_problems(s: MlaDecodeSpec):
    shapes = [(h, q) for h in (1, 8, 16, 24, 32, 48, 64, 96, 128) for q in (1, 2, 4)
              if MlaDecodeSpec.rows_for(h, q) == s.q_rows]
    blocks = (1, 24) if s.page_rows else (64, 48, 256) if s.paged else (0,)
    for user, (h, q), bs, (b, cap) in itertools.product(_users(s), shapes, blocks,
                                                        ((1, 1024), (1, 65536), (8, 32768), (64, 8192), (512, 4096))):
        yield M.Problem(s.kv_lora_rank, s.rope_dim, s.dtype.value, q, h, b, cap, s.paged, bs, user,
                        kv_dtype=s.kv_dtype, page_rows=s.page_rows)


def merge_problems(s):
    for tokens, heads in ((1, 1), (7, 32), (4096, 64)):
        yield G.Problem(s.head_dim, s.dtype.value, s.states.value, tokens, heads)


PROBLEMS = {"prefill": (P, prefill_problems), "decode": (D, decode_problems), "mla_decode": (M, mla_problems),
            "merge": (G, merge_problems)}


def _check_line(table: dict, archs: list[str]) -> int:
    m = manifest_from_dict({"archs": archs, "kernel": [table]})
    items = expand(m)
    built = {(resolve(s, a), a.name) for s, a in items}
    n = 0
    for s in m.groups[0].specs:
        mod, problems = PROBLEMS[s.family]
        for arch in archs:
            for f in (facts(arch, 0.7), facts(arch, 0.49, per_sm=2)):
                for p in problems(s):
                    spec = mod.choose(p, f).spec
                    assert (spec, arch) in built, (table, arch, p, spec.to_text())
                    n += 1
    return n


def test_a_users_line_covers_the_rows_the_op_takes():
    """The issue's example: prefill head_dim=128 mask=causal for sm_90a builds the 64-row kernel too, which calls
    under 768 query rows run."""
    items = expand(manifest_from_dict({"archs": ["sm_90a"], "kernel": [
        {"family": "prefill", "head_dim": 128, "mask": "causal"}]}))
    short = P.choose(P.Problem(128, mask=MaskMode.CAUSAL, rows=500), facts("sm_90a")).spec
    assert short.cta_tile_q == 64 and short in {resolve(s, a) for s, a in items} and len(items) == 2
    assert _check_line({"family": "prefill", "head_dim": 128, "mask": "causal"}, ["sm_90a"]) > 0


def test_every_choice_for_a_default_manifest_line_is_in_its_expansion():
    m = load_manifest(None)
    sm90 = {"sm_90a"}
    total = 0
    for g in m.groups:
        archs = [a.name for a in (g.archs or m.archs)]
        # every line on sm_90a, where the ops choose by size; the rest on one other arch (one kernel a line there)
        picked = [a for a in archs if a in sm90] + [a for a in archs if a not in sm90][:1]
        for values in itertools.product(*[v if isinstance(v, list) else [v] for v in g.fields.values()]):
            table = dict(zip(g.fields, values))
            if table.get("dtype") == "fp16":  # (the choice does not depend on the dtype)
                continue
            total += _check_line(table, picked)
    assert total > 1000


def test_mla_decode_reachable_cluster_forms_fit_their_merge():
    """reachable lists a kernel's cluster_merge form only where choose could take it: its merge fits (never over the
    gather), so the manifest builds no kernel that no choice returns."""
    for paged, page_rows, rows in itertools.product((False, True), (False, True), (16, 32, 64)):
        if page_rows and not paged:
            continue
        out = M.reachable(MlaDecodeSpec(q_rows=rows, paged=paged, page_rows=page_rows), get_arch("sm_90a"))
        clusters = [s for s in out if s.cluster_merge]
        assert all(s.cluster_merge_fits() for s in clusters), clusters
        assert not any(s.gather for s in clusters)


def test_decode_local_kernels_split_only_a_windows_live_keys():
    """A window bounds the keys a row sees: the local kernel runs, and the split count is chosen for the
    live keys, not the cache's capacity."""
    f = facts("sm_90a")
    whole = D.choose(D.Problem(128, heads=32, kv_heads=8, batch=1, capacity=32768), f)
    local = D.choose(D.Problem(128, heads=32, kv_heads=8, batch=1, capacity=32768, local=True), f)
    window = D.choose(D.Problem(128, heads=32, kv_heads=8, batch=1, capacity=32768, local=True, live=192), f)
    assert not whole.spec.local and local.spec.local and window.spec.local
    assert local.launch.num_splits == whole.launch.num_splits, "unbounded on the left: the whole cache"
    assert 1 <= window.launch.num_splits < whole.launch.num_splits, (window.launch, whole.launch)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("heads", [16, 32, 128])
def test_mla_decode_page_rows_choice(arch, heads):
    """Paged blocks that are not a multiple of 16 (the op's page_rows, e.g. SGLang's page 1) take the page_rows
    kernels: on sm_90a the TMA ring gathered by a producer warpgroup, elsewhere the cp.async ring; alternate tiles
    where blocks of whole tiles take them (gathered by halves), never the 32-row widening (its blocks are whole tiles);
    blocks of 16 keep the TMA kernels' boxes at 16 rows and in alternate tiles (sharded 32 and 64 rows: below)."""
    f = facts(arch)
    alternates = 0
    for b, cap in ((1, 8192), (8, 4096), (128, 1024)):
        c = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, 1, page_rows=True), f)
        s = c.spec
        assert s.page_rows and s.gather == (arch == "sm_90a")
        assert s.q_rows == MlaDecodeSpec.rows_for(heads, 1)
        ref = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, 16), f)
        whole = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, 64), f)
        if s.q_rows == 64:
            assert s.alternate == whole.spec.alternate and c.launch.num_splits == whole.launch.num_splits
        alternates += s.alternate
        if arch == "sm_90a":
            assert ref.spec.tma and ref.spec.page_rows == (ref.spec.q_rows >= 32 and ref.spec.sharded)
        assert c.launch.row_blocks == -(-heads // s.q_rows)
    assert alternates == (1 if arch == "sm_90a" and heads == 128 else 0)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_mla_decode_blocks_of_16_rows_gathered(arch):
    """The sharded 32- and 64-row kernels on sm_90a's TMA ring, over blocks that cut a tile into 16-row boxes (16, 48):
    the gather, with the split count of the boxes' kernel, unless a cluster merges the splits; blocks of 32 and 64,
    alternate tiles, 16 rows, an fp8 cache, a pinned tuning field and other GPUs keep their kernels."""
    f = facts(arch)
    gathered = kept = 0
    for heads in (16, 32, 64, 128):
        for b, cap in ((1, 32768), (8, 8192), (32, 4096), (64, 8192), (128, 2048)):
            for kv in (None, KVDType.FP8_E4M3):
                boxes = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, 32, kv_dtype=kv), f)
                r = boxes.spec
                want = (arch == "sm_90a" and r.tma and r.q_rows >= 32 and r.sharded and not r.fp8
                        and not boxes.launch.cluster)
                for bs in (16, 48):
                    c = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, bs, kv_dtype=kv), f)
                    assert c.spec == (r.replace(box_lanes=False, page_rows=True) if want else r)
                    assert c.launch.num_splits == boxes.launch.num_splits
                    if want:
                        assert c.spec.gather and c.spec in M.reachable(MlaDecodeSpec(q_rows=r.q_rows, paged=True,
                                                                                     kv_dtype=kv), arch)
                        pin = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, bs,
                                                 MlaDecodeSpec(num_stages=2), kv_dtype=kv), f)
                        assert not pin.spec.page_rows
                gathered += want
                kept += not want
                assert not M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, 64, kv_dtype=kv),
                                    f).spec.page_rows
    assert kept and (gathered > 0) == (arch == "sm_90a")


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_mla_decode_one_stage_gather(arch):
    """16 rows with many tiles an SM on fast memory: the one-stage form, two CTAs an SM. Over blocks that are not
    whole 64-key tiles (1, 16, 48) that form is the gather (page_rows); over whole tiles the TMA boxes'; with few
    tiles, or a caller's pinned tuning field, blocks of 16 keep the two-stage TMA boxes (sm_90a only: elsewhere the
    cp.async ring, page_rows only where the op asks)."""
    f = facts(arch)
    for bs in (1, 16, 48, 64):
        many = M.choose(M.Problem(512, 64, "bf16", 1, 16, 128, 4096, True, bs, page_rows=bs % 16 != 0), f).spec
        few = M.choose(M.Problem(512, 64, "bf16", 1, 16, 4, 8192, True, bs, page_rows=bs % 16 != 0), f).spec
        pinned = M.choose(M.Problem(512, 64, "bf16", 1, 16, 128, 4096, True, bs, MlaDecodeSpec(mma="mma_sync"),
                                    page_rows=bs % 16 != 0), f).spec
        if arch != "sm_90a":
            assert not many.tma and many.page_rows == (bs % 16 != 0) and not many.two_ctas()
            continue
        assert (many.num_stages, many.num_warps, many.tma) == (1, 4, True)
        assert many.gather == many.two_ctas() == (bs != 64)
        assert few.num_stages == 2 and few.gather == (bs % 16 != 0)
        assert pinned.page_rows == (bs % 16 != 0) and pinned.num_stages == (2 if bs in (16, 48) else 1)
        # between GATHER_ONE_STAGE_MIN_TILES and ONE_STAGE_MIN_TILES tiles an SM (8 x 8k: 7.8 on 132 SMs) only pages
        # that are not a multiple of 16 take one stage; below it (16 x 2k: 3.9) none
        mid = M.choose(M.Problem(512, 64, "bf16", 1, 16, 8, 8192, True, bs, page_rows=bs % 16 != 0), f).spec
        low = M.choose(M.Problem(512, 64, "bf16", 1, 16, 16, 2048, True, bs, page_rows=bs % 16 != 0), f).spec
        assert mid.num_stages == (1 if bs % 16 else 2) and mid.gather == (bs % 16 != 0) and low.num_stages == 2


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_mla_decode_box_lanes_for_blocks_smaller_than_a_tile(arch):
    """Paged blocks smaller than the kernel's tile on sm_90a's TMA ring (16, 32, 48 under 64-key tiles) take its
    box_lanes form, with the same split and cluster (the same tiles), whatever tuning field the caller pins; whole
    tiles, the gather, an fp8 cache and the cp.async ring keep theirs; every form taken is reachable."""
    f = facts(arch)
    taken = 0
    for heads in (16, 32, 64, 128):
        for b, cap in ((1, 32768), (8, 8192), (32, 4096), (128, 2048)):
            for kv in (None, KVDType.FP8_E4M3):
                for user in (None, MlaDecodeSpec(num_stages=2)):
                    whole = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, 64, user, kv_dtype=kv), f)
                    for bs in (16, 32, 48, 64, 128):
                        c = M.choose(M.Problem(512, 64, "bf16", 1, heads, b, cap, True, bs, user, kv_dtype=kv), f)
                        s = c.spec
                        want = s.tma and not s.page_rows and not s.fp8 and bs < s.cta_tile_kv
                        assert s.box_lanes == want, (heads, b, cap, bs, s.to_text())
                        if bs % 64 == 0:
                            assert c == whole
                        if want:
                            taken += 1
                            assert c.launch.num_splits == whole.launch.num_splits
                            assert s in M.reachable(MlaDecodeSpec(q_rows=s.q_rows, paged=True, **(
                                {"num_stages": 2} if user else {})), get_arch(arch))
    assert (taken > 0) == (arch == "sm_90a")
