"""attngen.decode at the head dims between the measured ones and at large GQA groups, on a real GPU
(pytest -m gpu), against the fp32 reference.

Head dims that are not multiples of 64 take padded shared-memory rows (and, where head_dim % 16 == 8,
a zeroed pad chunk the last MMA step reads): each is checked contiguous and paged, one split and the
automatic count, one and three new tokens (head_dim 512 too), with outputs poisoned with NaN and NaN in every cache
position a row must not read (tests/test_gpu_decode.py's Case). Groups of 64 query heads over one KV
head fill 64 packed rows of one CTA.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator, reference_decode  # noqa: E402
from tests.test_gpu_decode import Case, rel_l2, run  # noqa: E402

# Both sides of the tile-rule's boundaries (64, 128, 256), head_dim % 16 == 8 and == 0, the smallest, and 512
# (two CTAs a KV head, each half the output columns).
DIMS = [32, 40, 72, 80, 96, 112, 160, 192, 200, 224, 248, 512]
LENGTHS = [1, 17, 64, 65, 300, 1000, 2049]


@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 0], ids=["one_split", "auto"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_head_dims(d, paged, num_splits, q_len):
    case = Case(LENGTHS, q_len=q_len, heads=8, kv_heads=2, head_dim=d, dtype=torch.bfloat16,
                block_size=16 if paged else None)
    run(case, num_splits=num_splits)


@pytest.mark.parametrize("d", [40, 80, 200])
@pytest.mark.parametrize("variant", ["unfused"])
def test_head_dims_unfused(d, variant):
    run(Case(LENGTHS, q_len=2, heads=8, kv_heads=2, head_dim=d, dtype=torch.float16), variant=variant, num_splits=3)


@pytest.mark.parametrize("d", [72, 128, 200, 512])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("num_splits", [1, 0], ids=["one_split", "auto"])
def test_group_64_over_one_kv_head(d, paged, q_len, num_splits):
    # 64 x q_len packed rows a CTA (128 at two tokens)
    case = Case([1, 65, 1000, 3000], q_len=q_len, heads=64, kv_heads=1, head_dim=d, dtype=torch.bfloat16,
                block_size=32 if paged else None)
    run(case, num_splits=num_splits)


@pytest.mark.parametrize("group", [4, 32, 128])
def test_groups_past_16(group):
    run(Case([3, 129, 2000], q_len=1, heads=group, kv_heads=1, head_dim=96, dtype=torch.float16), num_splits=0)


@pytest.mark.parametrize("d", [40, 96, 200, 512])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_window_and_left_pad(d, paged, num_splits):
    """The local kernels at padded head dims: a sliding window and left pads, poisoned before each pad."""
    gen = fresh_generator()
    b, hk, h, q_len, bs = 3, 2, 8, 2, 16
    ends, starts = [70, 500, 1500], [0, 33, 400]
    cap = 1536
    kc = torch.full((b, cap, hk, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    vc = kc.clone()
    for i, (s, e) in enumerate(zip(starts, ends)):
        kc[i, s:e] = torch.randn(e - s, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
        vc[i, s:e] = torch.randn(e - s, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
    table = None
    if paged:
        per = cap // bs
        perm = torch.randperm(b * per, device="cuda", generator=gen).to(torch.int32)
        table = perm.reshape(b, per)
        pool_k = torch.full((b * per, bs, hk, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        pool_v = pool_k.clone()
        pool_k[table.flatten().long()] = kc.reshape(b * per, bs, hk, d)
        pool_v[table.flatten().long()] = vc.reshape(b * per, bs, hk, d)
        kc, vc = pool_k, pool_v
    q = torch.randn(b, q_len, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    seqlens = torch.tensor(ends, device="cuda", dtype=torch.int32)
    pads = torch.tensor(starts, device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    attngen.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table, window=(90, 0), cache_leftpad=pads,
                   num_splits=num_splits, out=out)
    torch.cuda.synchronize()
    ref, _ = reference_decode(q, kc, vc, ends, block_table=table, window=(90, 0), cache_leftpad=starts)
    assert torch.isfinite(out).all(), f"NaN in the output; seed {gen.initial_seed()}"
    assert rel_l2(out, ref) < 2e-2, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("d", [80, 160, 512])
def test_softcap_and_alibi(d):
    gen = fresh_generator()
    case = Case([5, 300, 1000], q_len=2, heads=8, kv_heads=2, head_dim=d, dtype=torch.bfloat16)
    slopes = torch.rand(8, device="cuda", generator=gen) * 0.1
    out = torch.full_like(case.q, float("nan"))
    attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), softcap=20.0, alibi_slopes=slopes,
                   num_splits=3, out=out)
    torch.cuda.synchronize()
    ref, _ = reference_decode(case.q, case.k_cache, case.v_cache, case.seqlens, softcap=20.0, alibi_slopes=slopes)
    assert torch.isfinite(out).all() and rel_l2(out, ref) < 2e-2, f"seed {case.seed}"


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_flash_attn_with_kvcache_head_dim_80(paged):
    case = Case([7, 400, 1000], q_len=1, heads=16, kv_heads=4, head_dim=80, dtype=torch.bfloat16,
                block_size=64 if paged else None)
    out = attngen.flash_attn_with_kvcache(case.q, case.k_cache, case.v_cache, cache_seqlens=case.seqlens,
                                          block_table=case.block_table, causal=True)
    torch.cuda.synchronize()
    ref, _ = case.reference()
    assert torch.isfinite(out).all() and rel_l2(out, ref) < 2e-2, f"seed {case.seed}"
