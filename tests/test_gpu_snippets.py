"""score_mod / mask_mod snippets on a real GPU (pytest -m gpu), against an fp64 reference of their definition.

The reference computes the scaled logits, applies the snippet's torch twin on index grids (b, the query head h,
q_idx the query's aligned position i + seqlen_k - seqlen_q, kv_idx the key's), drops what mask_mod and the range
masks drop, and runs the softmax (with the sinks as one more column where given). Positions below 0 (a decode row
shorter than its new tokens) take no snippet: mask_mod drops them, score_mod leaves them.

Variants: ALiBi as a score_mod (against the reference and the built-in alibi_slopes switch), softcap as a score_mod
(and against softcap=), a relative-position bias table (fp32 and a strided bf16 view), a document mask (int32 and
int64 ids), prefix-LM, a sliding window with global tokens, a bool keep table, rows every key of which is dropped
(zeros and LSE -inf, or the sink); combined with causal, windows and sinks; every whole-row kernel form on sm_90a;
varlen contiguous and paged; a custom mask tensor with mask_mod; decode contiguous, paged and split-KV; the
FlashAttention-named calls. Inputs sit in NaN-filled buffers (paged caches NaN past every row), outputs are
NaN-poisoned views of a sentinel-filled buffer.
"""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.families.prefill.choose import SHORT_CAUSAL, SHORT_CAUSAL_TMA, THREE_GROUPS  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.test_gpu_decode import NAN, Case  # noqa: E402
from tests.test_gpu_prefill_serving import _cu, check_sentinel, guarded, range_keep, sentinel_out  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
NEG_INF = float("-inf")
L = 4096  # the relative bias table's offset: |q_idx - kv_idx| < L in every test here

ALIBI = "return score - slope(h) * fabsf((float)(q_idx - kv_idx));"
SOFTCAP = "return 8.f * tanhf(score * 0.125f);"
REL = "return score + rel(h, q_idx - kv_idx + 4096);"
DOC = "return doc(b, q_idx) == doc(b, kv_idx);"
PREFIX = "return kv_idx <= q_idx || kv_idx < prefix(b);"
SWA_GLOBAL = "bool near = kv_idx <= q_idx && q_idx - kv_idx < 24;\nreturn near || kv_idx < 3 || q_idx < 3;"
KEEP = "return keep(q_idx, kv_idx) != 0;"
HOLES = "return q_idx % 5 != 2;"  # rows every key of which is dropped


# --- the torch twins: (s, B, H, Q, K) -> s, or (B, H, Q, K) -> bool keep; index grids broadcast to [B, H, Sq, Sk] --

def t_alibi(aux):
    return lambda s, B, H, Q, K: s - aux["slope"].double()[H] * (Q - K).abs()


def t_softcap(aux):
    return lambda s, B, H, Q, K: 8.0 * torch.tanh(s / 8.0)


def t_rel(aux):
    return lambda s, B, H, Q, K: s + aux["rel"].double()[H, Q - K + L]


def t_doc(aux):
    return lambda B, H, Q, K: aux["doc"][B, Q] == aux["doc"][B, K]


def t_prefix(aux):
    return lambda B, H, Q, K: (K <= Q) | (K < aux["prefix"][B])


def t_swa_global(aux):
    return lambda B, H, Q, K: ((K <= Q) & (Q - K < 24)) | (K < 3) | (Q < 3)


def t_keep(aux):
    return lambda B, H, Q, K: aux["keep"][Q, K] != 0


def t_holes(aux):
    return lambda B, H, Q, K: Q % 5 != 2


def reference(q, k, v, scale, *, causal=False, window=(-1, -1), keep=None, score=None, mask=None, sinks=None, b0=0,
              softcap=0.0, alibi=None):
    """(out fp32 [B, Sq, H, Dv], lse fp32 [B, H, Sq]) in fp64 by the definition (module docstring); softcap and alibi
    (built-ins) apply before the snippets, as in the kernels; ``b0``: the batch index of q's first row."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dev = q.device
    qf = q.double().transpose(1, 2)
    kf = k.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    vf = v.double().transpose(1, 2).repeat_interleave(h // hk, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    B = torch.arange(b, device=dev)[:, None, None, None] + b0
    H = torch.arange(h, device=dev)[None, :, None, None]
    Qraw = (torch.arange(sq, device=dev) + sk - sq)[None, None, :, None]
    K = torch.arange(sk, device=dev)[None, None, None, :]
    live = Qraw >= 0  # positions below 0 take no snippet
    Q = Qraw.clamp(min=0)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        s = s - alibi.double()[None, :, None, None] * (Qraw - K).abs()
    if score is not None:
        s = torch.where(live, score(s, B, H, Q, K), s)
    kp = range_keep(sq, sk, causal, window)[None, None]
    if keep is not None:
        kp = kp & keep
    if mask is not None:
        kp = kp & mask(B, H, Q, K) & live
    s = s.masked_fill(~kp, NEG_INF)
    if sinks is not None:
        s = torch.cat([s, sinks.double()[None, :, None, None].expand(b, h, sq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return torch.matmul(p, vf).transpose(1, 2).float(), lse.float()


def compare(o, lse, ref_o, ref_l, dtype, what=""):
    assert torch.isfinite(o).all(), f"unwritten (NaN) or non-finite output elements {what}"
    err = (torch.linalg.vector_norm(o.float() - ref_o) / torch.linalg.vector_norm(ref_o).clamp_min(1e-30)).item()
    assert err < TOL[dtype], f"rel L2 error {err:.3e} {what}"
    fin = torch.isfinite(ref_l)
    assert not torch.isnan(lse).any(), what
    assert torch.equal(torch.isfinite(lse), fin), f"LSE finite where the reference's is -inf, or the reverse {what}"
    if fin.any():
        lerr = (lse[fin] - ref_l[fin]).abs().max().item()
        assert lerr < 2e-2, f"LSE max abs error {lerr:.3e} {what}"
    empty = ~fin
    if empty.any():  # rows that see no key (and no sink): zeros
        assert (o.transpose(1, 2)[empty] == 0).all(), what


def make_aux(name, b, h, sk, gen):
    """The aux tensors of variant ``name`` (fresh random values; doc ids in runs of random length)."""
    dev = "cuda"
    if name == "alibi":
        return {"slope": torch.rand(h, generator=gen, device=dev) * 0.3}
    if name == "rel":
        return {"rel": torch.randn(h, 2 * L, generator=gen, device=dev)}
    if name == "doc":
        cuts = (torch.rand(b, sk, generator=gen, device=dev) < 0.05).to(torch.int32)
        return {"doc": torch.cumsum(cuts, dim=1, dtype=torch.int32)}
    if name == "prefix":
        return {"prefix": torch.randint(0, sk + 1, (b,), generator=gen, device=dev, dtype=torch.int32)}
    if name == "keep":
        return {"keep": torch.rand(sk, sk, generator=gen, device=dev) > 0.4}
    return {}


# name -> (score_mod, mask_mod, torch twin of the score, of the mask)
VARIANTS = {
    "alibi": (ALIBI, "", t_alibi, None),
    "softcap": (SOFTCAP, "", t_softcap, None),
    "rel": (REL, "", t_rel, None),
    "doc": ("", DOC, None, t_doc),
    "prefix": ("", PREFIX, None, t_prefix),
    "swa_global": ("", SWA_GLOBAL, None, t_swa_global),
    "keep": ("", KEEP, None, t_keep),
    "holes": ("", HOLES, None, t_holes),
    "alibi+doc": (ALIBI, DOC, t_alibi, t_doc),
}


def aux_of(variant, b, h, sk, gen):
    aux = {}
    for part in variant.split("+"):
        aux.update(make_aux(part, b, h, sk, gen))
    return aux


def run_dense(variant, *, b=2, sq=77, sk=77, h=4, hk=2, d=64, dtype=torch.bfloat16, causal=False, window=(-1, -1),
              sinks=False, spec=None, aux_override=None, **extra):
    gen = fresh_generator()
    q = guarded(b, sq, h, d, dtype=dtype, gen=gen)
    k = guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    v = guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    score_mod, mask_mod, t_score, t_mask = VARIANTS[variant]
    aux = aux_of(variant, b, h, sk, gen) if aux_override is None else aux_override
    snk = torch.randn(h, generator=gen, device="cuda") if sinks else None
    out, buf, guards = sentinel_out((b, sq, h, d), dtype)
    o, lse = attngen.prefill(q, k, v, causal=causal, window=window, return_lse=True, out=out, spec=spec, sinks=snk,
                             score_mod=score_mod, mask_mod=mask_mod, aux=aux, **extra)
    torch.cuda.synchronize()
    assert o is out
    check_sentinel(buf, guards)
    ref_o, ref_l = reference(q, k, v, d ** -0.5, causal=causal, window=window, sinks=snk,
                             score=t_score(aux) if t_score else None, mask=t_mask(aux) if t_mask else None,
                             softcap=extra.get("softcap", 0.0), alibi=extra.get("alibi_slopes"))
    compare(o, lse, ref_o, ref_l, dtype, f"({variant}, causal={causal}, window={window}, spec={spec})")
    return o, lse, (q, k, v, aux)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_variants(variant, causal):
    run_dense(variant, causal=causal)


@pytest.mark.parametrize("d, sq, sk", [(64, 45, 130), (128, 200, 200), (96, 33, 257), (256, 70, 70)])
@pytest.mark.parametrize("variant", ["alibi+doc", "rel", "holes"])
def test_head_dims_and_lengths(variant, d, sq, sk):
    run_dense(variant, d=d, sq=sq, sk=sk, causal=True)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("variant", ["alibi", "rel", "softcap"])
def test_more_queries_than_keys_without_a_mask(variant, d):
    # Rows before position 0 take no score_mod, yet join the softmax in the units the snippet's rows end in (logits),
    # and whole tiles take the path without per-row tests (a snippet that reads a position).
    run_dense(variant, d=d, sq=300, sk=90)
    run_dense(variant, d=d, sq=300, sk=90, sinks=True)
    run_dense(variant, d=d, sq=129, sk=384)


@pytest.mark.parametrize("variant", ["alibi+doc", "holes", "prefix"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_with_sinks_and_window(variant, dtype):
    run_dense(variant, dtype=dtype, causal=True, sinks=True)
    run_dense(variant, dtype=dtype, window=(20, 5), sinks=True)


def test_with_builtin_softcap_and_alibi_first():
    gen = fresh_generator()
    slopes = torch.rand(4, generator=gen, device="cuda") * 0.2
    run_dense("rel", softcap=30.0, causal=True)
    run_dense("doc", alibi_slopes=slopes, causal=True)


def test_alibi_and_softcap_snippets_match_the_builtins():
    gen = fresh_generator()
    b, s, h, hk, d = 2, 150, 8, 2, 128
    q = torch.randn(b, s, h, d, generator=gen, device="cuda").bfloat16()
    k = torch.randn(b, s, hk, d, generator=gen, device="cuda").bfloat16()
    v = torch.randn(b, s, hk, d, generator=gen, device="cuda").bfloat16()
    slope = torch.rand(h, generator=gen, device="cuda") * 0.3
    a = attngen.prefill(q, k, v, causal=True, score_mod=ALIBI, aux={"slope": slope})
    ref = attngen.prefill(q, k, v, causal=True, alibi_slopes=slope)
    assert (a.float() - ref.float()).abs().max().item() < 2e-2
    a = attngen.prefill(q, k, v, causal=True, score_mod=SOFTCAP)
    ref = attngen.prefill(q, k, v, causal=True, softcap=8.0)
    assert (a.float() - ref.float()).abs().max().item() < 2e-2


def test_aux_dtypes_and_strides():
    gen = fresh_generator()
    h, sk = 4, 77
    wide = torch.randn(h, 4 * L, generator=gen, device="cuda").bfloat16()
    run_dense("rel", aux_override={"rel": wide[:, ::2]})  # bf16, a strided view
    doc = torch.cumsum((torch.rand(2, sk, generator=gen, device="cuda") < 0.05).long(), dim=1)
    run_dense("doc", causal=True, aux_override={"doc": doc})  # int64
    run_dense("alibi", aux_override={"slope": (torch.rand(h, generator=gen, device="cuda") * 0.3).half()})  # fp16
    keep = (torch.rand(sk, sk, generator=gen, device="cuda") > 0.4).to(torch.uint8)
    run_dense("keep", aux_override={"keep": keep.t().contiguous().t()})  # uint8, column-major



def _far_apart(shape, dtype, gen):
    """A view of ``shape`` whose first dim's rows lie so far apart in one buffer that its last row starts 2^31
    elements or more past its first (the buffer: 2^31 and a few elements), filled with fresh random values."""
    n = shape[0]
    row = -(-2**31 // (n - 1))
    flat = torch.empty((n - 1) * row + math.prod(shape[1:]), dtype=dtype, device="cuda")
    view = flat.as_strided(shape, (row, *torch.empty(shape[1:]).stride()))
    if dtype == torch.uint8:
        view.copy_(torch.rand(shape, generator=gen, device="cuda") > 0.4)
    else:
        view.copy_(torch.randn(shape, generator=gen, device="cuda"))
    return view


def test_aux_tensors_past_2_31_elements_take_64_bit_offsets():
    from attngen.families import snippets

    gen = fresh_generator()
    keep = _far_apart((77, 77), torch.uint8, gen)
    assert snippets.call_aux({"keep": keep})[0] == "keep:uint8:2:wide"
    assert snippets.call_aux({"keep": keep[:76]})[0] == "keep:uint8:2"  # the last row alone was past 2^31
    for causal in (False, True):
        run_dense("keep", causal=causal, aux_override={"keep": keep})
    with pytest.raises(attngen.LaunchError, match="2\\^31 or more apart"):
        run_dense("keep", aux_override={"keep": keep}, spec=attngen.PrefillSpec(head_dim=64, aux="keep:uint8:2"))
    del keep
    rel = _far_apart((8, 2 * L), torch.bfloat16, gen)
    case = Case(DECODE_LENGTHS, q_len=3, heads=8, kv_heads=2, head_dim=128, block_size=16)
    o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=4, return_lse=True,
                            score_mod=REL, aux={"rel": rel})
    torch.cuda.synchronize()
    check_decode(case, "rel", o, lse, {"rel": rel})


SM90A = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                           reason="the sm_90a kernel forms")
FORMS = {
    "mma_sync": (64, dict(mma="mma_sync", pipeline="sync", cta_tile_q=64, cta_tile_kv=64, num_warps=4, num_stages=2)),
    "wgmma_sync": (64, SHORT_CAUSAL),
    "tma_serial_persistent": (128, SHORT_CAUSAL_TMA),
    "tma_pingpong_persistent": (128, dict(cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, mma="wgmma",
                                          pipeline="tma", schedule="pingpong", persistent="true")),
    "tma_overlap": (128, dict(cta_tile_q=128, cta_tile_kv=128, num_warps=8, num_stages=2, mma="wgmma",
                              pipeline="tma", schedule="overlap", persistent="false")),
    "three_groups": (64, THREE_GROUPS),
    "tma_kv80": (256, dict(cta_tile_q=128, cta_tile_kv=80, num_warps=8, num_stages=2, mma="wgmma", pipeline="tma",
                           schedule="pingpong", persistent="false")),
}


@SM90A
@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("variant", ["alibi+doc", "holes", "swa_global"])
def test_every_kernel_form(form, variant):
    d, fields = FORMS[form]
    spec = {"family": "prefill", **{k: getattr(v, "value", v) for k, v in fields.items()}}
    run_dense(variant, d=d, sq=300, sk=300, causal=True, sinks=True, spec={**spec, "sinks": True})  # (as the call)
    run_dense(variant, d=d, sq=130, sk=461, spec=spec)


@SM90A
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_kernel_form_with_a_score_mod_of_no_position(form):
    # Any score_mod's scores leave the step as logits: rows before position 0 (more queries than keys) take no
    # score_mod and become logits by a multiply, and the LSE and sinks read the row maxima back in units of q.k. A
    # pinned spec takes no q_scaled, so each form multiplies every score by sm_scale for the snippet.
    d, fields = FORMS[form]
    spec = {"family": "prefill", **{k: getattr(v, "value", v) for k, v in fields.items()}}
    run_dense("softcap", d=d, sq=300, sk=90, spec=spec)
    run_dense("softcap", d=d, sq=300, sk=300, causal=True, sinks=True, spec={**spec, "sinks": True})


def run_varlen(variant, lens_q, lens_k, *, h=4, hk=2, d=64, block_size=0, causal=True, sinks=False, fa=False):
    gen = fresh_generator()
    dtype = torch.bfloat16
    tq, tk = sum(lens_q), sum(lens_k)
    q = guarded(tq, h, d, dtype=dtype, gen=gen)
    k = guarded(tk, hk, d, dtype=dtype, gen=gen)
    v = guarded(tk, hk, d, dtype=dtype, gen=gen)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    score_mod, mask_mod, t_score, t_mask = VARIANTS[variant]
    aux = aux_of(variant, len(lens_q), h, max(lens_k), gen)
    snk = torch.randn(h, generator=gen, device="cuda") if sinks else None
    kw = {}
    kc, vc = k, v
    if block_size:
        per = [-(-n // block_size) for n in lens_k]
        nblocks = sum(per) + 2
        order = torch.randperm(nblocks).tolist()
        kc = torch.full((nblocks, block_size, hk, d), NAN, dtype=dtype, device="cuda")
        vc = torch.full_like(kc, NAN)
        table = torch.zeros(len(lens_k), max(per + [1]), dtype=torch.int32)
        at = k0 = 0
        for s, n in enumerate(lens_k):
            for j in range(per[s]):
                blk = order[at]
                at += 1
                table[s, j] = blk
                rows = min(block_size, n - j * block_size)
                kc[blk, :rows] = k[k0 + j * block_size:k0 + j * block_size + rows]
                vc[blk, :rows] = v[k0 + j * block_size:k0 + j * block_size + rows]
            k0 += n
        kw["block_table"] = table.cuda()
    if fa:
        o = attngen.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, sinks=snk,
                                           score_mod=score_mod, mask_mod=mask_mod, aux=aux, **kw)
        lse = None
    else:
        out, buf, guards = sentinel_out((tq, h, d), dtype)
        o, lse = attngen.prefill_varlen(q, kc, vc, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                        return_lse=True, out=out, sinks=snk, score_mod=score_mod, mask_mod=mask_mod,
                                        aux=aux, **kw)
        torch.cuda.synchronize()
        check_sentinel(buf, guards)
    torch.cuda.synchronize()
    q0 = k0 = 0
    for s, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq:
            ref_o, ref_l = reference(q[None, q0:q0 + nq], k[None, k0:k0 + nk], v[None, k0:k0 + nk], d ** -0.5,
                                     causal=causal, sinks=snk, b0=s, score=t_score(aux) if t_score else None,
                                     mask=t_mask(aux) if t_mask else None)
            got_l = lse[None, :, q0:q0 + nq] if lse is not None else ref_l
            compare(o[None, q0:q0 + nq], got_l, ref_o, ref_l, dtype, f"(sequence {s}, {variant})")
        q0 += nq
        k0 += nk


LENS = ([37, 1, 0, 130, 64], [37, 50, 9, 300, 64])  # (q, k) per sequence: equal, fewer queries, none, a long one


@pytest.mark.parametrize("variant", ["alibi+doc", "rel", "holes", "prefix"])
@pytest.mark.parametrize("block_size", [0, 16], ids=["contiguous", "paged16"])
def test_varlen(variant, block_size):
    run_varlen(variant, *LENS, block_size=block_size, sinks=True)


def test_varlen_without_causal_and_flash_attn_varlen_func():
    run_varlen("doc", *LENS, causal=False)
    run_varlen("alibi+doc", *LENS, fa=True)


@pytest.mark.parametrize("variant", ["alibi+doc", "holes"])
def test_custom_mask_tensor_with_mask_mod(variant):
    gen = fresh_generator()
    b, sq, sk, h = 2, 150, 150, 4
    keep = torch.rand(b, 1, sq, sk, generator=gen, device="cuda") > 0.3
    keep[:, :, :, :64] = True
    keep[:, :, :, 70:140] = False  # whole dead key tiles for the plan
    q = guarded(b, sq, h, 64, dtype=torch.bfloat16, gen=gen)
    k = guarded(b, sk, 2, 64, dtype=torch.bfloat16, gen=gen)
    v = guarded(b, sk, 2, 64, dtype=torch.bfloat16, gen=gen)
    score_mod, mask_mod, t_score, t_mask = VARIANTS[variant]
    aux = aux_of(variant, b, h, sk, gen)
    out, buf, guards = sentinel_out((b, sq, h, 64), torch.bfloat16)
    o, lse = attngen.prefill(q, k, v, mask=keep, causal=True, return_lse=True, out=out, score_mod=score_mod,
                             mask_mod=mask_mod, aux=aux)
    torch.cuda.synchronize()
    check_sentinel(buf, guards)
    ref_o, ref_l = reference(q, k, v, 64 ** -0.5, causal=True, keep=keep, score=t_score(aux) if t_score else None,
                             mask=t_mask(aux) if t_mask else None)
    compare(o, lse, ref_o, ref_l, torch.bfloat16, variant)


def test_flash_attn_func():
    gen = fresh_generator()
    b, s, h = 2, 90, 4
    q = torch.randn(b, s, h, 64, generator=gen, device="cuda").bfloat16()
    k = torch.randn(b, s, 2, 64, generator=gen, device="cuda").bfloat16()
    v = torch.randn(b, s, 2, 64, generator=gen, device="cuda").bfloat16()
    aux = aux_of("alibi+doc", b, h, s, gen)
    o = attngen.flash_attn_func(q, k, v, causal=True, score_mod=ALIBI, mask_mod=DOC, aux=aux)
    ref_o, ref_l = reference(q, k, v, 64 ** -0.5, causal=True, score=t_alibi(aux), mask=t_doc(aux))
    compare(o, ref_l, ref_o, ref_l, torch.bfloat16)


# --- decode ------------------------------------------------------------------------------------------------------

def row_kv(case, i, n):
    """Row i's first n keys and values [1, n, hk, d] (contiguous or through the block table)."""
    if case.block_table is None:
        return case.k_cache[i:i + 1, :n], case.v_cache[i:i + 1, :n]
    bs = case.k_cache.shape[1]
    blocks = case.block_table[i, :-(-n // bs)].long()
    hk, d = case.k_cache.shape[2:]
    if n == 0:
        return case.k_cache.new_empty(1, 0, hk, d), case.v_cache.new_empty(1, 0, hk, d)
    return (case.k_cache[blocks].reshape(1, -1, hk, d)[:, :n], case.v_cache[blocks].reshape(1, -1, hk, d)[:, :n])


def check_decode(case, variant, o, lse, aux, sinks=None):
    score_mod, mask_mod, t_score, t_mask = VARIANTS[variant]
    d = case.q.shape[-1]
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite outputs"
    for i, n in enumerate(case.lengths):
        k, v = row_kv(case, i, n)
        ref_o, ref_l = reference(case.q[i:i + 1], k, v, d ** -0.5, causal=True, sinks=sinks, b0=i,
                                 score=t_score(aux) if t_score else None, mask=t_mask(aux) if t_mask else None)
        compare(o[i:i + 1], lse[i:i + 1], ref_o, ref_l, case.dtype, f"(row {i} of length {n}, {variant})")


DECODE_LENGTHS = [0, 1, 3, 17, 129, 1000, 3001]


@pytest.mark.parametrize("variant", ["alibi+doc", "rel", "holes", "prefix", "swa_global"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("block_size", [None, 16], ids=["contiguous", "paged16"])
def test_decode(variant, num_splits, block_size):
    case = Case(DECODE_LENGTHS, q_len=3, heads=8, kv_heads=2, head_dim=128, block_size=block_size)
    aux = aux_of(variant, len(DECODE_LENGTHS), 8, max(DECODE_LENGTHS) + 8, fresh_generator())
    score_mod, mask_mod, _, _ = VARIANTS[variant]
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=num_splits, out=out,
                            return_lse=True, score_mod=score_mod, mask_mod=mask_mod, aux=aux)
    torch.cuda.synchronize()
    assert o is out
    check_decode(case, variant, o, lse, aux)


def test_decode_with_sinks_merge_launch_and_head_dim_512():
    from attngen.families.decode import op

    case = Case(DECODE_LENGTHS, q_len=2, heads=8, kv_heads=8, head_dim=512)
    aux = aux_of("alibi+doc", len(DECODE_LENGTHS), 8, max(DECODE_LENGTHS) + 8, fresh_generator())
    sinks = torch.randn(8, device="cuda")
    was = op.set_cluster_merge(0)
    try:
        o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=5, return_lse=True,
                                score_mod=ALIBI, mask_mod=DOC, aux=aux, sinks=sinks)
    finally:
        op.set_cluster_merge(was)
    torch.cuda.synchronize()
    check_decode(case, "alibi+doc", o, lse, aux, sinks)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("q_len", [1, 12])
def test_flash_attn_with_kvcache(paged, q_len):
    lengths = [40, 300, 1000]
    case = Case(lengths, q_len=q_len, heads=8, kv_heads=2, head_dim=128, block_size=64 if paged else None,
                pad=16 * math.ceil(1000 / 16) - 1000 + 16)  # contiguous rows 16 positions apart: the paged route
    aux = aux_of("alibi+doc", len(lengths), 8, max(lengths) + 16, fresh_generator())
    o, lse = attngen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, **case.kwargs(), causal=True,
                                             return_softmax_lse=True, score_mod=ALIBI, mask_mod=DOC, aux=aux)
    torch.cuda.synchronize()
    check_decode(case, "alibi+doc", o, lse, aux)
