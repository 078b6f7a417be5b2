"""``BatchAttention``: a serving step's attention, a ragged batch of requests against one paged cache.

A step mixes decode requests (one new token), speculative-verify requests (a few draft tokens under a tree mask)
and chunked-prefill requests (hundreds to thousands of tokens). ``plan`` reads the step's lengths, on the GPU
only, once a step; ``run`` is called once a layer and never reads a length on the host, so that a step (plan and
runs, or runs alone) replays as a CUDA graph with new lengths written into the same tensors.

``plan`` is one launch, of the varlen prefill kernel's ``_order`` entry (one CTA): it writes the prefill kernel's
cumulative key counts, the decode kernel's request order (the decode requests, most keys first, then the others)
and the prefill kernel's work list (below). A step of at most ``MAX_PLAN_BATCH`` requests.

``run`` launches on the caller's stream (the second decode launch, where there is one, forked and joined):

1. the decode kernel over every request, packed rows (each KV head's group of query heads x the request's
   tokens) a CTA, split-KV by the cache's capacity; a request of more than ``max_decode_q_len`` tokens returns at
   once (``attngen.decode`` with ``cu_seqlens_q``, which also applies the tree masks). Where group x
   max_decode_q_len rows need a larger CTA than a one-token request's group x 1 (``DecodeSpec.rows_for``), two
   launches of it: the requests of up to ``short_q_len`` tokens in the smaller CTAs (``max_q_len``), the others in
   the larger (``min_q_len``), that launch forked onto a side stream and joined, so that the verify requests' few
   CTAs run beside the others rather than after them (a single launch of the larger CTAs for every request read
   the cache more slowly: those CTAs' warps share each tile's keys between two 16-row halves);
2. the varlen prefill kernel over the paged cache, reading the work list ``plan`` sorted on the GPU: the query
   tiles of the longer requests only, heaviest first (``prefill_varlen``'s ``_order`` entry, skipping the short
   requests).

Each writes its own requests' rows of one output (and LSE), so nothing is merged.

An fp8 cache (``kv_dtype``): both kernels read it as ``attngen.decode`` and ``prefill_varlen`` do (fp8 tiles
widened on the chip, ``k_scale`` / ``v_scale`` at ``run``); the plan sorts the work list for the prefill kernel of
that cache.
"""

from __future__ import annotations

from .errors import LaunchError
from .families.decode.fp8 import BYTE_DTYPES, FP8_DTYPES
from .families.decode.op import decode
from .families.decode.spec import DecodeSpec, KVDType
from .families.prefill.op import _NO_WINDOW, mask_and_window, plan_for
from .families.prefill.choose import varlen_grid
from .families.prefill.spec import ORDER_SORT_MAX
from .families.prefill.fp8_op import cache_spec, check_cache_route
from .families.prefill.varlen import VarlenOrder, launch_order, order_tiles, page_layout, run_varlen
from .kvcache import _torch
from .runtime import tensor_info

# The decode kernel packs group x q_len rows into at most 128 (DecodeSpec.Q_ROWS); tree masks are 64-bit words; the
# plan sorts the decode order of at most ORDER_SORT_MAX requests (plan.cuh).
MAX_DECODE_ROWS = 128
MAX_TREE_TOKENS = 64
MAX_PLAN_BATCH = ORDER_SORT_MAX
_INSTEAD = "call attngen.decode and attngen.prefill_varlen directly"


def _int_arg(name: str, x, lo: int, hi: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise LaunchError(f"{name}={x!r} must be an int from {lo} to {hi}")
    return x


class BatchAttention:
    """Attention of a serving step: ``plan`` once a step, ``run`` once a layer.

    ``num_heads`` / ``num_kv_heads`` / ``head_dim`` / ``page_size`` describe q and the paged cache (any page size
    from 1; pages that are not a multiple of 16 positions take the kernels that look up every key row), ``dtype``
    is q's (torch.float16 or torch.bfloat16). ``causal`` (default True) aligns each request's tokens with the last
    keys of its cache, as ``attngen.decode`` does; ``window`` (left, right) bounds the keys a token sees, as in
    ``attngen.prefill``. ``max_decode_q_len``: requests of at most this many tokens (a decode token, a verify tree)
    run in the decode kernel, longer ones in the prefill kernel (default 8; at most 128 // (num_heads //
    num_kv_heads), and at most 64 where tree masks are used). ``sm_scale`` defaults to 1/sqrt(head_dim).
    ``kv_dtype``: the cache's format where it is fp8 (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, or their
    names ``"fp8_e4m3"`` / ``"fp8_e5m2"``; the caches given to ``run`` in that dtype or as uint8 bytes); default
    None, a cache in q's dtype.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *, dtype=None,
                 causal: bool = True,
                 window: tuple[int, int] = _NO_WINDOW, max_decode_q_len: int = 8, sm_scale: float | None = None,
                 kv_dtype=None):
        torch = _torch("BatchAttention", instead=_INSTEAD)
        self.h = _int_arg("num_heads", num_heads, 1, 1 << 16)
        self.hk = _int_arg("num_kv_heads", num_kv_heads, 1, self.h)
        if self.h % self.hk:
            raise LaunchError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self.d = _int_arg("head_dim", head_dim, 1, 256)
        dtype = torch.bfloat16 if dtype is None else dtype
        if dtype not in (torch.float16, torch.bfloat16):
            raise LaunchError(f"dtype={dtype} is not supported; allowed: torch.float16, torch.bfloat16")
        self.dtype, self._torch = dtype, torch
        self.kv, self.kv_torch = _kv_format(kv_dtype, torch)
        self.page_size = _int_arg("page_size", page_size, 1, 1 << 20)
        group = self.h // self.hk
        self.max_decode_q_len = _int_arg("max_decode_q_len", max_decode_q_len, 1, max(1, MAX_DECODE_ROWS // group))
        self.causal, self.sm_scale = bool(causal), sm_scale
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise LaunchError(f"window={window!r} must be a pair (left, right) of ints, -1 for unbounded")
        self.mcode, self.left, self.right = mask_and_window(causal, window)
        self.window = window
        self._planned = None  # (cu_seqlens_q, cache_seqlens, block_table, cu_k, order, total_q, decode order)
        # The most tokens of a request that the rows of a one-token request's CTA hold: where max_decode_q_len
        # needs more rows, the longer requests take a second launch of larger CTAs (run).
        self.short_q_len = min(self.max_decode_q_len, DecodeSpec.rows_for(group, 1) // group)
        self._side = {}  # device -> the side stream of the second decode launch
        # (batch, max_items, device) -> (cu_k, work list, decode order): reused, so graph replays see them
        self._buffers = {}

    def plan(self, cu_seqlens_q, cache_seqlens, block_table, *, total_q: int) -> "BatchAttention":
        """Read the step's lengths (on the GPU, no host sync): ``cu_seqlens_q`` int32 ``[batch + 1]`` (request b's
        tokens are rows cu[b]:cu[b+1] of q), ``cache_seqlens`` int32 ``[batch]`` (each request's keys, its new
        tokens included, which are the last of them), ``block_table`` int32 ``[batch, max_blocks]``; batch at
        most ``MAX_PLAN_BATCH`` (4096). ``total_q``:
        q's rows (host int; in a graph, the captured size; rows past cu[batch] are not written). The tensors are
        kept and read again by ``run``: write a later step's lengths into them and call ``plan`` again (or
        replay a graph that captured both). Returns self."""
        torch = _torch("BatchAttention.plan", cu_seqlens_q, cache_seqlens, block_table, instead=_INSTEAD)
        total_q = _int_arg("total_q", total_q, 0, (1 << 31) - 1)
        args = (("cu_seqlens_q", cu_seqlens_q, 1), ("cache_seqlens", cache_seqlens, 1), ("block_table", block_table, 2))
        for name, x, rank in args:
            if x.dtype != torch.int32 or x.dim() != rank:
                raise LaunchError(f"{name} must be an int32 CUDA tensor of {rank} dim(s); got {x.dtype} "
                                  f"{tuple(x.shape)} on {x.device}")
        batch = cache_seqlens.shape[0]
        if cu_seqlens_q.shape[0] != batch + 1 or block_table.shape[0] != batch:
            raise LaunchError(f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries and block_table "
                              f"{block_table.shape[0]} rows; with cache_seqlens of {batch} they must be "
                              f"{batch + 1} and {batch}")
        if batch > MAX_PLAN_BATCH:
            raise LaunchError(f"cache_seqlens has {batch} requests; BatchAttention.plan takes at most "
                              f"{MAX_PLAN_BATCH} a step (its decode order is sorted in one CTA's shared memory)")
        for name, x, rank in args:
            if not x.is_cuda:
                raise LaunchError(f"{name} must be an int32 CUDA tensor of {rank} dim(s); got {x.dtype} "
                                  f"{tuple(x.shape)} on {x.device}")
        if not cache_seqlens.is_contiguous() or not cu_seqlens_q.is_contiguous():
            raise LaunchError("cu_seqlens_q and cache_seqlens must be contiguous")
        dev = cu_seqlens_q.device
        qi = tensor_info(cu_seqlens_q, "cu_seqlens_q")
        kern = self._prefill_kernel(qi, total_q)
        max_items = varlen_grid(total_q, batch, self.h, kern.spec)[0]
        key = (batch, max_items, dev)
        bufs = self._buffers.get(key)
        if bufs is None:
            bufs = self._buffers[key] = (torch.empty(batch + 1, dtype=torch.int32, device=dev),
                                         torch.empty(2 * max_items + 1 + batch + 1, dtype=torch.int32, device=dev),
                                         torch.empty(batch, dtype=torch.int32, device=dev))
        cu_k, ws, order_b = bufs
        stream = torch.cuda.current_stream(dev).cuda_stream
        wp = ws.data_ptr()
        capacity = block_table.shape[1] * self.page_size
        if capacity >= 1 << 31:
            raise LaunchError(f"block_table of {block_table.shape[1]} blocks x page_size={self.page_size}: fewer "
                              f"than 2^31 positions a request")
        # One launch: the paged prefill kernel's cu_k (cumulative key counts, only their differences read), the
        # decode kernel's request order (longest first, so that no long one starts last) and the prefill kernel's
        # work list of the longer requests.
        launch_order(kern, stream, wp, max_items, cu_seqlens_q.data_ptr(), cu_k.data_ptr(), self.left, self.right,
                     batch, total_q, capacity, True, self.max_decode_q_len, seqlens_ptr=cache_seqlens.data_ptr(),
                     decode_order_ptr=order_b.data_ptr())
        order = VarlenOrder(ws, order_tiles(kern.spec), max_items, self.max_decode_q_len)
        self._planned = (cu_seqlens_q, cache_seqlens, block_table, cu_k, order, total_q, order_b)
        return self

    def _prefill_kernel(self, qi, total_q: int):
        """The varlen paged prefill kernel ``run`` will launch for the long requests (its tiles sort the list)."""
        dtype = "bf16" if self.dtype is self._torch.bfloat16 else "fp16"
        spec = None if self.kv is None else cache_spec(None, self.kv)  # run_varlen's spec for such a cache
        key = (self.d, dtype, qi.device, self.mcode, False, spec, "torch", False, False, page_layout(self.page_size),
               self.d, False)
        plan = plan_for(key)
        # Sized by the step's tokens, not their mean a request: the long requests hold most of them.
        return plan.kernel or plan.kernel_for(max(1, total_q))

    def run(self, q, k_cache, v_cache, *, tree_mask=None, sinks=None, out=None, return_lse: bool = False,
            k_scale=None, v_scale=None):
        """The step's attention for one layer: q ``[total_q, num_heads, head_dim]`` (the rows ``plan`` was given),
        k_cache / v_cache ``[num_blocks, block_size, num_kv_heads, head_dim]`` (block_size the plan's page_size).
        ``tree_mask`` (int64 ``[total_q]``): bit j of token i's word lets it see draft token j of its request (the
        key at position L - q_len + j), for requests run by the decode kernel; every key before the drafts is
        seen; longer requests stay causal. ``sinks`` (fp32 ``[num_heads]``): attention sinks. An fp8 cache (the
        ``kv_dtype`` given at construction): its keys are ``k_scale * k_cache`` and values ``v_scale * v_cache``
        (each a number, or an fp32 device tensor of shape [], [1] or [num_kv_heads]; missing means 1); sinks are
        refused there before any launch (the prefill kernel over an fp8 cache has no sinks form). Returns
        ``out`` ``[total_q, num_heads, head_dim]`` and with ``return_lse`` the fp32 LSE ``[num_heads, total_q]``."""
        if self._planned is None:
            raise LaunchError("BatchAttention.run before plan: call plan(cu_seqlens_q, cache_seqlens, block_table, "
                              "total_q=...) first")
        cu_q, lens, table, cu_k, order, total_q, order_b = self._planned
        if k_cache.dim() != 4 or k_cache.shape[1] != self.page_size:
            raise LaunchError(f"k_cache has shape {tuple(k_cache.shape)}; expected [num_blocks, {self.page_size}, "
                              f"{self.hk}, {self.d}] (page_size={self.page_size})")
        _torch("BatchAttention.run", q, k_cache, v_cache, tree_mask, sinks, out, instead=_INSTEAD)
        if q.dim() != 3 or tuple(q.shape) != (total_q, self.h, self.d) or q.dtype != self.dtype:
            raise LaunchError(f"q has shape {tuple(q.shape)} and dtype {q.dtype}; the plan expects "
                              f"[{total_q}, {self.h}, {self.d}] {self.dtype}")
        if tree_mask is not None and self.max_decode_q_len > MAX_TREE_TOKENS:
            raise LaunchError(f"tree_mask with max_decode_q_len={self.max_decode_q_len}: at most "
                              f"{MAX_TREE_TOKENS} tokens a tree (64-bit words)")
        k_cache, v_cache = self._caches(k_cache, v_cache)
        if self.kv is None and (k_scale is not None or v_scale is not None):
            raise LaunchError("k_scale and v_scale are for an fp8 cache: make BatchAttention with kv_dtype="
                              "torch.float8_e4m3fn or torch.float8_e5m2")
        if self.kv is not None and sinks is not None:
            # the prefill rows' kernel over an fp8 cache, with sinks, resolved before either kernel writes a row
            check_cache_route(q, self.kv, True, self.mcode, False, False, True)
        torch = self._torch
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty(self.h, total_q, dtype=torch.float32, device=q.device) if return_lse else None
        dec = dict(cache_seqlens=lens, block_table=table, cu_seqlens_q=cu_q, batch_order=order_b, tree_mask=tree_mask,
                   causal=self.causal, window=self.window, sinks=sinks, sm_scale=self.sm_scale, out=out,
                   return_lse=return_lse, lse=lse, k_scale=k_scale, v_scale=v_scale)
        short, cur, side = self.short_q_len, torch.cuda.current_stream(q.device), None
        if short < self.max_decode_q_len:
            # The requests of more than `short` tokens on a side stream: a fork, joined after the prefill launch
            # (a graph capture keeps them as two branches). The join orders every use of out, lse and the launch's
            # workspace on the side stream before anything later on this one.
            side = self._side.get(q.device)
            if side is None:
                side = self._side[q.device] = torch.cuda.Stream(q.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                decode(q, k_cache, v_cache, max_q_len=self.max_decode_q_len, min_q_len=short + 1, **dec)
        decode(q, k_cache, v_cache, max_q_len=short, **dec)
        run_varlen(q, k_cache, v_cache, cu_q, cu_k, causal=self.causal, window=self.window, sm_scale=self.sm_scale,
                   return_lse=return_lse, out=out, block_table=table, spec=None, softcap=0.0, alibi_slopes=None,
                   sinks=sinks, score_mod="", mask_mod="", aux=None, order=order, lse=lse,
                   size=max(1, total_q), k_scale=k_scale, v_scale=v_scale)
        if side is not None:
            cur.wait_stream(side)
        return (out, lse) if return_lse else out

    def _caches(self, k_cache, v_cache):
        """The caches as the kernels take them: in q's dtype, or in the fp8 dtype of ``kv_dtype`` (uint8 bytes
        viewed as it); a cache of another dtype is refused by name."""
        want = self.dtype if self.kv is None else self.kv_torch
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dtype != want and not (self.kv is not None and str(c.dtype) in BYTE_DTYPES):
                kv = "" if self.kv is None else f" or uint8 bytes (kv_dtype={self.kv.value})"
                hint = (" (an fp8 cache: make BatchAttention with kv_dtype=torch.float8_e4m3fn or "
                        "torch.float8_e5m2)" if self.kv is None and str(c.dtype) in (*FP8_DTYPES, *BYTE_DTYPES)
                        else "")
                raise LaunchError(f"{name} has dtype {c.dtype}; this BatchAttention reads {want}{kv}{hint}")
        if self.kv is not None:
            k_cache, v_cache = (c if c.dtype == want else c.view(want) for c in (k_cache, v_cache))
        return k_cache, v_cache


def _kv_format(kv_dtype, torch):
    """BatchAttention's ``kv_dtype`` (None, a torch fp8 dtype or its name): the cache's format and its torch dtype,
    (None, None) for a cache in q's dtype."""
    if kv_dtype is None:
        return None, None
    if isinstance(kv_dtype, str):
        kv = next((k for k in KVDType if k.value == kv_dtype), None)
    else:
        kv = FP8_DTYPES.get(str(kv_dtype))  # (torch's fp8 dtypes by name; others, e4m3fnuz say, are not there)
    if kv is not None:
        return kv, torch.float8_e4m3fn if kv is KVDType.FP8_E4M3 else torch.float8_e5m2
    raise LaunchError(f"kv_dtype={kv_dtype!r} is not supported; allowed: None (q's dtype), torch.float8_e4m3fn, "
                      f"torch.float8_e5m2, 'fp8_e4m3', 'fp8_e5m2'")
