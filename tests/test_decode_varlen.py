"""A packed, ragged q in the decode family without a GPU: the `varlen_q` and `tree` spec switches (text, name, key,
template arguments, what they refuse), NVRTC builds of the packed kernels spill-free at head dims 64/128/256 on sm_80
and sm_90a (contiguous and paged, every row count, with and without a tree, fp8 caches, the merge entry), and the host path on the
stub driver (parameters, shapes, errors). The GPU checks are tests/test_gpu_decode_varlen.py."""

import re

import pytest

from attngen import DecodeSpec, parse_spec, render, resolve
from attngen.compiler import compile
from attngen.errors import SpecError
from attngen.families.decode import defaults
from tests import fake_cuda


def test_switches_are_shown_only_when_on():
    on = parse_spec("decode:head_dim=128,q_rows=64,varlen_q=true,tree=true")
    off = DecodeSpec(head_dim=128, q_rows=64)
    assert on.varlen_q and on.tree and not off.varlen_q and not off.tree
    assert "varlen_q=true" in str(on) and "tree=true" in str(on)
    assert "varlen_q" not in str(off) and "tree" not in str(off) and "varlen_q" not in off.to_dict()
    assert parse_spec(str(on)) == on and DecodeSpec.from_dict(on.to_dict()) == on
    assert "_varlenq_tree_" in on.kernel_name and "varlen" not in off.kernel_name
    plain = DecodeSpec(head_dim=128, q_rows=64, varlen_q=True)
    assert len({on.digest(), plain.digest(), off.digest()}) == 3


@pytest.mark.parametrize("fields,field", [
    (dict(tree=True), "tree"),
    (dict(varlen_q=True, variant="unfused"), "variant"),
    (dict(varlen_q=True, head_dim=512), "head_dim"),
    (dict(varlen_q=True, tree=True, local=True), "local"),
    (dict(varlen_q=True, mask_mod="return true;"), "score_mod"),
])
def test_what_the_switches_refuse(fields, field):
    with pytest.raises(SpecError) as e:
        DecodeSpec(**fields)
    assert e.value.field == field and "varlen_q" in str(e.value), str(e.value)


def _shape_args(src: str) -> str:
    return " ".join(src[src.index("using Kernel = Decode"):].split(";")[0].split())


def _merge_call(src: str) -> str:
    return " ".join(src[src.index("attngen::split_merge<"):].split(";")[0].split())


def test_the_switches_reach_the_shape_the_params_and_the_merge():
    on = render(resolve(DecodeSpec(head_dim=128, q_rows=64, varlen_q=True, tree=True), "sm_90a"))
    plain = render(resolve(DecodeSpec(head_dim=128, q_rows=64, varlen_q=True), "sm_90a"))
    off = render(resolve(DecodeSpec(head_dim=128, q_rows=64), "sm_90a"))
    assert _shape_args(on).endswith("false, 0, true, true>>") and _shape_args(plain).endswith("false, 0, true, false>>")
    assert _shape_args(off).endswith("false, false>>"), _shape_args(off)
    assert _merge_call(on).endswith(", 1, false, true>(params)") and _merge_call(off).endswith(", 1, false>(params)")
    assert "#define ATTNGEN_DECODE_VARLEN" in on and "ATTNGEN_DECODE_VARLEN" not in off.split("namespace attngen")[0]


def test_a_spilling_config_is_not_a_packed_default():
    for (where, config), archs in defaults.SPILLS_ON.items():
        if len(where) == 5 and where[4].endswith(("varlen", "tree")):
            d, paged, rows, variant, mod = where
            spec = DecodeSpec(head_dim=d, paged=paged, q_rows=rows, variant=variant, varlen_q=True,
                              tree=mod.endswith("tree"), kv_dtype="fp8_e4m3" if mod.startswith("fp8") else None)
            for arch in archs:
                r = resolve(spec, arch)
                assert (r.cta_tile_kv, r.num_warps, r.num_stages) != config, (where, arch)


def _spills(log: str) -> set:
    return {tuple(map(int, m)) for m in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("fields", [
    dict(head_dim=64, q_rows=32),
    dict(head_dim=64, q_rows=64, paged=True, tree=True),
    dict(head_dim=128, q_rows=16, tree=True),
    dict(head_dim=128, q_rows=64, paged=True),
    dict(head_dim=128, q_rows=64, tree=True, dtype="fp16"),
    dict(head_dim=128, q_rows=128, paged=True, tree=True),
    dict(head_dim=256, q_rows=16, paged=True, tree=True),
    dict(head_dim=256, q_rows=32),
    dict(head_dim=128, q_rows=32, sinks=True, softcap=True, local=True),
    dict(head_dim=64, q_rows=64, kv_dtype="fp8_e4m3", tree=True),
    dict(head_dim=128, q_rows=64, kv_dtype="fp8_e4m3", paged=True, tree=True),
    dict(head_dim=256, q_rows=16, kv_dtype="fp8_e5m2", dtype="fp16", paged=True),
], ids=lambda f: "_".join(f"{k}{v}" for k, v in f.items()))
def test_packed_kernels_compile_without_spills(arch, fields):
    s = resolve(DecodeSpec(varlen_q=True, **fields), arch)
    b = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries)
    assert b.resources.known and _spills(b.log) == {(0, 0)}, (str(s), b.log[-2000:])


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_packed_q_through_the_host_path_on_the_stub_driver(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_decode_varlen.py", tmp_path)
