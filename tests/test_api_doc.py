"""docs/API.md is what tools/api_doc.py writes from the code now: every public name documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attngen

ROOT = Path(__file__).resolve().parent.parent


def test_api_doc_is_current():
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "api_doc.py"), "--check"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def test_api_doc_names_every_public_name_and_every_error():
    text = (ROOT / "docs" / "API.md").read_text()
    missing = [n for n in attngen.__all__ if n != "__version__" and f"### `attngen.{n}`" not in text]
    assert not missing, missing
    for err in ("SpecError", "CompileError", "CacheError", "LaunchError", "ManifestError"):
        assert f"  - `{err}`" in text


def test_a_spec_prints_as_its_text_form():
    s = attngen.parse_spec("prefill:head_dim=64,mask=causal")
    assert str(s) == "prefill:head_dim=64,dtype=bf16,mask=causal" and attngen.parse_spec(str(s)) == s
