"""The prefill family's tuning problem (``attngen tune prefill``): FlashAttention's sweep shape,
batch x seqlen x heads with batch = 16384 // seqlen and heads = 2048 // head_dim by default,
q and kv of the same length."""

from __future__ import annotations

import argparse

from ...tune import Problem
from .choose import by_rows
from .spec import MaskMode, PrefillSpec

SIZE = "q and kv sequence length"
BY_SIZE = "query rows"  # what by_size's bounds count
TOKENS = 16384   # default batch * seqlen
HIDDEN = 2048    # default heads * head_dim
DEFAULT_WINDOW = (256, 0)  # for sliding_window specs when no --window is given


def _window(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: LEFT,RIGHT, e.g. 256,0") from None
    if left < -1 or right < -1:
        raise argparse.ArgumentTypeError(f"{text!r}: each side is -1 (unbounded) or a count >= 0")
    return left, right


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--window", type=_window, metavar="L,R", help="window of a sliding_window spec (default 256,0)")


# What attngen.prefill runs by its query rows without a spec or a stored winner (``tune.defaults_by_size``):
# ``choose.BY_ROWS``, head dims 64, 128 and 256 on sm_90a.
by_size = by_rows


def problem_size(spec: PrefillSpec, seqlen: int, batch: int | None = None, heads: int | None = None) -> tuple[int, int]:
    return (batch or max(1, TOKENS // seqlen), heads or max(1, HIDDEN // spec.head_dim))


def visible_pairs(sq: int, sk: int, causal: bool, left: int, right: int) -> int:
    """How many (query, key) pairs the mask lets through, bottom-right aligned as in prefill."""
    if causal:
        right = 0
    total = 0
    for i in range(sq):
        p = i + sk - sq
        hi = sk - 1 if right < 0 else min(sk - 1, p + right)
        lo = 0 if left < 0 else max(0, p - left)
        total += max(0, hi - lo + 1)
    return total


def flops(spec: PrefillSpec, batch: int, heads: int, seqlen: int, window: tuple[int, int]) -> float:
    """FLOPs of one call. FlashAttention's convention (4*B*H*S*S*D, halved for causal) for
    none/causal, as ``attngen bench`` counts; sliding windows count the pairs they keep."""
    from ...bench import attention_flops

    if spec.mask is MaskMode.SLIDING_WINDOW:
        return 4.0 * batch * heads * spec.head_dim * visible_pairs(seqlen, seqlen, False, *window)
    return attention_flops(batch, heads, seqlen, seqlen, spec.head_dim, spec.mask is MaskMode.CAUSAL)


def problem(spec: PrefillSpec, seqlen: int, batch: int, heads: int, seed: int = 0, window=None) -> Problem:
    import torch

    from .op import prefill

    d = spec.head_dim
    causal = spec.mask is MaskMode.CAUSAL
    window = tuple(window or DEFAULT_WINDOW) if spec.mask is MaskMode.SLIDING_WINDOW else (-1, -1)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype.value]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, seqlen, heads, d, generator=gen, device="cuda", dtype=torch.float32).to(tdt)
               for _ in range(3))
    out = torch.empty_like(q)

    def run(s: PrefillSpec) -> tuple:
        res = prefill(q, k, v, causal=causal, window=window, return_lse=spec.return_lse, out=out, spec=s)
        return tuple(res) if spec.return_lse else (res,)

    return Problem(describe={"window": list(window)}, run=run, work=flops(spec, batch, heads, seqlen, window),
                   unit="TFLOP/s", lse_outputs=(1,) if spec.return_lse else (),
                   poison=lambda: out.fill_(float("nan")))
