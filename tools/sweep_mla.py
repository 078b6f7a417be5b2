"""MLA decode configs on this GPU: every (qk_shard, cta_tile_kv, num_warps, num_stages, mma) that fits the
arch, timed on a few decode steps as ``attngen bench mla`` times them (a CUDA graph over rotated
cache copies, no L2 flush), against a bare read of the same bytes. ``--prewarm`` first builds every
fitting config (and the defaults of the other dtypes and dims) in parallel, so the GPU tests and the
sweep do not compile one kernel at a time.

    PYTHONPATH=. python3 tools/sweep_mla.py --prewarm --out OUT/sweep_mla.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attngen  # noqa: E402
from attngen.families.mla_decode.spec import MlaDecodeSpec  # noqa: E402
from attngen.spec import tuning_candidates  # noqa: E402

# (batch, seqlen, heads), q_len 1, 512 + 64, bf16
SHAPES = [(64, 8192, 16), (128, 4096, 16), (1, 32768, 16), (64, 8192, 128), (1, 32768, 128), (8, 8192, 128)]


def fitting(arch, q_rows: int, paged: bool = False, dtype: str = "bf16") -> list[MlaDecodeSpec]:
    """Every config the tuning space offers that fits the arch (the default first)."""
    return tuning_candidates(MlaDecodeSpec(q_rows=q_rows, paged=paged, dtype=dtype), arch)


def prewarm(arch) -> None:
    from attngen.prewarm import run_prewarm

    items = [s for q, p in itertools.product((16, 32, 64), (False, True)) for s in fitting(arch, q, p)]
    for q, p, dt, (rank, rope) in itertools.product((16, 32, 64), (False, True), ("bf16", "fp16"),
                                                   ((512, 64), (256, 32))):
        items.append(attngen.resolve(MlaDecodeSpec(q_rows=q, paged=p, dtype=dt, kv_lora_rank=rank, rope_dim=rope),
                                     arch))
    items = list(dict.fromkeys(items))
    res = run_prewarm([(s, arch) for s in items], jobs=os.cpu_count())
    bad = [r for r in res if r["error"]]
    spills = [r["spec_resolved"] for r in res if r["spill_stores"]]
    print(f"prewarm: {len(items)} kernels, {len(bad)} failed, {len(spills)} spill: {spills}", flush=True)
    for r in bad[:5]:
        print("   ", r["spec"], r["error"][:300], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prewarm", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=60.0)
    ap.add_argument("--shapes", default=None, help="BxLxH,... (default: SHAPES)")
    ap.add_argument("--only", default="", help="time only the configs whose spec text holds this (e.g. pipeline=tma)")
    args = ap.parse_args()

    import torch

    from attngen.arch import arch_for_capability
    from attngen.bench import _event_bench, _graphed, environment
    from attngen.bench.core import stream_reader
    from attngen.families.decode.bench import rotate_copies

    arch = arch_for_capability(*torch.cuda.get_device_capability())
    if args.prewarm:
        prewarm(arch)
    if args.no_sweep:
        return 0
    read = stream_reader()
    rows = []
    shapes = [tuple(int(x) for x in t.split("x")) for t in args.shapes.split(",")] if args.shapes else SHAPES
    for b, n, h in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, h, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(b, n, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        nbytes = kv.numel() * 2
        copies = [kv] + [kv.clone() for _ in range(rotate_copies(nbytes, torch.cuda.mem_get_info()[0]) - 1)]
        scale = 1 / math.sqrt(192)
        qf = q[:1, 0].float()
        kf = kv[:1].float()
        ref = torch.softmax(torch.einsum("bhd,bnd->bhn", qf, kf) * scale, -1) @ kf[..., :512]
        rec = {"batch": b, "seqlen": n, "heads": h, "bytes": nbytes, "us": {}, "err": {}}

        def timed(make):
            replay = _graphed(*(make(c) for c in copies))
            return 1e3 * _event_bench(replay, 20.0, args.rep_ms, None, flush=False) / len(copies)

        rec["us"]["read"] = timed(lambda c: (lambda: read(c, c[:0])))
        q_rows = MlaDecodeSpec.rows_for(h, 1)
        runs = [(None, 0)] + [(spec, 0) for spec in fitting(arch, q_rows)[1:]  # [0] is the default
                              if args.only in spec.to_text()]
        if b <= 8:  # split counts forced, default config
            runs += [(None, s) for s in (8, 16, 32, 64, 96, 132, 200)]
        for spec, splits in runs:
            name = "default" if spec is None else spec.to_text().split("paged=false,")[1]
            name += f" splits={splits}" if splits else ""

            def make(c, spec=spec, splits=splits):
                return lambda: attngen.mla_decode(q[..., :512], q[..., 512:], c[..., :512], c[..., 512:],
                                                  cache_seqlens=n, sm_scale=scale, spec=spec, num_splits=splits)
            o = make(kv)()
            torch.cuda.synchronize()
            rec["err"][name] = ((o[:1, 0].float() - ref).norm() / ref.norm()).item()
            rec["us"][name] = timed(make)
        rows.append(rec)
        best = sorted(rec["us"].items(), key=lambda kv: kv[1])
        print(f"b={b} L={n} h={h} ({nbytes / 1e6:.0f} MB): read {rec['us']['read']:.1f} us; default "
              f"{rec['us']['default']:.1f}; best: " + "; ".join(f"{k} {v:.1f}" for k, v in best[:6]), flush=True)
        bad = {k: v for k, v in rec["err"].items() if v > 1e-2}
        if bad:
            print("    FAILED:", bad, flush=True)
        copies = kv = None
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": environment(True), "arch": arch.name, "rows": rows}, indent=1,
                                   default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
