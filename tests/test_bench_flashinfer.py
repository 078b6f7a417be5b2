"""The FlashInfer column of attngen bench prefill / decode / mla, on the CPU: absent without flashinfer
(a one-line note, no import of torch.cuda on the way), rendered where a run has it, and carried into a
results section by ``bench record``. Its timing is never faked here: tests/test_gpu_bench_flashinfer.py
runs FlashInfer itself on a GPU where it is installed."""

import argparse
import json
import subprocess
import sys

import pytest

from attngen import bench
from attngen.bench import flashinfer as fi
from attngen.bench.report import check_results, record, record_section, render
from attngen.families.decode import bench_report as decode_report
from attngen.families.mla_decode import bench as mla_bench
from attngen.families.prefill import bench as prefill_bench
from test_bench import FAKE_ENV, ROOT
from test_bench_decode import fake_decode_data
from test_bench_prefill import SIM, cpu_sim  # noqa: F401  (cpu_sim: the fixture, used by name below)
from test_bench_prefill import fake_data as fake_prefill_data

FI_CONFIG = {"present": True, "version": "0.7.2.post1", "note": None}


def fi_record(first=74.5, max_abs=3.9e-3, rel=2e-3, nan=0):
    return {"backend": "fa3", "first_call_s": first, "plan_s": first - 0.5, "import_s": 1.25,
            "vs_attngen": {"max_abs": max_abs, "rel_l2": rel, "nan_count": nan}}


# --- absent without flashinfer ----------------------------------------------------------------------

def test_missing_names_why_and_the_flag_wins(monkeypatch):
    monkeypatch.setattr(fi.importlib.util, "find_spec", lambda name: None)
    assert fi.missing() == ("no FlashInfer column: flashinfer is not installed (python3 -m pip install "
                            "flashinfer-python adds one)")
    assert fi.wanted(argparse.Namespace(no_flashinfer=False)) == fi.missing()
    assert fi.config(argparse.Namespace(no_flashinfer=False)) == {"present": False, "version": None,
                                                                   "note": fi.missing()}
    monkeypatch.setattr(fi.importlib.util, "find_spec", lambda name: object())
    assert fi.missing() is None and fi.wanted(argparse.Namespace(no_flashinfer=False)) is None
    assert fi.wanted(argparse.Namespace(no_flashinfer=True)) == "no FlashInfer column: --no-flashinfer"
    for argv in (["prefill"], ["decode"], ["mla"]):
        assert bench.build_parser().parse_args(argv + ["--no-flashinfer"]).no_flashinfer is True


def test_looking_flashinfer_up_imports_neither_it_nor_torch_cuda(tmp_path):
    # A package named flashinfer that fails when imported: finding it must not import it. Without it on the
    # path, the note; with it, the column (its config) -- and torch.cuda is imported on neither path.
    pkg = tmp_path / "site" / "flashinfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('flashinfer was imported')\n")
    code = ("import argparse, json, sys\n"
            "from attngen.bench import flashinfer as fi, build_parser\n"
            "build_parser()\n"
            "ns = argparse.Namespace(no_flashinfer=False)\n"
            "print(json.dumps([fi.missing(), fi.config(ns), fi.present({'results': []}), 'torch.cuda' in sys.modules,"
            " 'flashinfer' in sys.modules]))\n")
    for path, found in ((str(ROOT), False), (f"{tmp_path / 'site'}:{ROOT}", True)):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                           env={"PYTHONPATH": path, "PATH": "/usr/bin:/bin"}, timeout=120)
        assert r.returncode == 0, r.stderr
        note, cfg, present, cuda, imported = json.loads(r.stdout)
        assert (note is None) is found and cfg["present"] is found and present is False
        assert not cuda and not imported


def test_simulated_prefill_without_flashinfer_has_no_column(cpu_sim, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fi, "missing", lambda: "no FlashInfer column: flashinfer is not installed (test)")
    assert bench.main(SIM + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert "no FlashInfer column: flashinfer is not installed (test)" in out
    assert data["config"]["flashinfer"]["present"] is False and "flashinfer" not in data["config"]["backends"]
    for r in data["results"]:
        assert "flashinfer" not in r and "flashinfer" not in r["tflops"] and "flashinfer" not in r["ratio"]
    assert "flashinfer" not in prefill_bench.text_header(prefill_bench._impls(data["results"],
                                                                                data["config"]["backends"]))


def test_no_flashinfer_flag_keeps_an_installed_flashinfer_out(cpu_sim, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fi, "missing", lambda: None)   # as if installed; the flag must keep every call away
    monkeypatch.setattr(fi, "prefill", lambda *a, **k: pytest.fail("FlashInfer ran despite --no-flashinfer"))
    assert bench.main(SIM + ["--no-flashinfer", "--out", str(tmp_path)]) == 0
    assert "no FlashInfer column: --no-flashinfer" in capsys.readouterr().out
    data = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert data["config"]["flashinfer"] == {"present": False, "version": None,
                                            "note": "no FlashInfer column: --no-flashinfer"}


def test_attempt_records_the_peer_or_its_refusal(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    def refuses(q_len):
        raise ValueError(f"q_len {q_len}: FlashInfer's decode wrapper takes one new token a row (q_len 1)")

    rec = {"errors": {}, "ms": {"attngen": 1.0}, "gbps": {}}
    assert fi.attempt(rec, refuses, 4, nulls=("ms", "gbps")) is None
    assert rec["errors"] == {"flashinfer": "ValueError: q_len 4: FlashInfer's decode wrapper takes one new token a "
                                           "row (q_len 1)"}
    assert rec["ms"] == {"attngen": 1.0, "flashinfer": None} and rec["gbps"] == {"flashinfer": None}
    assert "flashinfer" not in rec
    peer = fi.Peer(call=lambda: None, backend="fa3", first_call_s=2.0, plan_s=1.5, import_s=0.25,
                   check={"vs_attngen": {"max_abs": 0.0, "rel_l2": 0.0, "nan_count": 0}})
    rec = {"errors": {}}
    assert fi.attempt(rec, lambda: peer) is peer and rec["errors"] == {}
    assert rec["flashinfer"] == {"backend": "fa3", "first_call_s": 2.0, "plan_s": 1.5, "import_s": 0.25,
                                 "vs_attngen": {"max_abs": 0.0, "rel_l2": 0.0, "nan_count": 0}}


# --- rendered where present -------------------------------------------------------------------------

def with_fi_prefill():
    data = fake_prefill_data()
    data["config"]["backends"] = ["flash", "cudnn", "efficient", "flashinfer"]
    data["config"]["flashinfer"] = FI_CONFIG
    for i, r in enumerate(data["results"]):
        tf = 400.0 if i else None
        r["tflops"]["flashinfer"] = tf
        r["ms"]["flashinfer"] = r["flops"] / (tf * 1e12) * 1e3 if tf else None
        r["ratio"]["flashinfer"] = r["tflops"]["attngen"] / tf if tf else None
        if i:
            r["flashinfer"] = fi_record(first=74.5 if i == 1 else 0.02, rel=0.5 if i == 2 else 2e-3)
        else:
            r["errors"]["flashinfer"] = "RuntimeError: not on this arch"
    return data


def test_prefill_table_with_and_without_the_column():
    old = fake_prefill_data()
    cols = prefill_bench.table_columns(prefill_bench._impls(old["results"], old["config"]["backends"]))
    assert "flashinfer" not in cols and fi.DELTA_COLUMN not in cols
    assert "FlashInfer" not in prefill_bench.prefill_markdown(old)
    data = with_fi_prefill()
    backends = prefill_bench._impls(data["results"], data["config"]["backends"])
    cols = prefill_bench.table_columns(backends)
    assert cols[-4:] == ["/efficient", "/flashinfer", "check", fi.DELTA_COLUMN]
    rows = [prefill_bench.table_row(r, backends) for r in data["results"]]
    assert rows[0][-1] == "—" and rows[0][cols.index("flashinfer")] == "—"
    assert rows[1][cols.index("flashinfer")] == "400.0" and rows[1][cols.index("/flashinfer")] == "0.38"
    assert rows[1][-1] == "3.9e-03" and rows[2][-1] == "3.9e-03 FAIL"
    summ = prefill_bench.summarize(data["results"], backends)
    assert summ["flashinfer"]["shapes"] == 2 and summ["flashinfer"]["min"] == pytest.approx(150 / 400)
    assert any(ln.startswith("attngen/flashinfer: min 0.375") for ln in prefill_bench.summary_lines(summ, backends))
    md = prefill_bench.prefill_markdown(data)
    assert "| flashinfer TFLOP/s |" in md and "FlashInfer max abs diff vs attngen |" in md
    assert ("FlashInfer fa3 first call (plan + run, its JIT build and load included, outside every timing): "
            "74.50 s (import 1.25 s), then at most 0.02 s a shape") in md


def test_decode_rows_with_and_without_the_column():
    old = fake_decode_data()
    assert decode_report.decode_peers(old) == ["flash", "cudnn"]
    data = fake_decode_data()
    data["config"]["flashinfer"] = {**FI_CONFIG, "first_call": fi_record(first=11.0)}
    r = data["results"][0]
    a = r["ms"]["attngen"]
    r["ms"]["flashinfer"], r["gbps"]["flashinfer"] = a * 0.9, r["bytes"] / (a * 0.9 * 1e-3) / 1e9
    r["ratio"]["attngen"]["flashinfer"] = 0.9
    r["checks"]["flashinfer"] = {"reference": "fp32", "nan_count": 0, "max_abs": 0.01, "rel_l2": 3e-3, "ok": True}
    r["flashinfer"] = fi_record(first=0.01)
    peers = decode_report.decode_peers(data)
    assert peers == ["flash", "cudnn", "flashinfer"]
    rows = decode_report.decode_rows(r, peers)
    cols = decode_report.decode_columns(peers)
    assert [row[1] for row in rows] == ["attngen", "sdpa-flash", "sdpa-cudnn", "flashinfer"]
    assert rows[0][cols.index("vs flashinfer")] == "0.90"
    assert rows[3][-1] == f"3.0e-03; {fi.DELTA_COLUMN} 3.9e-03"
    summ = decode_report.decode_summary(data["results"], peers)
    assert summ["impls"]["attngen"]["ratio"]["flashinfer"]["min"] == pytest.approx(0.9)
    assert "attngen vs flashinfer: min 0.90" in "\n".join(decode_report.decode_summary_lines(summ))
    md = decode_report.decode_markdown(data)
    assert "| vs flashinfer |" in md and "FlashInfer fa3 first call" in md and "11.00 s" in md
    assert "vs flashinfer" not in decode_report.decode_markdown(old)


def mla_data(with_fi: bool) -> dict:
    rows = ["attngen", "read"] + (["flashinfer"] if with_fi else [])
    results = []
    for b, us_a, us_f in ((1, 10.0, 8.0), (64, 100.0, 120.0)):
        nbytes = b * 1024 * 576 * 2
        us = {"attngen": us_a, "read": us_a * 0.8, **({"flashinfer": us_f} if with_fi else {})}
        r = {"batch": b, "seqlen": 1024, "heads": 128, "bytes": nbytes, "us": us,
             "gbps": {k: nbytes / (v * 1e-6) / 1e9 for k, v in us.items()},
             "checks": {k: {"rel_l2": 3e-3, "ok": True} for k in us if k != "read"}, "errors": {}, "specs": {}}
        if with_fi:
            r["ratio"] = {"flashinfer": us_f / us_a}
            r["flashinfer"] = fi_record(first=15.0 if b == 1 else 0.01)
        results.append(r)
    return {"benchmark": "mla", "complete": True, "env": FAKE_ENV, "results": results,
            "config": {"rows": rows, "timer": "sim", **({"flashinfer": FI_CONFIG} if with_fi else {})}}


def test_mla_table_and_summary_with_and_without_the_column():
    old = mla_data(False)
    assert "flashinfer" not in "\n".join(mla_bench._table(old)) and "ratio" not in mla_bench.summary(old)
    data = mla_data(True)
    table = mla_bench._table(data)
    assert table[0].endswith(f"| flashinfer GB/s | attngen / read | attngen / flashinfer | {fi.DELTA_COLUMN} |")
    assert table[1].count("---") == table[0].count("|") - 1
    assert table[2].endswith("| 0.80 | 0.80 | 3.9e-03 |") and table[3].endswith("| 0.80 | 1.20 | 3.9e-03 |")
    s = mla_bench.summary(data)
    assert s["ratio"]["flashinfer"]["min"] == pytest.approx(0.8) and s["ratio"]["flashinfer"]["shapes"] == 2
    assert s["ratio"]["flashinfer"]["min_at"] == {"batch": 1, "seqlen": 1024, "heads": 128}
    assert s["failed_checks"] == [] and s["flashinfer_failed_checks"] == []


# --- into a results section -------------------------------------------------------------------------

def test_record_names_flashinfer_where_the_run_had_it(tmp_path):
    data = mla_data(True)
    data["summary"] = mla_bench.summary(data)
    s = record_section(data, title="MLA against FlashInfer")
    assert s["versions"]["flashinfer"] == "0.7.2.post1"
    assert s["rows"] == [["flashinfer", "2", f"{(0.8 * 1.2) ** 0.5:.3f}", "0.800", "1",
                          "batch=1 seqlen=1024 heads=128"]]
    assert s["notes"] and s["notes"][0].startswith("FlashInfer fa3 first call") and "15.00 s" in s["notes"][0]
    pre = with_fi_prefill()
    pre["summary"] = prefill_bench.summarize(pre["results"], pre["config"]["backends"])
    labels = [row[0] for row in record_section(pre, title="t")["rows"]]
    assert labels == ["cudnn", "efficient", "flash", "flashinfer"]
    old = fake_prefill_data()
    old["summary"] = prefill_bench.summarize(old["results"], old["config"]["backends"])
    s_old = record_section(old, title="t")
    assert "flashinfer" not in s_old["versions"] and "notes" not in s_old
    assert "flashinfer" not in [row[0] for row in s_old["rows"]]
    record(data, tmp_path, family="mla_decode", title="MLA against FlashInfer")
    record(old, tmp_path, family="prefill", title="before the column")
    page = render(tmp_path)
    assert "FlashInfer 0.7.2.post1" in page and "| flashinfer | 2 |" in page and "- FlashInfer fa3 first call" in page
    before = page.split("### prefill: before the column")[1].split("### ")[0]
    assert "FlashInfer" not in before and "flashinfer" not in before


def test_results_files_with_and_without_a_flashinfer_version_are_accepted():
    base = {"format": 1, "gpu": "H200", "family": "mla_decode"}
    section = {"title": "t", "commit": "abc", "date": "2026-11-29", "command": "attngen bench mla",
               "columns": ["a"], "rows": [["1"]]}
    check_results({**base, "sections": [{**section, "versions": {"torch": "2.11"}}]}, "old")
    check_results({**base, "sections": [{**section, "versions": {"torch": "2.11", "flashinfer": "0.7.2"}}]}, "new")
    from attngen.bench.report import ReportError
    with pytest.raises(ReportError, match="'versions' has \\['flashinfe'\\]"):
        check_results({**base, "sections": [{**section, "versions": {"flashinfe": "0.7.2"}}]}, "typo")
