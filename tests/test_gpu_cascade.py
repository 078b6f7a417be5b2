"""attngen.cascade_decode on a real GPU against attention over the prefix and the request's own keys, in fp32
(pytest -m gpu). Fresh random inputs each run, outputs poisoned with NaN first."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402

MAX_ABS = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def reference(q, prefix_k, prefix_v, own_k, own_v, lens, scale):
    """fp32 attention of q [b, sq, h, d] over prefix + own keys (own_k [b, L, hk, d], row b's first lens[b]
    keys, causal within them): (out [b, sq, h, d], lse [b * sq, h])."""
    b, sq, h, d = q.shape
    hk = prefix_k.shape[1]
    outs, lses = [], []
    for i in range(b):
        L = int(lens[i])
        k = torch.cat((prefix_k, own_k[i, :L])).float().repeat_interleave(h // hk, dim=1)  # [n, h, d]
        v = torch.cat((prefix_v, own_v[i, :L])).float().repeat_interleave(h // hk, dim=1)
        s = torch.einsum("thd,nhd->htn", q[i].float(), k) * scale                            # [h, sq, n]
        n = k.shape[0]
        pos = prefix_k.shape[0] + L - sq + torch.arange(sq, device=q.device)                  # each token's position
        s = s.masked_fill(torch.arange(n, device=q.device)[None, None, :] > pos[None, :, None], float("-inf"))
        lses.append(torch.logsumexp(s, dim=-1).t())                                           # [sq, h]
        outs.append(torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v))
    return torch.stack(outs), torch.cat(lses)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("prefix,sq,paged,splits", [
    (4096, 1, False, 0), (5000, 3, True, 0), (300, 1, False, 0), (0, 2, False, 0), (2049, 1, True, 5),
    (1024, 8, False, 1),
])
def test_cascade_matches_attention_over_prefix_and_own_keys(dtype, prefix, sq, paged, splits):
    gen = fresh_generator()
    seed = gen.initial_seed()
    b, h, hk, d, cap = 6, 16, 4, 128, 320
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype, generator=gen)
    pk = torch.randn(prefix, hk, d, device=dev, dtype=dtype, generator=gen)
    pv = torch.randn(prefix, hk, d, device=dev, dtype=dtype, generator=gen)
    own_k = torch.randn(b, cap, hk, d, device=dev, dtype=dtype, generator=gen)
    own_v = torch.randn(b, cap, hk, d, device=dev, dtype=dtype, generator=gen)
    lens = torch.randint(sq, cap + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
    lens[0] = sq  # a request whose own keys are only its new tokens
    kw = {}
    if paged:
        bs = 16
        per = cap // bs
        table = torch.randperm(b * per, device=dev, generator=gen).to(torch.int32).view(b, per)
        kc = torch.empty(b * per, bs, hk, d, device=dev, dtype=dtype)
        vc = torch.empty_like(kc)
        kc[table.view(-1).long()] = own_k.view(b * per, bs, hk, d)
        vc[table.view(-1).long()] = own_v.view(b * per, bs, hk, d)
        kw["block_table"] = table
    else:
        kc, vc = own_k, own_v
    out = torch.full((b, sq, h, d), float("nan"), device=dev, dtype=dtype)
    got, lse = attngen.cascade_decode(q, pk, pv, kc, vc, cache_seqlens=lens, splits=splits, return_lse=True,
                                      out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    ref, ref_lse = reference(q, pk, pv, own_k, own_v, lens, d ** -0.5)
    err = (got.float() - ref).abs().max().item()
    assert err <= MAX_ABS[dtype], f"seed {seed}: max |err| {err}"
    lerr = (lse - ref_lse).abs().max().item()
    assert lerr <= 1e-3, f"seed {seed}: LSE max |err| {lerr}"
    plain = attngen.cascade_decode(q, pk, pv, kc, vc, cache_seqlens=lens, **kw)  # every option at its default
    assert (plain.float() - ref).abs().max().item() <= MAX_ABS[dtype], f"seed {seed}"


def test_cascade_refuses_by_name_on_the_gpu():
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    pk = torch.randn(100, 2, 64, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(2, 50, 2, 64, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((2,), 10, device="cuda", dtype=torch.int32)
    with pytest.raises(attngen.LaunchError, match="prefix_k"):
        attngen.cascade_decode(q, pk[:, :1], pk, kc, kc, cache_seqlens=lens)
    with pytest.raises(attngen.LaunchError, match="out must"):
        attngen.cascade_decode(q, pk, pk, kc, kc, cache_seqlens=lens, out=torch.empty(2, 1, 8, 32, device="cuda"))


def test_cascade_on_a_stream_of_the_callers_and_in_a_cuda_graph():
    # The prefix's stage runs on a stream of attngen's, forked from the caller's current stream before the own
    # decode and joined after it: a read of the output queued on the caller's stream right after the call sees it
    # whole, and a CUDA graph captures both streams' launches (replayed here after new values are copied into its
    # inputs). A prefix of 3001 keys (a prime) leaves keys over for a launch of their own on that stream.
    gen = fresh_generator()
    seed = gen.initial_seed()
    b, h, hk, d, cap, dev, dt = 4, 16, 4, 128, 256, "cuda", torch.bfloat16
    q = torch.randn(b, 1, h, d, device=dev, dtype=dt, generator=gen)
    pk, pv = (torch.randn(3001, hk, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    kc, vc = (torch.randn(b, cap, hk, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
    lens = torch.randint(1, cap + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
    theirs = torch.cuda.Stream()
    theirs.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(theirs):
        got = attngen.cascade_decode(q, pk, pv, kc, vc, cache_seqlens=lens).float()
    torch.cuda.current_stream().wait_stream(theirs)
    ref, _ = reference(q, pk, pv, kc, vc, lens, d ** -0.5)
    assert (got - ref).abs().max().item() <= MAX_ABS[dt], f"seed {seed}"

    out = torch.full((b, 1, h, d), float("nan"), device=dev, dtype=dt)
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        attngen.cascade_decode(q, pk, pv, kc, vc, cache_seqlens=lens, out=out)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attngen.cascade_decode(q, pk, pv, kc, vc, cache_seqlens=lens, out=out)
    for x in (q, pk, pv, kc, vc):
        x.copy_(torch.randn(x.shape, device=dev, dtype=dt, generator=gen))
    lens.copy_(torch.randint(1, cap + 1, (b,), device=dev, generator=gen, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref, _ = reference(q, pk, pv, kc, vc, lens, d ** -0.5)
    assert (out.float() - ref).abs().max().item() <= MAX_ABS[dt], f"seed {seed}"
