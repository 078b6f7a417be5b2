"""Run by tests/test_decode_varlen.py in a process of its own: a packed, ragged q (cu_seqlens_q, max_q_len, tree_mask)
through attngen.decode on the stub driver (sm_90). The packed kernels take the spec's varlen_q (and tree) switches and
rows for group x max_q_len; their parameters end with cu_seqlens_q's and tree_mask's pointers, total_q (the LSE's
head stride), batch_order's pointer and min_q_len; q's and out's batch strides are 0 and their row strides the packed
rows'; out is [total_q, heads, head_dim] and the LSE [heads, total_q] (or the caller's lse); the split count comes
from the cache's capacity and the merge launch covers batch x max_q_len rows. Every wrong argument is refused naming
the field, before any launch. Prints "ok" at the end.
"""

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

# DecodeParams (templates/decode/params.cuh) of the packed kernels, as decode's op packs them.
PARAMS = struct.Struct("<12Q14q9iI2f2fQqQiiQQQiif4xQQqQi4x")


def refused(fn, *texts):
    fake_cuda.refused(fn, *texts, error="LaunchError")


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-varlen-", propagate=True)  # (the padded copies)

    import torch

    import attngen
    from attngen.families.decode import op

    def params():
        return PARAMS.unpack(fake_cuda.last_params(PARAMS.size))

    def launched():
        return [c for c in op._calls.values() if c.grid is not None]

    total, h, hk, d = 11, 32, 8, 128
    q = rand(total, h, d)
    kc, vc = rand(5, 4096, hk, d), rand(5, 4096, hk, d)
    lens = i32([100, 3000, 7, 1, 50])
    cu = i32([0, 1, 3, 8, 8, 11])
    tree = wrap(torch.zeros(total, dtype=torch.int64))

    # One split: one launch, rows for group 4 x max_q_len 8 = 32, the packed fields last.
    n0 = fake_cuda.counts()["launches"]
    out, lse = attngen.decode(q, kc, vc, cache_seqlens=lens, cu_seqlens_q=cu, max_q_len=8, num_splits=1,
                              return_lse=True)
    assert fake_cuda.counts()["launches"] == n0 + 1
    assert out.shape == (total, h, d) and lse.shape == (h, total) and lse.dtype == torch.float32
    vals = params()
    assert vals[3] == out.data_ptr() and vals[4] == lse.data_ptr(), vals
    assert vals[-5:] == (cu.data_ptr(), 0, total, 0, 1), vals[-5:]
    assert vals[12:15] == (0, h * d, d), vals[12:15]        # q: no batch stride, its rows, its heads
    assert vals[21:24] == (0, h * d, d), vals[21:24]        # out likewise
    assert vals[26:30] == (5, 8, h, h // hk), vals[26:30]   # batch from cu_seqlens_q, q_len the most a request
    spec = launched()[-1].kern.spec
    assert spec.varlen_q and not spec.tree and spec.q_rows == 32, spec
    assert fake_cuda.last_launch()["grid"] == (1, hk, 5)

    # min_q_len (the requests of fewer tokens are not computed) and the caller's LSE: both in the parameters.
    lse2 = wrap(torch.zeros(h, total))
    out, l2 = attngen.decode(q, kc, vc, cache_seqlens=lens, cu_seqlens_q=cu, max_q_len=8, min_q_len=3, num_splits=1,
                             return_lse=True, lse=lse2)
    assert l2 is lse2 and params()[4] == lse2.data_ptr() and params()[-1] == 3, params()

    # A tree: its pointer, the tree kernels; out= with a wider row stride.
    wide = wrap(torch.zeros(total, 40, d).to(torch.bfloat16))
    o2 = wide[:, 4:36]
    r = attngen.decode(q, kc, vc, cache_seqlens=lens, cu_seqlens_q=cu, max_q_len=16, tree_mask=tree, num_splits=1,
                       out=o2)
    assert r is o2
    vals = params()
    assert vals[-5:-2] == (cu.data_ptr(), tree.data_ptr(), total) and vals[21:24] == (0, 40 * d, d), vals
    spec = launched()[-1].kern.spec
    assert spec.varlen_q and spec.tree and spec.q_rows == 64, spec

    # Split-KV through the merge launch: the workspace's partials for batch x max_q_len rows, the merge over as many.
    was = op.set_cluster_merge(0)
    try:
        n0 = fake_cuda.counts()["launches"]
        attngen.decode(q, kc, vc, cache_seqlens=lens, cu_seqlens_q=cu, max_q_len=4, num_splits=3)
        assert fake_cuda.counts()["launches"] == n0 + 2, "a split launch and a merge launch"
        assert fake_cuda.last_launch()["grid"] == (-(-5 * 4 * h // 4), 1, 1), fake_cuda.last_launch()
        vals = params()
        assert vals[8] and vals[9] and vals[30] == 3 and vals[-5] == cu.data_ptr(), vals
        call = launched()[-1]
        assert call.work >= 3 * 5 * 4 * h * d + 3 * 5 * h * 4, call.work
    finally:
        op.set_cluster_merge(was)
    # sm_90: the splits of a row merge in a cluster (one request: the stub's clusters all resident).
    attngen.decode(q[:3], kc, vc, cache_seqlens=i32([3000]), cu_seqlens_q=i32([0, 3]), max_q_len=4, num_splits=4)
    assert fake_cuda.last_launch()["cluster"] == 4 and params()[8] == 0
    # Paged, an int length for every request, no request at all.
    table = i32([[i] for i in range(5)])
    attngen.decode(q, rand(5, 4096, hk, d), rand(5, 4096, hk, d), cache_seqlens=4000, block_table=table,
                   cu_seqlens_q=cu, max_q_len=2, num_splits=1)
    assert launched()[-1].kern.spec.paged and params()[-5] == cu.data_ptr()
    n0 = fake_cuda.counts()["launches"]
    e = attngen.decode(rand(0, h, d), kc, vc, cache_seqlens=i32([]), cu_seqlens_q=i32([0]), max_q_len=1)
    assert e.shape == (0, h, d) and fake_cuda.counts()["launches"] == n0
    # A head dim no kernel is built for runs on zero-padded copies (100 -> 104), packed still.
    o3 = attngen.decode(rand(3, 8, 100), rand(1, 256, 2, 100), rand(1, 256, 2, 100), cache_seqlens=i32([200]),
                        cu_seqlens_q=i32([0, 3]), max_q_len=4, num_splits=1)
    spec = launched()[-1].kern.spec
    assert o3.shape == (3, 8, 100) and spec.head_dim == 104 and spec.varlen_q, (o3.shape, spec)
    # Without cu_seqlens_q, the kernels without the switch.
    attngen.decode(rand(2, 1, h, d), kc, vc, cache_seqlens=i32([5, 6]), num_splits=1)
    assert not launched()[-1].kern.spec.varlen_q

    call = dict(cache_seqlens=lens, cu_seqlens_q=cu, max_q_len=8)
    for kw, texts in [
        (dict(cache_seqlens=lens, max_q_len=8), ("max_q_len is given without cu_seqlens_q",)),
        (dict(cache_seqlens=lens, tree_mask=tree), ("tree_mask is given without cu_seqlens_q",)),
        (dict(call, max_q_len=None), ("max_q_len=None", "allowed: an int from 1 to 32")),
        (dict(call, max_q_len=33), ("max_q_len=33", "1 to 32")),
        (dict(call, max_q_len=0), ("max_q_len=0",)),
        (dict(call, max_q_len=True), ("max_q_len=True",)),
        (dict(cache_seqlens=lens, min_q_len=2), ("min_q_len is given without cu_seqlens_q",)),
        (dict(call, min_q_len=0), ("min_q_len=0", "allowed: an int from 1 to 8")),
        (dict(call, min_q_len=9), ("min_q_len=9", "with max_q_len=8")),
        (dict(call, min_q_len=2.0), ("min_q_len=2.0",)),
        (dict(call, lse=wrap(torch.zeros(h, total))), ("lse must be", "return_lse=True", "return_lse=False")),
        (dict(call, return_lse=True, lse=wrap(torch.zeros(h, total + 1))), ("lse must be", f"[{h}, {total}]")),
        (dict(call, return_lse=True, lse=wrap(torch.zeros(h, total).to(torch.bfloat16))), ("lse must be", "bf16")),
        (dict(call, return_lse=True, lse=wrap(torch.zeros(total, h)).t()), ("lse must be", "strides")),
        (dict(call, cu_seqlens_q=wrap(torch.zeros(6, dtype=torch.int64))), ("cu_seqlens_q has dtype", "int32")),
        (dict(call, cu_seqlens_q=torch.zeros(6, dtype=torch.int32)), ("cu_seqlens_q is on cpu",)),
        (dict(call, cu_seqlens_q=i32([0, 1, 2])), ("cu_seqlens_q has 3 entries", "cache_seqlens.shape[0] + 1 = 6")),
        (dict(call, cu_seqlens_q=i32([[0, 1]])), ("cu_seqlens_q has shape", "[batch + 1]")),
        (dict(call, tree_mask=i32([0] * total)), ("tree_mask has dtype int32", "int64")),
        (dict(call, tree_mask=wrap(torch.zeros(total + 1, dtype=torch.int64))), ("tree_mask has shape", "(11,)")),
        (dict(call, tree_mask=tree, window=(100, 0)), ("tree_mask with window=(100, 0)",)),
        (dict(call, tree_mask=tree, causal=False), ("tree_mask with", "causal=False")),
        (dict(call, variant="unfused"), ("variant='unfused' with cu_seqlens_q",)),
        (dict(call, score_mod="return score;"), ("score_mod/mask_mod",)),
    ]:
        refused(lambda: attngen.decode(q, kc, vc, **kw), *texts)
    refused(lambda: attngen.decode(rand(2, 1, h, d), kc, vc, **call), "q has shape", "expected 3 dims",
            "[total_q, heads, head_dim]")
    refused(lambda: attngen.decode(q, kc, vc, **call, out=rand(total, 1, h, d)), "out must match q")
    refused(lambda: attngen.decode(q, rand(5, 4096, 1, d), rand(5, 4096, 1, d), **call),
            "max_q_len=8", "1 to 4")  # group 32: 128 rows // 32
    # An fp8 cache: the fp8 kernels with the switches, the packed fields after the fp8 scales'.
    k8 = wrap(torch.zeros(5, 4096, hk, d, dtype=torch.float8_e4m3fn))
    attngen.decode(q, k8, k8, **call, tree_mask=tree, k_scale=0.5, num_splits=1)
    spec = launched()[-1].kern.spec
    assert spec.kv_dtype is not None and spec.varlen_q and spec.tree, spec
    assert params()[-5:-2] == (cu.data_ptr(), tree.data_ptr(), total)
    q512, c512 = rand(total, 8, 512), rand(5, 64, 8, 512)
    refused(lambda: attngen.decode(q512, c512, c512, **call), "head_dim=512 with cu_seqlens_q", "at most 256")
    print("ok")


if __name__ == "__main__":
    main()
