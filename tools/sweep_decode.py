"""Decode tuning sweep on the GPU (developer tool): times tile configs x split counts per shape,
and splits each call's GPU time between the main and merge kernels with the torch profiler.

    PYTHONPATH=. python3 tools/sweep_decode.py [--quick]

Its timing flushes L2 before each call (do_bench), which biases decode (BENCHMARKS.md, `--rotate`);
tools/probe_decode.py --configs times configs as a decode step, against a bare read of the bytes.
"""
import argparse
import itertools

import torch

import attngen
from attngen.bench import bench_ms
from attngen.errors import SpecError
from attngen.spec import resolve
from attngen import DecodeSpec

SHAPES = [  # batch, kv_len, kv_heads, heads, q_len, paged
    (16, 4096, 4, 32, 1, False),
    (16, 8192, 4, 32, 1, False),
    (16, 4096, 8, 32, 1, False),
    (1, 32768, 8, 32, 1, False),
    (16, 4096, 4, 32, 1, True),
    (4, 16384, 1, 16, 4, False),
]
CONFIGS = [(128, 4, 2), (64, 4, 2), (64, 4, 3), (32, 4, 4)]
SPLITS = [0, 1, 2, 3, 4, 6, 8, 16, 32]


def make(b, L, hk, h, ql, paged, d=128, bs=64):
    q = torch.randn(b, ql, h, d, device="cuda", dtype=torch.bfloat16)
    if paged:
        nb = b * L // bs
        k = torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16)
        kw = dict(block_table=torch.randperm(nb, device="cuda").int().reshape(b, L // bs))
    else:
        k = torch.randn(b, L, hk, d, device="cuda", dtype=torch.bfloat16)
        kw = {}
    v = torch.randn_like(k)
    return q, k, v, torch.full((b,), L, device="cuda", dtype=torch.int32), kw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    for (b, L, hk, h, ql, paged) in SHAPES:
        q, k, v, seq, kw = make(b, L, hk, h, ql, paged)
        gb = 2 * b * L * hk * 128 * 2 / 1e9
        rows = []
        for (kv, w, st), s in itertools.product(CONFIGS[:2] if args.quick else CONFIGS, SPLITS):
            try:
                spec = resolve(DecodeSpec(head_dim=128, q_rows=DecodeSpec.rows_for(h // hk, ql), paged=paged,
                                          cta_tile_kv=kv, num_warps=w, num_stages=st), "sm_90")
            except SpecError:
                continue
            fn = lambda: attngen.decode(q, k, v, cache_seqlens=seq, num_splits=s, spec=spec, **kw)  # noqa: E731
            ms, _ = bench_ms(fn, 10, 40)
            rows.append((ms, kv, w, st, s))
        rows.sort()
        name = f"b={b} L={L} h={h}/{hk} q={ql}{' paged' if paged else ''}"
        auto = [r for r in rows if r[4] == 0 and r[1:4] == rows[0][1:4]]
        print(f"{name}: best {rows[0][0]*1e3:.1f} us ({gb / rows[0][0] * 1e3:.0f} GB/s) kv={rows[0][1]} w={rows[0][2]} "
              f"st={rows[0][3]} splits={rows[0][4]}", flush=True)
        for r in rows[:8] + [r for r in rows if r[4] == 0]:
            print(f"    {r[0]*1e3:8.1f} us  {gb / r[0] * 1e3:6.0f} GB/s  kv={r[1]} w={r[2]} st={r[3]} splits={r[4]}")
        del auto
        # Kernel split of the default call.
        fn = lambda: attngen.decode(q, k, v, cache_seqlens=seq, **kw)  # noqa: E731
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.count:
                t = getattr(e, "device_time", None) or getattr(e, "cuda_time", 0)
                print(f"    profile: {e.key[:48]:48s} {t:8.1f} us avg x{e.count}")


if __name__ == "__main__":
    main()
