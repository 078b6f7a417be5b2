"""tools/gpu_tests.py: how it cuts the test list and reads pytest's summary (the runs themselves need a GPU)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_tests", Path(__file__).resolve().parent.parent / "tools" /
                                               "gpu_tests.py")
gpu_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_tests)


@pytest.mark.parametrize("n,workers,sizes", [(10, 3, [4, 3, 3]), (2, 8, [1, 1]), (7, 1, [7]), (6, 6, [1] * 6)])
def test_parts_are_contiguous_nearly_equal_and_never_empty(n, workers, sizes):
    ids = [f"t::{i}" for i in range(n)]
    got = gpu_tests.parts(ids, workers)
    assert [len(p) for p in got] == sizes
    assert [i for p in got for i in p] == ids  # in order, each once


@pytest.mark.parametrize("tail,want", [
    ("===== 1 failed, 318 passed, 36 skipped in 161.36s (0:02:41) =====", (318, 1, 0, 36)),
    ("===== 346 passed in 189.00s =====", (346, 0, 0, 0)),
    ("== 2 passed, 1 error in 3.1s ==", (2, 0, 1, 0)),
    ("== 5 failed, 3 errors in 9s ==", (0, 5, 3, 0)),
    ("KeyboardInterrupt", (0, 0, 0, 0)),
    ("", (0, 0, 0, 0)),
])
def test_counts_read_pytests_last_line(tail, want):
    c = gpu_tests.counts("some output\n" + tail)
    assert (c["passed"], c["failed"], c["errors"], c["skipped"]) == want


def test_collect_takes_a_keyword_expression():
    # a CPU test file, so that this collects without a GPU (the GPU files skip at import without torch)
    path = "tests/test_tool_gpu_tests.py"
    every = gpu_tests.collect([path])
    some = gpu_tests.collect([path], "counts_read")
    assert some and set(some) < set(every) and all("test_counts_read_pytests_last_line" in i for i in some)
    with pytest.raises(SystemExit, match="with -k 'no_such_test'"):
        gpu_tests.collect([path], "no_such_test")
