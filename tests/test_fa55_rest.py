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
from tests import fake_cuda


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


@pytest.mark.parametrize("d,want", [(59, 64), (111, 112), (33, 40), (1, 32), (24, 32), (16, 32), (255, 256),
                                    (64, 0), (40, 0), (256, 0), (259, 0), (300, 0), (512, 0), (0, 0)])
def test_padded_width_is_the_next_built_head_dim_up_to_256(d, want):
    from attngen import DecodeSpec, PrefillSpec
    from attngen.families.head_pad import padded_width

    for allowed in (PrefillSpec.WHOLE_DIMS, DecodeSpec.HEAD_DIMS):
        assert padded_width(d, allowed) == want
        assert not want or want in allowed


def test_pad_widths_pads_q_and_k_together_and_v_alone():
    from attngen import PrefillSpec
    from attngen.families.head_pad import pad_widths

    torch = pytest.importorskip("torch")
    t = {d: torch.empty(1, 2, 1, d) for d in (57, 59, 64, 96)}
    assert pad_widths(t[64], t[64], t[96], PrefillSpec.WHOLE_DIMS) is None
    assert pad_widths(t[59], t[59], t[59], PrefillSpec.WHOLE_DIMS) == (64, 64)
    assert pad_widths(t[64], t[64], t[57], PrefillSpec.WHOLE_DIMS) == (64, 64)
    assert pad_widths(t[59], t[64], t[64], PrefillSpec.WHOLE_DIMS) is None, "a mismatch is the op's to name"
    assert pad_widths(None, t[59], t[59], PrefillSpec.WHOLE_DIMS) is None, "no array: the op's checks name it"


def test_zero_padded_copies_and_cut_returns_the_real_columns():
    from attngen.families.head_pad import cut, zero_padded

    torch = pytest.importorskip("torch")
    x = torch.randn(2, 3, 4, 59).to(torch.bfloat16)[:, 1:]  # a strided view
    z = zero_padded(x, 64)
    assert z.shape == (2, 2, 4, 64) and z.dtype == x.dtype and z.is_contiguous()
    assert torch.equal(z[..., :59], x) and not z[..., 59:].any()
    assert zero_padded(z, 64) is z
    lse = torch.zeros(2, 4, 2)
    o, l2 = cut((z, lse), 59, None, True)
    assert l2 is lse and o.shape == (2, 2, 4, 59) and o.data_ptr() == z.data_ptr(), "a view, as FlashAttention's"
    assert cut(z, 59, None, False).shape == (2, 2, 4, 59)


@pytest.mark.skipif(not fake_cuda.available(), reason="needs gcc for the stub driver")
def test_padded_head_dims_block_sizes_and_routes_on_the_stub_driver(tmp_path):
    """tests/host_path_fa55.py: what reaches the kernels (padded copies, scales, block sizes past 256, the routes
    of many non-causal new tokens) on the stub driver."""
    pytest.importorskip("torch")
    fake_cuda.run_check("host_path_fa55.py", tmp_path, timeout=900)
