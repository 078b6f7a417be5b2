"""Rendering: a resolved spec -> one self-contained CUDA translation unit.

A family's top-level template (``templates/<family>/<family>.cu.jinja``) only binds constants
(``constexpr int HEAD_DIM = {{ head_dim }};``); the algorithm lives in the pieces it includes: the
family's own under ``templates/<family>/``, what two or more families share under
``templates/common/``. Every included piece is bracketed with ``// attngen:begin NAME`` /
``// attngen:end NAME`` so a compile error can name the template a bad line came from.

The cache key does not hash the rendered source: it hashes the template files a family can
include and the code that builds its template context (``family_digests``), so a warm load
neither renders nor imports Jinja. Jinja is imported only to render.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
import sys
from collections.abc import Mapping
from pathlib import Path

from .arch import Arch, target_arch
from .family import Family, family_of
from .spec import Spec, as_spec, resolve


def templates_dir() -> Path:
    """The template folder: the checkout's ``templates/`` or the copy inside the wheel."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "templates", here / "templates"):
        if (cand / "common").is_dir():
            return cand
    raise FileNotFoundError(f"attngen templates not found next to {here}")


def search_path(family: Family) -> tuple[str, ...]:
    """Where ``family``'s templates are looked up, in order: its own folder, then templates/."""
    own = (str(family.template_dir),) if family.template_dir is not None else ()
    return own + (str(templates_dir()),)


@functools.lru_cache(maxsize=None)
def environment(path: "str | tuple[str, ...] | None" = None):
    """The Jinja environment over ``path`` (one folder or a search path; default templates/)."""
    import jinja2

    class MarkedLoader(jinja2.FileSystemLoader):
        def get_source(self, environment, template):
            source, filename, uptodate = super().get_source(environment, template)
            if template.endswith(".cu.jinja"):
                pass  # a family's top-level template (in its folder or not): rendered as it is
            elif "/" in template and template.endswith(".jinja"):
                # A piece Jinja renders for text it repeats: wgmma's PTX operand lists written out with
                # loops, prefill_fwd's step of a KV tile in each loop that runs it. Still no spec values
                # in it.
                source = f"// attngen:begin {template}\n{source.rstrip()}\n// attngen:end {template}\n"
            elif "/" in template:
                # Included pieces are plain CUDA headers (PTX operand lists like "{%0, %1}" would
                # read as Jinja tags): they are pasted verbatim, never parameterised.
                source = (f"// attngen:begin {template}\n{{% raw %}}{source.rstrip()}\n{{% endraw %}}"
                          f"// attngen:end {template}\n")
            return source, filename, uptodate

    return jinja2.Environment(
        loader=MarkedLoader(list(path) if isinstance(path, tuple) else (path or str(templates_dir()))),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def render(spec: Spec | str | Mapping, arch: "str | Arch | None" = None) -> str:
    """Render the CUDA source for ``spec`` (a spec object, its text or a dict of its fields).

    Unresolved tuning fields are filled for ``arch`` (default sm_90a, as ``attngen inspect``'s;
    a resolved spec renders the same for any arch). The result is deterministic: the same spec
    gives the same bytes in any process. Nothing is written anywhere.
    """
    spec = as_spec(spec)
    if not spec.is_resolved:
        spec = resolve(spec, target_arch(arch))
    fam = family_of(spec)
    tmpl = environment(search_path(fam)).get_template(fam.template)
    return tmpl.render(**spec.template_context())


# --- what the key hashes instead of the source ---------------------------------------------------

# Every way a Jinja template names another one. Conditional includes are followed too: the key
# covers every piece a family can include, whichever branch a spec takes.
_INCLUDES = re.compile(r"""\{%-?\s*(?:include|import|from|extends)\s+["']([^"']+)["']""")


def _find(name: str, path: tuple[str, ...]) -> Path:
    for folder in path:
        p = Path(folder) / name
        if p.is_file():
            return p
    raise FileNotFoundError(f"template {name!r} not found in {', '.join(path)}")


def template_files(family: Family, path: "tuple[str, ...] | None" = None) -> dict[str, Path]:
    """Every template file ``family`` can include, by its name, the top-level template first."""
    path = path or search_path(family)
    found: dict[str, Path] = {}
    todo = [family.template]
    while todo:
        name = todo.pop(0)
        if name in found:
            continue
        found[name] = p = _find(name, path)
        todo += _INCLUDES.findall(p.read_text())
    return found


def _digest(parts: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for name, data in parts:
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def context_code_files(family: Family) -> list[Path]:
    """The Python files whose text decides what ``family``'s templates are given: this module (how
    pieces are pasted), the module of the family's spec class (its template context) and the
    family's extra ``context_modules``, with the spec classes they derive from."""
    mods = [__name__, family.spec.__module__, *family.context_modules]
    for base in family.spec.__mro__[1:]:
        if base.__module__ not in ("builtins", "abc") and base.__module__ not in mods:
            mods.append(base.__module__)
    files = []
    for m in mods:
        __import__(m)
        files.append(Path(inspect.getsourcefile(sys.modules[m])))
    return files


def digests_for(family: Family, path: "tuple[str, ...] | None" = None) -> dict[str, str]:
    """``templates``: SHA-256 over every template file ``family`` can include (names and bytes);
    ``code``: over the files of ``context_code_files``. Read from disk on each call."""
    templates = [(n, p.read_bytes()) for n, p in sorted(template_files(family, path).items())]
    code = [(p.name, p.read_bytes()) for p in context_code_files(family)]
    return {"templates": _digest(templates), "code": _digest(code)}


_digests: dict[tuple, dict[str, str]] = {}


def family_digests(family: Family) -> dict[str, str]:
    """``digests_for(family)``, computed once per process (the files do not change under a running
    process; ``clear_digests`` forgets them)."""
    k = (family.name, family.spec, family.template, family.template_dir, family.context_modules)
    got = _digests.get(k)
    if got is None:
        got = _digests[k] = digests_for(family)
    return got


def clear_digests() -> None:
    _digests.clear()
