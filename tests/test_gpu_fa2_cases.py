"""FlashAttention 2's forward cases through attngen's FlashAttention-named entry points (pytest -m gpu).

The parameter space FlashAttention 2's own forward tests cover (head dims 32 to 256 with odd ones, the
lengths, MHA/MQA/GQA, causal, sliding windows, softcap, ALiBi, dropout, packed qkv/kv, varlen, the KV-cache
call with appended tokens, cache_batch_idx, left pads, paged blocks of 256 and 512, num_splits), walked
here by a fixed sample of its combinations; written for attngen, none of its code. Each case either runs
and matches the fp32 reference, or is refused with a LaunchError whose reason is one of REFUSALS. The
counts per outcome are printed (``-s``), and any other exception or a wrong result fails the test.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]
torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import reference_attention, reference_decode, rel  # noqa: E402

TOL = 2e-2
# What attngen refuses by name, and the words the refusal carries. Only dropout, and (the KV-cache call) ALiBi with
# keys after a token's position on a paged cache with left pads (which FlashAttention 2 refuses too), may be
# refused: head dims up to 256 run (padded where no kernel is built for them), paged blocks of any size,
# and many new tokens without causality take the prefill kernel (or decode calls) over any cache.
REFUSALS = {"dropout": "dropout_p=", "head_dim": "head_dim=", "block_size": "block_size=",
            "many new tokens, ALiBi, keys after the token's own, paged with left pads": "and alibi_slopes is not "
                                                                                      "supported with cache_leftpad"}
ALLOWED = {"refused: dropout", "refused: many new tokens, ALiBi, keys after the token's own, paged with left pads"}
HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
LENGTHS = ((113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024),
           (1024, 1023), (2048, 2048))


def _refused(e: Exception) -> str:
    for reason, words in REFUSALS.items():
        if words in str(e):
            return reason
    raise e


def _heads(kind: str) -> tuple[int, int]:
    return {"mha": (6, 6), "mqa": (6, 1), "gqa": (6, 2)}[kind]


def _window(rng, sk):
    return (rng.randrange(0, sk), rng.randrange(0, sk))


def _cycled(rng, space, flags) -> list:
    """Each point of ``space`` with the next of the ``flags`` combinations (shuffled by ``rng``), cycling through
    them, so every combination is used about as often and each point gets one."""
    flags = list(flags)
    rng.shuffle(flags)
    return [(*p, *flags[i % len(flags)]) for i, p in enumerate(space)]


def _run(cases, body, counts: Counter):
    for case in cases:
        try:
            body(*case)
        except attngen.LaunchError as e:
            counts["refused: " + _refused(e)] += 1
        else:
            counts["passed"] += 1


def test_fa2_dense_cases(cache_dir):
    """flash_attn_func and its packed forms: every head dim x every length pair, with the flags cycled."""
    rng, gen = random.Random(1), torch.Generator(device="cuda")
    gen.seed()
    cases = _cycled(rng, [(d, sq, sk) for d, (sq, sk) in itertools.product(HEAD_DIMS, LENGTHS)],
                    itertools.product((False, True), (False, True), (False, True), (0.0, 50.0), ("mha", "mqa", "gqa"),
                                      (False, True), (torch.float16, torch.bfloat16), (0.0, 0.17)))
    counts = Counter()

    def body(d, sq, sk, causal, local, alibi, softcap, kind, kvpacked, dtype, dropout):
        h, hk = _heads(kind)
        b = 2 if sq * sk > 10 ** 6 else 4
        q = torch.randn(b, sq, h, d, device="cuda", generator=gen).to(dtype)
        kv = torch.randn(b, sk, 2, hk, d, device="cuda", generator=gen).to(dtype)
        window = _window(rng, sk) if local else (-1, -1)
        slopes = torch.rand(b, h, device="cuda", generator=gen) * 0.3 if alibi else None
        kw = dict(dropout_p=dropout, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
        if kvpacked:
            out = attngen.flash_attn_kvpacked_func(q, kv, **kw)
        else:
            out = attngen.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], **kw)
        ref, _ = reference_attention(q, kv[:, :, 0], kv[:, :, 1], causal=causal, window=window, softcap=softcap,
                                     alibi_slopes=slopes)
        assert torch.isfinite(out).all() and rel(out, ref) < TOL, (d, sq, sk, causal, local, alibi, softcap, kind)

    _run(cases, body, counts)
    print("dense:", dict(counts))
    assert counts["passed"] > 0 and set(counts) <= {"passed"} | ALLOWED, dict(counts)


def test_fa2_varlen_cases(cache_dir):
    """flash_attn_varlen_func and its packed forms over random lengths (some empty)."""
    rng, gen = random.Random(2), torch.Generator(device="cuda")
    gen.seed()
    cases = _cycled(rng, [(d, sq, sk) for d, (sq, sk) in itertools.product(HEAD_DIMS, LENGTHS)],
                    itertools.product((False, True), (False, True), (False, True), (0.0, 50.0), ("mha", "mqa", "gqa"),
                                      ("none", "kv", "qkv"), (torch.float16, torch.bfloat16), (0.0, 0.17)))
    counts = Counter()

    def body(d, sq, sk, causal, local, alibi, softcap, kind, packed, dtype, dropout):
        h, hk = _heads(kind)
        if packed == "qkv":
            sk, hk = sq, h
        b = 4
        lens_q = [rng.randrange(0, sq + 1) for _ in range(b)]
        lens_k = lens_q if packed == "qkv" else [rng.randrange(1, sk + 1) for _ in range(b)]
        cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32, device="cuda")
        window = _window(rng, sk) if local else (-1, -1)
        slopes = torch.rand(b, h, device="cuda", generator=gen) * 0.3 if alibi else None
        kw = dict(dropout_p=dropout, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
        if packed == "qkv":
            qkv = torch.randn(sum(lens_q), 3, h, d, device="cuda", generator=gen).to(dtype)
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
            out = attngen.flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(lens_q), **kw)
        else:
            q = torch.randn(sum(lens_q), h, d, device="cuda", generator=gen).to(dtype)
            kv = torch.randn(sum(lens_k), 2, hk, d, device="cuda", generator=gen).to(dtype)
            k, v = kv[:, 0], kv[:, 1]
            if packed == "kv":
                out = attngen.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
            else:
                out = attngen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
        q0 = k0 = 0
        for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
            if nq:
                ref, _ = reference_attention(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk],
                                             causal=causal, window=window, softcap=softcap,
                                             alibi_slopes=None if slopes is None else slopes[s:s + 1])
                got = out[None, q0:q0 + nq]
                assert torch.isfinite(got).all() and rel(got, ref) < TOL, (d, s, nq, nk, causal, local, kind)
            q0, k0 = q0 + nq, k0 + nk

    _run(cases, body, counts)
    print("varlen:", dict(counts))
    assert counts["passed"] > 0 and set(counts) <= {"passed"} | ALLOWED, dict(counts)


def test_fa2_kvcache_cases(cache_dir):
    """flash_attn_with_kvcache: new tokens 1 or 339, appended or already in the cache, cache_batch_idx, left
    pads, paged blocks of 256 and 512, causal, windows, ALiBi, num_splits 1 and automatic."""
    rng, gen = random.Random(3), torch.Generator(device="cuda")
    gen.seed()
    space = list(itertools.product((32, 59, 64, 80, 128, 256), (1, 339), (128, 339, 1024, 800, 256, 799, 2048)))
    cases = _cycled(rng, space, itertools.product((None, 256, 512), (False, True), (False, True), (False, True),
                                                  (False, True), (False, True), (False, True), ("mha", "mqa", "gqa"),
                                                  (1, 0), (torch.float16, torch.bfloat16)))
    counts = Counter()

    def body(d, n_new, sk, block, batch_idx, leftpad, causal, local, alibi, new_kv, kind, splits, dtype):
        h, hk = _heads(kind)
        b = 2
        if n_new > sk:
            n_new = sk
        lengths = [rng.randrange(0, sk - n_new + 1) for _ in range(b)] if new_kv else \
            [rng.randrange(n_new, sk + 1) for _ in range(b)]
        pads = [rng.randrange(0, n + 1) if leftpad else 0 for n in lengths]
        if block:
            per = -(-sk // block)
            kc = torch.randn(b * per + 1, block, hk, d, device="cuda", generator=gen).to(dtype)
            table = torch.randperm(b * per + 1, device="cuda", generator=gen)[:b * per].to(torch.int32).view(b, per)
            rows = None
        else:
            kc = torch.randn(b + 1, sk, hk, d, device="cuda", generator=gen).to(dtype)
            table = None
            rows = torch.tensor([1, 0], dtype=torch.int32, device="cuda") if batch_idx else None
        vc = torch.randn_like(kc)
        q = torch.randn(b, n_new, h, d, device="cuda", generator=gen).to(dtype)
        k_new = torch.randn(b, n_new, hk, d, device="cuda", generator=gen).to(dtype) if new_kv else None
        v_new = torch.randn_like(k_new) if new_kv else None
        seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        pad_t = torch.tensor(pads, dtype=torch.int32, device="cuda") if leftpad else None
        window = _window(rng, sk) if local else (-1, -1)
        slopes = torch.rand(b, h, device="cuda", generator=gen) * 0.3 if alibi else None
        out = attngen.flash_attn_with_kvcache(q, kc, vc, k=k_new, v=v_new, cache_seqlens=seqlens,
                                              cache_batch_idx=rows, cache_leftpad=pad_t, block_table=table,
                                              causal=causal, window_size=window, alibi_slopes=slopes,
                                              num_splits=splits)
        ends = seqlens + n_new if new_kv else seqlens
        ref, _ = reference_decode(q, kc, vc, ends, cache_batch_idx=rows, block_table=table, causal=causal,
                                  window=window, cache_leftpad=pad_t, alibi_slopes=slopes)
        seen = _rows_that_see_keys(ends.tolist(), pads, n_new, causal, window)
        got, want = out.float()[seen], ref[seen]
        assert torch.isfinite(out).all() and (not seen.any() or rel(got, want) < TOL), \
            (d, n_new, sk, block, leftpad, causal, local, new_kv, kind)

    _run(cases, body, counts)
    print("kvcache:", dict(counts))
    assert counts["passed"] > 0 and set(counts) <= {"passed"} | ALLOWED, dict(counts)


def _rows_that_see_keys(ends, pads, n_new, causal, window):
    """[b, n_new] bool: the tokens that see at least one key (the others are zeros in both)."""
    left, right = window
    if causal:
        right = 0
    seen = torch.zeros(len(ends), n_new, dtype=torch.bool)
    for i, (end, pad) in enumerate(zip(ends, pads)):
        for t in range(n_new):
            pos = end - n_new + t
            lo = max(pad, pos - left if left >= 0 else pad)
            hi = min(end - 1, pos + right if right >= 0 else end - 1)
            seen[i, t] = lo <= hi
    return seen.cuda()
