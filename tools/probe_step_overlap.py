"""Can a serving step run its decode rows (bound by the memory) and its chunked-prefill rows (bound by the matrix
products) at the same time on one GPU, rather than one launch after the other as ``BatchAttention.run`` does?

``attngen bench step`` shows the step at its serial bound: its decode part reads at a bare read's rate and its
prefill part runs at the prefill kernel's, so the separate calls' time over their sum is the most the serial step
can gain. More needs overlap. The default sm_90a prefill kernel holds a whole SM (a producer and two consumer
warpgroups, the register file and most of shared memory), so no decode CTA can share an SM with it; smaller prefill
kernels leave room but run slower alone. This times, for prefill kernels of several sizes on the step's own shapes
(128 decode requests of 1k-32k keys, 4 chunked-prefill requests of 2k tokens over 8k cached; GQA 32/8, head dim 128,
bf16, pages of 16): the prefill alone (and its TFLOP/s), the decode alone, both serial in one CUDA graph, and both as
two concurrent branches of one graph (each order of capture), medians of three rounds of rotated order. A kernel
whose concurrent time beats the default kernel's serial time is a way past the serial bound.

    PYTHONPATH=. python3 tools/probe_step_overlap.py [--rep-ms 60]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DECODE, KEYS = 128, (1024, 32768)
PREFILL, CHUNK, CACHED = 4, 2048, 8192
# the prefill kernels tried: None is the op's own choice (the TMA kernel, one CTA an SM)
KERNELS = {
    "default": None,
    "tma 64x128": "prefill:cta_tile_q=64,cta_tile_kv=128,num_warps=4,num_stages=2,mma=wgmma,pipeline=tma",
    "sync 64x64": "prefill:cta_tile_q=64,cta_tile_kv=64,num_warps=4,num_stages=2,mma=wgmma,pipeline=sync",
    "sync 128x64": "prefill:cta_tile_q=128,cta_tile_kv=64,num_warps=8,num_stages=2,mma=wgmma,pipeline=sync",
    "mma_sync 64x64": "prefill:cta_tile_q=64,cta_tile_kv=64,num_warps=4,num_stages=2,mma=mma_sync,pipeline=sync",
}


def graph(torch, *branches):
    """One CUDA graph of ``branches`` (lists of calls): the first on the capturing stream, each other on a stream
    forked from it and joined at the end; every call made twice first, outside the capture."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for fn in (f for b in branches for f in b):
            fn()
            fn()
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    forks = [torch.cuda.Stream() for _ in branches[1:]]
    with torch.cuda.graph(g):
        cur = torch.cuda.current_stream()
        for s, branch in zip(forks, branches[1:]):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                for fn in branch:
                    fn()
        for fn in branches[0]:
            fn()
        for s in forks:
            cur.wait_stream(s)
    return g.replay


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rep-ms", type=float, default=60.0)
    args = ap.parse_args()
    import torch

    import attngen
    from attngen.bench.core import interleaved

    dev, dt = "cuda", torch.bfloat16
    rng = random.Random(0)
    dec_lens = [int(math.exp(rng.uniform(*map(math.log, KEYS)))) for _ in range(DECODE)]
    lens = dec_lens + [CACHED + CHUNK] * PREFILL
    pages = [-(-n // PAGE) for n in lens]
    gen = torch.Generator(device=dev).manual_seed(0)
    kc = torch.randn(sum(pages), PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    vc = torch.randn_like(kc)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(at, at + n)
        at += n
    table = table.to(dev)
    t_dec, t_pf = table[:DECODE].contiguous(), table[DECODE:].contiguous()
    l_dec = torch.tensor(dec_lens, dtype=torch.int32, device=dev)
    q_dec = torch.randn(DECODE, 1, HEADS, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    q_pf = torch.randn(PREFILL * CHUNK, HEADS, HEAD_DIM, device=dev, dtype=dt, generator=gen)
    cu_q = torch.arange(0, PREFILL + 1, dtype=torch.int32, device=dev) * CHUNK
    cu_k = torch.arange(0, PREFILL + 1, dtype=torch.int32, device=dev) * (CACHED + CHUNK)
    flops = PREFILL * 4 * HEADS * HEAD_DIM * CHUNK * (CACHED + CHUNK - CHUNK / 2)

    def decode():
        attngen.decode(q_dec, kc, vc, cache_seqlens=l_dec, block_table=t_dec)

    def prefill(spec):
        return lambda: attngen.prefill_varlen(q_pf, kc, vc, cu_q, cu_k, CHUNK, CACHED + CHUNK, causal=True,
                                              block_table=t_pf, spec=spec)

    ref = prefill(None)().float()
    alone = graph(torch, [decode])
    rows = []
    for name, spec in KERNELS.items():
        try:
            fn = prefill(spec)
            err = (fn().float() - ref).abs().max().item()
            fns = {"prefill": graph(torch, [fn]), "decode": alone, "serial": graph(torch, [decode, fn]),
                   "concurrent": graph(torch, [fn], [decode]), "concurrent, decode captured first":
                   graph(torch, [decode], [fn])}
        except Exception as e:  # a kernel this arch or this layout does not take: said, and the others go on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        ms = interleaved(fns, args.rep_ms)
        rows.append((name, ms, err))
        print(f"{name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
              + f"; max |prefill - default| {err:.1e}", flush=True)
    print(f"GPU: {torch.cuda.get_device_name()}")
    print("| prefill kernel | prefill ms (TFLOP/s) | decode ms | serial ms | concurrent ms (either capture order) |")
    print("|---|---|---|---|---|")
    for name, ms, _ in rows:
        both = sorted((ms["concurrent"], ms["concurrent, decode captured first"]))
        print(f"| {name} | {ms['prefill']:.3f} ({flops / ms['prefill'] / 1e9:.0f}) | {ms['decode']:.3f} | "
              f"{ms['serial']:.3f} | {both[0]:.3f} / {both[1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
