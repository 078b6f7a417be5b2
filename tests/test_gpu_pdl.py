"""Programmatic dependent launch on a real GPU (pytest -m gpu): kernels that read what the kernel
just before them wrote.

On sm_90 and newer decode's split kernel launches with the programmatic-serialization attribute
(the merge without), and each of its kernels lets the next one start launching as soon as it
starts itself. A kernel that read its
inputs before ``griddepcontrol.wait`` would therefore see the previous kernel's output buffer
before it is written: every buffer starts as NaN, so such a read fails the comparison. Each step
of a chain takes the previous step's output as its query (split and merge launches, forced
splits and one split), eagerly and replayed from a CUDA graph, against an fp32 reference of
that step computed from the same input. mla_decode's 16- and 32-row modules launch their merge entries with the
attribute (the split kernel lets them start), its 64-row ones without (measured slower at 128 heads, BENCHMARKS.md);
its chain (16 heads, split) guards the same ordering.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen import runtime  # noqa: E402
from tests.gpu_reference import fresh_generator, reference_decode, reference_mla, rel  # noqa: E402

STEPS = 6
NAN = float("nan")


def _sm90():
    return torch.cuda.get_device_capability()[0] >= 9


def _rand(*shape, gen, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


@pytest.fixture(params=[True, False], ids=["pdl", "no_pdl"])
def pdl(request):
    was = runtime.set_pdl(request.param)
    yield request.param
    runtime.set_pdl(was)


def _run_chain(step, first, bufs, graph: bool):
    """bufs[i] receives step i's output, whose input is bufs[i - 1] (``first`` for step 0)."""
    for b in bufs:
        b.fill_(NAN)

    def chain():
        x = first
        for b in bufs:
            step(x, b)
            x = b

    if not graph:
        chain()
    else:
        chain()  # warm: every kernel loaded before capture
        for b in bufs:
            b.fill_(NAN)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            g.capture_begin()
            chain()
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        for b in bufs:
            b.fill_(NAN)
        g.replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_chain_reads_the_previous_output(pdl, graph, num_splits):
    gen = fresh_generator()
    b, h, hk, d, cap = 3, 16, 4, 128, 1536
    q0 = _rand(b, 1, h, d, gen=gen)
    kc, vc = _rand(b, cap, hk, d, gen=gen), _rand(b, cap, hk, d, gen=gen)
    lens = torch.tensor([1, 700, 1536], dtype=torch.int32, device="cuda")
    bufs = [torch.empty_like(q0) for _ in range(STEPS)]

    def step(x, out):
        attngen.decode(x, kc, vc, cache_seqlens=lens, num_splits=num_splits, out=out)

    _run_chain(step, q0, bufs, graph)
    x = q0
    for i, o in enumerate(bufs):
        ref, _ = reference_decode(x, kc, vc, lens)
        assert not o.isnan().any(), f"step {i}: NaN (read its input before the previous step wrote it)"
        assert rel(o, ref) < 2e-2, (i, rel(o, ref))
        x = o


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_mla_chain_reads_the_previous_output(pdl, graph):
    gen = fresh_generator()
    b, h, n = 2, 16, 2000
    q_nope0, q_pe = _rand(b, 1, h, 512, gen=gen), _rand(b, 1, h, 64, gen=gen)
    ckv, kpe = _rand(b, n, 512, gen=gen), _rand(b, n, 64, gen=gen)
    lens = torch.tensor([333, 2000], dtype=torch.int32, device="cuda")
    scale = 576 ** -0.5
    bufs = [torch.empty_like(q_nope0) for _ in range(STEPS)]

    def step(x, out):
        attngen.mla_decode(x, q_pe, ckv, kpe, cache_seqlens=lens, sm_scale=scale, num_splits=3, out=out)

    _run_chain(step, q_nope0, bufs, graph)
    x = q_nope0
    for i, o in enumerate(bufs):
        ref, _ = reference_mla(x, q_pe, ckv, kpe, lens, scale)
        assert not o.isnan().any(), f"step {i}: NaN (read its input before the previous step wrote it)"
        assert rel(o, ref) < 2e-2, (i, rel(o, ref))
        x = o


def test_decode_kernels_launch_with_pdl_where_the_arch_has_it():
    gen = fresh_generator()
    q = _rand(1, 1, 8, 128, gen=gen)
    kc = _rand(1, 256, 8, 128, gen=gen)
    attngen.decode(q, kc, kc, cache_seqlens=100)
    loaded = [k for k in list(runtime._kernels.values()) if k.spec.family == "decode"]
    assert loaded and all(k.pdl == _sm90() for k in loaded)
    others = [k for k in list(runtime._kernels.values()) if k.spec.family in ("prefill", "mla_decode")]
    assert all(not k.pdl for k in others)
