"""MLA decode on a contiguous cache against the same cache paged (blocks of 64 positions in a
shuffled table), with the bare read of the same bytes: rotated CUDA graphs as ``attngen bench mla``
times them, µs per call, and the paged output's relative L2 distance from the contiguous one.

    PYTHONPATH=. python3 tools/probe_mla_paged.py
"""
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import attngen  # noqa: E402
from attngen.bench import core  # noqa: E402
from attngen.bench.core import stream_reader  # noqa: E402
from attngen.families.decode.bench import rotate_copies, scatter_blocks  # noqa: E402

read = stream_reader()
R, P = 512, 64
rows = []
for b, L, h in [(1, 8192, 16), (1, 32768, 16), (1, 32768, 128), (8, 8192, 128), (64, 4096, 16), (64, 4096, 128), (128, 8192, 16)]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, h, R + P, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(b, L, R + P, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 1 / math.sqrt(192)
    nbytes = kv.numel() * 2
    n = rotate_copies(nbytes, torch.cuda.mem_get_info()[0] // 3)
    copies = [kv] + [kv.clone() for _ in range(n - 1)]
    pages = [scatter_blocks(c, 64) for c in copies]  # one seed: every copy scattered by the same table
    pcopies, table = [pool for pool, _ in pages], pages[0][1]
    qn, qp = q[..., :R], q[..., R:]
    o1 = attngen.mla_decode(qn, qp, kv[..., :R], kv[..., R:], cache_seqlens=L, sm_scale=scale)
    o2 = attngen.mla_decode(qn, qp, pcopies[0][..., :R], pcopies[0][..., R:], cache_seqlens=L, sm_scale=scale, block_table=table)
    torch.cuda.synchronize()
    err = ((o1.float() - o2.float()).norm() / o1.float().norm()).item()
    us = {}
    for name, mk, cs in [("read", lambda c: (lambda: read(c, c[:0])), copies),
                         ("contig", lambda c: (lambda: attngen.mla_decode(qn, qp, c[..., :R], c[..., R:], cache_seqlens=L, sm_scale=scale)), copies),
                         ("paged", lambda c: (lambda: attngen.mla_decode(qn, qp, c[..., :R], c[..., R:], cache_seqlens=L, sm_scale=scale, block_table=table)), pcopies)]:
        replay = core._graphed(*(mk(c) for c in cs))
        us[name] = 1e3 * core._event_bench(replay, 25.0, 40.0, None, flush=False) / len(cs)
    print(f"b={b} L={L} h={h} ({nbytes/1e6:.0f} MB): read {us['read']:.1f} contig {us['contig']:.1f} paged {us['paged']:.1f} "
          f"paged/contig {us['contig']/us['paged']:.2f} read/contig {us['read']/us['contig']:.2f}  diff {err:.1e}", flush=True)
    rows.append(dict(b=b, L=L, h=h, us=us, err=err))
    copies = pcopies = pages = kv = None
    torch.cuda.empty_cache()
