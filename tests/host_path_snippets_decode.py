"""Run by tests/test_snippets.py in a process of its own: score_mod / mask_mod snippets through attngen.decode and
flash_attn_with_kvcache on the stub driver (sm_90). Every launch of a snippet call (one split, the cluster merge, the
split and merge launches, paged) takes the snippet kernel and ends its parameters with ModArgs (the aux tensors'
pointers in name order, then their strides); the unfused variant, an fp8 cache and a KV-cache route that counts
positions otherwise are refused by name. Exits non-zero on the first failure; prints "ok" at the end.
"""

import functools
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

# DecodeParams (templates/decode/params.cuh) as decode's op packs it, then ModArgs.
PARAMS = struct.Struct("<12Q14q9iI2f2fQqQiiQQQiif4x")
MOD_ARGS = struct.Struct("<4Q16q")
SCORE = "return score - slope(h) * (float)(q_idx - kv_idx);"
MASK = "return kv_idx >= start(b);"

refused = functools.partial(fake_cuda.refused, error="LaunchError")


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-snippets-decode-", propagate=True)

    import torch

    import attngen
    from attngen.families.decode import op

    def mods():
        return MOD_ARGS.unpack(fake_cuda.last_params(PARAMS.size + MOD_ARGS.size)[PARAMS.size:])

    def kernel():
        return [c for c in op._calls.values() if c.grid is not None][-1].kern.spec

    q, kc, vc = rand(2, 2, 32, 128), rand(2, 4096, 8, 128), rand(2, 4096, 8, 128)
    lens = i32([3000, 17])
    slope, start = wrap(torch.rand(32)), wrap(torch.tensor([5, 0], dtype=torch.int64))
    aux = {"slope": slope, "start": start}
    want = (slope.data_ptr(), start.data_ptr(), 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, *[0] * 8)

    for splits in (1, 4):
        n0 = fake_cuda.counts()["launches"]
        attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=splits, score_mod=SCORE, mask_mod=MASK, aux=aux)
        assert fake_cuda.counts()["launches"] == n0 + 1  # (sm_90: four splits merge in a cluster)
        assert mods() == want, (splits, mods())
        spec = kernel()
        assert (spec.score_mod, spec.mask_mod, spec.aux) == (SCORE, MASK, "slope:fp32:1;start:int64:1"), spec
    was = op.set_cluster_merge(0)  # the split launch and the merge launch both carry ModArgs
    try:
        n0 = fake_cuda.counts()["launches"]
        attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=4, score_mod=SCORE, aux={"slope": slope})
        assert fake_cuda.counts()["launches"] == n0 + 2 and mods()[0] == slope.data_ptr()
    finally:
        op.set_cluster_merge(was)
    # paged
    pk, pv = rand(40, 256, 8, 128), rand(40, 256, 8, 128)
    table = i32([list(range(0, 16)), list(range(16, 32))])
    attngen.decode(q, pk, pv, cache_seqlens=lens, block_table=table, mask_mod=MASK, aux={"start": start})
    assert mods()[0] == start.data_ptr() and kernel().paged and kernel().mask_mod == MASK
    # without snippets: the plain kernel, DecodeParams alone
    attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=1)
    assert not (kernel().score_mod or kernel().mask_mod or kernel().aux)
    # refusals, by name
    refused(lambda: attngen.decode(q, kc, vc, cache_seqlens=lens, score_mod=SCORE, aux={"slope": slope, "x": start}),
            "aux['x'] is not read")
    refused(lambda: attngen.decode(q, kc, vc, cache_seqlens=lens, score_mod=SCORE, aux={"slope": slope.double()}),
            "aux['slope'] has dtype")
    fake_cuda.refused(lambda: attngen.decode(q, kc, vc, cache_seqlens=lens, variant="unfused", score_mod=SCORE,
                                             aux={"slope": slope}),
                      "variant", "fused kernel on a cache in q's dtype", error="SpecError")
    # flash_attn_with_kvcache: the decode route, and past 8 new tokens only the paged route
    attngen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, score_mod=SCORE, aux={"slope": slope})
    assert mods()[0] == slope.data_ptr() and kernel().score_mod == SCORE
    q12 = rand(2, 12, 32, 128)
    odd_k, odd_v = rand(2, 4100, 8, 128)[:, :4099], rand(2, 4100, 8, 128)[:, :4099]
    refused(lambda: attngen.flash_attn_with_kvcache(q12, odd_k, odd_v, cache_seqlens=lens, causal=True,
                                                    score_mod=SCORE, aux={"slope": slope}),
            "score_mod/mask_mod with 12 new tokens")
    print("ok")


if __name__ == "__main__":
    main()
