"""What ``flash_attn_with_kvcache`` does around the kernels, in torch operations on the device (no host
sync): the append of new tokens to the cache, rotary embedding of q and the new k, and the route of
more than ``MAX_Q_LEN`` new tokens (chunked prefill) to the prefill kernel over the cache."""

from __future__ import annotations

from .errors import LaunchError
from .families.decode.op import MAX_Q_LEN, decode
from .families.prefill.varlen import prefill_varlen

# Block sizes a contiguous cache may be presented to the paged prefill kernel with, largest first.
_PAGE_SIZES = (256, 128, 64, 32, 16)


def _torch(what: str, *xs, instead: str = "call attngen.decode and attngen.prefill_varlen directly"):
    """The torch module, where every one of ``xs`` (None skipped) is a torch tensor."""
    if not all(x is None or type(x).__module__.startswith("torch") for x in xs):
        raise LaunchError(f"{what} needs torch tensors (with CuPy arrays {instead})")
    import torch

    return torch


def capacity_of(k_cache, block_table) -> int:
    """The positions a row of the cache holds: max_seqlen, or (paged) the table's blocks x block_size."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def check_leftpad(cache_leftpad, q) -> None:
    """A torch ``cache_leftpad``: an int32 tensor [batch], checked before the rotary embedding reads it (the
    kernels check its device, and any other array)."""
    if cache_leftpad is None or not type(cache_leftpad).__module__.startswith("torch"):
        return
    import torch

    if cache_leftpad.dtype != torch.int32 or tuple(cache_leftpad.shape) != (q.shape[0],):
        raise LaunchError(f"cache_leftpad must be an int32 tensor [{q.shape[0]}]; got {cache_leftpad.dtype} "
                          f"{tuple(cache_leftpad.shape)}")


def _old_lengths(torch, cache_seqlens, batch: int, device):
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype == torch.int32 and \
            tuple(cache_seqlens.shape) == (batch,):
        return cache_seqlens
    raise LaunchError(f"cache_seqlens must be an int or an int32 tensor [{batch}]")


def _rotate(torch, x, cos, sin, pos, interleaved: bool):
    """x [batch, seqlen, heads, head_dim] with its first rotary_dim features rotated by the angles at
    positions ``pos`` [batch, seqlen] (fp32 arithmetic, rounded once to x's dtype)."""
    half = cos.shape[1]
    c = cos.float()[pos].unsqueeze(2)  # [batch, seqlen, 1, rotary_dim / 2]
    s = sin.float()[pos].unsqueeze(2)
    xf = x[..., :2 * half].float()
    if interleaved:  # GPT-J: pairs (0, 1), (2, 3), ...
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:  # GPT-NeoX: feature i with i + rotary_dim / 2
        x1, x2 = xf[..., :half], xf[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def rotary_qk(q, k, rotary_cos, rotary_sin, cache_seqlens, cache_leftpad, interleaved: bool, per_token: bool,
              capacity: int):
    """q and k rotated as FlashAttention's ``flash_attn_with_kvcache`` does before its append: k's token i
    at position ``cache_seqlens + i`` (less ``cache_leftpad``), q's likewise where ``per_token`` (a causal
    or windowed call), else every query at ``cache_seqlens``. Returns new tensors (q and k untouched)."""
    torch = _torch("rotary_cos/rotary_sin", q, k, rotary_cos, rotary_sin)
    b, sq, _, d = q.shape
    if rotary_cos.dim() != 2 or tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
        raise LaunchError(f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin {tuple(rotary_sin.shape)} must "
                          f"both be [seqlen_ro, rotary_dim / 2]")
    rd = 2 * rotary_cos.shape[1]
    if not 2 <= rd <= d:
        raise LaunchError(f"rotary_dim={rd} (2 x rotary_cos.shape[1]) must be from 2 to head_dim={d}")
    if rotary_cos.shape[0] < capacity:
        raise LaunchError(f"rotary_cos has {rotary_cos.shape[0]} positions; it needs one for each of the cache's "
                          f"{capacity}")
    if not rotary_cos.is_floating_point() or not rotary_sin.is_floating_point():
        raise LaunchError(f"rotary_cos/rotary_sin have dtype {rotary_cos.dtype}/{rotary_sin.dtype}; allowed: a "
                          f"floating dtype")
    base = _old_lengths(torch, cache_seqlens, b, q.device).long()
    if cache_leftpad is not None:
        base = base - cache_leftpad.long()
    last = rotary_cos.shape[0] - 1  # positions past the table (lengths past the cache) are clamped, as the append's
    pos_k = (base[:, None] + torch.arange(k.shape[1], device=q.device)).clamp(0, last)
    steps = torch.arange(sq, device=q.device) if per_token else torch.zeros(sq, dtype=torch.long, device=q.device)
    pos_q = (base[:, None] + steps).clamp(0, last)
    return (_rotate(torch, q, rotary_cos, rotary_sin, pos_q, interleaved),
            _rotate(torch, k, rotary_cos, rotary_sin, pos_k, interleaved))


def append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table):
    """Write k, v ``[batch, seqlen_new, kv_heads, head_dim]`` into the cache at each row's length;
    returns the new lengths (int32 ``[batch]`` on the device)."""
    torch = _torch("appending k/v to the cache", k_cache, v_cache, k, v,
                   instead="write the new tokens into the cache yourself and pass cache_seqlens including them")
    b, n_new = k.shape[0], k.shape[1]
    if tuple(k.shape) != tuple(v.shape) or k.dim() != 4 or tuple(k.shape[2:]) != tuple(k_cache.shape[2:]):
        raise LaunchError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [batch, seqlen_new, kv_heads, "
                          f"head_dim] with the cache's kv_heads and head_dim {tuple(k_cache.shape[2:])}")
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise LaunchError(f"k/v have dtype {k.dtype}; the cache has {k_cache.dtype}")
    dev = k_cache.device
    old = _old_lengths(torch, cache_seqlens, b, dev)
    pos = old.long()[:, None] + torch.arange(n_new, device=dev)  # [batch, seqlen_new]
    if block_table is not None:
        bs = k_cache.shape[1]
        # Positions past the table's capacity are clamped, as the kernels clamp lengths.
        pos = pos.clamp(max=block_table.shape[1] * bs - 1)
        blocks = block_table.long().gather(1, torch.div(pos, bs, rounding_mode="floor"))
        k_cache[blocks, pos % bs] = k
        v_cache[blocks, pos % bs] = v
    else:
        pos = pos.clamp(max=k_cache.shape[1] - 1)
        rows = (cache_batch_idx.long() if cache_batch_idx is not None else torch.arange(b, device=dev))[:, None]
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    return (old + n_new).to(torch.int32)


def _page_size(k_cache, v_cache) -> int:
    """The block size a contiguous cache ``[cache_batch, max_seqlen, kv_heads, head_dim]`` can be read as pages
    of (``_as_pages``): the largest of _PAGE_SIZES that divides max_seqlen and the row stride, with k's and v's
    strides alike; 0 where none does. Shapes and strides only: no tensor is made."""
    cb, m = k_cache.shape[:2]
    s0, s1 = k_cache.stride()[:2]
    if tuple(v_cache.stride()) != tuple(k_cache.stride()) or cb == 0 or m == 0:
        return 0
    return next((n for n in _PAGE_SIZES if m % n == 0 and s0 % (n * s1) == 0), 0)


def _cache_rows(torch, cache_batch_idx, batch: int, cache_rows: int, device):
    """The cache row of each batch row: 0..batch-1, or ``cache_batch_idx`` clamped to the cache's rows, as
    attngen.decode clamps it."""
    if cache_batch_idx is None:
        return torch.arange(batch, device=device)
    return cache_batch_idx.long().clamp(0, cache_rows - 1)


def _as_pages(torch, k_cache, v_cache, cache_batch_idx, batch: int):
    """A contiguous cache ``[cache_batch, max_seqlen, kv_heads, head_dim]`` as a paged one: (k blocks, v
    blocks, block table), views of the same memory, where ``_page_size`` finds a block size; else None."""
    bs = _page_size(k_cache, v_cache)
    if not bs:
        return None
    cb, m, hk, d = k_cache.shape
    s0, s1, s2, s3 = k_cache.stride()
    per_row = s0 // (bs * s1)
    # Blocks between rows (a row stride past max_seqlen) exist in the view but no table names them.
    shape, strides = ((cb - 1) * per_row + m // bs, bs, hk, d), (bs * s1, s1, s2, s3)
    rows = _cache_rows(torch, cache_batch_idx, batch, cb, k_cache.device)
    table = (rows[:, None] * per_row + torch.arange(m // bs, device=k_cache.device)).to(torch.int32)
    return k_cache.as_strided(shape, strides), v_cache.as_strided(shape, strides), table


# How more than MAX_Q_LEN new tokens a row are served (``prefill_route``).
PAGES, ROWS, DECODE, PACKED = "pages", "rows", "decode", "packed"
# PACKED takes up to this many new tokens a row (and group x tokens up to the decode kernel's 128 packed rows):
# the decode kernel over a packed q measured 2-4x the prefill kernel's speed on such rows (H200, 9-32 tokens).
PACKED_MAX_Q_LEN = 32


def packed_limit(heads: int, kv_heads: int) -> int:
    """The most new tokens a row the PACKED route takes for this GQA group (0: none)."""
    return min(PACKED_MAX_Q_LEN, 128 // max(1, heads // max(1, kv_heads))) if kv_heads and heads % kv_heads == 0 else 0


def _as_rows(torch, k_cache, v_cache):
    """A contiguous cache ``[cache_batch, max_seqlen, kv_heads, head_dim]`` as one run of positions: (k, v)
    ``[(cache_batch - 1) * R + max_seqlen, kv_heads, head_dim]``, views of the same memory in which row r's
    position j is position r * R + j (R: the row stride in positions, the same for k and v); else None (a row
    stride that is no whole number of positions, or more positions than int32 cu_seqlens count)."""
    cb, m, hk, d = k_cache.shape
    s0, s1, s2, s3 = k_cache.stride()
    v0, v1, v2, v3 = v_cache.stride()
    if cb == 0 or m == 0 or s1 <= 0 or v1 <= 0 or s0 % s1 or v0 % v1 or s0 // s1 != v0 // v1:
        return None
    per_row = s0 // s1
    n = (cb - 1) * per_row + m
    if n >= 2 ** 31:
        return None
    return k_cache.as_strided((n, hk, d), (s1, s2, s3)), v_cache.as_strided((n, hk, d), (v1, v2, v3)), per_row


def prefill_route(q, k_cache, v_cache, cache_batch_idx, cache_leftpad, block_table, causal: bool,
                  window: tuple[int, int], alibi: bool, packable: bool = False) -> str:
    """How more than MAX_Q_LEN new tokens a row are served, decided before the cache is touched: PAGES, the
    prefill kernel over a paged cache (or a contiguous one presented as pages, its rows whole blocks of 16
    positions or more apart, without ``cache_leftpad``); ROWS, the varlen prefill kernel over a contiguous cache's
    rows laid end to end (any other contiguous cache; a left pad moves where a row's keys begin); DECODE, the
    decode kernels on MAX_Q_LEN tokens at a time (a paged cache with ``cache_leftpad``, or a contiguous cache
    whose row stride is no whole number of positions). DECODE places each token at its own position only where
    no key after it is seen, or where the score does not depend on positions: with ALiBi, a call that lets a
    token see keys after its own (causal=False, window right other than 0) is refused there. PACKED, first where
    ``packable`` (the caller's options are ones the decode kernel takes with a packed q) and the rows are short
    enough (``packed_limit``): the decode kernel over the batch's tokens as one packed q, in one launch."""
    torch = _torch(f"seqlen_q={q.shape[1]} (past {MAX_Q_LEN}, through the prefill kernel)", q, k_cache, v_cache)
    if block_table is not None and cache_batch_idx is not None:
        raise LaunchError("cache_batch_idx cannot be combined with block_table (a paged cache names its blocks per "
                          "row already)")
    if block_table is None and cache_batch_idx is None and k_cache.shape[0] < q.shape[0]:
        raise LaunchError(f"k_cache has {k_cache.shape[0]} cache rows for batch {q.shape[0]}; pass "
                          f"cache_batch_idx to map rows")
    if packable and q.shape[1] <= packed_limit(q.shape[2], k_cache.shape[-2]):
        return PACKED
    if block_table is not None:
        if cache_leftpad is None:
            return PAGES
        why = "cache_leftpad with a paged cache (block_table), which the prefill kernel over pages does not take"
    else:
        if cache_leftpad is None and _page_size(k_cache, v_cache):
            return PAGES
        if _as_rows(torch, k_cache, v_cache) is not None:
            return ROWS
        why = (f"a contiguous cache whose row strides (k {k_cache.stride(0)}, v {v_cache.stride(0)}) are not one "
               f"whole number of positions (k {k_cache.stride(1)}, v {v_cache.stride(1)} elements)")
    right = 0 if causal else window[1]
    most = max(MAX_Q_LEN, packed_limit(q.shape[2], k_cache.shape[-2]))
    if alibi and right != 0:
        raise LaunchError(f"seqlen_q={q.shape[1]} with causal=False, window_size right={right} and alibi_slopes is "
                          f"not supported with {why}: the decode kernels that serve it place each token at the end of "
                          f"the keys it sees, which ALiBi's distances cannot follow; allowed: causal=True (or "
                          f"window_size right 0), no alibi_slopes, at most {most} new tokens a call, or a "
                          f"contiguous cache for cache_leftpad")
    return DECODE


def _batched(r, b: int, sq: int, h: int, return_lse: bool):
    """A varlen prefill result over ``b`` sequences of ``sq`` queries as the KV-cache call returns it: out
    ``[b, sq, h, dv]``, and the LSE ``[b, h, sq]`` (varlen's is ``[h, b * sq]``)."""
    if not return_lse:
        return r.view(b, sq, h, -1)
    return r[0].view(b, sq, h, -1), r[1].view(h, b, sq).permute(1, 0, 2).contiguous()


def _rows_prefill(q, kr, vr, per_row, lengths, cache_batch_idx, cache_leftpad, cap, rows_in_cache, window,
                  causal, return_lse, common):
    """ROWS: the varlen prefill kernel over the cache's rows laid end to end (``_as_rows``). Sequence 2i is batch
    row i: its q rows, and keys from its row's start (plus its left pad) to its length; between two of them a
    sequence of no queries (2i + 1), whose keys (the rest of the row) no query reads: varlen_rows clamps its
    count to 0 where the next row lies before it, so rows in any order (cache_batch_idx) take one launch.
    Positions and windows are counted from each sequence's end, as the decode kernels count them; ALiBi's
    distances too."""
    import torch

    b, sq, h, d = q.shape
    dev = q.device
    rows = _cache_rows(torch, cache_batch_idx, b, rows_in_cache, dev)
    ends = lengths.long().clamp(0, cap)
    starts = torch.zeros_like(ends) if cache_leftpad is None else torch.minimum(cache_leftpad.long().clamp(min=0), ends)
    base = rows * per_row
    cu_k = torch.stack((base + starts, base + ends), dim=1).flatten().to(torch.int32)
    cu_q = (torch.arange(b + 1, device=dev) * sq).repeat_interleave(2)[1:-1].to(torch.int32)
    slopes = common["alibi_slopes"]
    if getattr(slopes, "ndim", 0) == 2:
        if tuple(slopes.shape) != (b, h):
            raise LaunchError(f"alibi_slopes has shape {tuple(slopes.shape)}; expected ({h},) or ({b}, {h}), "
                              f"contiguous in the heads")
        slopes = slopes.repeat_interleave(2, dim=0)[:-1]  # the empty sequences' rows are never read
    r = prefill_varlen(q.reshape(b * sq, h, d), kr, vr, cu_q, cu_k, sq, cap, causal=causal, window=window,
                       return_lse=return_lse, **dict(common, alibi_slopes=slopes))
    return _batched(r, b, sq, h, return_lse)


def chunked_prefill(q, k_cache, v_cache, lengths, route: str, cache_batch_idx, cache_leftpad, block_table,
                    window: tuple[int, int], num_splits: int, causal: bool, return_lse: bool, common: dict,
                    sinks=None):
    """More than MAX_Q_LEN new tokens a row by ``prefill_route``'s ``route`` (lengths: each row's keys, new
    tokens included), over this k_cache/v_cache (the call's, or its zero-padded copies); ``sinks`` (attention
    sinks, or None) go to whichever kernel serves the route."""
    import torch

    b, sq, h, d = q.shape
    left, right = window
    lengths = _old_lengths(torch, lengths, b, q.device)
    if route == PACKED:
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        r = decode(q.reshape(b * sq, h, d), k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=cache_batch_idx,
                   block_table=block_table, num_splits=num_splits, return_lse=return_lse, causal=causal, window=window,
                   cache_leftpad=cache_leftpad, sinks=sinks, cu_seqlens_q=cu_q, max_q_len=sq, **common)
        return _batched(r, b, sq, h, return_lse)
    if route == ROWS:
        kr, vr, per_row = _as_rows(torch, k_cache, v_cache)
        return _rows_prefill(q, kr, vr, per_row, lengths, cache_batch_idx, cache_leftpad, k_cache.shape[1],
                             k_cache.shape[0], window, causal, return_lse, dict(common, sinks=sinks))
    if route == PAGES:
        kp, vp, table = (k_cache, v_cache, block_table) if block_table is not None else \
            _as_pages(torch, k_cache, v_cache, cache_batch_idx, b)
        cap = table.shape[1] * kp.shape[1]
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        cu_k = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = torch.cumsum(lengths.clamp(0, cap), 0)
        r = prefill_varlen(q.reshape(b * sq, h, d), kp, vp, cu_q, cu_k, sq, cap, causal=causal, window=window,
                           return_lse=return_lse, block_table=table, sinks=sinks, **common)
        return _batched(r, b, sq, h, return_lse)
    # DECODE: a chunk of n tokens, `behind` tokens before the last, runs as a decode call whose rows end `shift`
    # keys past the chunk's last token: the keys after a token that its window's right side (or, unbounded, the
    # row) lets it see, up to the row's end. The decode kernel places its tokens at the rows' end, so `shift`
    # past their own positions: the window's left side widens by it and its right side narrows by it.
    if causal:
        right = 0
    outs, lses = [], []
    for c0 in range(0, sq, MAX_Q_LEN):
        n = min(MAX_Q_LEN, sq - c0)
        behind = sq - c0 - n
        shift = behind if right < 0 else min(right, behind)
        w = (left + shift if left >= 0 else -1, right - shift if right >= 0 else -1)
        r = decode(q[:, c0:c0 + n], k_cache, v_cache, cache_seqlens=lengths - (behind - shift),
                   cache_batch_idx=cache_batch_idx, block_table=block_table, num_splits=num_splits,
                   return_lse=return_lse, causal=causal, window=w, cache_leftpad=cache_leftpad, sinks=sinks, **common)
        outs.append(r[0] if return_lse else r)
        if return_lse:
            lses.append(r[1])
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lses, dim=2)) if return_lse else out
