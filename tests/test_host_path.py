"""attngen.prefill's host path without a GPU: a stub libcuda and CPU torch tensors dressed as CUDA ones.

The checks run in a process of their own (tests/host_path_check.py), since the stub, once loaded,
would stand in for the driver of everything else in the process.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import fake_cuda

ROOT = Path(__file__).resolve().parent.parent


def _have_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
@pytest.mark.skipif(not _have_torch(), reason="needs torch (a CPU build is enough)")
def test_prefill_host_path_on_stub_driver(tmp_path):
    fake_cuda.run_check("host_path_check.py", tmp_path, keep_tuned=True)


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
@pytest.mark.skipif(not _have_torch(), reason="needs torch (a CPU build is enough)")
def test_host_overhead_tool_runs(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_host_overhead.py"), "--calls", "20",
                        "--batches", "2", "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
@pytest.mark.skipif(not _have_torch(), reason="needs torch (a CPU build is enough)")
def test_softcap_and_alibi_through_every_entry_point(tmp_path):
    """Every entry point x {softcap, ALiBi, both} x {sm_scale given, None} x {dense, varlen, paged, KV cache}
    reaches the kernel with the scale and modifiers it implies (tests/host_path_mods.py)."""
    fake_cuda.run_check("host_path_mods.py", tmp_path)
