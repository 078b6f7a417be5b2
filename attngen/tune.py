"""``attngen tune FAMILY``: search a spec's tuning space on the current GPU and store the winner.

For each size: every config of ``spec.tuning_candidates`` (the arch's default first; fields the
spec pins stay pinned) is built through the cache, run through the family's op on random inputs
(the family's tuning module builds the ``Problem``), checked against the default config's
outputs, and timed with CUDA events (``bench.bench_ms``). The fastest correct one is stored in
the cache root's tuned store (``attngen.tuned``) under the spec's untuned fields, the arch, the
GPU's name, the NVRTC and attngen versions and the size; the family's op picks it up in later
processes.

A family's tuning module (``Family.tuning``) provides:

- ``SIZE``: what the size is, for help texts ("q and kv sequence length", ...);
- ``add_arguments(parser)``: its own problem options (e.g. ``--window``; ``positive_int`` is
  an argparse type for counts);
- ``problem_size(spec, size, batch, heads) -> (batch, heads)``: the defaults a search uses;
- ``problem(spec, size, batch, heads, seed, **options) -> Problem``;
- optionally ``by_size(default, arch) -> (bounds, specs) | None``: where the op's built-in default depends on
  the size, ``specs[i]`` from ``bounds[i - 1]`` on (``default`` is the resolved, size-independent one), and
  ``BY_SIZE``, what those bounds count.

``plan`` is pure (no GPU): it lists the candidates; ``run`` needs torch and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from . import builder as _builder
from .__version__ import __version__
from .arch import Arch
from .cli_cache import aligned
from .compiler import nvrtc_version
from .errors import AttngenError, LaunchError, SpecError
from .family import get_family
from .runtime import device_arch, driver
from .spec import Spec, resolve, tuning_candidates
from .tuned import TunedStore

CHECK_TOL = 1e-2  # relative L2 vs the default config; two correct configs differ by ~1e-3 (bf16 rounding)
LSE_TOL = 1e-2    # max abs difference of fp32 outputs that are log-sum-exps


@dataclass
class Problem:
    """One tuning problem: inputs made once, run with any candidate spec."""

    describe: dict[str, Any]                 # batch, heads, ... as the family names them
    run: Callable[[Spec], tuple]             # launches the op with ``spec``; returns its outputs
    work: float                              # FLOPs (unit TFLOP/s) or bytes (GB/s) of one call
    unit: str = "TFLOP/s"
    # outputs compared by max abs difference (LSE) rather than relative L2, by index
    lse_outputs: tuple[int, ...] = ()
    poison: Callable[[], None] = lambda: None  # fills reused outputs with NaN before a checked run


def positive_int(text: str) -> int:
    """An argparse type for a positive integer (the CLI's and the tuning modules' options)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a positive integer")
    return n


def tuning_module(spec_or_family) -> ModuleType:
    fam = get_family(spec_or_family if isinstance(spec_or_family, str) else spec_or_family.family)
    if not fam.tuning:
        raise SpecError("family", fam.name, "a family with a tuning space", reason="attngen tune cannot search it")
    return importlib.import_module(fam.tuning)


def config_text(spec: Spec) -> str:
    """The tuning fields, short: ``cta_tile_q=128 cta_tile_kv=64 ...`` -> ``q128 kv64 w8 s2 mma_sync``."""
    short = {"cta_tile_q": "q", "cta_tile_kv": "kv", "num_warps": "w", "num_stages": "s"}
    d = spec.to_dict()
    return " ".join(f"{short[k]}{d[k]}" if k in short else str(d[k]) for k in spec.TUNING_FIELDS)


def tuning_of(spec: Spec) -> dict[str, Any]:
    """The tuning fields as plain JSON values (what the store keeps)."""
    d = spec.to_dict()
    return {k: d[k] for k in spec.TUNING_FIELDS}


def problem_size(spec: Spec, size: int, batch: int | None = None, heads: int | None = None) -> tuple[int, int]:
    """(batch, heads) of the inputs a search at ``size`` times."""
    return tuning_module(spec).problem_size(spec, size, batch, heads)


def defaults_by_size(spec: Spec, arch: Arch) -> list[tuple[int, Spec]]:
    """[(from size, spec)]: what the family's op runs for ``spec`` at each size without a stored winner, where its
    built-in default depends on the size (the tuning module's ``by_size``) and ``spec`` pins no tuning field;
    else []."""
    if not get_family(spec.family).tuning or spec.pins_tuning:
        return []
    by_size = getattr(tuning_module(spec), "by_size", None)
    rows = by_size(resolve(spec, arch), arch) if by_size else None
    if not rows:
        return []
    bounds, specs = rows
    return list(zip([0, *bounds], specs))


def plan(spec: Spec, arch: Arch, max_candidates: int | None = None, size: int | None = None) -> list[Spec]:
    """The configs a search tries, the default first; at most ``max_candidates`` of them. With ``size``, the
    default is what the family's op runs at that size without a stored winner (``defaults_by_size``)."""
    tuning_module(spec)  # refuses a family without a tuning space
    cands = tuning_candidates(spec, arch)
    by_size = defaults_by_size(spec, arch) if size is not None else []
    if by_size:
        first = [s for lo, s in by_size if size >= lo][-1]
        cands = [first, *(c for c in cands if c != first)]
    return cands[:max_candidates] if max_candidates else cands


@dataclass
class Row:
    """One candidate of one search."""

    spec: Spec
    default: bool = False
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    smem: int | None = None
    origin: str | None = None      # where its binary came from: compiled, disk or memory
    ms: float | None = None
    rate: float | None = None      # in the problem's unit (TFLOP/s or GB/s)
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
            "rate": None if self.rate is None else round(self.rate, 2),
            "rel_err": None if self.rel_err is None else float(f"{self.rel_err:.3g}"),
            "status": self.status, "error": self.error, **self.extra,
        }


def compile_rows(specs: list[Spec], arch: Arch, on_row: Callable[[int, Row], None] | None = None) -> list[Row]:
    """Build each candidate through the cache (no GPU) and note its resources."""
    rows = []
    for i, s in enumerate(specs):
        row = Row(s, default=(i == 0))
        _compile(row, arch)
        if row.status == "planned":
            row.status = "compiled"
        rows.append(row)
        if on_row:
            on_row(i, row)
    return rows


def _compile(row: Row, arch: Arch) -> bool:
    try:
        r = _builder.build(row.spec, arch)
    except AttngenError as e:
        row.status, row.error = "failed", _first_line(e)
        return False
    res = r.binary.resources.reported()  # (spills None where NVRTC's log held no report)
    row.registers, row.spill_stores, row.spill_loads = res["registers"], res["spill_stores"], res["spill_loads"]
    row.smem, row.origin = row.spec.smem_bytes(), r.origin
    return True


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def device_identity(device: int) -> dict[str, str]:
    """What a stored winner is keyed by besides the spec and size, for ``device``."""
    return {"arch": device_arch(device).name, "gpu": driver().device_name(device), "nvrtc": nvrtc_version(),
            "attngen": __version__}


def run(spec: Spec, size: int, *, batch: int | None = None, heads: int | None = None,
        max_candidates: int | None = None, warmup_ms: float = 25.0, rep_ms: float = 100.0, store: bool = True,
        seed: int = 0, on_row: Callable[[int, int, Row], None] | None = None, **options) -> dict[str, Any]:
    """Search ``spec``'s configs at ``size`` on the current CUDA device; store the winner.

    ``options`` go to the family's ``problem`` (e.g. prefill's ``window``). Returns a plain dict:
    the problem, one row per candidate, the winner (or None) and where it was stored.
    ``on_row(i, n, row)`` is called as each candidate finishes.
    """
    try:
        import torch
    except ImportError as e:
        raise LaunchError(f"attngen tune runs its candidates on torch tensors; torch is not available: {e}") from None
    if not torch.cuda.is_available():
        raise LaunchError("attngen tune needs a CUDA GPU (torch.cuda.is_available() is False); "
                          "--dry-run lists the candidates without one")
    from .bench import bench_ms

    mod = tuning_module(spec)
    device = torch.cuda.current_device()
    ident = device_identity(device)
    arch = device_arch(device)
    specs = plan(spec, arch, max_candidates, size)
    b, h = mod.problem_size(spec, size, batch, heads)
    prob: Problem = mod.problem(spec, size, b, h, seed, **options)

    rows: list[Row] = []
    ref = None
    for i, s in enumerate(specs):
        row = Row(s, default=(i == 0))
        rows.append(row)
        if _compile(row, arch):
            try:
                prob.poison()
                outs = [o.float() for o in prob.run(s)]
                torch.cuda.synchronize()
                if not all(bool(torch.isfinite(o).all()) for j, o in enumerate(outs) if j not in prob.lse_outputs):
                    row.status, row.error = "wrong", "non-finite or unwritten output"
                elif ref is None:
                    if i != 0:  # the default failed to build or run: no reference to check against
                        row.status, row.error = "failed", "no reference: the default config did not run"
                    else:
                        ref, row.rel_err = outs, 0.0
                else:
                    row.rel_err = max(_rel(torch, o, r) for j, (o, r) in enumerate(zip(outs, ref))
                                      if j not in prob.lse_outputs)
                    if not row.rel_err < CHECK_TOL:
                        row.status, row.error = "wrong", f"rel L2 {row.rel_err:.3g} vs the default config (tol {CHECK_TOL:g})"
                    elif not all(_lse_close(torch, outs[j], ref[j]) for j in prob.lse_outputs):
                        row.status, row.error = "wrong", "LSE differs from the default config's"
                if row.status == "planned":
                    row.ms, _ = bench_ms(lambda: prob.run(s), warmup_ms, rep_ms)
                    row.rate = prob.work / (row.ms * 1e-3) / (1e12 if prob.unit == "TFLOP/s" else 1e9)
                    row.status = "ok"
            except AttngenError as e:
                row.status, row.error = "failed", _first_line(e)
        if on_row:
            on_row(i, len(specs), row)
    good = [r for r in rows if r.status == "ok"]
    winner = min(good, key=lambda r: r.ms) if good else None
    result: dict[str, Any] = {
        "spec": spec.to_text(), "family": spec.family, "seqlen": size, "batch": b, "heads": h, **prob.describe,
        "unit": prob.unit, **ident, "candidates": len(specs), "rows": [r.to_dict() for r in rows],
        "winner": winner.to_dict() if winner else None, "stored": None,
        "default_ms": rows[0].ms if rows and rows[0].status == "ok" else None,
    }
    if winner is not None and store:
        result["stored"] = str(store_winner(spec, size, winner, ident, result))
    return result


def _rel(torch, o, r) -> float:
    return (torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30)).item()


def _lse_close(torch, lse, ref) -> bool:
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), fin):
        return False
    return not bool(fin.any()) or (lse[fin] - ref[fin]).abs().max().item() < LSE_TOL


def store_winner(spec: Spec, size: int, winner: Row, ident: dict, result: dict,
                 root: "str | Path | None" = None) -> Path:
    """Write the winner into the tuned store; returns the file."""
    w = winner.to_dict()
    skip = {"rows", "winner", "stored", "spec", "family", "seqlen", "arch", "gpu", "nvrtc", "attngen"}
    entry = {
        "family": spec.family, "fields": spec.untuned_dict(), **ident, "seqlen": int(size),
        "tuning": w["tuning"], "spec": w["spec"], "ms": w["ms"], "rate": w["rate"],
        **{k: v for k, v in result.items() if k not in skip},
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    return TunedStore(root).put(entry)


# --- text output ----------------------------------------------------------------------------------

def table(rows: list[dict], winner: dict | None = None, unit: str = "TFLOP/s") -> list[str]:
    """The rows as an aligned table; the winner marked with '*', the default with 'd'."""
    def fmt(x, spec):
        return "—" if x is None else format(x, spec)

    head = ("", "CONFIG", "REGS", "SPILLS", "SMEM", "MS", unit.upper(), "REL.ERR", "STATUS")
    lines = [head]
    for r in rows:
        mark = ("*" if winner and r["config"] == winner["config"] else " ") + ("d" if r["default"] else " ")
        spills = "—" if r["spill_stores"] is None else f"{r['spill_stores']}/{r['spill_loads']}"
        status = r["status"] + (f": {r['error']}" if r["error"] else "")
        lines.append((mark, r["config"], fmt(r["registers"], "d"), spills,
                      "—" if r["smem"] is None else f"{r['smem'] // 1024} KiB",
                      fmt(r["ms"], ".4f"), fmt(r["rate"], ".1f"), fmt(r["rel_err"], ".1e"), status))
    return aligned(lines)
