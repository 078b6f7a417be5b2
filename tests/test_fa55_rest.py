"""Issue 55's last refusals, on the CPU: paged block sizes past 256, head dims that are not a multiple of 8
(a zero-padded copy), and more than 8 new tokens with causal=False through the KV-cache call where no paged
prefill route reads the cache."""

from __future__ import annotations

import random
import re

import pytest

from attngen import LaunchError
from attngen.families.decode.op import block_mul
from attngen.families.split_kv import check_block_size


@pytest.mark.parametrize("bs", [16, 48, 256, 272, 512, 1008, 4096, 3 * 2 ** 20 + 16, 2 ** 30])
def test_decode_block_lookup_is_exact_for_any_multiple_of_16(bs):
    """Decode::block_of is pos * block_mul >> (31 + ceil(log2(bs))): exact for every position below 2^31 at any
    block size, the non-powers of two past 256 included (a sample of positions, the block edges among them)."""
    mul, shift = block_mul(bs), 31 + (bs - 1).bit_length()
    assert 2 ** 31 <= mul < 2 ** 32
    rng = random.Random(bs)
    edges = [k * bs + e for k in (1, 2, 7, (2 ** 31 - 1) // bs) for e in (-1, 0, 1)]
    for pos in [0, 1, 2 ** 31 - 1, *edges, *(rng.randrange(2 ** 31) for _ in range(500))]:
        if 0 <= pos < 2 ** 31:
            assert (pos * mul) >> shift == pos // bs, (bs, pos)


def test_block_sizes_past_256_are_taken_and_the_rest_refused_by_name():
    assert check_block_size(512, 3, "k_cache") == 1536
    assert check_block_size(272, 2, "k") == 544
    assert check_block_size(4096, 1, "k") == 4096
    for bs, text in ((8, "block_size=8 (k_cache.shape[1]) is not supported; allowed: a positive multiple of 16"),
                     (520, "block_size=520 (k_cache.shape[1])"), (0, "block_size=0 ")):
        with pytest.raises(LaunchError, match=re.escape(text)):
            check_block_size(bs, 4, "k_cache")
    with pytest.raises(LaunchError, match=r"2048 blocks a row x block_size=1048576 = 2147483648 positions is not "
                                          r"supported; allowed: fewer than 2\^31"):
        check_block_size(2 ** 20, 2048, "k_cache")
    # MLA decode keeps the sizes its kernels were checked at.
    with pytest.raises(LaunchError, match="allowed: a multiple of 16 from 16 to 256"):
        check_block_size(512, 1, "ckv_cache", 256)
