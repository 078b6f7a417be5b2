"""attngen bench cascade: its requests and block tables (no GPU), and its refusals."""

import pytest

from attngen import bench
from attngen.bench import cascade
from conftest import gpu_count


def test_own_lengths_are_seeded_and_in_range():
    a = cascade.own_lengths(64, "256,2048", 1, seed=3)
    assert a == cascade.own_lengths(64, "256,2048", 1, seed=3)
    assert a != cascade.own_lengths(64, "256,2048", 1, seed=4)
    assert len(a) == 64 and all(256 <= n <= 2048 for n in a) and len(set(a)) > 32
    assert cascade.own_lengths(8, "1,1", 5, seed=0) == [5] * 8  # at least the new tokens
    for bad in ("0,10", "20,10", "7"):
        with pytest.raises(ValueError):
            cascade.own_lengths(4, bad, 1, seed=0)


def test_block_tables_cover_the_pool_once_and_share_the_prefix():
    lens = [1, 16, 17, 300, 2048]
    own, shared, pool = cascade.block_tables(lens, prefix_blocks=4, seed=0)
    counts = [-(-n // cascade.PAGE) for n in lens]
    assert [len(r) for r in own] == counts and pool == sum(counts)
    assert sorted(b for r in own for b in r) == list(range(pool))  # every own block once, at random places
    assert [b for r in own for b in r] != list(range(pool))
    for o, s in zip(own, shared):
        assert s[:4] == [0, 1, 2, 3] and s[4:] == [4 + b for b in o]


def test_parser_defaults_and_refusals(capsys):
    args = bench.build_parser().parse_args(["cascade"])
    assert args.requests == (64,) and args.prefix == (4096, 16384) and args.own == "256,2048" and args.q_len == 1
    if gpu_count() == 0:
        assert bench.main(["cascade"]) == 2
        assert "GPU" in capsys.readouterr().out
    else:
        assert bench.main(["cascade", "--q-len", "9"]) == 2
        assert "--q-len 9" in capsys.readouterr().out
