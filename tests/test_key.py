"""The cache key: every input that can change the binary changes the key, and nothing else does."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attngen.cache as cache_mod
from attngen.__version__ import __version__
from attngen.arch import get_arch
from attngen.cache import KEY_SCHEMA, key_material, key_of
from attngen.compiler import compile_options, nvrtc_version
from attngen.errors import SpecError
from attngen.render import environment, render, template_context, templates_dir
from attngen.spec import PrefillSpec, parse_spec, resolve
from tests.spec_fields import BASE, BASES, FIELD_VALUES

ROOT = Path(__file__).resolve().parent.parent



def parts(spec, arch="sm_90", extra=()):
    a = get_arch(arch)
    r = resolve(spec, a)
    return r, a, render(r), compile_options(a, extra)


def key_for(spec, arch="sm_90", extra=()):
    return key_of(key_material(*parts(spec, arch, extra)))


def test_key_shape_and_material():
    r, a, src, opts = parts(BASE)
    m = key_material(r, a, src, opts)
    assert set(m) == {"schema", "attngen", "spec", "source_sha256", "options", "nvrtc", "arch"}
    assert m["schema"] == KEY_SCHEMA
    assert m["attngen"] == __version__
    assert m["spec"] == r.to_dict()
    assert m["arch"] == "sm_90"
    assert m["nvrtc"] == nvrtc_version()
    assert re.fullmatch(r"\d+\.\d+", m["nvrtc"])
    assert m["options"][0] == "--gpu-architecture=sm_90"
    assert json.loads(json.dumps(m)) == m
    k = key_of(m)
    assert re.fullmatch(r"[0-9a-f]{64}", k)
    # Dict order does not matter, values do.
    assert key_of(dict(reversed(list(m.items())))) == k


def test_options_hold_no_machine_paths():
    # Include folders differ between machines; a key built on CI must match one built on a GPU box.
    for arch in ("sm_80", "sm_90a", "sm_120"):
        opts = compile_options(arch)
        assert not any(o.startswith("-I") or "/" in o for o in opts), opts


def test_every_spec_field_changes_the_key():
    varied = set()
    for base, arch in BASES:
        keys = {key_for(base, arch): base.to_text(full=True)}
        seen = {base}
        for f in dataclasses.fields(PrefillSpec):
            for v in FIELD_VALUES[f.name]:
                if v == getattr(base, f.name):
                    continue
                try:
                    spec = base.replace(**{f.name: v})
                    r = resolve(spec, arch)
                except SpecError:
                    continue
                if r in seen:  # a 0 resolves to a value some other variant (or the base) already has
                    continue
                seen.add(r)
                k = key_for(r, arch)
                assert k not in keys, f"{f.name}={v} gives the key of {keys[k]}"
                keys[k] = r.to_text(full=True)
                varied.add(f.name)
    assert varied == set(FIELD_VALUES), f"fields never varied: {set(FIELD_VALUES) - varied}"


def test_field_table_covers_every_field():
    assert {f.name for f in dataclasses.fields(PrefillSpec)} == set(FIELD_VALUES)


def test_arch_changes_the_key():
    # One resolved spec that fits every arch: only the target differs.
    spec = PrefillSpec(head_dim=64, cta_tile_q=128, cta_tile_kv=64, num_warps=8, num_stages=2, mma="mma_sync")
    archs = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120")
    keys = {a: key_for(spec, a) for a in archs}
    assert len(set(keys.values())) == len(archs), keys
    # The source is the same for all of them: the arch alone moved the key.
    assert len({render(resolve(spec, a)) for a in archs}) == 1


def test_options_change_the_key():
    assert key_for(BASE) != key_for(BASE, extra=("-lineinfo",))
    assert key_for(BASE, extra=("-lineinfo",)) != key_for(BASE, extra=("--use_fast_math",))


def test_source_changes_the_key():
    r, a, src, opts = parts(BASE)
    k = key_of(key_material(r, a, src, opts))
    assert key_of(key_material(r, a, src + "\n", opts)) != k
    assert key_of(key_material(r, a, src.replace("NUM_STAGES = 2", "NUM_STAGES = 3"), opts)) != k


def test_template_edit_changes_the_key(tmp_path):
    """An edit to an included piece reaches the rendered source, hence the key, with no version bump."""
    r, a, src, opts = parts(BASE)
    copy = tmp_path / "templates"
    shutil.copytree(templates_dir(), copy)
    piece = copy / "common" / "mask.cuh"
    piece.write_text(piece.read_text() + "// a harmless edit\n")
    edited = environment(str(copy)).get_template(r.template).render(**template_context(r))
    assert edited != src
    assert "// a harmless edit" in edited
    assert key_of(key_material(r, a, edited, opts)) != key_of(key_material(r, a, src, opts))
    # An unedited copy renders the same bytes as the package's templates.
    fresh = tmp_path / "fresh"
    shutil.copytree(templates_dir(), fresh)
    assert environment(str(fresh)).get_template(r.template).render(**template_context(r)) == src


def test_nvrtc_version_changes_the_key(monkeypatch):
    r, a, src, opts = parts(BASE)
    k = key_of(key_material(r, a, src, opts))
    monkeypatch.setattr(cache_mod, "nvrtc_version", lambda: "12.9")
    m = key_material(r, a, src, opts)
    assert m["nvrtc"] == "12.9"
    assert key_of(m) != k


def test_attngen_version_changes_the_key(monkeypatch):
    r, a, src, opts = parts(BASE)
    k = key_of(key_material(r, a, src, opts))
    monkeypatch.setattr(cache_mod, "__version__", "0.0.0+other")
    assert key_of(key_material(r, a, src, opts)) != k


def test_key_schema_changes_the_key(monkeypatch):
    r, a, src, opts = parts(BASE)
    k = key_of(key_material(r, a, src, opts))
    monkeypatch.setattr(cache_mod, "KEY_SCHEMA", KEY_SCHEMA + 1)
    assert key_of(key_material(r, a, src, opts)) != k


def test_same_spec_same_key_in_a_new_process():
    specs = ["prefill:head_dim=128,dtype=bf16,mask=causal", "prefill:head_dim=96,dtype=fp16,return_lse=true"]
    archs = ["sm_80", "sm_90a"]
    code = (
        "import json\n"
        "from attngen.arch import get_arch\n"
        "from attngen.cache import key_material, key_of\n"
        "from attngen.compiler import compile_options\n"
        "from attngen.render import render\n"
        "from attngen.spec import parse_spec, resolve\n"
        "out = {}\n"
        f"for t in {specs!r}:\n"
        f"    for a in {archs!r}:\n"
        "        r = resolve(parse_spec(t), a)\n"
        "        out[t + '@' + a] = key_of(key_material(r, get_arch(a), render(r), compile_options(a)))\n"
        "print(json.dumps(out))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="987")
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout)
    ours = {f"{t}@{a}": key_for(parse_spec(t), a) for t in specs for a in archs}
    assert theirs == ours
    assert len(set(ours.values())) == len(ours)
