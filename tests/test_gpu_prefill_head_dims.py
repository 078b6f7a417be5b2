"""Whole-row head dims that are not 64, 96, 128, 192 or 256 on a real GPU (pytest -m gpu): every multiple of 8
from 32 to 256 runs the mma.sync kernel (multiples of 64 keep their wgmma and TMA kernels on sm_90a), with tiles
by ``defaults.neighbour``; a head dim of 8 mod 16 computes over one zeroed chunk more (fwd.cuh.jinja, QK_DIM).
Dense, varlen (contiguous and paged) and custom-mask layouts, against an fp32 reference, outputs poisoned with
NaN first and inputs inside NaN-filled buffers. Odd lengths (77, 203) leave partial tiles at both ends.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.test_gpu_prefill import run_case  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.test_gpu_prefill_serving import (check_sentinel, compare, guarded, range_keep, reference,  # noqa: E402
                                            run_masked, run_varlen, sentinel_out)

# 8 mod 16 (40, 72, 120, 200), multiples of 16 new to the kernel (32, 48, 80, 112, 160, 224) and two measured ones
DIMS = (32, 40, 48, 72, 80, 96, 112, 120, 160, 200, 224, 256)
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
MASKS = {"none": (False, (-1, -1)), "causal": (True, (-1, -1)), "window": (False, (48, 16))}


@DTYPES
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("mask", list(MASKS))
def test_dense(dtype, d, mask):
    causal, window = MASKS[mask]
    run_case(2, 77, 203, 4, 2, d, dtype, causal=causal, window=window)


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("mask,block_size", [("none", 0), ("causal", 16), ("window", 0)],
                         ids=["none-contiguous", "causal-paged", "window-contiguous"])
def test_varlen(d, mask, block_size):
    causal, window = MASKS[mask]
    dtype = torch.float16 if d % 16 else torch.bfloat16
    errs = run_varlen([77, 0, 203, 5], [203, 9, 203, 77], 4, 2, d, dtype, causal=causal, window=window,
                      block_size=block_size)
    assert errs


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_custom_mask(d, causal):
    gen = torch.Generator(device="cpu").manual_seed(d)
    keep = torch.rand(77, 203, generator=gen) < 0.4
    keep[:, 0] = True  # every row sees a key (causal rows align bottom-right, so key 0 is in every row's range)
    run_masked(2, 77, 203, 4, 2, d, torch.bfloat16, keep.cuda(), causal=causal)


@pytest.mark.parametrize("d,dv", [(40, 32), (120, 72), (200, 160), (224, 128), (128, 72), (72, 64), (256, 136)])
@pytest.mark.parametrize("layout", ["dense", "varlen", "mask"])
def test_narrower_v(d, dv, layout):
    """head_dim_v below head_dim (O staged in Q's padded rows); 8 mod 16 on either side."""
    if layout == "dense":
        gen = fresh_generator()
        q, k = (guarded(2, n, h, d, dtype=torch.bfloat16, gen=gen) for n, h in ((77, 4), (203, 2)))
        v = guarded(2, 203, 2, dv, dtype=torch.bfloat16, gen=gen)
        out, buf, guards = sentinel_out((2, 77, 4, dv), torch.bfloat16)
        o, lse = attngen.prefill(q, k, v, causal=True, return_lse=True, out=out)
        torch.cuda.synchronize()
        check_sentinel(buf, guards)
        ref_o, ref_l = reference(q, k, v, range_keep(77, 203, True, (-1, -1)), d ** -0.5)
        compare(o, lse, ref_o, ref_l, torch.bfloat16)
        return
    if layout == "varlen":
        run_varlen([77, 203], [203, 203], 4, 2, d, torch.bfloat16, causal=False, block_size=16, dv=dv)
        return
    keep = torch.rand(77, 203, generator=torch.Generator().manual_seed(dv)) < 0.5
    keep[:, -1] = True
    run_masked(1, 77, 203, 4, 4, d, torch.bfloat16, keep.cuda(), dv=dv)


@pytest.mark.parametrize("d", [259, 264, 300])
def test_other_head_dims_refused_by_name(d):
    """Past 256 (below it the ops pad: tests/test_gpu_fa55_rest.py), a head dim no kernel takes is refused before
    launch, naming head_dim, its value and the rule."""
    q = torch.randn(1, 16, 4, d, device="cuda", dtype=torch.float16)
    with pytest.raises(attngen.LaunchError, match=rf"head_dim={d} is not supported; allowed: a multiple of 8 "
                                                   r"from 32 to 256"):
        attngen.flash_attn_func(q, q, q)
