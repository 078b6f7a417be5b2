"""The built wheel holds what an install needs: every template file, every package, the manifests.

Builds the wheel for real (``pip wheel --no-deps``, a few seconds); ``.ci/wheel_check.sh`` then
installs one into a fresh venv and uses it from outside the checkout.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(ROOT), "-w", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = out.glob("attngen-*.whl")
    with zipfile.ZipFile(whl) as z:
        return set(z.namelist())


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
