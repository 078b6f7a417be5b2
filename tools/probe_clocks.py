"""SM clock, board power and temperature while attngen's default prefill and SDPA's cuDNN backend each run
back-to-back on the same inputs: does a kernel lose to another by work per cycle, or by the clock the power cap
leaves it? ``nvidia-smi`` is sampled every 50 ms from a thread; each (shape, dtype, kernel) runs 1 s of warm-up
and 1.5 s timed with CUDA events, twice (attngen first, then cuDNN first).

    PYTHONPATH=. python3 tools/probe_clocks.py [--out OUT/probe_clocks.json]

Printed per row: TFLOP/s (FlashAttention's convention, causal halved), the median SM clock (MHz), the median
power (W), the highest temperature and the clock-event reasons seen (0x4: software power cap).
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import subprocess
import threading
import time

SHAPES = [(128, False, 16, 16, 1024), (256, False, 8, 8, 2048), (128, False, 4, 16, 4096), (64, True, 32, 32, 512)]


class Sampler:
    """nvidia-smi every 50 ms: (time, SM MHz, W, C, clock-event reasons)."""

    def __init__(self):
        self.samples: list[tuple] = []
        self.field = "clocks_event_reasons.active"
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            res = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu," + self.field,
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True)
            if res.returncode != 0 and self.field != "clocks_throttle_reasons.active":
                self.field = "clocks_throttle_reasons.active"  # older drivers' name
                continue
            try:
                c, p, t, reason = [x.strip() for x in res.stdout.strip().split(",")]
                self.samples.append((time.time(), float(c), float(p), float(t), reason))
            except ValueError:
                pass
            time.sleep(0.05)

    def between(self, t0, t1):
        return [x for x in self.samples if t0 <= x[0] <= t1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen

    sampler = Sampler()
    rows = []
    for d, causal, b, h, s in SHAPES:
        for dt in ("bf16", "fp16"):
            tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=tdt, generator=g) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            fns = {"attngen": lambda: attngen.prefill(q, k, v, causal=causal), "cudnn": cudnn}
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            for rep, order in enumerate((["attngen", "cudnn"], ["cudnn", "attngen"])):
                for name in order:
                    fn = fns[name]
                    fn()
                    torch.cuda.synchronize()
                    t0 = time.time()
                    while time.time() - t0 < 1.0:
                        for _ in range(10):
                            fn()
                        torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    n, w0 = 0, time.time()
                    e0.record()
                    while time.time() - w0 < 1.5:
                        for _ in range(10):
                            fn()
                        n += 10
                        torch.cuda.synchronize()
                    e1.record()
                    torch.cuda.synchronize()
                    w1 = time.time()
                    sm = sampler.between(w0 + 0.1, w1)
                    r = dict(d=d, causal=causal, s=s, dtype=dt, impl=name, rep=rep,
                             tflops=flops / (e0.elapsed_time(e1) / n) / 1e9,
                             clock=st.median(x[1] for x in sm) if sm else None,
                             power=st.median(x[2] for x in sm) if sm else None,
                             temp=max(x[3] for x in sm) if sm else None, reasons=sorted({x[4] for x in sm}),
                             n_samples=len(sm))
                    rows.append(r)
                    print(f"d{d} {'C' if causal else 'F'} {s:>5} {dt} {name:8s} rep{rep}: {r['tflops']:6.1f} TF  "
                          f"{r['clock']} MHz  {r['power']} W  {r['temp']} C  {r['reasons']} ({r['n_samples']})",
                          flush=True)
    sampler.stop = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
