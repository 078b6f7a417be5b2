"""Run by tests/test_decode_fp8.py in a process of its own: attngen.decode with fp8 KV caches on the stub driver
(sm_90). Bad scales and dtypes are refused by name before any launch; good calls launch the fp8 kernel of the
cache's format, and the parameter struct carries the scales: a number folded into the softmax scale (k) or
passed as v's number, a device tensor's pointer and per-KV-head stride. Exits non-zero on the first failure;
prints "ok" at the end.
"""

import math
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

# DecodeParams (templates/decode/params.cuh), as attngen.families.decode.op packs it.
PARAMS = struct.Struct("<12Q14q9iI2f2fQqQiiQQQiif4x")  # ... the sinks' pointer, then the fp8 fields
SM_SCALE, SCALE_LOG2 = 36, 37                  # indices of the two softmax scales
K_PTR, V_PTR, K_SH, V_SH, V_NUM = 46, 47, 48, 49, 50


refused = fake_cuda.refused


def main():
    # (propagate: the KV-cache call's append computes on the wrapped tensors)
    wrap, rand, i32 = fake_cuda.stub_session("attngen-fp8kv-", propagate=True)

    import torch

    import attngen
    from attngen.families.decode import op

    assert PARAMS.size == op._PARAMS.size
    b, hk, group, d, cap = 2, 4, 4, 128, 512
    q = rand(b, 1, hk * group, d)
    e4 = torch.float8_e4m3fn

    def fp8(dtype=e4, shape=(b, cap, hk, d)):
        return wrap(torch.randn(*shape).to(dtype))

    def f32(*shape):
        return wrap(torch.rand(shape) + 0.5)

    k8, v8 = fp8(), fp8()
    lens = i32([300, 17])

    def params():
        return PARAMS.unpack(fake_cuda.last_params(PARAMS.size))

    def kernel():
        return [c for c in op._calls.values() if c.grid is not None][-1].kern.spec

    # no scales: 1.0, no pointers; the e4m3 kernel
    attngen.decode(q, k8, v8, cache_seqlens=lens, num_splits=1)
    vals = params()
    assert kernel().kv_dtype.value == "fp8_e4m3" and kernel().dtype.value == "bf16", kernel()
    assert vals[1:3] == (k8.data_ptr(), v8.data_ptr())
    assert math.isclose(vals[SM_SCALE], 1 / math.sqrt(d), rel_tol=1e-6)
    assert vals[K_PTR:] == (0, 0, 0, 0, 1.0), vals[K_PTR:]
    # numbers: k folded into both softmax scales, v passed as its number
    attngen.decode(q, k8, v8, cache_seqlens=lens, num_splits=1, k_scale=0.25, v_scale=3.0, sm_scale=0.5)
    vals = params()
    assert math.isclose(vals[SM_SCALE], 0.125, rel_tol=1e-6), vals[SM_SCALE]
    assert math.isclose(vals[SCALE_LOG2], 0.125 * math.log2(math.e), rel_tol=1e-6)
    assert vals[K_PTR:] == (0, 0, 0, 0, 3.0), vals[K_PTR:]
    # device tensors: per tensor (shape [] or [1]: stride 0), per KV head (its stride)
    ks, vs = f32(1), f32(hk)
    attngen.decode(q, k8, v8, cache_seqlens=lens, num_splits=1, k_scale=ks, v_scale=vs)
    vals = params()
    assert vals[K_PTR:V_NUM] == (ks.data_ptr(), vs.data_ptr(), 0, 1), vals[K_PTR:]
    assert math.isclose(vals[SM_SCALE], 1 / math.sqrt(d), rel_tol=1e-6), "a device k_scale is applied on the device"
    vs2 = f32(2 * hk)[::2]  # a strided view: its stride reaches the kernel
    attngen.decode(q, k8, v8, cache_seqlens=lens, num_splits=1, k_scale=f32(), v_scale=vs2)
    assert params()[K_SH:V_NUM] == (0, 2), params()[K_PTR:]
    # a new scale tensor of the same call is a new key: its pointer reaches the kernel
    ks2 = f32(hk)
    attngen.decode(q, k8, v8, cache_seqlens=lens, num_splits=1, k_scale=ks2, v_scale=vs)
    assert params()[K_PTR] == ks2.data_ptr()
    # e5m2, fp16 q, paged, split with the merge launch (the scales go to the split kernel)
    op.set_cluster_merge(0)
    q16 = wrap(torch.randn(b, 2, hk * group, d).half())
    kp, vp = fp8(torch.float8_e5m2, (40, 32, hk, d)), fp8(torch.float8_e5m2, (40, 32, hk, d))
    table = i32([list(range(0, 16)), list(range(16, 32))])
    n0 = fake_cuda.counts()["launches"]
    attngen.decode(q16, kp, vp, cache_seqlens=lens, block_table=table, num_splits=3, k_scale=2.0, v_scale=vs)
    assert fake_cuda.counts()["launches"] == n0 + 2, "the split launch and the merge launch"
    spec = [c for c in op._calls.values() if c.grid is not None][-1].kern.spec
    assert (spec.kv_dtype.value, spec.dtype.value, spec.paged) == ("fp8_e5m2", "fp16", True), spec
    op.set_cluster_merge(op.CLUSTER_MAX)
    # the kernel's 32-bit paged offsets: a slot stride of 2^32 elements (pages of one row, so that it costs no
    # storage) is refused by name, and one just under it launches
    for stride, ok in ((2 ** 32, False), (2 ** 32 - 16, True)):
        kh = wrap(torch.empty(40 * hk * d, dtype=torch.float8_e5m2).as_strided((40, 1, hk, d), (hk * d, stride, d, 1)))
        call = lambda: attngen.decode(q16, kh, kh, cache_seqlens=i32([10, 3]), block_table=table,  # noqa: E731
                                      num_splits=1)
        if ok:
            call()
        else:
            refused(call, "k_cache (fp8, paged) has strides", "below 2^32 elements")
    # uint8 bytes with the spec's kv_dtype (what a CuPy caller passes)
    kb, vb = (wrap(torch.randint(0, 255, (b, cap, hk, d), dtype=torch.uint8)) for _ in range(2))
    attngen.decode(q, kb, vb, cache_seqlens=lens, num_splits=1, spec="decode:kv_dtype=fp8_e5m2")
    assert kernel().kv_dtype.value == "fp8_e5m2"

    # refusals
    refused(lambda: attngen.decode(q, kb, vb, cache_seqlens=lens), "uint8", "kv_dtype=fp8_e4m3 or fp8_e5m2")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, spec="decode:kv_dtype=fp8_e5m2"),
            "kv_dtype=fp8_e5m2 (the spec) disagrees", "torch.float8_e4m3fn")
    refused(lambda: attngen.decode(q, rand(b, cap, hk, d), rand(b, cap, hk, d), cache_seqlens=lens,
                                   spec="decode:kv_dtype=fp8_e4m3"), "kv_dtype=fp8_e4m3 (the spec) disagrees", "bf16")
    refused(lambda: attngen.decode(q, k8, fp8(torch.float8_e5m2), cache_seqlens=lens), "must share a dtype")
    refused(lambda: attngen.decode(wrap(torch.randn(b, 1, hk * group, d).to(e4)), k8, v8, cache_seqlens=lens),
            "q has dtype torch.float8_e4m3fn", "an fp8 cache takes q in fp16 or bf16")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, k_scale=torch.ones(1)), "k_scale is on cpu")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, v_scale=wrap(torch.ones(1).half())),
            "v_scale has dtype fp16", "allowed: fp32")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, k_scale=f32(hk + 1)), "k_scale has shape [5]",
            "[kv_heads] (per KV head)", "kv_heads=4")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, k_scale=f32(1, hk)), "k_scale has shape [1, 4]")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, v_scale=bad), f"v_scale={bad!r}",
                "finite and > 0")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, k_scale=True), "k_scale=True")
    refused(lambda: attngen.decode(q, rand(b, cap, hk, d), rand(b, cap, hk, d), cache_seqlens=lens, k_scale=0.5),
            "k_scale is only for fp8 caches")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, softcap=30.0), "kv_dtype", "softcap=true")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, alibi_slopes=f32(hk * group)), "kv_dtype",
            "alibi=true")
    refused(lambda: attngen.decode(q, k8, v8, cache_seqlens=lens, variant="unfused"), "kv_dtype", "variant=unfused")
    # rows of 136 fp8 elements: 8-element strides pass the 16-bit rule, not the fp8 one
    kw, vw = fp8(shape=(b, cap, hk, d + 8))[..., :d], fp8(shape=(b, cap, hk, d + 8))[..., :d]
    refused(lambda: attngen.decode(q, kw, vw, cache_seqlens=lens), "k_cache (fp8)", "multiples of 16 elements")
    check_kvcache(torch, wrap, rand, i32, params)
    print("ok")


def check_kvcache(torch, wrap, rand, i32, params):
    """flash_attn_with_kvcache with an fp8 cache: the new tokens are quantised (k / k_scale, saturating) into the
    caller's cache at each row's length (the stub's tensors live on the host, so the bytes can be read back), the
    decode kernel gets the scales; what it refuses, it refuses before writing the cache."""
    import attngen

    b, hk, group, d, cap = 2, 4, 4, 128, 64
    q = rand(b, 2, hk * group, d)
    kc = wrap(torch.zeros(b, cap, hk, d).to(torch.float8_e4m3fn))
    vc = wrap(torch.zeros(b, cap, hk, d).to(torch.float8_e4m3fn))
    k, v = rand(b, 2, hk, d), rand(b, 2, hk, d)
    k[0, 0, 0, 0] = 1e4  # past 448 x k_scale: saturates to 448
    k[0, 0, 0, 1] = -1e4
    lens = i32([5, 30])
    attngen.flash_attn_with_kvcache(q, kc, vc, k=k, v=v, cache_seqlens=lens, causal=True, k_scale=0.5, v_scale=2.0,
                                    num_splits=1)
    for i, n in enumerate((5, 30)):
        want_k = (k[i].float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
        want_v = (v[i].float() / 2.0).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(kc[i, n:n + 2].view(torch.uint8), want_k.view(torch.uint8)), i
        assert torch.equal(vc[i, n:n + 2].view(torch.uint8), want_v.view(torch.uint8)), i
        assert not kc[i, :n].float().any() and not kc[i, n + 2:].float().any(), "only the new positions are written"
    assert kc[0, 5, 0, 0].item() == 448.0 and kc[0, 5, 0, 1].item() == -448.0
    vals = params()
    assert math.isclose(vals[SM_SCALE], 0.5 / math.sqrt(d), rel_tol=1e-6) and vals[V_NUM] == 2.0, vals
    # per KV head, paged (e5m2): each head's new tokens divided by its own scale
    e5 = torch.float8_e5m2
    kp = wrap(torch.zeros(8, 16, hk, d).to(e5))
    vp = wrap(torch.zeros(8, 16, hk, d).to(e5))
    table = i32([[3, 1, 0, 0], [6, 2, 0, 0]])
    ks = wrap(torch.tensor([0.5, 1.0, 2.0, 4.0]))
    attngen.flash_attn_with_kvcache(q, kp, vp, k=k, v=v, cache_seqlens=i32([15, 0]), block_table=table,
                                    causal=True, k_scale=ks, v_scale=ks)
    want = (k[0, 1].float() / ks[:, None]).clamp(-57344, 57344).to(e5)  # row 0's second token: position 16
    assert torch.equal(kp[1, 0].view(torch.uint8), want.view(torch.uint8))
    assert params()[K_PTR] == ks.data_ptr() and params()[K_SH] == 1
    # refused before the cache is written
    before = kc.view(torch.uint8).clone()
    for call, texts in (
            # past 8 tokens the prefill kernel over the fp8 cache serves the call, which takes no sinks
            (dict(q=rand(b, 9, hk * group, d), k=rand(b, 9, hk, d), v=rand(b, 9, hk, d),
                  sinks=wrap(torch.zeros(hk * group))), ("kv_dtype", "sinks")),
            (dict(k=wrap(k.half()), v=wrap(v.half())), ("k/v have dtype fp16", "q's dtype (bf16)")),
            (dict(k_scale=wrap(torch.ones(hk + 1))), ("k_scale has shape [5]",)),
            (dict(v_scale=-1.0), ("v_scale=-1.0",))):
        kw = dict(q=q, k=k, v=v, k_scale=0.5) | call
        refused(lambda: attngen.flash_attn_with_kvcache(kw.pop("q"), kc, vc, cache_seqlens=lens, **kw), *texts)
        assert torch.equal(kc.view(torch.uint8), before), f"{texts} wrote the cache"
    refused(lambda: attngen.flash_attn_with_kvcache(q, kc.view(torch.uint8), vc.view(torch.uint8), k=k, v=v,
                                                    cache_seqlens=lens), "torch.uint8", "bytes name no format")
    refused(lambda: attngen.flash_attn_with_kvcache(q, rand(b, cap, hk, d), rand(b, cap, hk, d), k=k, v=v,
                                                    cache_seqlens=lens, k_scale=0.5), "k_scale is only for fp8")
    k72 = wrap(torch.zeros(b, cap, hk, 72).to(torch.float8_e4m3fn))
    refused(lambda: attngen.flash_attn_with_kvcache(rand(b, 1, hk, 72), k72, k72, cache_seqlens=lens),
            "head_dim=72 with an fp8 cache")


if __name__ == "__main__":
    main()
