"""attngen.merge_state / merge_states on a real GPU against an fp32 reference built by torch (pytest -m gpu).

Fresh random inputs every run (the seed is named in failure messages), outputs poisoned with NaN before the
launch and held inside buffers whose border is a sentinel, inputs inside NaN-filled buffers (a read past a row
or of an empty state's values turns the output NaN). The reference merges the same fp32 inputs; where the states
come from attention over parts of one key set, the reference is attention over the whole set.
"""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402

NAN = float("nan")
NEG_INF = float("-inf")
SENTINEL = -1536.0  # exact in fp16, bf16 and fp32
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MAX_ABS = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}  # |values| below ~3
LSE_MAX_ABS = 1e-4


def _randn(*shape, gen):
    return torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen)


def embedded(x, *, pad=8, every=1):
    """``x`` copied into a NaN-filled buffer: each row padded by ``pad`` more (NaN) elements in its last dim and,
    with ``every`` > 1, ``every - 1`` NaN tokens between two of its tokens. Returns the view holding ``x``."""
    shape = list(x.shape)
    buf = torch.full((shape[0] * every, *shape[1:-1], shape[-1] + pad), NAN, dtype=x.dtype, device=x.device)
    view = buf[::every, ..., :shape[-1]]
    view.copy_(x)
    return view


def reference_merge(vs, ss):
    """fp32 merge of states ``vs`` [n][tokens, heads, d] (any dtype) with LSE ``ss`` [n][tokens, heads]: (values,
    LSE); an LSE of -inf weighs 0 (its values never read), all empty gives zeros and -inf."""
    s = torch.stack([x.float() for x in ss])                       # [n, t, h]
    m = s.max(dim=0).values
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w = torch.where(torch.isinf(s), torch.zeros_like(s), torch.exp(s - m_safe))
    v = torch.stack([torch.nan_to_num(x.float(), nan=0.0) for x in vs])  # an empty state's NaN never counts
    v = torch.where((w > 0)[..., None], v, torch.zeros_like(v))
    wsum = w.sum(dim=0)
    out = (w[..., None] * v).sum(dim=0) / torch.where(wsum > 0, wsum, torch.ones_like(wsum))[..., None]
    lse = torch.where(wsum > 0, m_safe + torch.log(torch.where(wsum > 0, wsum, torch.ones_like(wsum))),
                      torch.full_like(wsum, NEG_INF))
    return out, lse


def partial_attention(q, k, v, scale):
    """fp32 attention of q [t, h, d] over k, v [n, h, d]: (output [t, h, d], natural-log LSE [t, h]); no keys
    gives zeros and -inf."""
    if k.shape[0] == 0:
        t, h, d = q.shape
        return torch.zeros(t, h, v.shape[-1], device=q.device), torch.full((t, h), NEG_INF, device=q.device)
    s = torch.einsum("thd,nhd->htn", q, k) * scale
    lse = torch.logsumexp(s, dim=-1)                                 # [h, t]
    o = torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v)
    return o, lse.T.contiguous()


def check(o, lse, ref_o, ref_l, dtype, what, lse_tol=LSE_MAX_ABS):
    assert o.dtype == dtype and lse.dtype == torch.float32, what
    assert o.shape == ref_o.shape and lse.shape == ref_l.shape, what
    assert not torch.isnan(o).any(), f"NaN in the output (a stray read or an unwritten row); {what}"
    err = (o.float() - ref_o).abs().max().item() if o.numel() else 0.0
    assert err < MAX_ABS[dtype], f"max abs error {err:.3e}; {what}"
    fin = torch.isfinite(ref_l)
    assert not torch.isnan(lse).any(), f"NaN in the LSE; {what}"
    assert torch.equal(torch.isfinite(lse), fin), f"LSE finite where the reference is -inf, or the reverse; {what}"
    assert (lse[~fin] == NEG_INF).all(), what
    assert (o[~fin] == 0).all(), f"a row with only empty states must be zeros; {what}"
    if fin.any():
        lerr = (lse[fin] - ref_l[fin]).abs().max().item()
        assert lerr < lse_tol, f"LSE max abs error {lerr:.3e}; {what}"


def poisoned_outputs(t, h, d, dtype):
    """(values view, LSE view, values buffer, LSE buffer): NaN inside, SENTINEL on a border of one token either
    side (and, for the values, 8 more columns)."""
    obuf = torch.full((t + 2, h, d + 8), SENTINEL, dtype=dtype, device="cuda")
    lbuf = torch.full((t + 2, h), SENTINEL, dtype=torch.float32, device="cuda")
    o, lse = obuf[1:t + 1, :, :d], lbuf[1:t + 1]
    o.fill_(NAN)
    lse.fill_(NAN)
    return o, lse, obuf, lbuf


def border_intact(obuf, lbuf, t, d, what):
    assert (obuf[0] == SENTINEL).all() and (obuf[t + 1] == SENTINEL).all(), f"a write past the tokens; {what}"
    assert (obuf[:, :, d:] == SENTINEL).all(), f"a write past head_dim; {what}"
    assert (lbuf[0] == SENTINEL).all() and (lbuf[t + 1] == SENTINEL).all(), f"an LSE write past the tokens; {what}"


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("head_dim", [8, 64, 128, 200, 264, 512, 1024])
def test_two_halves_give_the_full_attention(dtype, head_dim):
    """Two partial attentions (torch softmax in fp32, the values rounded to the dtype) over the two halves of one
    key set, merged, against attention over the whole set; the caller's outputs poisoned with NaN."""
    gen = fresh_generator()
    at = f"dtype {dtype}, head_dim {head_dim}, seed {gen.initial_seed()}"
    t, h, n = 37, 3, 301
    q, k, v = _randn(t, h, head_dim, gen=gen), _randn(n, h, head_dim, gen=gen), _randn(n, h, head_dim, gen=gen)
    scale = 1.0 / math.sqrt(head_dim)
    split = 123
    oa, la = partial_attention(q, k[:split], v[:split], scale)
    ob, lb = partial_attention(q, k[split:], v[split:], scale)
    full_o, full_l = partial_attention(q, k, v, scale)
    tdt = DTYPES[dtype]
    va, vb = embedded(oa.to(tdt)), embedded(ob.to(tdt))
    o, lse, obuf, lbuf = poisoned_outputs(t, h, head_dim, tdt)
    ro, rl = attngen.merge_state(va, embedded(la, pad=0), vb, lb, out=(o, lse))
    torch.cuda.synchronize()
    assert ro.data_ptr() == o.data_ptr() and rl.data_ptr() == lse.data_ptr(), at
    # the merged result is attention over all keys, within the rounding of the partial outputs to the dtype
    check(o, lse, full_o, full_l, tdt, at)
    border_intact(obuf, lbuf, t, head_dim, at)
    # and new outputs give the same
    o2, l2 = attngen.merge_state(va, la, vb, lb)
    torch.cuda.synchronize()
    assert torch.equal(o2, o) and torch.equal(l2, lse), at


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("parts", [1, 5, 37, 70])
def test_many_parts_give_the_full_attention(dtype, parts):
    """The keys cut into ``parts`` uneven pieces (one empty when there are several: LSE -inf, values NaN), the
    states stacked on a states dim inside a NaN-filled buffer, merged at once."""
    gen = fresh_generator()
    at = f"dtype {dtype}, {parts} parts, seed {gen.initial_seed()}"
    t, h, d, n = 19, 4, 128, 997
    q, k, v = _randn(t, h, d, gen=gen), _randn(n, h, d, gen=gen), _randn(n, h, d, gen=gen)
    scale = 1.0 / math.sqrt(d)
    cpu = torch.Generator().manual_seed(gen.initial_seed() % (2 ** 63))
    cuts = sorted(torch.randint(0, n + 1, (parts - 1,), generator=cpu).tolist())
    if parts > 2:
        cuts[1] = cuts[0]  # an empty part
    bounds = [0, *cuts, n]
    tdt = DTYPES[dtype]
    v_all = torch.full((t, parts, h, d + 8), NAN, dtype=tdt, device="cuda")[..., :d]
    s_all = torch.full((t, parts, h), NAN, device="cuda")
    for i in range(parts):
        o_i, l_i = partial_attention(q, k[bounds[i]:bounds[i + 1]], v[bounds[i]:bounds[i + 1]], scale)
        s_all[:, i] = l_i
        if bounds[i + 1] > bounds[i]:
            v_all[:, i] = o_i.to(tdt)  # an empty part's values stay NaN: never added
    o, lse, obuf, lbuf = poisoned_outputs(t, h, d, tdt)
    attngen.merge_states(v_all, s_all, out=(o, lse))
    torch.cuda.synchronize()
    full_o, full_l = partial_attention(q, k, v, scale)
    check(o, lse, full_o, full_l, tdt, at)
    border_intact(obuf, lbuf, t, d, at)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_empty_states(dtype):
    """Rows where one state is empty (LSE -inf, values NaN) give the other state as it is; rows where both are
    give zeros and -inf; merge_states with every state of a row empty likewise."""
    gen = fresh_generator()
    at = f"dtype {dtype}, seed {gen.initial_seed()}"
    t, h, d = 40, 2, 64
    tdt = DTYPES[dtype]
    va, vb = _randn(t, h, d, gen=gen).to(tdt), _randn(t, h, d, gen=gen).to(tdt)
    sa, sb = _randn(t, h, gen=gen) * 3, _randn(t, h, gen=gen) * 3
    a_empty = torch.zeros(t, h, dtype=torch.bool, device="cuda")
    b_empty = torch.zeros_like(a_empty)
    a_empty[0:10], b_empty[10:20], a_empty[20:30], b_empty[20:30] = True, True, True, True
    sa[a_empty], sb[b_empty] = NEG_INF, NEG_INF
    va[a_empty], vb[b_empty] = NAN, NAN
    o, lse, obuf, lbuf = poisoned_outputs(t, h, d, tdt)
    attngen.merge_state(va, sa, vb, sb, out=(o, lse))
    torch.cuda.synchronize()
    ref_o, ref_l = reference_merge([va, vb], [sa, sb])
    check(o, lse, ref_o, ref_l, tdt, at)
    border_intact(obuf, lbuf, t, d, at)
    assert torch.equal(o[0:10], vb[0:10]) and torch.equal(lse[0:10], sb[0:10]), f"b alone must pass as it is; {at}"
    assert torch.equal(o[10:20], va[10:20]) and torch.equal(lse[10:20], sa[10:20]), f"a alone; {at}"
    assert (o[20:30] == 0).all() and (lse[20:30] == NEG_INF).all(), at
    # merge_states: three states, every state of the first rows empty
    v3 = torch.stack([va, vb, _randn(t, h, d, gen=gen).to(tdt)], dim=1)
    s3 = torch.stack([sa, sb, _randn(t, h, gen=gen)], dim=1)
    s3[:5] = NEG_INF
    v3[:5] = NAN
    o3, l3 = attngen.merge_states(v3, s3)
    torch.cuda.synchronize()
    ref_o, ref_l = reference_merge(list(v3.unbind(1)), list(s3.unbind(1)))
    check(o3, l3, ref_o, ref_l, tdt, at)
    assert (o3[:5] == 0).all() and (l3[:5] == NEG_INF).all(), at


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_strided_views_and_a_transposed_lse(dtype):
    """Values with a tokens stride (every third token of a NaN-filled buffer) and a padded heads stride, LSE as the
    transposed view of a [heads, tokens] tensor (prefill_varlen's layout), the output a strided view too."""
    gen = fresh_generator()
    at = f"dtype {dtype}, seed {gen.initial_seed()}"
    t, h, d = 33, 5, 96
    tdt = DTYPES[dtype]
    va, vb = _randn(t, h, d, gen=gen).to(tdt), _randn(t, h, d, gen=gen).to(tdt)
    sa_ht, sb = _randn(h, t, gen=gen) + 2, _randn(t, h, gen=gen)
    va_view, vb_view = embedded(va, pad=16, every=3), embedded(vb, pad=8, every=2)
    assert va_view.stride(0) == 3 * h * (d + 16) and not va_view.is_contiguous()
    o, lse, obuf, lbuf = poisoned_outputs(t, h, d, tdt)
    attngen.merge_state(va_view, sa_ht.T, vb_view, sb, out=(o, lse))
    torch.cuda.synchronize()
    ref_o, ref_l = reference_merge([va, vb], [sa_ht.T, sb])
    check(o, lse, ref_o, ref_l, tdt, at)
    border_intact(obuf, lbuf, t, d, at)


def test_attngen_prefill_lse_as_documented():
    """attngen.prefill's own partial results over two key halves (return_lse, [batch, heads, seqlen_q]), passed
    as merge_state's docstring says, give attngen.prefill over all the keys."""
    gen = fresh_generator()
    at = f"seed {gen.initial_seed()}"
    sq, sk, h, d = 77, 500, 4, 128
    q, k, v = (_randn(1, n, h, d, gen=gen).to(torch.bfloat16) for n in (sq, sk, sk))
    oa, la = attngen.prefill(q, k[:, :200].contiguous(), v[:, :200].contiguous(), return_lse=True)
    ob, lb = attngen.prefill(q, k[:, 200:].contiguous(), v[:, 200:].contiguous(), return_lse=True)
    o, lse = attngen.merge_state(oa.reshape(-1, h, d), la.transpose(1, 2).reshape(-1, h),
                                 ob.reshape(-1, h, d), lb.transpose(1, 2).reshape(-1, h))
    full_o, full_l = partial_attention(q[0].float(), k[0].float(), v[0].float(), 1.0 / math.sqrt(d))
    torch.cuda.synchronize()
    # the LSE as test_gpu_prefill checks prefill's own (its exp2 and scale products in fp32)
    check(o, lse, full_o, full_l, torch.bfloat16, at, lse_tol=2e-2)


def test_cupy_arrays():
    cp = pytest.importorskip("cupy")
    gen = fresh_generator()
    t, h, d = 9, 2, 64
    va, vb = (_randn(t, h, d, gen=gen).half() for _ in range(2))
    sa, sb = (_randn(t, h, gen=gen) for _ in range(2))
    torch.cuda.synchronize()
    out = cp.full((t, h, d), cp.nan, dtype=cp.float16)
    o, lse = attngen.merge_state(*(cp.asarray(x) for x in (va, sa, vb, sb)), out=out)
    cp.cuda.get_current_stream().synchronize()
    assert o is out and isinstance(lse, cp.ndarray)
    ref_o, ref_l = reference_merge([va, vb], [sa, sb])
    check(torch.as_tensor(o, device="cuda"), torch.as_tensor(lse, device="cuda"), ref_o, ref_l, torch.float16,
          f"seed {gen.initial_seed()}")
