"""Specs that once resolved to a spilling kernel, before their family's SPILLS_ON listed the configs (the decode
and MLA families, 2026-11-26: every default, and every single-field pin, compiled for every manifest arch): what
each resolves to now compiles spill-free, a real NVRTC compile."""

from __future__ import annotations

import pytest

from attngen.compiler import compile
from attngen.render import render
from attngen.spec import parse_spec, resolve

# decode: defaults (the first four) and single-field pins
DECODE = [("sm_90a", "decode:head_dim=64,q_rows=64,paged=true"),
          ("sm_90a", "decode:head_dim=64,q_rows=64,softcap=true"),
          ("sm_90a", "decode:head_dim=256,q_rows=16,paged=true,alibi=true"),
          ("sm_80", "decode:head_dim=128,q_rows=64,variant=unfused,softcap=true"),
          ("sm_90a", "decode:head_dim=128,q_rows=16,paged=true,cta_tile_kv=128"),
          ("sm_90a", "decode:head_dim=64,q_rows=32,cta_tile_kv=64"),
          ("sm_80", "decode:head_dim=128,q_rows=16,paged=true,cta_tile_kv=128"),
          ("sm_80", "decode:head_dim=64,q_rows=32,num_stages=3"),
          ("sm_89", "decode:head_dim=64,q_rows=16,paged=true,cta_tile_kv=64"),
          ("sm_120", "decode:head_dim=64,q_rows=32,num_stages=1"),
          ("sm_90a", "decode:head_dim=64,q_rows=32,kv_dtype=fp8_e4m3"),  # fp8 defaults
          ("sm_80", "decode:head_dim=64,q_rows=32,paged=true,kv_dtype=fp8_e4m3"),
          # fp8 defaults once the fragments were widened in registers (the sm_90a 32-row paged one: below)
          ("sm_89", "decode:head_dim=96,q_rows=16,kv_dtype=fp8_e4m3"),
          ("sm_86", "decode:head_dim=192,q_rows=16,kv_dtype=fp8_e4m3"),
          ("sm_90a", "decode:head_dim=192,q_rows=16,paged=true,kv_dtype=fp8_e5m2,dtype=fp16"),
          ("sm_90a", "decode:head_dim=256,q_rows=16,paged=true,page_rows=true")]  # a lookup a key row

# MLA decode: single-field pins, and one default (sm_120, 256 + 32, 32 rows, paged)
MLA = [("sm_90a", "mla_decode:q_rows=16,qk_shard=false"),
       ("sm_90a", "mla_decode:q_rows=16,paged=true,kv_lora_rank=256,rope_dim=32,qk_shard=false"),
       ("sm_90a", "mla_decode:q_rows=32,kv_lora_rank=256,rope_dim=32,qk_shard=false"),
       ("sm_90a", "mla_decode:q_rows=32,paged=true,kv_lora_rank=256,rope_dim=32,qk_shard=false"),
       ("sm_90a", "mla_decode:q_rows=64,kv_lora_rank=256,rope_dim=32,num_warps=4"),
       ("sm_90a", "mla_decode:q_rows=64,paged=true,kv_lora_rank=256,rope_dim=32,num_warps=4"),
       ("sm_120", "mla_decode:q_rows=32,paged=true,kv_lora_rank=256,rope_dim=32"),
       ("sm_120", "mla_decode:q_rows=16,cta_tile_kv=16"),
       ("sm_100", "mla_decode:q_rows=16,paged=true,qk_shard=false"),
       # fp8 caches (FP8_SPILLS_ON): the paged 16-row defaults of e4m3 on the 99 KB archs
       ("sm_89", "mla_decode:q_rows=16,paged=true,kv_dtype=fp8_e4m3"),
       ("sm_86", "mla_decode:q_rows=16,paged=true,kv_dtype=fp8_e4m3,dtype=fp16")]


@pytest.mark.parametrize("arch,text", DECODE + MLA)
def test_resolves_past_a_spilling_config_to_a_spill_free_kernel(arch, text, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    s = resolve(parse_spec(text), arch)
    r = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries).resources
    assert r.known and (r.spill_stores, r.spill_loads) == (0, 0), (text, s.to_text())


def test_the_fp8_paged_32_row_default_on_sm_90a_keeps_its_measured_spill(tmp_path, monkeypatch):
    # Since the paged copies form their offsets in 32 bits, 64x4x2 spills 24 bytes at this spec (ptxas at the 168
    # registers of three CTAs an SM). It stays the default: on an H200 (GQA 64/8, q_len 4, e4m3 pages of 16, b16-64 x
    # 8k-32k) it ran 1.03-1.04x faster than the spill-free 64x4x2 before the change, and every spill-free config
    # after it 1.08-1.42x slower than it (64x4x1 the nearest; 8 warps 1.16-1.19x). A spill past this bound is news.
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path))
    s = resolve(parse_spec("decode:head_dim=128,q_rows=32,paged=true,kv_dtype=fp8_e4m3"), "sm_90a")
    assert (s.cta_tile_kv, s.num_warps, s.num_stages) == (64, 4, 2), s.to_text()
    r = compile(render(s), "sm_90a", kernel_name=s.kernel_name, entries=s.entries).resources
    assert r.known and r.spill_stores <= 32 and r.spill_loads <= 32, (r.spill_stores, r.spill_loads)
