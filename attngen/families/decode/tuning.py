"""The decode family's tuning problem (``attngen tune decode``): a decode step of ``batch``
sequences, each ``seqlen`` keys long, against a contiguous or (``paged=true``) paged cache.

The spec's ``q_rows`` fixes how many packed query rows a CTA holds: the search runs
q_len = q_rows / 16 (at least 1) new tokens per sequence with a GQA group of q_rows / q_len
(16 at most), on ``--kv-heads`` KV heads. Timed as the op's host call plus its launches; the
rate is GB/s of K and V read.
"""

from __future__ import annotations

import argparse

from ...tune import Problem, positive_int
from .spec import DecodeSpec

SIZE = "cache length per sequence"
BATCH = 16
KV_HEADS = 8
BLOCK_SIZE = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-heads", type=positive_int, metavar="N", help=f"KV heads (default {KV_HEADS})")
    p.add_argument("--block-size", type=positive_int, metavar="N",
                   help=f"block size of a paged spec's cache (default {BLOCK_SIZE})")


def shape(spec: DecodeSpec) -> tuple[int, int]:
    """(q_len, GQA group) whose packed rows fill ``spec.q_rows``."""
    q_len = max(1, spec.q_rows // 16)
    return q_len, spec.q_rows // q_len


def problem_size(spec: DecodeSpec, seqlen: int, batch: int | None = None, heads: int | None = None) -> tuple[int, int]:
    """(batch, query heads); ``heads`` is the GQA group times the KV heads."""
    return batch or BATCH, heads or shape(spec)[1] * KV_HEADS


def problem(spec: DecodeSpec, seqlen: int, batch: int, heads: int, seed: int = 0, kv_heads=None,
            block_size=None) -> Problem:
    import torch

    from .op import decode

    q_len, group = shape(spec)
    hk = kv_heads or max(1, heads // group)
    heads = hk * group
    d = spec.head_dim
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype.value]
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(tdt)

    q = randn(batch, q_len, heads, d)
    seqlens = torch.full((batch,), seqlen, device="cuda", dtype=torch.int32)
    kw = {}
    if spec.paged:
        bs = block_size or BLOCK_SIZE
        per_row = -(-seqlen // bs)
        k, v = randn(batch * per_row, bs, hk, d), randn(batch * per_row, bs, hk, d)
        kw["block_table"] = torch.randperm(batch * per_row, generator=gen.manual_seed(seed + 1),
                                           device="cuda").to(torch.int32).reshape(batch, per_row)
    else:
        k, v = randn(batch, seqlen, hk, d), randn(batch, seqlen, hk, d)
    out = torch.empty_like(q)

    def run(s: DecodeSpec) -> tuple:
        return (decode(q, k, v, cache_seqlens=seqlens, out=out, variant=spec.variant.value, spec=s, **kw),)

    kv_bytes = 2 * batch * seqlen * hk * d * 2
    return Problem(describe={"q_len": q_len, "kv_heads": hk, "block_size": (block_size or BLOCK_SIZE) if spec.paged
                             else None}, run=run, work=kv_bytes, unit="GB/s",
                   poison=lambda: out.fill_(float("nan")))
