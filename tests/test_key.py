"""The cache key: every input that can change the binary changes the key, and nothing else does."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attngen.cache_key as key_mod
from attngen.__version__ import __version__
from attngen.arch import get_arch
from attngen.cache_key import KEY_SCHEMA, key_material, key_of
from attngen.compiler import compile_options, nvrtc_version
from attngen.errors import SpecError
from attngen.family import get_family
from attngen.render import digests_for, family_digests, render, template_files, templates_dir
from attngen.spec import parse_spec, resolve
from attngen import PrefillSpec
from tests.spec_fields import BASE, BASES, FIELD_VALUES

ROOT = Path(__file__).resolve().parent.parent



def parts(spec, arch="sm_90", extra=()):
    a = get_arch(arch)
    r = resolve(spec, a)
    return r, a, compile_options(a, extra)


def key_for(spec, arch="sm_90", extra=()):
    return key_of(key_material(*parts(spec, arch, extra)))


def test_key_shape_and_material():
    r, a, opts = parts(BASE)
    m = key_material(r, a, opts)
    assert set(m) == {"schema", "attngen", "spec", "templates_sha256", "code_sha256", "options", "nvrtc", "arch"}
    assert m["templates_sha256"] == family_digests(get_family("prefill"))["templates"]
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
        opts = compile_options(get_arch(arch))
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


def test_digests_change_the_key():
    r, a, opts = parts(BASE)
    d = family_digests(get_family("prefill"))
    k = key_of(key_material(r, a, opts, d))
    assert key_of(key_material(r, a, opts)) == k
    assert key_of(key_material(r, a, opts, {**d, "templates": "0" * 64})) != k
    assert key_of(key_material(r, a, opts, {**d, "code": "0" * 64})) != k


def test_template_edit_changes_the_key(tmp_path):
    """An edit to any piece a family can include moves its key with no version bump; a copy does not."""
    fam = get_family("prefill")
    r, a, opts = parts(BASE)
    base = digests_for(fam)
    fresh = tmp_path / "fresh"
    shutil.copytree(templates_dir(), fresh)
    assert digests_for(fam, (str(fresh),)) == base
    for piece in ("prefill/mask.cuh", "common/wgmma.cuh.jinja", "prefill/prefill.cu.jinja"):
        copy = tmp_path / piece.replace("/", "_")
        shutil.copytree(templates_dir(), copy)
        (copy / piece).write_text((copy / piece).read_text() + "// a harmless edit\n")
        edited = digests_for(fam, (str(copy),))
        assert edited["templates"] != base["templates"], piece
        assert key_of(key_material(r, a, opts, edited)) != key_of(key_material(r, a, opts, base))
    # A piece decode does not include leaves decode's key alone.
    dec = get_family("decode")
    copy = tmp_path / "mask_only"
    shutil.copytree(templates_dir(), copy)
    (copy / "prefill" / "mask.cuh").write_text("// changed\n")
    assert "prefill/mask.cuh" not in template_files(dec)
    assert digests_for(dec, (str(copy),)) == digests_for(dec)


def test_template_files_cover_everything_a_render_loads(monkeypatch):
    """The key's template set is a superset of what rendering reads, for every family and branch."""
    import jinja2

    loaded = []
    real = jinja2.FileSystemLoader.get_source

    def spy(self, environment, template):
        loaded.append(template)
        return real(self, environment, template)

    monkeypatch.setattr(jinja2.FileSystemLoader, "get_source", spy)
    from attngen.render import environment

    environment.cache_clear()
    try:
        for text, arch in [("prefill:head_dim=128,mask=causal", "sm_90a"), ("prefill:head_dim=96", "sm_80"),
                           ("decode:head_dim=128,paged=true", "sm_90a"), ("decode:variant=unfused", "sm_80")]:
            spec = resolve(parse_spec(text), arch)
            loaded.clear()
            environment.cache_clear()  # a fresh environment loads every template it needs again
            render(spec)
            assert loaded and set(loaded) <= set(template_files(get_family(spec.family))), (text, loaded)
    finally:
        environment.cache_clear()


def test_context_code_feeds_the_key():
    from attngen.render import context_code_files

    fam = get_family("prefill")
    files = {p.name for p in context_code_files(fam)}
    assert {"render.py", "spec.py"} <= files  # render.py pastes pieces; spec.py builds the context
    assert any(p.parent.name == "prefill" and p.name == "spec.py" for p in context_code_files(fam))
    # The snippets' code module pastes into prefill's and decode's sources: its text is theirs.
    for name in ("prefill", "decode"):
        assert any(p.name == "snippets.py" for p in context_code_files(get_family(name))), name
    # So do the modules prefill's spec computes its template context with (fp8 rows, row widths).
    assert {"fp8.py", "rows.py"} <= files
    # A module the family names as context code is hashed too.
    extra = dataclasses.replace(fam, context_modules=("tests.spec_fields",))
    assert digests_for(extra)["code"] != digests_for(fam)["code"]
    assert digests_for(extra)["templates"] == digests_for(fam)["templates"]


def test_a_warm_hit_in_a_new_process_imports_no_jinja(tmp_path):
    code = (
        "import sys\n"
        "from attngen import build, parse_spec\n"
        "r = build(parse_spec('prefill:head_dim=128,mask=causal'), 'sm_90a')\n"
        "print(r.origin, 'jinja2' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNGEN_CACHE_DIR=str(tmp_path))
    outs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    assert outs[0].returncode == 0 and outs[1].returncode == 0, outs[0].stderr + outs[1].stderr
    assert outs[0].stdout.split() == ["compiled", "True"]
    assert outs[1].stdout.split() == ["disk", "False"]


def test_nvrtc_version_changes_the_key(monkeypatch):
    r, a, opts = parts(BASE)
    k = key_of(key_material(r, a, opts))
    monkeypatch.setattr(key_mod, "nvrtc_version", lambda: "12.9")
    m = key_material(r, a, opts)
    assert m["nvrtc"] == "12.9"
    assert key_of(m) != k


def test_attngen_version_changes_the_key(monkeypatch):
    r, a, opts = parts(BASE)
    k = key_of(key_material(r, a, opts))
    monkeypatch.setattr(key_mod, "__version__", "0.0.0+other")
    assert key_of(key_material(r, a, opts)) != k


def test_key_schema_changes_the_key(monkeypatch):
    r, a, opts = parts(BASE)
    k = key_of(key_material(r, a, opts))
    monkeypatch.setattr(key_mod, "KEY_SCHEMA", KEY_SCHEMA + 1)
    assert key_of(key_material(r, a, opts)) != k


def test_same_spec_same_key_in_a_new_process():
    specs = ["prefill:head_dim=128,dtype=bf16,mask=causal", "prefill:head_dim=96,dtype=fp16,return_lse=true"]
    archs = ["sm_80", "sm_90a"]
    code = (
        "import json\n"
        "from attngen.arch import get_arch\n"
        "from attngen.cache_key import key_material, key_of\n"
        "from attngen.compiler import compile_options\n"
        "from attngen.spec import parse_spec, resolve\n"
        "out = {}\n"
        f"for t in {specs!r}:\n"
        f"    for a in {archs!r}:\n"
        "        r = resolve(parse_spec(t), a)\n"
        "        out[t + '@' + a] = key_of(key_material(r, get_arch(a), compile_options(get_arch(a))))\n"
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
