"""A mask_mod's block plan on a real GPU (pytest -m gpu): ``attngen.prefill(..., mask_mod=...)`` walks only the KV
tiles the snippet keeps somewhere and skips it on those it keeps whole (attngen/families/prefill/masks.py,
build_mod; templates/prefill/mod_plan.cuh).

Against the fp64 reference of tests/test_gpu_snippets.py (outputs NaN-poisoned inside a sentinel buffer, inputs in
NaN-filled ones, the LSE checked): a document mask, prefix-LM, a sliding window with global tokens, a mask_mod that
drops whole rows, one that reads h and an aux tensor, with and without causal, lengths that are no multiple of the
tiles and seqlen_q above and below seqlen_k; with score_mod and sinks; and the plan itself: its tile states read back
against an independent torch count of each tile's visible and kept pairs, its units by the b/h rule, reuse across
calls and its refusals.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.errors import LaunchError, SpecError  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.test_gpu_prefill_serving import check_sentinel, guarded, range_keep, sentinel_out  # noqa: E402
from tests.test_gpu_snippets import ALIBI, DOC, PREFIX, SWA_GLOBAL, compare, reference, t_alibi  # noqa: E402

LATE_ROWS = "return q_idx >= 300 && kv_idx < q_idx + 40;"  # rows below 300 see nothing: whole dead tiles
HEAD_SPAN = "return kv_idx <= q_idx + 5 && q_idx - kv_idx < span(h);"  # per head (aux [heads])
HEAD_SPAN_BOTH = "return doc(b, q_idx) == doc(b, kv_idx) && q_idx - kv_idx < span(h);"


def _doc(b, sk, gen):
    cuts = (torch.rand(b, sk, generator=gen, device="cuda") < 0.004).to(torch.int32)  # documents of ~250 tokens
    return {"doc": torch.cumsum(cuts, dim=1, dtype=torch.int32)}


# name -> (mask_mod, aux maker (b, h, sk, gen), torch twin (aux) -> (B, H, Q, K) -> keep, reads (b, h))
MASKS = {
    "doc": (DOC, lambda b, h, sk, gen: _doc(b, sk, gen),
            lambda a: lambda B, H, Q, K: a["doc"][B, Q] == a["doc"][B, K], (True, False)),
    "prefix": (PREFIX, lambda b, h, sk, gen: {"prefix": torch.tensor([sk // 3, 7], dtype=torch.int32,
                                                                     device="cuda")[:b]},
               lambda a: lambda B, H, Q, K: (K <= Q) | (K < a["prefix"][B]), (True, False)),
    "swa_global": (SWA_GLOBAL, lambda b, h, sk, gen: {},
                   lambda a: lambda B, H, Q, K: ((K <= Q) & (Q - K < 24)) | (K < 3) | (Q < 3), (False, False)),
    "late_rows": (LATE_ROWS, lambda b, h, sk, gen: {},
                  lambda a: lambda B, H, Q, K: (Q >= 300) & (K < Q + 40), (False, False)),
    "head_span": (HEAD_SPAN, lambda b, h, sk, gen: {"span": torch.tensor([1, 64, 300, 100000], dtype=torch.int32,
                                                                         device="cuda")[:h]},
                  lambda a: lambda B, H, Q, K: (K <= Q + 5) & (Q - K < a["span"][H]), (False, True)),
    "head_span_doc": (HEAD_SPAN_BOTH, lambda b, h, sk, gen: {**_doc(b, sk, gen), "span": torch.tensor(
                          [50, 400, 1000, 100000], dtype=torch.int32, device="cuda")[:h]},
                      lambda a: lambda B, H, Q, K: (a["doc"][B, Q] == a["doc"][B, K]) & (Q - K < a["span"][H]),
                      (True, True)),
}


def run(name, *, b=2, sq=1000, sk=1000, h=4, hk=2, d=64, causal=False, window=(-1, -1), score=False, sinks=False,
        spec=None, plan=None):
    gen = fresh_generator()
    mask_mod, make, twin, _ = MASKS[name]
    q = guarded(b, sq, h, d, dtype=torch.bfloat16, gen=gen)
    k = guarded(b, sk, hk, d, dtype=torch.bfloat16, gen=gen)
    v = guarded(b, sk, hk, d, dtype=torch.bfloat16, gen=gen)
    aux = make(b, h, sk, gen)
    if score:
        aux["slope"] = torch.rand(h, generator=gen, device="cuda") * 0.3
    snk = torch.randn(h, generator=gen, device="cuda") if sinks else None
    out, buf, guards = sentinel_out((b, sq, h, d), torch.bfloat16)
    extra = {} if plan is None else {"mask_plan": plan(q, k, aux)}
    o, lse = attngen.prefill(q, k, v, causal=causal, window=window, return_lse=True, out=out, sinks=snk, spec=spec,
                             score_mod=ALIBI if score else "", mask_mod=mask_mod, aux=aux, **extra)
    torch.cuda.synchronize()
    assert o is out
    check_sentinel(buf, guards)
    ref_o, ref_l = reference(q, k, v, d ** -0.5, causal=causal, window=window, sinks=snk, mask=twin(aux),
                             score=t_alibi(aux) if score else None)
    compare(o, lse, ref_o, ref_l, torch.bfloat16, f"({name}, sq={sq}, sk={sk}, causal={causal}, window={window})")
    return q, k, v, aux, o, lse


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (1537, 1537), (700, 1537), (1100, 1000)])
def test_plan_matches_the_reference(name, causal, sq, sk):
    run(name, sq=sq, sk=sk, causal=causal)


@pytest.mark.parametrize("name", ["doc", "head_span_doc", "late_rows"])
@pytest.mark.parametrize("d", [128, 256])
def test_plan_with_score_mod_sinks_and_window(name, d):
    run(name, d=d, sq=1537, sk=1537, causal=True, score=True, sinks=True)
    run(name, d=d, sq=1000, sk=1000, window=(333, 17), score=True)


def tile_states_by_torch(name, aux, b, h, sq, sk, causal, window, tiles):
    """[units, q tiles, kv tiles] of 0 (no visible pair kept), 2 (every visible pair kept), 1 (some), computed from
    the torch twin on every pair: the plan's definition (templates/prefill/mod_plan.cuh)."""
    _, _, twin, (reads_b, reads_h) = MASKS[name]
    ub, uh = (b if reads_b else 1), (h if reads_h else 1)
    B = torch.arange(ub, device="cuda").repeat_interleave(uh)[:, None, None]
    H = torch.arange(uh, device="cuda").repeat(ub)[:, None, None]
    Qraw = (torch.arange(sq, device="cuda") + sk - sq)[None, :, None]
    K = torch.arange(sk, device="cuda")[None, None, :]
    visible = range_keep(sq, sk, causal, window)[None].expand(ub * uh, sq, sk)
    kept = visible & twin(aux)(B, H, Qraw.clamp(min=0), K) & (Qraw >= 0)
    tq, tk = tiles
    nqt, nkt = -(-sq // tq), -(-sk // tk)

    def per_tile(x):
        x = torch.nn.functional.pad(x.int(), (0, nkt * tk - sk, 0, nqt * tq - sq))
        return x.reshape(ub * uh, nqt, tq, nkt, tk).sum(dim=(2, 4))

    n_vis, n_kept = per_tile(visible), per_tile(kept)
    states = torch.where(n_kept == 0, 0, torch.where(n_kept == n_vis, 2, 1))
    return states.cpu().numpy(), (ub, uh)


@pytest.mark.parametrize("name", sorted(MASKS))
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (400, 30))],
                         ids=["full", "causal", "window"])
@pytest.mark.parametrize("sq, sk", [(1537, 1537), (700, 1000), (1100, 1000)])
def test_plan_tile_states_match_torch(name, causal, window, sq, sk):
    gen = fresh_generator()
    b, h, d = 2, 4, 128
    q = torch.randn(b, sq, h, d, generator=gen, device="cuda").bfloat16()
    k = torch.randn(b, sk, 2, d, generator=gen, device="cuda").bfloat16()
    mask_mod, make, _, _ = MASKS[name]
    aux = make(b, h, sk, gen)
    mp = attngen.mask_plan(None, q, k, causal=causal, window=window, mask_mod=mask_mod, aux=aux)
    want, units = tile_states_by_torch(name, aux, b, h, sq, sk, causal, window, mp.tiles)
    assert (mp.units_b, mp.units_h) == units
    got = mp.tile_states()
    assert got.shape == want.shape
    bad = (got != want).nonzero()
    assert not bad[0].size, f"{bad[0].size} tile states differ, first at {tuple(int(x[0]) for x in bad)}: " \
                            f"{got[tuple(x[0] for x in bad)]} != {want[tuple(x[0] for x in bad)]}"
    counts = mp.live_counts()
    assert (counts.cpu().numpy() == (want > 0).sum(axis=-1)).all()
    assert (want == 0).any() or name == "prefix"  # (the cases do have dead tiles to skip)
    # where the snippet reads aux, every partial tile asked the pool for a slot: the count is theirs, and the pool
    # had room for them here; index arithmetic alone keeps no pool
    found, slots = mp.pooled_tiles()
    if aux:
        assert found == int((want == 1).sum()) and found <= slots
    else:
        assert (found, slots) == (0, 0)


@pytest.mark.parametrize("name, causal", [("doc", True), ("head_span_doc", False), ("prefix", False)])
@pytest.mark.parametrize("d", [64, 128])
def test_a_full_pool_leaves_its_other_tiles_to_mask_mod(monkeypatch, name, causal, d):
    from attngen.families.prefill import masks

    sq = 1537
    plan = lambda q, k, a: attngen.mask_plan(None, q, k, causal=causal, mask_mod=MASKS[name][0], aux=a)  # noqa: E731
    q, k, v, aux, o, lse = run(name, sq=sq, sk=sq, d=d, causal=causal, plan=plan)  # (checked: the reference)
    full = plan(q, k, aux)
    found, slots = full.pooled_tiles()
    # where a slot for every tile fits, the plan has one, and the call ran the kernel with no mask_mod (mod_bits)
    assert 3 < found <= slots and full.holds_every_tile()
    tq, tk = plan(q, k, aux).tiles
    monkeypatch.setattr(masks, "POOL_BYTES", 3 * tq * tk // 8)  # three slots: the other partial tiles run mask_mod
    small = plan(q, k, aux)
    assert small.pooled_tiles() == (found, 3)
    o3, lse3 = attngen.prefill(q, k, v, causal=causal, return_lse=True, mask_mod=MASKS[name][0], aux=aux,
                               mask_plan=small)
    # the same keep bits either way, so the same arithmetic: equal outputs (the call's kernel runs no mask_mod: with
    # this plan it runs the form that does, on the tiles past the pool)
    assert torch.equal(o3, o) and torch.equal(lse3, lse)


def test_mod_bits_pinned_by_the_caller():
    from attngen.families.prefill.spec import PrefillSpec

    sq = 1100
    # (the call's own fields replace these; mod_bits needs a mask_mod that reads aux, so the spec names it)
    pinned = PrefillSpec(mod_bits=True, custom_mask=True, mask_mod=DOC, aux="doc:int32:2")
    q, k, v, aux, o, lse = run("doc", sq=sq, sk=sq, d=128, causal=True, spec=pinned)
    o2, lse2 = attngen.prefill(q, k, v, causal=True, return_lse=True, mask_mod=DOC, aux=aux)  # the default's form
    assert (o2.float() - o.float()).abs().max().item() < 2e-2 and (lse2 - lse).abs().max().item() < 2e-2
    keep = torch.ones(sq, sq, dtype=torch.bool, device="cuda")
    with pytest.raises(LaunchError, match="mod_bits=true"):
        attngen.prefill(q, k, v, causal=True, mask=keep, mask_mod=DOC, aux=aux, spec=pinned)
    with pytest.raises(SpecError, match="mod_bits"):  # no plan: a kernel of no custom mask, which has no pool
        attngen.prefill(q, k, v, causal=True, mask_mod=DOC, aux=aux, spec=pinned, mask_plan="off")


def test_mod_bits_pinned_past_the_pools_bound(monkeypatch):
    from attngen.families.prefill import masks
    from attngen.families.prefill.spec import PrefillSpec

    sq = 1100
    q, k, v, aux, _, _ = run("doc", sq=sq, sk=sq, d=128, causal=True)  # (the default: mod_bits, every tile a slot)
    monkeypatch.setattr(masks, "POOL_BYTES", 2048 * 3)  # three 128 x 128 tiles' bits
    pinned = PrefillSpec(mod_bits=True, custom_mask=True, mask_mod=DOC, aux="doc:int32:2")
    with pytest.raises(LaunchError, match="mod_bits=true needs the keep bits of all"):
        attngen.prefill(q, k, v, causal=True, mask_mod=DOC, aux=aux, spec=pinned)


def test_plan_reuse_and_off():
    sq = 1537
    q, k, v, aux, o, lse = run("head_span_doc", sq=sq, sk=sq, causal=True, plan=lambda q, k, a: attngen.mask_plan(
        None, q, k, causal=True, mask_mod=HEAD_SPAN_BOTH, aux=a))
    o_off, lse_off = attngen.prefill(q, k, v, causal=True, return_lse=True, mask_mod=HEAD_SPAN_BOTH, aux=aux,
                                     mask_plan="off")
    # the plan built per call and one built apart run one kernel over the same lists: the same bits
    o_auto, lse_auto = attngen.prefill(q, k, v, causal=True, return_lse=True, mask_mod=HEAD_SPAN_BOTH, aux=aux)
    assert torch.equal(o_auto, o) and torch.equal(lse_auto, lse)
    assert (o_off.float() - o.float()).abs().max().item() < 2e-2
    fin = torch.isfinite(lse)
    assert torch.equal(torch.isfinite(lse_off), fin) and (lse_off[fin] - lse[fin]).abs().max().item() < 2e-2
    mp = attngen.mask_plan(None, q, k, causal=True, mask_mod=HEAD_SPAN_BOTH, aux=aux)
    assert 0 < mp.live_fraction() < 0.5  # (causal, documents and spans: most tiles dead)
    o_mp, _ = attngen.prefill(q, k, v, causal=True, return_lse=True, mask_mod=HEAD_SPAN_BOTH, aux=aux, mask_plan=mp)
    assert torch.equal(o_mp, o)
    with pytest.raises(LaunchError, match="causal/window"):
        attngen.prefill(q, k, v, mask_mod=HEAD_SPAN_BOTH, aux=aux, mask_plan=mp)
    with pytest.raises(LaunchError, match="another mask_mod"):
        attngen.prefill(q, k, v, causal=True, mask_mod=DOC, aux={"doc": aux["doc"]}, mask_plan=mp)
    aux["span"].add_(1)  # in place: the plan no longer says what the snippet keeps
    with pytest.raises(LaunchError, match="other aux tensors"):
        attngen.prefill(q, k, v, causal=True, mask_mod=HEAD_SPAN_BOTH, aux=aux, mask_plan=mp)
    keep = torch.ones(sq, sq, dtype=torch.bool, device="cuda")
    with pytest.raises(LaunchError, match="built from a mask_mod"):
        attngen.prefill(q, k, v, causal=True, mask=keep, mask_plan=mp)
    with pytest.raises(LaunchError, match="mask_plan='off' is not allowed with a mask tensor"):
        attngen.prefill(q, k, v, causal=True, mask=keep, mask_plan="off")
