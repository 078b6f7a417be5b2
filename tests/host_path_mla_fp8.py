"""Run by tests/test_mla_decode_fp8.py in a process of its own: attngen.mla_decode with fp8 latent caches on the stub
driver (sm_90). Bad scales, dtypes and options are refused by name before any launch; good calls launch the fp8
kernel of the cache's format (mma.sync on the cp.async ring; on sm_90a at 64 rows the wgmma kernel with its TMA maps of
the fp8 bytes and its producer warpgroup, or mma.sync where the driver refuses the maps), whose parameter struct
carries the scale: a number as k_scale_f, a device tensor's pointer. Exits non-zero on the first failure; prints "ok"
at the end.
"""

import math
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

# MlaFp8Params (templates/mla_decode/fp8.cuh): MlaParams (params.cuh), then k_scale's pointer and number.
PARAMS = struct.Struct("<10Q14q9i2fiQf4x")
SM_SCALE, SCALE_LOG2, K_PTR, K_NUM = 33, 34, 36, 37
# MlaFp8TmaParams: the two tensor maps (128 bytes each), then MlaFp8Params.
PARAMS_TMA = struct.Struct("<256s10Q14q9i2fiQf4x")

refused = fake_cuda.refused


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-mlafp8-")

    import torch

    import attngen
    from attngen.families.mla_decode import op

    assert PARAMS.size == op._PARAMS_FP8.size == 256 and op._PARAMS.size == 240
    assert PARAMS_TMA.size == op._PARAMS_FP8_TMA.size == 512
    launched = []
    real_get_kernel = op.get_kernel

    def spy(spec, device=None):
        launched.append(spec)
        return real_get_kernel(spec, device=device)

    op.get_kernel = spy
    b, h, cap = 2, 16, 256
    qn, qp = rand(b, 1, h, 512), rand(b, 1, h, 64)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2

    def fp8(dtype=e4, shape=(b, cap)):
        return wrap(torch.randn(*shape, 512).to(dtype)), wrap(torch.randn(*shape, 64).to(dtype))

    def params():
        return PARAMS.unpack(fake_cuda.last_params(PARAMS.size))

    ckv, kpe = fp8()
    lens = i32([200, 17])
    # a number: passed as k_scale_f, the softmax scales the caller's (the kernel folds k_scale in)
    attngen.mla_decode(qn, qp, ckv, kpe, cache_seqlens=lens, sm_scale=0.5, num_splits=1, k_scale=0.25)
    s = launched[-1]
    assert (s.kv_dtype.value, s.dtype.value, s.mma.value, s.pipeline.value) == ("fp8_e4m3", "bf16", "mma_sync",
                                                                                  "sync"), s
    vals = params()
    assert vals[2:4] == (ckv.data_ptr(), kpe.data_ptr())
    assert math.isclose(vals[SM_SCALE], 0.5, rel_tol=1e-6)
    assert math.isclose(vals[SCALE_LOG2], 0.5 * math.log2(math.e), rel_tol=1e-6)
    assert vals[K_PTR:] == (0, 0.25), vals[K_PTR:]
    assert fake_cuda.last_launch()["smem"] == s.smem_bytes() and fake_cuda.last_launch()["cluster"] == 0
    # device tensors of shape [] and [1]: their pointer, the number 1
    for ks in (wrap(torch.tensor(0.5)), wrap(torch.tensor([0.5]))):
        attngen.mla_decode(qn, qp, ckv, kpe, cache_seqlens=lens, sm_scale=0.5, num_splits=1, k_scale=ks)
        assert params()[K_PTR:] == (ks.data_ptr(), 1.0), params()[K_PTR:]
    # e5m2, fp16 q, paged, split with the merge launch (the fp8 struct to the split kernel only)
    q16n, q16p = wrap(torch.randn(b, 2, h, 512).half()), wrap(torch.randn(b, 2, h, 64).half())
    pc, pp = fp8(e5, (12, 64))
    table = i32([[0, 1, 2, 3], [4, 5, 6, 7]])
    n0 = fake_cuda.counts()["launches"]
    attngen.mla_decode(q16n, q16p, pc, pp, cache_seqlens=i32([250, 90]), sm_scale=0.1, block_table=table,
                       num_splits=3, k_scale=2.0, return_lse=True)
    assert fake_cuda.counts()["launches"] == n0 + 2, "the split launch and the merge launch"
    s = launched[-1]
    assert (s.kv_dtype.value, s.dtype.value, s.paged, s.q_rows) == ("fp8_e5m2", "fp16", True, 32), s
    # 64 rows (128 heads) on sm_90a: the wgmma kernel, its producer warpgroup (384 threads), maps of the fp8 bytes
    # (CU_TENSOR_MAP_DATA_TYPE_UINT8: the stub's map holds the address, the first two dims and the dtype code)
    attngen.mla_decode(rand(b, 1, 128, 512), rand(b, 1, 128, 64), ckv, kpe, cache_seqlens=lens, sm_scale=0.5,
                       k_scale=0.125, num_splits=1)
    s = launched[-1]
    assert (s.q_rows, s.mma.value, s.pipeline.value, s.qk_shard.value) == (64, "wgmma", "tma", "true"), s
    vals = PARAMS_TMA.unpack(fake_cuda.last_params(PARAMS_TMA.size))
    maps = [struct.unpack("<4Q", vals[0][i * 128:i * 128 + 32]) for i in (0, 1)]
    assert maps == [(ckv.data_ptr(), 512, cap, 0), (kpe.data_ptr(), 64, cap, 0)], maps
    assert vals[1 + 2:1 + 4] == (ckv.data_ptr(), kpe.data_ptr()) and vals[1 + K_PTR:] == (0, 0.125), vals
    assert math.isclose(vals[1 + SM_SCALE], 0.5, rel_tol=1e-6)
    launch = fake_cuda.last_launch()
    assert (launch["threads"], launch["smem"], launch["cluster"]) == (384, s.smem_bytes(), 0), launch
    # ... also where the 16-bit cache would take alternate tiles (two 64-row blocks, many tiles a CTA)
    lc, lp = fp8(shape=(1, 8192))
    attngen.mla_decode(rand(1, 1, 128, 512), rand(1, 1, 128, 64), lc, lp, cache_seqlens=8192, sm_scale=0.5,
                       num_splits=1, k_scale=1.0)
    assert launched[-1] == s, launched[-1]
    # where the driver refuses the maps: the mma.sync kernel of the cp.async ring, with its own struct; refused by
    # name where the caller's spec pins wgmma
    real_maps = op._tensor_maps

    def no_maps(*a, **k):
        raise attngen.LaunchError("stub: no TMA map")

    op._tensor_maps = no_maps
    attngen.mla_decode(rand(b, 1, 128, 512), rand(b, 1, 128, 64), ckv, kpe, cache_seqlens=lens, sm_scale=0.5,
                       k_scale=1.0, num_splits=1)
    s = launched[-1]
    assert (s.q_rows, s.mma.value, s.pipeline.value, s.kv_dtype.value) == (64, "mma_sync", "sync", "fp8_e4m3"), s
    assert params()[2:4] == (ckv.data_ptr(), kpe.data_ptr()) and fake_cuda.last_launch()["threads"] == 256
    refused(lambda: attngen.mla_decode(rand(b, 1, 128, 512), rand(b, 1, 128, 64), ckv, kpe, cache_seqlens=lens,
                                       sm_scale=0.5, k_scale=1.0, spec="mla_decode:mma=wgmma"), "stub: no TMA map")
    op._tensor_maps = real_maps
    # uint8 bytes with the spec's kv_dtype (what a CuPy caller passes)
    cb, pb = (wrap(torch.randint(0, 255, (b, cap, d), dtype=torch.uint8)) for d in (512, 64))
    attngen.mla_decode(qn, qp, cb, pb, cache_seqlens=lens, sm_scale=0.5, k_scale=1.0,
                       spec="mla_decode:kv_dtype=fp8_e5m2")
    assert launched[-1].kv_dtype.value == "fp8_e5m2"
    # the 16-bit cache still launches the 16-bit kernel with its own struct
    attngen.mla_decode(qn, qp, rand(b, cap, 512), rand(b, cap, 64), cache_seqlens=lens, sm_scale=0.5)
    assert launched[-1].kv_dtype is None

    # refusals
    call = dict(cache_seqlens=lens, sm_scale=0.5)
    refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, **call), "k_scale is required", "kv_dtype=fp8_e4m3")
    refused(lambda: attngen.mla_decode(qn, qp, cb, pb, k_scale=1.0, **call), "uint8",
            "kv_dtype=fp8_e4m3 or fp8_e5m2")
    refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=1.0, spec="mla_decode:kv_dtype=fp8_e5m2", **call),
            "kv_dtype=fp8_e5m2 (the spec) disagrees", "torch.float8_e4m3fn")
    refused(lambda: attngen.mla_decode(qn, qp, rand(b, cap, 512), rand(b, cap, 64), k_scale=1.0,
                                       spec="mla_decode:kv_dtype=fp8_e4m3", **call),
            "kv_dtype=fp8_e4m3 (the spec) disagrees", "bf16")
    refused(lambda: attngen.mla_decode(qn, qp, ckv, fp8(e5)[1], k_scale=1.0, **call),
            "ckv_cache and kpe_cache must share a dtype")
    refused(lambda: attngen.mla_decode(qn, qp, ckv, rand(b, cap, 64), k_scale=1.0, **call),
            "ckv_cache and kpe_cache must share a dtype")
    refused(lambda: attngen.mla_decode(wrap(torch.randn(b, 1, h, 512).to(e4)), qp, ckv, kpe, k_scale=1.0, **call),
            "q_nope has dtype torch.float8_e4m3fn", "allowed: fp16, bf16")
    refused(lambda: attngen.mla_decode(qn, wrap(torch.randn(b, 1, h, 64).half()), ckv, kpe, k_scale=1.0, **call),
            "q_nope and q_pe must share a dtype")
    refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=torch.ones(1), **call), "k_scale is on cpu")
    refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=wrap(torch.ones(1).half()), **call),
            "k_scale has dtype fp16", "allowed:")
    refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=wrap(torch.ones(2)), **call),
            "k_scale has shape [2]", "[] or [1]")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=bad, **call), f"k_scale={bad!r}",
                "finite and > 0")
    refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=True, **call), "k_scale=True")
    refused(lambda: attngen.mla_decode(qn, qp, rand(b, cap, 512), rand(b, cap, 64), k_scale=0.5, **call),
            "k_scale is only for fp8 caches")
    for pin in ("mma=wgmma,pipeline=sync", "mma=mma_sync,pipeline=tma", "qk_shard=alternate"):
        refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=1.0, spec=f"mla_decode:{pin}", **call),
                "kv_dtype", *pin.replace(",", ", ").split(", "), error="SpecError")
    # wgmma takes 64 rows: 16 heads with the pin are refused by name
    refused(lambda: attngen.mla_decode(qn, qp, ckv, kpe, k_scale=1.0, spec="mla_decode:mma=wgmma", **call),
            "mma='wgmma'", "q_rows=64", error="SpecError")
    # rows whose strides pass the 16-bit rule (multiples of 8 elements) and not the fp8 one (16)
    wide = wrap(torch.randn(b, cap, 520).to(e4))[..., :512]
    refused(lambda: attngen.mla_decode(qn, qp, wide, kpe, k_scale=1.0, **call), "ckv_cache (fp8)",
            "multiples of 16 elements")
    print("ok")


if __name__ == "__main__":
    main()
