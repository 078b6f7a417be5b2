"""attngen.prefill and prefill_varlen with fp8 (e4m3) q, k and v on a real sm_90a GPU (pytest -m gpu), against an
fp32 reference computed from the DEQUANTISED tensors (descale * x_fp8), exact softmax.

Inputs are fresh random normal values quantised to e4m3 under random descales (x / descale kept inside e4m3's
finite range), set inside buffers of NaN bytes (a read past either end of q, k or v, or of V's transposed copy,
turns the output NaN). Outputs are NaN-poisoned before the call where ``out`` is passed; a fresh output is
checked finite (and its memory was NaN the moment before: see ``_fresh``).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator, reference_attention, rel  # noqa: E402

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
NAN_BYTE = 0x7F  # e4m3fn's NaN (its only NaN bit pattern besides 0xFF)
NAN = float("nan")

REL_RMS = 0.06
"""Relative RMS (L2) error of O over a case. The kernel quantises P to e4m3 for P V: 3 mantissa bits, a relative
rounding of up to 2^-4 on each probability, uncorrelated across keys, so O's error is a few percent of its size;
q, k and v themselves are exact (the reference reads the same fp8 values, dequantised), and the logits are fp32
sums of exact products."""
MAX_ABS_FRAC, MAX_ABS_FLOOR = 0.1, 1e-3
"""Max abs error of O: at most 0.1 * max|ref| + 1e-3. One row over few keys carries P's rounding without the
averaging of many keys (a row of one or two live keys: up to 2^-4 of |v|), and output rounding to bf16 adds 2^-8."""
LSE_MAX_ABS, LSE_FRAC = 0.02, 2.0 ** -10
"""LSE max abs error (natural log): at most 0.02 + 2^-10 of the largest |LSE| of the case. It is taken from the
logits before P is quantised, but fp8 wgmma sums S = q k^T at reduced precision (about 14 bits of the partial sums
kept, as DeepSeek-V3 reports for Hopper's fp8 MMAs): the logits' error grows with their size (descales far from one
against a small sm_scale make rows of large logits)."""


def _need_sm90a():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("fp8 prefill runs on sm_90a only (see test_refused_off_sm90a)")


# --- inputs -------------------------------------------------------------------------------------------------------

DESCALE_KINDS = ("none", "float", "tensor0", "tensor1", "head", "batch_head")


def make_descale(kind: str, batch: int, kv_heads: int, gen):
    """(the argument a call passes, the fp32 ``[batch, kv_heads]`` values it stands for). ``none``: omitted (1.0);
    ``float``: a Python float; ``tensor0`` / ``tensor1``: an fp32 tensor of shape [] / [1]; ``head``: [kv_heads];
    ``batch_head``: [batch, kv_heads] (FlashAttention-3's shape). Descales lie in [0.015, 0.04]: randn values up to
    ~6 over them stay under e4m3's 448 (and the cast clamps anyway)."""
    def draw(*shape):
        return 0.015 + 0.025 * torch.rand(*shape, device="cuda", generator=gen)

    if kind == "none":
        return None, torch.ones(batch, kv_heads, device="cuda")
    if kind == "float":
        x = draw(1).item()
        return x, torch.full((batch, kv_heads), x, device="cuda")
    if kind == "tensor0":
        t = draw(1).reshape(())
        return t, t.expand(batch, kv_heads).clone()
    if kind == "tensor1":
        t = draw(1)
        return t, t.expand(batch, kv_heads).clone()
    if kind == "head":
        t = draw(kv_heads)
        return t, t[None].expand(batch, kv_heads).clone()
    if kind == "batch_head":
        t = draw(batch, kv_heads)
        return t, t.clone()
    raise ValueError(f"descale kind {kind!r} is not one of {DESCALE_KINDS}")


def quantise(x, scale_rows):
    """``x`` [rows, heads, d] (any float dtype), ``scale_rows`` fp32 [rows, heads] (each row's descale for each
    head) -> (x / scale rounded to e4m3, clamped to its range; the dequantised fp32 values the reference reads)."""
    s = scale_rows[..., None]
    x8 = (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, x8.float() * s


def guarded(x8, pad_rows=3):
    """``x8`` copied into the middle of a buffer of NaN bytes, ``pad_rows`` rows of them on either side (whole
    rows: the view stays as aligned as a fresh tensor)."""
    row = x8[0].numel() if x8.dim() == 3 else x8[0, 0].numel()
    n = x8.numel()
    buf = torch.full((n + 2 * pad_rows * row,), NAN_BYTE, dtype=torch.uint8, device="cuda")
    inner = buf[pad_rows * row: pad_rows * row + n].view(x8.shape)
    inner.copy_(x8.view(torch.uint8))
    return inner.view(E4M3)


class Dense:
    """One dense case: q [b, sq, h, d], k/v [b, sk, hk, d] in e4m3 (NaN-guarded), their descale arguments and the
    dequantised fp32 tensors. ``kinds``: the descale kind of q, k and v (one name for all three)."""

    def __init__(self, b, sq, sk, h, hk, d, kinds="batch_head"):
        kinds = (kinds,) * 3 if isinstance(kinds, str) else tuple(kinds)
        gen = fresh_generator()
        self.shape = (b, sq, sk, h, hk, d)
        self.kinds = kinds
        g = h // hk
        raw = [torch.randn(b, n, heads, d, device="cuda", generator=gen).to(torch.bfloat16)
               for n, heads in ((sq, h), (sk, hk), (sk, hk))]
        self.args, self.deq, self.x8 = [], [], []
        for x, kind, group in zip(raw, kinds, (g, 1, 1)):
            arg, per_bh = make_descale(kind, b, hk, gen)
            heads = x.shape[2]
            # q's head j takes the descale of its KV head j // group (FlashAttention-3's convention)
            rows = per_bh.repeat_interleave(group, dim=1)[:, None, :].expand(b, x.shape[1], heads)
            x8, xd = quantise(x.reshape(-1, heads, d), rows.reshape(-1, heads))
            self.args.append(arg)
            self.x8.append(guarded(x8.reshape(x.shape)))
            self.deq.append(xd.reshape(x.shape))
        self.q, self.k, self.v = self.x8
        self.descales = dict(zip(("q_descale", "k_descale", "v_descale"), self.args))

    def at(self) -> str:
        return f"(b, sq, sk, h, hk, d)={self.shape}, descales {self.kinds}"

    def reference(self, **kw):
        return reference_attention(*self.deq, **kw)


def _fresh(shape, dtype):
    """Leave NaN where the next allocation of ``shape`` x ``dtype`` most likely lands: the caching allocator hands
    a freed block of the same size out again, so an output the kernel leaves unwritten most likely reads NaN."""
    torch.full(shape, NAN, dtype=dtype, device="cuda")


def check(o, lse, ref_o, ref_l, *, dtype, at):
    """The fp8 bounds (REL_RMS, MAX_ABS_*, LSE_MAX_ABS), every output finite, rows that see no key zero with LSE
    -inf. ``lse`` / ``ref_l`` as [..., heads, rows] with ``o`` [..., rows, heads, d]. Returns the rel RMS error."""
    assert o.dtype == dtype, f"output dtype {o.dtype}, expected {dtype}; {at}"
    assert o.shape == ref_o.shape, f"output shape {tuple(o.shape)}, expected {tuple(ref_o.shape)}; {at}"
    bad = int((~torch.isfinite(o)).sum())
    assert bad == 0, f"{bad} unwritten (NaN) or non-finite outputs; {at}"
    err = rel(o, ref_o)
    mx = (o.float() - ref_o).abs().max().item() if o.numel() else 0.0
    bound = MAX_ABS_FRAC * (ref_o.abs().max().item() if o.numel() else 0.0) + MAX_ABS_FLOOR
    assert err <= REL_RMS, f"rel RMS error {err:.3e} (max abs {mx:.3e}); {at}"
    assert mx <= bound, f"max abs error {mx:.3e} over {bound:.3e} (rel RMS {err:.3e}); {at}"
    empty = torch.isinf(ref_l).transpose(-1, -2)
    if empty.any():
        assert (o[empty] == 0).all(), f"a query that sees no key must give zeros; {at}"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == ref_l.shape, (lse.dtype, tuple(lse.shape), at)
        assert not torch.isnan(lse).any(), f"NaN in the LSE; {at}"
        fin = torch.isfinite(ref_l)
        assert torch.equal(torch.isfinite(lse), fin), f"LSE finite where the reference is -inf, or the reverse; {at}"
        assert (lse[~fin] == float("-inf")).all(), f"an empty row's LSE must be -inf; {at}"
        if fin.any():
            lerr = (lse[fin] - ref_l[fin]).abs().max().item()
            lbound = LSE_MAX_ABS + LSE_FRAC * ref_l[fin].abs().max().item()
            assert lerr <= lbound, f"LSE max abs error {lerr:.3e} over {lbound:.3e}; {at}"
    return err


def run_dense(case, *, causal=False, window=(-1, -1), sm_scale=None, lse=True, out_dtype=None, spec=None,
              expect=torch.bfloat16):
    """One call of attngen.prefill on ``case`` checked against the reference: into a NaN-filled ``out`` of
    ``out_dtype`` where given, else a fresh output (of ``expect``, the dtype the call must choose)."""
    _need_sm90a()
    b, sq, sk, h, hk, d = case.shape
    out = None
    if out_dtype is not None:
        out = torch.full((b, sq, h, d), NAN, dtype=out_dtype, device="cuda")
        expect = out_dtype
    else:
        _fresh((b, sq, h, d), expect)
    res = attngen.prefill(case.q, case.k, case.v, causal=causal, window=window, sm_scale=sm_scale, return_lse=lse,
                          out=out, spec=spec, **case.descales)
    torch.cuda.synchronize()
    o, l = res if lse else (res, None)
    if out is not None:
        assert o is out, "the call must write into (and return) the out it was given"
    ref_o, ref_l = case.reference(causal=causal, window=window, sm_scale=sm_scale)
    at = f"{case.at()}, causal {causal}, window {window}"
    return check(o, l, ref_o, ref_l, dtype=expect, at=at)


# --- dense --------------------------------------------------------------------------------------------------------

# (batch, seqlen_q, seqlen_k) paired with (heads, kv_heads): every shape once with each head layout is more GPU time
# than it finds; the pairs put MQA and GQA on short, long and uneven shapes
DENSE = [((1, 1, 1), (8, 8)), ((1, 17, 17), (32, 8)), ((2, 300, 300), (4, 1)), ((1, 1000, 1000), (32, 8)),
         ((2, 128, 512), (8, 8)), ((1, 512, 128), (32, 8)), ((1, 4096, 4096), (4, 1))]


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqs,heads", DENSE, ids=[f"{s[0]}x{s[1]}x{s[2]}-h{h[0]}/{h[1]}" for s, h in DENSE])
def test_dense(seqs, heads, causal, d):
    # causal with sq > sk (512 x 128) leaves the first rows no key: zeros and LSE -inf
    b, sq, sk = seqs
    run_dense(Dense(b, sq, sk, *heads, d), causal=causal, out_dtype=torch.bfloat16 if sq % 2 else None)


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("window", [(64, 0), (128, 128)], ids=str)
@pytest.mark.parametrize("seqs", [(2, 300, 300), (1, 1000, 1000)], ids=str)
def test_sliding_window(seqs, window, d):
    run_dense(Dense(*seqs, 32, 8, d), window=window, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_no_lse_and_sm_scale(causal):
    run_dense(Dense(2, 333, 1031, 32, 8, 128), causal=causal, lse=False, sm_scale=0.05)


# --- descales -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kinds", [*DESCALE_KINDS, ("float", "head", "batch_head"), ("batch_head", "none", "tensor0")],
                         ids=lambda k: k if isinstance(k, str) else "-".join(k))
def test_every_form_of_the_descales(kinds, causal):
    # GQA 32/8 with a descale per (batch, KV head): a query head reading its own index instead of its KV head's
    # would scale its logits wrongly
    run_dense(Dense(2, 333, 1031, 32, 8, 128, kinds=kinds), causal=causal)


def test_descales_far_from_one():
    # the same fp8 values under descales 100 times larger: the logits' size (against a small sm_scale) and O's come
    # from the descales alone, applied in fp32
    case = Dense(1, 700, 700, 8, 2, 128, kinds="batch_head")
    for i, x in enumerate(case.args):
        x.mul_(100.0)
        case.deq[i] = case.deq[i] * 100.0
    run_dense(case, sm_scale=1e-4)


# --- the output's dtype -------------------------------------------------------------------------------------------

def test_out_fp16():
    run_dense(Dense(2, 300, 517, 32, 8, 128), causal=True, out_dtype=torch.float16)


@pytest.mark.parametrize("d", [128, 256])
def test_spec_dtype_fp16(d):
    spec = attngen.PrefillSpec(head_dim=d, qkv_dtype="fp8_e4m3", dtype="fp16")
    run_dense(Dense(1, 1000, 1000, 8, 8, d), causal=True, spec=spec, expect=torch.float16)


def test_default_output_is_bf16():
    run_dense(Dense(1, 129, 257, 8, 8, 128), expect=torch.bfloat16)


def test_uint8_tensors_with_the_spec():
    # bytes name their format through the spec: the same bits as the e4m3 call
    _need_sm90a()
    case = Dense(1, 300, 300, 8, 2, 128, kinds="head")
    spec = attngen.PrefillSpec(head_dim=128, qkv_dtype="fp8_e4m3")
    a, la = attngen.prefill(case.q, case.k, case.v, causal=True, return_lse=True, **case.descales)
    b, lb = attngen.prefill(case.q.view(torch.uint8), case.k.view(torch.uint8), case.v.view(torch.uint8),
                            causal=True, return_lse=True, spec=spec, **case.descales)
    torch.cuda.synchronize()
    assert torch.equal(a, b) and torch.equal(la, lb)
    ref_o, ref_l = case.reference(causal=True)
    check(b, lb, ref_o, ref_l, dtype=torch.bfloat16, at=case.at())


# --- explicit tiles and schedules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("schedule", ["serial", "overlap", "pingpong"])
def test_schedules(schedule, causal):
    spec = attngen.PrefillSpec(head_dim=128, qkv_dtype="fp8_e4m3", cta_tile_q=128, cta_tile_kv=128, num_warps=8,
                               num_stages=2, schedule=schedule)
    run_dense(Dense(2, 700, 1031, 32, 8, 128), causal=causal, spec=spec, out_dtype=torch.bfloat16)


# The mma.sync form (sm_89, sm_120's default; on the H100/H200 pinned by a spec): the cp.async ring, V's copy read
# with ldmatrix, m16n8k32 e4m3. Its tiles as the defaults of those archs take them (128x64 at head dim 128, 64x32 at
# 256 in their 99 KB) and the others it lists.
SYNC_TILES = [(128, 64, 8, 2), (64, 32, 4, 2), (128, 128, 8, 2), (128, 32, 8, 2)]


def _sync_spec(d, q, kv, w, st, varlen=False):
    return attngen.PrefillSpec(head_dim=d, qkv_dtype="fp8_e4m3", cta_tile_q=q, cta_tile_kv=kv, num_warps=w,
                               num_stages=st, mma="mma_sync", pipeline="sync", varlen=varlen)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("tiles", SYNC_TILES, ids=lambda t: "q{}k{}w{}s{}".format(*t))
def test_mma_sync_form(tiles, d, causal):
    try:
        spec = _sync_spec(d, *tiles)
        attngen.resolve(spec, "sm_90")
    except attngen.SpecError as e:
        pytest.skip(f"refused for this arch: {e}")
    run_dense(Dense(2, 333, 1031, 8, 2, d, kinds="batch_head"), causal=causal, spec=spec, out_dtype=torch.bfloat16)


# --- varlen -------------------------------------------------------------------------------------------------------

VARLEN_Q = [1, 300, 0, 1025, 128]
VARLEN_K = {True: [1, 517, 0, 1025, 300],   # causal: k >= q, the queries aligned bottom-right
            False: [7, 300, 0, 700, 1]}     # not: fewer keys than queries too


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("form", ["default", "mma_sync"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(causal, d, form):
    _need_sm90a()
    spec = None if form == "default" else _sync_spec(d, *((128, 64, 8, 2) if d == 128 else (64, 32, 4, 2)), varlen=True)
    h, hk, g = 32, 8, 4
    lq, lk = VARLEN_Q, VARLEN_K[causal]
    n = len(lq)
    gen = fresh_generator()
    seq_q = torch.repeat_interleave(torch.arange(n, device="cuda"), torch.tensor(lq, device="cuda"))
    seq_k = torch.repeat_interleave(torch.arange(n, device="cuda"), torch.tensor(lk, device="cuda"))
    args, deq, x8 = [], [], []
    for rows, heads, group in ((seq_q, h, g), (seq_k, hk, 1), (seq_k, hk, 1)):
        arg, per_bh = make_descale("batch_head", n, hk, gen)  # indexed by sequence
        x = torch.randn(len(rows), heads, d, device="cuda", generator=gen).to(torch.bfloat16)
        packed, xd = quantise(x, per_bh.repeat_interleave(group, dim=1)[rows])
        args.append(arg)
        x8.append(guarded(packed))
        deq.append(xd)
    out = torch.full((sum(lq), h, d), NAN, dtype=torch.bfloat16, device="cuda")
    o, lse = attngen.prefill_varlen(*x8, _cu(lq), _cu(lk), max(lq), max(lk), causal=causal, return_lse=True, out=out,
                                    q_descale=args[0], k_descale=args[1], v_descale=args[2], spec=spec)
    torch.cuda.synchronize()
    assert o is out
    assert lse.shape == (h, sum(lq)), tuple(lse.shape)
    ref_o = torch.zeros(sum(lq), h, d, device="cuda")
    ref_l = torch.full((h, sum(lq)), float("-inf"), device="cuda")
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for s in range(n):
        if lq[s] == 0:
            continue
        qs, ks = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        ro, rl = reference_attention(deq[0][qs][None], deq[1][ks][None], deq[2][ks][None], causal=causal)
        ref_o[qs], ref_l[:, qs] = ro[0], rl[0]
    check(o, lse, ref_o, ref_l, dtype=torch.bfloat16, at=f"varlen q {lq} k {lk} causal {causal} d {d} {form}")


# --- the call cache -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["float", "head", "batch_head"])
def test_second_call_and_new_descales(kind):
    # the second call with the same tensors reuses what the first worked out and gives the same bits; a call with
    # other descales after it (new objects, then the same tensors changed in place) must read the new ones
    _need_sm90a()
    case = Dense(2, 300, 700, 32, 8, 128, kinds=kind)
    first = attngen.prefill(case.q, case.k, case.v, causal=True, return_lse=True, **case.descales)
    again = attngen.prefill(case.q, case.k, case.v, causal=True, return_lse=True, **case.descales)
    torch.cuda.synchronize()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    ref_o, ref_l = case.reference(causal=True)
    check(*again, ref_o, ref_l, dtype=torch.bfloat16, at=case.at())

    factors = (2.0, 0.5, 3.0)  # q, k, v: logits x1, O x3
    new = {name: x * f for (name, x), f in zip(case.descales.items(), factors)}  # floats or new tensors
    o, l = attngen.prefill(case.q, case.k, case.v, causal=True, return_lse=True, **new)
    torch.cuda.synchronize()
    deq = [x * f for x, f in zip(case.deq, factors)]
    ref_o, ref_l = reference_attention(*deq, causal=True)
    check(o, l, ref_o, ref_l, dtype=torch.bfloat16, at=case.at() + ", new descales")
    assert not torch.equal(o, first[0])
    if kind != "float":
        for x, f in zip(case.args, (1.0, 4.0, 0.25)):  # in place: logits x4, O x1/4
            x.mul_(f)
        o, l = attngen.prefill(case.q, case.k, case.v, causal=True, return_lse=True, **case.descales)
        torch.cuda.synchronize()
        deq = [x * f for x, f in zip(case.deq, (1.0, 4.0, 0.25))]
        ref_o, ref_l = reference_attention(*deq, causal=True)
        check(o, l, ref_o, ref_l, dtype=torch.bfloat16, at=case.at() + ", descales changed in place")


# --- refusals -----------------------------------------------------------------------------------------------------

def _fp8(*shape, dtype=E4M3):
    return torch.randn(*shape, device="cuda").clamp(-E4M3_MAX, E4M3_MAX).to(dtype)


REFUSALS = {
    # name: (what the message must name, how the call's arguments change)
    "descale_on_cpu": ("k_descale", lambda a: a["kw"].update(k_descale=torch.ones(8))),
    "descale_shape_3": ("v_descale", lambda a: a["kw"].update(v_descale=torch.ones(3, device="cuda"))),
    "descale_fp16": ("q_descale", lambda a: a["kw"].update(q_descale=torch.ones(8, device="cuda",
                                                                                 dtype=torch.float16))),
    "e5m2": ("e5m2", lambda a: a.update(q=_fp8(1, 64, 32, 128, dtype=torch.float8_e5m2),
                                        k=_fp8(1, 64, 8, 128, dtype=torch.float8_e5m2),
                                        v=_fp8(1, 64, 8, 128, dtype=torch.float8_e5m2))),
    "mixed": ("dtype", lambda a: a.update(k=torch.randn(1, 64, 8, 128, device="cuda", dtype=torch.bfloat16))),
    "softcap": ("softcap", lambda a: a["kw"].update(softcap=30.0)),
    "head_dim_64": ("head_dim", lambda a: a.update(q=_fp8(1, 64, 32, 64), k=_fp8(1, 64, 8, 64), v=_fp8(1, 64, 8, 64))),
}


@pytest.mark.parametrize("bad", list(REFUSALS))
def test_refusals(bad):
    # refused before any launch, the error naming what is wrong; the out given stays as it was
    _need_sm90a()
    a = dict(q=_fp8(1, 64, 32, 128), k=_fp8(1, 64, 8, 128), v=_fp8(1, 64, 8, 128), kw={})
    name, change = REFUSALS[bad]
    change(a)
    out = torch.full((1, 64, 32, a["q"].shape[-1]), NAN, dtype=torch.bfloat16, device="cuda")
    with pytest.raises((attngen.LaunchError, attngen.SpecError)) as ei:
        attngen.prefill(a["q"], a["k"], a["v"], out=out, **a["kw"])
    assert name in str(ei.value), str(ei.value)
    torch.cuda.synchronize()
    assert torch.isnan(out).all()


def test_refused_off_sm90a():
    # elsewhere (sm_80, 89, 100, 120) the spec refuses qkv_dtype, naming the arch
    if torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this GPU runs fp8 prefill")
    with pytest.raises(attngen.SpecError) as ei:
        attngen.prefill(_fp8(1, 64, 8, 128), _fp8(1, 64, 8, 128), _fp8(1, 64, 8, 128))
    assert ei.value.field == "qkv_dtype" and "sm_" in str(ei.value)


# --- FlashAttention's names (FlashAttention 3's descale arguments) ------------------------------------------------

def test_flash_attn_func_fp8_matches_prefill():
    _need_sm90a()
    case = Dense(2, 300, 517, 32, 8, 128, kinds="batch_head")
    a = attngen.prefill(case.q, case.k, case.v, causal=True, **case.descales)
    b = attngen.flash_attn_func(case.q, case.k, case.v, causal=True, **case.descales)
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    ref_o, ref_l = case.reference(causal=True)
    check(b, None, ref_o, ref_l, dtype=torch.bfloat16, at=case.at())


def test_flash_attn_varlen_func_fp8_matches_prefill_varlen():
    _need_sm90a()
    case = Dense(1, 300, 300, 8, 2, 128, kinds="head")
    q, k, v = (x[0] for x in (case.q, case.k, case.v))
    cu = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    a = attngen.prefill_varlen(q, k, v, cu, cu, 300, 300, causal=True, **case.descales)
    b = attngen.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=True, **case.descales)
    torch.cuda.synchronize()
    assert torch.equal(a, b)
    ref_o, ref_l = case.reference(causal=True)
    check(b[None], None, ref_o, ref_l, dtype=torch.bfloat16, at=case.at())
