"""FlashAttention's entry points refuse what attngen does not do, clearly and before touching a tensor."""

from __future__ import annotations

import pytest

import attngen
from attngen import LaunchError

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("kw,needle", [
    ({"dropout_p": 0.1}, "dropout_p=0.1 is not supported"),
    ({"return_attn_probs": True}, "return_attn_probs=True is not supported"),
])
def test_flash_attn_func_refuses(kw, needle):
    with pytest.raises(LaunchError, match=needle):
        attngen.flash_attn_func(None, None, None, **kw)


def _kv(b=2, sq=1, h=4, hk=2, d=64, cap=48, new=1):
    """CPU tensors for the checks that run before any kernel: q, k_cache, v_cache, k, v."""
    q = torch.randn(b, sq, h, d).to(torch.bfloat16)
    kc, vc = (torch.zeros(b, cap, hk, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, new, hk, d).to(torch.bfloat16) for _ in range(2))
    return q, kc, vc, k, v


@pytest.mark.parametrize("kw,needle", [
    ({}, "cache_seqlens is required"),
    ({"cache_seqlens": 1, "k": 1}, "k and v go together"),
    ({"cache_seqlens": 1, "window_size": (4, -2)}, r"window_size=\(4, -2\): each side must be >= 0, or -1"),
    ({"cache_seqlens": 1, "window_size": 7}, "window_size=7 must be a pair"),
    ({"cache_seqlens": 1, "rotary_cos": 1}, "rotary_cos and rotary_sin go together"),
    ({"cache_seqlens": 1, "rotary_cos": 1, "rotary_sin": 1}, "rotate the new k before the append: pass k and v"),
])
def test_flash_attn_with_kvcache_refuses(kw, needle):
    with pytest.raises(LaunchError, match=needle):
        attngen.flash_attn_with_kvcache(None, None, None, **kw)


def test_kvcache_option_checks_name_the_argument():
    q, kc, vc, k, v = _kv()
    cos = torch.ones(48, 16)
    with pytest.raises(LaunchError, match=r"cache_leftpad must be an int32 tensor \[2\]"):
        attngen.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=3, cache_leftpad=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(LaunchError, match=r"rotary_dim=66 \(2 x rotary_cos.shape\[1\]\) must be from 2 to head_dim=64"):
        attngen.flash_attn_with_kvcache(q, kc, vc, k, v, torch.ones(48, 33), torch.ones(48, 33), cache_seqlens=3)
    with pytest.raises(LaunchError, match="rotary_cos has 40 positions; it needs one for each of the cache's 48"):
        attngen.flash_attn_with_kvcache(q, kc, vc, k, v, cos[:40], cos[:40], cache_seqlens=3)
    with pytest.raises(LaunchError, match=r"rotary_cos \(48, 16\) and rotary_sin \(48, 8\) must both be"):
        attngen.flash_attn_with_kvcache(q, kc, vc, k, v, cos, cos[:, :8], cache_seqlens=3)


def test_chunked_prefill_that_no_kernel_serves_is_refused_after_naming_why():
    # More than 8 new tokens, not causal, with ALiBi and left pads on a paged cache: the prefill kernel over pages
    # takes no left pad, and the decode kernels place each token at the end of the keys it sees, which ALiBi's
    # distances cannot follow where a token sees keys after its own position.
    # (Past 32 new tokens: fewer take the decode kernel over a packed q, which serves this.)
    q, kc, vc, k, v = _kv(sq=40, new=40)
    kc, vc = kc.view(6, 16, 2, 64), vc.view(6, 16, 2, 64)
    table = torch.arange(6, dtype=torch.int32).view(2, 3)
    pads = torch.tensor([1, 2], dtype=torch.int32)
    with pytest.raises(LaunchError, match=r"seqlen_q=40 with causal=False, window_size right=-1 and alibi_slopes is "
                                          r"not supported with cache_leftpad with a paged cache \(block_table\), .*; "
                                          r"allowed: causal=True"):
        attngen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, cache_leftpad=pads, block_table=table,
                                        alibi_slopes=torch.rand(4))
    assert not kc.any(), "refused before the append"
    with pytest.raises(LaunchError, match="window_size right=2 and alibi_slopes"):
        attngen.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, cache_leftpad=pads, block_table=table,
                                        alibi_slopes=torch.rand(4), window_size=(-1, 2))
    assert not kc.any(), "refused before the append"
    # A contiguous cache with fewer rows than the batch and no cache_batch_idx, as attngen.decode says.
    q, kc, vc, k, v = _kv(sq=12, new=12)
    with pytest.raises(LaunchError, match="k_cache has 1 cache rows for batch 2; pass cache_batch_idx"):
        attngen.flash_attn_with_kvcache(q, kc[:1], vc[:1], k, v, cache_seqlens=3)


def _rotary_reference(x, cos, sin, pos, interleaved):
    """x's first rotary_dim features as complex pairs turned by the angle at each position (fp64)."""
    half = cos.shape[1]
    xd = x.double()
    if interleaved:
        pairs = torch.complex(xd[..., 0:2 * half:2], xd[..., 1:2 * half:2])
    else:
        pairs = torch.complex(xd[..., :half], xd[..., half:2 * half])
    turn = torch.complex(cos.double()[pos], sin.double()[pos]).unsqueeze(2)
    r = pairs * turn
    rot = torch.stack((r.real, r.imag), -1).flatten(-2) if interleaved else torch.cat((r.real, r.imag), -1)
    return torch.cat((rot, xd[..., 2 * half:]), -1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("leftpad", [False, True])
def test_rotary_positions_follow_flash_attention(interleaved, per_token, leftpad):
    from attngen.kvcache import rotary_qk

    gen = torch.Generator().manual_seed(5)
    b, sq, sk, d, rd, cap = 3, 4, 3, 64, 32, 50
    q = torch.randn(b, sq, 4, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, sk, 2, d, generator=gen).to(torch.bfloat16)
    ang = torch.rand(cap, rd // 2, generator=gen) * 6.0
    cos, sin = ang.cos(), ang.sin()
    lens = torch.tensor([5, 0, 17], dtype=torch.int32)
    pads = torch.tensor([2, 0, 9], dtype=torch.int32) if leftpad else None
    rq, rk = rotary_qk(q, k, cos, sin, lens, pads, interleaved, per_token, cap)
    base = (lens - (pads if leftpad else 0)).long()[:, None]
    pos_k = base + torch.arange(sk)
    pos_q = base + (torch.arange(sq) if per_token else torch.zeros(sq, dtype=torch.long))
    for got, x, pos in ((rq, q, pos_q), (rk, k, pos_k)):
        want = _rotary_reference(x, cos, sin, pos, interleaved)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert (got.double() - want).abs().max().item() < 2e-2  # one bf16 rounding
        assert torch.equal(got[..., rd:], x[..., rd:]), "features past rotary_dim are untouched"
    assert not torch.equal(rq, q), "the rotation changes q"


def test_contiguous_cache_as_pages_names_the_same_elements():
    from attngen.kvcache import _as_pages

    # A cache slice: 3 rows of 64 positions inside rows of 96, rows chosen by cache_batch_idx.
    full = torch.arange(4 * 96 * 2 * 16, dtype=torch.float32).reshape(4, 96, 2, 16)
    kc = full[:3, :64]
    idx = torch.tensor([2, 0], dtype=torch.int32)
    kp, vp, table = _as_pages(torch, kc, kc, idx, 2)
    bs = kp.shape[1]
    assert bs == 32 and table.dtype == torch.int32 and table.shape == (2, 64 // bs)
    for row in range(2):
        for j in (0, 17, 31, 32, 63):
            assert torch.equal(kp[table[row, j // bs], j % bs], kc[idx[row], j])
    assert _as_pages(torch, full[:, :40], full[:, :40], None, 2) is None, "40 positions: no whole blocks"


@pytest.mark.parametrize("causal,window,q_len,want", [
    (True, (-1, -1), 4, (False, 1 << 30, 0)),
    (True, (127, 5), 1, (True, 127, 0)),
    (False, (-1, -1), 1, (False, 1 << 30, 1 << 30)),
    (False, (-1, -1), 3, (True, 1 << 30, 1 << 30)),
    (False, (-1, 0), 3, (False, 1 << 30, 0)),
    (False, (10, 2), 2, (True, 10, 2)),
])
def test_decode_window_bounds(causal, window, q_len, want):
    from attngen.families.decode.op import window_bounds

    assert window_bounds(causal, window, q_len) == want


@pytest.mark.parametrize("causal,window,needle", [
    ("yes", (-1, -1), "causal='yes' must be a bool"),
    (True, (-2, 0), r"window=\(-2, 0\) must be a pair \(left, right\) of ints >= -1"),
    (True, (1.5, 0), r"window=\(1.5, 0\) must be a pair"),
    (True, 3, "window=3 must be a pair"),
])
def test_decode_window_refused(causal, window, needle):
    from attngen.families.decode.op import window_bounds

    with pytest.raises(LaunchError, match=needle):
        window_bounds(causal, window, 2)


def test_local_is_a_spec_switch_in_the_key():
    a = attngen.parse_spec("decode:head_dim=128,local=true")
    assert a.local and a.kernel_name != attngen.DecodeSpec(head_dim=128).kernel_name
    src = attngen.render(attngen.resolve(a, "sm_90a"))
    # the shape's template arguments end with the logits variants (none here), local, sinks
    head = " ".join(src[src.index("using Kernel = Decode<DecodeShape<"):].split(";")[0].split())
    assert head.endswith("Logits, true, false>>"), head
    assert "using Logits = Variants<>;" in src


def test_score_modifiers_are_spec_fields_in_the_key():
    a = attngen.parse_spec("prefill:head_dim=128,softcap=true")
    b = attngen.parse_spec("decode:head_dim=128,alibi=true")
    assert a.softcap and not a.alibi and b.alibi and not b.softcap
    assert a.kernel_name != attngen.PrefillSpec(head_dim=128).kernel_name
    src = attngen.render(attngen.resolve(a, "sm_90a"))
    # the switches turn on the library variants they name (templates/common/variant.cuh), in their order
    assert "using Logits = Variants<Softcap>;" in src
    assert "using Logits = Variants<Alibi>;" in attngen.render(attngen.resolve(b, "sm_90a"))
    both = attngen.parse_spec("prefill:head_dim=128,softcap=true,alibi=true")
    assert "using Logits = Variants<Softcap, Alibi>;" in attngen.render(attngen.resolve(both, "sm_90a"))


def _reference_kernels(monkeypatch, seen):
    """attngen.decode and attngen.prefill_varlen as the kv-cache call uses them, replaced by the fp32
    references on CPU tensors (the paged prefill read through its block table and cu_seqlens only), so
    that the routes, the page view, the chunking and the reshapes run here. ``seen`` records the calls."""
    from attngen import flash_api, kvcache
    from tests.gpu_reference import reference_attention, reference_decode

    def decode(q, kc, vc, *, cache_seqlens, cache_batch_idx=None, block_table=None, num_splits=0, return_lse=False,
               causal=True, window=(-1, -1), cache_leftpad=None, sm_scale=None, softcap=0.0, alibi_slopes=None,
               sinks=None, k_scale=None, v_scale=None, cu_seqlens_q=None, max_q_len=None):
        assert k_scale is None and v_scale is None  # 16-bit caches here
        if cu_seqlens_q is not None:  # the PACKED route: every request max_q_len tokens, in order
            b = cu_seqlens_q.shape[0] - 1
            assert torch.equal(cu_seqlens_q, torch.arange(b + 1, dtype=torch.int32) * max_q_len)
            seen.append(("packed", max_q_len))
            o, lse = reference_decode(q.view(b, max_q_len, *q.shape[1:]), kc, vc, cache_seqlens, cache_batch_idx,
                                      block_table, sm_scale, softcap, alibi_slopes, causal, window, cache_leftpad,
                                      sinks)
            o, lse = o.reshape(q.shape), lse.permute(1, 0, 2).reshape(q.shape[1], -1)  # [h, total_q], as packed
            return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)
        seen.append(("decode", q.shape[1]))
        o, lse = reference_decode(q, kc, vc, cache_seqlens, cache_batch_idx, block_table, sm_scale, softcap,
                                  alibi_slopes, causal, window, cache_leftpad, sinks)
        return (o.to(q.dtype), lse) if return_lse else o.to(q.dtype)

    def prefill_varlen(q, kp, vp, cu_q, cu_k, max_q, max_k, *, causal, window, return_lse, sm_scale, softcap,
                       alibi_slopes, block_table=None, sinks=None):
        seen.append(("prefill" if block_table is not None else "rows", kp.shape[1]))
        out = torch.zeros(q.shape[0], q.shape[1], vp.shape[-1])
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"))
        assert cu_q.dtype == cu_k.dtype == torch.int32 and len(cu_q) == len(cu_k)
        for s in range(len(cu_q) - 1):
            q0, q1 = int(cu_q[s]), int(cu_q[s + 1])
            if block_table is not None:
                bs, n = kp.shape[1], int(cu_k[s + 1] - cu_k[s])
                blocks = block_table[s].long()[torch.arange(n) // bs]
                k, v = kp[blocks, torch.arange(n) % bs], vp[blocks, torch.arange(n) % bs]
            else:  # the kernel's varlen_rows: keys [cu_k[s], cu_k[s + 1]) clamped into k, at least none
                k0 = min(max(int(cu_k[s]), 0), kp.shape[0])
                k1 = min(max(int(cu_k[s + 1]), k0), kp.shape[0])
                k, v = kp[k0:k1], vp[k0:k1]
            if q1 > q0:
                slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[s:s + 1]
                o, l = reference_attention(q[None, q0:q1], k[None], v[None], causal=causal, window=window,
                                           sm_scale=sm_scale, softcap=softcap, alibi_slopes=slopes)
                if sinks is not None:  # each head's sink joins the denominator: the LSE and the weight of the keys
                    with_sink = torch.logaddexp(l[0], sinks[:, None].to(l.dtype))
                    o = o * torch.exp(l - with_sink).nan_to_num(0.0).transpose(1, 2)[..., None]
                    l = with_sink[None]
                out[q0:q1], lse[:, q0:q1] = o[0], l[0]
        return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)

    monkeypatch.setattr(flash_api, "decode", decode)
    monkeypatch.setattr(kvcache, "decode", decode)
    monkeypatch.setattr(kvcache, "prefill_varlen", prefill_varlen)


@pytest.mark.parametrize("layout,cap,route", [("paged", 256, "prefill"), ("contiguous", 256, "prefill"),
                                              ("contiguous", 200, "rows"), ("leftpad", 256, "rows"),
                                              ("leftpad, rows by index", 200, "rows"),
                                              ("paged, leftpad", 256, "decode")])
@pytest.mark.parametrize("n_new,q_len", [(11, 11), (3, 13), (20, 20), (40, 40), (3, 37)])
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (True, (9, 0)), (False, (-1, -1)), (False, (6, 2)),
                                           (False, (-1, 0)), (False, (5, 30))])
@pytest.mark.parametrize("alibi", [False, True])
def test_many_new_tokens_routes_match_the_reference(monkeypatch, layout, cap, route, n_new, q_len, causal, window,
                                                    alibi):
    """More than 8 new tokens through each route, against the fp32 reference of the whole call: the paged prefill
    kernel, a contiguous cache as pages, its rows laid end to end (left pads; rows in any order), and decode calls
    of 8 tokens on a paged cache with left pads, windows and keys after a token's own position included. Up to 32
    tokens (this GQA group) every layout takes the PACKED route instead: one decode call over a packed q."""
    from tests.gpu_reference import reference_decode

    seen = []
    _reference_kernels(monkeypatch, seen)
    gen = torch.Generator().manual_seed(11)
    b, hk, g, d, bs = 3, 2, 2, 16, 32
    old = [0, 90, 200 - n_new - 4]
    if q_len <= 32:
        route = "packed"
    pads = [0, 40, 7] if "leftpad" in layout else None
    rows = torch.tensor([2, 0, 1], dtype=torch.int32) if "index" in layout else None
    if layout.startswith("paged"):
        kc = torch.full((b * cap // bs + 2, bs, hk, d), float("nan"))
        table = torch.randperm(b * cap // bs + 2, generator=gen)[: b * cap // bs].to(torch.int32).reshape(b, -1)
    else:
        kc, table = torch.full((b, cap, hk, d), float("nan")), None
    vc = kc.clone()
    for i, n in enumerate(old):
        for p in range(0 if pads is None else pads[i], n):
            r = i if rows is None else int(rows[i])
            at = (int(table[i, p // bs]), p % bs) if table is not None else (r, p)
            kc[at], vc[at] = torch.randn(hk, d, generator=gen), torch.randn(hk, d, generator=gen)
    q = torch.randn(b, q_len, hk * g, d, generator=gen)
    k, v = torch.randn(b, n_new, hk, d, generator=gen), torch.randn(b, n_new, hk, d, generator=gen)
    lens = torch.tensor(old, dtype=torch.int32)
    lp = None if pads is None else torch.tensor(pads, dtype=torch.int32)
    slopes = torch.rand(b, hk * g, generator=gen) * 0.3 if alibi else None
    call = dict(cache_seqlens=lens, block_table=table, cache_leftpad=lp, causal=causal, window_size=window,
                return_softmax_lse=True, softmax_scale=0.3, cache_batch_idx=rows, alibi_slopes=slopes)
    if route == "decode" and alibi and not causal and window[1] != 0:
        with pytest.raises(LaunchError, match=f"seqlen_q={q_len} with causal=False, window_size right={window[1]} "
                                              f"and alibi_slopes"):
            attngen.flash_attn_with_kvcache(q, kc, vc, k, v, **call)
        assert not seen
        return
    out, lse = attngen.flash_attn_with_kvcache(q, kc, vc, k, v, **call)
    assert {name for name, _ in seen} == {route}
    if route == "decode":
        assert [n for _, n in seen] == [8] * (q_len // 8) + ([q_len % 8] if q_len % 8 else [])
    if route == "packed":
        assert [n for _, n in seen] == [q_len]
    ref, ref_lse = reference_decode(q, kc, vc, [o + n_new for o in old], cache_batch_idx=rows, block_table=table,
                                    sm_scale=0.3, causal=causal, window=window, cache_leftpad=pads,
                                    alibi_slopes=slopes)
    assert out.shape == q.shape and lse.shape == (b, hk * g, q_len)
    assert (out - ref).abs().max().item() < 1e-5
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert (lse[fin] - ref_lse[fin]).abs().max().item() < 1e-4
