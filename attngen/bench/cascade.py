"""``attngen bench cascade``: decode of many requests that share one prefix, ``cascade_decode`` (the prefix's KV read
once for the batch) against ``decode`` reading the prefix again for every request, on the same values in one run.

Each shape: ``requests`` requests of ``q_len`` new tokens (GQA 32/8, head dim 128, bf16) after a prefix of ``prefix``
keys, each with its own keys after it (``own`` min,max, uniform; the new tokens among them) in a paged cache (page
16, blocks at random places). Against two ways an engine without cascade runs the same step: ``decode`` over block
tables that point every request at the prefix's pages, then its own (shared pages: one copy of the prefix, read once a
request, partly from L2), and ``decode`` over a contiguous cache holding a copy of the prefix in every row (copied).
Every side is a CUDA graph over rotated copies of its caches (shared pages, cascade) so that no replay finds the last
one's bytes in L2; the copied cache is far larger than L2. The outputs are checked against each other (relative L2).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from .core import (_event_bench, _fmt, _graphed, _int_list, _rel_check, _say, env_lines, environment, have_gpu,
                   interleaved, ratio_summary, write_json)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
COPIES = 3  # rotated copies of the paged caches (and the prefix)
PEERS = ("shared_pages", "copied")


def add_parser(sub) -> None:
    p = sub.add_parser("cascade", help="cascade_decode (a shared prefix read once) vs decode reading it per request",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=_int_list, default=(64,), help="requests a step (default 64)")
    p.add_argument("--prefix", type=_int_list, default=(4096, 16384),
                   help=f"shared prefix keys, a multiple of {PAGE} (default 4k,16k)")
    p.add_argument("--own", default="256,2048", help="each request's own keys: min,max (default 256,2048)")
    p.add_argument("--q-len", type=int, default=1, help="new tokens a request, 1..8 (default 1)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench_cascade.json")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_cascade)


def own_lengths(requests: int, own: str, q_len: int, seed: int) -> list[int]:
    """Each request's own keys (new tokens included), uniform in ``own`` ("min,max"), at least ``q_len``."""
    lo, hi = (int(x) for x in own.split(","))
    if not 1 <= lo <= hi:
        raise ValueError(f"--own {own!r}: expected min,max with 1 <= min <= max")
    rng = random.Random(seed)
    return [max(q_len, rng.randint(lo, hi)) for _ in range(requests)]


def block_tables(lens: list[int], prefix_blocks: int, seed: int) -> tuple[list[list[int]], list[list[int]], int]:
    """(own, shared, pool blocks): each request's own blocks at random places in a pool of ``pool blocks``, and the
    shared-pages table of the same requests over a pool that holds the prefix's blocks first (blocks 0 ..
    prefix_blocks - 1, every request's table starting with them) and the own pool after them."""
    counts = [-(-n // PAGE) for n in lens]
    pool = sum(counts)
    order = list(range(pool))
    random.Random(seed + 1).shuffle(order)
    own, at = [], 0
    for c in counts:
        own.append(order[at:at + c])
        at += c
    shared = [list(range(prefix_blocks)) + [prefix_blocks + b for b in row] for row in own]
    return own, shared, pool


def _padded(torch, rows: list[list[int]], dev):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32, device=dev)


def measure(torch, requests: int, prefix: int, args) -> dict:
    import attngen

    if prefix % PAGE:
        raise ValueError(f"--prefix {prefix}: a multiple of {PAGE} (the shared pages hold it as whole blocks)")
    h, hk, d, dt, dev = HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda"
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    lens = own_lengths(requests, args.own, args.q_len, args.seed)
    own_rows, shared_rows, pool = block_tables(lens, prefix // PAGE, args.seed)
    own_table, shared_table = _padded(torch, own_rows, dev), _padded(torch, shared_rows, dev)
    own_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    all_lens = own_lens + prefix
    q = torch.randn(requests, args.q_len, h, d, device=dev, dtype=dt, generator=gen)
    copies = []
    for _ in range(COPIES):
        pk, pv = (torch.randn(prefix, hk, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
        ok_, ov = (torch.randn(pool, PAGE, hk, d, device=dev, dtype=dt, generator=gen) for _ in range(2))
        # shared pages: the prefix's blocks, then the own pool (the same values as the cascade's)
        sk, sv = (torch.cat([p.view(-1, PAGE, hk, d), o]) for p, o in ((pk, ok_), (pv, ov)))
        copies.append((pk, pv, ok_, ov, sk, sv))
    outs: dict = {}

    def cascade(c):
        outs["cascade"] = attngen.cascade_decode(q, c[0], c[1], c[2], c[3], cache_seqlens=own_lens,
                                                 block_table=own_table)

    def shared(c):
        outs["shared_pages"] = attngen.decode(q, c[4], c[5], cache_seqlens=all_lens, block_table=shared_table)

    graphs = {"cascade": _graphed(*(lambda c=c: cascade(c) for c in copies)),
              "shared_pages": _graphed(*(lambda c=c: shared(c) for c in copies))}
    # copied: every row holds the first copy's prefix then its own keys, contiguous
    c0 = copies[0]
    width = prefix + max(lens)
    kc = torch.zeros(requests, width, hk, d, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    for i, n in enumerate(lens):
        for cache, pre, pool_ in ((kc, c0[0], c0[2]), (vc, c0[1], c0[3])):
            cache[i, :prefix] = pre
            cache[i, prefix:prefix + n] = pool_[own_table[i, :-(-n // PAGE)].long()].reshape(-1, hk, d)[:n]
    graphs["copied"] = _graphed(lambda: outs.__setitem__(
        "copied", attngen.decode(q, kc, vc, cache_seqlens=all_lens)))
    # no L2 flush: the rotated copies keep the caches out of L2, and a flush's dirty lines would be written back
    # inside the timing
    ms = interleaved(graphs, args.rep_ms, timer=lambda g, rep: _event_bench(g, 25.0, rep, None, flush=False))
    ms = {k: v / (1 if k == "copied" else COPIES) for k, v in ms.items()}
    # checks: each side's output for the first copy against the copied cache's (the plain decode of the same keys)
    cascade(c0)
    shared(c0)
    torch.cuda.synchronize()
    ref = outs["copied"].float()
    checks = {k: _rel_check(outs[k], ref) for k in ("cascade", "shared_pages")}
    kv_row = hk * d * 2 * 2  # K and V bytes a key
    reads = {"cascade": (prefix + sum(lens)) * kv_row, "per_request": (prefix * requests + sum(lens)) * kv_row}
    shape = f"requests={requests} prefix={prefix} own={args.own} q_len={args.q_len}"
    rec = {"shape": shape, "requests": requests, "prefix": prefix, "own": lens, "q_len": args.q_len, "ms": ms,
           "bytes": reads, "checks": checks, "ratio": {p: ms[p] / ms["cascade"] for p in PEERS}}
    _say(f"{shape}: cascade {ms['cascade'] * 1e3:.1f} us ({reads['cascade'] / ms['cascade'] / 1e9:.2f} TB/s of "
         f"its bytes), shared pages {ms['shared_pages'] * 1e3:.1f} us ({rec['ratio']['shared_pages']:.2f}x), "
         f"copied {ms['copied'] * 1e3:.1f} us ({rec['ratio']['copied']:.2f}x); rel L2 "
         + ", ".join(f"{k} {_fmt(v['rel_l2'], '.1e')}" for k, v in checks.items()))
    return rec


def cmd_cascade(args: argparse.Namespace) -> int:
    if not have_gpu():
        _say("attngen bench cascade needs a CUDA GPU (torch with CUDA)")
        return 2
    if not 1 <= args.q_len <= 8:
        _say(f"--q-len {args.q_len}: 1..8 (decode's new tokens a request)")
        return 2
    import torch

    env = environment()
    for line in env_lines(env):
        _say(line)
    results = [measure(torch, n, p, args) for n in args.requests for p in args.prefix]
    summary = {p: ratio_summary([(r["ratio"][p], r) for r in results], lambda r: r["shape"]) for p in PEERS}
    out = {"benchmark": "cascade", "env": env, "results": results, "summary": {"ratio": summary}}
    args.result = out
    if args.out:
        write_json(Path(args.out) / "bench_cascade.json", out)
    return 0 if all(c["ok"] for r in results for c in r["checks"].values()) else 1
