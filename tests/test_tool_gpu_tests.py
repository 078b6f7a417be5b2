"""tools/gpu_tests.py: how it cuts the test list and reads pytest's summary (the runs themselves need a GPU)."""

import importlib.util
import os
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


def test_finished_reads_the_node_ids_pytest_v_reported():
    text = ("tests/a.py::test_x[1-2] PASSED                 [ 33%]\n"
            "tests/a.py::test_y FAILED                      [ 66%]\n"
            "tests/a.py::test_z SKIPPED (no GPU)            [100%]\n"
            "FAILED tests/a.py::test_y - assert 0\n")
    assert gpu_tests.finished(text) == {"tests/a.py::test_x[1-2]", "tests/a.py::test_y", "tests/a.py::test_z"}


def test_a_part_stopped_at_the_limit_names_its_test_and_lists_the_rest(tmp_path, capsys):
    # in tests/ (node ids are the repository's, as the tool's are), named so that no suite's discovery collects it
    probe = Path(__file__).resolve().parent / f"_gpu_tests_probe_{os.getpid()}.py"
    probe.write_text("import time\n\ndef test_a():\n    pass\n\ndef test_b():\n    time.sleep(60)\n\n"
                     "def test_c():\n    pass\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "not_run.txt").write_text("stale\n")
    try:
        rc = gpu_tests.main([str(probe.relative_to(gpu_tests.ROOT)), "--workers", "1", "--timeout", "5",
                             "--out", str(out)])
        text = capsys.readouterr().out
        assert rc == 1
        left = (out / "not_run.txt").read_text().split()
        assert [t.split("::")[1] for t in left] == ["test_b", "test_c"]
        assert f"part 0 stopped in {left[0]}: 2 of its tests not run" in text
        # a run that finishes leaves no list behind
        assert gpu_tests.main([left[1], "--workers", "1", "--out", str(out)]) == 0
        assert not (out / "not_run.txt").exists()
    finally:
        probe.unlink()
