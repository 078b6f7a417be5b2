"""``cascade_decode``: decode of many requests that share one prefix, the prefix's KV read once for all of them.

Without it a serving engine points every request's block table at the shared prefix's pages, and each request
reads the whole prefix again: a decode step over 64 requests on a 16k prefix reads the prefix 64 times. Here the
step is four launches, no host sync:

1. ``attngen.decode`` runs each request's new tokens against its own cache (contiguous or paged), causal within
   it, with its LSE, on the current stream;
2. beside it, on a stream of attngen's that forks from the current one before the decode and joins it after, the
   prefill kernel runs every request's new tokens as the query rows of one sequence against the prefix,
   non-causal (every prefix key precedes every new token), the prefix cut into ``splits`` key ranges presented as
   a batch (q broadcast over it with a zero batch stride, the prefix's rows viewed as ``[splits, len, kv_heads,
   head_dim]``) so that the grid fills the GPU; each split returns its output and LSE. The decode of short own
   caches reads below the memory's rate and the prefix's stage is bound by its MMAs, so the two overlap;
3. ``merge_states`` merges the prefix's splits, and ``merge_state`` that with the request's own state into the
   output (and the LSE over both), on the current stream.

A CUDA graph captures the fork and the join as it captures the launches.
"""

from __future__ import annotations

from .errors import LaunchError
from .families.choice import device_facts
from .families.decode.op import MAX_Q_LEN, decode
from .families.merge.op import merge_state, merge_states
from .families.prefill.op import prefill
from .kvcache import _torch

# A split of the prefix is at least this many keys: below it a CTA's fixed cost outweighs the keys it reads.
MIN_SPLIT_KEYS = 512
# The prefix stage aims at this many CTAs an SM (two waves' worth of one-CTA-an-SM tiles).
CTAS_PER_SM = 2


def prefix_splits(prefix_len: int, rows: int, heads: int, sm_count: int) -> int:
    """How many key ranges the prefix is cut into for ``rows`` query rows of ``heads`` heads: enough CTAs
    (a 64-row query tile a head a split, the prefill kernel's smallest) for ``CTAS_PER_SM`` an SM, each
    range at least ``MIN_SPLIT_KEYS`` keys; 1 for a short prefix. Of the counts from half that to twice it, the
    nearest that divides the prefix into ranges of one length where there is one: keys left over take a launch of
    their own and a copy of every split's state (28 us of a 234 us step, 64 requests on a 16k prefix, H100)."""
    tiles = -(-rows // 64) * heads
    want = max(1, min(-(-CTAS_PER_SM * sm_count // max(tiles, 1)), prefix_len // MIN_SPLIT_KEYS))
    whole = [k for k in range(max(1, want // 2), 2 * want + 1)
             if prefix_len % k == 0 and (k == 1 or prefix_len // k >= MIN_SPLIT_KEYS)]
    return min(whole, key=lambda k: (abs(k - want), -k)) if whole else want


_SIDE: dict = {}


def _side_stream(torch, device: int):
    """The stream the prefix's stage runs on (one a device, made on first use)."""
    s = _SIDE.get(device)
    if s is None:
        s = _SIDE[device] = torch.cuda.Stream(device=device)
    return s


def cascade_decode(q, prefix_k, prefix_v, k_cache, v_cache, *, cache_seqlens, block_table=None,
                   cache_batch_idx=None, sm_scale: float | None = None, return_lse: bool = False, splits: int = 0,
                   out=None):
    """Attention of each request's new tokens over a prefix all requests share followed by the request's own
    cache: the result of ``attngen.decode`` on a cache holding the prefix then the request's rows, with the
    prefix's KV read once for the whole batch instead of once a request.

    q ``[batch, q_len, heads, head_dim]`` (q_len 1..8, torch); prefix_k, prefix_v ``[prefix_len, kv_heads,
    head_dim]`` (prefix_len may be 0); k_cache, v_cache, ``cache_seqlens``, ``block_table`` and
    ``cache_batch_idx`` as ``attngen.decode`` takes them, holding each request's own keys after the prefix, new
    tokens included (token i of a request at own position L - q_len + i sees the whole prefix and its own keys
    up to that position). ``splits``: key ranges the prefix is cut into (0: enough to fill the GPU,
    ``prefix_splits``). Returns ``out`` ``[batch, q_len, heads, head_dim]`` (a new tensor, or the caller's), and
    with ``return_lse`` the fp32 natural-log LSE ``[batch * q_len, heads]`` over both parts.
    """
    torch = _torch("cascade_decode", q, prefix_k, prefix_v, k_cache, v_cache,
                   instead="call attngen.prefill, attngen.decode and attngen.merge_state directly")
    if q.dim() != 4:
        raise LaunchError(f"q has shape {tuple(q.shape)}; expected [batch, q_len, heads, head_dim]")
    b, sq, h, d = q.shape
    if not 1 <= sq <= MAX_Q_LEN:
        raise LaunchError(f"q_len={sq} (q's dim 1) must be 1..{MAX_Q_LEN}; more new tokens a request: "
                          f"attngen.prefill_varlen against the prefix and the request's keys, then merge_state")
    for name, x in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        if x.dim() != 3 or x.shape[2] != d or x.shape[1] == 0 or h % x.shape[1]:
            raise LaunchError(f"{name} has shape {tuple(x.shape)}; expected [prefix_len, kv_heads, {d}] with "
                              f"kv_heads dividing heads={h}")
    if prefix_k.shape[1] != k_cache.shape[-2]:
        raise LaunchError(f"prefix_k has {prefix_k.shape[1]} kv_heads and k_cache {k_cache.shape[-2]}; they must match")
    if prefix_v.shape != prefix_k.shape:
        raise LaunchError(f"prefix_k {tuple(prefix_k.shape)} and prefix_v {tuple(prefix_v.shape)} must have one shape")
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 0:
        raise LaunchError(f"splits={splits!r} must be an int >= 0 (0: chosen for the GPU)")
    main = torch.cuda.current_stream(q.device)
    side = _side_stream(torch, q.get_device())
    side.wait_stream(main)  # the fork: the prefix's stage follows what came before the decode, not the decode
    own = decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, block_table=block_table,
                 cache_batch_idx=cache_batch_idx, sm_scale=sm_scale, return_lse=True)
    o_own, lse_own = own[0].view(b * sq, h, d), own[1].transpose(1, 2).reshape(b * sq, h)
    n = prefix_k.shape[0]
    if out is not None and (tuple(out.shape) != (b, sq, h, d) or out.dtype != q.dtype or out.device != q.device):
        raise LaunchError(f"out must be a {q.dtype} tensor {(b, sq, h, d)} on {q.device}; got {out.dtype} "
                          f"{tuple(out.shape)} on {out.device}")
    if n == 0 or b == 0:
        if out is not None:
            out.copy_(own[0])
        res = own[0] if out is None else out
        return (res, lse_own) if return_lse else res
    rows = b * sq
    parts = splits or prefix_splits(n, rows, h, device_facts(q.get_device()).sm_count)
    parts = min(parts, n)
    size = n // parts
    # The prefix's first parts * size rows as a batch of key ranges; what is left over, a range of its own.
    qs = q.reshape(1, rows, h, d).expand(parts, rows, h, d)
    hk = prefix_k.shape[1]
    with torch.cuda.stream(side):
        o_pre, lse_pre = prefill(qs, prefix_k[:parts * size].view(parts, size, hk, d),
                                 prefix_v[:parts * size].view(parts, size, hk, d), sm_scale=sm_scale, return_lse=True)
        # [parts, rows, heads, d] and [parts, heads, rows] as [rows, parts, heads, ...] views for merge_states
        v_states, s_states = o_pre.permute(1, 0, 2, 3), lse_pre.permute(2, 0, 1)
        if parts * size < n:
            o_tail, lse_tail = prefill(q.reshape(1, rows, h, d), prefix_k[parts * size:].unsqueeze(0),
                                       prefix_v[parts * size:].unsqueeze(0), sm_scale=sm_scale, return_lse=True)
            v_states = torch.cat((v_states, o_tail.view(rows, 1, h, d)), dim=1)
            s_states = torch.cat((s_states, lse_tail.view(h, rows).t().unsqueeze(1)), dim=1)
    main.wait_stream(side)  # the join
    # made on the side stream, read on this one: their memory is not reused before this stream's reads
    v_states.record_stream(main)
    s_states.record_stream(main)
    o_p, lse_p = merge_states(v_states, s_states)
    dest = None if out is None else (out.view(rows, h, d) if out.is_contiguous() else None)
    o, lse = merge_state(o_p, lse_p, o_own, lse_own, out=dest)
    if out is not None and dest is None:
        out.copy_(o.view(b, sq, h, d))
        o = out
    res = o.view(b, sq, h, d) if out is None else out
    return (res, lse) if return_lse else res
