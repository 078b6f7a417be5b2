"""Paged attngen.decode on a real GPU (pytest -m gpu): the copies' per-group lookups (templates/decode/producer.cuh,
load_rows_paged), beside test_gpu_decode.py's paged cases.

Each 16-row group of a tile finds its block from the table entry of its first row, read a tile ahead; a thread's
other rows of the group step from its first. Where blocks hold whole tiles (block_size a multiple of the tile) the
fused kernel runs a second copy of its loop that reads one entry a tile and steps every row from the first. These
cases cover what that creates: block sizes that do and do not divide the tile and multiples of it, warp counts whose
threads' first rows lie in different groups (rows 16 or 32 apart), entries read ahead past a row's end, a pool past
4 GiB (64-bit offsets from the block and the slot), a long table, and bad entries, which read a wrong block but
never fault.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.test_gpu_decode import NAN, Case, check, run  # noqa: E402

# Ends inside a 16-row group, on a group's or a tile's edge and one past, and long.
LENGTHS = [1, 15, 16, 17, 63, 64, 65, 200, 1000, 3001]


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 80, 128, 512])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_block_sizes_each_head_dim(d, block_size):
    # The default kernel of each head dim (head_dim 64: 8 warps on 128-key tiles, rows 32 apart; 128: rows 8 apart,
    # two a group; 256: four a group), blocks of one group, of several, not dividing a 64-key tile (48, 80), and of
    # whole tiles (64 at head_dim 128; 128 and 512 everywhere).
    run(Case(LENGTHS, q_len=3, heads=16, kv_heads=2, head_dim=d, dtype=torch.bfloat16, block_size=block_size))


@pytest.mark.parametrize("variant", ["fused", "unfused"])
@pytest.mark.parametrize("cfg", [(64, 64, 4, 2), (64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
                                 (256, 128, 8, 1), (256, 64, 4, 1)], ids=lambda c: "d%d-kv%d-w%d-st%d" % c)
@pytest.mark.parametrize("block_size", [16, 48, 64, 256])
def test_warp_counts(variant, cfg, block_size):
    # Threads' first rows of a tile 16 apart (head_dim 64 at 4 warps, 128 at 8: one row a group), 32 apart (64 at 8
    # warps: half the threads start in the tile's second group), 8 or 4 (two or four rows a group), one-stage to
    # three-stage rings (three stages or more, fused, blocks of whole tiles: the one-lookup-a-tile loop); split so
    # that some splits get no tile.
    d, kv, w, st = cfg
    spec = attngen.DecodeSpec(cta_tile_kv=kv, num_warps=w, num_stages=st)
    case = Case(LENGTHS, q_len=2, heads=8, kv_heads=2, head_dim=d, dtype=torch.bfloat16, block_size=block_size)
    for splits in (1, 7):
        out = torch.full_like(case.q, NAN)
        o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=splits,
                                variant=variant, spec=spec, out=out, return_lse=True)
        torch.cuda.synchronize()
        check(case, o, lse)


@pytest.mark.parametrize("bs", [16, 64])
def test_long_table_and_pool_past_4gib(bs):
    # Blocks at the far end of a pool of over 4 GiB a cache (a block's byte offset needs 64 bits), in a table of
    # 70000 entries a row, against the same keys in a small pool; positions past a row's end hold NaN. Blocks of
    # 16 take a lookup a 16-row group, of 64 one a tile.
    free, _ = torch.cuda.mem_get_info()
    hk, d = 1, 128
    num_blocks = (4 << 30) // (bs * hk * d * 2) + 64
    if free < 2 * num_blocks * bs * hk * d * 2 + (2 << 30):
        pytest.skip("needs about 10 GiB of free GPU memory")
    lengths, width = [1000, 2049, 77], 70000
    k = torch.empty(num_blocks, bs, hk, d, dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    gen = torch.Generator(device="cuda").manual_seed(5)
    table = torch.zeros(len(lengths), width, dtype=torch.int32, device="cuda")
    small_table = torch.zeros_like(table)
    small_k, small_v = [], []
    top, base = num_blocks, 0
    for b, n in enumerate(lengths):
        m = -(-n // bs)
        own = torch.arange(top - m, top, device="cuda", dtype=torch.int32).flip(0)  # the pool's last blocks, reversed
        top -= m
        table[b, :m] = own
        small_table[b, :m] = torch.arange(base, base + m, device="cuda", dtype=torch.int32)
        base += m
        for cache, small in ((k, small_k), (v, small_v)):
            dense = torch.full((m * bs, hk, d), NAN, dtype=torch.bfloat16, device="cuda")
            dense[:n] = torch.randn(n, hk, d, device="cuda", generator=gen).to(torch.bfloat16)
            cache[own.long()] = dense.view(m, bs, hk, d)
            small.append(dense.view(m, bs, hk, d))
    q = torch.randn(len(lengths), 1, 8, d, device="cuda", generator=gen).to(torch.bfloat16)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    got = attngen.decode(q, k, v, cache_seqlens=seqlens, block_table=table)
    want = attngen.decode(q, torch.cat(small_k), torch.cat(small_v), cache_seqlens=seqlens, block_table=small_table)
    torch.cuda.synchronize()
    assert torch.isfinite(got).all()
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


def test_bad_entries_read_a_wrong_block_never_fault():
    # Entries past the pool and negative ones inside rows 0 and 1 are clamped to the pool: those rows read some
    # block (their outputs are not checked), the launch does not fault, and the other rows are exact.
    case = Case([300, 700, 1000, 2001], q_len=1, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                block_size=16, spare_blocks=0)
    bad = case.block_table.clone()
    bad[0, 3] = 1 << 30
    bad[1, 5] = -7
    out = torch.full_like(case.q, NAN)
    attngen.decode(case.q, case.k_cache, case.v_cache, cache_seqlens=case.seqlens, block_table=bad, out=out)
    torch.cuda.synchronize()
    ref, _ = case.reference()
    good = out[2:].float()
    assert torch.isfinite(good).all()
    assert (good - ref[2:]).abs().max().item() < 6e-2
