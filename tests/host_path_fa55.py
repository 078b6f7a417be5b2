"""Run by tests/test_fa55_rest.py in a process of its own: issue 55's last refusals on the stub driver.

- A head dim that is not a multiple of 8 (59) through attngen.prefill, prefill_varlen (contiguous and paged),
  decode and flash_attn_with_kvcache: the kernel is given zero-padded copies (their data checked here: q/k/v
  in the first 59 columns, zeros past them; the cache copy made after the append), the default scale of the
  real head dim, and the caller gets 59 columns (in their ``out`` where given); the append lands in the
  caller's cache.
- Paged blocks of 272 and 512 positions: decode packs the block size, the capacity and Decode::block_of's
  multiplier; prefill_varlen the block size and the capacity.
- More than 8 new tokens with causal=False and left pads: a contiguous cache runs the varlen prefill kernel over
  its rows (its checks take the flattened view and the interleaved ALiBi slopes), a paged one decode calls.
Exits non-zero on the first failure; prints "ok" at the end.
"""

import math
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

LOG2E = 1.4426950408889634


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-fa55-", propagate=True)

    import torch

    import attngen
    from attngen.families import head_pad
    from attngen.families.decode.op import block_mul

    made = []  # every zero-padded copy an op makes, kept alive so its pointer can be matched to the launch

    def spy(x, width):
        z = real_padded(x, width)
        made.append((x, z))
        return z

    real_padded = head_pad.zero_padded
    from attngen import flash_api
    from attngen.families.prefill import op as prefill_op
    for mod in (head_pad, flash_api, prefill_op):  # the ops' run_padded, the KV-cache call, mask_plan
        mod.zero_padded = spy

    def params():
        return fake_cuda.last_params(1024)

    def has_ptr(t):
        return struct.pack("<Q", t.data_ptr()) in params()

    def check_copies(n, width):
        """The last ``n`` copies: ``width`` columns, the source in front, zeros behind; one of them reached the
        last launch."""
        assert len(made) >= n, made
        for src, z in made[-n:]:
            d = src.shape[-1]
            assert z.shape == (*src.shape[:-1], width), (z.shape, src.shape)
            assert torch.equal(z[..., :d], src) and not z[..., d:].any()
        assert any(has_ptr(z) for _, z in made[-n:]), "the launch reads a padded copy"

    def scale_in(s):
        return struct.pack("<2f", s, s * LOG2E) in params()

    s59 = 1.0 / math.sqrt(59)

    # prefill, dense: q, k, v padded to 64, the scale of 59, 59 columns back; into the caller's out.
    q, k, v = rand(2, 37, 4, 59), rand(2, 50, 2, 59), rand(2, 50, 2, 59)
    del made[:]
    o = attngen.flash_attn_func(q, k, v, causal=True)
    check_copies(3, 64)
    assert scale_in(s59) and o.shape == (2, 37, 4, 59), o.shape
    out = wrap(torch.zeros(2, 37, 4, 59).to(torch.bfloat16))
    o, lse = attngen.prefill(q, k, v, out=out, return_lse=True, sm_scale=0.25)
    assert o is out and lse.shape == (2, 4, 37) and scale_in(0.25)
    # v alone past a built head dim: q and k as they are.
    del made[:]
    o = attngen.prefill(rand(2, 37, 4, 64), rand(2, 50, 2, 64), rand(2, 50, 2, 57))
    check_copies(1, 64)
    assert o.shape == (2, 37, 4, 57) and scale_in(1 / 8)

    # prefill_varlen, contiguous and over a paged cache of 512-position blocks.
    cu_q, cu_k = i32([0, 30, 37]), i32([0, 50, 90])
    del made[:]
    o = attngen.flash_attn_varlen_func(rand(37, 4, 59), rand(90, 2, 59), rand(90, 2, 59), cu_q, cu_k, 30, 50)
    check_copies(3, 64)
    assert o.shape == (37, 4, 59) and scale_in(s59)
    pk, pv = rand(3, 512, 2, 59), rand(3, 512, 2, 59)
    del made[:]
    o = attngen.prefill_varlen(rand(37, 4, 59), pk, pv, cu_q, i32([0, 600, 700]), 30, 600,
                               block_table=i32([[2, 0], [1, 2]]))
    check_copies(3, 64)
    # block_size, num_blocks, total_q, total_k (the paged capacity: 2 blocks of 512)
    assert o.shape == (37, 4, 59) and struct.pack("<4i", 512, 3, 37, 1024) in params()

    # decode: paged blocks past 256, the multiplier of block_of packed beside them.
    for bs in (272, 512):
        kc, vc = rand(5, bs, 2, 64), rand(5, bs, 2, 64)
        table = i32([[4, 1], [0, 3]])
        attngen.decode(rand(2, 1, 8, 64), kc, vc, cache_seqlens=i32([bs + 9, 3]), block_table=table, num_splits=1)
        # block_size, capacity, pool, seq_fixed, block_mul
        assert struct.pack("<4iI", bs, 2 * bs, 5, 0, block_mul(bs)) in params(), bs
    # decode at head dim 59, contiguous and paged (512).
    del made[:]
    o = attngen.decode(rand(2, 2, 8, 59), rand(2, 80, 2, 59), rand(2, 80, 2, 59), cache_seqlens=i32([40, 80]))
    check_copies(3, 64)
    assert o.shape == (2, 2, 8, 59) and scale_in(s59)
    del made[:]
    o, lse = attngen.decode(rand(2, 1, 8, 59), pk, pv, cache_seqlens=i32([700, 3]), block_table=i32([[2, 0], [1, 2]]),
                            return_lse=True, sm_scale=0.5)
    check_copies(3, 64)
    assert o.shape == (2, 1, 8, 59) and lse.shape == (2, 8, 1) and scale_in(0.5)
    # q, k and v of different head dims that pad to one width (59, 60) are not padded into agreement: refused,
    # naming the mismatch.
    for dq, dk, dv, text in ((59, 59, 60, "must have the same shape"), (59, 60, 60, "head_dim")):
        for call in (lambda: attngen.decode(rand(2, 1, 8, dq), rand(2, 80, 2, dk), rand(2, 80, 2, dv),
                                            cache_seqlens=i32([40, 80])),
                     lambda: attngen.flash_attn_with_kvcache(rand(2, 1, 8, dq), rand(2, 80, 2, dk),
                                                             rand(2, 80, 2, dv), cache_seqlens=i32([40, 80]))):
            try:
                call()
            except attngen.LaunchError as e:
                assert text in str(e), e
            else:
                raise AssertionError(f"q {dq}, k {dk}, v {dv} accepted")

    # flash_attn_with_kvcache at head dim 59: the append lands in the caller's cache, then the padded copy of it
    # (made after the append) is what the kernel reads.
    kc, vc = rand(2, 64, 2, 59), rand(2, 64, 2, 59)
    kn, vn = rand(2, 3, 2, 59), rand(2, 3, 2, 59)
    del made[:]
    o = attngen.flash_attn_with_kvcache(rand(2, 3, 8, 59), kc, vc, k=kn, v=vn, cache_seqlens=i32([5, 20]),
                                        causal=True)
    assert torch.equal(kc[0, 5:8], kn[0]) and torch.equal(vc[1, 20:23], vn[1]), "appended to the caller's cache"
    check_copies(3, 64)
    assert any(src is kc for src, _ in made) and o.shape == (2, 3, 8, 59) and scale_in(s59)

    # More than 32 new tokens (past the packed decode route), causal=False, left pads, ALiBi per batch row: a
    # contiguous cache through the varlen kernel over its rows (its _order launch, then the kernel: two launches),
    # a paged cache through decode calls.
    pads, slopes = i32([2, 7]), wrap(torch.rand(2, 8))
    kc, vc = rand(3, 100, 2, 64), rand(3, 100, 2, 64)
    n0 = fake_cuda.counts()["launches"]
    o = attngen.flash_attn_with_kvcache(rand(2, 40, 8, 64), kc, vc, k=rand(2, 40, 2, 64), v=rand(2, 40, 2, 64),
                                        cache_seqlens=i32([10, 40]), cache_leftpad=pads, cache_batch_idx=i32([2, 0]),
                                        alibi_slopes=slopes, window_size=(20, 3))
    assert fake_cuda.counts()["launches"] == n0 + 2 and o.shape == (2, 40, 8, 64)
    assert has_ptr(kc), "the varlen kernel reads the caller's cache in place"
    pk, pv = rand(6, 32, 2, 64), rand(6, 32, 2, 64)
    n0 = fake_cuda.counts()["launches"]
    o = attngen.flash_attn_with_kvcache(rand(2, 40, 8, 64), pk, pv, k=rand(2, 40, 2, 64), v=rand(2, 40, 2, 64),
                                        cache_seqlens=i32([10, 40]), cache_leftpad=pads, block_table=i32([[0, 1, 2],
                                                                                                         [3, 4, 5]]))
    assert fake_cuda.counts()["launches"] >= n0 + 5 and o.shape == (2, 40, 8, 64), "one decode call a chunk"
    # 12 new tokens (group 4: up to 32) on the same caches: the decode kernel over a packed q, one call.
    n0 = fake_cuda.counts()["launches"]
    o = attngen.flash_attn_with_kvcache(rand(2, 12, 8, 64), kc, vc, k=rand(2, 12, 2, 64), v=rand(2, 12, 2, 64),
                                        cache_seqlens=i32([10, 40]), cache_leftpad=pads, cache_batch_idx=i32([2, 0]),
                                        alibi_slopes=slopes, window_size=(20, 3))
    assert n0 + 1 <= fake_cuda.counts()["launches"] <= n0 + 2 and o.shape == (2, 12, 8, 64), "one packed decode"
    print("ok")


if __name__ == "__main__":
    main()
