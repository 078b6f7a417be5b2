"""``attngen tune``: search a spec's tuning space on the current GPU and store the winner.

For each seqlen: every config of ``spec.tuning_candidates`` (the arch's default first; fields
the spec pins stay pinned) is built through the cache, run through ``attngen.prefill`` on random
inputs of batch x seqlen x heads (default FlashAttention's sweep: batch = 16384 // seqlen,
heads = 2048 // head_dim), checked against the default config's output, and timed with CUDA
events (``bench.bench_ms``). The fastest correct one is stored in the cache root's tuned store
(``cache.TunedStore``) under the spec's untuned fields, the arch, the GPU's name, the NVRTC and
attngen versions and the seqlen; ``attngen.prefill`` then picks it up in later processes.

``plan`` is pure (no GPU): it lists the candidates; ``run`` needs torch and a CUDA GPU.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import cache as _cache
from .__version__ import __version__
from .arch import Arch, get_arch
from .errors import AttngenError, LaunchError, SpecError
from .spec import PrefillSpec, tuning_candidates

TOKENS = 16384   # default batch * seqlen
HIDDEN = 2048    # default heads * head_dim
CHECK_TOL = 1e-2  # relative L2 vs the default config; two correct configs differ by ~1e-3 (bf16 rounding)
LSE_TOL = 1e-2    # max abs LSE difference
DEFAULT_WINDOW = (256, 0)  # for sliding_window specs when no --window is given


def config_text(spec: PrefillSpec) -> str:
    return f"q{spec.cta_tile_q} kv{spec.cta_tile_kv} w{spec.num_warps} s{spec.num_stages} {spec.mma.value}"


def tuning_of(spec: PrefillSpec) -> dict[str, Any]:
    """The tuning fields as plain JSON values (what the store keeps)."""
    d = spec.to_dict()
    return {k: d[k] for k in spec.TUNING_FIELDS}


def problem_size(spec: PrefillSpec, seqlen: int, batch: int | None = None, heads: int | None = None) -> tuple[int, int]:
    """(batch, heads) of the inputs a search at ``seqlen`` times."""
    return (batch or max(1, TOKENS // seqlen), heads or max(1, HIDDEN // spec.head_dim))


def plan(spec: PrefillSpec, arch: "str | Arch", max_candidates: int | None = None) -> list[PrefillSpec]:
    """The configs a search tries, the default first; at most ``max_candidates`` of them."""
    if spec.family != "prefill":
        raise SpecError("family", spec.family, "prefill", reason="attngen tune searches prefill specs")
    cands = tuning_candidates(spec, get_arch(arch))
    return cands[:max_candidates] if max_candidates else cands


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
    from .bench import attention_flops
    from .spec import MaskMode

    if spec.mask is MaskMode.SLIDING_WINDOW:
        return 4.0 * batch * heads * spec.head_dim * visible_pairs(seqlen, seqlen, False, *window)
    return attention_flops(batch, heads, seqlen, seqlen, spec.head_dim, spec.mask is MaskMode.CAUSAL)


@dataclass
class Row:
    """One candidate of one search."""

    spec: PrefillSpec
    default: bool = False
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    smem: int | None = None
    origin: str | None = None      # where its binary came from: compiled, disk or memory
    ms: float | None = None
    tflops: float | None = None
    rel_err: float | None = None   # vs the default config's output
    status: str = "planned"        # ok, wrong, failed, planned, compiled
    error: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": config_text(self.spec), "spec": self.spec.to_text(full=True),
            "tuning": tuning_of(self.spec),
            "default": self.default, "registers": self.registers, "spill_stores": self.spill_stores,
            "spill_loads": self.spill_loads, "smem": self.smem, "origin": self.origin,
            "ms": None if self.ms is None else round(self.ms, 5),
            "tflops": None if self.tflops is None else round(self.tflops, 2),
            "rel_err": None if self.rel_err is None else float(f"{self.rel_err:.3g}"),
            "status": self.status, "error": self.error, **self.extra,
        }


def compile_rows(specs: list[PrefillSpec], arch: "str | Arch", on_row: Callable[[int, Row], None] | None = None) -> list[Row]:
    """Build each candidate through the cache (no GPU) and note its resources."""
    rows = []
    for i, s in enumerate(specs):
        row = Row(s, default=(i == 0))
        _compile(row, get_arch(arch))
        if row.status == "planned":
            row.status = "compiled"
        rows.append(row)
        if on_row:
            on_row(i, row)
    return rows


def _compile(row: Row, arch: Arch) -> bool:
    try:
        r = _cache.build(row.spec, arch)
    except AttngenError as e:
        row.status, row.error = "failed", _first_line(e)
        return False
    res = r.binary.resources
    row.registers, row.spill_stores, row.spill_loads = res.registers, res.spill_stores, res.spill_loads
    row.smem, row.origin = row.spec.smem_bytes(), r.origin
    return True


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def device_identity(device: int) -> dict[str, str]:
    """What a stored winner is keyed by besides the spec and seqlen, for ``device``."""
    from .compiler import nvrtc_version
    from .runtime import device_arch, driver

    return {"arch": device_arch(device).name, "gpu": driver().device_name(device), "nvrtc": nvrtc_version(),
            "attngen": __version__}


def run(spec: PrefillSpec, seqlen: int, *, batch: int | None = None, heads: int | None = None,
        max_candidates: int | None = None, window: tuple[int, int] | None = None, warmup_ms: float = 25.0,
        rep_ms: float = 100.0, store: bool = True, seed: int = 0,
        on_row: Callable[[int, int, Row], None] | None = None) -> dict[str, Any]:
    """Search ``spec``'s configs at ``seqlen`` on the current CUDA device; store the winner.

    Returns a plain dict: the problem, one row per candidate, the winner (or None) and where
    it was stored. ``on_row(i, n, row)`` is called as each candidate finishes.
    """
    try:
        import torch
    except ImportError as e:
        raise LaunchError(f"attngen tune runs its candidates on torch tensors; torch is not available: {e}") from None
    if not torch.cuda.is_available():
        raise LaunchError("attngen tune needs a CUDA GPU (torch.cuda.is_available() is False); "
                          "--dry-run lists the candidates without one")
    from . import bench
    from .ops.prefill import prefill
    from .spec import MaskMode

    device = torch.cuda.current_device()
    ident = device_identity(device)
    arch = get_arch(ident["arch"])
    specs = plan(spec, arch, max_candidates)
    b, h = problem_size(spec, seqlen, batch, heads)
    d = spec.head_dim
    causal = spec.mask is MaskMode.CAUSAL
    if spec.mask is MaskMode.SLIDING_WINDOW:
        window = tuple(window or DEFAULT_WINDOW)
    else:
        window = (-1, -1)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype.value]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, seqlen, h, d, generator=gen, device="cuda", dtype=torch.float32).to(tdt)
               for _ in range(3))
    out = torch.empty_like(q)
    n_flops = flops(spec, b, h, seqlen, window)
    kw = dict(causal=causal, window=window, return_lse=spec.return_lse, out=out)

    def call(s: PrefillSpec):
        return prefill(q, k, v, spec=s, **kw)

    rows: list[Row] = []
    ref = ref_lse = None
    for i, s in enumerate(specs):
        row = Row(s, default=(i == 0))
        rows.append(row)
        if _compile(row, arch):
            try:
                out.fill_(float("nan"))
                res = call(s)
                torch.cuda.synchronize()
                o = out.float()
                lse = res[1] if spec.return_lse else None
                if not bool(torch.isfinite(o).all()):
                    row.status, row.error = "wrong", "non-finite or unwritten output"
                elif ref is None:
                    if i != 0:  # the default failed to build or run: no reference to check against
                        row.status, row.error = "failed", "no reference: the default config did not run"
                    else:
                        ref, ref_lse, row.rel_err = o, lse, 0.0
                else:
                    row.rel_err = (torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()
                    if not row.rel_err < CHECK_TOL:
                        row.status, row.error = "wrong", f"rel L2 {row.rel_err:.3g} vs the default config (tol {CHECK_TOL:g})"
                    elif lse is not None and not _lse_close(torch, lse, ref_lse):
                        row.status, row.error = "wrong", "LSE differs from the default config's"
                if row.status == "planned":
                    row.ms, _ = bench.bench_ms(lambda: call(s), warmup_ms, rep_ms)
                    row.tflops = bench.tflops(n_flops, row.ms)
                    row.status = "ok"
            except AttngenError as e:
                row.status, row.error = "failed", _first_line(e)
        if on_row:
            on_row(i, len(specs), row)
    good = [r for r in rows if r.status == "ok"]
    winner = min(good, key=lambda r: r.ms) if good else None
    result: dict[str, Any] = {
        "spec": spec.to_text(), "seqlen": seqlen, "batch": b, "heads": h, "window": list(window),
        **ident, "candidates": len(specs), "rows": [r.to_dict() for r in rows],
        "winner": winner.to_dict() if winner else None, "stored": None,
        "default_ms": rows[0].ms if rows and rows[0].status == "ok" else None,
    }
    if winner is not None and store:
        result["stored"] = str(store_winner(spec, seqlen, winner, ident, result))
    return result


def _lse_close(torch, lse, ref) -> bool:
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), fin):
        return False
    return not bool(fin.any()) or (lse[fin] - ref[fin]).abs().max().item() < LSE_TOL


def store_winner(spec: PrefillSpec, seqlen: int, winner: Row, ident: dict, result: dict,
                 root: "str | Path | None" = None) -> Path:
    """Write the winner into the tuned store; returns the file."""
    from .ops.prefill import untuned_fields

    w = winner.to_dict()
    entry = {
        "family": spec.family, "fields": untuned_fields(spec), **ident, "seqlen": int(seqlen),
        "tuning": w["tuning"], "spec": w["spec"], "ms": w["ms"], "tflops": w["tflops"],
        "default_ms": result.get("default_ms"), "batch": result["batch"], "heads": result["heads"],
        "window": result["window"], "candidates": result["candidates"],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return _cache.TunedStore(root).put(entry)


# --- text output ----------------------------------------------------------------------------------

def table(rows: list[dict], winner: dict | None = None) -> list[str]:
    """The rows as an aligned table; the winner marked with '*', the default with 'd'."""
    def fmt(x, spec):
        return "—" if x is None else format(x, spec)

    head = ("", "CONFIG", "REGS", "SPILLS", "SMEM", "MS", "TFLOP/S", "REL.ERR", "STATUS")
    lines = [head]
    for r in rows:
        mark = ("*" if winner and r["config"] == winner["config"] else " ") + ("d" if r["default"] else " ")
        spills = "—" if r["spill_stores"] is None else f"{r['spill_stores']}/{r['spill_loads']}"
        status = r["status"] + (f": {r['error']}" if r["error"] else "")
        lines.append((mark, r["config"], fmt(r["registers"], "d"), spills,
                      "—" if r["smem"] is None else f"{r['smem'] // 1024} KiB",
                      fmt(r["ms"], ".4f"), fmt(r["tflops"], ".1f"), fmt(r["rel_err"], ".1e"), status))
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head) - 1)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[-1] for row in lines]
