"""``attngen bench decode``: attngen.decode vs PyTorch SDPA (flash, cudnn; efficient on request).

Runs both on one dense KV cache per shape (heads 32/8, 32/4, 64/8 at head_dim 128; batch
1..128; kv_len 1k..32k; q_len 1; plus batch 4, q_len 4, 16/1 heads, 16k). A decode is bound by
reading K and V, so it reports GB/s of K+V read and the fraction of a device-to-device copy's
bandwidth measured in the same run, with the time ratios to each peer and the targets'
verdicts. Each shape is spot-checked against an fp32 reference with the output poisoned with
NaN; shapes that do not fit in memory are skipped and listed.

This module holds the shapes, the options and the measuring; ``bench_report`` turns the
records into the table, summary, Markdown and plot.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterable

import attngen
from attngen.bench import core
from attngen.bench import flashinfer as fi
from .bench_report import (BYTES_NOTE, DECODE_SDPA_CONTIG_NOTE, DECODE_SDPA_NOTE, ITEMSIZE, RATIO_NOTE,  # noqa: F401
                           ROTATE_BYTES, TARGET_B1_CUDNN, TARGET_COPY_FRAC, TARGET_FLASH, TARGET_READ, DecodeShape,
                           _copy_line, _finish_decode, decode_summary, decode_text_header,
                           decode_text_rows, rotate_note)
from attngen.bench.core import (CHECK_TOL, COPY_MIB, _backend_list, _dtype_list, _int_list, _no_tf32, _nonneg_int,
                                _rel_check, _replay_or_gpu_check, _say, _sdpa_backend, _short_error, env_lines, gbps,
                                write_json)

DECODE_HEADS = ((32, 8), (32, 4), (64, 8))      # (query heads, KV heads)
DECODE_BATCHES = (1, 16, 64, 128)
DECODE_KV_LENS = (1024, 4096, 8192, 32768)
DECODE_Q_LENS = (1,)
DECODE_HEAD_DIM = 128
# (batch, kv_len, q_len, heads, kv_heads): speculative decoding with 4 new tokens, MQA-like 16/1 heads.
DECODE_EXTRA = ((4, 16384, 4, 16, 1),)
DECODE_QUICK = dict(heads=((32, 8),), batches=(1, 64), kv_lens=(4096, 32768))
DECODE_BACKENDS = ("flash", "cudnn")
DECODE_VARIANTS = ("auto", "fused", "unfused", "both")
MEM_MARGIN = 3 << 29             # 1.5 GiB kept free beside a shape's own tensors
REF_CHUNK_BYTES = 1 << 30        # fp32 K+V per chunk of the spot-check reference


# --- the sweep ------------------------------------------------------------------------------------

def make_decode_sweep(heads: Iterable[tuple[int, int]] = DECODE_HEADS, batches: Iterable[int] = DECODE_BATCHES,
                      kv_lens: Iterable[int] = DECODE_KV_LENS, q_lens: Iterable[int] = DECODE_Q_LENS,
                      head_dim: int = DECODE_HEAD_DIM, dtype: str = "bf16",
                      extra: Iterable[tuple[int, int, int, int, int]] = DECODE_EXTRA) -> list[DecodeShape]:
    """The shapes, in the order they run: heads, batch, kv_len, q_len; then the extra shapes."""
    out = [DecodeShape(dtype, b, n, ql, h, hk, head_dim)
           for h, hk in heads for b in batches for n in kv_lens for ql in q_lens]
    for b, n, ql, h, hk in extra:
        s = DecodeShape(dtype, b, n, ql, h, hk, head_dim)
        if s not in out:
            out.append(s)
    return out


def decode_sweep_from_args(args: argparse.Namespace) -> list[DecodeShape]:
    q = DECODE_QUICK if args.quick else {}
    narrowed = any(getattr(args, a) for a in ("heads", "batches", "kv_lens", "q_lens"))
    return make_decode_sweep(
        heads=args.heads or q.get("heads", DECODE_HEADS),
        batches=args.batches or q.get("batches", DECODE_BATCHES),
        kv_lens=args.kv_lens or q.get("kv_lens", DECODE_KV_LENS),
        q_lens=args.q_lens or DECODE_Q_LENS,
        head_dim=args.head_dim, dtype=args.dtype,
        extra=() if (narrowed or args.no_extra) else DECODE_EXTRA,
    )


def decode_impls(variant: str, paged: bool) -> list[tuple[str, str, bool]]:
    """attngen's rows per shape: (name, variant, paged)."""
    variants = ("fused", "unfused") if variant == "both" else (variant,)
    out = []
    for p in ((False, True) if paged else (False,)):
        for v in variants:
            name = "attngen" + ("" if v == "auto" else f"-{v}") + ("-paged" if p else "")
            out.append((name, v, p))
    return out


def decode_mem_need(shape: DecodeShape, *, paged: bool = False, sdpa_contiguous: bool = False,
                    check: bool = True, unfused: bool = False) -> int:
    """Device bytes one shape needs at its peak: caches, their copies, q/outputs, workspaces, the reference."""
    kv = shape.kv_bytes
    need = kv * (1 + int(paged) + int(sdpa_contiguous))
    rows = shape.batch * shape.q_len * shape.heads * shape.head_dim
    need += rows * ITEMSIZE[shape.dtype] * 8          # q, poisoned outs, peers' outputs
    need += rows * 4 * 64                              # split-KV partials (fp32), up to 64 splits
    if unfused:                                        # the unfused variant's fp32 score rows
        need += shape.batch * shape.heads * shape.q_len * shape.kv_len * 4
    need += shape.batch * 4 * 2                        # cache_seqlens, block table (small)
    if check:
        per_row = shape.kv_len * shape.kv_heads * shape.head_dim * 4 * 2
        need += rows * 4 * 2 + max(per_row, min(REF_CHUNK_BYTES, per_row * shape.batch)) * 2
    return need + MEM_MARGIN


def rotate_copies(kv_bytes: int, free_bytes: int | None = None) -> int:
    """How many K/V copies ``--rotate`` walks per graph replay: enough to cover ROTATE_BYTES, one where a
    single cache already does; at most ``free_bytes // (4 * kv_bytes)``, since a copy may hold a dense cache,
    a paged one and SDPA's contiguous one, and the rest is left to the graph's outputs and workspaces."""
    kv = max(1, int(kv_bytes))
    n = max(1, -(-ROTATE_BYTES // kv))
    if free_bytes is not None:
        n = min(n, max(1, int(free_bytes) // (4 * kv)))
    return n


def rotate_timer(n: int) -> str:
    return f"cuda-events, no flush, {n} calls over {n} K/V copies per CUDA-graph replay"


# --- options --------------------------------------------------------------------------------------

def _heads_list(text: str) -> tuple[tuple[int, int], ...]:
    vals = []
    for part in text.split(","):
        p = part.strip()
        if not p:
            continue
        try:
            h, hk = (int(x) for x in p.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not HEADS/KV_HEADS (e.g. 32/8)") from None
        if h <= 0 or hk <= 0 or h % hk:
            raise argparse.ArgumentTypeError(f"{part!r}: heads must be a positive multiple of kv_heads")
        vals.append((h, hk))
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return tuple(dict.fromkeys(vals))


def _q_len_list(text: str) -> tuple[int, ...]:
    vals = _int_list(text)
    bad = [v for v in vals if v > 8]
    if bad:
        raise argparse.ArgumentTypeError(f"q_len {bad[0]} is not in 1..8")
    return vals


def _one_dtype(text: str) -> str:
    vals = _dtype_list(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one dtype, bf16 or fp16")
    return vals[0]


def _block_size(text: str) -> int:
    v = _nonneg_int(text)
    if v % 16 or not 16 <= v <= 256:
        raise argparse.ArgumentTypeError(f"block size {v} must be a multiple of 16 from 16 to 256")
    return v


def add_parser(sub) -> None:
    pd = sub.add_parser("decode", help="attngen.decode vs SDPA flash / cudnn on a KV cache (GB/s, %% of copy)",
                        description="attngen.decode vs torch SDPA backends on decode shapes (issue sweep: heads "
                                    "32/8, 32/4, 64/8 at head_dim 128; batch 1, 16, 64, 128; kv_len 1k..32k; "
                                    "q_len 1; plus batch 4, q_len 4, 16/1 heads, 16k). "
                                    f"{BYTES_NOTE}. {RATIO_NOTE}. {DECODE_SDPA_NOTE}.")
    pd.add_argument("--heads", type=_heads_list, default=None, help="HEADS/KV_HEADS pairs, e.g. 32/8,64/8")
    pd.add_argument("--batches", type=_int_list, default=None, help="e.g. 1,16 (default 1,16,64,128)")
    pd.add_argument("--kv-lens", type=_int_list, default=None, help="e.g. 4k,32k (default 1k,4k,8k,32k)")
    pd.add_argument("--q-lens", type=_q_len_list, default=None, help="new tokens per row, 1..8 (default 1)")
    pd.add_argument("--head-dim", type=int, choices=(64, 128, 256), default=DECODE_HEAD_DIM)
    pd.add_argument("--dtype", type=_one_dtype, default="bf16", help="bf16 (default) or fp16")
    pd.add_argument("--no-extra", action="store_true",
                    help="leave out the extra shape (batch 4, q_len 4, 16/1 heads, 16k); narrowing options "
                         "(--heads/--batches/--kv-lens/--q-lens) leave it out too")
    pd.add_argument("--quick", action="store_true",
                    help="a small subset: heads 32/8, batch 1,64, kv 4k,32k, plus the extra shape")
    pd.add_argument("--backends", type=_backend_list, default=DECODE_BACKENDS,
                    help="SDPA backends to compare with (default flash,cudnn; efficient refuses GQA)")
    pd.add_argument("--variant", choices=DECODE_VARIANTS, default="auto",
                    help="attngen variant; both = a fused and an unfused row per shape")
    pd.add_argument("--num-splits", type=_nonneg_int, default=0, help="attngen num_splits (0 = automatic)")
    pd.add_argument("--paged", action="store_true", help="also time attngen on a paged copy of the cache")
    pd.add_argument("--block-size", type=_block_size, default=64, help="paged block size (default 64)")
    pd.add_argument("--sdpa-layout", choices=("view", "contiguous"), default="view",
                    help="view (default): SDPA reads attngen's cache through .transpose(1, 2) views; "
                         "contiguous: its own [B, Hkv, L, D] copies (more memory)")
    pd.add_argument("--graph", action="store_true",
                    help="time CUDA-graph replays of each call (attngen and SDPA alike), as serving engines run "
                         "decode steps: GPU time without the Python launch path")
    pd.add_argument("--rotate", action="store_true",
                    help="time a CUDA graph of back-to-back calls, each over its own copy of the inputs (copies "
                         f"adding up to {ROTATE_BYTES >> 20} MiB, past L2), with no L2 flush: a decode step's "
                         "one call per layer; ms = replay time / calls (implies --graph)")
    pd.add_argument("--out", type=Path, default=None, help="folder for bench_decode.json and bench_decode.png")
    pd.add_argument("--markdown", type=Path, default=None, help="write the table as Markdown to FILE")
    pd.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up per measurement (ms, default 25)")
    pd.add_argument("--rep-ms", type=float, default=100.0, help="timed repeats per measurement (ms, default 100)")
    pd.add_argument("--reps", type=int, default=None,
                    help="a fixed number of timed repeats instead of --rep-ms (own CUDA-event loop)")
    pd.add_argument("--no-check", action="store_true", help="skip the correctness spot checks")
    pd.add_argument("--no-pdl", action="store_true",
                    help="launch without programmatic dependent launch (sm_90+), to time what it buys")
    pd.add_argument("--seed", type=int, default=0)
    fi.add_argument(pd)
    pd.add_argument("--copy-mib", type=int, default=COPY_MIB, help=argparse.SUPPRESS)
    pd.add_argument("--from-json", type=Path, default=None,
                    help="re-render table/Markdown/plot from a saved bench_decode.json (no GPU)")
    pd.set_defaults(func=cmd_decode)


# --- measuring ------------------------------------------------------------------------------------

def decode_reference(q, k, v, sm_scale: float | None = None, chunk_bytes: int = REF_CHUNK_BYTES):
    """fp32 decode on a dense cache where every row holds all L keys: out ``[B, q_len, H, D]``.

    q ``[B, q_len, H, D]``, k/v ``[B, L, Hkv, D]``; query i sees keys ``0 .. L - q_len + i``.
    Rows go in chunks so the fp32 copies of K and V stay near ``chunk_bytes``.
    """
    import torch

    b, ql, h, d = q.shape
    n, hk = k.shape[1], k.shape[2]
    g = h // hk
    scale = d ** -0.5 if sm_scale is None else sm_scale
    out = torch.zeros(b, ql, h, d, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    pos = torch.arange(ql, device=q.device)[:, None] + (n - ql)
    keep = torch.arange(n, device=q.device)[None, :] <= pos                 # [q_len, L]
    step = max(1, chunk_bytes // max(1, n * hk * d * 4 * 2))
    with _no_tf32():
        for s0 in range(0, b, step):
            s1 = min(b, s0 + step)
            m = s1 - s0
            qf = q[s0:s1].float().reshape(m, ql, hk, g, d).permute(0, 2, 3, 1, 4).reshape(m, hk, g * ql, d)
            kf = k[s0:s1].float().permute(0, 2, 1, 3)                       # [m, Hkv, L, D]
            s = torch.matmul(qf, kf.transpose(-1, -2)).reshape(m, hk, g, ql, n) * scale
            del kf
            p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)
            del s
            vf = v[s0:s1].float().permute(0, 2, 1, 3)
            o = torch.matmul(p.reshape(m, hk, g * ql, n), vf).reshape(m, hk, g, ql, d)
            out[s0:s1] = o.permute(0, 3, 1, 2, 4).reshape(m, ql, h, d)
            del p, vf, o
    return out


def scatter_blocks(x, block_size: int, seed: int = 0):
    """A dense cache ``[B, L, ...]`` as blocks of ``block_size`` positions scattered over a pool, with
    its block table: (pages ``[B * ceil(L / bs), bs, ...]``, block_table int32 ``[B, ceil(L / bs)]``).
    The order depends on the shapes and ``seed`` only; positions past L in a row's last block hold NaN.
    """
    import torch

    b, n, rest = x.shape[0], x.shape[1], tuple(x.shape[2:])
    bs = block_size
    nb = (n + bs - 1) // bs
    perm = torch.randperm(b * nb, generator=torch.Generator().manual_seed(seed))
    table = perm.view(b, nb).to(torch.int32).to(x.device)
    perm = perm.to(x.device)
    dst = torch.empty(b * nb, bs, *rest, dtype=x.dtype, device=x.device)
    for i in range(b):
        idx = perm[i * nb:(i + 1) * nb]
        if n % bs == 0:
            dst[idx] = x[i].reshape(nb, bs, *rest)
        else:
            tmp = torch.full((nb * bs, *rest), float("nan"), dtype=x.dtype, device=x.device)
            tmp[:n] = x[i]
            dst[idx] = tmp.view(nb, bs, *rest)
            del tmp
    return dst, table


def paged_copy(k, v, block_size: int, seed: int = 0):
    """The dense cache ``[B, L, Hkv, D]`` as blocks scattered over a pool, with its block table.

    Returns (k_pages, v_pages ``[B * ceil(L / bs), bs, Hkv, D]``, block_table int32 ``[B, ceil(L / bs)]``);
    K and V share the table; positions past L in a row's last block hold NaN (``scatter_blocks``).
    """
    k_pages, table = scatter_blocks(k, block_size, seed)
    v_pages, _ = scatter_blocks(v, block_size, seed)
    return k_pages, v_pages, table


def run_decode_shape(shape: DecodeShape, backends: tuple[str, ...], *, impls: list[tuple[str, str, bool]],
                     num_splits: int = 0, block_size: int = 64, check: bool = True, warmup_ms: float = 25.0,
                     rep_ms: float = 100.0, reps: int | None = None, seed: int = 0, sdpa_layout: str = "view",
                     copy_gbps: float | None = None, graph: bool = False, rotate: bool = False,
                     flashinfer: bool = False) -> dict:
    """Check and time one shape: each attngen row and each SDPA backend, on one dense cache; with
    ``flashinfer``, FlashInfer's paged decode on the paged copy (block_size a page), its first call apart.
    With ``graph``, each call is captured once into a CUDA graph and its replays are timed. With
    ``rotate``, one graph holds ``rotate_copies`` calls, each over its own copy of the K/V it reads, and
    its replays are timed without an L2 flush; ms is per call."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[shape.dtype]
    b, n, ql, h, hk, d = shape.batch, shape.kv_len, shape.q_len, shape.heads, shape.kv_heads, shape.head_dim
    gen = torch.Generator(device=core.DEVICE).manual_seed(seed)
    q = torch.randn(b, ql, h, d, device=core.DEVICE, dtype=tdt, generator=gen)
    kc = torch.randn(b, n, hk, d, device=core.DEVICE, dtype=tdt, generator=gen)
    vc = torch.randn(b, n, hk, d, device=core.DEVICE, dtype=tdt, generator=gen)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=core.DEVICE)
    rec: dict[str, Any] = {**asdict(shape), "bytes": shape.kv_bytes, "impls": [name for name, _, _ in impls],
                           "backends": list(backends), "ms": {}, "gbps": {}, "frac_copy": {}, "errors": {},
                           "checks": {}, "sdpa_call": {}, "ratio": {}, "timer": None}

    def fail(name: str, e: BaseException) -> None:
        rec["errors"][name] = _short_error(e)
        rec["ms"][name] = rec["gbps"][name] = rec["frac_copy"][name] = None

    ref = decode_reference(q, kc, vc) if check else None

    # attngen: one call into a NaN-poisoned out decides supported or not, and is the spot check.
    paged = ag_out = None
    fns: dict[str, Callable[[], Any]] = {}
    for name, variant, is_paged in impls:
        try:
            if is_paged:
                if paged is None:
                    paged = paged_copy(kc, vc, block_size, seed)
                kk, vv, kw = paged[0], paged[1], {"block_table": paged[2]}
            else:
                kk, vv, kw = kc, vc, {}

            def fn(kk=kk, vv=vv, kw=kw, variant=variant, out=None):
                return attngen.decode(q, kk, vv, cache_seqlens=seqlens, num_splits=num_splits, variant=variant,
                                      out=out, **kw)

            out = torch.full_like(q, float("nan"))
            fn(out=out)
            torch.cuda.synchronize()
            if ref is not None:
                rec["checks"][name] = _rel_check(out, ref)
            ag_out = out if ag_out is None else ag_out   # FlashInfer's output is held against it
            fns[name] = fn
        except Exception as e:
            fail(name, e)
            torch.cuda.synchronize()

    # SDPA: the first call form each backend accepts (and, with the check, gets right).
    qt = q.transpose(1, 2)
    kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
    if sdpa_layout == "contiguous":
        kt, vt = kt.contiguous(), vt.contiguous()
    gqa = {"enable_gqa": True} if h != hk else {}
    if ql == 1:
        forms = [("no mask", {})]
    else:
        mask = (torch.arange(n, device=core.DEVICE)[None, :]
                <= (torch.arange(ql, device=core.DEVICE)[:, None] + (n - ql)))
        forms = [("bottom-right bool attn_mask", {"attn_mask": mask}),
                 ("is_causal=True (bottom-right in this backend)", {"is_causal": True})]
    for name in backends:
        tried = []
        for label, kw in forms:
            def sdpa(kw=kw, kt=kt, vt=vt):
                return F.scaled_dot_product_attention(qt, kt, vt, **kw, **gqa)
            try:
                with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend(name)):
                    warnings.simplefilter("ignore")
                    o = sdpa()
                torch.cuda.synchronize()
            except Exception as e:
                torch.cuda.synchronize()
                tried.append(f"{label}: {_short_error(e)}")
                continue
            if ref is not None:
                chk = _rel_check(o.transpose(1, 2), ref)
                if not chk["ok"]:
                    tried.append(f"{label}: wrong result (rel L2 {chk['rel_l2']:.2e}, {chk['nan_count']} NaN)")
                    continue
                rec["checks"][name] = chk
            del o
            fns[name] = sdpa
            rec["sdpa_call"][name] = label if ref is not None or ql == 1 else f"{label} (unchecked: --no-check)"
            break
        else:
            rec["errors"][name] = "; ".join(tried)[:400]
            rec["ms"][name] = rec["gbps"][name] = rec["frac_copy"][name] = None
    if flashinfer:   # on the paged copy (q_len 1 only)
        paged = paged or paged_copy(kc, vc, block_size, seed)
        peer = fi.attempt(rec, fi.decode, q, *paged, n, attngen_out=ag_out, nulls=("ms", "gbps", "frac_copy"))
        if peer and ref is not None:
            rec["checks"][fi.NAME] = _rel_check(peer.call().reshape(q.shape), ref)
        if peer:
            fns[fi.NAME] = peer.call
    del ref, ag_out
    peers = list(backends) + ([fi.NAME] if flashinfer else [])

    # Copy 0 is what the checks ran on. With rotate, the others are clones at other addresses (same values,
    # so copy 0's check speaks for them): a graph walking them reads each from DRAM, as a decode step's
    # layers do, where timing one cache again and again would read it from L2 once it fits there.
    copies = [(kc, vc, paged, kt, vt)]
    if rotate:
        for _ in range(rotate_copies(shape.kv_bytes, torch.cuda.mem_get_info()[0]) - 1):
            k2, v2 = kc.clone(), vc.clone()
            # The block table is a few KB, read-only: every copy shares it.
            p2 = None if paged is None else (paged[0].clone(), paged[1].clone(), paged[2])
            if sdpa_layout == "contiguous":
                copies.append((k2, v2, p2, kt.clone(), vt.clone()))
            else:
                copies.append((k2, v2, p2, k2.transpose(1, 2), v2.transpose(1, 2)))
        rec["rotate"] = len(copies)
    paged_rows = {name for name, _, p in impls if p} | {fi.NAME}

    def on_copy(name: str, fn: Callable[..., Any], c: tuple) -> Callable[[], Any]:
        if name in backends:
            return functools.partial(fn, kt=c[3], vt=c[4])
        kk, vv = (c[2][0], c[2][1]) if name in paged_rows else (c[0], c[1])
        return functools.partial(fn, kk=kk, vv=vv)

    def timed(name: str, fn: Callable[..., Any]) -> tuple[float, str]:
        if rotate:
            replay = core._graphed(*(on_copy(name, fn, c) for c in copies))
            ms = core._event_bench(replay, warmup_ms, rep_ms, reps, flush=False) / len(copies)
            return ms, rotate_timer(len(copies))
        ms, timer = core.bench_ms(core._graphed(fn) if graph else fn, warmup_ms, rep_ms, reps)
        return ms, timer + (" on CUDA-graph replays" if graph else "")

    # Timing, attngen rows first.
    for name in [i[0] for i in impls] + peers:
        fn = fns.get(name)
        if fn is None:
            continue
        try:
            if name in backends:   # capture and replay alike under the backend's context
                with warnings.catch_warnings(), sdpa_kernel(_sdpa_backend(name)):
                    warnings.simplefilter("ignore")
                    ms, timer = timed(name, fn)
            else:
                ms, timer = timed(name, fn)
        except Exception as e:
            fail(name, e)
            continue
        rec["timer"] = rec["timer"] or timer
        rec["ms"][name] = ms
        rec["gbps"][name] = gbps(shape.kv_bytes, ms)
        rec["frac_copy"][name] = rec["gbps"][name] / copy_gbps if (copy_gbps and rec["gbps"][name]) else None
    if rotate:  # the bare read of each copy's K/V, in a graph of its own over the same copies (%read)
        try:
            read = _stream_read()
            replay = core._graphed(*(functools.partial(read, c[0], c[1]) for c in copies))
            rec["read_ms"] = core._event_bench(replay, warmup_ms, rep_ms, reps, flush=False) / len(copies)
        except Exception as e:
            rec["errors"]["read"] = _short_error(e)
    for name, _, _ in impls:
        a = rec["ms"].get(name)
        rec["ratio"][name] = {p: (rec["ms"][p] / a if a and rec["ms"].get(p) else None) for p in peers}
    return rec


@functools.lru_cache(maxsize=None)
def _stream_read():
    return core.stream_reader()


# --- the command ----------------------------------------------------------------------------------

def _decode_json_paths(args: argparse.Namespace) -> list[Path]:
    return [Path(args.out) / "bench_decode.json"] if args.out else []


def cmd_decode(args: argparse.Namespace) -> int:
    # The report imports this module's shapes and notes, so it is imported here, not at the top.

    done = _replay_or_gpu_check("decode", args, _finish_decode)
    if done is not None:
        return done
    import torch

    from ... import runtime

    runtime.set_pdl(not args.no_pdl)
    dtype = args.dtype
    shapes = decode_sweep_from_args(args)
    backends = list(args.backends)
    fi_note = fi.wanted(args)
    peers = backends + ([fi.NAME] if fi_note is None else [])   # the columns: SDPA's backends, then FlashInfer
    impls = decode_impls(args.variant, args.paged)
    env = core.environment(gpu=True)
    timer = "cuda-events" if args.reps is not None or core._triton_do_bench() is None else "triton.do_bench"
    if args.rotate:
        timer = "cuda-events, no flush, CUDA-graph replays over rotated K/V copies"
    data: dict[str, Any] = {
        "benchmark": "decode", "complete": False, "env": env,
        "config": {"shapes": len(shapes), "backends": backends, "impls": [i[0] for i in impls],
                   "variant": args.variant, "num_splits": args.num_splits, "paged": args.paged,
                   "block_size": args.block_size, "dtype": dtype, "warmup_ms": args.warmup_ms,
                   "rep_ms": args.rep_ms, "reps": args.reps, "timer": timer, "seed": args.seed,
                   "check": not args.no_check, "check_tolerance_rel_l2": CHECK_TOL, "sdpa_layout": args.sdpa_layout,
                   "graph": bool(getattr(args, "graph", False) or args.rotate), "rotate": bool(args.rotate),
                   "pdl": not args.no_pdl, fi.NAME: fi.config(args),
                   "sdpa_note": DECODE_SDPA_NOTE if args.sdpa_layout == "view" else DECODE_SDPA_CONTIG_NOTE,
                   "bytes": BYTES_NOTE, "ratio": RATIO_NOTE,
                   "targets": {"copy_frac": TARGET_COPY_FRAC, "cudnn_b1_32k": TARGET_B1_CUDNN,
                               "flash": TARGET_FLASH, **({"read_frac": TARGET_READ} if args.rotate else {})}},
        "copy": None, "results": [],
    }
    json_paths = _decode_json_paths(args)

    def save():
        for p in json_paths:
            write_json(p, data)

    for ln in env_lines(env):
        _say(ln)
    try:
        data["copy"] = core.measure_copy_bandwidth(args.copy_mib, args.warmup_ms, args.rep_ms, args.reps)
    except Exception as e:
        data["copy"] = {"error": _short_error(e)}
        _say(f"copy bandwidth: failed: {_short_error(e)}")
    copy_gbps = (data["copy"] or {}).get("gbps")
    _say(_copy_line(data["copy"]))
    _say(f"{len(shapes)} shapes x ({', '.join(i[0] for i in impls)} + sdpa {', '.join(backends)}); timer {timer}, "
         f"warm-up {args.warmup_ms} ms, repeats {args.reps if args.reps is not None else str(args.rep_ms) + ' ms'}")
    _say(BYTES_NOTE)
    _say(RATIO_NOTE)
    _say(data["config"]["sdpa_note"])
    if args.rotate:
        _say(rotate_note([]))
    if fi_note:
        _say(fi_note)
    if not json_paths:
        _say("(no --json/--out: the JSON is not written)")
    _say(decode_text_header(peers))
    t0 = time.perf_counter()
    said: set[tuple[str, str]] = set()
    if shapes:
        # The first shape of a run can come out slow for attngen (its later shapes and the same shape
        # elsewhere in the sweep do not): one untimed pass first.
        try:
            warm = run_decode_shape(shapes[0], tuple(backends), impls=impls, num_splits=args.num_splits,
                                    block_size=args.block_size, check=False, warmup_ms=args.warmup_ms,
                                    rep_ms=args.rep_ms, reps=args.reps, seed=args.seed, sdpa_layout=args.sdpa_layout,
                                    copy_gbps=copy_gbps, graph=args.graph, rotate=args.rotate,
                                    flashinfer=fi_note is None)
            if fi.NAME in warm:   # its JIT build ran here: the first call the run reports
                data["config"][fi.NAME]["first_call"] = warm[fi.NAME]
        except Exception:
            pass
    for i, shape in enumerate(shapes):
        base = {**asdict(shape), "bytes": shape.kv_bytes, "impls": [x[0] for x in impls], "backends": backends}
        need = decode_mem_need(shape, paged=args.paged or fi_note is None,   # FlashInfer reads the paged copy
                               sdpa_contiguous=args.sdpa_layout == "contiguous", check=not args.no_check,
                               unfused=any(v == "unfused" for _, v, _ in impls))
        try:
            torch.cuda.empty_cache()
            free, _total = torch.cuda.mem_get_info()
        except Exception:
            free = None
        if free is not None and need > free:
            rec = {**base, "skipped": f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"}
        else:
            try:
                rec = run_decode_shape(shape, tuple(backends), impls=impls, num_splits=args.num_splits,
                                       block_size=args.block_size, check=not args.no_check,
                                       warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, reps=args.reps,
                                       seed=args.seed + i, sdpa_layout=args.sdpa_layout, copy_gbps=copy_gbps,
                                       graph=args.graph, rotate=args.rotate, flashinfer=fi_note is None)
            except Exception as e:  # e.g. out of memory: keep the sweep going
                rec = {**base, "ms": {}, "gbps": {}, "frac_copy": {}, "ratio": {}, "checks": {},
                       "errors": {"shape": _short_error(e)}}
            core.release_gpu_memory()
        data["results"].append(rec)
        for ln in decode_text_rows(rec, peers):
            _say(ln)
        for n, err in (rec.get("errors") or {}).items():
            if n.startswith("attngen") or n == "shape" or (n, err) not in said:
                _say(f"    {n}: {err}")   # a peer's refusal once, not on every shape
                said.add((n, err))
        if rec.get("skipped"):
            _say(f"    skipped: {rec['skipped']}")
        data["elapsed_s"] = round(time.perf_counter() - t0, 1)
        save()
    if copy_gbps:
        try:
            end = core.measure_copy_bandwidth(args.copy_mib, args.warmup_ms, args.rep_ms, args.reps)
            data["copy"]["end_gbps"] = end["gbps"]
        except Exception:
            pass
    data["complete"] = True
    data["elapsed_s"] = round(time.perf_counter() - t0, 1)
    data["summary"] = decode_summary(data["results"], peers)
    save()
    for p in json_paths:
        _say(f"wrote {p}")
    _say(f"sweep took {data['elapsed_s']} s")
    _finish_decode(data, args, print_table=False)
    failed = [r for r in data["results"] if not r.get("skipped") and (
        any(not c.get("ok") for n, c in (r.get("checks") or {}).items() if n.startswith("attngen"))
        or any(n.startswith("attngen") or n == "shape" for n in (r.get("errors") or {})))]
    if failed:
        _say(f"{len(failed)} shape(s) failed the check or did not run attngen", file=sys.stderr)
        return 1
    return 0
