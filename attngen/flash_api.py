"""FlashAttention 2's entry points over attngen's ops, so that a user swaps one import.

``flash_attn_func``, ``flash_attn_varlen_func``, their qkv- and kv-packed forms and
``flash_attn_with_kvcache`` take FlashAttention 2's arguments and return what it returns:
``softmax_scale``, ``window_size=(left, right)``, ``softcap``, ``alibi_slopes``, ``return_softmax_lse``,
``sinks`` (fp32 ``[heads]`` attention sinks, as FlashAttention 3 and FlashInfer name them),
the LSE as fp32 ``[batch, heads, seqlen_q]`` (natural log); with a KV cache also ``rotary_cos``/``rotary_sin``
(applied by torch before the kernel), ``cache_leftpad`` and any number of new tokens. Any head dim up to 256 runs
(one that no kernel is built for on a zero-padded copy of the operands). What attngen cannot do is refused with a
``LaunchError`` that says so (dropout, attention probabilities), never ignored.
"""

from __future__ import annotations

from . import runtime as _rt
from .errors import LaunchError
from .families.decode import fp8
from .families.decode.op import MAX_Q_LEN, decode
from .families.decode.spec import DecodeSpec
from .families.head_pad import cut, default_scale, pad_widths, zero_padded
from .families.prefill.fp8_op import check_cache_route
from .families.prefill.op import mask_and_window, prefill
from .families.prefill.varlen import prefill_varlen
from .kvcache import PAGES, ROWS, append, capacity_of, check_leftpad, chunked_prefill, prefill_route, rotary_qk


def _window(window_size) -> tuple[int, int]:
    try:
        left, right = (int(window_size[0]), int(window_size[1]))
    except (TypeError, ValueError, IndexError):
        raise LaunchError(f"window_size={window_size!r} must be a pair (left, right) of ints, -1 for unbounded") \
            from None
    return left, right


def _refuse(dropout_p, return_attn_probs, native: str) -> None:
    if dropout_p:
        raise LaunchError(f"dropout_p={dropout_p!r} is not supported; allowed: 0.0 (attngen's kernels are "
                          f"inference forward passes)")
    if return_attn_probs:
        raise LaunchError(f"return_attn_probs=True is not supported: attngen never materialises the attention "
                          f"probabilities; for the LSE call attngen.{native}(..., return_lse=True)")


def flash_attn_func(q, k, v, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                    return_attn_probs: bool = False, sinks=None, score_mod: str = "", mask_mod: str = "", aux=None,
                    q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention 2's ``flash_attn_func``: q ``[batch, seqlen_q, heads, head_dim]``, k and v
    ``[batch, seqlen_k, kv_heads, head_dim]``; returns out like q. ``causal`` aligns bottom-right;
    ``window_size=(left, right)``, -1 unbounded. ``deterministic`` is accepted (the forward pass
    always is). ``dropout_p`` > 0 and ``return_attn_probs`` are refused: attngen runs no dropout
    and never materialises the probabilities. ``sinks`` (fp32 ``[heads]``): attention sinks, as in
    ``attngen.prefill``; ``score_mod``, ``mask_mod`` and ``aux``: a user's variant, as there (docs/variants.md).
    fp8 q, k, v (``torch.float8_e4m3fn``) with ``q_descale``, ``k_descale``, ``v_descale`` as FlashAttention 3 takes
    them (fp32 ``[batch, kv_heads]``, or per tensor / per KV head, or numbers): ``attngen.prefill``'s fp8 path."""
    _refuse(dropout_p, return_attn_probs, "prefill")
    left, right = _window(window_size)
    return prefill(q, k, v, causal=bool(causal), window=(left, right), sm_scale=softmax_scale, softcap=softcap,
                   alibi_slopes=alibi_slopes, sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, aux=aux,
                   q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table=None, sinks=None, score_mod: str = "",
                           mask_mod: str = "", aux=None, q_descale=None, k_descale=None, v_descale=None):
    """FlashAttention 2's ``flash_attn_varlen_func`` on ``attngen.prefill_varlen``: q
    ``[total_q, heads, head_dim]``, k and v ``[total_k, kv_heads, head_dim]`` (or, with
    ``block_table`` int32 ``[batch, max_blocks]``, a paged cache ``[num_blocks, block_size,
    kv_heads, head_dim]``), int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``[batch + 1]``; returns out
    like q. ``causal`` aligns bottom-right per sequence; ``window_size=(left, right)``, -1
    unbounded. ``dropout_p`` > 0 and ``return_attn_probs`` are refused, as in ``flash_attn_func``;
    ``sinks``, ``score_mod``, ``mask_mod`` and ``aux`` as there; fp8 q, k, v with the descales as in
    ``flash_attn_func`` (per sequence where ``[batch, kv_heads]``)."""
    _refuse(dropout_p, return_attn_probs, "prefill_varlen")
    left, right = _window(window_size)
    return prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=bool(causal),
                          window=(left, right), sm_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes,
                          block_table=block_table, sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, aux=aux,
                          q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def _unpack(t, n: int, name: str, dims: str):
    """The ``n`` tensors packed along dim -3 of ``t`` (FlashAttention's qkv / kv layouts), as views."""
    shape = tuple(getattr(t, "shape", ()))
    if len(shape) < 3 or shape[-3] != n:
        raise LaunchError(f"{name} has shape {shape}; expected {dims}")
    return tuple(t[(slice(None),) * (len(shape) - 3) + (i,)] for i in range(n))


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                              window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                              deterministic: bool = False, return_attn_probs: bool = False, sinks=None):
    """FlashAttention 2's ``flash_attn_qkvpacked_func``: qkv ``[batch, seqlen, 3, heads, head_dim]``
    (q, k and v with the same heads), read in place; otherwise as ``flash_attn_func``."""
    q, k, v = _unpack(qkv, 3, "qkv", "[batch, seqlen, 3, heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                             window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                             deterministic: bool = False, return_attn_probs: bool = False, sinks=None):
    """FlashAttention 2's ``flash_attn_kvpacked_func``: kv ``[batch, seqlen_k, 2, kv_heads, head_dim]``,
    read in place; otherwise as ``flash_attn_func``."""
    k, v = _unpack(kv, 2, "kv", "[batch, seqlen_k, 2, kv_heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs, sinks=sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                                     softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                                     return_attn_probs: bool = False, sinks=None):
    """FlashAttention 2's ``flash_attn_varlen_qkvpacked_func``: qkv ``[total, 3, heads, head_dim]``
    and one ``cu_seqlens`` for queries and keys; otherwise as ``flash_attn_varlen_func``."""
    q, k, v = _unpack(qkv, 3, "qkv", "[total, 3, heads, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                                  sinks=sinks)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                    deterministic: bool = False, return_attn_probs: bool = False, sinks=None):
    """FlashAttention 2's ``flash_attn_varlen_kvpacked_func``: kv ``[total_k, 2, kv_heads, head_dim]``;
    otherwise as ``flash_attn_varlen_func``."""
    k, v = _unpack(kv, 2, "kv", "[total_k, 2, kv_heads, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs, sinks=sinks)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                            softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes=None,
                            num_splits: int = 0, return_softmax_lse: bool = False, sinks=None, k_scale=None,
                            v_scale=None, score_mod: str = "", mask_mod: str = "", aux=None):
    """FlashAttention 2's ``flash_attn_with_kvcache`` on ``attngen.decode`` (and, past 8 new tokens,
    ``attngen.prefill_varlen`` over the cache).

    q ``[batch, seqlen_q, heads, head_dim]``; the cache contiguous ``[cache_batch, max_seqlen,
    kv_heads, head_dim]`` (rows by ``cache_batch_idx``) or paged ``[num_blocks, block_size, kv_heads,
    head_dim]`` through ``block_table``. ``cache_seqlens`` (int or int32 ``[batch]``) is where each
    row ends before this call. With ``k``/``v`` (``[batch, seqlen_new, kv_heads, head_dim]``) they are
    written into the cache at ``cache_seqlens`` first (torch tensors; on the device, no host sync),
    and the queries attend to ``cache_seqlens + seqlen_new`` keys; without them, to ``cache_seqlens``.
    Queries align bottom-right. ``causal`` lets each new token see itself and what precedes it;
    ``window_size=(left, right)`` (-1 unbounded) keeps keys left before to right after the token's
    position (``causal`` sets right to 0). ``cache_leftpad`` (int32 ``[batch]``) is each row's first
    cache position: keys before it are not attended, and the append still starts at
    ``cache_seqlens``.

    ``rotary_cos``/``rotary_sin`` ``[seqlen_ro, rotary_dim / 2]`` (seqlen_ro at least the cache's
    capacity) rotate the first rotary_dim features of q and of the new k (GPT-J pairs with
    ``rotary_interleaved``, else GPT-NeoX halves) before the append: k at positions
    ``cache_seqlens + i`` (less ``cache_leftpad``), q likewise where the call is causal or has a
    window, else every query at ``cache_seqlens``. attngen applies it with torch operations before
    the kernel (not fused into it); q is not modified, the cache receives the rotated k.

    Up to 8 new tokens take the decode kernels (``num_splits`` 0 chooses the split-KV count). More
    take the prefill kernel over the cache: paged, or a contiguous cache presented as pages where its
    rows are whole multiples of 16 positions apart; else (``cache_leftpad``, or other rows) over the
    contiguous cache's rows laid end to end. A paged cache with ``cache_leftpad`` runs the decode
    kernels on 8 tokens at a time, each token keeping its own window; there ALiBi with keys after a
    token's position (``causal=False`` with window right not 0) is refused. Returns out, or
    ``(out, lse)`` with ``return_softmax_lse`` (fp32 ``[batch, heads, seqlen_q]``; a token that sees
    no key gives zeros and LSE -inf). A head dim up to 256 that is not a multiple of 8 (or is below
    32) runs on zero-padded copies of q and the cache, made after ``k``/``v`` are appended to the
    caller's cache; that costs a copy of q and the cache per call.

    ``sinks`` (fp32 ``[heads]``): attention sinks as ``attngen.decode`` and ``attngen.prefill_varlen`` take them
    (the returned LSE includes them), on every route.

    fp8 caches (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) with ``k_scale``/``v_scale`` as in
    ``attngen.decode`` (a number, or an fp32 device tensor [] / [1] / [kv_heads]; missing: 1): ``k``/``v`` come in
    q's dtype and are appended as ``k / k_scale`` rounded to the cache's format, saturating at its largest finite
    value. Past 8 new tokens the routes above serve it (the prefill kernel over the fp8 cache widens its tiles; see
    docs/prefill.md), checked before the cache is written.

    ``score_mod``, ``mask_mod`` and ``aux``: a user's variant as ``attngen.decode`` takes it (q_idx the token's
    position, kv_idx the key's cache position), on the decode route and, past 8 new tokens, on a paged cache or a
    contiguous one presented as pages; other routes (``cache_leftpad``, rows not 16 positions apart) refuse them.
    """
    left, right = _window(window_size)
    if left < -1 or right < -1:
        raise LaunchError(f"window_size={tuple(window_size)!r}: each side must be >= 0, or -1 for unbounded")
    if cache_seqlens is None:
        raise LaunchError("cache_seqlens is required: an int or an int32 tensor [batch] of each row's length")
    if (k is None) != (v is None):
        raise LaunchError("k and v go together: pass both (to append them to the cache) or neither")
    if (rotary_cos is None) != (rotary_sin is None):
        raise LaunchError("rotary_cos and rotary_sin go together: pass both or neither")
    if rotary_cos is not None and k is None:
        raise LaunchError("rotary_cos/rotary_sin rotate the new k before the append: pass k and v with them "
                          "(without new tokens, rotate q yourself and call without rotary_cos)")
    check_leftpad(cache_leftpad, q)
    causal = bool(causal)
    local = causal or (left, right) != (-1, -1)
    many = q.shape[1] > MAX_Q_LEN
    # An fp8 cache: checked before the cache is written, the new tokens quantised as they are appended.
    kv8 = fp8.check_kvcache_call(q, k_cache, v_cache, k, k_scale, v_scale, many)
    # The route of many new tokens is settled (or refused) before the cache is written.
    mods = bool(score_mod or mask_mod or aux)
    # The decode kernel over a packed q takes a few more tokens than MAX_Q_LEN, but not snippets, fp8 caches or a
    # torch.compile trace (attngen::decode has no packed form; prefill_varlen's op serves the trace).
    packable = not mods and kv8 is None and q.shape[-1] <= 256 and not (_rt.tracing is not None and _rt.tracing())
    route = prefill_route(q, k_cache, v_cache, cache_batch_idx, cache_leftpad, block_table, causal, (left, right),
                          alibi_slopes is not None, packable) if many else None
    if mods and route is not None and route != PAGES:
        raise LaunchError(f"score_mod/mask_mod with {q.shape[1]} new tokens on this cache is not supported (the "
                          f"{route!r} route counts positions otherwise); allowed: up to {MAX_Q_LEN} new tokens, or a "
                          "paged cache (or a contiguous one whose rows are multiples of 16 positions apart) without "
                          "cache_leftpad")
    if kv8 is not None and route in (PAGES, ROWS):  # the fp8 cache's prefill kernel, checked before the write
        check_cache_route(q, kv8, route == PAGES, mask_and_window(causal, (left, right))[0], bool(softcap),
                          alibi_slopes is not None, sinks is not None)
    if rotary_cos is not None:
        q, k = rotary_qk(q, k, rotary_cos, rotary_sin, cache_seqlens, cache_leftpad, bool(rotary_interleaved),
                         local, capacity_of(k_cache, block_table))
    lengths = cache_seqlens
    if k is not None:  # into the caller's cache, before any padded copy of it
        into = (k_cache, v_cache, k, v)
        if kv8 is not None:
            into = fp8.byte_views(k_cache, v_cache, fp8.quantise(k, k_scale, kv8), fp8.quantise(v, v_scale, kv8))
        lengths = append(*into, cache_seqlens, cache_batch_idx, block_table)
    # A head dim no kernel is built for: q and the cache padded once here rather than by each kernel call.
    widths = pad_widths(q, k_cache, v_cache, DecodeSpec.HEAD_DIMS, v_as_k=True)
    d = q.shape[-1]
    if widths is not None:
        q, k_cache, v_cache = (zero_padded(x, widths[0]) for x in (q, k_cache, v_cache))
        softmax_scale = default_scale(softmax_scale, d)
    common = dict(sm_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes)
    if mods:
        common.update(score_mod=score_mod, mask_mod=mask_mod, aux=aux)
    if not many:
        r = decode(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=cache_batch_idx,
                   block_table=block_table, num_splits=num_splits, return_lse=return_softmax_lse, causal=causal,
                   window=(left, right), cache_leftpad=cache_leftpad, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                   **common)
    else:
        if kv8 is not None:  # (the fp8 cache's scales, to whichever kernel serves the route)
            common.update(k_scale=k_scale, v_scale=v_scale)
        r = chunked_prefill(q, k_cache, v_cache, lengths, route, cache_batch_idx, cache_leftpad, block_table,
                            (left, right), num_splits, causal, bool(return_softmax_lse), common, sinks)
    return r if q.shape[-1] == d else cut(r, d, None, bool(return_softmax_lse))
