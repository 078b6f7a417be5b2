"""Time prefill tile configurations side by side, to choose the per-arch defaults.

`PYTHONPATH=. python3 tools/sweep_configs.py [--seqlen 4096] [--head-dims 64,128,256,192/128]`
Prints, per head dim (D, or D/DV for a v of its own head dim) and mask, each valid config's TFLOP/s
at batch*seqlen = 16384 tokens, heads = 2048 / head_dim, bf16, with registers and spills from ptxas.
"""

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from triton.testing import do_bench

import attngen
from attngen.errors import SpecError


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--mma", default="mma_sync,wgmma", help="instruction paths to try (wgmma needs sm_90a)")
    ap.add_argument("--causal", default="both", choices=("both", "false", "true"))
    a = ap.parse_args()
    from cupy_backends.cuda.libs import nvrtc

    print("NVRTC", nvrtc.getVersion(), "GPU", torch.cuda.get_device_name())
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    s = a.seqlen
    for dims in a.head_dims.split(","):
        d, dv = (int(x) for x in dims.split("/")) if "/" in dims else (int(dims),) * 2
        h, b = 2048 // d, 16384 // s
        q, k, v = (torch.randn(b, s, h, w, device="cuda", dtype=tdt) for w in (d, d, dv))
        for causal in {"both": (False, True), "false": (False,), "true": (True,)}[a.causal]:
            flops = 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
            res = []
            for mma, bm, bn, w, st in itertools.product(a.mma.split(","), (64, 128), (32, 64, 128), (4, 8),
                                                        (1, 2, 3, 4)):
                try:
                    spec = attngen.PrefillSpec(head_dim=d, head_dim_v=dv, dtype=a.dtype, mask="causal" if causal else "none",
                                               cta_tile_q=bm, cta_tile_kv=bn, num_warps=w, num_stages=st, mma=mma)
                    kern = attngen.get_kernel(spec)
                except SpecError:
                    continue
                fn = lambda: attngen.prefill(q, k, v, causal=causal, spec=spec)
                fn()
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
                r = kern.binary.resources
                res.append((flops / ms / 1e9, mma, bm, bn, w, st, r.registers, r.spill_stores, kern.smem_bytes))
            res.sort(reverse=True)
            print(f"\nD={dims} S={s} causal={causal}")
            for tf, mma, bm, bn, w, st, reg, sp, sm in res[:10]:
                print(f"  {tf:7.1f} TFLOP/s  {mma} q{bm} kv{bn} w{w} st{st}  regs {reg} spill {sp} smem {sm}")


if __name__ == "__main__":
    main()
