"""Quick side-by-side timing of attngen.prefill and SDPA's flash backend on a few shapes.

For development between full benchmark runs: `PYTHONPATH=. python3 tools/probe_perf.py`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import attngen


def tflops(b, h, s, d, causal, ms):
    f = 4 * b * h * s * s * d / (2 if causal else 1)
    return f / ms / 1e9


def main():
    rows = []
    for d in (64, 128, 256):
        for s in (1024, 4096, 16384):
            for causal in (False, True):
                h = 2048 // d
                b = 16384 // s
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                fa = lambda: attngen.prefill(q, k, v, causal=causal)
                fa()
                torch.cuda.synchronize()
                t_a = do_bench(fa, warmup=25, rep=100, return_mode="median")
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fs = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    t_f = do_bench(fs, warmup=25, rep=100, return_mode="median")
                ref = fs().transpose(1, 2)
                err = ((fa().float() - ref.float()).norm() / ref.float().norm()).item()
                kern = attngen.get_kernel(attngen.PrefillSpec(head_dim=d, mask="causal" if causal else "none"))
                r = kern.binary.resources
                rows.append((d, s, causal, tflops(b, h, s, d, causal, t_a), tflops(b, h, s, d, causal, t_f), err,
                             r.registers, r.spill_stores))
    print(f"{'D':>4} {'S':>6} {'causal':>6} {'attngen':>8} {'flash':>8} {'ratio':>6} {'relerr':>8} regs spill")
    for d, s, c, a, f, e, reg, sp in rows:
        print(f"{d:>4} {s:>6} {str(c):>6} {a:8.1f} {f:8.1f} {a / f:6.2f} {e:8.1e} {reg:4d} {sp}")


if __name__ == "__main__":
    main()
