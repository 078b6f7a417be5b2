"""attngen bench jit: the writers, and the cold-compile and warm-load paths for real on the CPU."""

import json
import math
import time

import pytest

from attngen import bench
from attngen.bench import jit
from test_bench import FAKE_ENV


def test_jit_writers():
    rows = [jit._row("cold compile (sm_90)", "prefill:head_dim=64", 0.8, "s", 2.0, "NVRTC 0.7 s"),
            jit._row("warm get_kernel, fresh process", "prefill:head_dim=64", 35.0, "ms", 20.0),
            jit._row("import attngen + the above", "prefill:head_dim=64", 100.0, "ms", None)]
    assert rows[0]["status"] == "met"
    assert rows[1]["status"].startswith("missed by 15 ms (1.75x)")
    assert rows[2]["status"] == "(info)"
    data = {"env": FAKE_ENV, "rows": rows, "skipped": ["prefill host overhead: needs a GPU"],
            "config": {"arch": "sm_90"}}
    md = jit.jit_markdown(data)
    assert "| cold compile (sm_90) | `prefill:head_dim=64` | 0.800 s | ≤ 2 s | met |" in md
    assert "skipped: prefill host overhead" in md
    text = "\n".join(jit.jit_text(data))
    assert "missed by 15 ms" in text and "≤ 20 ms" in text


# --- for real, on the CPU ---------------------------------------------------------------------------

def test_jit_cold_compile_for_one_spec(tmp_path, cache_dir, capsys):
    md = tmp_path / "jit.md"
    t0 = time.perf_counter()
    rc = bench.main(["jit", "--arch", "sm_90", "--spec", "prefill:head_dim=64,dtype=bf16,mask=none",
                     "--measure", "cold", "--out", str(tmp_path), "--markdown", str(md)])
    assert rc == 0
    assert time.perf_counter() - t0 < 30
    data = json.loads((tmp_path / "bench_jit.json").read_text())
    cold = [r for r in data["rows"] if r["metric"].startswith("cold compile")]
    assert len(cold) == 1
    assert cold[0]["unit"] == "s" and 0 < cold[0]["value"] < 30
    assert cold[0]["target"] == jit.TARGET_COLD_S
    assert data["config"]["arch"] == "sm_90"
    assert "cold compile (sm_90)" in md.read_text()
    # Cold means cold: nothing was left in the user's cache root or the in-process layer.
    assert not any(cache_dir.rglob("*.cubin"))
    from attngen import cache

    assert not len(cache.memory)


def test_jit_warm_in_a_fresh_process_without_gpu(tmp_path, cache_dir):
    rc = bench.main(["jit", "--arch", "sm_90", "--spec", "prefill:head_dim=64,dtype=bf16,mask=none",
                     "--measure", "warm,repeat", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "bench_jit.json").read_text())
    warm = [r for r in data["rows"] if r["metric"].startswith("warm")]
    assert len(warm) == 1 and warm[0]["value"] is not None, data["rows"]
    assert "origin disk" in warm[0]["note"]
    assert any(r["metric"].startswith("repeat") and r["value"] for r in data["rows"])


def test_jit_rejects_bad_input(capsys):
    assert bench.main(["jit", "--arch", "sm_90", "--measure", "cold,bogus"]) == 2
    assert bench.main(["jit", "--arch", "sm_12345"]) == 2
    assert bench.main(["jit", "--arch", "sm_90", "--spec", "prefill:head_dim=65"]) == 2


# --- on the GPU -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_jit_bench_on_gpu(tmp_path, cache_dir):
    rc = bench.main(["jit", "--spec", "prefill:head_dim=64,dtype=bf16,mask=none", "--repeat-calls", "1000",
                     "--overhead-calls", "100", "--overhead-batches", "3", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "bench_jit.json").read_text())
    metrics = [r["metric"] for r in data["rows"]]
    assert any(m.startswith("warm get_kernel") for m in metrics)
    assert any(m.startswith("repeat get_kernel") for m in metrics)
    assert any(m.startswith("host time per call: attngen.prefill") for m in metrics)
    assert all(r["value"] is not None for r in data["rows"]), data["rows"]
    assert not data["skipped"]
    assert math.isfinite(next(r["value"] for r in data["rows"] if r["metric"].startswith("cold compile")))
