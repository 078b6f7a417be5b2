"""The README and the pages of docs/ say true things: every Python example runs as written (the ones that need
no GPU here; on a GPU machine, ``pytest -m gpu``, every page's examples in order), every code block holds code,
and every file and page they cite exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# docs/API.md is generated from the docstrings (tools/api_doc.py) and checked by its own test.
PAGES = [README] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "API.md")


def blocks(page: Path = README, lang: str = "python") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), flags=re.S)


def needs_gpu(code: str) -> bool:
    return "cuda" in code or "get_kernel" in code


# ADDING_A_FAMILY.md's Python is a fragment of a family's own __init__.py (tests/toy_family/ is the whole of it).
RUNNABLE = [p for p in PAGES if p.name != "ADDING_A_FAMILY.md"]
EXAMPLES = [(p, i) for p in RUNNABLE for i, b in enumerate(blocks(p)) if not needs_gpu(b)]


def test_the_pages_have_examples_of_both_kinds():
    bs = [b for p in RUNNABLE for b in blocks(p)]
    assert len(bs) >= 5 and any(needs_gpu(b) for b in bs) and not all(needs_gpu(b) for b in bs)
    assert len(blocks(README)) == 1 and len(blocks(README)[0].strip().splitlines()) == 5


@pytest.mark.parametrize("page, index", EXAMPLES, ids=[f"{p.name}-{i}" for p, i in EXAMPLES])
def test_cpu_examples_run(page, index, cache_dir):
    exec(compile(blocks(page)[index], f"{page.name} python block {index + 1}", "exec"), {})


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_code_block_holds_code_and_every_cited_path_exists(page):
    text = page.read_text()
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S):
        code = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        assert lang and code, f"{page.name}: a ```{lang} block without code: {body[:80]!r}"
    for path in re.findall(r"`((?:attngen|templates|tests|tools|docs|cache|benchmarks|\.ci)/[^`\s]*)`", text):
        if "<" not in path and "*" not in path:
            assert (ROOT / path).exists(), f"{page.name} cites {path}, which does not exist"
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not link.startswith("http"):
            assert (page.parent / link).exists(), f"{page.name} links to {link}, which does not exist"


def test_the_readme_install_and_test_commands_are_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    sh = [line.strip() for b in blocks(README, "sh") for line in b.splitlines()]
    for command in ("python3 -m pip install -e '.[cu13,test]'", "python3 -m pytest -q -n auto"):
        assert command in sh and f"\n{command}" in ci, command


@pytest.mark.gpu
@pytest.mark.parametrize("page", [p for p in RUNNABLE if any(needs_gpu(b) for b in blocks(p))],
                         ids=lambda p: p.name)
def test_every_example_runs_in_order_on_a_gpu(page, cache_dir):
    namespace: dict = {}
    for i, code in enumerate(blocks(page)):
        exec(compile(code, f"{page.name} python block {i + 1}", "exec"), namespace)
    import torch

    torch.cuda.synchronize()
    assert "out" in namespace or namespace["kern"].spec.is_resolved
