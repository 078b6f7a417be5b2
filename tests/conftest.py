import functools
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@functools.lru_cache(maxsize=1)
def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def _skipped_for_torch(report) -> bool:
    """Whether a skipped report's reason is torch's absence (pytest.importorskip("torch"), or a skipif saying so)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return report.skipped and "torch" in reason and "GPU" not in reason


class TorchSkips:
    """ATTNGEN_TEST_TORCH_SKIPS=FILE: the ids of the tests (and modules) this run skipped for want of torch, one a line,
    for .ci/run's step with a CPU build of torch to run again. Written by the main process only (with pytest-xdist its
    workers' reports reach it)."""

    def __init__(self, path: str):
        self.path, self.ids = path, set()

    def pytest_collectreport(self, report):  # a module skipped at collection; a test skipped when run, below
        if _skipped_for_torch(report):
            self.ids.add(report.nodeid)

    pytest_runtest_logreport = pytest_collectreport

    def pytest_sessionfinish(self):
        Path(self.path).write_text("".join(f"{i}\n" for i in sorted(self.ids)))


def pytest_configure(config):
    path = os.environ.get("ATTNGEN_TEST_TORCH_SKIPS")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(TorchSkips(path), "attngen-torch-skips")


def pytest_collection_modifyitems(config, items):
    if gpu_count() > 0:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty cache root for one test (and a clean in-process layer)."""
    from attngen import builder, runtime, tuned

    d = tmp_path / "cache"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(d))
    for clear in (builder.clear_memory, tuned.clear_tuned_memo, runtime.clear_loaded):
        clear()
    yield d
    for clear in (builder.clear_memory, tuned.clear_tuned_memo, runtime.clear_loaded):
        clear()


@pytest.fixture
def exact_fp32_reference():
    """fp32 matmuls without TF32 for the duration of a test, so the reference stays fp32-exact."""
    import torch

    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# ---- the cache tests' (test_cache*.py) --------------------------------------------------------------

@pytest.fixture
def compiles(monkeypatch):
    """Counts real NVRTC compiles made by build() (a spy: the real compiler still runs)."""
    import attngen.builder as builder_mod

    calls = []
    real = builder_mod.nvrtc_compile

    def counting(*args, **kwargs):
        calls.append(kwargs.get("kernel_name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(builder_mod, "nvrtc_compile", counting)
    return calls


@pytest.fixture(scope="session")
def golden(tmp_path_factory):
    """A populated cache root built once: cache_support.SPEC for sm_80 and sm_86. Tests copy it."""
    from attngen.builder import build, clear_memory
    from attngen.cache import DiskCache
    from cache_support import SPEC

    root = tmp_path_factory.mktemp("golden") / "cache"
    disk = DiskCache(root)
    clear_memory()
    results = {arch: build(SPEC, arch, cache=disk) for arch in ("sm_80", "sm_86")}
    clear_memory()
    assert all(r.origin == "compiled" and r.stored for r in results.values())
    return root, results
