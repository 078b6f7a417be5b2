"""fp8 prefill: q, k and v in e4m3 with descales, output fp16 or bf16, on sm_90a's fp8 wgmma (spec ``qkv_dtype``).

The kernel is the TMA whole-row kernel with its operands in bytes (templates/prefill/fp8.cuh): q and k are read as
they are (fp8 wgmma reads them K-major, as the 16-bit kernel does), P is rounded to e4m3 for O += P V, and v is
first copied transposed (keys contiguous, as fp8 wgmma needs its B operand) into a scratch buffer by the module's
``_vt`` entry, launched just before the main one on the same stream. Descales: numbers fold into the softmax's
scale (q's, k's) and O (v's) on the host; fp32 device tensors (per tensor, per KV head, or FlashAttention-3's
``[batch, kv_heads]``) are read by each CTA for its (batch, KV head).

Here: the spec's rules for ``qkv_dtype`` (``PrefillSpec`` calls ``check_fields`` and ``check_fit``), its default
tiles and its shared memory; the host path of ``attngen.prefill`` / ``prefill_varlen`` for fp8 operands is
``fp8_op.py``.
"""

from __future__ import annotations

from ...errors import SpecError
from ...spec import Mma, Pipeline, allowed_text, check_smem, check_wgmma_arch
from .rows import _smem_row

QKV_DTYPES = ("fp8_e4m3",)
HEAD_DIMS = (128, 256)
VT_THREADS = 256  # templates/prefill/fp8.cuh: the `_vt` entry's


# ---- the spec ------------------------------------------------------------------------------------------------

def check_fields(spec) -> str:
    """``qkv_dtype`` checked against the spec's other fields (PrefillSpec.__post_init__): the value it keeps."""
    v = spec.qkv_dtype
    if v is None or v == "":
        return ""
    v = getattr(v, "value", v)
    if v not in QKV_DTYPES:
        raise SpecError("qkv_dtype", v, "'' (q, k, v in dtype) or " + allowed_text(QKV_DTYPES),
                        reason="fp8 prefill runs e4m3 (fp8 wgmma's e5m2 form is not built)")
    if spec.head_dim not in HEAD_DIMS or spec.head_dim_v:
        raise SpecError("qkv_dtype", v, "'' with head_dim=" + str(spec.head_dim) +
                        (f", head_dim_v={spec.head_dim_v}" if spec.head_dim_v else ""),
                        reason=f"fp8 prefill takes head_dim {allowed_text(HEAD_DIMS)} (whole 128-byte rows) with "
                               "head_dim_v = head_dim")
    for name in ("softcap", "alibi", "sinks", "custom_mask", "paged", "score_mod", "mask_mod"):
        if getattr(spec, name):
            raise SpecError("qkv_dtype", v, f"'' with {name} set",
                            reason=f"fp8 prefill has no {name.replace('_', '-')} form yet (causal, sliding window, "
                                   "varlen and return_lse are built)")
    if spec.head_dim_chunk:
        raise SpecError("head_dim_chunk", spec.head_dim_chunk, f"0 with qkv_dtype={v}",
                        reason="fp8 prefill holds whole rows")
    return v


KV_DTYPES = ("fp8_e4m3", "fp8_e5m2")
KV_CODES = {"fp8_e4m3": 1, "fp8_e5m2": 2}  # the template's KV8 (common/fp8.cuh's formats)


def check_kv_fields(spec) -> str:
    """``kv_dtype`` (an fp8 cache a varlen call reads, q in dtype) checked against the other fields: the value kept."""
    v = spec.kv_dtype
    if v is None or v == "":
        return ""
    v = getattr(v, "value", v)
    if v not in KV_DTYPES:
        raise SpecError("kv_dtype", v, "'' (the cache in dtype), " + allowed_text(KV_DTYPES))
    if spec.qkv_dtype:
        raise SpecError("kv_dtype", v, f"'' with qkv_dtype={spec.qkv_dtype}", reason="qkv_dtype names k's and v's too")
    if not spec.varlen:
        raise SpecError("kv_dtype", v, "'' with varlen=false",
                        reason="an fp8 cache is read through prefill_varlen (contiguous or paged)")
    if spec.head_dim % 16 or spec.head_dim > 256 or spec.head_dim_v or spec.head_dim_chunk:
        raise SpecError("kv_dtype", v, f"'' with head_dim={spec.head_dim}" +
                        (f", head_dim_v={spec.head_dim_v}" if spec.head_dim_v else ""),
                        reason="an fp8 cache's rows are widened in 16-byte chunks: head dims a multiple of 16 up to "
                               "256, v as wide as k")
    for name in ("softcap", "alibi", "sinks", "score_mod", "mask_mod"):
        if getattr(spec, name):
            raise SpecError("kv_dtype", v, f"'' with {name} set",
                            reason=f"the fp8-cache prefill has no {name.replace('_', '-')} form yet")
    return v


def check_kv_fit(spec, a) -> None:
    """An fp8 cache's arch rules (PrefillSpec.check, before the 16-bit kernel's): head dims above 128 on wgmma only."""
    if spec.head_dim > 128 and spec.mma is not Mma.WGMMA:
        raise SpecError("kv_dtype", spec.kv_dtype, f"'' with head_dim={spec.head_dim} and mma={spec.mma.value}",
                        reason="the widening beside a head dim above 128's O spilled registers on mma.sync (sm_80-89, "
                               "sm_120: 16-36 bytes at every tile tried); on sm_90a's wgmma it does not")
    if spec.tma:
        # (templates/prefill/widen.cuh: three of the producer's warps widen, and hold registers the consumers of a
        # one-warpgroup kernel would need; a box lands in a 32-key unit of the slot)
        if spec.num_warps != 8:
            raise SpecError("num_warps", spec.num_warps, f"8 with kv_dtype={spec.kv_dtype} and pipeline=tma",
                            reason="the fp8 cache's TMA kernel runs two consumer warpgroups beside a producer that "
                                   "widens")
        if spec.cta_tile_kv % 32:
            raise SpecError("cta_tile_kv", spec.cta_tile_kv, f"a multiple of 32 with kv_dtype={spec.kv_dtype} and "
                            "pipeline=tma", reason="the producer widens a key tile in units of 32 keys")


def computes_fp16(spec) -> bool:
    """A bf16 q over an fp8 cache on the TMA kernel runs its MMAs in fp16 (templates/prefill/traits.cuh's Q16): the
    cache widens by one convert a pair, and q is carried into fp16 by a power of two that the logits' scale takes back
    (exact wherever |q| is at least 2^-28 of its query tile's largest)."""
    return bool(spec.kv_dtype) and spec.tma and spec.dtype.value == "bf16"


def kv_smem_bytes(spec) -> int:
    """An fp8 cache's kernel. TMA: the 16-bit kernel's, and two mbarriers a slot more (the fp8 bytes land inside the
    16-bit slots); a bf16 q (computes_fp16) one more for Q's bytes and three words for its largest |q|. cp.async: Q,
    one widened K and V tile (the 16-bit kernel's with one stage), and the fp8 rows' ring, K's and V's slots of rows
    padded as templates/prefill/traits.cuh's ROW8."""
    if spec.tma:
        return spec.replace(kv_dtype="").smem_bytes() + 16 * spec.num_stages + (24 if computes_fp16(spec) else 0)
    half = spec.head_dim // 2
    row8 = half if half % 64 == 0 else half + 8
    return spec.replace(kv_dtype="", num_stages=1).smem_bytes() + 4 * spec.num_stages * spec.cta_tile_kv * row8


def check_fit(spec, a) -> None:
    """The fp8 kernel's fit rules on arch ``a`` (PrefillSpec.check): wgmma (sm_90a) or mma.sync (sm_89+)."""
    if not a.has_fp8_mma:
        raise SpecError("qkv_dtype", spec.qkv_dtype, f"'' on {a.name}",
                        reason="fp8 MMAs need sm_89 or newer (mma.sync; wgmma on sm_90a)")
    if spec.mma is Mma.WGMMA:
        _check_wgmma(spec, a)
    else:
        _check_sync(spec, a)
    check_smem(spec, a, "num_stages", "fewer num_stages or a smaller cta_tile_kv")


def _check_wgmma(spec, a) -> None:
    check_wgmma_arch(spec, a)
    if spec.num_warps != 8 or spec.cta_tile_q != 128:
        name, value = ("num_warps", spec.num_warps) if spec.num_warps != 8 else ("cta_tile_q", spec.cta_tile_q)
        raise SpecError(name, value, "num_warps 8 with cta_tile_q 128 with qkv_dtype and mma=wgmma",
                        reason="fp8 prefill on wgmma runs two consumer warpgroups of 64 query rows")
    if spec.cta_tile_kv % 128:
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, "128 with qkv_dtype and mma=wgmma",
                        reason="V's transposed copy is read in boxes of 128 keys (128-byte swizzle rows)")
    if spec.num_stages < 2:
        raise SpecError("num_stages", spec.num_stages, "2, 3, 4 with qkv_dtype and mma=wgmma",
                        reason="the TMA ring of fp8 prefill holds two tiles at least")


def _check_sync(spec, a) -> None:
    if spec.tma:
        raise SpecError("pipeline", "tma", "sync with mma=mma_sync", reason="the TMA pipeline is built on wgmma")
    if spec.cta_tile_kv not in (32, 64, 128):
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, "32, 64, 128 with qkv_dtype and mma=mma_sync",
                        reason="P V takes 32 keys a step, V's copy whole 16-byte chunks of keys")
    warp_rows = spec.cta_tile_q // spec.num_warps
    if warp_rows % 16 or spec.num_warps == 12:
        raise SpecError("num_warps", spec.num_warps, "4, 8 dividing cta_tile_q/16",
                        reason=f"each warp owns whole 16-row tiles of cta_tile_q={spec.cta_tile_q}")
    # Per thread: S and O of the warp's 16-row tiles (kv/2 + d/2 floats each), as the 16-bit kernel's limit.
    acc = warp_rows // 16 * (spec.cta_tile_kv + spec.head_dim) // 2
    if acc > 176:
        raise SpecError("cta_tile_kv", spec.cta_tile_kv, "a smaller cta_tile_kv or cta_tile_q",
                        reason=f"needs about {acc} accumulator registers per thread (limit 176)")


def smem_bytes(spec) -> int:
    """Q's tile, the ring of K and V (V's keys transposed), O's own 16-bit tile; wgmma: dense 128-byte rows, the
    1024-byte alignment slack and the TMA ring's mbarriers; mma.sync: rows as ``layout_context`` pads them."""
    d, q, kv, st = spec.head_dim, spec.cta_tile_q, spec.cta_tile_kv, spec.num_stages
    o = q * d * spec.dtype.itemsize
    if spec.mma is Mma.WGMMA:
        bars = 8 * (1 + (4 if spec.overlapped else 3) * st + spec.is_persistent)
        return q * d + 2 * st * kv * d + o + 1024 + bars
    c = layout_context(spec)
    return 2 * (q + st * kv) * c["smem_row_elems"] + 2 * st * d * c["smem_row_elems_v"] + o


def layout_context(spec) -> dict:
    """The template's row widths and swizzles for fp8 rows (in 16-bit pairs): q and k head_dim / 2, V's copy
    cta_tile_kv / 2 (its rows are keys), each swizzled where a multiple of 64."""
    qk, v = spec.head_dim // 2, spec.cta_tile_kv // 2
    return dict(smem_row_elems=_smem_row(qk), smem_row_elems_v=_smem_row(v), swizzle=qk % 64 == 0,
                swizzle_v=v % 64 == 0)


def candidates(spec):
    """The default tiles (see the module), measured order first."""
    # (the family's enums through the spec's own fields: this module is below spec.py, which imports it)
    Schedule, Persistent = type(spec.schedule), type(spec.persistent)

    # Measured on an H200 (1x4k-16k, 8x2k, causal and not): at head dim 128 ping-pong, persistent (varlen: one
    # CTA a work-list slot), best; at 256 overlap one CTA a tile (persistent spills there: left to a spec that pins
    # it), ping-pong within 2%.
    first = ((Schedule.PINGPONG, Persistent.OFF if spec.varlen else Persistent.ON) if spec.head_dim == 128
             else (Schedule.OVERLAP, Persistent.OFF))
    rest = [(sc, pe) for pe in ((Persistent.OFF, Persistent.ON) if spec.head_dim == 128 else (Persistent.OFF,))
            for sc in (Schedule.PINGPONG, Schedule.OVERLAP, Schedule.SERIAL) if (sc, pe) != first]
    for st in (2, 3):
        for sc, pe in (first, *rest):
            yield 128, 128, 8, st, Mma.WGMMA, 0, Pipeline.TMA, sc, pe
    # mma.sync (sm_89, sm_120; sm_90a where a spec pins it): the cp.async ring
    # (head dim 256: 64x32, whose registers hold O without spilling (64x64 spilled on sm_100), in sm_89's 99 KB)
    tiles = ((128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3), (128, 32, 8, 2), (64, 32, 4, 2))
    for q, kv, w, st in (((64, 32, 4, 2), *tiles) if spec.head_dim == 256 else tiles):
        yield q, kv, w, st, Mma.SYNC, 0, Pipeline.SYNC, Schedule.SERIAL, Persistent.OFF
