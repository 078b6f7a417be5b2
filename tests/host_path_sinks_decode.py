"""Run by tests/test_decode_sinks.py in a process of its own: attention sinks through attngen.decode and
flash_attn_with_kvcache on the stub driver (sm_90). The sinks' pointer follows the window in the parameters of every launch that
normalises a row (one split, the cluster merge, the merge launch) and of the split launch before a merge launch;
a call with sinks takes the `sinks` kernel and one without the kernel without it; wrong sinks and a spec that
disagrees with the call are refused naming `sinks`; the KV-cache call passes them to decode. Exits non-zero on the first failure; prints "ok" at the end.
"""

import struct
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

# DecodeParams (templates/decode/params.cuh) up to the sinks' pointer (the fp8 kernels' fields follow), as decode's op packs it.
PARAMS = struct.Struct("<12Q14q9iI2f2fQqQiiQ")


refused = functools.partial(fake_cuda.refused, error="LaunchError")


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-sinks-", propagate=True)  # (the padded copies)

    import torch

    import attngen
    from attngen.families.decode import op

    def params():
        return PARAMS.unpack(fake_cuda.last_params(PARAMS.size))

    def launched():
        return [c for c in op._calls.values() if c.grid is not None]

    q, kc, vc = rand(1, 1, 32, 128), rand(1, 4096, 8, 128), rand(1, 4096, 8, 128)
    lens = i32([3000])
    sinks = wrap(torch.randn(32))

    # One split: one launch, the sinks' pointer last, the `sinks` kernel.
    n0 = fake_cuda.counts()["launches"]
    out = attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=1, sinks=sinks)
    assert fake_cuda.counts()["launches"] == n0 + 1
    vals = params()
    assert vals[3] == out.data_ptr() and vals[-1] == sinks.data_ptr(), vals
    assert launched()[-1].kern.spec.sinks, launched()[-1].kern.spec
    # Without sinks: the kernel without the switch, a null pointer.
    attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=1)
    assert params()[-1] == 0 and not launched()[-1].kern.spec.sinks
    # sm_90: the splits of a row merge in a cluster, which adds the sink: one launch.
    n0 = fake_cuda.counts()["launches"]
    attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=4, sinks=sinks)
    assert fake_cuda.counts()["launches"] == n0 + 1 and fake_cuda.last_launch()["cluster"] == 4
    assert params()[-1] == sinks.data_ptr()
    # The merge launch adds it where there is no cluster: both launches carry the pointer.
    was = op.set_cluster_merge(0)
    try:
        n0 = fake_cuda.counts()["launches"]
        o, lse = attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=4, sinks=sinks, return_lse=True)
        assert fake_cuda.counts()["launches"] == n0 + 2, "a split launch and a merge launch"
        vals = params()
        assert vals[-1] == sinks.data_ptr() and vals[4] == lse.data_ptr() and vals[8] and vals[9], vals
    finally:
        op.set_cluster_merge(was)
    # A padded head dim (100 -> 104) keeps its sinks.
    q1, k1, v1 = rand(1, 2, 8, 100), rand(1, 256, 2, 100), rand(1, 256, 2, 100)
    s8 = wrap(torch.randn(8))
    attngen.decode(q1, k1, v1, cache_seqlens=200, num_splits=1, sinks=s8)
    assert params()[-1] == s8.data_ptr() and launched()[-1].kern.spec.head_dim == 104

    # Wrong sinks, each twice (beside a remembered call of the same tensors too).
    for bad, needle in [(wrap(torch.randn(32).to(torch.float16)), "got fp16 torch of shape (32,)"),
                        (wrap(torch.randn(8)), "of shape (32,) (one logit a query head)"),
                        (wrap(torch.randn(32, 1)), "got fp32 torch of shape (32, 1)"),
                        (wrap(torch.randn(64))[::2], "strides (2,)"),
                        (torch.randn(32), "sinks is on cpu"),
                        ([0.0] * 32, "sinks is a builtins.list")]:
        for _ in range(2):
            refused(lambda: attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=1, sinks=bad), "sinks", needle)
    # A spec of the caller's must agree with the call.
    plain = "decode:head_dim=128,q_rows=16"
    refused(lambda: attngen.decode(q, kc, vc, cache_seqlens=lens, spec=plain, sinks=sinks), "sinks: the spec",
            "has sinks=false but the call has a sinks array", "allowed: a spec with sinks=true")
    refused(lambda: attngen.decode(q, kc, vc, cache_seqlens=lens, spec=plain + ",sinks=true"), "sinks: the spec",
            "has sinks=true but the call has none")
    attngen.decode(q, kc, vc, cache_seqlens=lens, num_splits=1, spec=plain + ",sinks=true", sinks=sinks)
    assert params()[-1] == sinks.data_ptr() and launched()[-1].kern.spec.sinks

    # flash_attn_with_kvcache: the decode kernels take the sinks (past 8 new tokens the prefill kernel's routes do:
    # test_decode_sinks.test_kvcache_routes_with_sinks against the reference)
    attngen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, sinks=sinks)
    assert params()[-1] == sinks.data_ptr() and launched()[-1].kern.spec.sinks
    print("ok")


if __name__ == "__main__":
    main()
