"""attngen bench host without a GPU: re-rendering a saved run, and the message where it cannot run."""

import json

import pytest

from attngen import bench
from conftest import gpu_count
from test_bench import FAKE_ENV


def _saved(tmp_path):
    data = {"env": FAKE_ENV, "calls": 500, "batches": 20,
            "host": [{"label": "attngen.prefill(q, k, v)", "shape": "B=1 S=128 H=8 D=64 bf16", "us": 12.5,
                      "target": 10.0},
                     {"label": "attngen.decode(q, k_cache, v_cache, cache_seqlens=lens)", "shape": "B=1", "us": 9.5,
                      "target": 10.0},
                     {"label": "SDPA (default dispatch)", "shape": "B=1 S=128 H=8 D=64 bf16", "us": 18.1,
                      "target": None}],
            "decode_step": [{"label": "attngen.decode, eager", "us": 30.0},
                            {"label": "SDPA cuDNN, eager", "us": None, "error": "refused"}]}
    p = tmp_path / "bench_host.json"
    p.write_text(json.dumps(data))
    return p


def test_from_json_rerenders_targets_without_gpu(tmp_path, capsys):
    assert bench.main(["host", "--from-json", str(_saved(tmp_path)), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "| attngen.prefill(q, k, v) | B=1 S=128 H=8 D=64 bf16 | 12.50 | 10 | no |" in out
    assert "cache_seqlens=lens) | B=1 | 9.50 | 10 | yes |" in out
    assert "| SDPA (default dispatch) | B=1 S=128 H=8 D=64 bf16 | 18.10 |  |  |" in out
    assert "| SDPA cuDNN, eager | — |" in out
    assert json.loads((tmp_path / "o" / "bench_host.json").read_text())["host"][0]["us"] == 12.5


@pytest.mark.skipif(gpu_count() > 0, reason="checks the message where no GPU is present")
def test_without_torch_or_gpu_says_why(capsys):
    assert bench.main(["host"]) == 2
    err = capsys.readouterr().err
    assert "attngen bench host" in err and ("torch" in err or "GPU" in err)
