"""fp8 against bf16 MLA decode (512 + 64, q_len 1, bf16 q): the time of one attngen.mla_decode call with the latent
cache in bf16 and in fp8 (e4m3, k_scale a number), each timed as ``attngen bench mla`` times (a CUDA graph of calls
over rotated cache copies, at least 256 MiB of them, medians of event pairs), and the fp8 output checked against the
bf16 call on the dequantised cache (rel L2). Prints one table row a shape: the two times, bf16 / fp8 (the issue's
target: >= 1.6 on memory-bound shapes), the fp8 call's read rate (cache bytes / time) and its kernel: wgmma (sm_90a,
64 rows and more: widened in shared memory by a producer warpgroup) or mma_sync, then its tiles and ring.

    PYTHONPATH=. python3 tools/probe_mla_fp8.py [HxBxL,...|default] [REP_MS] [FP8_SPEC]   (JSON to $OUT)

Default shapes: 16 heads at batch 1, 8, 32 and 128 heads at batch 1, 4, 8, each at 4k and 16k keys. FP8_SPEC (e.g.
``mla_decode:num_stages=4``) pins tuning fields of the fp8 calls.
"""
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import attngen  # noqa: E402
from attngen.bench import _event_bench, _graphed  # noqa: E402
from attngen.families.mla_decode import op  # noqa: E402

ROTATE = 256 * 2**20
DEFAULT = [(16, b, n) for b in (1, 8, 32) for n in (4096, 16384)] + [(128, b, n) for b in (1, 4, 8)
                                                                      for n in (4096, 16384)]


def main() -> int:
    arg = sys.argv[1] if len(sys.argv) > 1 else "default"
    shapes = DEFAULT if arg == "default" else [tuple(int(x) for x in s.split("x")) for s in arg.split(",")]
    rep = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    fp8_spec = sys.argv[3] if len(sys.argv) > 3 else None
    out = Path(os.environ.get("OUT", "/tmp")) / "probe_mla_fp8.json"
    used = []  # the spec of every kernel the calls load
    real_get_kernel = op.get_kernel

    def spy(spec, **kw):
        used.append(spec)
        return real_get_kernel(spec, **kw)

    op.get_kernel = spy
    free = torch.cuda.mem_get_info()[0]
    rows = []
    print(f"{'heads':>5} {'batch':>5} {'keys':>6} {'bf16 us':>9} {'fp8 us':>9} {'bf16/fp8':>8} {'fp8 GB/s':>9} "
          f"{'rel L2':>8}  fp8 kernel", flush=True)
    for h, b, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        qn = torch.randn(b, 1, h, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        qp = torch.randn(b, 1, h, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        k_scale = 0.05
        kv = torch.randn(b, n, 576, device="cuda", generator=g)
        kv8 = (kv / k_scale).to(torch.float8_e4m3fn)
        kv16 = (kv8.float() * k_scale).to(torch.bfloat16)  # the same values, dequantised
        del kv
        scale = 1 / math.sqrt(192)
        times, outs, kernel = {}, {}, ""
        for name, base in (("bf16", kv16), ("fp8", kv8)):
            nbytes = base.numel() * base.element_size()
            ncop = max(1, min(-(-ROTATE // nbytes), free // (4 * nbytes)))
            copies = [base] + [base.clone() for _ in range(ncop - 1)]
            ks, spec = (k_scale, fp8_spec) if name == "fp8" else (None, None)

            def call(c, ks=ks, spec=spec):
                return attngen.mla_decode(qn, qp, c[..., :512], c[..., 512:], cache_seqlens=n, sm_scale=scale,
                                          k_scale=ks, spec=spec)
            outs[name] = call(base).float()
            if name == "fp8":
                s = used[-1]
                kernel = (f"{s.mma.value} q{s.q_rows} {s.qk_shard.value} k{s.cta_tile_kv} w{s.num_warps} "
                          f"s{s.num_stages} {s.pipeline.value}")
            replay = _graphed(*[(lambda c=c: call(c)) for c in copies])
            times[name] = 1e3 * _event_bench(replay, 20.0, rep, None, flush=False) / len(copies)
            del copies, replay
        err = (torch.linalg.vector_norm(outs["fp8"] - outs["bf16"]) / torch.linalg.vector_norm(outs["bf16"])).item()
        gbs = b * n * 576 / times["fp8"] / 1e3
        rec = dict(heads=h, batch=b, keys=n, bf16_us=times["bf16"], fp8_us=times["fp8"],
                   ratio=times["bf16"] / times["fp8"], fp8_gbs=gbs, rel_l2=err, fp8_kernel=kernel)
        rows.append(rec)
        print(f"{h:>5} {b:>5} {n:>6} {times['bf16']:>9.1f} {times['fp8']:>9.1f} {rec['ratio']:>8.2f} {gbs:>9.0f} "
              f"{err:>8.1e}  {kernel}", flush=True)
        del kv8, kv16
        torch.cuda.empty_cache()
    out.write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), fp8_spec=fp8_spec, rows=rows), indent=1))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
