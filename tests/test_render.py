"""Rendering: determinism, StrictUndefined, bound constants, piece markers, kernel names."""

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from attngen.errors import SpecError
from attngen.family import families
from attngen.render import environment, render, template_files, templates_dir
from attngen.spec import DType, parse_spec, resolve
from attngen import MaskMode, PrefillSpec
from tests.spec_fields import BASE, BASES, FIELD_VALUES

ROOT = Path(__file__).resolve().parent.parent



def field_names():
    return [f.name for f in dataclasses.fields(PrefillSpec)]


def test_field_table_covers_every_field():
    assert set(field_names()) == set(FIELD_VALUES)


def single_field_variants(base):
    """(field, spec) for every valid spec that differs from ``base`` in exactly one field."""
    for name in field_names():
        for v in FIELD_VALUES[name]:
            if v == getattr(base, name):
                continue
            try:
                s = base.replace(**{name: v})
            except SpecError:
                continue
            if s != base:  # e.g. head_dim_v equal to head_dim is stored as 0
                yield name, s


def resolved_variants(base, arch="sm_90"):
    """(field, resolved spec) for single-field changes that still resolve to a different spec."""
    out = []
    for name, s in single_field_variants(base):
        try:
            r = resolve(s, arch)
        except SpecError:
            continue
        if r != base:
            out.append((name, r))
    return out


# --- determinism ---------------------------------------------------------------------------------

SPECS = [
    "prefill:head_dim=64",
    "prefill:head_dim=96,dtype=fp16,mask=sliding_window,return_lse=true",
    "prefill:head_dim=128,dtype=bf16,mask=causal",
    "prefill:head_dim=256,dtype=fp16,mask=causal",
]


def _digests(arch="sm_90"):
    return {t: hashlib.sha256(render(resolve(parse_spec(t), arch)).encode()).hexdigest() for t in SPECS}


def test_render_is_deterministic_in_process():
    for t in SPECS:
        s = resolve(parse_spec(t), "sm_80")
        a = render(s)
        environment.cache_clear()  # a fresh Jinja environment renders the same bytes
        b = render(s)
        assert a == b
        assert render(PrefillSpec.from_dict(s.to_dict())) == a


def test_render_is_deterministic_across_processes():
    code = (
        "import hashlib, json\n"
        "from attngen.render import render\n"
        "from attngen.spec import parse_spec, resolve\n"
        f"specs = {SPECS!r}\n"
        "print(json.dumps({t: hashlib.sha256(render(resolve(parse_spec(t), 'sm_90')).encode()).hexdigest()"
        " for t in specs}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == _digests()


# --- StrictUndefined -------------------------------------------------------------------------------

def test_environment_is_strict_about_missing_variables():
    env = environment()
    assert env.undefined is jinja2.StrictUndefined
    with pytest.raises(jinja2.UndefinedError, match="head_dimm"):
        env.from_string("constexpr int HEAD_DIM = {{ head_dimm }};").render(head_dim=128)
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ flag|lower }}").render()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{% if missing %}x{% endif %}").render()
    # The variable given, the same template renders.
    assert env.from_string("constexpr int HEAD_DIM = {{ head_dim }};").render(head_dim=128) == \
        "constexpr int HEAD_DIM = 128;"


@pytest.mark.parametrize("drop", ["num_stages", "kernel_name", "is_bf16", "mask_mode", "threads"])
def test_family_template_fails_on_any_missing_context_value(drop):
    spec = resolve(PrefillSpec(head_dim=64), "sm_90")
    ctx = spec.template_context()
    del ctx[drop]
    with pytest.raises(jinja2.UndefinedError, match=drop):
        environment().get_template(f"{spec.family}/{spec.family}.cu.jinja").render(**ctx)


# --- what the source holds -------------------------------------------------------------------------

def test_source_binds_the_spec():
    spec = parse_spec("prefill:head_dim=96,dtype=fp16,mask=causal,return_lse=true,"
                      "cta_tile_q=128,cta_tile_kv=64,num_warps=8,num_stages=3,mma=mma_sync")
    src = render(spec)
    assert re.search(rf'extern "C" __global__ void __launch_bounds__\({spec.threads}\)\s*\n'
                     rf'{spec.kernel_name}\(', src), src[-600:]
    for line in (
        "constexpr int HEAD_DIM = 96;",
        f"constexpr int BLOCK_M = {spec.cta_tile_q};",
        f"constexpr int BLOCK_N = {spec.cta_tile_kv};",
        f"constexpr int NUM_WARPS = {spec.num_warps};",
        f"constexpr int NUM_STAGES = {spec.num_stages};",
        "constexpr int MASK = 1;",
        "constexpr bool RETURN_LSE = true;",
        "constexpr bool IS_BF16 = false;",
        "using elem_t = __half;",
        "constexpr int ROW_ELEMS = 104;",  # 96 is not a multiple of 64: padded rows
        "constexpr bool SWIZZLE = false;",
        "constexpr bool Q_IN_REGS = true;",
    ):
        assert line in src, line


@pytest.mark.parametrize("mask, value", [(MaskMode.NONE, 0), (MaskMode.CAUSAL, 1), (MaskMode.SLIDING_WINDOW, 2)])
def test_mask_constant_matches_the_cuda_enum(mask, value):
    src = render(resolve(PrefillSpec(head_dim=64, mask=mask), "sm_90"))
    assert f"constexpr int MASK = {value};" in src
    # ... and the numbering is the one prefill/mask.cuh declares.
    assert "MASK_NONE = 0, MASK_CAUSAL = 1, MASK_WINDOW = 2" in src


def test_bf16_binds_the_bf16_type():
    src = render(resolve(PrefillSpec(head_dim=256, dtype=DType.BF16), "sm_90"))
    assert "using elem_t = __nv_bfloat16;" in src
    assert "constexpr bool IS_BF16 = true;" in src
    assert "constexpr bool SWIZZLE = true;" in src and "constexpr bool Q_IN_REGS = false;" in src


def test_source_is_self_contained():
    src = render(resolve(PrefillSpec(), "sm_90"))
    includes = re.findall(r"^\s*#\s*include\s*(.+)$", src, flags=re.M)
    assert includes == ["<cuda_fp16.h>", "<cuda_bf16.h>"]
    assert "{{" not in src and "{#" not in src


def test_every_field_that_changes_the_resolved_spec_changes_the_source():
    seen = set()
    for base, arch in BASES:
        base_src = render(base).replace(base.kernel_name, "KERNEL")
        for name, r in resolved_variants(base, arch):
            src = render(r)
            assert r.kernel_name in src
            # Not only through the kernel's name: the constants themselves differ.
            assert src.replace(r.kernel_name, "KERNEL") != base_src, (name, r.to_text(full=True))
            seen.add(name)
    assert seen == set(FIELD_VALUES), f"fields never varied: {set(FIELD_VALUES) - seen}"


def test_unresolved_spec_renders_for_the_arch_given():
    spec = PrefillSpec(head_dim=256)
    assert render(spec, "sm_86") == render(resolve(spec, "sm_86"))
    assert render(spec, "sm_90") == render(resolve(spec, "sm_90"))
    assert render(spec, "sm_86") != render(spec, "sm_90")  # different tiles fit


@pytest.mark.parametrize("family", ["prefill", "decode", "mla_decode"])
def test_included_pieces_are_bracketed_and_verbatim(family):
    src = render(resolve(parse_spec(f"{family}:"), "sm_90"))
    lines = src.splitlines()
    root = templates_dir()

    def included(pattern):
        names = sorted(p.relative_to(root).as_posix() for p in root.glob(pattern))
        return [n for n in names if f"// attngen:begin {n}" in lines]

    pieces = included("*/*.cuh")
    assert len([n for n in pieces if n.startswith("common/")]) >= 2, "no common pieces found"
    assert any(n.startswith(f"{family}/") for n in pieces), "none of the family's own pieces found"
    for name in pieces:
        begin, end = f"// attngen:begin {name}", f"// attngen:end {name}"
        assert lines.count(begin) == 1, name
        assert lines.count(end) == 1, name
        i, j = lines.index(begin), lines.index(end)
        assert i < j
        body = "\n".join(lines[i + 1:j])
        text = (root / name).read_text().rstrip()
        assert body == text, f"{name} is not pasted verbatim"
    # The top-level template is rendered as it is, not bracketed as a piece.
    assert not included("*/*.cu.jinja")
    # Pieces rendered by Jinja (*.cuh.jinja: text they repeat, no spec values) are bracketed too, as often as
    # they are rendered: prefill_fwd's step of a KV tile (prefill/step.cuh.jinja) inside it, once a loop.
    rendered = included("*/*.cuh.jinja")
    assert "prefill/step.cuh.jinja" in rendered or family != "prefill"
    for piece in rendered:
        assert lines.count(f"// attngen:begin {piece}") == lines.count(f"// attngen:end {piece}") >= 1
    # Pieces nest like brackets (the compiler's error report takes the innermost open one); plain pieces sit at
    # the top level, and only rendered pieces hold others.
    stack = []
    for ln in lines:
        if ln.startswith("// attngen:begin "):
            assert not stack or stack[-1].endswith(".jinja"), (stack, ln)
            stack.append(ln[len("// attngen:begin "):])
        elif ln.startswith("// attngen:end "):
            assert stack and stack.pop() == ln[len("// attngen:end "):], ln
    assert not stack


def test_every_piece_is_included_by_some_family():
    specs = ("prefill:", "decode:", "decode:variant=unfused", "decode:kv_dtype=fp8_e4m3", "prefill:custom_mask=true", "prefill:varlen=true,paged=true", "prefill:head_dim=512",
             "mla_decode:", "mla_decode:kv_dtype=fp8_e4m3", "merge:", "merge:states=many")
    sources = [render(resolve(parse_spec(text), "sm_90")) for text in specs]
    sources.append(render(resolve(parse_spec("mla_decode:qk_shard=alternate"), "sm_90a")))
    # fp8 on the wgmma kernel (sm_90a, 64 rows): mla_decode/fp8_wgmma.cuh
    sources.append(render(resolve(parse_spec("mla_decode:kv_dtype=fp8_e4m3,q_rows=64"), "sm_90a")))
    # a mask_mod's block plan (a snippet is no part of a spec's text)
    sources.append(render(resolve(parse_spec("prefill:custom_mask=true").replace(mask_mod="return true;"), "sm_90")))
    # fp8 prefill (sm_90a): prefill/fp8.cuh
    sources.append(render(resolve(parse_spec("prefill:qkv_dtype=fp8_e4m3"), "sm_90a")))
    # an fp8 cache under a 16-bit q (the producer widens; included with the cp.async kernel's too): prefill/widen.cuh
    sources.append(render(resolve(parse_spec("prefill:varlen=true,paged=true,kv_dtype=fp8_e4m3"), "sm_90a")))
    # paged blocks of any size gathered into the TMA ring (sm_90a): mla_decode/gather.cuh
    sources.append(render(resolve(parse_spec("mla_decode:paged=true,page_rows=true"), "sm_90a")))
    for p in templates_dir().glob("*/*.cuh*"):
        name = p.relative_to(templates_dir()).as_posix()
        assert any(f"// attngen:begin {name}" in s for s in sources), name


def test_common_holds_only_what_two_families_include():
    """templates/common/ is for pieces two or more families include; a family's own live in its folder."""
    shipped = [f for f in families() if f.template_dir is None]  # not a test's toy family
    assert {f.name for f in shipped} >= {"prefill", "decode", "mla_decode"}
    users: dict[str, set] = {}
    for fam in shipped:
        for name in template_files(fam):
            users.setdefault(name, set()).add(fam.name)
    for p in (templates_dir() / "common").iterdir():
        name = f"common/{p.name}"
        assert len(users.get(name, ())) >= 2, (name, users.get(name))
    for fam in shipped:
        for name in template_files(fam):
            assert name.startswith(("common/", f"{fam.name}/")), (fam.name, name)


def test_renders_every_resolved_default_on_every_arch():
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a", "sm_100", "sm_120"):
        for hd in PrefillSpec.HEAD_DIMS:
            for mask in MaskMode:
                r = resolve(PrefillSpec(head_dim=hd, mask=mask), arch)
                src = render(r)
                assert f"constexpr int HEAD_DIM = {hd};" in src
                assert r.kernel_name in src


# --- kernel names ----------------------------------------------------------------------------------

def test_kernel_name_shape():
    s = PrefillSpec()
    assert re.fullmatch(r"attngen_prefill_d128_bf16_[0-9a-f]{8}", s.kernel_name)
    assert s.kernel_name == PrefillSpec().kernel_name
    assert s.kernel_name == parse_spec(s.to_text(full=True)).kernel_name


@pytest.mark.parametrize("base", [
    PrefillSpec(),
    BASE,
    PrefillSpec(head_dim=256, dtype=DType.FP16, mask=MaskMode.CAUSAL, return_lse=True,
                cta_tile_q=64, cta_tile_kv=64, num_warps=4, num_stages=3),
    PrefillSpec(varlen=True),
    PrefillSpec(varlen=True, paged=True),
    BASE.replace(custom_mask=True, mask_mod="return kv_idx <= q_idx + t(0);", aux="t:int32:1"),
    PrefillSpec(score_mod="return score * 0.5f;"),
], ids=["defaults", "resolved", "other", "varlen", "paged", "mask_mod", "score_mod"])
def test_every_field_feeds_the_kernel_name(base):
    names = {base.kernel_name: base}
    varied = set()
    for name, s in single_field_variants(base):
        assert s.kernel_name != base.kernel_name, f"changing {name} alone kept the kernel name"
        assert s.kernel_name not in names, (s, names.get(s.kernel_name))
        names[s.kernel_name] = s
        varied.add(name)
    # Alone, paged needs varlen and custom_mask refuses it: one of the two cannot vary from each base;
    # the chunked kernel (head_dim_v, head_dim_chunk) has no paged form, and the varlen base is paged-free.
    # A base on the cp.async pipeline has the serial schedule only; it, and a varlen one, no persistent form.
    refused = {"custom_mask"} if base.varlen else {"paged"}
    refused |= {"schedule"} if base.pipeline.value == "sync" else set()
    refused |= {"persistent"} if base.pipeline.value == "sync" else set()
    # page_rows needs paged; a paged base cannot drop varlen alone, nor take the chunked kernel (head_dim_chunk).
    refused |= {"varlen", "head_dim_chunk"} if base.paged else {"page_rows"}
    # fp8 (qkv_dtype) is the TMA kernel's: not on the cp.async pipeline nor with a paged cache.
    refused |= {"qkv_dtype"} if base.pipeline.value == "sync" or base.paged else set()
    # kv_dtype (an fp8 cache) is the varlen cp.async kernel's: it needs varlen.
    refused |= {"kv_dtype"} if not base.varlen else set()
    # mod_bits needs a custom mask with a mask_mod, which takes neither varlen nor the chunked kernel.
    refused |= {"varlen", "head_dim_chunk"} if base.mask_mod else {"mod_bits"}
    # q_scaled needs a score_mod, which neither the chunked kernel (head_dim_chunk) nor fp8 (qkv_dtype) takes.
    refused |= {"head_dim_chunk", "qkv_dtype"} if base.score_mod else {"q_scaled"}
    assert varied == set(FIELD_VALUES) - refused, f"fields never varied: {set(FIELD_VALUES) - refused - varied}"


def test_resolved_and_unresolved_specs_name_distinct_kernels():
    # A kernel compiled for resolved tiles must never be mistaken for "tiles left to the arch".
    s = PrefillSpec(head_dim=128)
    assert resolve(s, "sm_90").kernel_name != s.kernel_name
    # The name is the spec's; the arch goes into the cache key (test_key.py), not the symbol.
    pinned = s.replace(mma="mma_sync")
    assert resolve(pinned, "sm_90").kernel_name == resolve(pinned, "sm_90a").kernel_name
    # Left to the arch, sm_90a resolves to the wgmma kernel, a different spec and name.
    assert resolve(s, "sm_90a").mma.value == "wgmma" and resolve(s, "sm_90").mma.value == "mma_sync"
    assert resolve(s, "sm_90").kernel_name != resolve(s, "sm_90a").kernel_name


def test_building_writes_no_python_code_into_the_cache_root(tmp_path, monkeypatch):
    # Nothing CPU-executable is kept in the cache (Jinja's bytecode cache held code objects):
    # a build leaves cubins, sources, metadata and lock files only.
    from attngen import build

    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    spec = resolve(PrefillSpec(head_dim=128), "sm_90a")
    assert build(spec, "sm_90a").origin == "compiled"
    names = {p.name.rsplit(".", 1)[-1] for p in tmp_path.rglob("*") if p.is_file()}
    assert names <= {"cubin", "cu", "json", "lock"}, names
    assert not (tmp_path / "v1" / "jinja").exists()
