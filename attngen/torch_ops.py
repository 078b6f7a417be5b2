"""PyTorch custom ops for attngen's ops (``torch.library``): ``attngen::prefill``,
``attngen::prefill_varlen``, ``attngen::decode`` and ``attngen::mla_decode``, each with a fake
implementation that gives the output shapes, so ``torch.compile(fullgraph=True)`` traces a model
that calls any of those ops without a graph break, and
``mode="reduce-overhead"`` captures them into its CUDA graphs.

While torch.compile traces, each op hands its call to its custom op (``runtime.tracing``, set
here); eager calls go straight to the kernels as before. ``import attngen`` registers the ops when
torch is already imported; otherwise ``import attngen.torch_ops`` does. What a custom op cannot
carry is refused while tracing with a ``LaunchError``: ``out=`` (ops return new tensors), a
``mask_plan`` (pass ``mask=`` alone: the op builds the plan) and a spec object (pass its text,
``spec=str(spec)``, which every op accepts and parses once per text).
"""

from typing import Optional

import torch

from . import runtime
from .errors import LaunchError


def _text(spec, what: str) -> Optional[str]:
    """The spec's text for the op. Dynamo cannot carry a spec object (a frozen dataclass) into
    the graph, so under torch.compile a spec is given as its text."""
    if spec is None or isinstance(spec, str):
        return spec
    raise LaunchError(f"{what}(spec=<{type(spec).__name__}>) is not supported under torch.compile; pass its text, "
                      f"spec=str(spec), e.g. spec={str(spec)!r}")


def _no_lse(q):
    return q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("attngen::prefill", mutates_args=(), device_types="cuda")
def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window_left: int, window_right: int,
             sm_scale: Optional[float], softcap: float, alibi_slopes: Optional[torch.Tensor], return_lse: bool,
             spec: Optional[str], mask: Optional[torch.Tensor],
             sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    # sinks came after the op's first release: a default keeps calls through torch.ops.attngen.prefill that predate it
    # working.
    from .families.prefill.op import prefill

    r = prefill(q, k, v, causal=causal, window=(window_left, window_right), sm_scale=sm_scale, softcap=softcap,
                alibi_slopes=alibi_slopes, return_lse=return_lse, spec=spec, mask=mask, sinks=sinks)
    return r if return_lse else (r, _no_lse(q))


@_prefill.register_fake
def _(q, k, v, causal, window_left, window_right, sm_scale, softcap, alibi_slopes, return_lse, spec, mask, sinks=None):
    b, sq, h, _ = q.shape
    lse = q.new_empty((b, h, sq), dtype=torch.float32) if return_lse else _no_lse(q)
    return q.new_empty((b, sq, h, v.shape[-1])), lse


@torch.library.custom_op("attngen::prefill_varlen", mutates_args=(), device_types="cuda")
def _prefill_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool, window_left: int,
                    window_right: int, sm_scale: Optional[float], softcap: float,
                    alibi_slopes: Optional[torch.Tensor], block_table: Optional[torch.Tensor], return_lse: bool,
                    spec: Optional[str], sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    # (sinks: a default, as attngen::prefill's)
    from .families.prefill.varlen import prefill_varlen

    r = prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                       window=(window_left, window_right), sm_scale=sm_scale, softcap=softcap,
                       alibi_slopes=alibi_slopes, block_table=block_table, return_lse=return_lse,
                       spec=spec, sinks=sinks)
    return r if return_lse else (r, _no_lse(q))


@_prefill_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left, window_right,
      sm_scale, softcap, alibi_slopes, block_table, return_lse, spec, sinks=None):
    total, h, _ = q.shape
    lse = q.new_empty((h, total), dtype=torch.float32) if return_lse else _no_lse(q)
    return q.new_empty((total, h, v.shape[-1])), lse


@torch.library.custom_op("attngen::decode", mutates_args=(), device_types="cuda")
def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: Optional[torch.Tensor],
            cache_seqlen: int, cache_batch_idx: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
            num_splits: int, sm_scale: Optional[float], return_lse: bool, variant: str, spec: Optional[str],
            softcap: float, alibi_slopes: Optional[torch.Tensor], causal: bool = True, window_left: int = -1,
            window_right: int = -1, cache_leftpad: Optional[torch.Tensor] = None,
            sinks: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    # The window, left-pad and sinks arguments came after the op's first release: defaults keep calls
    # through torch.ops.attngen.decode that predate them working.
    from .families.decode.op import decode

    r = decode(q, k_cache, v_cache, cache_seqlens=cache_seqlen if cache_seqlens is None else cache_seqlens,
               cache_batch_idx=cache_batch_idx, block_table=block_table, num_splits=num_splits, sm_scale=sm_scale,
               return_lse=return_lse, variant=variant, spec=spec, softcap=softcap,
               alibi_slopes=alibi_slopes, causal=causal, window=(window_left, window_right),
               cache_leftpad=cache_leftpad, sinks=sinks)
    return r if return_lse else (r, _no_lse(q))


@_decode.register_fake
def _(q, k_cache, v_cache, cache_seqlens, cache_seqlen, cache_batch_idx, block_table, num_splits, sm_scale,
      return_lse, variant, spec, softcap, alibi_slopes, causal=True, window_left=-1, window_right=-1,
      cache_leftpad=None, sinks=None):
    b, n, h, _ = q.shape
    lse = q.new_empty((b, h, n), dtype=torch.float32) if return_lse else _no_lse(q)
    return torch.empty_like(q, memory_format=torch.contiguous_format), lse


@torch.library.custom_op("attngen::mla_decode", mutates_args=(), device_types="cuda")
def _mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                cache_seqlens: Optional[torch.Tensor], cache_seqlen: int, sm_scale: float,
                block_table: Optional[torch.Tensor], num_splits: int, return_lse: bool,
                spec: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    from .families.mla_decode.op import mla_decode

    r = mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens=cache_seqlen if cache_seqlens is None
                   else cache_seqlens, sm_scale=sm_scale, block_table=block_table, num_splits=num_splits,
                   return_lse=return_lse, spec=spec)
    return r if return_lse else (r, _no_lse(q_nope))


@_mla_decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens, cache_seqlen, sm_scale, block_table, num_splits,
      return_lse, spec):
    b, n, h, _ = q_nope.shape
    lse = q_nope.new_empty((b, h, n), dtype=torch.float32) if return_lse else _no_lse(q_nope)
    return q_nope.new_empty((b, n, h, ckv_cache.shape[-1])), lse


def _traced(what: str, out, extra: str = "") -> None:
    if out is not None:
        raise LaunchError(f"{what}(out=...) is not supported under torch.compile (its custom op returns a new "
                          f"tensor); drop out={extra}")


def prefill(q, k, v, *, causal, window, sm_scale, return_lse, out, spec, softcap, alibi_slopes, mask, mask_plan,
            sinks=None):
    """``attngen.prefill`` while torch.compile traces: the ``attngen::prefill`` op."""
    _traced("attngen.prefill", out)
    if mask_plan is not None:
        raise LaunchError("attngen.prefill(mask_plan=...) is not supported under torch.compile; pass mask= alone "
                          "(the op builds the plan)")
    o, lse = torch.ops.attngen.prefill(q, k, v, bool(causal), int(window[0]), int(window[1]), sm_scale,
                                       float(softcap), alibi_slopes, bool(return_lse),
                                       _text(spec, "attngen.prefill"), mask, sinks)
    return (o, lse) if return_lse else o


def prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, window, sm_scale,
                   return_lse, out, block_table, spec, softcap, alibi_slopes, sinks=None):
    """``attngen.prefill_varlen`` while torch.compile traces: the ``attngen::prefill_varlen`` op."""
    _traced("attngen.prefill_varlen", out)
    o, lse = torch.ops.attngen.prefill_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                              int(max_seqlen_k), bool(causal), int(window[0]), int(window[1]),
                                              sm_scale, float(softcap), alibi_slopes, block_table, bool(return_lse),
                                              _text(spec, "attngen.prefill_varlen"), sinks)
    return (o, lse) if return_lse else o


def decode(q, k_cache, v_cache, *, cache_seqlens, cache_batch_idx, block_table, num_splits, sm_scale, return_lse,
           out, variant, spec, softcap, alibi_slopes, causal=True, window=(-1, -1), cache_leftpad=None, sinks=None):
    """``attngen.decode`` while torch.compile traces: the ``attngen::decode`` op."""
    _traced("attngen.decode", out)
    tensor = isinstance(cache_seqlens, torch.Tensor)
    o, lse = torch.ops.attngen.decode(q, k_cache, v_cache, cache_seqlens if tensor else None,
                                      0 if tensor else int(cache_seqlens), cache_batch_idx, block_table,
                                      int(num_splits), sm_scale, bool(return_lse),
                                      str(getattr(variant, "value", variant)), _text(spec, "attngen.decode"),
                                      float(softcap),
                                      alibi_slopes, bool(causal), int(window[0]), int(window[1]), cache_leftpad,
                                      sinks)
    return (o, lse) if return_lse else o


def mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, *, cache_seqlens, sm_scale, block_table, num_splits, return_lse,
               out, spec):
    """``attngen.mla_decode`` while torch.compile traces: the ``attngen::mla_decode`` op."""
    _traced("attngen.mla_decode", out)
    tensor = isinstance(cache_seqlens, torch.Tensor)
    o, lse = torch.ops.attngen.mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, cache_seqlens if tensor else None,
                                          0 if tensor else int(cache_seqlens), float(sm_scale), block_table,
                                          int(num_splits), bool(return_lse), _text(spec, "attngen.mla_decode"))
    return (o, lse) if return_lse else o


runtime.traced_ops.update(prefill=prefill, prefill_varlen=prefill_varlen, decode=decode, mla_decode=mla_decode)
runtime.tracing = torch.compiler.is_compiling
