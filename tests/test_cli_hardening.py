"""The CLI and the environment under faults (issue 57): one-line errors with rc 2 instead of tracebacks,
configuration validated loudly, unusable places found before any work, prewarm that dies with its
parent, compressed sources, and a fuzz of the CLI and the spec parser."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from attngen import AttngenError, fs
from attngen.builder import build, clear_memory
from attngen.cache import DiskCache, cache_root, lock_timeout
from attngen.cli import main
from attngen.spec import parse_spec
from cache_support import ARCH, ROOT, SPEC, child_env, other_user, populate  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def _fresh_warnings():
    fs.forget_warnings()
    yield
    fs.forget_warnings()


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert "Traceback" not in err and lines, err
    return lines[0]


def _cli(*argv, env=None, timeout=60, cache=None) -> subprocess.CompletedProcess:
    e = child_env(cache or Path("/nonexistent-attngen-root"), **(env or {}))
    return subprocess.run([sys.executable, "-m", "attngen", *argv], cwd=str(ROOT), env=e, capture_output=True,
                          text=True, timeout=timeout)


# --- 8: one-line errors, not tracebacks ------------------------------------------------------------

BIG = "1" * 5000


@pytest.mark.parametrize("argv", [
    ["inspect", f"prefill:head_dim={BIG}"],
    ["inspect", "prefill:head_dim=64", "--arch", f"sm_{BIG}"],
    ["prewarm", "--jobs", BIG, "--arch", "sm_80"],
    ["cache", "prune", "--max-size", "inf"],
    ["cache", "prune", "--max-size", "nan"],
    ["cache", "prune", "--max-size", f"{BIG}G"],
    ["cache", "prune", "--older-than", "inf"],
])
def test_bad_values_are_one_line_errors(cache_dir, capsys, argv):
    assert main(argv) == 2
    _one_line_error(capsys.readouterr().err)


def test_huge_integers_in_tuned_json_are_ignored(cache_dir, capsys):
    (cache_dir / "v1" / "tuned").mkdir(parents=True, mode=0o700)
    os.chmod(cache_dir, 0o700)
    os.chmod(cache_dir / "v1", 0o700)
    (cache_dir / "v1" / "tuned" / "sm_80.json").write_text('{"format": 1, "entries": [{"seqlen": %s}]}' % BIG)
    assert main(["tune", "ls"]) == 0
    assert main(["cache", "stats"]) == 0
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("entries", [[5], ["x"], [None], [{"key": 5}], [{"key": "a" * 64, "files": 3}]])
def test_a_malformed_bundle_manifest_is_refused_in_one_line(cache_dir, tmp_path, capsys, entries):
    path = tmp_path / "b.tar"
    with tarfile.open(path, "w") as tar:
        data = json.dumps({"format": 1, "entries": entries}).encode()
        info = tarfile.TarInfo("attngen-bundle.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert main(["cache", "import", str(path)]) in (1, 2)
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("head", [b"\x1f\x8b", b"\x1f\x8b\x08\x04" + bytes(6) + b"\x17\x40",
                                  b"\x1f\x8b\x08\x00" + bytes(6)],
                         ids=["gzip magic", "a gzip extra field longer than the file", "damaged deflate data"])
def test_a_non_bundle_is_refused_in_one_line(cache_dir, tmp_path, capsys, head):
    path = tmp_path / "junk.tar.gz"
    path.write_bytes(head + (b"abc" if len(head) > 8 and head[3] == 4 else os.urandom(200)))
    assert main(["cache", "import", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not a readable attngen bundle" in err, err
    assert "CompressionError" not in err and "ReadError" not in err


@pytest.mark.parametrize("value,argv", [("nonexistent", ["cache", "ls"]), (".foo", ["inspect", "prefill:head_dim=64"])])
def test_a_bad_families_variable_is_one_line_for_every_command(cache_dir, value, argv):
    for argv in ([argv] if value == ".foo" else [argv, ["families"]]):
        got = _cli(*argv, env={"ATTNGEN_FAMILIES": value}, cache=cache_dir)
        assert got.returncode == 2, (argv, got.stderr)
        assert "ATTNGEN_FAMILIES" in _one_line_error(got.stderr)


@pytest.mark.parametrize("value,ok", [("", 600.0), ("  ", 600.0), ("2.5", 2.5), ("0", 0.0), ("abc", None),
                                      ("nan", None), ("-1", None), ("inf", None), (BIG, None)])
def test_lock_timeout_is_validated(monkeypatch, value, ok):
    monkeypatch.setenv("ATTNGEN_LOCK_TIMEOUT", value)
    if ok is not None:
        assert lock_timeout() == ok
    else:
        with pytest.raises(AttngenError, match="ATTNGEN_LOCK_TIMEOUT"):
            lock_timeout()


def test_parse_spec_refuses_odd_values_by_name():
    for bad in ({"family": ["x"]}, {"family": {"a": 1}}, None, 5, ["prefill"], {"family": "prefill", "head_dim": [1]}):
        with pytest.raises(AttngenError) as ei:
            parse_spec(bad)
        assert "family='None'" not in str(ei.value)
    with pytest.raises(AttngenError, match="spec"):
        parse_spec(None)


def test_bench_without_arguments_prints_usage_on_stderr_and_fails(capsys):
    assert main(["bench"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "usage" in out.err


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_root() == tmp_path / ".cache" / "attngen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "attngen"


def test_a_negative_age_is_named(cache_dir, capsys):
    assert main(["cache", "prune", "--older-than", "-5d"]) == 2
    err = capsys.readouterr().err
    assert "expected one argument" not in err and "-5d" in err


# --- 9: unusable places, found early ------------------------------------------------------------

def test_compiles_work_with_an_unwritable_home(tmp_path):
    (tmp_path / "file").write_text("x")
    code = "from attngen.builder import build; from attngen import PrefillSpec; print(build(PrefillSpec(head_dim=64), 'sm_80').origin)"
    env = child_env(tmp_path / "cache", HOME=str(tmp_path / "file" / "home"))
    env.pop("CUPY_CACHE_DIR", None)
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "compiled", got.stderr


@pytest.mark.parametrize("kind", ["file", "world-writable", "read-only", "foreign"])
def test_prewarm_on_an_unusable_root_exits_2_before_compiling(tmp_path, request, kind):
    root = tmp_path / "root"
    if kind == "file":
        root.write_text("x")
    else:
        root.mkdir(mode=0o700)
        os.chmod(root, 0o777 if kind == "world-writable" else 0o500 if kind == "read-only" else 0o700)
        if kind == "foreign":
            os.chown(root, *request.getfixturevalue("other_user"))
    env = {}
    if kind == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes a 0500 folder anyway")
    t0 = time.monotonic()
    got = _cli("prewarm", "--arch", "sm_80", "--jobs", "1", cache=root, env=env)
    assert got.returncode == 2 and str(root) in _one_line_error(got.stderr)
    assert "compiled" not in got.stderr and time.monotonic() - t0 < 20


@pytest.mark.parametrize("argv", [["cache", "ls"], ["cache", "stats"], ["cache", "verify"], ["cache", "clear"]])
def test_cache_commands_on_a_refused_root_say_so(tmp_path, capsys, monkeypatch, argv):
    root = tmp_path / "root"
    root.write_text("x")
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(root))
    assert main(argv) == 2
    err = _one_line_error(capsys.readouterr().err)
    assert str(root) in err and "not a folder" in err


def test_bad_log_level_is_refused(monkeypatch, cache_dir):
    monkeypatch.setenv("ATTNGEN_LOG", "verbose")
    with pytest.raises(AttngenError, match="ATTNGEN_LOG.*debug"):
        build(SPEC, ARCH)


def test_missing_or_odd_layers_are_warned_about(cache_dir, tmp_path, monkeypatch, caplog):
    from attngen.cache_env import cache_layers

    (tmp_path / "afile").write_text("x")
    (tmp_path / "good").mkdir()
    monkeypatch.setenv("ATTNGEN_CACHE_LAYERS", os.pathsep.join([str(tmp_path / "missing"), str(tmp_path / "afile"),
                                                                str(tmp_path / "good")]))
    with caplog.at_level(logging.WARNING, logger="attngen"):
        assert cache_layers() == [tmp_path / "good"]  # read on every miss
    msgs = " ".join(r.getMessage() for r in caplog.records)
    assert "ATTNGEN_CACHE_LAYERS" in msgs and str(tmp_path / "missing") in msgs and str(tmp_path / "afile") in msgs


# --- 10: the smaller voices --------------------------------------------------------------------

def test_root_warnings_carry_the_prefix_and_a_file_root_gets_fitting_advice(tmp_path):
    root = tmp_path / "root"
    root.write_text("x")
    got = _cli("inspect", "prefill:head_dim=64", "--arch", "sm_80", "--resources", cache=root)
    assert got.returncode == 0, got.stderr
    warn = [ln for ln in got.stderr.splitlines() if str(root) in ln]
    assert warn and warn[0].startswith("attngen: warning:"), got.stderr
    assert "owner and mode" not in got.stderr and "chmod" not in got.stderr


def test_bench_jit_without_a_gpu_is_prefixed(capsys):
    rc = main(["bench", "jit"])
    err = capsys.readouterr().err
    if rc == 0:
        pytest.skip("a GPU is present")
    assert rc == 2 and err.startswith("attngen: error:"), err


def test_export_names_a_damaged_entry_it_skips(golden, cache_dir, tmp_path, capsys):
    root, results = golden
    populate(golden, cache_dir)
    (DiskCache().entry_path(results["sm_86"].key) / "kernel.cubin").write_bytes(b"junk")
    assert main(["cache", "export", str(tmp_path / "b.tar")]) == 0
    err = capsys.readouterr().err
    assert results["sm_86"].key in err and err.startswith("attngen: warning:")


def test_sources_are_stored_compressed_and_old_plain_ones_still_read(cache_dir):
    r = build(SPEC, ARCH)
    disk = DiskCache()
    stored = (disk.entry_path(r.key) / "kernel.cu").read_bytes()
    assert len(stored) * 3 < len(r.source.encode())
    assert disk.source(r.key) == r.source
    (disk.entry_path(r.key) / "kernel.cu").write_text(r.source)  # an entry written before compression
    assert disk.source(r.key) == r.source
    clear_memory()
    assert build(SPEC, ARCH).origin == "disk"
    (disk.entry_path(r.key) / "kernel.cu").write_bytes(b"\x1f\x8b" + b"broken")
    assert disk.source(r.key) is None


# --- fuzz: the CLI and the spec parser -----------------------------------------------------------

_WORDS = ["prefill", "decode", "mla_decode", "family", "head_dim", "dtype", "mask", "causal", "bf16", "fp16", "64", "128",
          "-1", "0", "1e9", BIG[:40], "nan", "inf", "", "=", ":", ",", "sm_80", "sm_90a", "sm_", "..", "/",
          "\x00", "\u00e9", "true", "none", "window", "auto", "cta_tile_q", "num_stages", "[", "{", "'", " "]


def _fuzz_spec(rng: random.Random) -> "str | dict":
    if rng.random() < 0.3:
        d = {}
        for _ in range(rng.randint(0, 4)):
            d[rng.choice(_WORDS)] = rng.choice([rng.choice(_WORDS), rng.randint(-10**6, 10**6), None, [1], {"a": 1},
                                                True, 1.5, float("nan")])
        return d
    parts = [rng.choice(_WORDS) for _ in range(rng.randint(0, 8))]
    return "".join(parts) if rng.random() < 0.5 else (rng.choice(["prefill", "decode", "mla_decode", "x"]) + ":" +
                                                       ",".join(f"{rng.choice(_WORDS)}={rng.choice(_WORDS)}"
                                                                for _ in range(rng.randint(0, 4))))


def test_fuzz_the_spec_parser_finds_no_traceback():
    rng = random.Random(57)
    for i in range(3000):
        s = _fuzz_spec(rng)
        try:
            parse_spec(s)
        except AttngenError:
            pass
        except Exception as e:  # anything else is a crash a user would see as a traceback
            raise AssertionError(f"case {i}: parse_spec({s!r}) raised {type(e).__name__}: {e}")


_CMDS = [["cache", "ls"], ["cache", "stats"], ["cache", "verify"], ["cache", "prune"], ["cache", "import"],
         ["cache", "export"], ["cache", "clear"], ["inspect"], ["tune", "prefill"], ["tune", "decode"], ["tune", "ls"],
         ["families"], ["prewarm"], ["bench"], ["bench", "prefill"], ["bench", "decode"], []]
_OPTS = ["--json", "--arch", "--max-size", "--older-than", "--tuned", "--key", "--source", "--seqlen", "--dry-run",
         "--jobs", "--manifest", "--verify", "--help", "-q", "--batch", "--heads", "--max-candidates", "--version"]


def test_fuzz_the_cli_finds_no_traceback(cache_dir, capsys, tmp_path, monkeypatch):
    # In-process and cheap: only arguments, never a compile (prewarm and --resources/--ptx are refused
    # or pointed at a manifest that does not exist before any work).
    monkeypatch.chdir(tmp_path)  # an export writes where it is told
    rng = random.Random(5757)
    count = 0
    for i in range(1000):
        argv = list(rng.choice(_CMDS))
        for _ in range(rng.randint(0, 5)):
            argv.append(rng.choice(_OPTS) if rng.random() < 0.5 else str(_fuzz_spec(rng)) if rng.random() < 0.5
                        else rng.choice(_WORDS + [str(tmp_path / "nope.tar"), "500M", "-5d", "12h"]))
        if argv[:1] == ["prewarm"]:
            argv += ["--manifest", str(tmp_path / "missing.toml")]
        if argv[:1] == ["inspect"]:
            argv = [a for a in argv if a not in ("--resources", "--ptx")]
        if argv[:2] == ["tune", "prefill"] or argv[:2] == ["tune", "decode"]:
            argv += ["--dry-run", "--arch", "sm_80", "--max-candidates", "1"]
        if argv[:1] == ["bench"]:
            argv.append("--help")
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
        except Exception as e:
            raise AssertionError(f"case {i}: attngen {argv!r} raised {type(e).__name__}: {e}")
        out = capsys.readouterr()
        assert "Traceback" not in out.err and "internal error" not in out.err, (argv, out.err)
        assert isinstance(rc, int), (argv, rc)
        count += 1
    assert count == 1000
