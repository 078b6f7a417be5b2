"""attngen's ops as PyTorch custom ops (pytest -m gpu): torch.library's own checks of each op and
its fake implementation, torch.compile(fullgraph=True) over functions that call attngen.prefill,
prefill_varlen, decode and mla_decode (a graph break fails the test), and mode="reduce-overhead" (CUDA graphs)
with fresh inputs per call, each against the eager call and the fp32 reference."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]
torch = pytest.importorskip("torch")

import attngen  # noqa: E402
import attngen.torch_ops  # noqa: E402,F401  (registers the ops whatever the import order)
from tests.gpu_reference import reference_attention, reference_decode, reference_mla, rel  # noqa: E402

TOL = 2e-2


def rnd(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


@pytest.fixture
def gen():
    g = torch.Generator(device="cuda")
    g.seed()
    return g


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _varlen_inputs(gen):
    cu = torch.tensor([0, 7, 207, 207, 500], dtype=torch.int32, device="cuda")
    return rnd(500, 8, 64, gen=gen), rnd(500, 2, 64, gen=gen), rnd(500, 2, 64, gen=gen), cu


def test_opcheck_each_op(gen, cache_dir):
    q, k, v = rnd(2, 70, 8, 64, gen=gen), rnd(2, 90, 2, 64, gen=gen), rnd(2, 90, 2, 64, gen=gen)
    for lse in (False, True):
        torch.library.opcheck(torch.ops.attngen.prefill.default,
                              (q, k, v, True, -1, -1, None, 0.0, None, lse, None, None))
    keep = torch.rand(70, 90, device="cuda", generator=gen) < 0.5
    torch.library.opcheck(torch.ops.attngen.prefill.default, (q, k, v, False, -1, -1, 0.2, 0.0, None, True, None, keep))
    vq, vk, vv, cu = _varlen_inputs(gen)
    torch.library.opcheck(torch.ops.attngen.prefill_varlen.default,
                          (vq, vk, vv, cu, cu, 293, 293, True, -1, -1, None, 0.0, None, None, True, None))
    dq, kc = rnd(3, 1, 8, 128, gen=gen), rnd(3, 256, 2, 128, gen=gen)
    lens = torch.tensor([1, 100, 256], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.attngen.decode.default,
                          (dq, kc, kc.clone(), lens, 0, None, None, 0, None, True, "auto", None, 0.0, None))


def test_compile_fullgraph_prefill(gen, cache_dir):
    def f(q, k, v, keep):
        o, lse = attngen.prefill(q * 2, k, v, causal=True, return_lse=True)
        m = attngen.prefill(q, k, v, mask=keep, spec="prefill:head_dim=64,cta_tile_q=64")
        w = attngen.flash_attn_func(q, k, v, window_size=(32, 0), softmax_scale=0.1)
        return o, m, w, lse

    q, k, v = rnd(2, 130, 8, 64, gen=gen), rnd(2, 200, 2, 64, gen=gen), rnd(2, 200, 2, 64, gen=gen)
    keep = torch.rand(130, 200, device="cuda", generator=gen) < 0.3
    outs = torch.compile(f, fullgraph=True)(q, k, v, keep)
    # The ops' outputs are the eager calls' bit for bit (a sum of them is not: inductor adds in fp32).
    assert all(torch.equal(a, b) for a, b in zip(outs, f(q, k, v, keep)))
    got = sum(x.float() for x in outs[:3])
    ref = reference_attention(q * 2, k, v, causal=True)[0] + reference_attention(q, k, v, window=(32, 0),
                                                                                  sm_scale=0.1)[0]
    bias = torch.zeros(130, 200, device="cuda").masked_fill(~keep, float("-inf"))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float().repeat_interleave(4, dim=2)) * 64 ** -0.5 + bias
    ref = ref + torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1).nan_to_num(), v.float().repeat_interleave(4, dim=2))
    assert rel(got, ref) < TOL


def test_compile_fullgraph_varlen_and_decode(gen, cache_dir):
    vq, vk, vv, cu = _varlen_inputs(gen)
    dq, kc, vc = rnd(3, 2, 8, 128, gen=gen), rnd(3, 256, 2, 128, gen=gen), rnd(3, 256, 2, 128, gen=gen)
    lens = torch.tensor([2, 100, 256], dtype=torch.int32, device="cuda")

    def f(vq, vk, vv, cu, dq, kc, vc, lens):
        o = attngen.prefill_varlen(vq, vk, vv, cu, cu, 293, 293, causal=True)
        d, lse = attngen.decode(dq, kc, vc, cache_seqlens=lens, return_lse=True)
        d2 = attngen.decode(dq, kc, vc, cache_seqlens=200)
        return o, d + d2, lse

    args = (vq, vk, vv, cu, dq, kc, vc, lens)
    got = torch.compile(f, fullgraph=True)(*args)
    want = f(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    for s, (a, b) in enumerate(((0, 7), (7, 207), (207, 500))):
        ref, _ = reference_attention(vq[None, a:b], vk[None, a:b], vv[None, a:b], causal=True)
        assert rel(got[0][None, a:b], ref) < TOL
    ref = reference_decode(dq, kc, vc, lens)[0] + reference_decode(dq, kc, vc, torch.full_like(lens, 200))[0]
    assert rel(got[1], ref) < TOL


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_compile_reduce_overhead_cuda_graphs(which, gen, cache_dir):
    if which == "prefill":
        def f(q, k, v):
            return attngen.prefill(q, k, v, causal=True) * 0.5

        def make():
            return rnd(1, 100, 8, 64, gen=gen), rnd(1, 100, 2, 64, gen=gen), rnd(1, 100, 2, 64, gen=gen)

        def ref(q, k, v):
            return reference_attention(q, k, v, causal=True)[0] * 0.5
    else:
        lens = torch.tensor([1, 77], dtype=torch.int32, device="cuda")

        def f(q, kc, vc):
            return attngen.decode(q, kc, vc, cache_seqlens=lens) * 0.5

        def make():
            return rnd(2, 1, 8, 128, gen=gen), rnd(2, 128, 2, 128, gen=gen), rnd(2, 128, 2, 128, gen=gen)

        def ref(q, kc, vc):
            return reference_decode(q, kc, vc, lens)[0] * 0.5
    g = torch.compile(f, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # the first calls record, later ones replay the graph on new inputs
        args = make()
        out = g(*args).clone()
        assert torch.equal(out, f(*args))
        assert rel(out, ref(*args)) < TOL


def test_mla_decode_op(gen, cache_dir):
    """opcheck, fullgraph and reduce-overhead for attngen::mla_decode."""
    qn, qp = rnd(2, 2, 16, 512, gen=gen), rnd(2, 2, 16, 64, gen=gen)
    ckv, kpe = rnd(2, 300, 512, gen=gen), rnd(2, 300, 64, gen=gen)
    lens = torch.tensor([3, 300], dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.attngen.mla_decode.default, (qn, qp, ckv, kpe, lens, 0, 0.07, None, 0, True, None))

    def f(qn, qp, ckv, kpe):
        o, lse = attngen.mla_decode(qn, qp, ckv, kpe, cache_seqlens=lens, sm_scale=0.07, return_lse=True)
        o2 = attngen.mla_decode(qn, qp, ckv, kpe, cache_seqlens=200, sm_scale=0.07,
                                spec="mla_decode:qk_shard=false")
        return o + o2, lse

    got = torch.compile(f, fullgraph=True)(qn, qp, ckv, kpe)
    assert all(torch.equal(a, b) for a, b in zip(got, f(qn, qp, ckv, kpe)))
    ref = reference_mla(qn, qp, ckv, kpe, lens, 0.07)[0] + reference_mla(qn, qp, ckv, kpe, [200, 200], 0.07)[0]
    assert rel(got[0], ref) < TOL
    torch._dynamo.reset()
    g = torch.compile(lambda *a: attngen.mla_decode(*a, cache_seqlens=lens, sm_scale=0.07) * 0.5,
                      mode="reduce-overhead", fullgraph=True)
    for _ in range(4):
        args = (rnd(2, 1, 16, 512, gen=gen), rnd(2, 1, 16, 64, gen=gen), ckv, kpe)
        out = g(*args).clone()
        assert rel(out, reference_mla(*args, lens, 0.07)[0] * 0.5) < TOL
