"""Every Python example of the README runs as written: the ones that need no GPU here, all of them
in order on a GPU machine (``pytest -m gpu``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def needs_gpu(code: str) -> bool:
    return "cuda" in code or "get_kernel" in code


def test_the_readme_has_examples_of_both_kinds():
    bs = blocks()
    assert len(bs) >= 3 and any(needs_gpu(b) for b in bs) and not all(needs_gpu(b) for b in bs)


@pytest.mark.parametrize("index", [i for i, b in enumerate(blocks()) if not needs_gpu(b)])
def test_cpu_examples_run(index, cache_dir):
    exec(compile(blocks()[index], f"README.md python block {index + 1}", "exec"), {})


@pytest.mark.gpu
def test_every_example_runs_in_order_on_a_gpu(cache_dir):
    namespace: dict = {}
    for i, code in enumerate(blocks()):
        exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
    import torch

    torch.cuda.synchronize()
    assert namespace["out"].shape == namespace["q"].shape and namespace["kern"].spec.is_resolved
