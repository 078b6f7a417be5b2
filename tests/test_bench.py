"""attngen.bench, the package: dispatch to the subcommands, the no-GPU messages, the command from a checkout.

The benchmarks themselves are tested beside their modules' tests: test_bench_prefill.py,
test_bench_decode.py, test_bench_jit.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from attngen import bench
from conftest import gpu_count

ROOT = Path(__file__).resolve().parent.parent

# The environment record the writer tests of every benchmark render.
FAKE_ENV = {"date": "2026-11-22T00:00:00+00:00", "gpu": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0",
            "sm_count": 132, "driver": "580.95", "attngen": "0.1.0", "torch": "2.11.0+cu130", "torch_cuda": "13.0",
            "cudnn": 91300, "cupy": "14.2.0", "triton": "3.6.0", "nvrtc": "13.0", "python": "3.12.3",
            "gpu_present": True, "attngen_arch": "sm_90"}


def test_main_without_subcommand_prints_help(capsys):
    assert bench.main([]) == 2
    out = capsys.readouterr()
    assert "prefill" in out.err and out.out == ""  # a usage error: on stderr, as argparse's own


@pytest.mark.skipif(gpu_count() > 0, reason="checks the no-GPU messages")
def test_no_gpu_messages(capsys):
    assert bench.main(["jit", "--measure", "cold"]) == 2
    assert "--arch" in capsys.readouterr().err
    pytest.importorskip("torch")
    assert bench.main(["prefill", "--quick"]) == 2
    assert "GPU" in capsys.readouterr().err


def test_bench_help_runs_from_a_checkout():
    for sub in ("prefill", "jit"):
        r = subprocess.run([sys.executable, "-m", "attngen", "bench", sub, "--help"], capture_output=True, text=True,
                           cwd=ROOT, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "--markdown" in r.stdout
