"""Which decode, MLA decode and dense prefill kernels ptxas spills, or leaves a coded note on (C7508-C7520: setmaxnreg
ignored, wgmma serialised or waited for): every default (each shape field's values, no tuning field pinned) and,
with ``--pins``, every single-field pin of a tuning field, resolved for each arch and compiled with NVRTC (the cache
makes a rerun cheap). Prints one line a spilling or noted kernel with the spec texts that reach it, and exits 1 if
any default spills or has a note: the check behind each family's SPILLS_ON list (``defaults.py``), to rerun when a
template or NVRTC changes.

    python3 tools/spill_scan.py decode,mla_decode,prefill [--archs sm_80,sm_90a] [--pins] [--dtypes bf16,fp16] [--jobs N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen.arch import ARCHS  # noqa: E402
from attngen.builder import build  # noqa: E402
from attngen.compiler import note_codes, performance_notes  # noqa: E402
from attngen.errors import AttngenError  # noqa: E402
from attngen.spec import parse_spec, resolve  # noqa: E402

# Per family: the shape fields' values (every combination is a default to check) and the tuning pins.
SHAPES = {
    "decode": dict(head_dim=(64, 128, 256), q_rows=(16, 32, 64, 128), paged=("false", "true"),
                   variant=("fused", "unfused"), mod=("", "softcap=true", "alibi=true", "sinks=true")),
    "mla_decode": dict(kv_lora_rank=("512,rope_dim=64", "256,rope_dim=32"), q_rows=(16, 32, 64),
                       paged=("false", "true")),
    # dense prefill only (the masked, varlen and paged forms are the manifest's, compiled by its slow test)
    "prefill": dict(head_dim=(64, 128, 256), mask=("none", "causal")),
}
PINS = {
    "decode": [f"cta_tile_kv={v}" for v in (16, 32, 64, 128)] + [f"num_warps={v}" for v in (4, 8)]
    + [f"num_stages={v}" for v in (1, 2, 3, 4)],
    "mla_decode": [f"qk_shard={v}" for v in ("true", "false", "alternate")] + [f"cta_tile_kv={v}" for v in (16, 32, 64)]
    + [f"num_warps={v}" for v in (4, 8)] + [f"num_stages={v}" for v in (1, 2, 3, 4)]
    + ["mma=mma_sync", "mma=wgmma", "pipeline=sync", "pipeline=tma"],
    "prefill": [f"cta_tile_q={v}" for v in (64, 128, 192)] + [f"cta_tile_kv={v}" for v in (64, 80, 128, 176)]
    + [f"num_warps={v}" for v in (4, 8, 12)] + [f"num_stages={v}" for v in (1, 2, 3, 4)]
    + ["mma=mma_sync", "mma=wgmma", "pipeline=sync", "pipeline=tma"]
    + [f"schedule={v}" for v in ("serial", "overlap", "pingpong")] + [f"persistent={v}" for v in ("true", "false")],
}


def texts(family: str, dtype: str, pins: bool):
    """(spec text, is a default) for every shape of the family, unpinned and (``pins``) with each pin."""
    fields = SHAPES[family]
    for values in itertools.product(*fields.values()):
        parts = [f"dtype={dtype}"] + [v if k == "mod" else f"{k}={v}" for k, v in zip(fields, values) if v != ""]
        base = f"{family}:" + ",".join(parts)
        yield base, True
        if pins:
            for pin in PINS[family]:
                yield f"{base},{pin}", False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("families", help="comma-separated: decode, mla_decode, prefill")
    ap.add_argument("--archs", default=",".join(sorted(ARCHS)))
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--pins", action="store_true", help="also every single-field pin of a tuning field")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    kernels: dict[tuple[str, str], list[tuple[str, bool]]] = {}
    for family, arch, dtype in itertools.product(args.families.split(","), args.archs.split(","),
                                                 args.dtypes.split(",")):
        for text, default in texts(family, dtype, args.pins):
            try:
                spec = resolve(parse_spec(text), arch)
            except AttngenError:  # a pin the arch refuses (e.g. wgmma off sm_90a)
                continue
            kernels.setdefault((arch, str(spec)), []).append((text, default))
    print(f"{len(kernels)} distinct kernels", file=sys.stderr, flush=True)

    def scan(key):
        arch, text = key
        b = build(parse_spec(text), arch).binary
        return key, b.resources.spill_stores, performance_notes(b.log)

    bad_default = False
    with ThreadPoolExecutor(args.jobs) as ex:
        for (arch, text), n, notes in ex.map(scan, kernels):
            if n or notes:
                reached = kernels[(arch, text)]
                bad_default |= any(d for _, d in reached)
                kind = "DEFAULT" if any(d for _, d in reached) else "pin"
                what = ", ".join(([f"spills {n} bytes"] if n else []) +
                                 ([f"ptxas notes {note_codes(notes)}"] if notes else []))
                print(f"{kind} {arch} {text} {what} <- {', '.join(t for t, _ in reached[:4])}", flush=True)
    return 1 if bad_default else 0


if __name__ == "__main__":
    sys.exit(main())
