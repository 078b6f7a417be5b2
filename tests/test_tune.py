"""Tuned configurations without a GPU: the store, the choice prefill makes from it, and ``attngen tune``'s CLI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attngen import __version__, builder, cache
from attngen.arch import get_arch
from attngen.cli import main
from attngen.errors import CacheError
from attngen import tuned
from attngen.families.prefill import tuning as prefill_tuning
from attngen.spec import resolve, tuning_candidates
from attngen import PrefillSpec
from attngen import tune
from conftest import gpu_count

ROOT = Path(__file__).resolve().parent.parent
SPEC = "prefill:head_dim=64,dtype=bf16"
FIELDS = {"head_dim": 64, "dtype": "bf16", "mask": "none", "return_lse": False, "softcap": False, "alibi": False,
          "custom_mask": False, "varlen": False, "paged": False, "head_dim_v": 0}
IDENT = {"arch": "sm_90", "gpu": "NVIDIA H200", "nvrtc": "13.0", "attngen": __version__}
CFG_A = {"cta_tile_q": 64, "cta_tile_kv": 32, "num_warps": 4, "num_stages": 2, "mma": "mma_sync"}
CFG_B = {"cta_tile_q": 128, "cta_tile_kv": 32, "num_warps": 8, "num_stages": 1, "mma": "mma_sync"}


def entry(seqlen=512, tuning=CFG_A, fields=FIELDS, **over) -> dict:
    e = {"family": "prefill", "fields": dict(fields), **IDENT, "seqlen": seqlen, "tuning": dict(tuning), "ms": 0.1}
    e.update(over)
    return e


def base(**kw) -> PrefillSpec:
    return PrefillSpec(**{**FIELDS, **kw})


def choices(entries, **ident):
    i = {**IDENT, **ident}
    return tuned.tuned_choices(base(), get_arch(i["arch"]), i["gpu"], entries, nvrtc=i["nvrtc"], version=i["attngen"])


# --- the store ------------------------------------------------------------------------------------

def test_store_round_trip(cache_dir):
    store = tuned.TunedStore()
    assert store.read(get_arch("sm_90")) == [] and store.entries() == []
    path = store.put(entry(512))
    assert path == cache_dir / "v1" / "tuned" / "sm_90.json"
    store.put(entry(4096, CFG_B))
    got = store.read(get_arch("sm_90"))
    assert sorted(e["seqlen"] for e in got) == [512, 4096]
    assert next(e for e in got if e["seqlen"] == 4096)["tuning"] == CFG_B
    assert json.loads(path.read_text())["format"] == tuned.TUNED_FORMAT
    # Same key and seqlen: replaced, not duplicated.
    store.put(entry(512, CFG_B))
    got = store.read(get_arch("sm_90"))
    assert len(got) == 2 and all(e["tuning"] == CFG_B for e in got)
    # Another arch is another file.
    store.put(entry(512, arch="sm_80"))
    assert len(store.read(get_arch("sm_80"))) == 1 and len(store.entries()) == 3
    assert not list(path.parent.glob("*.tmp")), "temporary files left behind"


def test_tuned_entries_read_once_per_process_and_updated_by_put(cache_dir):
    store = tuned.TunedStore()
    store.put(entry(512))
    builder.clear_memory()
    first = tuned.tuned_entries(get_arch("sm_90"))
    assert len(first) == 1
    store.path(get_arch("sm_90")).write_text("{}")  # another process rewrites the file: this one keeps its copy
    assert tuned.tuned_entries(get_arch("sm_90")) == first
    store.put(entry(1024))  # a put re-reads the file under its lock and refreshes this process's copy
    assert [e["seqlen"] for e in tuned.tuned_entries(get_arch("sm_90"))] == [1024]
    builder.clear_memory()
    assert [e["seqlen"] for e in tuned.tuned_entries(get_arch("sm_90"))] == [1024]


@pytest.mark.parametrize("content", [b"", b"{not json", b"[]", b'"x"', b'{"format": 99, "entries": []}',
                                     b'{"format": 1, "entries": {}}', b"\xff\xfe\x00garbage"])
def test_corrupt_file_reads_as_empty_and_is_replaced_by_put(cache_dir, content):
    store = tuned.TunedStore()
    p = store.path(get_arch("sm_90"))
    p.parent.mkdir(parents=True)
    p.write_bytes(content)
    assert store.read(get_arch("sm_90")) == [] and store.entries() == []
    builder.clear_memory()
    assert tuned.tuned_entries(get_arch("sm_90")) == []
    assert choices(tuned.tuned_entries(get_arch("sm_90"))) == []
    store.put(entry(512))
    assert [e["seqlen"] for e in store.read(get_arch("sm_90"))] == [512]


def test_malformed_entries_are_skipped_alone(cache_dir):
    store = tuned.TunedStore()
    good = entry(512)
    bad = [1, "x", {"family": "prefill"}, entry(0), entry(-5), entry(True), {**entry(700), "tuning": "fast"},
           {**entry(800), "fields": None}, {**entry(900), "gpu": 3}]
    p = store.path(get_arch("sm_90"))
    p.parent.mkdir(parents=True)
    p.write_text(json.dumps({"format": 1, "entries": [*bad, good]}))
    assert store.read(get_arch("sm_90")) == [good]
    with pytest.raises(CacheError, match="not a tuned entry"):
        store.put(entry(0))


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(cache_dir, monkeypatch):
    store = tuned.TunedStore()
    store.put(entry(512))
    before = store.path(get_arch("sm_90")).read_bytes()

    def boom(path, data):
        Path(path).write_bytes(data[: len(data) // 2])  # a crash halfway through the temp file
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuned.fs, "write_private", boom)
    with pytest.raises(CacheError, match="could not store the tuned configuration"):
        store.put(entry(1024))
    assert store.path(get_arch("sm_90")).read_bytes() == before
    assert not [f for f in store.base.iterdir() if f.name != "sm_90.json"]


def test_read_only_root_raises_cache_error(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(CacheError):
            tuned.TunedStore(ro).put(entry(512))
        assert tuned.TunedStore(ro).entries() == []
    finally:
        ro.chmod(0o755)


_PUT_SCRIPT = """
import sys
from attngen import tuned
e = {"family": "prefill", "fields": %r, "arch": "sm_90", "gpu": "g", "nvrtc": "13.0", "attngen": "x",
     "tuning": %r}
for i in range(int(sys.argv[2])):
    tuned.TunedStore(sys.argv[1]).put({**e, "seqlen": int(sys.argv[3]) * 1000 + i + 1})
""" % (FIELDS, CFG_A)


def test_concurrent_processes_lose_no_entry(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", _PUT_SCRIPT, str(tmp_path), "10", str(w)], env=env)
             for w in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    got = tuned.TunedStore(tmp_path).read(get_arch("sm_90"))
    assert sorted(e["seqlen"] for e in got) == sorted(w * 1000 + i + 1 for w in range(4) for i in range(10))


# --- the choice prefill makes ---------------------------------------------------------------------

def test_key_separation():
    entries = [entry(512)]
    assert [s for s, _ in choices(entries)] == [512]
    for field, other in [("arch", "sm_80"), ("gpu", "NVIDIA H100 80GB HBM3"), ("nvrtc", "13.5"),
                         ("attngen", "0.0.0")]:
        assert choices(entries, **{field: other}) == [], field
    for field, other in [("head_dim", 128), ("dtype", "fp16"), ("mask", "causal"), ("return_lse", True)]:
        b = base(**{field: other})
        assert tuned.tuned_choices(b, get_arch("sm_90"), IDENT["gpu"], entries, nvrtc=IDENT["nvrtc"]) == [], field
    fam = dict(entry(512), family="decode")
    assert choices([fam]) == []


def test_entries_stored_before_a_field_existed_still_apply():
    # head_dim_v and head_dim_chunk came later: an entry without them was measured with their defaults
    old_fields = {k: v for k, v in FIELDS.items() if k != "head_dim_v"}
    assert [s for s, _ in choices([entry(512, CFG_A, fields=old_fields)])] == [512]
    # ... but not for a spec whose new field is not the default
    b = base(head_dim=192, head_dim_v=128)
    old = entry(512, CFG_A, fields=dict(old_fields, head_dim=192))
    assert tuned.tuned_choices(b, get_arch("sm_90"), IDENT["gpu"], [old], nvrtc=IDENT["nvrtc"]) == []


def test_tuned_choices_give_specs_sorted_by_seqlen_and_skip_invalid_tunings():
    entries = [entry(4096, CFG_B), entry(512, CFG_A),
               entry(1024, {"cta_tile_q": 96, "cta_tile_kv": 32, "num_warps": 4, "num_stages": 2}),  # no such tile
               entry(2048, {"cta_tile_q": 64, "cta_tile_kv": 32, "num_warps": 8, "num_stages": 2}),  # warps vs tile
               entry(8192, {"cta_tile_q": 128}),  # incomplete
               entry(16384, {**CFG_A, "num_stages": 0})]  # unresolved
    got = choices(entries)
    assert got == [(512, base(**CFG_A)), (4096, base(**CFG_B))]
    # What does not fit the arch is skipped too: 128x128 tiles with 4 stages need > 99 KiB (sm_86).
    big = {"cta_tile_q": 128, "cta_tile_kv": 128, "num_warps": 8, "num_stages": 4, "mma": "mma_sync"}
    assert choices([entry(512, big, arch="sm_86")], arch="sm_86") == []
    assert choices([entry(512, big)]) != []


@pytest.mark.parametrize("seqlen,want", [(1, 512), (100, 512), (512, 512), (1448, 512), (1449, 4096),
                                         (4096, 4096), (10 ** 6, 4096)])
def test_nearest_bucket_by_log_distance(seqlen, want):
    assert math.sqrt(512 * 4096) == pytest.approx(1448.15, abs=0.01)
    ch = [(512, base(**CFG_A)), (4096, base(**CFG_B))]
    assert tuned.choose_spec(base(), get_arch("sm_90"), seqlen, ch) == dict(ch)[want]


def test_three_buckets_and_no_bucket():
    ch = [(256, base(**CFG_A)), (1024, base(**CFG_B)), (8192, base(**{**CFG_A, "num_stages": 3}))]
    assert [tuned.choose_spec(base(), get_arch("sm_90"), s, ch) for s in (300, 511, 513, 2895, 2897)] == [
        ch[0][1], ch[0][1], ch[1][1], ch[1][1], ch[2][1]]
    assert tuned.choose_spec(base(), get_arch("sm_90"), 512, []) == resolve(base(), "sm_90")
    assert tuned.bucket_bounds([512]) == []


def test_tuned_disabled_by_environment(monkeypatch):
    monkeypatch.delenv("ATTNGEN_NO_TUNED", raising=False)
    assert not tuned.tuned_disabled()
    for v, off in [("1", True), ("yes", True), ("true", True), ("0", False), ("", False), ("no", False)]:
        monkeypatch.setenv("ATTNGEN_NO_TUNED", v)
        assert tuned.tuned_disabled() is off, v


def test_store_winner_writes_what_prefill_reads(cache_dir):
    spec = PrefillSpec(head_dim=64, dtype="bf16", mask="causal", return_lse=True)
    row = tune.Row(spec.replace(**CFG_B), ms=0.5, rate=100.0, status="ok")
    result = {"batch": 32, "heads": 32, "window": [-1, -1], "candidates": 3, "default_ms": 0.6}
    tune.store_winner(spec, 512, row, IDENT, result)
    got = tuned.TunedStore().read(get_arch("sm_90"))
    assert len(got) == 1 and got[0]["fields"] == {"head_dim": 64, "dtype": "bf16", "mask": "causal", "return_lse": True,
                                                     "softcap": False, "alibi": False, "sinks": False,
                                                     "custom_mask": False, "varlen": False, "paged": False,
                                                     "head_dim_v": 0}
    ch = tuned.tuned_choices(spec, get_arch("sm_90"), IDENT["gpu"], got, nvrtc=IDENT["nvrtc"])
    assert ch == [(512, spec.replace(**CFG_B))]


# --- the search's pure parts ----------------------------------------------------------------------

def test_plan_puts_the_default_first_and_respects_pins_and_the_cap():
    spec = PrefillSpec(head_dim=64, dtype="bf16")
    full = tune.plan(spec, get_arch("sm_90"))
    assert full[0] == resolve(spec, "sm_90") and len(set(full)) == len(full) > 10
    assert all(s.is_resolved for s in full)
    assert tune.plan(spec, get_arch("sm_90"), 3) == full[:3]
    pinned = tune.plan(PrefillSpec(head_dim=64, num_warps=8, num_stages=2), get_arch("sm_90"))
    assert pinned and all(s.num_warps == 8 and s.num_stages == 2 for s in pinned)
    assert len(tune.plan(PrefillSpec(head_dim=256), get_arch("sm_86"))) < len(tune.plan(PrefillSpec(head_dim=256), get_arch("sm_90")))
    assert tuning_candidates(spec, "sm_90") == full


def test_plan_at_a_size_puts_the_default_for_that_size_first():
    # sm_90a, head_dim 64: attngen.prefill's built-in default depends on the query rows (BY_ROWS); a search at a
    # size compares against what the op would run there
    from attngen.families.prefill.choose import by_rows

    for mask, size, rows_first in (("none", 512, 128), ("none", 4096, 192), ("causal", 512, 64), ("causal", 4096, 128),
                                   ("causal", 20000, 192)):
        spec = PrefillSpec(head_dim=64, dtype="bf16", mask=mask)
        at = tune.plan(spec, get_arch("sm_90a"), size=size)
        assert at[0].cta_tile_q == rows_first and sorted(map(str, at)) == sorted(map(str, tune.plan(spec, get_arch("sm_90a"))))
        assert at[0] in by_rows(resolve(spec, "sm_90a"), "sm_90a")[1]
    # elsewhere, or with a tuning field pinned, the size changes nothing
    assert tune.plan(PrefillSpec(head_dim=64), get_arch("sm_90"), size=4096) == tune.plan(PrefillSpec(head_dim=64), get_arch("sm_90"))
    pinned = PrefillSpec(head_dim=64, num_stages=2)
    assert tune.plan(pinned, get_arch("sm_90a"), size=4096) == tune.plan(pinned, get_arch("sm_90a"))


def test_problem_size_and_flops():
    spec = PrefillSpec(head_dim=128)
    assert tune.problem_size(spec, 512) == (32, 16)
    assert tune.problem_size(spec, 65536) == (1, 16)
    assert tune.problem_size(spec, 512, batch=3, heads=5) == (3, 5)
    for sq, sk, causal, left, right in [(7, 7, False, -1, -1), (7, 7, True, -1, -1), (5, 9, True, 2, -1),
                                        (9, 5, False, 1, 1), (6, 6, False, 0, 0)]:
        brute = sum(1 for i in range(sq) for j in range(sk)
                    if (right < 0 and not causal or j <= i + sk - sq + (0 if causal else right))
                    and (left < 0 or j >= i + sk - sq - left))
        assert prefill_tuning.visible_pairs(sq, sk, causal, left, right) == brute
    assert prefill_tuning.flops(PrefillSpec(head_dim=64, mask="causal"), 2, 3, 100, (-1, -1)) == 4 * 2 * 3 * 100 * 100 * 64 / 2


# --- the CLI --------------------------------------------------------------------------------------

def run_json(capsys, *args):
    rc = main([*args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_cli_dry_run_lists_candidates(capsys, cache_dir):
    rc, out = run_json(capsys, "tune", "prefill", SPEC, "--seqlen", "512,1k", "--seqlen", "4096",
                       "--dry-run", "--arch", "sm_90")
    assert rc == 0 and out["dry_run"] and out["arch"] == "sm_90"
    assert [p["seqlen"] for p in out["problems"]] == [512, 1024, 4096]
    assert [p["batch"] for p in out["problems"]] == [32, 16, 4]
    cands = out["candidates"]
    full = tune.plan(PrefillSpec(head_dim=64, dtype="bf16"), get_arch("sm_90"))
    assert [c["spec"] for c in cands] == [s.to_text(full=True) for s in full]
    assert cands[0]["default"] and cands[0]["status"] == "planned"
    assert not cache.DiskCache().entries(), "a dry run without --compile compiled something"
    rc = main(["tune", "prefill", SPEC, "--seqlen", "512", "--dry-run", "--arch", "sm_90", "--max-candidates", "2"])
    text = capsys.readouterr().out
    assert rc == 0 and "2 candidates" in text and "q128 kv64 w4 s3" in text


def test_cli_dry_run_compile_shows_resources(capsys, cache_dir):
    rc, out = run_json(capsys, "tune", "prefill", SPEC, "--seqlen", "512", "--dry-run", "--arch", "sm_90",
                       "--compile", "--max-candidates", "2")
    assert rc == 0 and len(out["candidates"]) == 2
    for c in out["candidates"]:
        assert c["status"] == "compiled" and c["registers"] > 0 and c["smem"] > 0 and c["origin"] == "compiled"
    assert len(cache.DiskCache().entries()) == 2


@pytest.mark.parametrize("argv,needle", [
    (["--seqlen", "0"], "--seqlen"),
    (["--seqlen", "abc"], "--seqlen"),
    (["--seqlen", "512", "--batch", "0"], "--batch"),
    (["--seqlen", "512", "--window", "5"], "--window"),
    (["--seqlen", "512", "--arch", "sm_70", "--dry-run"], "--arch"),
    ([], "--seqlen"),
])
def test_cli_usage_errors_exit_2(capsys, argv, needle):
    assert main(["tune", "prefill", SPEC, *argv]) == 2
    assert needle in capsys.readouterr().err


def test_cli_request_errors_exit_2_with_json(capsys, cache_dir):
    rc, out = run_json(capsys, "tune", "prefill", "prefill:head_dim=100", "--seqlen", "512", "--dry-run",
                       "--arch", "sm_90")
    assert rc == 2 and out["error"]["field"] == "head_dim"
    rc, out = run_json(capsys, "tune", "prefill", SPEC, "--seqlen", "512", "--compile")
    assert rc == 2 and out["error"]["field"] == "--compile"
    rc, out = run_json(capsys, "tune", "prefill", SPEC, "--seqlen", "512", "--arch", "sm_90")
    assert rc == 2 and out["error"]["field"] == "--arch"


@pytest.mark.skipif(gpu_count() > 0, reason="checks the error of a machine without a GPU")
def test_cli_search_without_gpu_is_an_error(capsys, cache_dir):
    assert main(["tune", "prefill", SPEC, "--seqlen", "512", "-q"]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err or "torch is not available" in err
    assert tuned.TunedStore().entries() == []


def test_cli_tune_ls_and_cache_commands(capsys, cache_dir):
    assert main(["tune", "ls"]) == 0
    assert "no tuned configurations" in capsys.readouterr().err
    tuned.TunedStore().put(entry(512))
    rc, out = run_json(capsys, "tune", "ls")
    assert rc == 0 and [e["seqlen"] for e in out["entries"]] == [512]
    assert main(["tune", "ls"]) == 0
    assert "q64 kv32 w4 s2" in capsys.readouterr().out
    rc, out = run_json(capsys, "cache", "ls")
    assert rc == 0 and out["entries"] == []  # the tuned folder is not a cache entry
    rc, out = run_json(capsys, "cache", "stats")
    assert rc == 0 and out["tuned"] == 1 and out["entries"] == 0 and out["invalid"] == 0
    rc, out = run_json(capsys, "cache", "clear")
    assert rc == 0 and "removed_tuned" not in out
    assert len(tuned.TunedStore().entries()) == 1, "cache clear removed tuned configurations"
    rc, out = run_json(capsys, "cache", "clear", "--tuned")
    assert rc == 0 and out["removed_tuned"] == 1
    assert tuned.TunedStore().entries() == [] and tuned.tuned_entries(get_arch("sm_90")) == []
