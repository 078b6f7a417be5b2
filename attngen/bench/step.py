"""``attngen bench step``: a serving step's attention through ``BatchAttention`` against attngen's own separate
calls for the same work, on the same paged cache in one run.

The step (defaults): 128 decode requests (1 token, 1k-32k keys, log-uniform), 8 verify requests of 5 draft tokens
under a tree mask, 4 chunked-prefill requests of 2k tokens over 8k of cache; GQA 32/8, head dim 128, bf16, page 16.
Separate calls: ``decode`` over the decode requests, ``decode`` over the verify requests (q_len 5, causal: attngen
has no other tree-masked call), ``prefill_varlen`` over the prefill requests. Both sides are CUDA graphs; the step's
plan (once a step, shared by the layers) is timed apart, also at 512 requests (decode rows of one length, and a
step's mix with verify and prefill rows). The step, its tree form, the separate calls and FlashInfer are timed in three
rounds of rotated order (medians). A bare read of the step's KV bytes
bounds its memory-bound part. The step runs its launches one after another, so the serial bound is separate / (a bare
read of the decode and verify requests' pages + the prefill call alone): what the step could reach with its decode
part at the read and its prefill part at the prefill kernel's own speed. Outputs are checked against the separate
calls (relative L2) where both run causal.
``--kv-dtype fp8_e4m3`` / ``fp8_e5m2``: the same values in an fp8 cache (one scale for k and v), both sides reading it.
Where ``flashinfer`` imports (and not ``--no-flashinfer``), its ``BatchAttention`` (one persistent launch) runs the
same causal bf16 step as a third column, checked against the step's output; its first call (a JIT build) is reported
apart, outside every timing.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from . import flashinfer as fi
from .core import (_fmt, _graphed, _rel_check, _say, bench_ms, env_lines, environment, interleaved,
                   ratio_summary, stream_reader, write_json)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16


def add_parser(sub) -> None:
    p = sub.add_parser("step", help="a serving step (BatchAttention) vs separate decode / prefill calls",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--decode", type=int, default=128, help="decode requests (default 128)")
    p.add_argument("--verify", type=int, default=8, help="verify requests (default 8)")
    p.add_argument("--draft", type=int, default=5, help="draft tokens a verify request (default 5)")
    p.add_argument("--prefill", type=int, default=4, help="chunked-prefill requests (default 4)")
    p.add_argument("--chunk", type=int, default=2048, help="new tokens a prefill request (default 2048)")
    p.add_argument("--cached", type=int, default=8192, help="cached keys before a prefill chunk (default 8192)")
    p.add_argument("--keys", default="1024,32768", help="decode/verify keys: min,max (default 1024,32768)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench_step.json")
    p.add_argument("--rep-ms", type=float, default=200.0, help="timed repeats per measurement (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-dtype", choices=("bf16", "fp8_e4m3", "fp8_e5m2"), default="bf16",
                   help="the cache's format (default bf16, q's): fp8 caches hold the same values / a per-tensor scale")
    fi.add_argument(p)
    p.set_defaults(func=cmd_step)


def _requests(args) -> tuple[list[int], list[int], list[str]]:
    rng = random.Random(args.seed)
    lo, hi = (int(x) for x in args.keys.split(","))
    q_lens, lens, kinds = [], [], []
    for kind, n, q_len in (("decode", args.decode, 1), ("verify", args.verify, args.draft),
                           ("prefill", args.prefill, args.chunk)):
        for _ in range(n):
            keys = args.cached + q_len if kind == "prefill" else int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
            q_lens.append(q_len)
            lens.append(max(keys, q_len))
            kinds.append(kind)
    order = list(range(len(q_lens)))
    rng.shuffle(order)  # an engine's batch is in no particular order
    return [q_lens[i] for i in order], [lens[i] for i in order], [kinds[i] for i in order]


def _tree(torch, q_lens, kinds, rng):
    words = []
    for n, kind in zip(q_lens, kinds):
        row = []
        for i in range(n):
            parent = rng.randrange(i) if (kind == "verify" and i) else i - 1
            row.append((row[parent] if parent >= 0 else 0) | (1 << i) if kind == "verify" else 0)
        words += row
    return torch.tensor(words, dtype=torch.int64, device="cuda")


def cmd_step(args: argparse.Namespace) -> int:
    env = environment()
    for line in env_lines(env):
        _say(line)
    results = []
    # the step as asked, then the same without its prefill requests (decode and verify only)
    for prefill in dict.fromkeys((args.prefill, 0)):
        rec = measure(argparse.Namespace(**{**vars(args), "prefill": prefill}))
        results.append(rec)
    summary = {peer: ratio_summary([(r["ratio"][peer], r) for r in results if peer in r["ratio"]],
                                   lambda r: r["shape"])
               for peer in ("separate", fi.NAME) if any(peer in r["ratio"] for r in results)}
    out = {"benchmark": "step", "env": env, "config": {fi.NAME: fi.config(args)}, "results": results,
           "summary": {"ratio": summary}}
    args.result = out
    if args.out:
        write_json(Path(args.out) / "bench_step.json", out)
    return 0 if all(c["ok"] for r in results for c in r["checks"].values()) else 1


def measure(args: argparse.Namespace) -> dict:
    """One step's timings (ms), checks and ratio against the separate calls."""
    import torch

    import attngen
    q_lens, lens, kinds = _requests(args)
    b, h, hk, d = len(q_lens), HEADS, KV_HEADS, HEAD_DIM
    dev, dt = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    per = -(-max(lens) // PAGE)
    pages = [-(-n // PAGE) for n in lens]
    kc = torch.randn(sum(pages), PAGE, hk, d, device=dev, dtype=dt, generator=gen)
    vc = torch.randn_like(kc)
    kv_dtype = args.kv_dtype
    scales = {}
    if kv_dtype != "bf16":  # the cache quantised (saturating), the same scale for k and v
        f8 = torch.float8_e4m3fn if kv_dtype == "fp8_e4m3" else torch.float8_e5m2
        scale = 4.0 / torch.finfo(f8).max
        kc, vc = ((c / scale).clamp(-torch.finfo(f8).max, torch.finfo(f8).max).to(f8) for c in (kc, vc))
        scales = {"k_scale": scale, "v_scale": scale}
    host_table = torch.zeros(b, per, dtype=torch.int32)
    at = 0
    for i, n in enumerate(pages):
        host_table[i, :n] = torch.arange(at, at + n)
        at += n
    table = host_table.to(dev)
    total = sum(q_lens)
    q = torch.randn(total, h, d, device=dev, dtype=dt, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
    cache_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    tree = _tree(torch, q_lens, kinds, random.Random(args.seed))
    max_q = max([n for n, k in zip(q_lens, kinds) if k != "prefill"] + [1])

    ba = attngen.BatchAttention(h, hk, d, PAGE, dtype=dt, max_decode_q_len=max(8, max_q),
                                kv_dtype=None if kv_dtype == "bf16" else kc.dtype)
    out_step = torch.empty_like(q)
    ba.plan(cu, cache_lens, table, total_q=total)
    step_causal = _graphed(lambda: ba.run(q, kc, vc, out=out_step, **scales))
    step_causal()
    torch.cuda.synchronize()
    ref_step = out_step.clone()
    step_tree = _graphed(lambda: ba.run(q, kc, vc, tree_mask=tree, out=out_step, **scales))
    plan_fn = _graphed(lambda: ba.plan(cu, cache_lens, table, total_q=total))

    # the separate calls: each kind's rows gathered once, outside the timings
    sep_out = {}
    calls = []
    for kind in ("decode", "verify", "prefill"):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        if not idx:
            continue
        rows = torch.cat([torch.arange(int(cu[i]), int(cu[i + 1])) for i in idx]).to(dev)
        t = table[idx].contiguous()
        ls = cache_lens[idx].contiguous()
        if kind == "prefill":
            qk = q[rows].contiguous()
            cuq = torch.tensor([0] + list(torch.tensor([q_lens[i] for i in idx]).cumsum(0)), dtype=torch.int32,
                               device=dev)
            cuk = torch.tensor([0] + list(torch.tensor([lens[i] for i in idx]).cumsum(0)), dtype=torch.int32,
                               device=dev)
            mq, mk = max(q_lens[i] for i in idx), max(lens[i] for i in idx)
            calls.append(lambda qk=qk, cuq=cuq, cuk=cuk, t=t, mq=mq, mk=mk, kind=kind: sep_out.__setitem__(
                kind, attngen.prefill_varlen(qk, kc, vc, cuq, cuk, mq, mk, causal=True, block_table=t, **scales)))
        else:
            qk = q[rows].view(len(idx), q_lens[idx[0]], h, d).contiguous()
            calls.append(lambda qk=qk, t=t, ls=ls, kind=kind: sep_out.__setitem__(
                kind, attngen.decode(qk, kc, vc, cache_seqlens=ls, block_table=t, causal=True, **scales)))
        calls[-1].rows, calls[-1].kind = rows, kind
    prefill_alone = next((_graphed(c) for c in calls if c.kind == "prefill"), None)
    separate = _graphed(*calls)
    separate()
    torch.cuda.synchronize()
    checks = {c.kind: _rel_check(ref_step[c.rows].float(), sep_out[c.kind].reshape(-1, h, d).float()) for c in calls}

    # FlashInfer's BatchAttention on the same step (bf16 caches; causal, as step_causal), checked against it
    peer_rec: dict = {"errors": {}}
    peer = (fi.attempt(peer_rec, fi.batch, q, kc, vc, cu, cache_lens, table, attngen_out=ref_step)
            if kv_dtype == "bf16" and fi.wanted(args) is None else None)

    kv_bytes = sum(lens) * hk * d * 2 * kc.element_size()
    read = stream_reader()
    flat = [kc, vc]
    # The serial bound's parts, timed in the rounds below with the rest (a compute-bound prefill timed after them ran
    # slower, at the clocks a long busy run settles to): the decode and verify requests' pages read bare (a copy of
    # the same bytes), and the prefill requests' call alone.
    short = torch.cat([host_table[i, :n] for i, (n, k) in enumerate(zip(pages, kinds)) if k != "prefill"]
                      or [torch.zeros(0, dtype=torch.int32)]).to(dev, torch.long)
    ks, vs = kc[short].contiguous(), vc[short].contiguous()
    # The compared graphs in core.ROUNDS rounds, each round's order rotated, medians: on an H200 the first ~100 ms of a
    # busy GPU ran 5% faster than the rest, which favoured whichever was timed first.
    compared = {"step": step_causal, "step_tree": step_tree, "separate": separate,
                **({fi.NAME: _graphed(peer.call)} if peer is not None else {}),
                "bare_read_decode_pages": _graphed(lambda: read(ks, vs)),
                **({"prefill_alone": prefill_alone} if prefill_alone is not None else {})}
    ms = interleaved(compared, args.rep_ms)
    del ks, vs
    ms.update({"plan": bench_ms(plan_fn, rep_ms=args.rep_ms)[0],
               "bare_read_all_pages": bench_ms(lambda: read(*flat), rep_ms=args.rep_ms)[0]})
    # the plan at 512 requests (decode rows), its GPU time alone
    b5 = 512
    cu5 = torch.arange(b5 + 1, dtype=torch.int32, device=dev)
    ls5 = torch.full((b5,), 4096, dtype=torch.int32, device=dev)
    t5 = torch.zeros(b5, 256, dtype=torch.int32, device=dev)
    ba5 = attngen.BatchAttention(h, hk, d, PAGE, dtype=dt)
    ms["plan_512"] = bench_ms(_graphed(lambda: ba5.plan(cu5, ls5, t5, total_q=b5)), rep_ms=args.rep_ms)[0]
    # and 512 of a step's mix: decode rows of the step's key range, 16 verify rows of 5 tokens, 8 prefill rows of 512
    mix = argparse.Namespace(**{**vars(args), "decode": b5 - 24, "verify": 16, "draft": 5, "prefill": 8, "chunk": 512,
                                "cached": 4096})
    q_m, lens_m, _ = _requests(mix)
    cu_m = torch.tensor([0] + list(torch.tensor(q_m).cumsum(0)), dtype=torch.int32, device=dev)
    ls_m = torch.tensor(lens_m, dtype=torch.int32, device=dev)
    t_m = torch.zeros(b5, -(-max(lens_m) // PAGE), dtype=torch.int32, device=dev)
    ms["plan_512_mixed"] = bench_ms(_graphed(lambda: ba5.plan(cu_m, ls_m, t_m, total_q=sum(q_m))),
                                    rep_ms=args.rep_ms)[0]
    shape = (f"decode={args.decode} verify={args.verify}x{args.draft} prefill={args.prefill}x{args.chunk}"
             f"+{args.cached}" + ("" if kv_dtype == "bf16" else f" kv={kv_dtype}"))
    serial = ms["bare_read_decode_pages"] + ms.get("prefill_alone", 0.0)
    pf_flops = sum(4 * h * d * n * (k - n / 2) for n, k, kind in zip(q_lens, lens, kinds) if kind == "prefill")
    rec = {"shape": shape, "kv_bytes": kv_bytes, "ms": ms, "checks": checks,
           "ratio": {"separate": ms["separate"] / ms["step"]}, "kv_read_tbps": kv_bytes / ms["step"] / 1e9,
           "serial_bound": ms["separate"] / serial,
           "prefill_tflops": pf_flops / ms["prefill_alone"] / 1e9 if "prefill_alone" in ms else None}
    if peer is not None:
        rec["ratio"][fi.NAME] = ms[fi.NAME] / ms["step"]
        rec[fi.NAME] = peer_rec[fi.NAME]
    if peer_rec["errors"]:
        rec["errors"] = peer_rec["errors"]
    _say(f"step {shape}: {b} requests, {total} tokens, {kv_bytes / 2**30:.2f} GiB of KV")
    _say("| what | ms | vs separate |")
    _say("|---|---|---|")
    for k, v in ms.items():
        vs = ms["separate"] / v if k.startswith("step") or k == fi.NAME else None
        _say(f"| {k} | {_fmt(v, '.3f')} | {_fmt(vs, '.2f')} |")
    _say(f"serial bound (separate / (bare read of the decode and verify pages + prefill alone)): "
         f"{rec['serial_bound']:.3f}; the step {rec['ratio']['separate']:.3f}"
         + (f"; prefill alone {rec['prefill_tflops']:.0f} TFLOP/s" if rec["prefill_tflops"] else ""))
    _say("checks (rel L2 step vs separate): "
         + ", ".join(f"{k} {_fmt(v.get('rel_l2'), '.1e')}" for k, v in checks.items()))
    if peer is not None:
        c = rec[fi.NAME].get("vs_attngen") or {}
        _say(f"FlashInfer BatchAttention vs the step: rel L2 {_fmt(c.get('rel_l2'), '.1e')}, first call "
             f"{rec[fi.NAME]['first_call_s']:.2f} s")
    for k, v in peer_rec["errors"].items():
        _say(f"{k}: {v}")
    return rec
