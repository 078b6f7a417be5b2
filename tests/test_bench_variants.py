"""attngen bench variants without a GPU: the summary's ratios and checks, the table from a saved JSON, the section
`attngen bench record` makes of it, and the refusal of an unknown case."""

import json
from argparse import Namespace

import pytest

from attngen import bench
from attngen.bench import report
from attngen.families.prefill import bench_variants as bv
from test_bench import FAKE_ENV


def _row(case, d, s, ms, checks, live=1.0):
    r = dict(case=case, head_dim=d, seqlen=s, batch=16384 // s, heads=32, kv_heads=8, causal=True, ms=ms,
             first_s={"snippet": 0.4, "flex": 9.5}, check={k: dict(rel_l2=v, ok=v <= 1e-2) for k, v in checks.items()})
    best = min(ms[k] for k in ("builtin", "snippet") if k in ms)
    r["ratio"] = {"flex": ms["flex"] / best}
    if "snippet" in ms:
        r["ratio"]["flex_snippet"] = ms["flex"] / ms["snippet"]
    if "snippet" in ms and "builtin" in ms:
        r["ratio"]["builtin"] = ms["builtin"] / ms["snippet"]
    if "causal" in ms:
        r["live"] = live
        r["ratio"]["flex_probe"] = ms["flex"] / (ms["causal"] * live)
    return r


ROWS = [_row("softcap", 128, 8192, {"builtin": 1.0, "snippet": 1.02, "flex": 1.7, "causal": 0.85},
             {"builtin": 3e-3, "snippet": 3e-3}),
        _row("sinks", 64, 2048, {"builtin": 0.5, "flex": 0.6}, {"builtin": 2e-3}),
        _row("rel_bias", 128, 2048, {"snippet": 0.8, "flex": 2.0}, {"snippet": 0.5})]


def test_summary_ratios_and_failed_checks():
    s = bv.summarize(ROWS)
    assert s["ratio"]["flex"]["min"] == pytest.approx(1.2) and s["ratio"]["flex"]["shapes"] == 3
    assert s["ratio"]["flex"]["min_at"] == {"case": "sinks", "head_dim": 64, "seqlen": 2048}
    assert s["ratio"]["builtin"]["shapes"] == 1 and s["ratio"]["builtin"]["geomean"] == pytest.approx(1 / 1.02)
    assert s["checks"] == {"run": 4, "failed": 1, "max_rel_l2": 0.5}
    # the causal probe: only the row that timed it
    assert s["ratio"]["flex_probe"]["shapes"] == 1 and s["ratio"]["flex_probe"]["geomean"] == pytest.approx(2.0)


def test_table_from_json_and_record(tmp_path, capsys):
    data = dict(benchmark="variants", env=FAKE_ENV, rows=ROWS, results=ROWS, summary=bv.summarize(ROWS), config={})
    saved = tmp_path / "bench_variants.json"
    saved.write_text(json.dumps(data))
    assert bench.main(["variants", "--from-json", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "| softcap | 128 | 8192 | 2 | 1.000 | 1.020 | — | — | 1.700 | 1.70 | 1.67 | 0.98 | 0.40 / 9.5 | 3.0e-03 | " \
           "0.850 (1.000) | 2.00 |" in out
    assert "| 2.0e-03 | — (—) | — |" in out  # a row saved before the probe
    assert "the causal probe × live pairs): geomean 2.000" in out
    assert "| sinks | 64 | 2048 | 8 | 0.500 | — | — | — | 0.600 | 1.20 |" in out
    assert "checks: 4 run, 1 failed" in out
    section = report.record_section(data, title="variants")
    labels = [r[0] for r in section["rows"]]
    assert labels == ["builtin", "flex", "flex_probe", "flex_snippet"]
    assert section["rows"][1][1:4] == ["3", f"{(1.7 * 1.2 * 2.5) ** (1 / 3):.3f}", "1.200"]


def test_a_mask_mods_plan_and_the_snippet_without_it_are_shown(capsys):
    row = _row("document", 128, 8192, {"builtin": 1.0, "snippet": 1.1, "snippet_noplan": 9.0, "plan": 0.02,
                                        "flex": 1.5, "causal": 2.0},
               {"builtin": 1e-3, "snippet": 1e-3, "snippet_noplan": 1e-3}, live=0.25)
    data = dict(benchmark="variants", env=FAKE_ENV, rows=[row], results=[row], summary=bv.summarize([row]), config={})
    bv._finish(data, Namespace(out=None))
    out = capsys.readouterr().out
    assert "| document | 128 | 8192 | 2 | 1.000 | 1.100 | 9.000 | 0.020 | 1.500 | 1.50 |" in out
    # the probe scaled by the live pairs: 1.5 / (2.0 * 0.25)
    assert "| 2.000 (0.250) | 3.00 |" in out


def test_unknown_case_is_refused(capsys):
    assert bench.main(["variants", "--cases", "softcap,bogus"]) == 2
    err = capsys.readouterr().err
    assert "bogus unknown" in err and "allowed: softcap,alibi" in err
