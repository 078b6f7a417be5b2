"""Write docs/API.md from attngen's public names and their docstrings; ``--check`` fails if the
file differs from what the code says now (tests/test_api_doc.py runs it), so the page cannot drift.

    python3 tools/api_doc.py            # rewrite docs/API.md
    python3 tools/api_doc.py --check    # exit 1 if docs/API.md is stale
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import attngen  # noqa: E402
from attngen.spec import SpecBase  # noqa: E402

OUT = ROOT / "docs" / "API.md"

SECTIONS = [
    ("Operations", lambda o: inspect.isfunction(o) and o.__module__.startswith("attngen.families.")),
    ("Specs", lambda o: isinstance(o, type) and issubclass(o, SpecBase)),
    ("Enums", lambda o: isinstance(o, type) and issubclass(o, enum.Enum)),
    ("Errors", lambda o: isinstance(o, type) and issubclass(o, BaseException)),
    ("Building and loading", lambda o: callable(o)),
    ("Constants", lambda o: True),
]


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip()


def _signature(name: str, obj) -> str:
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        return name


def _spec_fields(cls) -> list[str]:
    lines = ["", "| field | values | default | tuning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(cls):
        vals = ", ".join(str(v.value if isinstance(v, enum.Enum) else v).lower() if isinstance(v, bool)
                         else str(v.value if isinstance(v, enum.Enum) else v) for v in cls.allowed_values(f.name))
        d = f.default.value if isinstance(f.default, enum.Enum) else f.default
        lines.append(f"| `{f.name}` | {vals} | `{str(d).lower() if isinstance(d, bool) else d}` | "
                     f"{'yes' if f.name in cls.TUNING_FIELDS else ''} |")
    return lines


def _errors() -> list[str]:
    lines = ["", "The hierarchy:", ""]

    def walk(cls, depth):
        lines.append(f"{'  ' * depth}- `{cls.__name__}`" + (f" (also a `ValueError`)" if issubclass(cls, ValueError)
                                                          and cls is not attngen.AttngenError else ""))
        for sub in sorted(cls.__subclasses__(), key=lambda c: c.__name__):
            if sub.__module__.startswith("attngen"):
                walk(sub, depth + 1)

    walk(attngen.AttngenError, 0)
    return lines


def render() -> str:
    names = sorted(attngen.__all__, key=str.lower)
    placed: set[str] = set()
    out = ["# attngen API", "",
           "Generated from the code by `python3 tools/api_doc.py`; `tests/test_api_doc.py` fails when it is stale.",
           "Every public name of the `attngen` package, with its signature and its docstring. Shapes are in the",
           "docstrings (FlashAttention's layout: `[batch, seqlen, heads, head_dim]`). Each kernel family adds its",
           "op, spec class and enums (`docs/ADDING_A_FAMILY.md`). A spec's text form is `str(spec)`",
           "(`spec.to_text()`), e.g. `prefill:head_dim=128,dtype=bf16,mask=causal`; `parse_spec` reads it back."]
    for title, test in SECTIONS:
        here = [n for n in names if n not in placed and not n.startswith("_") and test(getattr(attngen, n))]
        if not here:
            continue
        out += ["", f"## {title}"]
        for n in here:
            placed.add(n)
            obj = getattr(attngen, n)
            out += ["", f"### `attngen.{n}`"]
            if callable(obj) and not isinstance(obj, type) or (isinstance(obj, type) and not issubclass(obj, enum.Enum)):
                out += ["", "```python", _signature(n, obj), "```"]
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                out += ["", "Values: " + ", ".join(f"`{m.value}`" for m in obj) + "."]
            doc = _doc(obj) if (callable(obj) or isinstance(obj, type)) else ""
            if doc and not (isinstance(obj, type) and issubclass(obj, enum.Enum) and doc == _doc(enum.Enum)):
                out += ["", doc]
            if isinstance(obj, type) and issubclass(obj, SpecBase):
                out += _spec_fields(obj)
            if obj is attngen.AttngenError:
                out += _errors()
            if title == "Constants":
                out += ["", f"`{obj!r}`" if not isinstance(obj, dict) else f"{len(obj)} entries: " +
                        ", ".join(f"`{k}`" for k in obj)]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python3 tools/api_doc.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
