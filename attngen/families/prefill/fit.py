"""The prefill spec's fit rules for the chunked kernel and the whole-row kernels: what ``PrefillSpec.check``
runs past the rules every form shares. Not part of the cache key: they decide which specs are valid, never what a
template is given. ``spec`` is a resolved ``PrefillSpec`` (not imported here: it imports this module)."""

from __future__ import annotations

from ...arch import Arch
from ...errors import SpecError
from ...spec import Mma, allowed_text, check_smem, check_wgmma_arch
from .rows import _mma_dim


def check_chunked(spec, a: Arch) -> None:
    """The chunked kernel's fit rules (head dims above 256, or a head_dim_chunk)."""
    if spec.mma is Mma.WGMMA:
        check_chunked_wgmma(spec, a)
        return
    if spec.num_stages < 2:
        raise SpecError("num_stages", spec.num_stages, "2, 3, 4", reason="the chunked kernel's ring needs two slots")
    if spec.cta_tile_q not in (32, 64) or spec.num_warps != 8:
        raise SpecError("cta_tile_q" if spec.num_warps == 8 else "num_warps",
                        spec.cta_tile_q if spec.num_warps == 8 else spec.num_warps,
                        "cta_tile_q 32 or 64 with num_warps 8",
                        reason="the chunked kernel's warps own 32-row groups and split the columns of O")
    cg = spec.chunk_grid
    if cg["sn"] % 16:
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, f"a multiple of {16 * cg['warps_n']}",
                        reason=f"each of the {cg['warps_n']} warp columns takes 16-key blocks of S")
    if cg["on"] % 16:
        raise SpecError("cta_tile_q", spec.cta_tile_q, "64" if spec.cta_tile_q == 32 else "32",
                        reason=f"head_dim_v={spec.dim_v} splits into {cg['warps_n']} warp columns of "
                               f"{spec.dim_v / cg['warps_n']:g}, not a multiple of 16")
    # Per thread: O (ON floats for its two m-tiles) and S (SN); ptxas spilled past ~176.
    acc = cg["on"] + cg["sn"]
    if acc > 176:
        raise SpecError("cta_tile_q", spec.cta_tile_q, "32" if spec.cta_tile_q == 64 else "a smaller head_dim_v",
                        reason=f"needs about {acc} accumulator registers per thread (limit 176) with "
                               f"head_dim_v={spec.dim_v} and cta_tile_kv={spec.cta_tile_kv}")
    check_smem(spec, a, "num_stages", "fewer num_stages or a smaller head_dim_chunk or cta_tile_kv")

def check_chunked_wgmma(spec, a: Arch) -> None:
    """The chunked kernel's wgmma form (sm_90a): two warpgroups over 64 query rows, each with half of
    a KV tile's keys in S and half of O's columns, in whole 64-column swizzle blocks."""
    check_wgmma_arch(spec, a)
    form = "the chunked kernel's wgmma form"
    if spec.num_warps != 8:
        raise SpecError("num_warps", spec.num_warps, "8 with mma=wgmma", reason=f"{form} runs two warpgroups")
    if spec.cta_tile_q != 64:
        raise SpecError("cta_tile_q", spec.cta_tile_q, "64 with mma=wgmma",
                        reason=f"{form}: both warpgroups own the same 64 query rows")
    if spec.head_dim_chunk % 64:
        raise SpecError("head_dim_chunk", spec.head_dim_chunk, "64, 128 with mma=wgmma",
                        reason=f"{form} reads whole 128-byte swizzle rows")
    if spec.head_dim // spec.head_dim_chunk < 2:
        raise SpecError("head_dim_chunk", spec.head_dim_chunk, f"at most head_dim/2 = {spec.head_dim // 2}",
                        reason=f"{form} needs two S steps a tile (P is rewritten only after both "
                               "warpgroups finished the tile before)")
    if spec.tma and spec.dim_v_padded * spec.v_splits != spec.dim_v:
        raise SpecError("pipeline", "tma", "sync",
                        reason=f"{form}'s TMA copies are whole 64-column boxes of v or 32-column tails, and with "
                               f"head_dim_v={spec.dim_v} each warpgroup's {spec.dim_v // spec.v_splits / 2:g} "
                               "columns would be padded")
    if spec.num_stages < 3:
        raise SpecError("num_stages", spec.num_stages, "3 to 8 with mma=wgmma",
                        reason=f"{form} leaves a step's wgmma running while the next step's copies land: "
                               "two slots are being read")
    cg = spec.chunk_grid
    # Per thread: O (head_dim_v/4 floats) and S (cta_tile_kv/4); ptxas spilled the whole-row wgmma
    # kernel past ~176.
    acc = cg["on"] // 2 + cg["sn"] // 2
    if acc > 176:
        fits = [kv for kv in spec.CTA_TILE_KV if kv and cg["on"] // 2 + kv // 4 <= 176]
        why = (f"needs about {acc} accumulator registers per thread (limit 176) with head_dim_v={spec.dim_v} "
               f"and mma=wgmma" + (f" (padded to {spec.dim_v_padded})" if spec.dim_v_padded != spec.dim_v else ""))
        if not fits:
            raise SpecError("mma", "wgmma", "mma_sync", reason=why)
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, allowed_text(fits), reason=why)
    check_smem(spec, a, "num_stages", "fewer num_stages or a smaller head_dim_chunk or cta_tile_kv")


# Where q_scaled is built: its Q tile is wgmma's register operand, on the TMA kernels. The cp.async wgmma kernel's form
# computed wrong outputs on an H100 (every variant, rel L2 about 1, whether Q's fragments were read in the first step
# or before the key loop), so it is not offered.
Q_SCALED_KERNELS = "q_scaled is the TMA kernels' (pipeline=tma, mma=wgmma, sm_90a)"


def check_q_scaled_fields(spec) -> None:
    """q_scaled's rules on the fields before they are resolved: the scores become logits for score_mod alone."""
    if not spec.q_scaled:
        return
    if not spec.score_mod:
        raise SpecError("q_scaled", True, "false without a score_mod",
                        reason="only score_mod takes the scores as logits (a spec that asks for q_scaled names the "
                               "score_mod it serves); elsewhere sm_scale is folded into the softmax's exp2 at no cost")
    for name in ("softcap", "alibi"):  # (the fp8 kernels take no score_mod)
        if getattr(spec, name):
            raise SpecError("q_scaled", True, f"false with {name}=true",
                            reason="the softcap and ALiBi switches take their scores in units of q.k")


def check_wgmma(spec, a: Arch) -> None:
    """The wgmma whole-row kernel's fit rules (sm_90a)."""
    check_wgmma_arch(spec, a)
    for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.dim_v)):
        if d % 64:
            raise SpecError(name, d, "64, 128, 192, 256 (whole 128-byte swizzle rows) with mma=wgmma")
    if spec.schedule.value == "pingpong" and spec.num_warps == 4:
        raise SpecError("schedule", "pingpong", "serial, overlap with num_warps=4",
                        reason="ping-pong takes turns between two or three consumer warpgroups (num_warps=8, 12)")
    if spec.overlapped and spec.num_stages < 2:
        raise SpecError("num_stages", spec.num_stages, "2, 3, 4 with schedule=" + spec.schedule.value,
                        reason="tile i's V and tile i+1's K are in the ring together")
    if spec.cta_tile_q != 16 * spec.num_warps:
        raise SpecError("cta_tile_q", spec.cta_tile_q, f"{16 * spec.num_warps} with num_warps={spec.num_warps}",
                        reason="with mma=wgmma each warpgroup of 4 warps owns 64 query rows")
    # Per thread: O (head_dim_v/2 floats), S (cta_tile_kv/2) and P packed to 16 bits (cta_tile_kv/4).
    # NVRTC 13.5, sm_90a, causal, two stages, 128-row tiles: the cp.async kernel spilled past
    # ~176 (head_dim 192 with 112-key tiles, estimate 180, 64 bytes); the TMA kernel compiles 128/192 (estimate
    # 208, FlashInfer's fa3 tile without a mask) spill-free in every schedule and mask, one CTA a tile and
    # persistent (NVRTC 13.0 and 13.5; an earlier form of the overlapped schedules spilled there). A spec that pins
    # a spilling config still runs it, and defaults skip those (SPILLS_ON).
    # Three consumer warpgroups (12 warps) have 160 registers a thread: one CTA a tile compiled spill-free up to
    # 128 (64/128 in every schedule, 128/80; 64/144 overlapped spills 64 bytes); persistent, the overlapped
    # schedules spill 28-84 bytes at 64/64, 64/112-128 and 128/64-80 (none at 64/80-96).
    # q_scaled: Q's fragments (head_dim/4) on top, and 176 at most (NVRTC 13.5, causal, ALiBi's score_mod, the TMA
    # kernels: 128x128 tiles at head_dim 128 spilled 16 bytes at 192, 128x64 at 256 204 bytes at 240, the three
    # warpgroups at 64 108 bytes at 144; 128x192 at 64, also 192, compiled spill-free and is refused with them).
    base = spec.dim_v // 2 + spec.cta_tile_kv // 2 + spec.cta_tile_kv // 4
    base_limit = (128 if spec.num_warps == 12 else 208) if spec.tma else 176
    acc, limit = (base + spec.head_dim // 4, min(base_limit, 176)) if spec.q_scaled else (base, base_limit)
    if acc > limit:
        if spec.q_scaled and base <= base_limit:  # the tiles fit without it
            raise SpecError("q_scaled", True, "false", reason=f"Q's fragments take {spec.head_dim // 4} more "
                            f"registers a thread, {acc} in all (limit {limit} with q_scaled=true) with "
                            f"head_dim={spec.head_dim}, cta_tile_kv={spec.cta_tile_kv} and num_warps={spec.num_warps}")
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, "a smaller cta_tile_kv",
                        reason=f"needs about {acc} accumulator registers per thread (limit {limit} with "
                               f"pipeline={spec.pipeline.value}) with head_dim_v={spec.dim_v} and mma=wgmma")
    check_smem(spec, a, "cta_tile_kv", "a smaller cta_tile_kv or num_stages")


def check_mma_sync(spec, a: Arch) -> None:
    """The mma.sync whole-row kernel's fit rules."""
    warp_rows = spec.cta_tile_q // spec.num_warps
    if warp_rows % 16:
        raise SpecError("num_warps", spec.num_warps, f"a divisor of cta_tile_q/16 = {spec.cta_tile_q // 16}")
    # Register budget: fp32 accumulators of O (head_dim_v/8 tiles) and S (cta_tile_kv/8 tiles) per
    # 16-row m-tile, 4 floats each. Past ~200 the kernel spills.
    m_tiles = warp_rows // 16
    acc = m_tiles * 4 * (_mma_dim(spec.dim_v) // 8 + spec.cta_tile_kv // 8)
    if spec.q_in_regs:
        acc += m_tiles * 4 * (_mma_dim(spec.head_dim) // 16)
    if acc > 200:
        raise SpecError("cta_tile_q", spec.cta_tile_q,
                        "a smaller cta_tile_q or cta_tile_kv, or more num_warps",
                        reason=f"needs about {acc} accumulator registers per thread (limit 200) "
                               f"with head_dim={spec.head_dim}, head_dim_v={spec.dim_v}, "
                               f"cta_tile_kv={spec.cta_tile_kv}, num_warps={spec.num_warps}")
    check_smem(spec, a, "cta_tile_kv", "a smaller cta_tile_kv, num_stages or cta_tile_q")
