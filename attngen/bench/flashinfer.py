"""FlashInfer as a peer column of ``attngen bench prefill|decode|mla``, where it is installed.

One function per family takes the tensors that family's benchmark made, builds FlashInfer's
wrapper for them and plans it, runs it once, and compares that output with attngen's. The first
plan and run are timed apart on the host clock (on a cold FlashInfer cache they hold its nvcc
JIT build and module load, tens of seconds) and never enter a timing. What comes back is a
``Peer``: a callable the benchmark times the way it times attngen and SDPA (events, graphs,
rotated copies), the first call's seconds, and the check.

Without flashinfer the column is absent: ``missing()`` says why in one line, and nothing here
imports torch or flashinfer until a family function runs on the GPU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from .core import CHECK_TOL, _rel_check, _short_error

NAME = "flashinfer"          # the column's name in records, tables and summaries
DIST = "flashinfer-python"   # the distribution whose version the records carry
WORKSPACE_BYTES = 512 << 20  # FlashInfer's scratch for split-KV partials (the harness's size); zeroed once
MLA_PAGE = 64                # the page size FlashInfer's MLA runs at here (DeepSeek's)

_workspaces: dict[Any, Any] = {}
_imported: dict[str, Any] = {}
_import_s: dict[str, float] = {}   # an import's seconds, until the first peer of its family records them


def missing() -> str | None:
    """None when flashinfer can be imported; else one line saying why the column is absent.
    Looks the package up without importing it (its import pulls in torch and its JIT layer)."""
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError) as e:
        return f"no FlashInfer column: looking up the flashinfer package failed ({e})"
    if spec is None:
        return f"no FlashInfer column: flashinfer is not installed (python3 -m pip install {DIST} adds one)"
    return None


def version() -> str | None:
    """The installed FlashInfer's version from its distribution's metadata (no import), or None."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def wanted(args) -> str | None:
    """None when the run gets a FlashInfer column; else the one-line note the benchmark prints."""
    if getattr(args, "no_flashinfer", False):
        return "no FlashInfer column: --no-flashinfer"
    return missing()


def add_argument(parser) -> None:
    parser.add_argument("--no-flashinfer", action="store_true",
                        help="leave out the FlashInfer column even where flashinfer is installed (its first "
                             "call builds its kernels with nvcc: tens of seconds on a cold cache)")


def config(args) -> dict:
    """What a run's JSON ``config`` records about the column: present or not, and why not."""
    note = wanted(args)
    return {"present": note is None, "version": version() if note is None else None, "note": note}


def present(data: dict) -> bool:
    """Whether a run (live or saved) has the FlashInfer column: its config says so, or a record
    holds a FlashInfer time; runs from before the column have neither."""
    cfg = (data.get("config") or {}).get(NAME) or {}
    if cfg.get("present"):
        return True
    return any(isinstance(r, dict) and NAME in (r.get("ms") or r.get("us") or r.get("tflops") or {})
               for r in data.get("results", []))


def first_call_line(data: dict) -> str | None:
    """One line on FlashInfer's first calls in a run (where its JIT build shows), or None. A run that
    warms up on an untimed pass first keeps that pass's first call in its config."""
    warm = ((data.get("config") or {}).get(NAME) or {}).get("first_call")
    firsts = [r[NAME] for r in data.get("results", []) if isinstance(r, dict) and isinstance(r.get(NAME), dict)]
    firsts = [f for f in [warm] + firsts if isinstance(f, dict) and isinstance(f.get("first_call_s"), (int, float))]
    if not firsts:
        return None
    one = firsts[0]
    return (f"FlashInfer {one.get('backend', '')} first call (plan + run, its JIT build and load included, outside "
            f"every timing): {one['first_call_s']:.2f} s (import {one.get('import_s', 0.0):.2f} s), then at most "
            f"{max(f['first_call_s'] for f in firsts[1:]) if firsts[1:] else 0.0:.2f} s a shape")


DELTA_COLUMN = "fi max diff"   # tables: FlashInfer's largest absolute difference from attngen's output


def delta_cell(r: dict) -> str:
    """A record's FlashInfer-vs-attngen cell: the max abs difference, FAIL past the benchmarks' tolerance."""
    c = (r.get(NAME) or {}).get("vs_attngen")
    if not c:
        return "—"
    bad = c.get("nan_count") or not (c.get("rel_l2", 0.0) <= CHECK_TOL)
    return f"{c['max_abs']:.1e}" + (" FAIL" if bad else "")


@dataclass
class Peer:
    """FlashInfer planned for one shape: ``call(**tensors)`` runs it (the family's rotating tensors by
    keyword, defaulting to the ones it was planned and checked on)."""
    call: Callable[..., Any]
    backend: str
    first_call_s: float   # the first plan + run
    plan_s: float         # of which the plan
    import_s: float       # importing flashinfer's module for this family: the first shape's only
    check: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {"backend": self.backend, "first_call_s": self.first_call_s, "plan_s": self.plan_s,
                "import_s": self.import_s, **self.check}


def attempt(rec: dict, family: Callable[..., Peer], *args, nulls: tuple[str, ...] = (), **kwargs) -> Peer | None:
    """``family(*args, **kwargs)`` for a benchmark's record: the peer, its record under ``rec[NAME]``; or,
    where FlashInfer refuses the shape or fails, None, the error under ``rec["errors"]`` and a null
    under each of ``rec[k]`` for k in ``nulls`` (the record's per-column dicts)."""
    try:
        peer = family(*args, **kwargs)
    except Exception as e:  # a shape, dtype or arch it does not take
        import torch

        rec["errors"][NAME] = _short_error(e)
        for k in nulls:
            rec[k][NAME] = None
        torch.cuda.synchronize()
        return None
    rec[NAME] = peer.record()
    return peer


# --- shared ---------------------------------------------------------------------------------------

def _module(name: str):
    """flashinfer.<name>, imported once; the import's seconds are kept for the first peer's record."""
    if name not in _imported:
        import importlib

        t0 = time.perf_counter()
        _imported[name] = importlib.import_module(f"flashinfer.{name}")
        _import_s[name] = time.perf_counter() - t0
    return _imported[name]


def _workspace(device):
    import torch

    key = torch.device(device)
    if key not in _workspaces:
        _workspaces[key] = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=key)
    return _workspaces[key]


def _fa_backend(device) -> str:
    """fa3 (its Hopper kernels, the ones to beat) on compute capability 9.x, fa2 elsewhere."""
    import torch

    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


def _compare(out, ref) -> dict:
    """FlashInfer's output against attngen's (same number of elements): the benchmarks' check (``_rel_check``),
    its NaN count, max abs and relative L2 difference."""
    if ref is None:
        return {"vs_attngen": None}
    c = _rel_check(out.reshape(-1), ref.float().reshape(-1))
    return {"vs_attngen": {k: c[k] for k in ("max_abs", "rel_l2", "nan_count")}}


def _first(plan: Callable[[], Any], run: Callable[[], Any], module: str) -> tuple[Any, float, float, float]:
    """plan(), then run() once, each waited for: (output, plan + run seconds, plan seconds, import seconds)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    plan()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out = run()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return out, t2 - t0, t1 - t0, _import_s.pop(module, 0.0)


# --- the families ---------------------------------------------------------------------------------

def prefill(q, k, v, *, causal: bool, attngen_out=None) -> Peer:
    """Ragged prefill on attngen's [B, S, H, D] q and [B, S, Hkv, D(v)] k, v (contiguous), every
    sequence S long: FlashInfer sees them as [B*S, heads, D] with indptrs of stride S."""
    import torch

    fi = _module("prefill")
    b, s, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    qf, kf, vf = (x.reshape(b * s, x.shape[2], x.shape[3]) for x in (q, k, v))
    backend = _fa_backend(q.device)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD", backend=backend)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * s

    def plan():
        w.plan(indptr, indptr.clone(), h, hk, d, head_dim_vo=dv, causal=causal, q_data_type=q.dtype,
               kv_data_type=k.dtype)

    def call(q=qf, k=kf, v=vf):
        return w.run(q, k, v)

    out, *times = _first(plan, call, "prefill")
    ref = None if attngen_out is None else attngen_out.reshape(b * s, h, dv)
    return Peer(call, backend, *times, _compare(out, ref))


def decode(q, k_pages, v_pages, block_table, kv_len: int, *, attngen_out=None) -> Peer:
    """Paged decode, one new token a row, on attngen's paged cache (``[pages, page, Hkv, D]`` K and V
    and their ``[B, pages a row]`` table; every row ``kv_len`` long): FlashInfer's tensor-core decode,
    the peer the decode targets name (its classic fa2 decode is not timed here). ``call(kk=..., vv=...)``
    runs it on another copy of the pages."""
    import torch

    fi = _module("decode")
    b, ql, h, d = q.shape
    if ql != 1:
        raise ValueError(f"q_len {ql}: FlashInfer's decode wrapper takes one new token a row (q_len 1)")
    page, hk = k_pages.shape[1], k_pages.shape[2]
    per_row = block_table.shape[1]
    if not (per_row - 1) * page < kv_len <= per_row * page:
        raise ValueError(f"kv_len {kv_len} does not fill the last of {per_row} pages of {page}")
    qf = q.reshape(b, h, d)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(q.device), "NHD", use_tensor_cores=True)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * per_row
    indices = block_table.reshape(-1).to(torch.int32).contiguous()
    last = torch.full((b,), kv_len - (per_row - 1) * page, dtype=torch.int32, device=q.device)

    def plan():
        w.plan(indptr, indices, last, h, hk, d, page, q_data_type=q.dtype, kv_data_type=k_pages.dtype)

    def call(kk=k_pages, vv=v_pages):
        return w.run(qf, (kk, vv))

    out, *times = _first(plan, call, "decode")
    ref = None if attngen_out is None else attngen_out.reshape(b, h, d)
    return Peer(call, "tensor-core decode", *times, _compare(out, ref))


def mla(q_nope, q_pe, kv, lens, *, rank: int, sm_scale: float, attngen_out=None, page: int = MLA_PAGE) -> Peer:
    """MLA decode on attngen's ``[B, L, rank + rope]`` cache (ckv in the first ``rank`` columns) read
    as pages of ``page`` tokens in order, q_nope ``[B, H, rank]`` and q_pe ``[B, H, rope]`` (views
    are fine: FlashInfer takes strides). ``call(kv=...)`` runs it on another copy of the cache."""
    import torch

    fi = _module("mla")
    b, n, width = kv.shape
    h = q_nope.shape[1]
    if n % page:
        raise ValueError(f"seqlen {n} is not a multiple of FlashInfer's MLA page here ({page})")
    per_row = n // page
    backend = _fa_backend(kv.device)
    w = fi.BatchMLAPagedAttentionWrapper(_workspace(kv.device), backend=backend)
    rows = torch.arange(b + 1, dtype=torch.int32, device=kv.device)
    meta = fi.MLAPlanMetadata.csr(rows, rows * per_row,
                                  torch.arange(b * per_row, dtype=torch.int32, device=kv.device),
                                  lens.to(torch.int32))

    def plan():
        w.plan(metadata=meta, num_heads=h, head_dim_ckv=rank, head_dim_kpe=width - rank, page_size=page,
               causal=False, sm_scale=sm_scale, q_data_type=q_nope.dtype, kv_data_type=kv.dtype,
               query_layout="split", kv_cache_layout="split")

    def call(kv=kv):
        pages = kv.view(b * per_row, page, width)
        return w.run(query=(q_nope, q_pe), kv_cache=(pages[..., :rank], pages[..., rank:]))

    out, *times = _first(plan, call, "mla")
    ref = None if attngen_out is None else attngen_out.reshape(b, h, rank)
    return Peer(call, backend, *times, _compare(out, ref))


def prefill_fp8(q, k, v, q_scale, k_scale, v_scale, *, causal: bool, out_dtype, attngen_out=None) -> Peer:
    """fp8 prefill on attngen's e4m3 [B, S, H, D] q and [B, S, Hkv, D] k, v (contiguous, every sequence S long),
    its output ``out_dtype``: FlashInfer's ragged wrapper (its FA3 backend takes fp8 where the GPU is sm_90), the
    tensors seen as [B*S, heads, D]. Its scales are per head (fp32 ``[H]`` for q, ``[Hkv]`` for k and v), so the
    caller's descales must be one a KV head: ``q_scale`` here is per query head already."""
    import torch

    fi = _module("prefill")
    b, s, h, d = q.shape
    hk = k.shape[2]
    qf, kf, vf = (x.reshape(b * s, x.shape[2], x.shape[3]) for x in (q, k, v))
    backend = _fa_backend(q.device)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device), "NHD", backend=backend)
    indptr = torch.arange(b + 1, dtype=torch.int32, device=q.device) * s

    def plan():
        w.plan(indptr, indptr.clone(), h, hk, d, causal=causal, q_data_type=q.dtype, kv_data_type=k.dtype,
               o_data_type=out_dtype)

    def call(q=qf, k=kf, v=vf):
        # the fp8 run takes the three scales after the tensors
        return w.run(q, k, v, q_scale, k_scale, v_scale)

    out, *times = _first(plan, call, "prefill")
    ref = None if attngen_out is None else attngen_out.reshape(b * s, h, d)
    return Peer(call, f"{backend} fp8", *times, _compare(out, ref))


def batch(q, k_pages, v_pages, cu_q, lens, block_table, *, attngen_out=None) -> Peer:
    """A serving step's mixed batch (attngen.BatchAttention's inputs: packed q ``[total_q, H, D]`` with ``cu_q``,
    paged ``[pages, page, Hkv, D]`` K and V, each request's key count ``lens`` and its row of ``block_table``),
    causal: FlashInfer's ``BatchAttention``, one persistent launch for decode and prefill requests alike. Its plan
    reads the lengths on the host. ``call()`` runs it on the tensors it was planned on."""
    import torch

    fi = _module("attention")
    h, d = q.shape[1], q.shape[2]
    page, hk = k_pages.shape[1], k_pages.shape[2]
    pages = (lens.to(torch.int64) + page - 1) // page
    indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    indices = block_table[cols[None, :] < pages[:, None]].to(torch.int32).contiguous()  # each row's pages in order
    w = fi.BatchAttention(kv_layout="NHD", device=q.device)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[0], h, dtype=torch.float32, device=q.device)

    def plan():
        w.plan(cu_q, indptr, indices, lens, h, hk, d, d, page, causal=True, sm_scale=d ** -0.5,
               q_data_type=q.dtype, kv_data_type=k_pages.dtype)

    def call():
        return w.run(q, (k_pages, v_pages), out=out, lse=lse)[0]

    got, *times = _first(plan, call, "attention")
    return Peer(call, "BatchAttention", *times, _compare(got, attngen_out))
