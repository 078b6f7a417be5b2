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


def _as_pages(torch, k_cache, v_cache, cache_batch_idx, batch: int):
    """A contiguous cache ``[cache_batch, max_seqlen, kv_heads, head_dim]`` as a paged one: (k blocks, v
    blocks, block table), views of the same memory, where max_seqlen and the row stride are whole
    blocks of 16 positions or more; else None."""
    cb, m, hk, d = k_cache.shape
    s0, s1, s2, s3 = k_cache.stride()
    if tuple(v_cache.stride()) != (s0, s1, s2, s3) or cb == 0 or m == 0:
        return None
    bs = next((n for n in _PAGE_SIZES if m % n == 0 and s0 % (n * s1) == 0), 0)
    if not bs:
        return None
    per_row = s0 // (bs * s1)
    # Blocks between rows (a row stride past max_seqlen) exist in the view but no table names them.
    shape, strides = ((cb - 1) * per_row + m // bs, bs, hk, d), (bs * s1, s1, s2, s3)
    rows = torch.arange(batch, device=k_cache.device) if cache_batch_idx is None else \
        cache_batch_idx.long().clamp(0, cb - 1)  # clamped to the cache's rows, as attngen.decode does
    table = (rows[:, None] * per_row + torch.arange(m // bs, device=k_cache.device)).to(torch.int32)
    return k_cache.as_strided(shape, strides), v_cache.as_strided(shape, strides), table


def prefill_route(q, k_cache, v_cache, cache_batch_idx, cache_leftpad, block_table, causal: bool, right: int):
    """How more than MAX_Q_LEN new tokens a row are served, decided before the cache is touched: (k blocks, v
    blocks, block table) for the prefill kernel over the cache (paged, or a contiguous cache as pages), or None
    where it cannot serve (``cache_leftpad``, or contiguous rows that are not whole blocks apart) and the call
    is causal: the decode kernels then run on MAX_Q_LEN tokens at a time. Anything else is refused."""
    torch = _torch(f"seqlen_q={q.shape[1]} (past {MAX_Q_LEN}, through the prefill kernel)", q, k_cache, v_cache)
    if block_table is not None and cache_batch_idx is not None:
        raise LaunchError("cache_batch_idx cannot be combined with block_table (a paged cache names its blocks per "
                          "row already)")
    paged = None
    if cache_leftpad is None:
        paged = (k_cache, v_cache, block_table) if block_table is not None else \
            _as_pages(torch, k_cache, v_cache, cache_batch_idx, q.shape[0])
    if paged is None and not (causal or right == 0):
        why = "cache_leftpad, which the prefill kernel over the cache does not take" if cache_leftpad is not None \
            else (f"a contiguous cache of max_seqlen {k_cache.shape[1]} and row stride {k_cache.stride(0)}, not "
                  f"whole blocks of 16 positions as the prefill kernel over the cache reads it")
        raise LaunchError(f"seqlen_q={q.shape[1]} with causal=False and window_size right={right} is not supported "
                          f"with {why}; allowed: causal=True (or window_size right 0), at most {MAX_Q_LEN} new "
                          f"tokens a call, or a paged cache (block_table) without cache_leftpad")
    return paged


def chunked_prefill(q, k_cache, v_cache, lengths, paged, cache_batch_idx, cache_leftpad, block_table,
                    window: tuple[int, int], num_splits: int, causal: bool, return_lse: bool, common: dict):
    """More than MAX_Q_LEN new tokens a row, by ``prefill_route``'s choice (lengths: each row's keys, new tokens
    included): the prefill kernel bottom-right per row over ``paged``, or, where that is None (a causal call),
    the decode kernels on MAX_Q_LEN tokens at a time."""
    import torch

    b, sq, h, d = q.shape
    left, _ = window
    lengths = _old_lengths(torch, lengths, b, q.device)
    if paged is not None:
        kp, vp, table = paged
        cap = table.shape[1] * kp.shape[1]
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        cu_k = torch.zeros(b + 1, dtype=torch.int32, device=q.device)
        cu_k[1:] = torch.cumsum(lengths.clamp(0, cap), 0)
        r = prefill_varlen(q.reshape(b * sq, h, d), kp, vp, cu_q, cu_k, sq, cap, causal=causal, window=window,
                           return_lse=return_lse, block_table=table, **common)
        if not return_lse:
            return r.view(b, sq, h, -1)
        return r[0].view(b, sq, h, -1), r[1].view(h, b, sq).permute(1, 0, 2).contiguous()
    # Causal: token i of a chunk sees no key past its own position, so each chunk runs as a decode call whose
    # rows end at the chunk's last token.
    outs, lses = [], []
    for c0 in range(0, sq, MAX_Q_LEN):
        n = min(MAX_Q_LEN, sq - c0)
        r = decode(q[:, c0:c0 + n], k_cache, v_cache, cache_seqlens=lengths - (sq - c0 - n),
                   cache_batch_idx=cache_batch_idx, block_table=block_table, num_splits=num_splits,
                   return_lse=return_lse, causal=True, window=(left, 0), cache_leftpad=cache_leftpad, **common)
        outs.append(r[0] if return_lse else r)
        if return_lse:
            lses.append(r[1])
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(lses, dim=2)) if return_lse else out
