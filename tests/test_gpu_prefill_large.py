"""Head dims above 256 and split QK/V head dims on a real GPU against an fp32 reference (pytest -m gpu):
the chunked kernel, and the whole-row kernel for V narrower than Q/K up to head_dim 256.

Fresh random inputs, outputs poisoned with NaN; q, k and v sit inside larger NaN-filled buffers
(a stray read turns the output NaN) and the output inside a buffer whose border holds a sentinel
(a stray write changes it).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import check_output_and_lse, fresh_generator, reference_attention  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LARGE = (320, 384, 448, 512, 576, 640, 768, 1024)
SENTINEL = 7.0



def _inside_nan(shape, dtype, gen):
    """A random [b, s, h, d] tensor viewed inside a NaN buffer with 3 rows before and after it,
    one head past it and 8 elements past each row."""
    b, s, h, d = shape
    buf = torch.full((b, s + 6, h + 1, d + 8), float("nan"), dtype=dtype, device="cuda")
    view = buf[:, 3:3 + s, :h, :d]
    view.copy_(torch.randn(shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype))
    return view


def run_case(b, sq, sk, h, hk, d, dv, dtype, causal=False, window=(-1, -1), spec=None, sm_scale=None):
    gen = fresh_generator()
    q = _inside_nan((b, sq, h, d), dtype, gen)
    k = _inside_nan((b, sk, hk, d), dtype, gen)
    v = _inside_nan((b, sk, hk, dv), dtype, gen)
    obuf = torch.full((b, sq + 2, h, dv + 8), SENTINEL, dtype=dtype, device="cuda")
    out = obuf[:, 1:1 + sq, :, :dv]
    out.fill_(float("nan"))
    o, lse = attngen.prefill(q, k, v, causal=causal, window=window, return_lse=True, out=out, spec=spec,
                             sm_scale=sm_scale)
    torch.cuda.synchronize()
    assert o is out
    border = obuf.clone()
    border[:, 1:1 + sq, :, :dv] = SENTINEL
    assert (border == SENTINEL).all(), "a write landed outside the output"
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite output elements: a stray read or no write"
    ref_o, ref_l = reference_attention(q, k, v, causal=causal, window=window, sm_scale=sm_scale)
    return check_output_and_lse(o, lse, ref_o, ref_l, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", LARGE)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_large_head_dims(dtype, d, causal):
    run_case(1, 1000, 1000, 2, 2, d, d, dtype, causal=causal)


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (3001, 3001), (17, 1000), (1000, 17), (129, 3001)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_ragged_lengths(sq, sk, causal):
    run_case(2, sq, sk, 2, 1, 512, 512, torch.bfloat16, causal=causal)


@pytest.mark.parametrize("d,dv", [(576, 512), (192, 128), (512, 320), (320, 1024)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_split_head_dims(d, dv, causal):
    run_case(2, 777, 1000, 4, 2, d, dv, torch.bfloat16, causal=causal)


NARROW_V = [(192, 128), (256, 128), (128, 64), (96, 64), (128, 96), (256, 192)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", NARROW_V)
@pytest.mark.parametrize("mma", ["mma_sync", "wgmma"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 37))],
                         ids=["full", "causal", "window"])
def test_narrower_v_whole_row_kernel(dtype, d, dv, mma, causal, window):
    """V narrower than Q/K (DeepSeek's 192/128) through the whole-row kernel, both instructions."""
    if mma == "wgmma" and (d % 64 or dv % 64 or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("wgmma needs sm_90a and head dims that are multiples of 64")
    spec = attngen.PrefillSpec(mma=mma)
    run_case(2, 777, 1000, 4, 2, d, dv, dtype, causal=causal, window=window, spec=spec)
    q = torch.empty(1, 8, 2, d, device="cuda", dtype=dtype)
    from attngen.families.prefill.op import kernel_for

    assert not kernel_for(q, q, q[..., :dv].contiguous(), spec=spec).spec.chunked


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (3001, 3001), (17, 1000), (1000, 17)])
def test_narrower_v_ragged_lengths_and_gqa(sq, sk):
    run_case(2, sq, sk, 6, 2, 192, 128, torch.bfloat16, causal=True)


@pytest.mark.parametrize("h,hk", [(8, 1), (6, 2)])
def test_gqa(h, hk):
    run_case(1, 300, 700, h, hk, 640, 640, torch.bfloat16, causal=True)


@pytest.mark.parametrize("window", [(64, 0), (100, 37)])
def test_sliding_window(window):
    run_case(1, 700, 900, 2, 2, 384, 384, torch.float16, window=window)


@pytest.mark.parametrize("spec", ["head_dim_chunk=32,num_stages=2", "cta_tile_q=32,num_stages=4",
                                  "cta_tile_kv=64,num_stages=3"])
def test_tile_configs(spec):
    run_case(1, 500, 1300, 2, 2, 512, 512, torch.bfloat16, causal=True, spec=f"prefill:{spec}")


def test_head_dim_256_through_the_chunked_kernel():
    run_case(1, 1000, 1000, 4, 4, 256, 256, torch.bfloat16, causal=True, spec="prefill:head_dim_chunk=64")


def _scale_softcap_alibi(s, h, d, spec=None):
    """A custom scale, softcap and ALiBi slopes together, causal, against the fp32 reference."""
    gen = fresh_generator()
    q, k, v = (torch.randn(1, s, h, d, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    slopes = torch.rand(h, device="cuda", generator=gen) * 0.1
    o = attngen.prefill(q, k, v, causal=True, sm_scale=0.03, softcap=20.0, alibi_slopes=slopes, spec=spec)
    ref, _ = reference_attention(q, k, v, causal=True, sm_scale=0.03, softcap=20.0, alibi_slopes=slopes)
    err = (torch.linalg.vector_norm(o.float() - ref) / torch.linalg.vector_norm(ref)).item()
    assert err < 2e-2


def test_sm_scale_softcap_alibi():
    _scale_softcap_alibi(400, 4, 512)


def test_kernel_is_the_chunked_one():
    q = torch.empty(1, 8, 2, 768, device="cuda", dtype=torch.bfloat16)
    from attngen.families.prefill.op import kernel_for

    kern = kernel_for(q, q, q)
    assert kern.spec.chunked and kern.spec.head_dim_chunk in (32, 64)
    if torch.cuda.get_device_capability() == (9, 0):  # the default at 512 is the wgmma form there
        q = torch.empty(1, 8, 2, 512, device="cuda", dtype=torch.bfloat16)
        assert kernel_for(q, q, q).spec.mma.value == "wgmma"


# ---- the chunked kernel's wgmma form (sm_90a): head_dim_v up to 640 ---------------------------------------

# (a warpgroup's V columns end in a 32-column tail step at 320, 448, 576 and 192; padded to whole 64-column
# blocks at 96)
# (and past 640 columns of v split over two CTAs a query tile)
WGMMA_DIMS = [(384, 384), (512, 512), (576, 512), (640, 640), (256, 256), (1024, 512), (320, 320), (448, 448),
              (576, 576), (512, 320), (768, 768), (1024, 1024), (320, 1024), (512, 1024), (512, 96), (640, 192)]


def _spec_that_runs(d, dv, dtype=torch.bfloat16, causal=False, spec=None):
    """The spec of the kernel ``attngen.prefill`` runs for q and k of head dim d and v of dv (``spec`` as
    prefill takes it: a spec or its text)."""
    from attngen.families.prefill.op import kernel_for

    q = torch.empty(1, 8, 2, d, device="cuda", dtype=dtype)
    return kernel_for(q, q, torch.empty(1, 8, 2, dv, device="cuda", dtype=dtype), causal=causal, spec=spec).spec


def _needs_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90a (H100/H200)")


def _wgmma_spec(d, dv, extra=""):
    cfg = "head_dim_chunk=64" if d == 256 else ""
    if 512 < dv <= 640:
        cfg += ",cta_tile_kv=64"
    return f"prefill:mma=wgmma{',' + cfg if cfg else ''}{',' + extra if extra else ''}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", WGMMA_DIMS)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (100, 37))],
                         ids=["full", "causal", "window"])
def test_chunked_wgmma(dtype, d, dv, causal, window):
    _needs_sm90()
    run_case(2, 777, 1000, 4, 2, d, dv, dtype, causal=causal, window=window, spec=_wgmma_spec(d, dv))
    ks = _spec_that_runs(d, dv, dtype, spec=attngen.parse_spec(_wgmma_spec(d, dv)))
    assert ks.chunked and ks.mma.value == "wgmma"


@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 17), (3001, 3001), (17, 1000), (1000, 17), (129, 3001)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunked_wgmma_ragged_lengths_and_gqa(sq, sk, causal):
    _needs_sm90()
    run_case(2, sq, sk, 6, 2, 512, 512, torch.bfloat16, causal=causal, spec=_wgmma_spec(512, 512))


@pytest.mark.parametrize("cfg", ["cta_tile_kv=64,num_stages=3", "cta_tile_kv=128,num_stages=4",
                                 "cta_tile_kv=64,head_dim_chunk=128,num_stages=4",
                                 "cta_tile_kv=128,head_dim_chunk=128,num_stages=3", "cta_tile_kv=32,num_stages=4",
                                 "cta_tile_kv=128,num_stages=8", "cta_tile_kv=64,num_stages=7",
                                 "cta_tile_kv=64,head_dim_chunk=128,num_stages=6",
                                 "cta_tile_kv=128,head_dim_chunk=128,num_stages=4"])
def test_chunked_wgmma_tile_configs(cfg):
    _needs_sm90()
    spec = f"prefill:mma=wgmma,{cfg}"
    run_case(1, 500, 1300, 2, 2, 512, 512, torch.bfloat16, causal=True, spec=spec)
    # the kernel is the one the text pins (a 128-wide chunk is not read as whole rows at the default head_dim)
    ks = _spec_that_runs(512, 512, causal=True, spec=spec)
    want = dict(item.split("=") for item in cfg.split(","))
    assert all(str(getattr(ks, f)) == v for f, v in want.items()), (ks, want)


def test_chunked_wgmma_sm_scale_softcap_alibi():
    _needs_sm90()
    _scale_softcap_alibi(400, 4, 512, spec="prefill:mma=wgmma")


# Past 640 columns of v the two CTAs of a query tile form a cluster that splits the QK work (qk_pair)
# where each half of head_dim is whole chunks and QK's work exceeds a CTA's PV (768, 1024); 512/1024 and
# 320/1024 repeat it in each CTA.
@pytest.mark.parametrize("d,dv,pair", [(1024, 1024, True), (768, 768, True), (512, 1024, False), (320, 1024, False)])
@pytest.mark.parametrize("sq,sk", [(1, 1), (17, 1000), (1000, 17), (129, 3001)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunked_wgmma_split_pairs_ragged_and_gqa(d, dv, pair, sq, sk, causal):
    _needs_sm90()
    run_case(2, sq, sk, 6, 2, d, dv, torch.bfloat16, causal=causal)
    ks = _spec_that_runs(d, dv, causal=causal)
    assert ks.v_splits == 2 and ks.qk_pair is pair


def test_chunked_wgmma_split_pair_window_lse_softcap():
    _needs_sm90()
    run_case(1, 700, 900, 4, 4, 1024, 1024, torch.float16, window=(100, 37))
    _scale_softcap_alibi(300, 2, 768)


# A warpgroup's V columns ending 32 columns into a block take a tail step (no padding), at the default tiles
# and at 64-key tiles; 96 columns of v are padded to 128 as before.
@pytest.mark.parametrize("d,dv,tail", [(320, 320, True), (448, 448, True), (576, 576, True), (640, 192, True),
                                       (192, 192, True), (512, 96, False)])
@pytest.mark.parametrize("kv", [0, 64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chunked_wgmma_v_tail(d, dv, tail, kv, causal):
    _needs_sm90()
    spec = "prefill:mma=wgmma" + (",head_dim_chunk=64" if d <= 256 else "") + (f",cta_tile_kv={kv}" if kv else "")
    for sq, sk in ((1, 1), (17, 1000), (1000, 17), (129, 3001)):
        run_case(2, sq, sk, 6, 2, d, dv, torch.bfloat16, causal=causal, spec=spec)
    ks = _spec_that_runs(d, dv, causal=causal, spec=attngen.parse_spec(spec))
    assert ks.v_tail is tail and ks.dim_v_padded == (dv if tail else 128)
    if kv:
        assert ks.cta_tile_kv == kv
