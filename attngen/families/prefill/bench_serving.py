"""``attngen bench mask`` and ``attngen bench varlen``: prefill for serving.

mask: (1) llama.cpp's batched inference, 1024 query tokens from N parallel sequences over a KV
buffer of 65536 cells, each sequence seeing its own cells causally; (2) a block-sparse density
sweep. attngen with its live-tile plan against attngen without a mask (the dense cost the plan
saves from) and SDPA given the same boolean mask (cuDNN and efficient backends).
varlen: 16k tokens as one long sequence among many short ones vs the same tokens in equal
lengths, and paged vs contiguous KV (paged only where the head dims take the whole-row kernel).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from ...bench.core import (_graphed, _head_dims, _int_list, _replay_or_gpu_check, _save_figure, _say, bench_ms,
                           env_lines, environment, measure_copy_bandwidth, pyplot, write_json)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def add_parser(sub) -> None:
    for name, fn, help_ in (("mask", cmd_mask, "custom masks with live-tile plans vs dense attngen and SDPA"),
                            ("varlen", cmd_varlen, "varlen long-tailed vs equal lengths; paged vs contiguous")):
        p = sub.add_parser(name, help=help_, description=__doc__.split("\n\n")[0])
        if name == "mask":
            p.add_argument("--parallel", type=_int_list, default=(1, 2, 4, 8, 16, 32),
                           help="sweep 1: numbers of parallel sequences (default 1,2,4,8,16,32)")
            p.add_argument("--seqlens", type=_int_list, default=(8192, 16384),
                           help="sweep 2: seqlens (default 8k,16k)")
            p.add_argument("--densities", default="0.05,0.1,0.2,0.3,0.5,0.7,0.9",
                           help="sweep 2: live-block densities")
            p.add_argument("--backends", default="cudnn,efficient", help="SDPA backends (default cudnn,efficient)")
        else:
            p.add_argument("--head-dim", type=_head_dims, default=(HEAD_DIM, HEAD_DIM),
                           help=f"D or D/DV (default {HEAD_DIM}; e.g. 192/128, or 512: the chunked kernel, no paged rows)")
        p.add_argument("--out", type=Path, default=None, help=f"folder for bench_{name}.json")
        p.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--from-json", type=Path, default=None, help="re-render a saved JSON (no GPU)")
        p.set_defaults(func=fn)


def _sdpa(torch, q, k, v, mask, backend):
    """SDPA in its layout with k/v repeated to the query heads and the boolean mask broadcast."""
    from torch.nn.attention import sdpa_kernel

    from ...bench.core import _sdpa_backend

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
    m = mask if mask.dim() == 4 else mask[None, None]

    def run():
        with sdpa_kernel(_sdpa_backend(backend)):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=m)
    return run


def llama_mask(torch, sq: int, sk: int, nseq: int):
    """Sequence s owns cells [s*sk/N, (s+1)*sk/N); its sq/N queries are its last cells, causal."""
    keep = torch.zeros(sq, sk, dtype=torch.bool, device="cuda")
    qn, kn = sq // nseq, sk // nseq
    i = torch.arange(qn, device="cuda")[:, None]
    j = torch.arange(kn, device="cuda")[None, :]
    block = j <= i + (kn - qn)
    for s in range(nseq):
        keep[s * qn:(s + 1) * qn, s * kn:(s + 1) * kn] = block
    return keep


def _time(fn, args):
    return bench_ms(fn, rep_ms=args.rep_ms)[0]


def _plan_row(attngen, q, k, v, mask, args, copy_gbps: float, **row) -> dict:
    """One point: the plan timed as a caller makes it (host and GPU) and replayed in a CUDA graph
    (GPU alone), its floor (the mask read once and its bits written once at copy bandwidth), the
    masked call with the plan and the target bound 1.1 x dense x live + plan."""
    plan = attngen.mask_plan(mask, q, k)
    floor_bytes = mask.numel() * mask.element_size() + mask.numel() // 8
    row.update(live=plan.live_fraction(), plan_ms=_time(lambda: attngen.mask_plan(mask, q, k), args),
               plan_graph_ms=_time(_graphed(lambda: attngen.mask_plan(mask, q, k)), args),
               plan_floor_ms=floor_bytes / copy_gbps / 1e6,
               masked_ms=_time(lambda: attngen.prefill(q, k, v, mask=mask, mask_plan=plan), args))
    row["bound_ms"] = 1.1 * row["dense_ms"] * row["live"] + row["plan_graph_ms"]
    return row


def cmd_mask(args: argparse.Namespace) -> int:
    rc = _replay_or_gpu_check("mask", args, _finish_mask)
    if rc is not None:
        return rc
    import torch

    import attngen

    torch.manual_seed(args.seed)
    dt = torch.bfloat16
    rows = []
    sq, sk = 1024, 65536
    q = torch.randn(1, sq, HEADS, HEAD_DIM, device="cuda", dtype=dt)
    k = torch.randn(1, sk, KV_HEADS, HEAD_DIM, device="cuda", dtype=dt)
    v = torch.randn_like(k)
    copy = measure_copy_bandwidth(rep_ms=args.rep_ms)
    _say(f"device-to-device copy: {copy['gbps']:.0f} GB/s")
    dense = _time(lambda: attngen.prefill(q, k, v), args)
    for n in args.parallel:
        mask = llama_mask(torch, sq, sk, n)
        row = _plan_row(attngen, q, k, v, mask, args, copy["gbps"], sweep="parallel", n=n, seqlen_q=sq,
                        seqlen_k=sk, dense_ms=dense)
        for b in args.backends.split(","):
            try:
                row[f"sdpa_{b}_ms"] = _time(_sdpa(torch, q, k, v, mask, b), args)
            except Exception as e:  # a backend that refuses this shape or mask
                row[f"sdpa_{b}_ms"] = None
                row[f"sdpa_{b}_error"] = str(e).splitlines()[0][:120]
        rows.append(row)
        _say(_line(row))
    rng = random.Random(args.seed)
    for s in args.seqlens:
        q = torch.randn(1, s, HEADS, HEAD_DIM, device="cuda", dtype=dt)
        k = torch.randn(1, s, HEADS, HEAD_DIM, device="cuda", dtype=dt)
        v = torch.randn_like(k)
        dense = _time(lambda: attngen.prefill(q, k, v), args)
        for dens in (float(x) for x in args.densities.split(",")):
            nb = -(-s // 64)
            live = torch.tensor([[rng.random() < dens for _ in range(nb)] for _ in range(nb)], device="cuda")
            mask = live.repeat_interleave(64, 0).repeat_interleave(64, 1)[:s, :s].contiguous()
            row = _plan_row(attngen, q, k, v, mask, args, copy["gbps"], sweep="density", density=dens,
                            seqlen_q=s, seqlen_k=s, dense_ms=dense)
            rows.append(row)
            _say(_line(row))
    data = dict(env=environment(), copy=copy, rows=rows)
    args.result = data
    _finish_mask(data, args)
    return 0


def _line(r: dict) -> str:
    what = f"N={r['n']}" if r["sweep"] == "parallel" else f"s={r['seqlen_q']} density={r['density']}"
    bound = r["dense_ms"] * r["live"]
    sd = "".join(f" {k[5:-3]}={r[k]:.3f}" for k in r if k.startswith("sdpa_") and k.endswith("_ms") and r[k])
    return (f"{what:>22}  live={r['live']:.3f}  plan={r['plan_ms']:.3f} (GPU {_f(r.get('plan_graph_ms'))})  "
            f"masked={r['masked_ms']:.3f}  dense={r['dense_ms']:.3f}  "
            f"masked/(dense*live)={r['masked_ms'] / bound if bound else 0:.2f}{sd}")


def _f(x, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def _finish_mask(data: dict, args, print_table: bool = False) -> None:
    if print_table:
        for r in data["rows"]:
            print(_line(r))
    copy = data.get("copy")
    lines = [*env_lines(data["env"]),
             f"device-to-device copy: {copy['gbps']:.0f} GB/s (the plan's floor: the mask read and its bits "
             f"written once at that rate)" if copy else "", "",
             "| sweep | point | live tiles | plan ms (GPU ms, floor ms) | masked ms | dense ms | "
             "bound ms: 1.1 × dense × live + plan GPU | met | masked ÷ (dense × live) | plan GPU ÷ masked | "
             "SDPA cuDNN ms | SDPA efficient ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        pt = f"N={r['n']}" if r["sweep"] == "parallel" else f"{r['seqlen_q']}, {r['density']}"
        bound = r["dense_ms"] * r["live"]
        gpu = r.get("plan_graph_ms")
        target = r.get("bound_ms")
        met = "" if target is None else ("yes" if r["masked_ms"] <= target else "no")
        lines.append(f"| {r['sweep']} | {pt} | {r['live']:.3f} | {r['plan_ms']:.3f} ({_f(gpu)}, "
                     f"{_f(r.get('plan_floor_ms'))}) | {r['masked_ms']:.3f} | {r['dense_ms']:.3f} | {_f(target)} | "
                     f"{met} | {r['masked_ms'] / bound if bound else 0:.2f} | "
                     f"{_f(gpu / r['masked_ms'] if gpu is not None else None, '.2f')} | "
                     f"{_f(r.get('sdpa_cudnn_ms'))} | {_f(r.get('sdpa_efficient_ms'))} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "bench_mask.json", data)
        plot_mask(data, args.out / "bench_mask.png")


def plot_mask(data: dict, path: Path) -> Path | None:
    """Sweep 1: times against N; sweep 2: masked ÷ dense against the live fraction, per seqlen."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4), squeeze=False)
    par = [r for r in data["rows"] if r["sweep"] == "parallel"]
    ax = axes[0][0]
    ns = [r["n"] for r in par]
    for key, label in (("masked_ms", "attngen, live-tile plan"), ("dense_ms", "attngen, no mask"),
                       ("plan_graph_ms", "plan (GPU)"), ("sdpa_cudnn_ms", "SDPA cuDNN, mask"),
                       ("sdpa_efficient_ms", "SDPA efficient, mask")):
        pts = [(n, r.get(key)) for n, r in zip(ns, par) if r.get(key)]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=label)
    ax.set(xscale="log", yscale="log", xlabel="parallel sequences N (1024 queries, 65536 cells)", ylabel="ms")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax = axes[0][1]
    for c, s in enumerate(sorted({r["seqlen_q"] for r in data["rows"] if r["sweep"] == "density"})):
        pts = sorted((r["live"], r["masked_ms"] / r["dense_ms"]) for r in data["rows"]
                     if r["sweep"] == "density" and r["seqlen_q"] == s)
        ax.plot(*zip(*pts), marker="s", ms=3, c=f"C{5 + c}", label=f"masked ÷ dense, seqlen {s}")
    ax.plot([0, 1], [0, 1], ls="--", c="gray", label="time ∝ live tiles")
    ax.plot([0, 1], [0, 1.1], ls=":", c="gray", label="1.1 × live")
    ax.set(xlabel="live-tile fraction", ylabel="masked ÷ dense time", xlim=(0, 1), ylim=(0, 1.2))
    return _save_figure(plt, fig, axes, data, "prefill, custom masks", path, bottom=0.2, dpi=120, ncol=4)


def long_tail(total: int, longest: int, rng: random.Random) -> list[int]:
    lens, left = [longest], total - longest
    while left > 0:
        n = min(left, int(16 * (2 ** (rng.random() * 5))))  # 16 .. 512, long-tailed toward short
        lens.append(n)
        left -= n
    return lens


def cmd_varlen(args: argparse.Namespace) -> int:
    rc = _replay_or_gpu_check("varlen", args, _finish_varlen)
    if rc is not None:
        return rc
    import torch

    import attngen

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dt, total = torch.bfloat16, 16384
    d, dv = args.head_dim
    paged_rows = not attngen.PrefillSpec(head_dim=d, head_dim_v=dv).chunked
    cases = [("long-tailed", long_tail(total, 8192, rng)), ("equal 16x1024", [1024] * 16),
             ("equal 2x8192", [8192] * 2)]
    rows = []
    for name, lens in cases:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(total, HEADS, d, device="cuda", dtype=dt)
        k = torch.randn(total, KV_HEADS, d, device="cuda", dtype=dt)
        v = torch.randn(total, KV_HEADS, dv, device="cuda", dtype=dt)
        flops = sum(2 * HEADS * (d + dv) * n * (n + 1) / 2 for n in lens)
        ms = _time(lambda: attngen.prefill_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True), args)
        row = dict(case=name, seqs=len(lens), ms=ms, tflops=flops / ms / 1e9, layout="contiguous", head_dims=[d, dv])
        rows.append(row)
        _say(row)
        if name == "long-tailed" and paged_rows:
            for bs in (16, 64, 256):
                per = [-(-n // bs) for n in lens]
                nblocks = sum(per)
                perm = torch.randperm(nblocks)
                kc = torch.randn(nblocks, bs, KV_HEADS, d, device="cuda", dtype=dt)
                vc = torch.randn(nblocks, bs, KV_HEADS, dv, device="cuda", dtype=dt)
                table = torch.zeros(len(lens), max(per), dtype=torch.int32)
                at = 0
                for s, n in enumerate(lens):
                    for j in range(per[s]):
                        table[s, j] = int(perm[at])
                        at += 1
                table = table.cuda()
                ms_p = _time(lambda: attngen.prefill_varlen(q, kc, vc, cu, cu, max(lens), max(lens), causal=True,
                                                            block_table=table), args)
                row = dict(case=name, seqs=len(lens), ms=ms_p, tflops=flops / ms_p / 1e9,
                           layout=f"paged {bs}", paged_vs_contiguous=ms / ms_p, head_dims=[d, dv])
                rows.append(row)
                _say(row)
    data = dict(env=environment(), rows=rows)
    args.result = data
    _finish_varlen(data, args)
    return 0


def _finish_varlen(data: dict, args, print_table: bool = False) -> None:
    lines = [*env_lines(data["env"]), "", "| case | sequences | head dims | KV layout | ms | TFLOP/s | "
             "paged ÷ contiguous speed |", "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        pv = r.get("paged_vs_contiguous")
        dims = "/".join(map(str, r.get("head_dims", [HEAD_DIM, HEAD_DIM])))
        lines.append(f"| {r['case']} | {r['seqs']} | {dims} | {r['layout']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{'' if pv is None else f'{pv:.2f}'} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "bench_varlen.json", data)
