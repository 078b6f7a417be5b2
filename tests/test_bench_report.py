"""BENCHMARKS.md is rendered from benchmarks/ (``attngen bench report``) and cannot drift from it; the
renderer and ``attngen bench record`` on small made-up inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attngen.bench import main as bench_main
from attngen.bench.report import ReportError, gpu_folder, record, record_section, render

ROOT = Path(__file__).resolve().parent.parent


def test_committed_page_is_what_the_committed_results_render():
    assert (ROOT / "BENCHMARKS.md").read_text() == render(ROOT / "benchmarks"), (
        "BENCHMARKS.md is stale: run `python3 -m attngen bench report`")


def test_committed_results_are_small_and_the_page_short():
    files = sorted((ROOT / "benchmarks").rglob("*.json"))
    assert (ROOT / "benchmarks" / "levers.json") in files and len(files) >= 5
    assert all(f.stat().st_size < 12_000 for f in files)
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) < 300


def test_levers_name_commits_of_this_repository():
    git = ROOT / ".git"
    if not git.exists():
        pytest.skip("not a git checkout")
    rows = json.loads((ROOT / "benchmarks" / "levers.json").read_text())["rows"]
    assert len(rows) >= 40
    for lever, shapes, effect, commit in rows:
        assert lever and shapes and effect
        r = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
        assert r.returncode == 0, f"{lever}: commit {commit} not found"


def _results(gpu="X100", family="prefill", **section):
    s = {"title": "sweep", "commit": "abc1234", "date": "2026-01-02", "versions": {"driver": "1.0", "cudnn": "9.1"},
         "command": "attngen bench prefill", "columns": ["shape", "a | b"], "rows": [["64", 1.5], ["128", "0.9"]],
         "notes": ["a note"]}
    s.update(section)
    return {"format": 1, "gpu": gpu, "family": family, "sections": [s]}


def _write(root: Path, folder: str, data: dict) -> None:
    (root / folder).mkdir(parents=True, exist_ok=True)
    (root / folder / f"{data['family']}.json").write_text(json.dumps(data))


def test_render_orders_gpus_and_families_and_escapes_cells(tmp_path):
    _write(tmp_path, "x200", _results("X200", "decode"))
    _write(tmp_path, "x200", _results("X200", "jit"))
    _write(tmp_path, "x200", _results("X200", "prefill"))
    _write(tmp_path, "x100", _results("X100", "mla_decode"))
    (tmp_path / "levers.json").write_text(json.dumps(
        {"format": 1, "title": "Levers not kept", "columns": ["lever", "commit"], "rows": [["a lever", "abc1234"]]}))
    text = render(tmp_path)
    heads = [line for line in text.splitlines() if line.startswith("#")]
    assert heads == ["# Benchmarks", "## X100", "### mla_decode: sweep", "## X200", "### prefill: sweep",
                     "### decode: sweep", "### jit: sweep", "## Levers not kept"]
    assert "| shape | a \\| b |" in text and "| 64 | 1.5 |" in text and "- a note" in text
    assert "2026-01-02, commit `abc1234`; driver 1.0, cuDNN 9.1; `attngen bench prefill`" in text
    assert "| a lever | abc1234 |" in text and text.endswith("|\n")
    assert render(tmp_path) == text


@pytest.mark.parametrize("change, words", [
    ({"date": "Jan 2"}, "'date' is 'Jan 2'; expected YYYY-MM-DD"),
    ({"rows": [["64"]]}, "rows[0] has 1 cells; expected 2"),
    ({"versions": {"gcc": "13"}}, "'versions' has ['gcc']"),
    ({"commit": 5}, "field 'commit' is int 5; expected str"),
])
def test_render_refuses_a_malformed_section_by_field(tmp_path, change, words):
    _write(tmp_path, "x100", _results(**change))
    with pytest.raises(ReportError, match="sections\\[0\\]") as e:
        render(tmp_path)
    assert words in str(e.value) and "prefill.json" in str(e.value)


def test_render_refuses_a_family_that_is_not_the_file_name(tmp_path):
    (tmp_path / "x100").mkdir()
    (tmp_path / "x100" / "decode.json").write_text(json.dumps(_results()))
    with pytest.raises(ReportError, match="'family' is 'prefill'; the file's name says 'decode'"):
        render(tmp_path)


RUN = {"benchmark": "prefill",
       "env": {"date": "2026-03-04T05:06:07+00:00", "gpu": "NVIDIA H100 80GB HBM3", "driver": "580.1",
               "torch": "2.11.0", "cudnn": 91900, "nvrtc": "13.0", "attngen_commit": "def5678"},
       "results": [{"ratio": {"cudnn": 1.2}}, {"ratio": {"cudnn": 0.8}}, {"ratio": {"cudnn": 1.0}}],
       "summary": {"cudnn": {"min": 0.8, "geomean": 0.98654, "shapes": 3, "min_at": {"head_dim": 64}},
                   "checks": {"run": 3, "failed": 0}}}


def test_record_section_from_a_benchmark_json():
    s = record_section(RUN, title="t")
    assert s["commit"] == "def5678" and s["date"] == "2026-03-04"
    assert s["versions"] == {"driver": "580.1", "torch": "2.11.0", "cudnn": "9.19", "nvrtc": "13.0"}
    assert s["rows"] == [["cudnn", "3", "0.987", "0.800", "2", "head_dim=64"]]
    with pytest.raises(ReportError, match="no ratio summary"):
        record_section({**RUN, "summary": {"checks": {}}}, title="t")
    assert gpu_folder("NVIDIA H100 80GB HBM3") == "h100" and gpu_folder("NVIDIA H200") == "h200"


def test_record_adds_then_replaces_a_section_and_the_page_renders(tmp_path):
    path = record(RUN, tmp_path, family="prefill", title="sweep")
    assert path == tmp_path / "h100" / "prefill.json"
    record({**RUN, "env": {**RUN["env"], "attngen_commit": "0000001"}}, tmp_path, family="prefill", title="sweep")
    record(RUN, tmp_path, family="prefill", title="other")
    data = json.loads(path.read_text())
    assert data["gpu"] == "H100 80GB HBM3" and [s["title"] for s in data["sections"]] == ["sweep", "other"]
    assert data["sections"][0]["commit"] == "0000001"
    assert "### prefill: sweep" in render(tmp_path)


def test_cli_report_writes_and_checks(tmp_path, capsys):
    _write(tmp_path / "b", "x100", _results())
    out = tmp_path / "B.md"
    assert bench_main(["report", "--dir", str(tmp_path / "b"), "--out", str(out), "--check"]) == 1
    assert "is not what" in capsys.readouterr().err
    assert bench_main(["report", "--dir", str(tmp_path / "b"), "--out", str(out)]) == 0
    assert bench_main(["report", "--dir", str(tmp_path / "b"), "--out", str(out), "--check"]) == 0
    assert bench_main(["report", "--dir", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert "no such folder" in capsys.readouterr().err
    run = tmp_path / "bench_prefill.json"
    run.write_text(json.dumps(RUN))
    assert bench_main(["record", str(run), "--family", "prefill", "--dir", str(tmp_path / "b")]) == 0
    assert (tmp_path / "b" / "h100" / "prefill.json").exists()


def test_python_m_attngen_bench_report_check_passes_on_the_checkout():
    r = subprocess.run([sys.executable, "-m", "attngen", "bench", "report", "--check"], cwd=ROOT,
                       capture_output=True, text=True, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
