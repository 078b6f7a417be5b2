"""The ``attngen`` command, run in-process through ``main([...])`` and once or twice as a real process.

CPU only: compiles go through NVRTC (a few tiny manifests), nothing is loaded on a GPU.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from attngen import builder, cache
from attngen.cli import Progress, main
from attngen.errors import CompileError
from attngen.spec import parse_spec, resolve

ROOT = Path(__file__).resolve().parent.parent
HEX64 = re.compile(r"\b[0-9a-f]{64}\b")
SPEC = "prefill:head_dim=64,dtype=bf16,mask=causal"


def run_module(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "attngen", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def run_json(capsys, *args: str) -> tuple[int, dict]:
    rc = main([*args, "--json"])
    out = capsys.readouterr().out
    return rc, json.loads(out)


@pytest.fixture
def tiny_manifest(tmp_path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(textwrap.dedent("""
        archs = ["sm_80", "sm_90"]
        [[kernel]]
        family = "prefill"
        head_dim = [64, 128]
        dtype = "bf16"
        mask = "none"
    """))
    return p


def one_kernel_manifest(tmp_path: Path, head_dims=(64,)) -> Path:
    p = tmp_path / "one.toml"
    p.write_text(f'archs = ["sm_80"]\n[[kernel]]\nfamily = "prefill"\nhead_dim = {list(head_dims)}\n')
    return p


# --- prewarm -----------------------------------------------------------------------------------

def test_prewarm_compiles_in_worker_processes_then_everything_is_a_hit(cache_dir, tiny_manifest, capsys):
    # A real process with a pool of 2: proves the exit code and that workers use ATTNGEN_CACHE_DIR.
    p = run_module("prewarm", "--manifest", str(tiny_manifest), "--jobs", "2", "--json")
    assert p.returncode == 0, p.stderr
    first = json.loads(p.stdout)
    assert (first["total"], first["compiled"], first["cache_hits"], first["failed"]) == (4, 4, 0, 0)
    assert first["ok"] is True and first["jobs"] == 2 and first["archs"] == ["sm_80", "sm_90"]
    assert first["cache_root"] == str(cache_dir)
    assert "[4/4]" in p.stderr  # progress, plain lines when stderr is not a terminal
    for item in first["items"]:
        assert HEX64.fullmatch(item["key"]) and item["error"] is None
        assert item["registers"] > 0 and item["compile_seconds"] > 0 and item["ptxas_notes"] == []
        assert (cache_dir / "v1" / item["key"][:2] / item["key"] / "kernel.cubin").is_file()

    # Second run, in-process, one job: every item comes from disk with the same keys.
    builder.clear_memory()
    rc, second = run_json(capsys, "prewarm", "--manifest", str(tiny_manifest), "--jobs", "1")
    assert rc == 0
    assert (second["compiled"], second["cache_hits"], second["failed"]) == (0, 4, 0)
    assert {i["origin"] for i in second["items"]} == {"disk"}
    assert [i["key"] for i in second["items"]] == [i["key"] for i in first["items"]]
    assert second["compile_seconds"] == 0


def test_prewarm_text_summary_and_arch_override(cache_dir, tiny_manifest, capsys):
    rc = main(["prewarm", "--manifest", str(tiny_manifest), "--arch", "sm_86", "--jobs", "1", "--quiet"])
    cap = capsys.readouterr()
    assert rc == 0
    assert "2 kernels for sm_86" in cap.out and "compiled 2, cache hits 0, failed 0" in cap.out
    assert cap.err == ""  # --quiet


def test_prewarm_exits_1_when_a_compile_fails_and_builds_the_rest(cache_dir, tmp_path, monkeypatch, capsys):
    real_build = builder.build

    def flaky_build(spec, arch, **kw):
        if spec.head_dim == 128:
            raise CompileError("NVRTC failed to compile (injected)", log="kernel.cu(7): error: boom")
        return real_build(spec, arch, **kw)

    monkeypatch.setattr(builder, "build", flaky_build)
    rc, out = run_json(capsys, "prewarm", "--manifest", str(one_kernel_manifest(tmp_path, (64, 128))),
                       "--jobs", "1")
    assert rc == 1
    assert (out["ok"], out["compiled"], out["failed"]) == (False, 1, 1)
    bad, = [i for i in out["items"] if i["error"]]
    assert bad["spec"].startswith("prefill:head_dim=128") and bad["origin"] == "failed"
    assert "injected" in bad["error"] and bad["error_type"] == "CompileError"
    rc = main(["prewarm", "--manifest", str(one_kernel_manifest(tmp_path, (128,))), "--jobs", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and "failed: prefill:head_dim=128" in err and "boom" in err


def test_prewarm_counts_a_binary_the_cache_could_not_store_as_failed(cache_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cache.DiskCache, "put", lambda self, *a, **k: False)
    rc, out = run_json(capsys, "prewarm", "--manifest", str(one_kernel_manifest(tmp_path)), "--jobs", "1")
    assert rc == 1 and out["failed"] == 1
    assert "not stored" in out["items"][0]["error"]


def test_prewarm_and_inspect_report_ptxas_notes(cache_dir, tmp_path, monkeypatch, capsys):
    # A note as ptxas writes it, added to a real build's log: the log is all that shows such a kernel
    note = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
            "stage in the function 'k' in line 0")
    real_build = builder.build

    def noted(spec, arch, **kw):
        r = real_build(spec, arch, **kw)
        return dataclasses.replace(r, binary=dataclasses.replace(r.binary, log=f"{r.binary.log}\n{note}"))

    monkeypatch.setattr(builder, "build", noted)
    manifest = str(one_kernel_manifest(tmp_path))
    rc, out = run_json(capsys, "prewarm", "--manifest", manifest, "--jobs", "1")
    assert rc == 0 and out["with_ptxas_notes"] == 1  # a note is not a failure
    assert [n.split(":")[0] for n in out["items"][0]["ptxas_notes"]] == ["C7514"]
    assert main(["prewarm", "--manifest", manifest, "--jobs", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "ptxas notes on 1 kernels" in text and "sm_80 prefill:head_dim=64" in text and "C7514" in text
    rc, js = run_json(capsys, "inspect", SPEC, "--resources")
    assert rc == 0 and js["resources"]["ptxas_notes"] == [
        "C7514: Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions "
        "reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'k' in "
        "line N"]
    assert main(["inspect", SPEC, "--resources"]) == 0
    assert re.search(r"ptxas note\s+C7514: Potential Performance Loss", capsys.readouterr().out)


def test_prewarm_manifest_errors_exit_2(cache_dir, tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('archs = ["sm_90"]\n[[kernel]]\nfamily = "prefill"\nhead_dimm = [64]\n')
    assert main(["prewarm", "--manifest", str(bad)]) == 2
    assert "head_dimm" in capsys.readouterr().err

    rc, out = run_json(capsys, "prewarm", "--manifest", str(bad))
    assert rc == 2 and out["ok"] is False and out["error"]["field"] == "head_dimm"

    assert main(["prewarm", "--manifest", str(tmp_path / "missing.toml")]) == 2
    assert "not found" in capsys.readouterr().err

    # An override that leaves nothing to build is an error, not an empty success.
    only90 = tmp_path / "only90.toml"
    only90.write_text('[[kernel]]\nfamily = "prefill"\narchs = ["sm_90"]\n')
    assert main(["prewarm", "--manifest", str(only90), "--arch", "sm_80"]) == 2
    assert "nothing to build" in capsys.readouterr().err
    assert not (cache_dir / "v1").exists()


@pytest.mark.parametrize("argv, needle", [
    (["prewarm", "--arch", "sm_75"], "sm_75"),
    (["prewarm", "--arch", ","], "arch"),
    (["prewarm", "--jobs", "0"], "positive integer"),
    (["inspect", SPEC, "--arch", "sm_70"], "sm_70"),
    (["inspect"], "SPEC"),
    (["cache"], "ACTION"),
    (["cache", "prune"], "prune"),
    ([], "COMMAND"),
    (["frobnicate"], "frobnicate"),
])
def test_usage_errors_exit_2(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_help_and_version_exit_0(capsys):
    assert main(["--help"]) == 0
    assert "prewarm" in capsys.readouterr().out
    assert main(["--version"]) == 0
    assert "attngen" in capsys.readouterr().out


# --- inspect -----------------------------------------------------------------------------------

def test_inspect_prints_the_source_with_the_kernel_name(capsys):
    assert main(["inspect", SPEC]) == 0
    src = capsys.readouterr().out
    assert resolve(parse_spec(SPEC), "sm_90a").kernel_name in src
    assert main(["inspect", SPEC, "--arch", "sm_86"]) == 0
    assert resolve(parse_spec(SPEC), "sm_86").kernel_name in capsys.readouterr().out


@pytest.mark.parametrize("text, field", [
    ("prefill:head_dimx=128", "head_dimx"),
    ("prefill:head_dim=100", "head_dim"),
    ("prefill:dtype=fp8", "dtype"),
    ("nosuch:head_dim=128", "family"),
    ("prefill:head_dim", "spec"),
])
def test_inspect_bad_spec_exits_2_naming_the_field(text, field, capsys):
    assert main(["inspect", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attngen: error: ") and f"{field}=" in err


def test_inspect_says_where_the_default_depends_on_the_size(capsys):
    # sm_90a, head_dim 64: attngen.prefill runs other tiles by query rows (BY_ROWS); inspect says so on stderr
    # and in the JSON, and shows the spec it was asked for
    assert main(["inspect", "prefill:head_dim=64,mask=causal", "--arch", "sm_90a", "--json"]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    by = out["defaults_by_size"]
    assert [b["from"] for b in by] == [0, 1024, 8192] and "cta_tile_q=192" in by[-1]["spec"]
    assert "by size (query rows)" in cap.err and "from 8192: prefill:" in cap.err
    assert main(["inspect", "prefill:head_dim=128", "--arch", "sm_90a", "--json"]) == 0
    cap = capsys.readouterr()
    by = json.loads(cap.out)["defaults_by_size"]
    assert [b["from"] for b in by] == [0, 8192] and "cta_tile_kv=192" in by[-1]["spec"]
    for text, arch in (("prefill:head_dim=128,mask=sliding_window", "sm_90a"), ("prefill:head_dim=64", "sm_80"),
                       ("prefill:head_dim=64,num_stages=2", "sm_90a"), ("decode:head_dim=128", "sm_90a")):
        assert main(["inspect", text, "--arch", arch, "--json"]) == 0
        cap = capsys.readouterr()
        assert "defaults_by_size" not in json.loads(cap.out) and "by size" not in cap.err, text


def test_inspect_spec_that_does_not_fit_the_arch_exits_2(capsys):
    text = "prefill:head_dim=256,cta_tile_q=64,num_warps=4,cta_tile_kv=128,num_stages=4"
    assert main(["inspect", text, "--arch", "sm_86"]) == 2
    assert "sm_86" in capsys.readouterr().err


def test_inspect_key_without_compiling(cache_dir, capsys):
    assert main(["inspect", SPEC, "--key"]) == 0
    out = capsys.readouterr().out
    assert HEX64.search(out) and '"templates_sha256"' in out and '"nvrtc"' in out
    rc, js = run_json(capsys, "inspect", SPEC, "--key", "--arch", "sm_80")
    assert rc == 0 and HEX64.fullmatch(js["key"]) and js["key_material"]["arch"] == "sm_80"
    assert "source" not in js
    assert not (cache_dir / "v1").exists()


def test_inspect_and_cache_ls_say_when_nvrtc_gave_no_spill_report(cache_dir, capsys, monkeypatch):
    # NVRTC leaves ptxas' report out of some logs: inspect and cache ls then show the cubin's registers and say the
    # spills are not reported, rather than 0 bytes
    import attngen.compiler as compiler

    real = compiler._run_nvrtc
    monkeypatch.setattr(compiler, "_run_nvrtc", lambda *a: (lambda c, log, p: (c, "", p))(*real(*a)))
    assert main(["inspect", SPEC, "--resources"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"registers\s+[1-9]\d* per thread", out) and "spills      not reported" in out
    rc, js = run_json(capsys, "inspect", SPEC, "--resources")
    assert rc == 0 and js["resources"]["known"] is False and js["resources"]["registers"] > 0
    rc, ls = run_json(capsys, "cache", "ls")
    entry = ls["entries"][0]
    assert entry["registers"] == js["resources"]["registers"] and entry["spill_stores"] is None
    assert main(["cache", "ls"]) == 0
    assert "?" in capsys.readouterr().out.splitlines()[1].split()[3]  # the SPILLS column


def test_inspect_resources_builds_through_the_cache_with_the_key_it_shows(cache_dir, capsys):
    assert main(["inspect", SPEC, "--resources"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"registers\s+\d+", out) and "spills" in out and "dynamic" in out
    rc, js = run_json(capsys, "inspect", SPEC, "--resources", "--key")
    assert rc == 0
    res = js["resources"]
    assert res["registers"] > 0 and res["origin"] in ("memory", "disk")
    assert res["smem_dynamic"] == resolve(parse_spec(SPEC), "sm_90a").smem_bytes()
    assert js["key"] == res["key"]  # --key predicts the key the build path uses

    # The cache commands see that entry.
    rc, ls = run_json(capsys, "cache", "ls")
    assert rc == 0 and [e["key"] for e in ls["entries"]] == [res["key"]]
    entry = ls["entries"][0]
    assert entry["valid"] and entry["arch"] == "sm_90a" and entry["registers"] == res["registers"]
    assert entry["spec"].startswith(SPEC) and entry["bytes"] > 0 and entry["created"]
    assert main(["cache", "ls"]) == 0
    text = capsys.readouterr().out
    assert res["key"][:12] in text and "sm_90" in text and "KEY" in text

    rc, st = run_json(capsys, "cache", "stats")
    assert rc == 0 and st["entries"] == 1 and st["by_arch"] == {"sm_90a": 1} and st["root"] == str(cache_dir)
    assert main(["cache", "stats"]) == 0
    assert "entries" in capsys.readouterr().out

    rc, cl = run_json(capsys, "cache", "clear")
    assert rc == 0 and cl["removed"] == 1
    rc, st = run_json(capsys, "cache", "stats")
    assert st["entries"] == 0
    assert main(["cache", "ls"]) == 0
    assert "no entries" in capsys.readouterr().err
    assert main(["cache", "clear"]) == 0
    assert "removed 0" in capsys.readouterr().out


def test_cache_ls_lists_damaged_entries_as_invalid(cache_dir, capsys):
    for key, meta in (("ab" + "0" * 62, "[1, 2]"), ("cd" + "1" * 62, "{not json")):
        d = cache_dir / "v1" / key[:2] / key
        d.mkdir(parents=True)
        (d / "meta.json").write_text(meta)
    rc, ls = run_json(capsys, "cache", "ls")
    assert rc == 0 and len(ls["entries"]) == 2 and not any(e["valid"] for e in ls["entries"])
    assert main(["cache", "ls"]) == 0
    assert capsys.readouterr().out.count("[invalid]") == 2
    rc, cl = run_json(capsys, "cache", "clear")
    assert rc == 0 and cl["removed"] == 2


def test_inspect_ptx(capsys):
    assert main(["inspect", SPEC, "--ptx", "--arch", "sm_80"]) == 0
    ptx = capsys.readouterr().out
    name = resolve(parse_spec(SPEC), "sm_80").kernel_name
    assert f".entry {name}" in ptx and ".target sm_80" in ptx


def test_cache_commands_read_the_environment_at_call_time(tmp_path, monkeypatch, capsys):
    for d in ("a", "b"):
        monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / d))
        rc, st = run_json(capsys, "cache", "stats")
        assert rc == 0 and st["root"] == str(tmp_path / d) and st["entries"] == 0


# --- progress and bench ------------------------------------------------------------------------

class _Tty(io.StringIO):
    def isatty(self):
        return True


def _item(i, error=None):
    return {"index": i, "spec": "prefill:head_dim=64", "arch": "sm_90", "origin": "compiled",
            "error": error, "seconds": 0.5}


def test_progress_rewrites_one_line_on_a_terminal():
    s = _Tty()
    p = Progress(2, s)
    p.update(_item(0))
    p.update(_item(1, error="x"))
    p.close()
    out = s.getvalue()
    assert out.count("\r") == 2 and "\r[1/2]" in out and "[2/2]" in out and "1 failed" in out
    assert out.endswith("\n") and out.count("\n") == 1


def test_progress_writes_plain_lines_elsewhere_and_nothing_when_disabled():
    s = io.StringIO()
    p = Progress(2, s)
    p.update(_item(0))
    p.update(_item(1, error="x"))
    p.close()
    lines = s.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[1/2] compiled") and "FAILED" in lines[1]
    assert "\r" not in s.getvalue()
    q = io.StringIO()
    p = Progress(1, q, enabled=False)
    p.update(_item(0))
    p.close()
    assert q.getvalue() == ""


def test_bench_passes_its_arguments_through(monkeypatch):
    seen = []
    fake = types.ModuleType("attngen.bench")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "attngen.bench", fake)
    assert main(["bench", "--help", "-x", "1"]) == 3
    assert seen == [["--help", "-x", "1"]]


def test_bench_missing_module_fails_clearly(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "attngen.bench", None)  # as if the module were not installed
    assert main(["bench"]) == 2
    assert "attngen.bench" in capsys.readouterr().err


# --- a real process ----------------------------------------------------------------------------

def test_module_entry_point_exit_codes(cache_dir):
    p = run_module("inspect", "prefill:head_dimx=128")
    assert p.returncode == 2 and "head_dimx" in p.stderr and p.stdout == ""
    p = run_module("inspect", SPEC, "--key", "--json")
    assert p.returncode == 0 and HEX64.fullmatch(json.loads(p.stdout)["key"])
    p = run_module("prewarm", "--arch", "sm_75")
    assert p.returncode == 2 and "sm_75" in p.stderr


# --- one CLI voice ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["sm_90a", "sm90a", "90a", "SM_90A", "compute_90a"])
def test_arch_spellings_agree(text):
    from attngen.arch import get_arch

    assert get_arch(text).name == "sm_90a"
    assert get_arch("9.0").name == "sm_90" and get_arch("86").name == "sm_86"


def test_an_unknown_field_suggests_the_nearest(capsys):
    assert main(["inspect", "prefill:head_dimm=128", "--key"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attngen: error: head_dimm='128' is not allowed") and "did you mean head_dim?" in err


def test_a_closed_stdout_ends_quietly():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "attngen", "families"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()  # the reader is gone before the first line is written
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141
    assert err == "", err


def test_bench_without_torch_says_how_to_install_and_json_stays_json(capsys):
    pytest.importorskip("attngen.bench")
    try:
        import torch  # noqa: F401
        pytest.skip("torch is installed here")
    except ImportError:
        pass
    assert main(["bench", "prefill", "--quick", "--json"]) == 2
    cap = capsys.readouterr()
    assert json.loads(cap.out) == {"ok": False, "exit": 2}
    assert cap.err.startswith("attngen: error: attngen bench prefill needs torch") and \
        "python3 -m pip install torch" in cap.err


# --- every error path: one line, non-zero, no traceback ---------------------------------------------

BAD_ARGS = [
    ["nosuch"],
    ["prewarm", "--arch", "sm_70"],
    ["prewarm", "--jobs", "0"],
    ["prewarm", "--manifest", "/nonexistent.toml"],
    ["inspect"],
    ["inspect", "prefill:head_dim=100"],
    ["inspect", "nosuch:head_dim=64"],
    ["inspect", "prefill:head_dim=64", "--arch", "sm_90x"],
    ["inspect", "prefill:head_dimm=64"],
    ["cache"],
    ["cache", "nosuch"],
    ["cache", "import", "/nonexistent.tar"],
    ["cache", "prune"],
    ["cache", "prune", "--max-size", "lots"],
    ["tune"],
    ["tune", "prefill", "prefill:head_dim=64"],
    ["tune", "decode", "prefill:head_dim=64", "--seqlen", "1k", "--dry-run", "--arch", "sm_90"],
    ["tune", "prefill", "prefill:head_dim=64", "--seqlen", "-3"],
    ["families", "--bogus"],
    ["bench", "nosuch"],
    ["bench", "prefill", "--seqlens", "x"],
]


@pytest.mark.parametrize("argv", BAD_ARGS, ids=[" ".join(a) for a in BAD_ARGS])
def test_every_bad_request_is_one_error_line_and_no_traceback(argv, cache_dir):
    p = subprocess.run([sys.executable, "-m", "attngen", *argv], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    errors = [ln for ln in p.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, p.stderr
    assert errors[0].startswith(("attngen: error: ", "attngen bench: error: ", "usage: ")) or \
        errors[0].split(": error: ")[0].startswith("attngen"), p.stderr
