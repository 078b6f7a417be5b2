"""SM clock, board power and temperature while kernels run back-to-back: does a kernel lose to another by work
per cycle, or by the clock the power cap leaves it? ``nvidia-smi`` is sampled every 50 ms from a thread; each
kernel runs 1 s of warm-up and 1.5 s timed with CUDA events, twice (the order reversed the second time).

    PYTHONPATH=. python3 tools/probe_clocks.py [--out OUT/probe_clocks.json]          # prefill: attngen, cuDNN
    PYTHONPATH=. python3 tools/probe_clocks.py --mla [--out OUT/probe_clocks_mla.json]

Prefill: attngen's default prefill and SDPA's cuDNN backend on the same inputs; TFLOP/s in FlashAttention's
convention (causal halved). MLA (issue 13's ceiling at 128 heads): cuBLAS's bf16 GEMM (the best tensor rate the
card sustains), the bare read of a cache, and attngen's MLA decode at 128 heads (tensor-bound) and 16 (memory-bound);
TFLOP/s and GB/s of cache read. Printed per row: the rate, the median SM clock (MHz), TFLOP/s per GHz of that clock,
the median power (W), the highest temperature and the clock-event reasons seen (0x4: software power cap).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics as st
import subprocess
import threading
import time

SHAPES = [(128, False, 16, 16, 1024), (256, False, 8, 8, 2048), (128, False, 4, 16, 4096), (64, True, 32, 32, 512)]
MLA_SHAPES = [(128, 64, 32768), (128, 128, 8192), (16, 128, 32768)]  # heads, batch, keys
RANK, ROPE = 512, 64


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

    def summary(self, t0, t1) -> dict:
        """The median SM clock and power, the highest temperature and the reasons seen between t0 and t1."""
        sm = self.between(t0, t1)
        return dict(clock=st.median(x[1] for x in sm) if sm else None, power=st.median(x[2] for x in sm) if sm else None,
                    temp=max(x[3] for x in sm) if sm else None, reasons=sorted({x[4] for x in sm}), n_samples=len(sm))


def sustain(sampler: Sampler, fn, warm_s: float = 1.0, timed_s: float = 1.5) -> dict:
    """``fn`` back-to-back: warm_s untimed, then timed_s between two events. Seconds a call, and what the
    sampler saw meanwhile (its first 0.1 s left out)."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.time()
    while time.time() - t0 < warm_s:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n, w0 = 0, time.time()
    e0.record()
    while time.time() - w0 < timed_s:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    e1.record()
    torch.cuda.synchronize()
    return dict(s_per_call=e0.elapsed_time(e1) / n / 1e3, **sampler.summary(w0 + 0.1, time.time()))


def _report(label: str, r: dict) -> None:
    rate = f"{r['tflops']:6.1f} TF" + (f"  {r['gbps']:6.0f} GB/s" if r.get("gbps") else "")
    per_ghz = f"{r['tflops'] / (r['clock'] / 1e3):6.1f} TF/GHz" if r["clock"] and r["tflops"] else ""
    print(f"{label}: {rate}  {r['clock']} MHz  {per_ghz}  {r['power']} W  {r['temp']} C  {r['reasons']} "
          f"({r['n_samples']})", flush=True)


def run_prefill(sampler: Sampler) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import attngen

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
                    r = sustain(sampler, fns[name])
                    r.update(d=d, causal=causal, s=s, dtype=dt, impl=name, rep=rep,
                             tflops=flops / r["s_per_call"] / 1e12)
                    rows.append(r)
                    _report(f"d{d} {'C' if causal else 'F'} {s:>5} {dt} {name:8s} rep{rep}", r)
    return rows


def corun(sampler: Sampler, a, b, read, g, warm_s: float = 1.0, timed_s: float = 1.5) -> list[dict]:
    """cuBLAS's GEMM on one stream while the bare read streams a 2.4 GB cache on another, both queues kept full:
    how much math the card does while it also streams (each stream's rate over its own elapsed time, so a tail
    that runs alone counts in its favour)."""
    import torch

    kv = torch.randn(64, 32768, RANK + ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
    n = a.shape[0]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    work = [lambda: torch.matmul(a, b), lambda: read(kv, kv[:0])]
    per_batch = [8, 16]  # about 13 ms of each alone
    counts = [0, 0]
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in streams]

    def batch():
        """A batch of each on its stream, counted, each stream's end event recorded after it; then both done."""
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                for _ in range(per_batch[i]):
                    work[i]()
            counts[i] += per_batch[i]
        for i, s in enumerate(streams):
            ev[i][1].record(s)
        torch.cuda.synchronize()

    t0 = time.time()
    while time.time() - t0 < warm_s:
        batch()
    counts[:] = [0, 0]
    for i, s in enumerate(streams):
        ev[i][0].record(s)
    w0 = time.time()
    while time.time() - w0 < timed_s:
        batch()
    secs = [ev[i][0].elapsed_time(ev[i][1]) / 1e3 for i in range(2)]
    r = dict(impl="corun", n=n, tflops=2 * n ** 3 * counts[0] / secs[0] / 1e12,
             gbps=kv.numel() * kv.element_size() * counts[1] / secs[1] / 1e9, secs=secs,
             **sampler.summary(w0 + 0.1, time.time()), rep=0)
    _report(f"cublas {n}^3 || read 2.4 GB", r)
    del kv
    return [r]


def run_mla(sampler: Sampler) -> list[dict]:
    """cuBLAS's square bf16 GEMM, then per shape the bare read of the cache and attngen's MLA decode (default
    spec), each sustained twice in alternating order."""
    import torch

    import attngen
    from attngen.bench import core

    rows = []
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    for rep in range(2):
        r = sustain(sampler, lambda: torch.matmul(a, b))
        r.update(impl="cublas", n=n, rep=rep, tflops=2 * n ** 3 / r["s_per_call"] / 1e12)
        rows.append(r)
        _report(f"cublas bf16 {n}^3 rep{rep}", r)
    read = core.stream_reader()
    rows += corun(sampler, a, b, read, g)
    del a, b
    for heads, batch, keys in MLA_SHAPES:
        torch.cuda.empty_cache()
        q = torch.randn(batch, 1, heads, RANK + ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(batch, keys, RANK + ROPE, device="cuda", dtype=torch.bfloat16, generator=g)
        lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        scale = 1.0 / math.sqrt(192)
        nbytes = kv.numel() * kv.element_size()
        flops = 2 * batch * heads * keys * (RANK + ROPE + RANK)
        fns = {"attngen": lambda: attngen.mla_decode(q[..., :RANK], q[..., RANK:], kv[..., :RANK], kv[..., RANK:],
                                                     cache_seqlens=lens, sm_scale=scale),
               "read": lambda: read(kv, kv[:0])}
        for rep, order in enumerate((["attngen", "read"], ["read", "attngen"])):
            for name in order:
                r = sustain(sampler, fns[name])
                r.update(impl=name, heads=heads, batch=batch, keys=keys, rep=rep, gbps=nbytes / r["s_per_call"] / 1e9,
                         tflops=flops / r["s_per_call"] / 1e12 if name == "attngen" else 0.0)
                rows.append(r)
                _report(f"mla h{heads} b{batch} {keys:>5} {name:8s} rep{rep}", r)
        del q, kv
    # What cuBLAS's work per cycle would give at each MLA run's own clock (an upper bound: a kernel doing that
    # much math per cycle while it streams the cache spends more energy a cycle, so runs no faster).
    blas = max(r["tflops"] / (r["clock"] / 1e3) for r in rows if r["impl"] == "cublas" and r["clock"])
    for r in rows:
        if r["impl"] != "attngen" or not r["clock"]:
            continue
        rd = st.median(x["gbps"] for x in rows if x["impl"] == "read" and x["heads"] == r["heads"]
                       and x["batch"] == r["batch"] and x["keys"] == r["keys"])
        fpb = 2 * r["heads"] * (RANK + ROPE + RANK) / ((RANK + ROPE) * 2)  # FLOP a cache byte
        at_blas = blas * (r["clock"] / 1e3) * 1e12 / fpb / 1e9
        r.update(read_gbps=rd, of_read=r["gbps"] / rd, blas_tf_per_ghz=blas, ceiling_gbps=min(at_blas, rd),
                 ceiling_of_read=min(at_blas, rd) / rd)
        print(f"mla h{r['heads']} b{r['batch']} {r['keys']:>5} rep{r['rep']}: {r['of_read']:.3f} of the read at "
              f"{r['clock']} MHz; cuBLAS's {blas:.1f} TF/GHz there: {at_blas:.0f} GB/s = {at_blas / rd:.3f} of the "
              f"read", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mla", action="store_true", help="the MLA decode probe instead of prefill's")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    sampler = Sampler()
    rows = run_mla(sampler) if args.mla else run_prefill(sampler)
    sampler.stop = True
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
