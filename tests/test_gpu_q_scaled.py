"""Prefill's q_scaled on a real GPU (pytest -m gpu; sm_90a): Q's tile times sm_scale in registers, score_mod taking the
MMA's scores as logits, against the fp64 reference of tests/test_gpu_snippets.py.

Every kernel form that takes it (the TMA serial persistent, overlapped and ping-pong persistent kernels; varlen, paged
and custom-mask calls), score_mods that read positions (ALiBi, a relative-position table) and one that reads none
(softcap), with sinks, rows before position 0 (which take no score_mod and keep the MMA's logits) and mask_mods beside
them, fp16 and bf16, the scales 1/8 and 1/16; the choice a call without a spec makes (on where the scale is a power of
two, off where not, both against the reference), and the call refused where a spec asks for it with another scale.
Inputs sit in NaN-filled buffers, outputs are NaN-poisoned views of a sentinel-filled buffer.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.errors import LaunchError  # noqa: E402
from attngen.families.prefill import op, plans  # noqa: E402
from attngen.families.prefill.choose import SHORT_CAUSAL_TMA  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.test_gpu_prefill_serving import check_sentinel, guarded, sentinel_out  # noqa: E402
from tests.test_gpu_snippets import VARIANTS, aux_of, compare, reference, run_varlen  # noqa: E402

if torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("q_scaled is the sm_90a wgmma kernels'", allow_module_level=True)


def _fields(d):
    return {k: getattr(v, "value", v) for k, v in d.items()}


TMA = dict(mma="wgmma", pipeline="tma", num_stages=2)
FORMS = {
    "tma_serial_persistent": (128, _fields(SHORT_CAUSAL_TMA)),
    "tma_pingpong_persistent": (64, dict(TMA, cta_tile_q=128, cta_tile_kv=128, num_warps=8, schedule="pingpong",
                                         persistent="true")),
    "tma_overlap": (64, dict(TMA, cta_tile_q=128, cta_tile_kv=128, num_warps=8, schedule="overlap",
                             persistent="false")),
    "tma_overlap_one_group": (64, dict(TMA, cta_tile_q=64, cta_tile_kv=128, num_warps=4, schedule="overlap",
                                       persistent="false")),
}


def run(variant, *, d, sq, sk, b=2, h=4, hk=2, dtype=torch.bfloat16, causal=False, sinks=False, spec=None,
        scale=None):
    """One prefill call of ``variant`` against the reference; returns its output."""
    gen = fresh_generator()
    q = guarded(b, sq, h, d, dtype=dtype, gen=gen)
    k = guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    v = guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    score_mod, mask_mod, t_score, t_mask = VARIANTS[variant]
    if spec is not None and spec.get("q_scaled"):
        spec = {**spec, "score_mod": score_mod}  # (q_scaled names the score_mod it serves; aux: the call's)
    aux = aux_of(variant, b, h, sk, gen)
    snk = torch.randn(h, generator=gen, device="cuda") if sinks else None
    out, buf, guards = sentinel_out((b, sq, h, d), dtype)
    o, lse = attngen.prefill(q, k, v, causal=causal, return_lse=True, out=out, spec=spec, sinks=snk, sm_scale=scale,
                             score_mod=score_mod, mask_mod=mask_mod, aux=aux)
    torch.cuda.synchronize()
    check_sentinel(buf, guards)
    ref_o, ref_l = reference(q, k, v, d ** -0.5 if scale is None else scale, causal=causal, sinks=snk,
                             score=t_score(aux) if t_score else None, mask=t_mask(aux) if t_mask else None)
    compare(o, lse, ref_o, ref_l, dtype, f"({variant}, d={d}, {sq}x{sk}, causal={causal}, spec={spec})")
    return o


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("variant", ["alibi", "softcap", "rel", "alibi+doc"])
def test_every_kernel_form(form, variant):
    d, fields = FORMS[form]
    spec = {"family": "prefill", "q_scaled": True, **fields}
    scale = None if d == 64 else 0.125  # (head dim 128's own scale is no power of two)
    run(variant, d=d, sq=300, sk=300, causal=True, sinks=True, spec={**spec, "sinks": True, "mask": "causal"},
        scale=scale)
    run(variant, d=d, sq=130, sk=461, spec=spec, scale=scale)
    run(variant, d=d, sq=300, sk=90, spec=spec, scale=scale)  # rows before position 0: the MMA's logits kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale", [0.125, 0.0625, 1.0])
def test_dtypes_and_scales(dtype, scale):
    spec = {"family": "prefill", "q_scaled": True, **FORMS["tma_pingpong_persistent"][1]}
    run("alibi", d=64, sq=257, sk=257, dtype=dtype, spec=spec, scale=scale)
    run("softcap", d=64, sq=100, sk=700, dtype=dtype, spec=spec, scale=scale)


def test_a_call_without_a_spec_takes_it_where_the_scale_is_a_power_of_two():
    for variant, scale, causal, taken in (("alibi", None, False, True), ("alibi", 0.1, False, False),
                                          ("softcap", None, True, True), ("doc", None, False, False)):
        op._calls.clear()
        run(variant, d=64, sq=1100, sk=1100, b=1, scale=scale, causal=causal)  # the 128-row TMA kernel
        (c,) = [c for c in op._calls.values() if c.grid is not None][-1:]
        assert c.kern.spec.q_scaled is taken, (variant, scale)


def test_varlen_paged_and_custom_mask_calls_take_it():
    plans.clear_plans()
    lens = ([37, 1, 0, 130, 64], [37, 50, 9, 300, 64])
    run_varlen("alibi", *lens, causal=False, sinks=True)
    run_varlen("rel", *lens, block_size=16, causal=False)
    run("alibi+doc", d=64, sq=300, sk=300)  # a score_mod and a mask_mod: the mask_mod plan's kernel
    specs = [s for p in plans._plans.values() for s in ([p.kernel.spec] if p.kernel else getattr(p, "specs", []))]
    taken = {s.kernel_name for s in specs if s.q_scaled}
    assert any("_varlen_" in n for n in taken) and any("_cmask_" in n for n in taken), taken


def test_a_spec_that_asks_for_it_refuses_another_scale():
    gen = fresh_generator()
    q = torch.randn(1, 64, 4, 64, generator=gen, device="cuda").bfloat16()
    k = torch.randn(1, 64, 2, 64, generator=gen, device="cuda").bfloat16()
    score_mod, _, _, _ = VARIANTS["softcap"]
    spec = {"family": "prefill", "q_scaled": True, "score_mod": score_mod, **FORMS["tma_overlap"][1]}
    with pytest.raises(LaunchError, match="q_scaled=true"):
        attngen.prefill(q, k, k, spec=spec, score_mod=score_mod, sm_scale=0.1)
    attngen.prefill(q, k, k, spec=spec, score_mod=score_mod, sm_scale=0.25)
    torch.cuda.synchronize()


@pytest.mark.parametrize("causal, b, s, h", [(True, 2, 4096, 16), (False, 8, 1024, 32)], ids=["causal", "full"])
def test_persistent_ctas_walking_many_query_tiles_against_the_switch(causal, b, s, h):
    # More query tiles than the grid's CTAs: each CTA reads a new tile's Q fragments in every pass. ALiBi's snippet
    # against the alibi_slopes switch, return score; against no variant (the switches are themselves tested against
    # the reference).
    gen = fresh_generator()
    hk, d = h // 4, 64
    q, k, v = (torch.randn(b, s, n, d, generator=gen, device="cuda").bfloat16() for n in (h, hk, hk))
    slope = torch.rand(h, generator=gen, device="cuda") * 0.3
    op._calls.clear()
    a = attngen.prefill(q, k, v, causal=causal, score_mod=VARIANTS["alibi"][0], aux={"slope": slope})
    (c,) = [c for c in op._calls.values() if c.grid is not None][-1:]
    assert c.kern.spec.q_scaled and c.kern.spec.is_persistent and c.grid[0] < b * h * s // 128
    ref = attngen.prefill(q, k, v, causal=causal, alibi_slopes=slope)
    assert (a.float() - ref.float()).abs().max().item() < 2e-2
    a = attngen.prefill(q, k, v, causal=causal, score_mod="return score;")
    ref = attngen.prefill(q, k, v, causal=causal)
    assert (a.float() - ref.float()).abs().max().item() < 2e-2
