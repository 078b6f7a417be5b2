"""The attngen package has no import cycle, function-level imports counted (``tools/import_graph.py``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_no_import_cycle_among_attngen_modules():
    g = import_graph.graph(ROOT / "attngen")
    assert "attngen.cache" in g and g["attngen.cache"], "the graph found no imports: the tool is broken"
    assert import_graph.cycles(g) == []


def test_function_level_imports_count(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import x\n    import torch\n")
    g = import_graph.graph(pkg)
    assert g["pkg.a"] == {"pkg.b": True} and g["pkg.b"] == {"pkg.a": False}
    assert import_graph.cycles(g) == [["pkg.a", "pkg.b"]]
