"""The serving step's GPU test helpers (tests/test_gpu_serving*.py, tests/test_gpu_paged_any.py): a ragged step on a
paged cache, fp32 attention request by request, and the check of a step's output and LSE against it."""

from __future__ import annotations

import torch

MAX_ABS = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def tree_words(q_len: int, gen, dev) -> list[int]:
    """A random tree over q_len draft tokens: token i sees itself and its ancestors (parent < i)."""
    words = []
    for i in range(q_len):
        parent = int(torch.randint(0, i, (1,), generator=gen, device=dev)) if i else -1
        words.append((words[parent] if parent >= 0 else 0) | (1 << i))
    return words


def make_step(gen, q_lens, lens, h, hk, d, page, dtype, dev="cuda"):
    """Packed q, a paged cache holding every request's keys (pages in random order), its table and lengths."""
    b = len(q_lens)
    per = max(1, -(-max(lens) // page))
    total = sum(q_lens)
    q = torch.randn(total, h, d, device=dev, dtype=dtype, generator=gen)
    kc = torch.randn(b * per + 3, page, hk, d, device=dev, dtype=dtype, generator=gen)
    vc = torch.randn(b * per + 3, page, hk, d, device=dev, dtype=dtype, generator=gen)
    table = torch.randperm(b * per + 3, device=dev, generator=gen)[:b * per].to(torch.int32).view(b, per)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q, kc, vc, table, cu, cache_lens


def reference(q, kc, vc, table, q_lens, lens, scale, tree=None, max_tree=0, sinks=None):
    """fp32 (out [total, h, d], lse [h, total]) request by request; tree words apply to requests of at most
    max_tree tokens, the others are causal."""
    h, d = q.shape[1], q.shape[2]
    hk, page = kc.shape[2], kc.shape[1]
    outs, lses, at = [], [], 0
    for b, (n, L) in enumerate(zip(q_lens, lens)):
        if n == 0:
            continue
        blocks = table[b, :-(-L // page)].long()
        k = kc[blocks].reshape(-1, hk, d)[:L].float().repeat_interleave(h // hk, dim=1)
        v = vc[blocks].reshape(-1, hk, d)[:L].float().repeat_interleave(h // hk, dim=1)
        s = torch.einsum("thd,nhd->htn", q[at:at + n].float(), k) * scale
        keys = torch.arange(L, device=q.device)
        first = L - n
        if tree is not None and n <= max_tree:
            words = tree[at:at + n]
            bit = (keys - first).clamp(min=0, max=62)
            seen = (keys[None, :] < first) | (((words[:, None] >> bit[None, :]) & 1) == 1)
        else:
            seen = keys[None, :] <= (first + torch.arange(n, device=q.device))[:, None]
        s = s.masked_fill(~seen[None], float("-inf"))
        if sinks is not None:
            s = torch.cat((s, sinks.float()[:, None, None].expand(h, n, 1)), dim=-1)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1)[..., :L]
        outs.append(torch.einsum("htn,nhd->thd", p, v))
        lses.append(lse)
        at += n
    return torch.cat(outs), torch.cat(lses, dim=1)


def check(out, lse, ref_o, ref_l, dtype):
    assert not torch.isnan(out).any()
    assert (out.float() - ref_o).abs().max().item() < MAX_ABS[dtype]
    assert (lse - ref_l).abs().max().item() < 2e-3
