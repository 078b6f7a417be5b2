"""The import graph of the attngen package: module -> attngen modules it imports, at top level
and inside functions alike (a function-level import hides a cycle, it does not remove it).

Usage: ``python3 tools/import_graph.py [--package-dir attngen]``; prints one ``a -> b`` line per
edge (``(lazy)`` where every import of that edge sits inside a function), then every cycle, and
exits 1 when there is one. ``tests/test_import_graph.py`` runs ``graph`` and ``cycles``.

Counted: ``import x``, ``from x import y`` (``y`` a submodule counts as that submodule), relative
forms, and ``importlib.import_module``/``__import__`` with a constant name. Not counted: imports of
modules outside the package (torch, cupy: optional third-party imports may stay lazy), the
implicit import of a module's parent package (``attngen.families.prefill`` importing
``attngen.arch`` runs ``attngen/__init__`` first, a fact of Python, not of the code), and names
computed at run time (the family registry imports its plug-ins by name, which is what a registry is).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(package_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``package_dir`` (a package: ``__init__``)."""
    out = {}
    base = package_dir.parent
    for f in sorted(package_dir.rglob("*.py")):
        parts = list(f.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _resolve(mod: str, is_pkg: bool, level: int, name: "str | None") -> str:
    if level == 0:
        return name or ""
    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
    if level > 1:
        here = here[: len(here) - (level - 1)]
    return ".".join(here + ([name] if name else []))


def imports_of(mod: str, path: Path, known: dict[str, Path]) -> dict[str, bool]:
    """Imported attngen module -> whether some import of it is at module level (not in a function)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    found: dict[str, bool] = {}

    def add(target: str, top: bool) -> None:
        # The longest known module that ``target`` names (``attngen.cache.build`` -> ``attngen.cache``).
        parts = target.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts and ".".join(parts) != mod:
            t = ".".join(parts)
            found[t] = found.get(t, False) or top

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for a in child.names:
                    add(a.name, top)
            elif isinstance(child, ast.ImportFrom):
                base = _resolve(mod, is_pkg, child.level, child.module)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    add(sub if sub in known else base, top)
            elif isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant) \
                    and isinstance(child.args[0].value, str):
                f = child.func
                fname = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                if fname in ("import_module", "__import__"):
                    add(child.args[0].value, top)
            visit(child, inner)

    visit(tree, True)
    return found


def graph(package_dir: Path = ROOT / "attngen") -> dict[str, dict[str, bool]]:
    known = modules(package_dir)
    return {m: imports_of(m, p, known) for m, p in known.items()}


def cycles(g: dict[str, dict[str, bool]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(g):
        if v not in index:
            strong(v)
    return sorted(out)


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--package-dir", type=Path, default=ROOT / "attngen")
    args = p.parse_args(argv)
    g = graph(args.package_dir)
    n = 0
    for m in sorted(g):
        for t in sorted(g[m]):
            n += 1
            print(f"{m} -> {t}{'' if g[m][t] else ' (lazy)'}")
    found = cycles(g)
    print(f"# {len(g)} modules, {n} edges, {sum(1 for m in g for t in g[m] if not g[m][t])} lazy, "
          f"{len(found)} cycle(s)")
    for c in found:
        print("cycle: " + " <-> ".join(c))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
