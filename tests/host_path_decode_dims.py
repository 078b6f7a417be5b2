"""Run by tests/test_decode_head_dims.py in a process of its own: attngen.decode's head dims and GQA groups on
the stub driver (sm_90). Head dims decode does not build and does not pad (0, past 256) and groups past its
packed rows are refused naming what to change, before any compile; a padded head dim with 64 query heads over
one KV head launches the kernel the family's choice names, with its grid; head_dim 512 launches two CTAs a KV
head. Exits non-zero on the first failure; prints "ok" at the end.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-dims-")

    import torch

    import attngen
    from attngen.families.choice import device_facts
    from attngen.families.decode import choose

    lens = i32([40, 90])
    for (b, q_len, h, hk, d), text in 2 * [
        ((2, 1, 8, 2, 0), "head_dim=0 is not supported; allowed: a multiple of 8 from 32 to 256, or 512 (rows"),
        ((2, 1, 8, 2, 300), "head_dim=300 is not supported"),
        ((2, 1, 8, 2, 264), "head_dim=264 is not supported; allowed: a multiple of 8 from 32 to 256, or 512 (past"),
        ((2, 1, 8, 2, 520), "head_dim=520 is not supported"),
        ((2, 1, 129, 1, 64), "heads/kv_heads = 129 is not supported; allowed: a GQA group of 1 to 128"),
        ((2, 3, 64, 1, 64), "heads/kv_heads x q_len = 64 x 3 = 192 packed query rows"),
    ]:
        q, kc, vc = rand(b, q_len, h, d), rand(b, 128, hk, d), rand(b, 128, hk, d)
        try:
            attngen.decode(q, kc, vc, cache_seqlens=lens)
        except attngen.LaunchError as e:
            assert text in str(e), (text, str(e))
            assert "allowed:" in str(e), str(e)
        else:
            raise AssertionError(f"no error for {text}")

    # 64 query heads over one KV head at head_dim 80: 64 packed rows, the grid the choice names.
    q, kc, vc = rand(2, 1, 64, 80), rand(2, 2048, 1, 80), rand(2, 2048, 1, 80)
    n0 = fake_cuda.counts()["launches"]
    attngen.decode(q, kc, vc, cache_seqlens=i32([1000, 2000]), num_splits=1)
    assert fake_cuda.counts()["launches"] == n0 + 1, "one launch"
    c = choose.choose(choose.Problem(80, "bf16", 1, 64, 1, 2, 2048, num_splits=1), device_facts(0))
    assert c.spec.q_rows == 64 and c.spec.head_dim == 80, c.spec
    got = fake_cuda.last_launch()
    assert got["grid"] == c.launch.grid == (1, 1, 2) and got["threads"] == c.spec.threads, (got, c)
    assert got["smem"] == c.spec.smem_bytes(), (got, c.spec.smem_bytes())

    # head_dim 512: two CTAs a KV head (the grid's y), merged through the workspace and the merge launch.
    q, kc, vc = rand(2, 1, 8, 512), rand(2, 1024, 2, 512), rand(2, 1024, 2, 512)
    n0 = fake_cuda.counts()["launches"]
    attngen.decode(q, kc, vc, cache_seqlens=i32([1000, 700]), num_splits=3)
    assert fake_cuda.counts()["launches"] == n0 + 2, "a split launch and a merge launch"
    c = choose.choose(choose.Problem(512, "bf16", 1, 8, 2, 2, 1024, num_splits=3), device_facts(0))
    assert c.launch.grid == (3, 4, 2) and c.launch.cluster == 0 and c.launch.merge_grid is not None, c.launch
    assert fake_cuda.last_launch()["grid"] == c.launch.merge_grid, fake_cuda.last_launch()
    print("ok")


if __name__ == "__main__":
    main()
