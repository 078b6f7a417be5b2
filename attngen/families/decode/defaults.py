"""The decode family's per-arch defaults: measured configs first, then every allowed combination."""

from __future__ import annotations

import itertools

from ...arch import Arch

# Per (head_dim, paged): [(cta_tile_kv, num_warps, num_stages), ...] best first. From
# tools/sweep_decode.py: two stages of large tiles matched or beat deeper rings (head_dim 256 still
# comes from it). head_dim 128 contiguous from tools/probe_decode.py --configs (timed as a decode step):
# four stages of 64-key tiles keep a fast memory (an H200's) busy, where a two-stage ring of 128-key
# tiles fell behind cuDNN, and cost nothing on slower memory. head_dim 128 paged and head_dim 64 from
# the same probe (--paged 64, once the paged loads lost their branches): paged at 128 as contiguous;
# at 64, 8 warps on 128-key tiles beat 4. head_dim 256 paged (once its copies stepped from each group's
# first row): two stages lead, deeper or shallower rings behind; 64x4x2 spills where SPILLS_ON says.
TUNED = {
    (64, False): [(128, 8, 2), (128, 4, 2), (64, 4, 2)],
    (64, True): [(128, 8, 2), (128, 4, 2), (64, 4, 3)],
    (128, False): [(64, 4, 4), (128, 4, 2), (64, 4, 2)],
    (128, True): [(64, 4, 4), (64, 4, 2)],
    (256, False): [(64, 4, 2), (32, 8, 2)],
    (256, True): [(64, 4, 2), (32, 8, 2)],
    # not measured: the one 16-row config whose accumulators (half the output columns a CTA) and one stage of
    # 64-key K and V tiles fit (sm_80, sm_90a, sm_100; not the 99 KB of shared memory of sm_86/89/120)
    (512, False): [(64, 4, 1)],
    (512, True): [(64, 4, 1)],
}

# Per (head_dim, paged, q_rows, variant): configs tried before TUNED's where the packed query rows change the best.
# 64 rows (e.g. q_len 4 x GQA 16) at head_dim 128: two warps across each tile's keys (64x8x3) beat the 64x4x4
# default on a contiguous and a paged cache, where each of four warps read the whole tile for its 16 rows. At 32 and
# 128 rows (contiguous) the defaults lead. The unfused variant: not measured.
# defaults led or came within 2%. The unfused variant: not measured.
TUNED_ROWS = {
    (128, False, 64, "fused"): [(64, 8, 3)],
    (128, True, 64, "fused"): [(64, 8, 3)],
}

# Per (head_dim, paged, q_rows) of the packed, ragged q (varlen_q), tried before TUNED_ROWS' and TUNED's: a serving
# step's decode requests (one token each) and verify requests (5 tokens) at 32 rows, GQA 32/8, 1k-32k keys, page 16
# (H200): 32-key tiles on 4 warps 1.46 ms, 128x8x2 1.84 ms, the 64x4x4 default 2.24 ms. Only this shape was measured.
TUNED_VARLEN = {
    (128, True, 32): [(32, 4, 4)],
    # That step's one-token requests in a launch of their own (BatchAttention splits them from the verify requests):
    # 16 rows, 64x4x3 1.25 ms, 64x4x2 1.27-1.29, 128x4x2 1.52, the 64x4x4 default 1.64 (one CTA an SM).
    (128, True, 16): [(64, 4, 3)],
}

# The same over an fp8 cache on sm_90a, tried before TUNED_VARLEN's: that step's decode and verify rows (attngen bench
# step --kv-dtype fp8_e4m3; H200): two stages of 128-key tiles 0.94 ms, 64x4x2 0.96 ms, the 32x4x4 16-bit choice 1.05
# ms. Only this shape was measured.
TUNED_VARLEN_FP8_SM90 = {
    (128, True, 32): [(128, 4, 2)],
}

# Per (head_dim, paged, q_rows) of a 16-bit cache and an unpacked q, tried before TUNED_ROWS' and TUNED's: paged
# head_dim 128 at 16 rows (GQA 32/8, tools/probe_decode.py --configs --paged 16 and 64, H200): a three-stage ring of
# 64-key tiles read 0.91-0.98 of the bare read at batch 16-128 x 1k-32k, 5-19% faster than the four-stage default
# it replaces there (pages of 16 and 64; at batch 1, pages of 16 1-3% faster, pages of 64 2-6% slower).
TUNED_PLAIN = {
    (128, True, 16): [(64, 4, 3)],
}

# Configs ptxas spills on some archs (NVRTC 13.5), per (head_dim, paged, q_rows, variant[, a modifier: "softcap",
# "alibi" or "local"]) and (cta_tile_kv, num_warps, num_stages). Every single-field pin (or none) of every head_dim,
# row count, layout and variant (bf16, no softcap or ALiBi) was compiled for every manifest arch. (Paged
# head_dim 256 at 16 rows, 64x4x2: the copies stepping from each 16-row group's first row hold one register more
# than ptxas has.)
SPILLS_ON = {
    ((64, False, 32, 'fused'), (64, 4, 1)): ('sm_80', 'sm_86', 'sm_89', 'sm_120'),
    ((64, False, 32, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((64, False, 32, 'fused'), (64, 4, 3)): ('sm_80', 'sm_86', 'sm_89'),
    ((64, False, 64, 'fused'), (32, 4, 3)): ('sm_90a',),
    ((64, False, 64, 'fused'), (32, 4, 4)): ('sm_90a',),
    ((64, False, 64, 'unfused'), (64, 4, 2)): ('sm_80', 'sm_86', 'sm_89'),
    ((64, True, 16, 'fused'), (64, 4, 1)): ('sm_90a',),
    ((64, True, 16, 'fused'), (64, 4, 3)): ('sm_80', 'sm_86', 'sm_89'),
    ((64, True, 16, 'fused'), (64, 4, 4)): ('sm_80', 'sm_86', 'sm_89'),
    ((64, True, 16, 'fused'), (128, 4, 2)): ('sm_90a',),
    ((64, True, 16, 'fused'), (128, 4, 3)): ('sm_80', 'sm_86', 'sm_89'),
    ((64, True, 16, 'fused'), (128, 4, 4)): ('sm_80',),
    ((64, True, 32, 'fused'), (64, 4, 1)): ('sm_80', 'sm_86', 'sm_89', 'sm_90a'),
    ((64, True, 32, 'fused'), (64, 4, 3)): ('sm_90a',),
    ((64, True, 32, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((64, True, 64, 'fused'), (128, 8, 2)): ('sm_90a',),
    ((128, True, 16, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((128, True, 16, 'fused'), (128, 4, 2)): ('sm_80', 'sm_90a'),
    ((128, True, 16, 'fused'), (128, 4, 3)): ('sm_90a',),
    ((256, False, 16, 'fused'), (64, 4, 3)): ('sm_90a',),
    ((256, False, 32, 'fused'), (32, 4, 3)): ('sm_80', 'sm_90a'),
    ((256, False, 32, 'fused'), (32, 4, 4)): ('sm_80', 'sm_90a'),
    ((256, True, 16, 'fused'), (64, 4, 2)): ('sm_80', 'sm_90a'),
    # with softcap or ALiBi (every default of every head_dim, row count, layout, variant, modifier and dtype compiled
    # for every manifest arch)
    ((64, False, 64, 'fused', 'softcap'), (128, 8, 2)): ('sm_90a',),
    ((128, False, 64, 'unfused', 'softcap'), (64, 4, 4)): ('sm_80',),
    ((256, True, 16, 'fused', 'alibi'), (64, 4, 3)): ('sm_90a',),
    # page_rows (a lookup a key row): the fused defaults of head_dim 64/128/256, q_rows 16 and 32, bf16 and fp16,
    # compiled for sm_80 and sm_90a
    ((256, True, 16, 'fused', 'page_rows'), (64, 4, 3)): ('sm_90a',),
    # with the local switch (window, left pad): the fused defaults of every head_dim, layout and q_rows 16 and 32,
    # bf16, compiled for sm_80 and sm_90a, 2026-11-29
    ((64, False, 32, 'fused', 'local'), (128, 8, 2)): ('sm_80', 'sm_90a'),
    ((64, True, 32, 'fused', 'local'), (128, 8, 2)): ('sm_80',),
    ((256, False, 16, 'fused', 'local'), (64, 4, 2)): ('sm_80', 'sm_90a'),
    # the head dims between the measured ones: the fused defaults of every new head_dim, layout and q_rows 16, 32 and
    # 64 for sm_80 and sm_90a, of 80/96/160/192 (the manifest's) at q_rows 16 and 32 for every manifest arch, and of
    # 512 at every q_rows for sm_80, sm_90a and sm_100, bf16, each resolved, compiled and listed here until it
    # compiled without spills; with the local switch, q_rows 16 of 40/80/96/160/192/200/512 for sm_80 and sm_90a
    ((32, False, 32, 'fused'), (128, 8, 2)): ('sm_80', 'sm_90a'),
    ((72, False, 16, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((72, True, 32, 'fused'), (64, 4, 2)): ('sm_80',),
    ((72, True, 32, 'fused'), (64, 4, 3)): ('sm_80',),
    ((72, True, 32, 'fused'), (64, 4, 4)): ('sm_80',),
    ((80, False, 32, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((80, True, 32, 'fused'), (64, 4, 2)): ('sm_80', 'sm_90a'),
    ((80, True, 32, 'fused'), (64, 4, 3)): ('sm_80', 'sm_90a'),
    ((80, True, 32, 'fused'), (64, 4, 4)): ('sm_80', 'sm_90a'),
    ((80, True, 64, 'fused'), (64, 8, 3)): ('sm_80',),
    ((88, False, 32, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((88, False, 64, 'fused'), (64, 8, 3)): ('sm_90a',),
    ((88, True, 32, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((88, True, 32, 'fused'), (64, 4, 3)): ('sm_90a',),
    ((88, True, 32, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((88, True, 64, 'fused'), (64, 8, 3)): ('sm_80',),
    ((96, False, 64, 'fused'), (64, 8, 3)): ('sm_90a',),
    ((104, False, 32, 'fused'), (64, 4, 4)): ('sm_80',),
    ((104, False, 64, 'fused'), (64, 8, 3)): ('sm_90a',),
    ((104, True, 16, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((104, True, 16, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((112, False, 16, 'fused'), (64, 4, 4)): ('sm_80',),
    ((112, False, 32, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((136, False, 64, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((136, True, 16, 'fused'), (64, 4, 2)): ('sm_80',),
    ((136, True, 16, 'fused'), (64, 4, 3)): ('sm_80',),
    ((136, True, 16, 'fused'), (64, 4, 4)): ('sm_80',),
    ((136, True, 64, 'fused'), (64, 4, 2)): ('sm_80', 'sm_90a'),
    ((144, False, 16, 'fused'), (64, 4, 2)): ('sm_80',),
    ((144, False, 32, 'fused'), (64, 4, 2)): ('sm_80',),
    ((152, True, 16, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((152, True, 16, 'fused'), (64, 4, 3)): ('sm_90a',),
    ((152, True, 16, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((152, True, 64, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((192, False, 32, 'fused'), (64, 4, 2)): ('sm_80', 'sm_90a'),
    ((192, False, 32, 'fused'), (64, 4, 3)): ('sm_80', 'sm_90a'),
    ((192, False, 32, 'fused'), (64, 4, 4)): ('sm_90a',),
    ((192, False, 64, 'fused'), (64, 4, 2)): ('sm_80', 'sm_90a'),
    ((192, True, 32, 'fused'), (64, 4, 2)): ('sm_80',),
    ((192, True, 64, 'fused'), (64, 4, 2)): ('sm_80',),
    ((200, True, 32, 'fused'), (64, 4, 2)): ('sm_90a',),
    ((240, False, 32, 'fused'), (64, 4, 2)): ('sm_80', 'sm_90a'),
    ((240, False, 32, 'fused'), (64, 4, 3)): ('sm_90a',),
    ((512, False, 64, 'fused'), (32, 8, 2)): ('sm_90a',),
    ((512, False, 128, 'fused'), (16, 8, 3)): ('sm_90a',),
    ((512, True, 64, 'fused'), (32, 8, 2)): ('sm_90a',),
    ((40, True, 16, 'fused', 'local'), (64, 4, 3)): ('sm_80',),
    ((40, True, 16, 'fused', 'local'), (64, 4, 4)): ('sm_80',),
    ((40, True, 16, 'fused', 'local'), (128, 4, 2)): ('sm_80',),
    ((40, True, 16, 'fused', 'local'), (128, 8, 2)): ('sm_80',),
    ((160, True, 16, 'fused', 'local'), (64, 4, 2)): ('sm_80',),
    ((160, True, 16, 'fused', 'local'), (64, 4, 3)): ('sm_80',),
    # a packed, ragged q (varlen_q; tree: with tree masks): the fused defaults of head_dim 64/128/256, both layouts,
    # every q_rows, bf16, compiled for sm_80 and sm_90a until they compiled without spills
    ((256, True, 16, 'fused', 'varlen'), (64, 4, 3)): ('sm_90a',),
    # (and once the packed kernels read batch_order: the contiguous head_dim 64 32-row default on sm_80, 4 bytes)
    ((64, False, 32, 'fused', 'varlen'), (128, 8, 2)): ('sm_80',),
    # and with an fp8 cache (fp8_varlen, fp8_tree; e4m3, bf16 q): the same, but for q_rows 128 on sm_80, whose fp8
    # defaults spill without a packed q too
    ((64, False, 32, 'fused', 'fp8_tree'), (128, 8, 2)): ('sm_80',),
    # the paged ones (BatchAttention's) compiled for every manifest arch, which it prewarms: head_dim 64/128/256, q_rows
    # 16/32/64, with and without a tree, 16-bit and e4m3 caches, bf16 q
    ((64, True, 32, 'fused', 'varlen'), (128, 8, 2)): ('sm_86', 'sm_89'),
    ((64, True, 32, 'fused', 'tree'), (128, 8, 2)): ('sm_100',),
    ((64, True, 64, 'fused', 'fp8_varlen'), (128, 8, 2)): ('sm_100',),
    # fp8 caches (kv_dtype; e4m3 with bf16 q, e5m2 with fp16 q): the fused defaults of head_dim 64/128/256, both
    # layouts, q_rows 16 and 32, and of 80-192 at 16 rows, compiled for every manifest arch until they compiled
    # without spills
    ((96, False, 16, 'fused', 'fp8'), (64, 4, 4)): ('sm_89',),
    # (and once the paged copies formed their offsets in 32 bits, templates/decode/fp8.cuh: 4 bytes on sm_80/sm_86;
    # the sm_90a 32-row default at 64x4x2 spills 24 bytes there, and stays: tests/test_spill_lists.py says why)
    ((64, True, 32, 'fused', 'fp8'), (128, 8, 2)): ('sm_80', 'sm_86'),
    ((128, True, 32, 'fused', 'fp8'), (64, 4, 4)): ('sm_90a',),
    ((144, True, 16, 'fused', 'fp8'), (64, 4, 1)): ('sm_80', 'sm_89', 'sm_90a'),
    ((144, True, 16, 'fused', 'fp8'), (64, 4, 2)): ('sm_80', 'sm_86', 'sm_89', 'sm_90a'),
    ((144, True, 16, 'fused', 'fp8'), (64, 4, 3)): ('sm_80', 'sm_86', 'sm_89', 'sm_90a'),
    ((144, True, 16, 'fused', 'fp8'), (64, 4, 4)): ('sm_80', 'sm_86', 'sm_89', 'sm_90a'),
    ((192, False, 16, 'fused', 'fp8'), (64, 4, 2)): ('sm_86',),
    ((192, True, 16, 'fused', 'fp8'), (64, 4, 1)): ('sm_80', 'sm_90a'),
    ((192, True, 16, 'fused', 'fp8'), (64, 4, 2)): ('sm_80', 'sm_120', 'sm_90a'),
    ((192, True, 16, 'fused', 'fp8'), (64, 4, 3)): ('sm_80', 'sm_120', 'sm_90a'),
    ((192, True, 16, 'fused', 'fp8'), (64, 4, 4)): ('sm_80', 'sm_90a'),
    ((192, True, 16, 'fused', 'fp8'), (128, 4, 3)): ('sm_90a',),
    ((192, True, 16, 'fused', 'fp8'), (128, 4, 4)): ('sm_90a',),
}


def measured_dim(head_dim: int) -> int:
    """The measured head dim whose tiles ``head_dim`` takes: the nearest one at or above it, so that a config
    that fits its rows (shared memory, accumulators) fits the narrower ones too."""
    return min(d for d, _ in TUNED if d >= head_dim)


def candidates(spec, arch: Arch):
    """(cta_tile_kv, num_warps, num_stages): tuned configs first, then every allowed combination; those SPILLS_ON
    lists for the arch last, so a default never takes one while another fits and a spec that pins one still gets
    it (spills cost speed, not results)."""
    where = (spec.head_dim, spec.paged, spec.q_rows, spec.variant.value)
    m = measured_dim(spec.head_dim)
    plain = not spec.varlen_q and spec.kv_dtype is None
    fp8_sm90 = spec.kv_dtype is not None and arch.has_wgmma
    # (at the measured head dim only: 96 and 112 spill its config with some modifiers)
    every = itertools.chain(TUNED_VARLEN_FP8_SM90.get(where[:3], ()) if spec.varlen_q and fp8_sm90 else (),
                            TUNED_VARLEN.get((m, *where[1:3]), ()) if spec.varlen_q else (),
                            TUNED_PLAIN.get((m, *where[1:3]), ()) if plain else (),
                            TUNED_ROWS.get((m, *where[1:]), ()),
                            TUNED[(m, spec.paged)],
                            itertools.product((64, 128, 32, 16), (4, 8), (4, 3, 2, 1)))
    keys = [where] + [(*where, mod) for mod in ("softcap", "alibi", "local", "page_rows") if getattr(spec, mod)]
    for mod, on in (("varlen", spec.varlen_q), ("tree", spec.tree)):
        if on:
            keys += [(*where, mod)] + ([(*where, "fp8_" + mod)] if spec.kv_dtype is not None else [])
    if spec.kv_dtype is not None:
        keys.append((*where, "fp8"))
    return iter(sorted(every, key=lambda c: any(arch.name in SPILLS_ON.get((k, c), ()) for k in keys)))
