"""Run by tests/test_merge.py in a process of its own: attngen.merge_state / merge_states on the stub driver
(sm_90). Bad operands are refused naming the field, the value and what is allowed, before any compile or launch;
good calls launch the kernel the family's choice names with its grid, and the parameter struct carries the
operands' pointers and strides (a tokens stride of a view, a transposed LSE, the caller's outputs). Exits
non-zero on the first failure; prints "ok" at the end.
"""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402


refused = functools.partial(fake_cuda.refused, error="LaunchError")


def main():
    wrap, rand, _ = fake_cuda.stub_session("attngen-merge-")

    import torch

    import attngen
    from attngen.families.choice import device_facts
    from attngen.families.merge import choose
    from attngen.families.merge.op import _PARAMS

    def f32(*shape):
        return wrap(torch.randn(*shape))

    t, h, d = 5, 3, 128
    va, vb, sa, sb = rand(t, h, d), rand(t, h, d), f32(t, h), f32(t, h)

    # refusals: each names the field, the value and what is allowed
    refused(lambda: attngen.merge_state(rand(t, h, 12), sa, rand(t, h, 12), sb),
            "head_dim=12", "allowed: a multiple of 8 from 8 to 1024")
    refused(lambda: attngen.merge_state(rand(t, h, 1032), sa, rand(t, h, 1032), sb), "head_dim=1032", "allowed:")
    refused(lambda: attngen.merge_state(va, sa, rand(t, h, 64), sb), "v_b has shape (5, 3, 64)", "expected (5, 3, 128)")
    refused(lambda: attngen.merge_state(va, sa, wrap(torch.randn(t, h, d).half()), sb), "v_b has dtype fp16",
            "expected bf16")
    refused(lambda: attngen.merge_state(wrap(torch.zeros(t, h, d, dtype=torch.int32)), sa, vb, sb),
            "v_a has dtype int32", "allowed: fp16, bf16, fp32")
    refused(lambda: attngen.merge_state(va, rand(t, h), vb, sb), "s_a has dtype bf16", "allowed: fp32")
    refused(lambda: attngen.merge_state(va, sa, vb, f32(t, h + 1)), "s_b has shape (5, 4)", "expected (5, 3)")
    refused(lambda: attngen.merge_state(wrap(torch.randn(t, d, h).bfloat16().transpose(1, 2)), sa, vb, sb),
            "v_a has stride 3 in its last dim (head_dim)", "allowed: 1")
    # rows of 132 elements: strides that are not whole 16-byte vectors of bf16
    refused(lambda: attngen.merge_state(rand(t, h, d + 4)[:, :, :d], sa, vb, sb),
            "v_a has stride 396 in dim 0 (tokens;", "allowed: multiples of 8 elements")
    refused(lambda: attngen.merge_state(va, sa, wrap(torch.randn(t, 400).bfloat16()[:, :h * 132].view(t, h, 132)[:, :, :d]), sb),
            "v_b has stride 132 in dim 1 (heads;", "allowed: multiples of 8 elements")
    refused(lambda: attngen.merge_state(wrap(torch.randn(t * h * d + 8).bfloat16()[4:4 + t * h * d].view(t, h, d)), sa, vb, sb),
            "v_a starts at address", "allowed: 16-byte aligned")
    refused(lambda: attngen.merge_state(va, sa, vb, sb, out=rand(t, h, 64)), "out has shape (5, 3, 64)")
    refused(lambda: attngen.merge_state(va, sa, vb, sb, out=(rand(t, h, d), rand(t, h))), "out[1] has dtype bf16",
            "allowed: fp32")
    refused(lambda: attngen.merge_state(va, sa, vb, sb, out=(va, f32(t, h))), "out overlaps v_a",
            "allowed: outputs apart from the inputs")
    refused(lambda: attngen.merge_state(va, sa, vb, sb, out=(rand(t, h, d), sb)), "out[1] overlaps s_b")
    refused(lambda: attngen.merge_state(va, sa, vb, sb, out=(rand(t, h, d),)), "out has 1 items")
    refused(lambda: attngen.merge_states(rand(t, h, d), f32(t, h)), "v has shape (5, 3, 128)",
            "expected 4 dims [tokens, num_states, heads, head_dim]")
    refused(lambda: attngen.merge_states(rand(t, 4, h, d), f32(t, 3, h)), "s has shape (5, 3, 3)",
            "expected (5, 4, 3)")

    # merge_state: a tokens stride of a view (every other token) and a transposed LSE (prefill_varlen's [heads,
    # total]), new outputs
    big = rand(2 * t, h, d)
    va_view = big[::2]
    lse_ht = torch.randn(h, t)  # (a view of a wrapped tensor is not wrapped: the view is made, then wrapped)
    n0 = fake_cuda.counts()["launches"]
    o, lse = attngen.merge_state(va_view, wrap(lse_ht.T), vb, sb)
    assert fake_cuda.counts()["launches"] == n0 + 1
    assert tuple(o.shape) == (t, h, d) and o.dtype == torch.bfloat16 and tuple(lse.shape) == (t, h)
    assert lse.dtype == torch.float32
    c = choose.choose(choose.Problem(d, "bf16", "pair", t, h), device_facts(0))
    got = fake_cuda.last_launch()
    assert got["grid"] == c.launch.grid == (-(-t * h * (d // 8) // c.spec.threads), 1, 1), (got, c)  # a thread a vector
    assert got["threads"] == c.spec.threads == 128 and got["smem"] == 0, got
    p = _PARAMS.unpack(fake_cuda.last_params(_PARAMS.size))
    assert p[:6] == (va_view.data_ptr(), vb.data_ptr(), lse_ht.data_ptr(), sb.data_ptr(), o.data_ptr(),
                     lse.data_ptr()), p[:6]
    assert p[6:11] == (2 * h * d, d, h * d, d, 0), p[6:11]           # v_a's tokens stride is the view's
    assert p[11:16] == (1, t, h, 1, 0), p[11:16]                     # s_a transposed: tokens stride 1
    assert p[16:20] == (h * d, d, h, 1) and p[20:] == (t, h, 2), p[16:]

    # the caller's outputs: a values view with a tokens stride, and an LSE
    obig, lout = rand(2 * t, h, d), f32(t, h)
    r = attngen.merge_state(va, sa, vb, sb, out=(obig[::2], lout))
    assert r[0].data_ptr() == obig.data_ptr() and r[1] is lout
    p = _PARAMS.unpack(fake_cuda.last_params(_PARAMS.size))
    assert p[4:6] == (obig.data_ptr(), lout.data_ptr()) and p[16:20] == (2 * h * d, d, h, 1), p
    # the same call again (its kept _Call) reads the same
    attngen.merge_state(va, sa, vb, sb, out=(obig[::2], lout))
    assert _PARAMS.unpack(fake_cuda.last_params(_PARAMS.size)) == p

    # merge_states: fp32 values, head_dim 200 (its last chunk part of a warp), 6 states
    n = 6
    v, s = f32(t, n, h, 200), f32(t, n, h)
    o, lse = attngen.merge_states(v, s)
    assert o.dtype == torch.float32 and tuple(o.shape) == (t, h, 200)
    c = choose.choose(choose.Problem(200, "fp32", "many", t, h), device_facts(0))
    assert c.spec.chunks == 2 and c.spec.states.value == "many", c.spec
    assert fake_cuda.last_launch()["grid"] == c.launch.grid == (-(-t * h * 2 // c.spec.num_warps), 1, 1)
    p = _PARAMS.unpack(fake_cuda.last_params(_PARAMS.size))
    assert p[:6] == (v.data_ptr(), 0, s.data_ptr(), 0, o.data_ptr(), lse.data_ptr()), p[:6]
    assert p[6:11] == (n * h * 200, 200, 0, 0, h * 200) and p[11:16] == (n * h, 1, 0, 0, h), p[6:16]
    assert p[20:] == (t, h, n), p[20:]

    # while torch.compile traces: refused by name (the merges are not torch custom ops)
    from attngen import runtime

    was, runtime.tracing = runtime.tracing, lambda: True
    try:
        refused(lambda: attngen.merge_state(va, sa, vb, sb), "attngen.merge_state is not a torch custom op",
                "allowed: calls outside torch.compile")
        refused(lambda: attngen.merge_states(v, s), "attngen.merge_states is not a torch custom op")
    finally:
        runtime.tracing = was

    # no rows: outputs, no launch
    n0 = fake_cuda.counts()["launches"]
    o, lse = attngen.merge_state(rand(0, h, d), f32(0, h), rand(0, h, d), f32(0, h))
    assert tuple(o.shape) == (0, h, d) and tuple(lse.shape) == (0, h)
    o0, l0 = rand(0, h, d), f32(0, h)
    r = attngen.merge_state(rand(0, h, d), f32(0, h), rand(0, h, d), f32(0, h), out=(o0, l0))
    assert r[0] is o0 and r[1] is l0, "the caller's outputs come back, even empty ones"
    assert fake_cuda.counts()["launches"] == n0
    print("ok")


if __name__ == "__main__":
    main()
