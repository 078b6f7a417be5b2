"""``attngen bench variants``: attention variants against FlexAttention, on the same inputs in one run.

Each case is one variant three ways where it exists: attngen's built-in switch (softcap, ALiBi, sinks, varlen for
document masks, a mask tensor with its live-tile plan), attngen with the variant written as a ``score_mod`` /
``mask_mod`` snippet, and ``torch.compile(flex_attention)`` with its block mask built from the same mask function.
The block mask and attngen's mask plans (a mask tensor's, a mask_mod's block plan) are built once, outside the timings
(as a model builds them once a step), the mask_mod plan's build timed apart, and the snippet also without its plan
(``mask_plan='off'``: every tile the built-in masks leave, mask_mod on each pair); each implementation's first call
(compile and, for a mask_mod, its plan included) is reported apart. The outputs are checked against each other
(relative L2), never only timed. A case's calls are timed together, medians of rounds of rotated order.

Each case also times the plain causal kernel on the same tensors in the same rounds: the probe. Scaled by the case's
live pairs (its mask's kept (query, key) pairs over the causal mask's), it is the time the variant would take at the
plain kernel's rate a pair, and FlexAttention's time over it the ratio such a kernel would reach (``flex_probe``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ...bench.core import (_fmt, _int_list, _rel_check, _replay_or_gpu_check, _say, bench_ms, env_lines, environment,
                           interleaved, ratio_summary, write_json)

HEADS, KV_HEADS = 32, 8
CASES = ("softcap", "alibi", "document", "prefix_lm", "window_global", "sinks", "rel_bias")
SOFTCAP, WINDOW, GLOBAL = 30.0, 1024, 64


def add_parser(sub) -> None:
    p = sub.add_parser("variants", help="variants (built-in switches and snippets) vs FlexAttention",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dims", type=_int_list, default=(64, 128), help="head dims (default 64,128)")
    p.add_argument("--seqlens", type=_int_list, default=(2048, 8192), help="tokens a sequence (default 2k,8k)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens a batch: batch = tokens / seqlen (default 16k)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated cases (default all: {','.join(CASES)})")
    p.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    p.add_argument("--out", type=Path, default=None, help="folder for bench_variants.json")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--from-json", type=Path, default=None, help="re-render a saved JSON (no GPU)")
    p.set_defaults(func=cmd_variants)


# --- the cases ---------------------------------------------------------------------------------------------

def _doc_ids(torch, batch: int, seqlen: int, gen) -> Any:
    """int32 [batch, seqlen]: each sequence cut into documents of 1/16 to 1/2 of it (the last one takes the rest)."""
    ids = torch.empty(batch, seqlen, dtype=torch.int32)
    for b in range(batch):
        at, doc = 0, 0
        while at < seqlen:
            n = int(torch.randint(seqlen // 16, seqlen // 2 + 1, (1,), generator=gen))
            ids[b, at:at + n] = doc
            at, doc = at + n, doc + 1
    return ids.cuda()


def make_case(torch, name: str, q, k, v, gen) -> dict:
    """One case's pieces: the attngen snippet call's keyword arguments, the built-in call (None where attngen has no
    switch for it), FlexAttention's score_mod / mask_mod over the same tensors, and whether it is causal."""
    import attngen

    batch, seqlen = q.shape[0], q.shape[1]
    dev = q.device
    c: dict[str, Any] = dict(causal=True, snippet=None, builtin=None, score_mod=None, mask_mod=None, sinks=None,
                             live=1.0)
    causal_pairs = batch * seqlen * (seqlen + 1) / 2
    if name == "softcap":
        c["snippet"] = dict(score_mod=f"return {SOFTCAP}f * fast_tanh(score * {1 / SOFTCAP!r}f);")
        c["builtin"] = lambda: attngen.prefill(q, k, v, causal=True, softcap=SOFTCAP)
        c["score_mod"] = lambda s, b, h, qi, ki: SOFTCAP * torch.tanh(s / SOFTCAP)
    elif name == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / HEADS) for i in range(HEADS)], device=dev)
        c["snippet"] = dict(score_mod="return score + slopes(h) * (float)(kv_idx - q_idx);", aux={"slopes": slopes})
        c["builtin"] = lambda: attngen.prefill(q, k, v, causal=True, alibi_slopes=slopes)
        c["score_mod"] = lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)
    elif name == "document":
        doc = _doc_ids(torch, batch, seqlen, gen)
        c["snippet"] = dict(mask_mod="return doc(b, q_idx) == doc(b, kv_idx);", aux={"doc": doc})
        # Built in: the same documents as a varlen batch.
        starts = (torch.nn.functional.pad(doc[:, 1:] != doc[:, :-1], (1, 0), value=True)).reshape(-1)
        cu = torch.cat([starts.nonzero().flatten(), torch.tensor([batch * seqlen], device=dev)]).to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        qf, kf, vf = (x.reshape(-1, x.shape[2], x.shape[3]) for x in (q, k, v))
        c["builtin"] = lambda: attngen.prefill_varlen(qf, kf, vf, cu, cu, longest, longest, causal=True)
        c["builtin_view"] = lambda o: o.view(batch, seqlen, *o.shape[1:])
        c["mask_mod"] = lambda b, h, qi, ki: (doc[b, qi] == doc[b, ki]) & (ki <= qi)
        n = (cu[1:] - cu[:-1]).double()
        c["live"] = float((n * (n + 1) / 2).sum()) / causal_pairs
    elif name == "prefix_lm":
        prefix = torch.full((batch,), seqlen // 4, dtype=torch.int32, device=dev)
        c["causal"] = False
        # | rather than ||: both sides are safe to evaluate, and || would make the aux read a branch a pair
        # (docs/variants.md "Cost"); FlexAttention's mask_mod below is written the same way.
        c["snippet"] = dict(mask_mod="return (kv_idx <= q_idx) | (kv_idx < prefix(b));", aux={"prefix": prefix})
        i = torch.arange(seqlen, device=dev)
        keep = (i[None, :] <= i[:, None]) | (i[None, :] < seqlen // 4)
        plan = attngen.mask_plan(keep, q, k)
        c["builtin"] = lambda: attngen.prefill(q, k, v, mask=keep, mask_plan=plan)
        c["mask_mod"] = lambda b, h, qi, ki: (ki <= qi) | (ki < prefix[b])
        c["live"] = batch * float(keep.sum()) / causal_pairs
    elif name == "window_global":
        c["snippet"] = dict(mask_mod=f"return q_idx - kv_idx < {WINDOW} || kv_idx < {GLOBAL};")
        i = torch.arange(seqlen, device=dev)
        keep = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < WINDOW) | (i[None, :] < GLOBAL))
        plan = attngen.mask_plan(keep, q, k, causal=True)
        c["builtin"] = lambda: attngen.prefill(q, k, v, causal=True, mask=keep, mask_plan=plan)
        c["mask_mod"] = lambda b, h, qi, ki: (ki <= qi) & ((qi - ki < WINDOW) | (ki < GLOBAL))
        c["live"] = batch * float(keep.sum()) / causal_pairs
    elif name == "sinks":
        sinks = (torch.randn(HEADS, generator=gen) * 2).to(dev)
        c["sinks"] = sinks
        c["builtin"] = lambda: attngen.prefill(q, k, v, causal=True, sinks=sinks)
    elif name == "rel_bias":
        table = torch.randn(HEADS, seqlen, device=dev) * 0.5
        # Both evaluate the score on the causal mask's dropped pairs too (attngen's order runs score_mod before the
        # masks; FlexAttention over whole blocks): the index is clamped there, where the value is never used.
        c["snippet"] = dict(score_mod="return score + bias(h, q_idx >= kv_idx ? q_idx - kv_idx : 0);",
                            aux={"bias": table})
        c["score_mod"] = lambda s, b, h, qi, ki: s + table[h, (qi - ki).clamp(min=0)]
    else:
        raise ValueError(f"case {name!r} is not one of {', '.join(CASES)}")
    if c["snippet"] is not None:
        c["snippet_call"] = lambda **kw: attngen.prefill(q, k, v, causal=c["causal"], **c["snippet"], **kw)
    return c


def _flex(torch, c: dict, q, k, v):
    """FlexAttention's call for case ``c`` over [B, H, L, D] copies of the inputs (its layout), its block mask built
    here from the case's mask function (causal folded in); returns a function giving attngen's layout."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, seqlen = q.shape[0], q.shape[1]
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    mm = c["mask_mod"]
    if mm is None and c["causal"]:
        mm = lambda b, h, qi, ki: ki <= qi  # noqa: E731
    bm = None if mm is None else create_block_mask(mm, batch, None, seqlen, seqlen, device=q.device)
    sinks = c["sinks"]

    def run(qt, kt, vt):
        if sinks is None:
            return flex_attention(qt, kt, vt, score_mod=c["score_mod"], block_mask=bm, enable_gqa=True)
        o, lse = flex_attention(qt, kt, vt, score_mod=c["score_mod"], block_mask=bm, enable_gqa=True,
                                return_lse=True)
        # The sink joins each row's denominator: O scales by e^lse / (e^lse + e^sink).
        return (o.float() * torch.sigmoid(lse - sinks[None, :, None])[..., None]).to(o.dtype)

    # A fresh compile a case: past dynamo's recompile limit a compiled function falls back to eager flex_attention,
    # which materialises the scores (tens of times slower), and that would be timed instead.
    torch._dynamo.reset()
    compiled = torch.compile(run, dynamic=False)
    return lambda: compiled(qt, kt, vt).transpose(1, 2)


def _first_call(fn) -> tuple[Any, float]:
    import torch

    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def run_case(torch, name: str, d: int, seqlen: int, args) -> dict:
    import attngen

    gen = torch.Generator().manual_seed(args.seed)
    batch = max(1, args.tokens // seqlen)
    q = torch.randn(batch, seqlen, HEADS, d, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(batch, seqlen, KV_HEADS, d, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(batch, seqlen, KV_HEADS, d, generator=gen).to("cuda", torch.bfloat16)
    c = make_case(torch, name, q, k, v, gen)
    row: dict[str, Any] = dict(case=name, head_dim=d, seqlen=seqlen, batch=batch, heads=HEADS, kv_heads=KV_HEADS,
                               causal=c["causal"], live=c["live"], ms={}, first_s={}, check={})
    # Each output is made once here and checked below; the calls are then timed together in rotated rounds, so
    # that a clock's drift over the run falls on each of them alike rather than on whichever ran last.
    outs, timed = {}, {}
    if c["builtin"] is not None:
        view = c.get("builtin_view", lambda o: o)
        outs["builtin"] = view(c["builtin"]())
        timed["builtin"] = c["builtin"]
    if c["snippet"] is not None:
        # A comment no earlier call had makes this call's module new: its first call is a cold compile.
        nonce = f"\n// {time.time_ns()}"
        cold = {key: (val + nonce if key in ("score_mod", "mask_mod") else val) for key, val in c["snippet"].items()}
        _, row["first_s"]["snippet"] = _first_call(lambda: attngen.prefill(q, k, v, causal=c["causal"], **cold))
        snippet = c["snippet_call"]
        if c["snippet"].get("mask_mod"):
            def make_plan():
                return attngen.mask_plan(None, q, k, causal=c["causal"], **c["snippet"])

            plan = make_plan()
            snippet = lambda: c["snippet_call"](mask_plan=plan)  # noqa: E731
            row["ms"]["plan"] = bench_ms(make_plan, rep_ms=args.rep_ms)[0]
            no_plan = lambda: c["snippet_call"](mask_plan="off")  # noqa: E731
            outs["snippet_noplan"] = no_plan()
            timed["snippet_noplan"] = no_plan
        outs["snippet"] = snippet()
        timed["snippet"] = snippet
    if not args.no_flex:
        try:
            flex = _flex(torch, c, q, k, v)
            outs["flex"], row["first_s"]["flex"] = _first_call(flex)
            timed["flex"] = flex
        except Exception as e:  # a torch without FlexAttention, or one that refuses this case
            row["flex_error"] = str(e).splitlines()[0][:160]
    # The probe: the plain causal kernel, timed with the others, not checked (it computes another function).
    timed["causal"] = lambda: attngen.prefill(q, k, v, causal=True)
    row["ms"].update(interleaved(timed, args.rep_ms))
    # The reference: FlexAttention's output, else the built-in's; a case with one implementation has no check.
    ref = outs.get("flex", outs.get("builtin"))
    for key, o in outs.items():
        if ref is not None and o is not ref:
            row["check"][key] = _rel_check(o, ref.float())
    best = min((row["ms"][k] for k in ("builtin", "snippet") if k in row["ms"]), default=None)
    row["ratio"] = {}
    if best and "flex" in row["ms"]:
        row["ratio"]["flex"] = row["ms"]["flex"] / best
    if "snippet" in row["ms"] and "flex" in row["ms"]:
        row["ratio"]["flex_snippet"] = row["ms"]["flex"] / row["ms"]["snippet"]
    if "snippet" in row["ms"] and "builtin" in row["ms"]:
        row["ratio"]["builtin"] = row["ms"]["builtin"] / row["ms"]["snippet"]
    if "flex" in row["ms"]:
        row["ratio"]["flex_probe"] = row["ms"]["flex"] / (row["ms"]["causal"] * row["live"])
    return row


def summarize(rows: list[dict]) -> dict:
    where = lambda r: {k: r[k] for k in ("case", "head_dim", "seqlen")}  # noqa: E731
    out = {}
    for peer in ("flex", "flex_snippet", "builtin", "flex_probe"):
        s = ratio_summary([(r["ratio"][peer], r) for r in rows if peer in r.get("ratio", {})], where)
        if s:
            out[peer] = s
    checks = [c for r in rows for c in r.get("check", {}).values()]
    out["checks"] = {"run": len(checks), "failed": sum(1 for c in checks if not c["ok"]),
                     "max_rel_l2": max((c["rel_l2"] for c in checks), default=None)}
    return {"ratio": {k: v for k, v in out.items() if k != "checks"}, "checks": out["checks"]}


def _finish(data: dict, args, print_table: bool = False) -> None:
    lines = [*env_lines(data["env"]), "",
             "| case | D | S | B | built-in ms | snippet ms | snippet, plan off ms | plan ms | Flex ms | "
             "Flex ÷ best attngen | Flex ÷ snippet | built-in ÷ snippet | first call s: snippet / Flex | worst rel L2 | "
             "causal probe ms (live pairs) | Flex ÷ probe × live |",
             "|---|" * 1 + "---|" * 15]
    errors = []
    for r in data["rows"]:
        ms, ra, fs = r["ms"], r.get("ratio", {}), r.get("first_s", {})
        worst = max((c["rel_l2"] for c in r.get("check", {}).values()), default=None)
        lines.append(f"| {r['case']} | {r['head_dim']} | {r['seqlen']} | {r['batch']} | "
                     f"{_fmt(ms.get('builtin'), '.3f')} | {_fmt(ms.get('snippet'), '.3f')} | "
                     f"{_fmt(ms.get('snippet_noplan'), '.3f')} | {_fmt(ms.get('plan'), '.3f')} | "
                     f"{_fmt(ms.get('flex'), '.3f')} | {_fmt(ra.get('flex'), '.2f')} | "
                     f"{_fmt(ra.get('flex_snippet'), '.2f')} | {_fmt(ra.get('builtin'), '.2f')} | "
                     f"{_fmt(fs.get('snippet'), '.2f')} / {_fmt(fs.get('flex'), '.1f')} | {_fmt(worst, '.1e')} | "
                     f"{_fmt(ms.get('causal'), '.3f')} ({_fmt(r.get('live'), '.3f')}) | "
                     f"{_fmt(ra.get('flex_probe'), '.2f')} |")
        if r.get("flex_error"):
            errors.append(f"FlexAttention refused {r['case']} D={r['head_dim']} S={r['seqlen']}: {r['flex_error']}")
    lines += [""] + errors if errors else []
    s = data.get("summary", {}).get("ratio", {})
    for peer, label in (("flex", "FlexAttention ÷ best attngen"), ("flex_snippet", "FlexAttention ÷ snippet"),
                        ("builtin", "built-in ÷ snippet"),
                        ("flex_probe", "FlexAttention ÷ (the causal probe × live pairs)")):
        if peer in s:
            lines.append(f"\n{label}: geomean {s[peer]['geomean']:.3f}, min {s[peer]['min']:.3f} at "
                         f"{s[peer]['min_at']} over {s[peer]['shapes']} rows")
    c = data.get("summary", {}).get("checks", {})
    if c:
        lines.append(f"\nchecks: {c['run']} run, {c['failed']} failed, worst rel L2 {_fmt(c.get('max_rel_l2'), '.1e')}")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "bench_variants.json", data)


def cmd_variants(args: argparse.Namespace) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        _say(f"attngen: error: --cases {args.cases!r}: {','.join(bad) or 'none'} unknown; allowed: {','.join(CASES)}",
             file=sys.stderr)
        return 2
    rc = _replay_or_gpu_check("variants", args, _finish)
    if rc is not None:
        return rc
    import torch

    rows = []
    for d in args.head_dims:
        for s in args.seqlens:
            for name in cases:
                row = run_case(torch, name, d, s, args)
                rows.append(row)
                _say(f"{name:>14} D={d:<4} S={s:<6} " + " ".join(f"{k}={v:.3f}ms" for k, v in row["ms"].items())
                     + "  " + " ".join(f"{k}={v:.2f}x" for k, v in row["ratio"].items())
                     + "  " + " ".join(f"{k}:{c['rel_l2']:.1e}" for k, c in row["check"].items())
                     + (f"  flex: {row['flex_error']}" if "flex_error" in row else ""))
    data = dict(benchmark="variants", env=environment(gpu=True), rows=rows, results=rows, summary=summarize(rows),
                config=dict(tokens=args.tokens, rep_ms=args.rep_ms, seed=args.seed, flex=not args.no_flex))
    args.result = data
    _finish(data, args)
    return 0 if all(c["ok"] for r in rows for c in r["check"].values()) else 1


