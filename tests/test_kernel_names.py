"""Kernel names read the variant: family, head dims, dtype, mask, tiles, pipeline, then a digest of the
whole spec, so that a profile or a cache listing tells one kernel from another (CPU only, nothing compiled)."""

import re
import subprocess
import sys

import pytest

from attngen.manifest import expand, load_manifest
from attngen.spec import NAME_MAX, parse_spec, resolve

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@pytest.fixture(scope="module")
def manifest_specs():
    """Every resolved spec of the shipped manifest, over every arch it names."""
    return [resolve(spec, arch) for spec, arch in expand(load_manifest())]


def test_names_are_unique_across_the_default_manifest(manifest_specs):
    by_name: dict[str, set] = {}
    by_parts: dict[str, set] = {}
    for r in manifest_specs:
        by_name.setdefault(r.kernel_name, set()).add(r.canonical_json())
        by_parts.setdefault(r.kernel_name[:-len(r.digest()) - 1], set()).add(r.canonical_json())
    assert len(by_name) > 100
    assert not {n: s for n, s in by_name.items() if len(s) > 1}
    # The readable parts alone already tell the manifest's kernels apart: the digest is a guard, not the
    # only difference a reader sees.
    assert not {n: s for n, s in by_parts.items() if len(s) > 1}


def test_names_are_bounded_c_identifiers_ending_in_the_digest(manifest_specs):
    for r in manifest_specs:
        name = r.kernel_name
        assert IDENT.fullmatch(name) and len(name) <= NAME_MAX, name
        assert name.startswith(f"attngen_{r.family}_") and name.endswith("_" + r.digest()), name
        assert re.fullmatch(r"[0-9a-f]{8}", r.digest())
        for entry in r.entries:  # every entry of the module follows (its suffix after the name)
            assert IDENT.fullmatch(entry) and entry.startswith(name), entry


# Tuning fields pinned, so that the names do not follow the measured defaults.
TILES = "cta_tile_q=128,cta_tile_kv=128,num_warps=8,num_stages=2"


@pytest.mark.parametrize("text, arch, parts", [
    (f"prefill:head_dim=128,dtype=bf16,mask=causal,{TILES},mma=wgmma,pipeline=tma,schedule=pingpong", "sm_90a",
     "prefill_d128_bf16_causal_q128k128_w8s2_wgmma_tma_pp"),
    (f"prefill:head_dim=192,head_dim_v=128,dtype=fp16,mask=sliding_window,varlen=true,{TILES},mma=wgmma,"
     "pipeline=tma,schedule=overlap", "sm_90a", "prefill_d192v128_fp16_swa_varlen_q128k128_w8s2_wgmma_tma_ov"),
    ("prefill:head_dim=64,mask=none,return_lse=true,softcap=true,alibi=true,cta_tile_q=64,cta_tile_kv=64,"
     "num_warps=4,num_stages=3,mma=mma_sync", "sm_80", "prefill_d64_bf16_lse_cap_alibi_q64k64_w4s3_mma"),
    ("prefill:head_dim=128,custom_mask=true,cta_tile_q=64,cta_tile_kv=64,num_warps=4,num_stages=2,mma=mma_sync",
     "sm_86", "prefill_d128_bf16_cmask_q64k64_w4s2_mma"),
    ("prefill:head_dim=512,cta_tile_q=64,cta_tile_kv=128,num_warps=8,num_stages=3,head_dim_chunk=64,mma=mma_sync",
     "sm_86", "prefill_d512_bf16_q64k128_w8s3_c64_mma"),
    ("decode:head_dim=128,dtype=fp16,q_rows=16,paged=true,variant=unfused,cta_tile_kv=64,num_warps=4,num_stages=4",
     "sm_90", "decode_d128_fp16_rows16_paged_unfused_k64_w4s4"),
    ("decode:head_dim=64,q_rows=32,local=true,alibi=true,cta_tile_kv=64,num_warps=4,num_stages=2",
     "sm_90a", "decode_d64_bf16_rows32_alibi_local_k64_w4s2"),
    ("mla_decode:q_rows=64,qk_shard=alternate,cta_tile_kv=64,num_warps=8,num_stages=2,mma=wgmma,pipeline=tma",
     "sm_90a", "mla_decode_ckv512_kpe64_bf16_rows64_qkalt_k64_w8s2_wgmma_tma"),
])
def test_names_read_the_variant(text, arch, parts):
    r = resolve(parse_spec(text), arch)
    assert r.kernel_name.startswith(f"attngen_{parts}_"), r.kernel_name


def test_unset_tuning_fields_are_left_out_of_the_name():
    s = parse_spec("prefill:head_dim=128,dtype=fp16")
    assert re.fullmatch(r"attngen_prefill_d128_fp16_[0-9a-f]{8}", s.kernel_name)
    pinned = s.replace(cta_tile_q=64, cta_tile_kv=32, mma="mma_sync")
    assert re.fullmatch(r"attngen_prefill_d128_fp16_q64k32_mma_[0-9a-f]{8}", pinned.kernel_name)


def test_long_parts_are_cut_not_the_digest():
    s = parse_spec("prefill:head_dim=128")

    class Wordy(type(s)):
        def name_parts(self):
            return ("x" * 300, "y-z")

    w = Wordy()
    assert len(w.kernel_name) == NAME_MAX and w.kernel_name.endswith("_" + w.digest())
    assert IDENT.fullmatch(w.kernel_name)


def test_names_are_the_same_in_a_new_process(manifest_specs):
    picked = manifest_specs[::97]
    code = ("import sys\nfrom attngen.spec import parse_spec, resolve\n"
            "for line in sys.stdin.read().splitlines():\n"
            "    arch, text = line.split(' ', 1)\n"
            "    print(resolve(parse_spec(text), arch).kernel_name)\n")
    lines = "\n".join(f"sm_90a {r.to_text(full=True)}" for r in picked)
    out = subprocess.run([sys.executable, "-c", code], input=lines, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [r.kernel_name for r in picked]
