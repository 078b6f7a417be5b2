"""``attngen tune`` on a real GPU (pytest -m gpu): the stored winner is what a fresh process's prefill
(and decode) runs.

Each check runs in fresh processes (``python -m attngen tune ...``, then a script that calls
``attngen.prefill``) under the test's own cache root, so the store is read the way a later
process reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
SPEC = "prefill:head_dim=64,dtype=bf16"

# Runs prefill on fresh inputs of seqlen argv[1], checks it against the fp32 reference and prints
# the spec the kernel it launched was built from.
_USE_SCRIPT = r"""
import json, sys
import torch
import attngen
from attngen.families.prefill.op import kernel_for
from tests.gpu_reference import reference_attention

torch.backends.cuda.matmul.allow_tf32 = False
s = int(sys.argv[1])
g = torch.Generator(device="cuda")
g.seed()
q, k, v = (torch.randn(2, s, 4, 64, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
out = torch.full_like(q, float("nan"))
attngen.prefill(q, k, v, out=out)
torch.cuda.synchronize()
ref, _ = reference_attention(q, k, v)
err = (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()
spec = kernel_for(q, k, v).spec
print("RESULT " + json.dumps({"spec": spec.to_dict(), "finite": bool(torch.isfinite(out).all()), "rel_l2": err}))
"""


def _env(cache_dir, **extra):
    # The checkout first, then the caller's path (which may name the NVRTC wheel in use: a tuned
    # entry is keyed by the NVRTC version, so the child must load the same one).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, ATTNGEN_CACHE_DIR=str(cache_dir))
    env.pop("ATTNGEN_NO_TUNED", None)
    env.update(extra)
    return env


def _use(cache_dir, seqlen, **extra) -> dict:
    p = subprocess.run([sys.executable, "-c", _USE_SCRIPT, str(seqlen)], cwd=ROOT, env=_env(cache_dir, **extra),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    assert r["finite"] and r["rel_l2"] < 2e-2, r
    return r


def _tuning(d: dict) -> dict:
    from attngen import PrefillSpec

    return {k: d[k] for k in PrefillSpec.TUNING_FIELDS}


def test_tune_stores_a_winner_that_a_fresh_process_uses(cache_dir):
    p = subprocess.run([sys.executable, "-m", "attngen", "tune", "prefill", SPEC, "--seqlen", "512",
                        "--max-candidates", "3", "--json"], cwd=ROOT, env=_env(cache_dir), capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["ok"] and len(out["results"]) == 1
    r = out["results"][0]
    assert r["candidates"] == 3 and len(r["rows"]) == 3 and r["rows"][0]["default"]
    assert all(row["status"] == "ok" for row in r["rows"]), r["rows"]
    w = r["winner"]
    assert w["ms"] == min(row["ms"] for row in r["rows"])
    assert r["stored"] and Path(r["stored"]).is_file()
    stored = json.loads(Path(r["stored"]).read_text())["entries"]
    assert len(stored) == 1 and stored[0]["seqlen"] == 512 and stored[0]["tuning"] == w["tuning"]

    used = _use(cache_dir, 512)
    assert _tuning(used["spec"]) == w["tuning"]
    assert _tuning(_use(cache_dir, 300)["spec"]) == w["tuning"]  # the only bucket serves every seqlen
    default = _use(cache_dir, 512, ATTNGEN_NO_TUNED="1")
    assert _tuning(default["spec"]) == r["rows"][0]["tuning"]


def test_a_stored_non_default_config_is_used_and_correct(cache_dir):
    """The search above may well keep the default; this stores a config that is not, per bucket."""
    import torch

    from attngen import tune
    from attngen import PrefillSpec
    from attngen.arch import get_arch

    spec = PrefillSpec(head_dim=64, dtype="bf16")
    ident = tune.device_identity(torch.cuda.current_device())
    cands = tune.plan(spec, get_arch(ident["arch"]))
    small, large = cands[1], cands[2]
    for seqlen, cand in ((256, small), (4096, large)):
        row = tune.Row(cand, ms=1.0, rate=1.0, status="ok")
        tune.store_winner(spec, seqlen, row, ident, {"batch": 1, "heads": 1, "window": [-1, -1], "candidates": 1},
                          root=cache_dir)
    assert _tuning(_use(cache_dir, 300)["spec"]) == _tuning(small.to_dict())
    assert _tuning(_use(cache_dir, 3000)["spec"]) == _tuning(large.to_dict())
    # without the stored winners: the built-in default for 3000 rows (on sm_90a it depends on the rows)
    from attngen.families.prefill.choose import by_rows

    bounds, by = by_rows(cands[0], ident["arch"]) or ([], [cands[0]])
    builtin = by[sum(3000 >= b for b in bounds)]
    assert _tuning(_use(cache_dir, 3000, ATTNGEN_NO_TUNED="1")["spec"]) == _tuning(builtin.to_dict())


# Decode against a paged cache of capacity argv[1] (ragged lengths up to it): checks the output
# against the fp32 reference and prints the tuning of every decode kernel the process loaded.
_DECODE_SCRIPT = r"""
import json, sys
import torch
import attngen
from attngen import runtime
from tests.gpu_reference import reference_decode

torch.backends.cuda.matmul.allow_tf32 = False
cap = int(sys.argv[1])
g = torch.Generator(device="cuda")
g.seed()
b, hk, group, bs = 3, 2, 4, 64
q = torch.randn(b, 1, hk * group, 128, device="cuda", generator=g).to(torch.bfloat16)
blocks = cap // bs
kp, vp = (torch.randn(b * blocks, bs, hk, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
table = torch.randperm(b * blocks, device="cuda", generator=g).to(torch.int32).reshape(b, blocks)
lens = torch.randint(1, cap + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
out = torch.full_like(q, float("nan"))
attngen.decode(q, kp, vp, cache_seqlens=lens, block_table=table, out=out)
torch.cuda.synchronize()
ref = reference_decode(q, kp, vp, lens, block_table=table)
ref = ref[0] if isinstance(ref, tuple) else ref
err = (torch.linalg.vector_norm(out.float() - ref.float()) / torch.linalg.vector_norm(ref.float())).item()
loaded = list({id(k): k.spec.to_dict() for k in runtime._kernels.values() if k.spec.family == "decode"}.values())
print("RESULT " + json.dumps({"loaded": loaded, "finite": bool(torch.isfinite(out).all()), "rel_l2": err}))
"""


def _decode_use(cache_dir, capacity, **extra) -> dict:
    p = subprocess.run([sys.executable, "-c", _DECODE_SCRIPT, str(capacity)], cwd=ROOT,
                       env=_env(cache_dir, **extra), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert r["finite"] and r["rel_l2"] < 2e-2, r
    return r


def test_tune_decode_stores_a_winner_that_decode_uses(cache_dir):
    from attngen import DecodeSpec

    spec = "decode:head_dim=128,dtype=bf16,paged=true"
    p = subprocess.run([sys.executable, "-m", "attngen", "tune", "decode", spec, "--seqlen", "1024,8k",
                        "--batch", "4", "--max-candidates", "3", "--json"], cwd=ROOT, env=_env(cache_dir),
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["ok"] and [r["seqlen"] for r in out["results"]] == [1024, 8192]
    for r in out["results"]:
        assert r["unit"] == "GB/s" and r["block_size"] == 64 and r["q_len"] == 1
        assert all(row["status"] == "ok" for row in r["rows"]), r["rows"]
        assert r["winner"]["ms"] == min(row["ms"] for row in r["rows"])
    winners = {r["seqlen"]: r["winner"]["tuning"] for r in out["results"]}

    def tuning(d):
        return {k: d[k] for k in DecodeSpec.TUNING_FIELDS}

    for capacity, size in ((1024, 1024), (8192, 8192)):
        used = _decode_use(cache_dir, capacity)["loaded"]
        assert [tuning(s) for s in used] == [winners[size]], (capacity, used)
    default = _decode_use(cache_dir, 8192, ATTNGEN_NO_TUNED="1")["loaded"]
    assert [tuning(s) for s in default] == [out["results"][1]["rows"][0]["tuning"]]
