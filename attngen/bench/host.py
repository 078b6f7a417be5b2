"""``attngen bench host``: the host path of one eager call, against SDPA's, in one run.

Host time: back-to-back calls on tiny inputs, host clock, median of batches (the GPU work of
each is shorter than its host path, so the host path is what is timed). Then one realistic decode
step, batch 1 against an 8k cache, timed the same way: each call costs the larger of its host
path and its GPU work, as for an eager caller; the same step replayed from a CUDA graph and
SDPA-cuDNN's eager step show how much of it the host path is.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .core import (_fmt, _graphed, _replay_or_gpu_check, _say, _sdpa_backend, env_lines, environment,
                   host_time_us, write_json)

TARGET_HOST_US = 10.0   # issue: prefill and decode host path per eager call


def add_parser(sub) -> None:
    p = sub.add_parser("host", help="host time per eager call: prefill and decode vs SDPA",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=500, help="calls per batch (default 500)")
    p.add_argument("--batches", type=int, default=20, help="batches, median (default 20)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench_host.json")
    p.add_argument("--from-json", type=Path, default=None, help="re-render a saved bench_host.json (no GPU)")
    p.set_defaults(func=cmd_host)


def _cases(torch, attngen):
    """(label, shape text, fn, target µs) for the host-time rows."""
    import torch.nn.functional as F

    bf = dict(device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, 128, 8, 64, **bf) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    dq = torch.randn(1, 1, 32, 128, **bf)
    kc, vc = (torch.randn(1, 256, 8, 128, **bf) for _ in range(2))
    lens = torch.tensor([200], dtype=torch.int32, device="cuda")
    dqt = dq.transpose(1, 2)
    kct, vct = (x[:, :200].transpose(1, 2).repeat_interleave(4, dim=1) for x in (kc, vc))
    small, dec = "B=1 S=128 H=8 D=64 bf16", "B=1 q_len=1 H=32/8 D=128 bf16, 200 of 256 cells"
    cases = [
        ("attngen.prefill(q, k, v)", small, lambda: attngen.prefill(q, k, v), TARGET_HOST_US),
        ("attngen.prefill(q, k, v, causal=True)", small, lambda: attngen.prefill(q, k, v, causal=True), None),
        ("SDPA (default dispatch)", small, lambda: F.scaled_dot_product_attention(qt, kt, vt), None),
        ("attngen.decode(q, k_cache, v_cache, cache_seqlens=lens)", dec,
         lambda: attngen.decode(dq, kc, vc, cache_seqlens=lens), TARGET_HOST_US),
        ("attngen.decode(..., cache_seqlens=200)", dec, lambda: attngen.decode(dq, kc, vc, cache_seqlens=200), None),
        ("SDPA (default dispatch), decode shapes", dec, lambda: F.scaled_dot_product_attention(dqt, kct, vct), None),
        # Pieces every call of a Python op on torch tensors pays, whatever it does: the floor's parts.
        ("piece: torch.empty of prefill's output", small, lambda: torch.empty(1, 128, 8, 64, **bf), None),
        ("piece: q, k, v's pointer, shape, strides, dtype and device read", small,
         lambda: [(x.data_ptr(), x.shape, x.stride(), x.dtype, x.get_device()) for x in (q, k, v)], None),
        ("piece: torch.cuda.current_stream()", small, torch.cuda.current_stream, None),
    ]
    return cases


def _decode_step(torch, attngen, calls: int, batches: int) -> list[dict]:
    """Batch 1 against an 8192-token cache: eager attngen, attngen in a CUDA graph, eager SDPA-cuDNN."""
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    bf = dict(device="cuda", dtype=torch.bfloat16)
    n = 8192
    q = torch.randn(1, 1, 32, 128, **bf)
    kc, vc = (torch.randn(1, n, 8, 128, **bf) for _ in range(2))
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    qt = q.transpose(1, 2)
    kt, vt = (x.transpose(1, 2).repeat_interleave(4, dim=1) for x in (kc, vc))

    def cudnn():
        with sdpa_kernel(_sdpa_backend("cudnn")):
            return F.scaled_dot_product_attention(qt, kt, vt)

    rows = []
    for label, fn in (("attngen.decode, eager", lambda: attngen.decode(q, kc, vc, cache_seqlens=lens)),
                      ("attngen.decode, CUDA graph", _graphed(lambda: attngen.decode(q, kc, vc, cache_seqlens=lens))),
                      ("SDPA cuDNN, eager", cudnn)):
        try:
            rows.append(dict(label=label, us=host_time_us(fn, calls, batches)))
        except Exception as e:  # a backend that refuses the shape
            rows.append(dict(label=label, us=None, error=str(e).splitlines()[0][:120]))
    return rows


def cmd_host(args: argparse.Namespace) -> int:
    rc = _replay_or_gpu_check("host", args, _finish)
    if rc is not None:
        return rc
    import torch

    import attngen

    rows = []
    for label, shape, fn, target in _cases(torch, attngen):
        try:
            us = host_time_us(fn, args.calls, args.batches)
            rows.append(dict(label=label, shape=shape, us=us, target=target))
        except Exception as e:
            rows.append(dict(label=label, shape=shape, us=None, target=target, error=str(e).splitlines()[0][:120]))
        _say(rows[-1])
    data = dict(env=environment(), calls=args.calls, batches=args.batches, host=rows,
                decode_step=_decode_step(torch, attngen, args.calls, args.batches))
    args.result = data
    _finish(data, args)
    return 0


def _finish(data: dict, args, print_table: bool = False) -> None:
    lines = [*env_lines(data["env"]), "",
             f"Host time per eager call ({data['calls']} calls x {data['batches']} batches, host clock, median):", "",
             "| call | inputs | µs | target | met |", "|---|---|---|---|---|"]
    for r in data["host"]:
        t = r.get("target")
        met = "" if t is None or r["us"] is None else ("yes" if r["us"] <= t else "no")
        lines.append(f"| {r['label']} | {r['shape']} | {_fmt(r['us'], '.2f')} | {_fmt(t, '.0f', '')} | {met} |")
    lines += ["", "One decode step, batch 1, 8192 cached tokens, H=32/8, D=128, bf16 (back-to-back steps, host "
              "clock, median):", "",
              "| how | µs per step |", "|---|---|"]
    lines += [f"| {r['label']} | {_fmt(r['us'], '.1f')} |" for r in data["decode_step"]]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "bench_host.json", data)
