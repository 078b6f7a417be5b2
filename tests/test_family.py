"""Families as plug-ins: the registry, and a toy family from the test suite (tests/toy_family, the
example docs/ADDING_A_FAMILY.md walks through) that goes through every shared stage without a
line of attngen naming it: spec text, resolve, render, key, NVRTC, cache, inspect, manifest,
prewarm in worker processes and, on a GPU, a launch."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import attngen
from attngen.cli import main
from attngen.family import Family, families, get_family, register, unregister
from attngen.manifest import expand, manifest_from_dict
from attngen.prewarm import run_prewarm

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def toy(monkeypatch):
    """The toy family registered, and named in ATTNGEN_FAMILIES for worker processes."""
    monkeypatch.setenv("ATTNGEN_FAMILIES", "tests.toy_family")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    import tests.toy_family as mod

    register(mod.FAMILY)
    yield mod
    unregister("toy")


def test_builtin_families_are_found_by_folder():
    names = [f.name for f in families()]
    assert {"prefill", "decode"} <= set(names)
    for f in families():
        assert f.spec.family == f.name and f.template.endswith(".cu.jinja")
    assert get_family("PREFILL") is get_family("prefill")
    with pytest.raises(attngen.SpecError) as ei:
        get_family("nosuch")
    assert ei.value.field == "family" and "prefill" in ei.value.allowed


def test_a_family_whose_spec_names_another_family_is_refused(toy):
    with pytest.raises(ValueError, match="says family='toy'"):
        Family(name="other", spec=toy.ToySpec, template="x.cu.jinja", candidates=toy.candidates)
    class OtherToy(toy.ToySpec):  # the same family name, another spec class
        pass

    with pytest.raises(ValueError, match="registered already"):
        register(Family(name="toy", spec=OtherToy, template="x.cu.jinja", candidates=toy.candidates))
    register(toy.FAMILY)  # registering the same family again is harmless


def test_the_toy_family_goes_through_every_stage(toy, cache_dir):
    spec = attngen.parse_spec("toy:dtype=fp16")
    assert spec.to_text() == "toy:dtype=fp16"
    assert attngen.resolve(spec, "sm_80").threads_per_block == 256     # its fit rule refuses 1024 there
    assert attngen.resolve(spec, "sm_90a").threads_per_block == 1024
    with pytest.raises(attngen.SpecError) as ei:
        attngen.resolve(spec.replace(threads_per_block=1024), "sm_86")
    assert ei.value.field == "threads_per_block"
    src = attngen.render(attngen.resolve(spec, "sm_80"))
    assert "// attngen:begin common/ptx.cuh" in src and "// attngen:begin toy/body.cuh" in src
    # Its name reads the variant through its name_parts hook.
    assert re.fullmatch(r"attngen_toy_fp16_t256_[0-9a-f]{8}", attngen.resolve(spec, "sm_80").kernel_name)
    r = attngen.build(spec, "sm_80")
    assert r.origin == "compiled" and r.binary.resources.known and not r.binary.resources.spill_stores
    assert attngen.build(spec, "sm_80").origin == "memory"
    assert r.source == src
    # Its own template files and the shared piece it includes feed its key.
    from attngen.render import template_files

    assert set(template_files(get_family("toy"))) == {"toy.cu.jinja", "common/ptx.cuh", "toy/body.cuh"}


def test_the_cli_knows_the_toy_family(toy, cache_dir, capsys):
    assert main(["families", "--json"]) == 0
    fams = {f["name"]: f for f in json.loads(capsys.readouterr().out)["families"]}
    assert fams["toy"]["fields"][1] == {"name": "threads_per_block", "default": 0,
                                        "allowed": [0, 64, 128, 256, 1024], "tuning": True}
    assert main(["inspect", "toy:dtype=bf16", "--arch", "sm_86", "--resources", "--key", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec_resolved"] == "toy:dtype=bf16,threads_per_block=256"
    assert out["resources"]["threads"] == 256 and out["key_material"]["spec"]["family"] == "toy"


def test_a_manifest_prewarms_the_toy_family_in_worker_processes(toy, cache_dir):
    m = manifest_from_dict({"archs": ["sm_80", "sm_90a"],
                            "kernel": [{"family": "toy", "dtype": ["fp16", "bf16"]}]})
    items = expand(m)
    assert len(items) == 4
    results = run_prewarm(items, jobs=2)  # spawned workers register the toy through ATTNGEN_FAMILIES
    assert [r["error"] for r in results] == [None] * 4
    assert {r["origin"] for r in results} == {"compiled"}
    assert len(attngen.DiskCache().entries()) == 4


def test_an_unimportable_plugin_is_a_named_error():
    code = "import attngen; attngen.parse_spec('prefill:head_dim=64')"
    env = dict(os.environ, ATTNGEN_FAMILIES="no_such_module_x", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "ATTNGEN_FAMILIES='no_such_module_x'" in p.stderr


@pytest.mark.gpu
def test_the_toy_kernel_runs(toy, cache_dir):
    import torch

    from attngen.runtime import current_stream

    for dtype, tdt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        kern = attngen.get_kernel(attngen.parse_spec(f"toy:dtype={dtype}"))
        n = 100_003
        x = torch.randn(n + 64, device="cuda").to(tdt)
        y = torch.full((n + 64,), float("nan"), device="cuda", dtype=tdt)
        t = kern.spec.threads
        kern.launch_struct(struct.Struct("<QQif"), (-(-n // t), 1, 1), current_stream("torch", 0),
                           x.data_ptr(), y.data_ptr(), n, 3.0)
        torch.cuda.synchronize()
        assert torch.equal(y[:n], (x[:n].float() * 3.0).to(tdt))
        assert torch.isnan(y[n:].float()).all()  # nothing written past n
