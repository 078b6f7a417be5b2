"""Time prefill tile configurations side by side, to choose the per-arch defaults.

`PYTHONPATH=. python3 tools/sweep_configs.py [--seqlen 4096] [--head-dims 64,128,256,192/128]`
Prints, per head dim (D, or D/DV for a v of its own head dim) and mask, each valid config's TFLOP/s
at batch*seqlen = 16384 tokens, heads = 2048 / head_dim (or the --shape given), bf16, with registers
and spills from ptxas. `--chunked` sweeps the chunked kernel's configs (query rows, key tile,
stages, head_dim chunk; both instructions on sm_90a) instead of the whole-row kernel's; `--emit-manifest FILE --arch ARCH`
writes every valid config as a manifest (to compile them in parallel with `attngen prewarm`
first) and exits.
"""

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attngen  # noqa: E402
from attngen.bench.core import _head_dim_list  # noqa: E402
from attngen.errors import SpecError  # noqa: E402


def configs(a, d, dv, causal):
    """Every (spec, label) the sweep times for one head dim and mask that validates on the arch."""
    base = dict(head_dim=d, head_dim_v=dv, dtype=a.dtype, mask="causal" if causal else "none")
    if a.chunked:
        grid = [dict(cta_tile_q=bm, cta_tile_kv=bn, num_warps=8, num_stages=st, mma="mma_sync", head_dim_chunk=dk,
                     pipeline="sync")
                for bm, bn, st, dk in itertools.product((64, 32), (128, 64), (2, 3, 4), (64, 32))
                if "mma_sync" in a.mma.split(",")]
        # the wgmma form: two warpgroups over 64 rows, chunks of whole 64-column swizzle blocks, rings of up to 8
        # stages (its defaults take 4-6)
        # (--tma: on the TMA ring instead, where its V columns are whole boxes; the default is timed beside them)
        grid += [dict(cta_tile_q=64, cta_tile_kv=bn, num_warps=8, num_stages=st, mma="wgmma", head_dim_chunk=dk,
                      pipeline=pl)
                 for pl, bn, st, dk in itertools.product(("tma",) if a.tma else ("sync",), (128, 64, 32),
                                                         (3, 4, 5, 6, 8), (64, 128))
                 if "wgmma" in a.mma.split(",")]
    else:
        pipes = [("sync", "serial", "false")] + ([("tma", sc.value, pe) for sc in attngen.Schedule if sc
                                                  for pe in ("false", "true")] if a.tma else [])
        grid = [dict(cta_tile_q=bm, cta_tile_kv=bn, num_warps=w, num_stages=st, mma=mma, pipeline=pl, schedule=sc,
                     persistent=pe)
                for mma, bm, bn, w, st, (pl, sc, pe) in itertools.product(a.mma.split(","), (64, 128), a.kv_tiles,
                                                                          (4, 8), (1, 2, 3, 4), pipes)
                if pl == "sync" or mma == "wgmma"]
    for g in grid:
        try:
            spec = attngen.PrefillSpec(**base, **g)
            attngen.validate(spec, a.arch)
        except SpecError:
            continue
        label = " ".join(f"{k.replace('cta_tile_', '').replace('num_', '').replace('head_dim_', '')}{v}"
                         for k, v in g.items() if k not in ("mma", "pipeline", "schedule", "persistent"))
        label += (" tma" + (f" {g['schedule']}" if "schedule" in g else "")) if g.get("pipeline") == "tma" else ""
        label += " persistent" if g.get("persistent") == "true" else ""
        yield spec, f"{g['mma']} {label}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--shape", default=None, help="BxHxS instead of 16k tokens at --seqlen")
    ap.add_argument("--head-dims", type=_head_dim_list, default="64,128,256", help="D or D/DV, comma-separated")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--mma", default="mma_sync,wgmma", help="instruction paths to try (wgmma needs sm_90a)")
    ap.add_argument("--causal", default="both", choices=("both", "false", "true"))
    ap.add_argument("--chunked", action="store_true", help="the chunked kernel's configs")
    ap.add_argument("--tma", action="store_true",
                    help="each wgmma config also with pipeline=tma, in each schedule, one CTA a query tile and persistent "
                         "(--chunked: the configs on the TMA ring instead, and the default)")
    ap.add_argument("--kv-tiles", type=lambda t: tuple(int(x) for x in t.split(",")), default=(32, 64, 128),
                    help="key tiles of the whole-row kernel's grid (default 32,64,128; the wgmma kernel also takes "
                         "80-192 in steps of 16)")
    ap.add_argument("--arch", default=None, help="validate for this arch (default: the GPU's)")
    ap.add_argument("--emit-manifest", type=Path, default=None)
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args()
    dims = a.head_dims
    masks = {"both": (False, True), "false": (False,), "true": (True,)}[a.causal]
    if a.emit_manifest:
        lines = [f'archs = ["{a.arch}"]']
        for (d, dv), causal in itertools.product(dims, masks):
            for spec, _ in configs(a, d, dv, causal):
                fields = {k: v for k, v in spec.to_dict().items() if k != "family"}
                lines.append('\n[[kernel]]\nfamily = "prefill"\n' + "".join(
                    f"{k} = {str(v).lower() if isinstance(v, bool) else v if isinstance(v, int) else repr(v)}\n"
                    .replace("'", '"') for k, v in fields.items()))
        a.emit_manifest.write_text("\n".join(lines))
        return

    import torch
    from triton.testing import do_bench

    from attngen.compiler import nvrtc_version
    from attngen.runtime import device_arch

    a.arch = a.arch or device_arch(torch.cuda.current_device()).name
    print("NVRTC", nvrtc_version(), "GPU", torch.cuda.get_device_name())
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    for d, dv in dims:
        if a.shape:
            b, h, s = (int(x) for x in a.shape.split("x"))
        else:
            s = a.seqlen
            h, b = 2048 // d, 16384 // s
        q, k, v = (torch.randn(b, s, h, w, device="cuda", dtype=tdt) for w in (d, d, dv))
        for causal in masks:
            flops = 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
            res = []
            default = attngen.resolve(attngen.PrefillSpec(head_dim=d, head_dim_v=dv, dtype=a.dtype,
                                                          mask="causal" if causal else "none"), a.arch)
            listed = list(configs(a, d, dv, causal))
            if all(spec != default for spec, _ in listed):
                listed.append((default, "default"))
            for spec, label in listed:
                label += " *" if spec == default else ""
                kern = attngen.get_kernel(spec)
                fn = lambda: attngen.prefill(q, k, v, causal=causal, spec=spec)  # noqa: E731
                fn()
                ms = do_bench(fn, warmup=10, rep=40, return_mode="median")
                r = kern.binary.resources
                res.append((flops / ms / 1e9, label, r.registers, r.spill_stores, kern.smem_bytes))
            res.sort(reverse=True)
            print(f"\nD={d}/{dv} B={b} H={h} S={s} causal={causal}", flush=True)
            shown = res[:a.top] + [r for r in res[a.top:] if r[1].endswith("*")]  # the default (*) always
            for tf, label, reg, sp, sm in shown:
                print(f"  {tf:7.1f} TFLOP/s  {label}  regs {reg} spill {sp} smem {sm}", flush=True)


if __name__ == "__main__":
    main()
