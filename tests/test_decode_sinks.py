"""Attention sinks in the decode family without a GPU: the `sinks` spec switch (text, name, key, template
arguments), NVRTC builds of sinks kernels of every kind decode runs (fused and unfused, contiguous and paged,
padded rows, head_dim 512's two CTAs a KV head, the sm_90 cluster merge, with the score modifiers and windows),
the host path on the stub driver, and the KV-cache call's routes with sinks against the fp32 reference."""

import re
from pathlib import Path

import pytest

from attngen import DecodeSpec, parse_spec, render, resolve
from attngen.compiler import compile
from attngen.errors import SpecError
from tests import fake_cuda

ROOT = Path(__file__).resolve().parent.parent


def test_sinks_is_a_spec_switch_shown_only_when_on():
    on = parse_spec("decode:head_dim=128,sinks=true")
    off = DecodeSpec(head_dim=128)
    assert on.sinks and not off.sinks
    assert "sinks=true" in str(on) and "sinks" not in str(off)
    assert parse_spec(str(on)) == on and DecodeSpec.from_dict(on.to_dict()) == on
    assert "_sinks_" in on.kernel_name and "sinks" not in off.kernel_name
    with pytest.raises(SpecError, match="sinks"):
        DecodeSpec(sinks="maybe")


def _shape_args(src: str) -> str:
    head = src[src.index("using Kernel = Decode"):].split(";")[0]
    return " ".join(head.split())


def _merge_call(src: str) -> str:
    return " ".join(src[src.index("attngen::split_merge<"):].split(";")[0].split())


@pytest.mark.parametrize("variant", ["fused", "unfused"])
def test_the_switch_reaches_the_shape_and_the_merge(variant):
    on = render(resolve(DecodeSpec(head_dim=128, variant=variant, sinks=True), "sm_90a"))
    off = render(resolve(DecodeSpec(head_dim=128, variant=variant), "sm_90a"))
    # (the shape's arguments end with the logits variants, local, sinks)
    assert _shape_args(on).endswith("Logits, false, true>>") and _shape_args(off).endswith("Logits, false, false>>")
    assert _merge_call(on).endswith(", 1, true>(params)") and _merge_call(off).endswith(", 1, false>(params)")


def _spills(log: str) -> set:
    return {tuple(map(int, m)) for m in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)}


def _texts(b) -> dict:
    """Entry name -> its machine code (.text section) of a build, read as tools/cubin_digests.py reads it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cubin_digests", ROOT / "tools" / "cubin_digests.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return {name.removeprefix(".text."): code for name, code in tool.text_sections(b.cubin)}


@pytest.mark.parametrize("arch,fields", [
    ("sm_80", dict(head_dim=128)),                                                   # fused, contiguous
    ("sm_80", dict(head_dim=64, q_rows=32, paged=True)),                             # (spilled with expf/log1pf)
    ("sm_80", dict(head_dim=64, paged=True, variant="unfused", softcap=True)),       # the unfused kernels
    ("sm_80", dict(head_dim=512, paged=True, local=True)),                           # two CTAs a KV head
    ("sm_90a", dict(head_dim=128)),                                                  # with the cluster merge
    ("sm_90a", dict(head_dim=128, q_rows=32, paged=True, variant="unfused", alibi=True, local=True)),
    ("sm_90a", dict(head_dim=80, q_rows=32, softcap=True, local=True)),              # padded rows
    ("sm_90a", dict(head_dim=512, q_rows=128, paged=True)),                         # (spilled with expf/log1pf)
])
def test_sinks_kernels_compile_without_spills(arch, fields):
    s = resolve(DecodeSpec(sinks=True, **fields), arch)
    b = compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries)
    assert set(_texts(b)) == set(s.entries), (sorted(_texts(b)), s.entries)
    assert b.resources.known and _spills(b.log) == {(0, 0)}, b.log[-2000:]


def test_the_switch_changes_the_normalising_entries_only_where_it_joins():
    # sm_90a, one KV head's rows: the main entry (one split and the cluster merge) and the merge entry both add
    # the sink; the split's partial states are the same computation either way.
    arch = "sm_90a"
    on, off = (resolve(DecodeSpec(head_dim=128, sinks=x), arch) for x in (True, False))
    t_on, t_off = (_texts(compile(render(s), arch, kernel_name=s.kernel_name, entries=s.entries)) for s in (on, off))
    for suffix in ("", "_merge"):
        assert t_on[on.kernel_name + suffix] != t_off[off.kernel_name + suffix], suffix


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_sinks_through_the_host_path_on_the_stub_driver(tmp_path):
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_sinks_decode.py", tmp_path)


def test_torch_op_schema_takes_sinks():
    torch = pytest.importorskip("torch")
    import attngen.torch_ops  # noqa: F401  (registers the ops)

    schema = str(torch.ops.attngen.decode.default._schema)
    assert schema.rstrip().endswith("Tensor? sinks=None) -> (Tensor, Tensor)"), schema


@pytest.mark.parametrize("layout", ["paged, leftpad", "contiguous"])
@pytest.mark.parametrize("n_new,q_len", [(3, 3), (12, 12), (30, 30), (36, 36)])
def test_kvcache_routes_with_sinks(monkeypatch, layout, n_new, q_len):
    """flash_attn_with_kvcache with sinks, the kernels replaced by the fp32 references (test_flash_api): up to 8 new
    tokens, up to 128 // group (here 42, capped at 32) through the decode kernel over a packed q, and past that the
    paged left-pad route (decode calls of 8 tokens) match the reference of the whole call with the sinks, and so
    does more on a contiguous cache (the prefill kernel's route)."""
    torch = pytest.importorskip("torch")
    import attngen
    from tests.gpu_reference import reference_decode
    from tests.test_flash_api import _reference_kernels

    seen = []
    _reference_kernels(monkeypatch, seen)
    gen = torch.Generator().manual_seed(5)
    b, hk, g, d, bs, cap = 2, 2, 3, 16, 32, 128
    old, pads = [0, 70], [0, 9]
    if layout.startswith("paged"):
        kc = torch.randn(b * cap // bs + 1, bs, hk, d, generator=gen)
        table = torch.randperm(b * cap // bs + 1, generator=gen)[: b * cap // bs].to(torch.int32).reshape(b, -1)
        lp = torch.tensor(pads, dtype=torch.int32)
    else:
        kc, table, lp, pads = torch.randn(b, cap, hk, d, generator=gen), None, None, None
    vc = torch.randn(kc.shape, generator=gen)
    q = torch.randn(b, q_len, hk * g, d, generator=gen)
    k, v = torch.randn(b, n_new, hk, d, generator=gen), torch.randn(b, n_new, hk, d, generator=gen)
    # ordinary sinks, one far above every score, and none (-inf)
    sinks = torch.tensor([0.5, -1.0, 40.0, float("-inf"), 2.0, -3.0])
    call = dict(cache_seqlens=torch.tensor(old, dtype=torch.int32), block_table=table, cache_leftpad=lp,
                causal=True, return_softmax_lse=True, softmax_scale=0.4, sinks=sinks)
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k, v, **call)
    if 8 < q_len <= 32:  # the decode kernel over a packed q, sinks and all
        assert seen == [("packed", q_len)], seen
    elif q_len > 8 and layout == "contiguous":  # the prefill kernel over the cache, sinks and all
        assert len(seen) == 1 and seen[0][0] in ("rows", "prefill"), seen
    else:
        assert [n for _, n in seen] == ([q_len] if q_len <= 8 else [8] * (q_len // 8) + [q_len % 8]), seen
    ref, ref_lse = reference_decode(q, kc, vc, [o + n_new for o in old], block_table=table, sm_scale=0.4,
                                    cache_leftpad=pads, sinks=sinks)
    assert (out - ref).abs().max().item() < 1e-5
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin) and (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-4
