"""Where an MLA decode call's time goes: the default (bf16, 512 + 64, q_len 1), its main kernel alone
(the merge launch left out: the output is then wrong, the time is the main kernel's), forced split
counts with and without the merge, against the bare read of the same bytes and the floor of any split
read of them (``tools/probe_decode.py``'s rows_read and rows_last on k and v ``[b, L, 1, 288]``, 1152
bytes a token as ckv + kpe). Timed as ``attngen bench mla`` times (a CUDA graph over rotated copies).

    PYTHONPATH=. python3 tools/probe_mla.py 1x32768x16,8x8192x16 [REP_MS]   (BxLxH; JSON to $OUT/probe_mla.json)
"""
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import attngen  # noqa: E402
import probe_decode as pd  # noqa: E402
from attngen import runtime as rt  # noqa: E402
from attngen.bench import _event_bench, _graphed  # noqa: E402
from attngen.bench.core import stream_reader  # noqa: E402
from attngen.families.decode.bench import rotate_copies  # noqa: E402

def main() -> int:
    SHAPES = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1].split(",")]
    REP = float(sys.argv[2]) if len(sys.argv) > 2 else 30.0
    out = Path(os.environ.get("OUT", "/tmp")) / "probe_mla.json"

    read = stream_reader()
    rows_read = pd.rows_reader()
    _, last = pd.floor_readers()
    res = []
    for b, n, h in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, h, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        kv = torch.randn(b, n, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        nbytes = kv.numel() * 2
        ncop = rotate_copies(nbytes, torch.cuda.mem_get_info()[0] // 2)
        copies = [kv] + [kv.clone() for _ in range(ncop - 1)]
        halves = [(torch.randn(b, n, 1, 288, device="cuda", dtype=torch.bfloat16),
                   torch.randn(b, n, 1, 288, device="cuda", dtype=torch.bfloat16)) for _ in range(ncop)]
        scale = 1 / math.sqrt(192)

        def timed(makes):
            replay = _graphed(*makes)
            return 1e3 * _event_bench(replay, 20.0, REP, None, flush=False) / len(makes)

        rec = {"b": b, "L": n, "h": h, "us": {}}
        rec["us"]["read"] = timed([(lambda c=c: read(c, c[:0])) for c in copies])

        def mla(splits, drop):
            def make(c):
                return lambda: attngen.mla_decode(q[..., :512], q[..., 512:], c[..., :512], c[..., 512:],
                                                  cache_seqlens=n, sm_scale=scale, num_splits=splits)
            # the main entries' grids; with ``drop`` the merge launches left out (the main kernel's time)
            with rt.recorded_launches(lambda one: None if one.entry else one.grid,
                                      launch_if=lambda one: not (drop and one.entry.startswith("_merge"))) as grids:
                t = timed([make(c) for c in copies])
            return t, grids[-1]

        t, grid = mla(0, False)
        rec["us"]["default"] = t
        dsp = grid[0]
        rec["splits"] = dsp
        rec["us"]["main"] = mla(dsp, True)[0]
        for s in sorted({1, 2, 4, 8, 16, 33, 66, 132, dsp}):
            if s * b > 4 * 132 * 2 or (n // 64) < s:
                continue
            rec["us"][f"s{s}"] = mla(s, False)[0]
            if s > 1:
                rec["us"][f"s{s}_main"] = mla(s, True)[0]
        rec["us"]["rows_read@auto"] = timed([(lambda k=k, v=v: rows_read(k, v, b, n)) for k, v in halves])
        rec["us"]["rows_last@auto"] = timed([(lambda k=k, v=v: last(k, v, b, n)) for k, v in halves])
        rec["us"][f"rows_last@{dsp}"] = timed([(lambda k=k, v=v: last(k, v, b, n, dsp)) for k, v in halves])
        res.append(rec)
        u = rec["us"]
        print(f"b={b} L={n} h={h}: read {u['read']:.1f} default {u['default']:.1f} (splits {dsp}, "
              f"{u['read'] / u['default']:.2f} of read) main-only {u['main']:.1f}; floor rows_last@auto "
              f"{u['rows_last@auto']:.1f} @{dsp} {u[f'rows_last@{dsp}']:.1f}", flush=True)
        print("    " + " ".join(f"{k}={v:.1f}" for k, v in u.items()), flush=True)
        copies = halves = kv = None
        torch.cuda.empty_cache()
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
