"""The built wheel holds what an install needs: every template file, every package, the manifests.

Builds the wheel for real (``pip wheel --no-deps``, a few seconds); ``.ci/wheel_check.sh`` then
installs one into a fresh venv and uses it from outside the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # From a copy of what the wheel is made of: built in the checkout, setuptools reuses its build/ folder, which
    # keeps a template the tree has since deleted.
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("attngen", "templates", "cache"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(src), "-w", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("attngen-*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_wheel_metadata_license_and_one_cuda_extra_per_driver_major(wheel, wheel_names):
    (meta,) = [n for n in wheel_names if n.endswith(".dist-info/METADATA")]
    with zipfile.ZipFile(wheel) as z:
        text = z.read(meta).decode()
    assert "License-Expression: MIT" in text
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel_names)
    requires = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    # No CUDA stack without an extra: the cu12 and cu13 ones cannot share an environment.
    assert not [r for r in base if "cupy" in r or "cuda-toolkit" in r], base
    for major in (12, 13):
        extra = [r for r in requires if f'extra == "cu{major}"' in r]
        assert any(r.startswith(f"cupy-cuda{major}x") for r in extra), extra
        assert any(r.startswith("cuda-toolkit") and f"=={major}.*" in r for r in extra), extra


def _tree(folder: Path, pattern: str = "*") -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob(pattern)
            if p.is_file() and "__pycache__" not in p.parts}


def test_wheel_ships_every_template_file(wheel_names):
    shipped = {n[len("attngen/templates/"):] for n in wheel_names if n.startswith("attngen/templates/")}
    assert shipped == _tree(ROOT / "templates")


def test_wheel_ships_every_module_and_manifest(wheel_names):
    modules = {f"attngen/{p}" for p in _tree(ROOT / "attngen", "*.py")}
    assert modules <= wheel_names, sorted(modules - wheel_names)
    manifests = {f"attngen/manifests/{p}" for p in _tree(ROOT / "cache", "*.toml")}
    assert manifests and manifests <= wheel_names, sorted(manifests - wheel_names)
