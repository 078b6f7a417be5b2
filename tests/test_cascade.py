"""cascade_decode's refusals (before anything reaches a GPU) and its split count."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.cascade import MIN_SPLIT_KEYS, prefix_splits  # noqa: E402


def _args(b=2, sq=1, h=8, hk=2, d=64, n=100):
    q = torch.zeros(b, sq, h, d, dtype=torch.bfloat16)
    pk = torch.zeros(n, hk, d, dtype=torch.bfloat16)
    kc = torch.zeros(b, 32, hk, d, dtype=torch.bfloat16)
    return q, pk, pk.clone(), kc, kc.clone()


@pytest.mark.parametrize("change,match", [
    (dict(sq=9), "q_len=9"),
    (dict(sq=0), "q_len=0"),
])
def test_q_len_outside_decode_is_refused_by_name(change, match):
    with pytest.raises(attngen.LaunchError, match=match):
        attngen.cascade_decode(*_args(**change), cache_seqlens=1)


def test_bad_prefix_shapes_and_splits_are_refused_by_name():
    q, pk, pv, kc, vc = _args()
    with pytest.raises(attngen.LaunchError, match="prefix_k has shape"):
        attngen.cascade_decode(q, pk[..., :32], pv, kc, vc, cache_seqlens=1)
    with pytest.raises(attngen.LaunchError, match="prefix_v has shape"):
        attngen.cascade_decode(q, pk, pv[:, :, :1], kc, vc, cache_seqlens=1)
    with pytest.raises(attngen.LaunchError, match="kv_heads dividing heads=8"):
        attngen.cascade_decode(q, torch.zeros(100, 3, 64, dtype=torch.bfloat16), pv, kc, vc, cache_seqlens=1)
    with pytest.raises(attngen.LaunchError, match="prefix_k has 1 kv_heads and k_cache 2"):
        attngen.cascade_decode(q, pk[:, :1], pv[:, :1], kc, vc, cache_seqlens=1)
    with pytest.raises(attngen.LaunchError, match="must have one shape"):
        attngen.cascade_decode(q, pk, pv[:50], kc, vc, cache_seqlens=1)
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(attngen.LaunchError, match="splits="):
            attngen.cascade_decode(q, pk, pv, kc, vc, cache_seqlens=1, splits=bad)


def test_arrays_other_than_torch_tensors_are_sent_to_the_ops_it_composes():
    numpy = pytest.importorskip("numpy")
    q, pk, pv, kc, vc = _args()
    with pytest.raises(attngen.LaunchError, match="needs torch tensors.*attngen.merge_state"):
        attngen.cascade_decode(numpy.zeros((2, 1, 8, 64)), pk, pv, kc, vc, cache_seqlens=1)


@pytest.mark.parametrize("n,rows,heads,sms,want", [
    (16384, 64, 32, 132, 8),      # 32 tiles: 264 CTAs wanted (9 splits), 8 divides the prefix
    (16400, 64, 32, 132, 10),     # 9 does not either: 8 and 10 are as near, the larger taken
    (16411, 64, 32, 132, 9),      # a prime: no count from 4 to 18 divides it, keys left over
    (16384, 512, 32, 132, 2),     # 8 tiles a head already: 256 CTAs at two splits
    (1000, 64, 32, 132, 1),       # under two MIN_SPLIT_KEYS ranges
    (0, 64, 32, 132, 1),
    (1 << 20, 8, 1, 132, 256),    # 264 wanted, 256 divides
    (1536, 64, 32, 132, 3),       # 9 wanted, at most 3 ranges of 512 keys
])
def test_prefix_splits_fill_the_gpu_with_ranges_of_min_split_keys_or_more(n, rows, heads, sms, want):
    s = prefix_splits(n, rows, heads, sms)
    assert s == want
    assert s == 1 or n // s >= MIN_SPLIT_KEYS
