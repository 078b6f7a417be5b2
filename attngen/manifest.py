"""Pre-warm manifests: which specs a CI job builds, and for which archs.

A manifest is a TOML file::

    format = 1                                  # optional; bump when the layout below changes
    archs = ["sm_80", "sm_90"]                  # default archs of every [[kernel]]

    [[kernel]]
    family = "prefill"
    head_dim = [64, 128]                        # a list expands: one spec per value
    dtype = ["fp16", "bf16"]
    mask = "causal"                             # a scalar stays
    archs = ["sm_90"]                           # optional: this group's own archs

A ``[[kernel]]`` group stands for the Cartesian product of its list-valued fields. Every spec
is validated when the manifest is loaded (unknown fields, bad values) and again per arch when
it is expanded (does it fit that arch), so a bad manifest fails before anything compiles.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from .arch import ARCHS, Arch, get_arch
from .errors import ManifestError, SpecError
from .family import family_of
from .spec import SNIPPET_FIELDS, Spec, parse_spec, resolve

# Bump when the manifest layout changes incompatibly; files that name another format are refused.
FORMAT = 1
_TOP_KEYS = ("format", "archs", "kernel")
_SCALARS = (str, int, bool)


@dataclass(frozen=True)
class KernelGroup:
    """One ``[[kernel]]`` table: its specs (the product of its lists) and its own archs, if any."""

    index: int                           # 1-based position in the file, for error messages
    fields: dict                         # the table as written (lists not yet expanded)
    specs: tuple[Spec, ...]
    archs: tuple[Arch, ...] | None

    @property
    def where(self) -> str:
        return f"[[kernel]] #{self.index}"


@dataclass(frozen=True)
class Manifest:
    path: Path | None
    archs: tuple[Arch, ...]              # top-level default; empty when the file names none
    groups: tuple[KernelGroup, ...]


def default_manifest_path() -> Path:
    """The shipped default manifest: the checkout's ``cache/default.toml``, else the wheel's copy."""
    import attngen

    pkg = Path(attngen.__file__).resolve().parent
    candidates = [pkg.parent / "cache" / "default.toml", pkg / "manifests" / "default.toml"]
    for cand in candidates:
        if cand.is_file():
            return cand
    try:
        # Installs that do not unpack to plain files (zipped) still expose it as a resource.
        from importlib.resources import as_file, files

        res = files("attngen.manifests") / "default.toml"
        if res.is_file():
            with as_file(res) as p:
                if Path(p).is_file():
                    return Path(p)
    except (ModuleNotFoundError, FileNotFoundError, TypeError, NotADirectoryError):
        pass
    raise ManifestError("the default manifest was not found; looked in "
                        + ", ".join(str(c) for c in candidates) + " and package attngen.manifests")


def load_manifest(path: "str | Path | None" = None) -> Manifest:
    """Read and validate a manifest; ``None`` reads the default one."""
    p = Path(path) if path is not None else default_manifest_path()
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"manifest file not found: {p}") from None
    except OSError as e:
        raise ManifestError(f"cannot read manifest {p}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ManifestError(f"manifest {p} is not UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"manifest {p} is not valid TOML: {e}") from None
    return manifest_from_dict(data, path=p)


def manifest_from_dict(data: dict, *, path: "Path | None" = None) -> Manifest:
    """Validate the parsed TOML of a manifest (split out so tests need no files)."""
    where = f"manifest {path}" if path else "manifest"
    unknown = sorted(set(data) - set(_TOP_KEYS))
    if unknown:
        raise SpecError(unknown[0], data[unknown[0]], ", ".join(_TOP_KEYS),
                        reason=f"unknown top-level key in {where}")
    fmt = data.get("format", FORMAT)
    if fmt != FORMAT:
        raise SpecError("format", fmt, str(FORMAT), reason=f"{where} has a format this attngen does not read")
    archs = _archs(data["archs"], f"{where}, top level") if "archs" in data else ()
    tables = data.get("kernel", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise SpecError("kernel", tables, "an array of tables written [[kernel]]", reason=f"in {where}")
    if not tables:
        raise SpecError("kernel", [], "at least one [[kernel]] table", reason=f"{where} lists no kernels")
    groups = []
    for i, table in enumerate(tables, 1):
        group_where = f"{where}, [[kernel]] #{i}"
        own = _archs(table["archs"], group_where) if "archs" in table else None
        if own is None and not archs:
            raise SpecError("archs", None, ", ".join(ARCHS),
                            reason=f"{group_where} has no archs and the manifest has no top-level archs")
        fields = {k: v for k, v in table.items() if k != "archs"}
        for name in SNIPPET_FIELDS:
            if fields.get(name):  # a user's code reaches a kernel only from the call that runs it (DESIGN.md)
                raise SpecError(name, "<source>" if name != "aux" else fields[name], "'' (left out)",
                                reason=f"{group_where}: score_mod / mask_mod snippets come from the op's call, "
                                       "never from a manifest")
        groups.append(KernelGroup(i, fields, _expand_fields(fields, group_where), own))
    return Manifest(path, archs, tuple(groups))


def expand(manifest: Manifest, archs: "list[str | Arch] | tuple | None" = None) -> list[tuple[Spec, Arch]]:
    """Every (spec, arch) the manifest asks for, in file order, without repeats, then every other kernel the
    family's op can run for a call of those specs' fields (its ``reachable``: e.g. tiles chosen by the call's
    sizes), so that a prewarmed manifest covers what the ops pick.

    ``archs`` replaces the manifest's top-level archs; a group with its own archs keeps only
    those that ``archs`` also names (so ``--arch sm_90`` builds what the manifest wants for
    sm_90 and nothing for other archs). Each spec is checked against each arch here; the
    specs listed are as written (unresolved), those reachable from them resolved;
    ``attngen.builder.build`` resolves them.
    """
    override = tuple(get_arch(a) for a in archs) if archs is not None else None
    out: list[tuple[Spec, Arch]] = []
    seen: set[tuple[Spec, str]] = set()
    more: list[tuple[Spec, Arch]] = []
    for g in manifest.groups:
        if g.archs is None:
            targets = override if override is not None else manifest.archs
        elif override is not None:
            targets = tuple(a for a in g.archs if a in override)
        else:
            targets = g.archs
        for spec in g.specs:
            for a in targets:
                try:
                    resolved = resolve(spec, a)
                except SpecError as e:
                    raise _located(e, f"{_name(manifest)}, {g.where}, spec {spec.to_text()} on {a.name}") from None
                # Two spellings of one kernel (a tuning field written out at its default) build once.
                ident = (resolved, a.name)
                if ident not in seen:
                    seen.add(ident)
                    out.append((spec, a))
                    reach = family_of(spec).reachable
                    if reach is not None:
                        more += [(r, a) for r in sorted(reach(spec, a) - {resolved}, key=lambda r: r.to_text())]
    for r, a in more:
        if (r, a.name) not in seen:
            seen.add((r, a.name))
            out.append((r, a))
    return out


# --- helpers -------------------------------------------------------------------------------

def _name(manifest: Manifest) -> str:
    return f"manifest {manifest.path}" if manifest.path else "manifest"


def _located(e: SpecError, where: str) -> SpecError:
    """The same SpecError (same field, value, allowed) with where it came from in the reason."""
    reason = f"in {where}" + (f": {e.reason}" if e.reason else "")
    return SpecError(e.field, e.value, e.allowed, reason=reason)


def _archs(value: Any, where: str) -> tuple[Arch, ...]:
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(a, str) for a in items):
        raise SpecError("archs", value, ", ".join(ARCHS), reason=f"in {where}: a non-empty list of arch names")
    out: list[Arch] = []
    for text in items:
        for part in filter(None, (s.strip() for s in text.split(","))):
            try:
                a = get_arch(part)
            except SpecError as e:
                raise _located(e, where) from None
            if a not in out:
                out.append(a)
    if not out:
        raise SpecError("archs", value, ", ".join(ARCHS), reason=f"in {where}: empty")
    return tuple(out)


def _expand_fields(fields: dict, where: str) -> tuple[Spec, ...]:
    if "family" not in fields:
        raise SpecError("family", None, "a family name, e.g. family = \"prefill\"", reason=f"{where} names no family")
    axes: list[tuple[str, list]] = []
    for name, value in fields.items():
        values = value if isinstance(value, list) else [value]
        if not values:
            raise SpecError(name, value, "a value or a non-empty list of values",
                            reason=f"in {where}: an empty list would expand to no kernels")
        for v in values:
            if not isinstance(v, _SCALARS):
                raise SpecError(name, v, "a string, integer or boolean, or a list of them", reason=f"in {where}")
        if len(set(map(repr, values))) != len(values):
            raise SpecError(name, value, "each value once", reason=f"in {where}: a value is repeated")
        axes.append((name, values))
    names = [n for n, _ in axes]
    specs: list[Spec] = []
    for combo in itertools.product(*(vals for _, vals in axes)):
        try:
            spec = parse_spec(dict(zip(names, combo)))
        except SpecError as e:
            raise _located(e, where) from None
        if spec not in specs:
            specs.append(spec)
    return tuple(specs)
