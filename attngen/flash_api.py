"""FlashAttention 2's entry points over attngen's ops, so that a user swaps one import.

``flash_attn_func``, ``flash_attn_varlen_func``, their qkv- and kv-packed forms and
``flash_attn_with_kvcache`` take FlashAttention 2's arguments and return what it returns:
``softmax_scale``, ``window_size=(left, right)``, ``softcap``, ``alibi_slopes``, ``return_softmax_lse``,
the LSE as fp32 ``[batch, heads, seqlen_q]`` (natural log). What attngen cannot do is refused with a
``LaunchError`` that says so (dropout, attention probabilities, rotary embedding inside the call), never ignored.
"""

from __future__ import annotations

from .errors import LaunchError
from .families.decode.op import decode
from .families.prefill.op import prefill
from .families.prefill.varlen import prefill_varlen


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
                    return_attn_probs: bool = False):
    """FlashAttention 2's ``flash_attn_func``: q ``[batch, seqlen_q, heads, head_dim]``, k and v
    ``[batch, seqlen_k, kv_heads, head_dim]``; returns out like q. ``causal`` aligns bottom-right;
    ``window_size=(left, right)``, -1 unbounded. ``deterministic`` is accepted (the forward pass
    always is). ``dropout_p`` > 0 and ``return_attn_probs`` are refused: attngen runs no dropout
    and never materialises the probabilities."""
    _refuse(dropout_p, return_attn_probs, "prefill")
    left, right = _window(window_size)
    return prefill(q, k, v, causal=bool(causal), window=(left, right), sm_scale=softmax_scale, softcap=softcap,
                   alibi_slopes=alibi_slopes)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                           dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                           window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table=None):
    """FlashAttention 2's ``flash_attn_varlen_func`` on ``attngen.prefill_varlen``: q
    ``[total_q, heads, head_dim]``, k and v ``[total_k, kv_heads, head_dim]`` (or, with
    ``block_table`` int32 ``[batch, max_blocks]``, a paged cache ``[num_blocks, block_size,
    kv_heads, head_dim]``), int32 ``cu_seqlens_q``/``cu_seqlens_k`` ``[batch + 1]``; returns out
    like q. ``causal`` aligns bottom-right per sequence; ``window_size=(left, right)``, -1
    unbounded. ``dropout_p`` > 0 and ``return_attn_probs`` are refused, as in ``flash_attn_func``."""
    _refuse(dropout_p, return_attn_probs, "prefill_varlen")
    left, right = _window(window_size)
    return prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=bool(causal),
                          window=(left, right), sm_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes,
                          block_table=block_table)


def _unpack(t, n: int, name: str, dims: str):
    """The ``n`` tensors packed along dim -3 of ``t`` (FlashAttention's qkv / kv layouts), as views."""
    shape = tuple(getattr(t, "shape", ()))
    if len(shape) < 3 or shape[-3] != n:
        raise LaunchError(f"{name} has shape {shape}; expected {dims}")
    return tuple(t[(slice(None),) * (len(shape) - 3) + (i,)] for i in range(n))


def flash_attn_qkvpacked_func(qkv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                              window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                              deterministic: bool = False, return_attn_probs: bool = False):
    """FlashAttention 2's ``flash_attn_qkvpacked_func``: qkv ``[batch, seqlen, 3, heads, head_dim]``
    (q, k and v with the same heads), read in place; otherwise as ``flash_attn_func``."""
    q, k, v = _unpack(qkv, 3, "qkv", "[batch, seqlen, 3, heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                             window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                             deterministic: bool = False, return_attn_probs: bool = False):
    """FlashAttention 2's ``flash_attn_kvpacked_func``: kv ``[batch, seqlen_k, 2, kv_heads, head_dim]``,
    read in place; otherwise as ``flash_attn_func``."""
    k, v = _unpack(kv, 2, "kv", "[batch, seqlen_k, 2, kv_heads, head_dim]")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen: int, dropout_p: float = 0.0,
                                     softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                                     softcap: float = 0.0, alibi_slopes=None, deterministic: bool = False,
                                     return_attn_probs: bool = False):
    """FlashAttention 2's ``flash_attn_varlen_qkvpacked_func``: qkv ``[total, 3, heads, head_dim]``
    and one ``cu_seqlens`` for queries and keys; otherwise as ``flash_attn_varlen_func``."""
    q, k, v = _unpack(qkv, 3, "qkv", "[total, 3, heads, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                                    window_size=(-1, -1), softcap: float = 0.0, alibi_slopes=None,
                                    deterministic: bool = False, return_attn_probs: bool = False):
    """FlashAttention 2's ``flash_attn_varlen_kvpacked_func``: kv ``[total_k, 2, kv_heads, head_dim]``;
    otherwise as ``flash_attn_varlen_func``."""
    k, v = _unpack(kv, 2, "kv", "[total_k, 2, kv_heads, head_dim]")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale: float | None = None, causal: bool = False, window_size=(-1, -1),
                            softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes=None,
                            num_splits: int = 0, return_softmax_lse: bool = False):
    """FlashAttention 2's ``flash_attn_with_kvcache`` on ``attngen.decode``.

    q ``[batch, seqlen_new, heads, head_dim]`` (seqlen_new 1..8); the cache contiguous
    ``[cache_batch, max_seqlen, kv_heads, head_dim]`` (rows by ``cache_batch_idx``) or paged
    ``[num_blocks, block_size, kv_heads, head_dim]`` through ``block_table``. ``cache_seqlens``
    (int or int32 ``[batch]``) is each row's length before this call. With ``k``/``v``
    (``[batch, seqlen_new, kv_heads, head_dim]``) they are written into the cache at
    ``cache_seqlens`` first (torch tensors; on the device, no host sync), and the query attends
    to ``cache_seqlens + seqlen_new`` keys; without them, to ``cache_seqlens`` keys. Queries
    align bottom-right; with seqlen_new > 1 only ``causal=True`` is supported (each new token
    sees itself and what precedes it). Returns out, or ``(out, lse)`` with ``return_softmax_lse``.
    Rotary embedding inside the call, ``cache_leftpad`` and a sliding window are refused.
    """
    for name, val in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_leftpad", cache_leftpad)):
        if val is not None:
            raise LaunchError(f"{name} is not supported by attngen's flash_attn_with_kvcache; apply rotary "
                              f"embedding (and left padding) before the call")
    if tuple(_window(window_size)) != (-1, -1):
        raise LaunchError(f"window_size={tuple(window_size)!r} is not supported with a KV cache; allowed: (-1, -1)")
    if cache_seqlens is None:
        raise LaunchError("cache_seqlens is required: an int or an int32 tensor [batch] of each row's length")
    if (k is None) != (v is None):
        raise LaunchError("k and v go together: pass both (to append them to the cache) or neither")
    q_len = q.shape[1]
    if q_len > 1 and not causal:
        raise LaunchError(f"seqlen_new={q_len} with causal=False is not supported; attngen's decode lets each new "
                          f"token see itself and the tokens before it: pass causal=True")
    lengths = cache_seqlens
    if k is not None:
        lengths = _append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table)
    return decode(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=cache_batch_idx,
                  block_table=block_table, num_splits=num_splits, sm_scale=softmax_scale,
                  return_lse=return_softmax_lse, softcap=softcap, alibi_slopes=alibi_slopes)


def _append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """Write k, v ``[batch, seqlen_new, kv_heads, head_dim]`` into the cache at each row's length;
    returns the new lengths (int32 ``[batch]`` on the device)."""
    if not all(type(x).__module__.startswith("torch") for x in (k_cache, v_cache, k, v)):
        raise LaunchError("appending k/v to the cache needs torch tensors (CuPy arrays: write the new tokens "
                          "into the cache yourself and pass cache_seqlens including them)")
    import torch

    b, n_new = k.shape[0], k.shape[1]
    if tuple(k.shape) != tuple(v.shape) or k.dim() != 4 or tuple(k.shape[2:]) != tuple(k_cache.shape[2:]):
        raise LaunchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [batch, seqlen_new, kv_heads, "
                          f"head_dim] with the cache's kv_heads and head_dim {tuple(k_cache.shape[2:])}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise LaunchError(f"k/v have dtype {k.dtype}; the cache has {k_cache.dtype}")
    dev = k_cache.device
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        old = torch.full((b,), cache_seqlens, dtype=torch.int32, device=dev)
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32 and \
            tuple(cache_seqlens.shape) == (b,):
        old = cache_seqlens
    else:
        raise LaunchError(f"cache_seqlens must be an int or an int32 tensor [{b}]")
    pos = old.long()[:, None] + torch.arange(n_new, device=dev)  # [batch, seqlen_new]
    if block_table is not None:
        bs = k_cache.shape[1]
        # Positions past the table's capacity are clamped, as the kernels clamp lengths.
        cap = block_table.shape[1] * bs
        pos = pos.clamp(max=cap - 1)
        blocks = block_table.long().gather(1, torch.div(pos, bs, rounding_mode="floor"))
        k_cache[blocks, pos % bs] = k
        v_cache[blocks, pos % bs] = v
    else:
        pos = pos.clamp(max=k_cache.shape[1] - 1)
        rows = (cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(b, device=dev))[:, None]
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    return (old + n_new).to(torch.int32)
