"""Pre-warm manifests: loading, validation, expansion, and the shipped default manifest (no compiles)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import attngen
from attngen.arch import get_arch
from attngen.errors import SpecError
from attngen.manifest import (ManifestError, default_manifest_path, expand, load_manifest,
                              manifest_from_dict)
from attngen.families.decode.spec import KVDType
from attngen.spec import resolve, validate
from attngen import MaskMode

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str, name: str = "m.toml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_lists_expand_to_their_product_and_scalars_stay(tmp_path):
    m = load_manifest(write(tmp_path, """
        archs = ["sm_80", "sm_90"]
        [[kernel]]
        family = "prefill"
        head_dim = [64, 128]
        dtype = ["fp16", "bf16"]
        mask = ["none", "causal", "sliding_window"]
        return_lse = true
    """))
    items = expand(m)
    assert len(items) == 2 * 2 * 3 * 2
    assert all(spec.return_lse for spec, _ in items)
    assert {a.name for _, a in items} == {"sm_80", "sm_90"}
    assert len({(s, a.name) for s, a in items}) == len(items)
    # File order: the first field varies slowest, archs innermost.
    assert [(s.head_dim, a.name) for s, a in items[:2]] == [(64, "sm_80"), (64, "sm_90")]


def test_specs_come_back_as_written_not_resolved(tmp_path):
    m = manifest_from_dict({"archs": ["sm_90"], "kernel": [{"family": "prefill", "head_dim": 128}]})
    (spec, arch), = expand(m)
    assert spec.cta_tile_q == 0 and arch == get_arch("sm_90")


def test_group_archs_and_arch_override():
    m = manifest_from_dict({
        "archs": ["sm_80", "sm_86"],
        "kernel": [
            {"family": "prefill", "head_dim": 64},
            {"family": "prefill", "head_dim": 128, "archs": ["sm_90"]},
        ],
    })
    assert [(s.head_dim, a.name) for s, a in expand(m)] == [(64, "sm_80"), (64, "sm_86"), (128, "sm_90")]
    # An override replaces the top-level archs and filters a group's own archs.
    assert [(s.head_dim, a.name) for s, a in expand(m, ["sm_90"])] == [(64, "sm_90"), (128, "sm_90")]
    assert [(s.head_dim, a.name) for s, a in expand(m, ["sm_120"])] == [(64, "sm_120")]


def test_archs_accept_a_comma_string_and_aliases():
    m = manifest_from_dict({"archs": "sm_80, 90", "kernel": [{"family": "prefill"}]})
    assert [a.name for a in m.archs] == ["sm_80", "sm_90"]


def test_overlapping_groups_and_default_spellings_build_once():
    m = manifest_from_dict({
        "archs": ["sm_90"],
        "kernel": [
            {"family": "prefill", "head_dim": [64, 128], "mask": "causal"},
            {"family": "prefill", "head_dim": 128, "mask": ["causal", "none"]},
        ],
    })
    items = expand(m)
    assert [(s.head_dim, s.mask) for s, _ in items] == [(64, MaskMode.CAUSAL), (128, MaskMode.CAUSAL),
                                                        (128, MaskMode.NONE)]
    # Tuning fields written out at the values the arch would choose give the same kernel.
    resolved = resolve(attngen.parse_spec("prefill:head_dim=128"), "sm_90")
    tuning = {k: getattr(resolved, k) for k in ("cta_tile_q", "cta_tile_kv", "num_warps", "num_stages")}
    m2 = manifest_from_dict({"archs": ["sm_90"], "kernel": [
        {"family": "prefill", "head_dim": 128},
        {"family": "prefill", "head_dim": 128, **tuning},
    ]})
    assert len(expand(m2)) == 1


@pytest.mark.parametrize("table, field", [
    ({"family": "prefill", "head_dimm": 128}, "head_dimm"),
    ({"family": "prefill", "head_dim": [64, 100]}, "head_dim"),
    ({"family": "prefill", "dtype": ["fp16", "fp8"]}, "dtype"),
    ({"family": "prefill", "mask": []}, "mask"),
    ({"family": "prefill", "head_dim": [64, 64]}, "head_dim"),
    ({"family": "prefill", "head_dim": 1.5}, "head_dim"),
    ({"family": "prefill", "dtype": {"a": 1}}, "dtype"),
    ({"head_dim": 128}, "family"),
    ({"family": "nosuch"}, "family"),
    ({"family": "prefill", "archs": ["sm_75"]}, "arch"),
    ({"family": "prefill", "archs": []}, "archs"),
])
def test_bad_kernel_tables_name_the_field(table, field):
    with pytest.raises(SpecError) as ei:
        manifest_from_dict({"archs": ["sm_90"], "kernel": [{"family": "prefill"}, table]})
    assert ei.value.field == field
    assert field in str(ei.value)
    assert "[[kernel]] #2" in str(ei.value)


@pytest.mark.parametrize("data, field", [
    ({"archs": ["sm_90"], "kernels": [{"family": "prefill"}]}, "kernels"),
    ({"archs": ["sm_90"]}, "kernel"),
    ({"kernel": [{"family": "prefill"}]}, "archs"),
    ({"archs": ["sm_90"], "format": 2, "kernel": [{"family": "prefill"}]}, "format"),
    ({"archs": ["sm_90"], "kernel": {"family": "prefill"}}, "kernel"),
    ({"archs": [90], "kernel": [{"family": "prefill"}]}, "archs"),
])
def test_bad_top_level_names_the_field(data, field):
    with pytest.raises(SpecError) as ei:
        manifest_from_dict(data)
    assert ei.value.field == field


def test_a_spec_that_does_not_fit_an_arch_fails_at_expansion_naming_the_arch():
    m = manifest_from_dict({"archs": ["sm_86"], "kernel": [{
        "family": "prefill", "head_dim": 256, "cta_tile_q": 64, "num_warps": 4,
        "cta_tile_kv": 128, "num_stages": 4}]})
    with pytest.raises(SpecError) as ei:
        expand(m)
    assert "sm_86" in str(ei.value) and "[[kernel]] #1" in str(ei.value)


def test_file_errors(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        load_manifest(tmp_path / "nope.toml")
    with pytest.raises(ManifestError, match="not valid TOML"):
        load_manifest(write(tmp_path, "archs = [\n"))
    with pytest.raises(ManifestError):
        load_manifest(tmp_path)  # a directory
    assert issubclass(ManifestError, attngen.AttngenError)


# --- the shipped default manifest --------------------------------------------------------------

def test_default_manifest_is_the_checkout_copy():
    assert default_manifest_path() == ROOT / "cache" / "default.toml"


def test_default_manifest_falls_back_to_the_package_copy(tmp_path, monkeypatch):
    pkg = tmp_path / "site-packages" / "attngen"
    (pkg / "manifests").mkdir(parents=True)
    (pkg / "manifests" / "default.toml").write_text((ROOT / "cache" / "default.toml").read_text())
    monkeypatch.setattr(attngen, "__file__", str(pkg / "__init__.py"))
    assert default_manifest_path() == pkg / "manifests" / "default.toml"


def test_default_manifest_validates_for_every_arch_it_lists():
    m = load_manifest(None)
    items = expand(m)  # resolves and validates every (spec, arch)
    for spec, arch in items:
        validate(resolve(spec, arch), arch)
    archs = {a.name for _, a in items}
    assert archs == {"sm_80", "sm_86", "sm_89", "sm_90a", "sm_100", "sm_120"}
    specs = {s for s, _ in items}
    prefill = {s for s in specs if s.family == "prefill"}
    decode = {s for s in specs if s.family == "decode"}
    assert {s.head_dim for s in prefill} >= {64, 128, 256}
    assert {s.dtype.value for s in specs} == {"fp16", "bf16"}
    assert {s.mask.value for s in prefill} == {"none", "causal", "sliding_window"}
    assert {s.head_dim for s in decode} == {64, 80, 96, 128, 160, 192, 256}
    assert {s.paged for s in decode} == {False, True}
    # Every non-LSE kernel on every arch (what attngen.prefill and attngen.decode ask for by default),
    # but custom masks at head_dim 192/256: only on the archs where they compile spill-free.
    for s in specs:
        partial = (getattr(s, "custom_mask", False) and s.head_dim in (192, 256)) or (
            getattr(s, "varlen", False) and s.head_dim == 256 and s.mask.value == "sliding_window") or (
            s.family == "mla_decode" and (s.alternate or s.num_stages == 1 or s.cluster_merge or s.gather
                                          or s.box_lanes)) or (  # sm_90a only
            s.family == "prefill" and s.mma.value == "wgmma") or (  # (prefill's configs by rows at 64, 128, 256)
            getattr(s, "qkv_dtype", ""))  # fp8 prefill: the archs with fp8 MMAs (sm_89+)
        if not getattr(s, "return_lse", False) and not partial:
            assert {a.name for sp, a in items if sp == s} == archs
    assert {s.varlen for s in prefill} == {False, True} and {s.custom_mask for s in prefill} == {False, True}
    # Each kernel here costs CI's slow step 1.2-1.6 s of a core (the whole manifest: 18-25 min on two cores).
    mla = {s for s in specs if s.family == "mla_decode"}
    assert {s.q_rows for s in mla} == {16, 32, 64} and {s.paged for s in mla} == {False, True}
    merge = {s for s in specs if s.family == "merge"}
    assert {s.head_dim for s in merge} == {64, 128, 256, 512} and {s.states.value for s in merge} == {"pair", "many"}
    # 1440 attention kernels plus 96 merges (each compiles in a fraction of a second, so the merges add
    # under a minute to a prewarm), 36 fp8-cache decode kernels and 36 fp8-cache MLA decode kernels.
    fp8 = {s for s in specs if s.family == "decode" and s.kv_dtype is not None}
    assert {s.head_dim for s in fp8} == {64, 128, 256} and {s.paged for s in fp8} == {False, True}
    mla8 = {s for s in mla if s.kv_dtype is not None}
    assert {(s.q_rows, s.paged, s.kv_dtype.value, s.dtype.value) for s in mla8} == {
        (r, p, "fp8_e4m3", "bf16") for r in (16, 32, 64) for p in (False, True)}
    # 36 more with page_rows (paged blocks not a multiple of 16): decode d128 at q_rows 16 and 32, the varlen paged
    # prefill d128 causal, both dtypes.
    rows = {s for s in specs if getattr(s, "page_rows", False) and s.family != "mla_decode"}
    assert {(s.family, s.head_dim, s.dtype.value) for s in rows} == {
        (f, 128, dt) for f in ("decode", "prefill") for dt in ("fp16", "bf16")}
    # 18 more: MLA decode with page_rows (SGLang's pages of 1), bf16, 16-64 rows, every arch; and the gathers paged
    # blocks of 16 reach on sm_90a (fp16's from the paged line): the one-stage 16 rows, the sharded 32 and 64 rows.
    assert {(s.q_rows, s.dtype.value, s.kv_dtype) for s in mla if s.page_rows} == {
        (r, dt, None) for r in (16, 32, 64) for dt in ("bf16", "fp16")}
    # 36 more fp8 prefill kernels (head dims 128, 256, every mask, dense and varlen, on sm_89, sm_90a, sm_120).
    pf8 = {s for s in prefill if s.qkv_dtype}
    assert {(s.head_dim, s.varlen) for s in pf8} == {(d, v) for d in (128, 256) for v in (False, True)}
    # 12 more varlen prefill kernels over an fp8 cache (head_dim 128, causal, contiguous and paged, every arch).
    kv8 = {s for s in prefill if s.kv_dtype}
    assert {(s.head_dim, s.paged, s.kv_dtype) for s in kv8} == {(128, p, "fp8_e4m3") for p in (False, True)}
    # 4 more MLA kernels: the sharded wgmma kernel's cluster_merge form (512 + 64, bf16 and fp16, contiguous and paged,
    # sm_90a only).
    assert {(s.dtype.value, s.paged) for s in mla if s.cluster_merge} == {
        (dt, p) for dt in ("fp16", "bf16") for p in (False, True)}
    # 108 more: BatchAttention's decode kernels (paged, a packed q, 16 and 32 rows; 16-bit caches in both dtypes and
    # an e4m3 cache with a bf16 q), every arch.
    packed = {s for s in decode if s.varlen_q}
    assert {(s.head_dim, s.q_rows, s.paged, s.dtype.value, s.kv_dtype) for s in packed} == {
        (d, r, True, dt, kv) for d in (64, 128, 256) for r in (16, 32)
        for dt, kv in (("fp16", None), ("bf16", None), ("bf16", KVDType("fp8_e4m3")))}
    # 4 more: head_dim 128 without a mask from 8k rows, 128x192 tiles in ping-pong, persistent (sm_90a).
    assert {(s.dtype.value, s.return_lse) for s in prefill if s.cta_tile_kv == 192 and s.head_dim == 128} == {
        (dt, lse) for dt in ("fp16", "bf16") for lse in (False, True)}
    # 2 more: the sharded 32- and 64-row gathers of fp16 over blocks of 16 (sm_90a; bf16's come from the page_rows line);
    # 1 more: alternate tiles over the gather (sm_90a, 128 heads over blocks of any size); 1 fewer: the gather's
    # cluster_merge form, which its merge does not fit (no choice takes it).
    # 10 more: the box_lanes forms that blocks smaller than a tile reach (sm_90a, paged, bf16 and fp16): 16 and 32 rows
    # two-stage, the 64-row sharded kernel, its cluster_merge form and alternate tiles.
    assert {(s.q_rows, s.qk_shard.value, s.cluster_merge) for s in mla if s.box_lanes} == {
        (16, "true", False), (32, "true", False), (64, "true", False), (64, "true", True), (64, "alternate", False)}
    assert all(s.paged and s.num_stages == 2 and not s.fp8 for s in mla if s.box_lanes)
    assert 100 <= len(items) <= 1841
