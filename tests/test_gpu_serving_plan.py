"""BatchAttention.plan on a real GPU (pytest -m gpu): what its one launch writes against torch (the decode kernel's
request order, the paged prefill kernel's cu_k, the prefill kernel's work list) on random batches of 1 to 4096
requests, before and after graph replays with new lengths; the step's outputs at those sizes against fp32 attention
(empty rows, one-token rows, all-decode and all-prefill batches)."""

from __future__ import annotations

import random

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.serving import MAX_PLAN_BATCH  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.serving_reference import check, make_step, reference  # noqa: E402

MIXES = {  # (kind, weight): decode 1 token, verify 2-8, empty, prefill 9-300
    "mixed": (("decode", 6), ("verify", 2), ("empty", 1), ("prefill", 1)),
    "decode": (("decode", 1),),
    "prefill": (("prefill", 1),),
    "ties": (("decode_tie", 4), ("prefill", 1)),
}
ORDER_BUCKETS = 2048  # plan.cuh: work keys past this share the last bucket


def random_batch(rng: random.Random, b: int, mix: str, max_keys: int = 20000) -> tuple[list[int], list[int]]:
    """q_lens and cache lens (new tokens included) of b requests drawn from ``mix``."""
    kinds, weights = zip(*MIXES[mix])
    q_lens, lens = [], []
    for kind in rng.choices(kinds, weights, k=b):
        n = {"decode": 1, "decode_tie": 1, "verify": rng.randint(2, 8), "empty": 0,
             "prefill": rng.randint(9, 300)}[kind]
        keys = rng.choice((100, 4096)) if kind == "decode_tie" else n + rng.randint(0, max_keys)
        q_lens.append(n)
        lens.append(keys)
    return q_lens, lens


def expected_plan(q_lens, lens, max_decode_q_len: int, block_m: int, block_n: int):
    """torch's plan (causal): cu_k, the decode order (decode requests by keys, longest first, ties by index, then
    the others by index), the per-request tile offsets and each list item (request, query tile) with its KV tiles."""
    ql = torch.tensor(q_lens, dtype=torch.int64)
    kl = torch.tensor(lens, dtype=torch.int64)
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int64)
    cu_k[1:] = kl.cumsum(0)
    dec = (ql > 0) & (ql <= max_decode_q_len)
    di = dec.nonzero().flatten()
    di = di[torch.sort(kl[di], descending=True, stable=True).indices]
    order = torch.cat((di, (~dec).nonzero().flatten()))
    tiles = torch.where(ql > max_decode_q_len, (ql + block_m - 1) // block_m, 0)
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = tiles.cumsum(0)
    items = {}
    for s in tiles.nonzero().flatten().tolist():
        sq, sk = q_lens[s], lens[s]
        for t in range(int(tiles[s])):
            hi = min(sk, min((t + 1) * block_m, sq) - 1 + sk - sq + 1)
            items[(s, t)] = -(-hi // block_n) if hi > 0 else 0
    return cu_k, order, offsets, items


def check_plan(ba, q_lens, lens):
    """The plan's buffers (as run reads them) against expected_plan."""
    torch.cuda.synchronize()
    _, _, _, cu_k, order, _, order_b = ba._planned
    block_m, block_n, _ = order.tiles
    cu_k_ref, order_ref, offsets_ref, items_ref = expected_plan(q_lens, lens, ba.max_decode_q_len, block_m, block_n)
    b = len(lens)
    assert torch.equal(cu_k.cpu().long(), cu_k_ref)
    assert torch.equal(order_b.cpu().long(), order_ref)
    ws = order.ws.cpu().long()
    m = order.max_items
    count = int(ws[2 * m])
    assert count == len(items_ref) <= m
    assert torch.equal(ws[2 * m + 1:2 * m + 2 + b], offsets_ref)
    got = [tuple(x) for x in ws[:2 * count].view(count, 2).tolist()]
    assert sorted(got) == sorted(items_ref)
    works = [min(items_ref[it], ORDER_BUCKETS - 1) for it in got]
    assert all(a >= b for a, b in zip(works, works[1:])), "the work list is not heaviest first"


def plan_inputs(q_lens, lens, page: int, dev="cuda"):
    cu = torch.tensor([0] + list(torch.tensor(q_lens, dtype=torch.int64).cumsum(0)), dtype=torch.int32, device=dev)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    table = torch.zeros(len(lens), max(1, -(-max(lens) // page)), dtype=torch.int32, device=dev)
    return cu, cache_lens, table


@pytest.mark.parametrize("b", [1, 7, 128, 512, 513, MAX_PLAN_BATCH])
@pytest.mark.parametrize("mix", list(MIXES))
def test_the_plan_matches_torch(b, mix):
    rng = random.Random(b * 31 + len(mix))
    q_lens, lens = random_batch(rng, b, mix)
    cu, cache_lens, table = plan_inputs(q_lens, lens, 16)
    ba = attngen.BatchAttention(32, 8, 128, 16, dtype=torch.bfloat16)
    ba.plan(cu, cache_lens, table, total_q=sum(q_lens))
    check_plan(ba, q_lens, lens)


@pytest.mark.parametrize("page,max_decode_q_len", [(1, 4), (64, 16)])
def test_the_plan_follows_the_decode_bound_and_page(page, max_decode_q_len):
    rng = random.Random(page)
    q_lens, lens = random_batch(rng, 300, "mixed", max_keys=3000)
    cu, cache_lens, table = plan_inputs(q_lens, lens, page)
    ba = attngen.BatchAttention(16, 4, 128, page, dtype=torch.float16, max_decode_q_len=max_decode_q_len)
    ba.plan(cu, cache_lens, table, total_q=sum(q_lens))
    check_plan(ba, q_lens, lens)


def test_graph_replays_of_the_plan_follow_new_lengths():
    rng = random.Random(5)
    b, page = 513, 16
    batches = [random_batch(rng, b, mix) for mix in ("mixed", "decode", "prefill", "ties", "mixed")]
    total_q = max(sum(q) for q, _ in batches)
    max_keys = max(max(k) for _, k in batches)
    q_lens, lens = batches[0]
    cu, cache_lens, _ = plan_inputs(q_lens, lens, page)
    table = torch.zeros(b, -(-max_keys // page), dtype=torch.int32, device="cuda")
    ba = attngen.BatchAttention(32, 8, 128, page, dtype=torch.bfloat16)
    ba.plan(cu, cache_lens, table, total_q=total_q)  # loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ba.plan(cu, cache_lens, table, total_q=total_q)
    for q_lens, lens in batches:
        cu2, lens2, _ = plan_inputs(q_lens, lens, page)
        cu.copy_(cu2)
        cache_lens.copy_(lens2)
        graph.replay()
        check_plan(ba, q_lens, lens)


@pytest.mark.parametrize("b", [1, 7, 128, 513])
@pytest.mark.parametrize("mix", ["mixed", "decode", "prefill"])
def test_the_step_at_size_matches_attention_per_request(b, mix):
    gen = fresh_generator()
    rng = random.Random(b + len(mix))
    dtype, h, hk, d, page = torch.bfloat16, 16, 4, 128, 16
    q_lens, lens = random_batch(rng, b, mix, max_keys=1500)
    if mix == "prefill" and b > 128:
        q_lens = [min(n, 40) for n in q_lens]  # the reference's time
    q, kc, vc, table, cu, cache_lens = make_step(gen, q_lens, lens, h, hk, d, page, dtype)
    ba = attngen.BatchAttention(h, hk, d, page, dtype=dtype)
    ba.plan(cu, cache_lens, table, total_q=q.shape[0])
    out = torch.full_like(q, float("nan"))
    o, lse = ba.run(q, kc, vc, out=out, return_lse=True)
    check_plan(ba, q_lens, lens)
    ref_o, ref_l = reference(q, kc, vc, table, q_lens, lens, d ** -0.5)
    check(o, lse, ref_o, ref_l, dtype)
