"""Run by tests/test_host_path.py in a process of its own: softcap and ALiBi through every entry point
that takes them, on the stub driver.

Each entry point (attngen's ops, FlashAttention's names and their packed forms) x {softcap, ALiBi,
both} x {sm_scale given, None} x its layout (dense, varlen contiguous and paged, KV cache with and
without appended tokens) is called once, and what reaches cuLaunchKernel must carry the scale the
call implies (1 / sqrt(head_dim) by default), the cap as the kernel takes it (cap / scale and
scale / cap) and the slopes' pointer and batch stride. Exits non-zero on the first failure; prints
"ok" at the end.
"""

import math
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

LOG2E = 1.4426950408889634
MODS = {"softcap": (7.5, False), "alibi": (0.0, True), "both": (30.0, True)}


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-mods-", propagate=True)

    import torch

    import attngen

    b, h, hk, d = 2, 8, 2, 64
    sq, sk = 37, 90
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    qkv = rand(b, sq, 3, h, d)
    kv = rand(b, sk, 2, hk, d)
    cu_q, cu_k = i32([0, 30, 37]), i32([0, 50, 90])
    vq, vk, vv = rand(37, h, d), rand(90, hk, d), rand(90, hk, d)
    vqkv, vkv = rand(37, 3, h, d), rand(90, 2, hk, d)
    cu_same = i32([0, 20, 37])
    pk, pv = rand(6, 16, hk, d), rand(6, 16, hk, d)
    table = i32([[0, 2, 4], [1, 3, 5]])
    kc, vc = rand(b, 64, hk, d), rand(b, 64, hk, d)
    dq = rand(b, 1, h, d)
    new_k, new_v = rand(b, 1, hk, d), rand(b, 1, hk, d)
    lens = i32([10, 40])

    # (layout, name, call(scale, cap, slopes)): every entry point that takes softcap and alibi_slopes.
    calls = [
        ("dense", "attngen.prefill",
         lambda s, c, a: attngen.prefill(q, k, v, sm_scale=s, softcap=c, alibi_slopes=a)),
        ("dense", "flash_attn_func",
         lambda s, c, a: attngen.flash_attn_func(q, k, v, softmax_scale=s, softcap=c, alibi_slopes=a)),
        ("dense", "flash_attn_qkvpacked_func",
         lambda s, c, a: attngen.flash_attn_qkvpacked_func(qkv, softmax_scale=s, softcap=c, alibi_slopes=a)),
        ("dense", "flash_attn_kvpacked_func",
         lambda s, c, a: attngen.flash_attn_kvpacked_func(q, kv, softmax_scale=s, softcap=c, alibi_slopes=a)),
        ("varlen", "attngen.prefill_varlen",
         lambda s, c, a: attngen.prefill_varlen(vq, vk, vv, cu_q, cu_k, 30, 50, sm_scale=s, softcap=c,
                                                alibi_slopes=a)),
        ("varlen", "flash_attn_varlen_func",
         lambda s, c, a: attngen.flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, 30, 50, softmax_scale=s, softcap=c,
                                                        alibi_slopes=a)),
        ("varlen", "flash_attn_varlen_qkvpacked_func",
         lambda s, c, a: attngen.flash_attn_varlen_qkvpacked_func(vqkv, cu_same, 20, softmax_scale=s, softcap=c,
                                                                  alibi_slopes=a)),
        ("varlen", "flash_attn_varlen_kvpacked_func",
         lambda s, c, a: attngen.flash_attn_varlen_kvpacked_func(vq, vkv, cu_q, cu_k, 30, 50, softmax_scale=s,
                                                                 softcap=c, alibi_slopes=a)),
        ("paged", "flash_attn_varlen_func (block_table)",
         lambda s, c, a: attngen.flash_attn_varlen_func(vq, pk, pv, cu_q, cu_k, 30, 50, softmax_scale=s, softcap=c,
                                                        alibi_slopes=a, block_table=table)),
        ("kvcache", "attngen.decode",
         lambda s, c, a: attngen.decode(dq, kc, vc, cache_seqlens=lens, sm_scale=s, softcap=c, alibi_slopes=a)),
        ("kvcache", "flash_attn_with_kvcache",
         lambda s, c, a: attngen.flash_attn_with_kvcache(dq, kc, vc, cache_seqlens=lens, softmax_scale=s,
                                                         softcap=c, alibi_slopes=a)),
        ("kvcache", "flash_attn_with_kvcache (k, v appended)",
         lambda s, c, a: attngen.flash_attn_with_kvcache(dq, kc, vc, k=new_k, v=new_v, cache_seqlens=10,
                                                         softmax_scale=s, softcap=c, alibi_slopes=a)),
    ]
    slopes = {"one": wrap(torch.rand(h)), "per_batch": wrap(torch.rand(b, h))}
    n = 0
    for layout, name, call in calls:
        for mod, (cap, with_alibi) in MODS.items():
            for scale in (0.3, None):
                for which in (("one", "per_batch") if with_alibi else (None,)):
                    al = slopes[which] if which else None
                    launches = fake_cuda.counts()["launches"]
                    try:
                        call(scale, cap, al)
                    except Exception as e:
                        raise AssertionError(f"{name} ({layout}) with {mod}, sm_scale={scale}, slopes {which}: "
                                             f"{type(e).__name__}: {e}") from e
                    assert fake_cuda.counts()["launches"] > launches, f"{name}: no launch"
                    s = d ** -0.5 if scale is None else scale
                    sb = al.stride(0) if al is not None and al.dim() == 2 else 0
                    mods = struct.pack("<2fQq", cap / s if cap else 0.0, s / cap if cap else 0.0,
                                       al.data_ptr() if al is not None else 0, sb)
                    got = fake_cuda.last_params(1024)
                    head = struct.pack("<2f", s, s * LOG2E)
                    # decode passes the scale and the modifiers side by side; prefill puts the window between.
                    want = head + mods if layout == "kvcache" else head
                    assert want in got and mods in got, f"{name} ({layout}) {mod} sm_scale={scale}: parameters"
                    n += 1
    assert n == len(calls) * 10, n
    # The modifiers' own checks name the argument, in every layout.
    for layout, name, call in calls:
        for cap, al, text in ((-1.0, None, "softcap=-1.0 must be 0 (off) or a finite cap > 0"),
                              (math.inf, None, "softcap=inf must be 0 (off) or a finite cap > 0"),
                              ("x", None, "softcap='x' must be a number"),
                              (0.0, wrap(torch.rand(h + 1)), "alibi_slopes has shape (9,)"),
                              (0.0, wrap(torch.rand(h).double()), "alibi_slopes must be an fp32")):
            try:
                call(None, cap, al)
            except attngen.LaunchError as e:
                assert text in str(e), (name, text, str(e))
            else:
                raise AssertionError(f"{name} accepted softcap={cap!r}, slopes {al}")
    # A head dim no kernel takes, and past the padded ones (256), is named as such, not as the strides it makes
    # misaligned.
    for call in (lambda: attngen.prefill(rand(1, 8, 2, 259), rand(1, 8, 2, 259), rand(1, 8, 2, 259)),
                 lambda: attngen.prefill_varlen(rand(8, 2, 259), rand(8, 2, 259), rand(8, 2, 259), i32([0, 8]),
                                                i32([0, 8]), 8, 8),
                 lambda: attngen.decode(rand(1, 1, 2, 259), rand(1, 8, 2, 259), rand(1, 8, 2, 259), cache_seqlens=4)):
        try:
            call()
        except attngen.LaunchError as e:
            assert "head_dim=259 is not supported; allowed: " in str(e), str(e)
        else:
            raise AssertionError("head_dim 259 accepted")
    print("ok")


if __name__ == "__main__":
    main()
