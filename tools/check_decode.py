"""Quick decode correctness sweep on the GPU (developer tool): prints the max error per config.

    PYTHONPATH=. python3 tools/check_decode.py
"""
import itertools
import sys

import torch

import attngen
from tests.gpu_reference import reference_decode


def case(d, group, q_len, variant, splits, paged, dtype=torch.bfloat16, b=3, hk=2, lens=(1, 65, 1000), bs=64):
    h = hk * group
    cap = 1024
    q = torch.randn(b, q_len, h, d, device="cuda", dtype=dtype)
    if paged:
        nblk = b * cap // bs + 3
        k = torch.randn(nblk, bs, hk, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        table = torch.randperm(nblk, device="cuda")[: b * cap // bs].reshape(b, cap // bs).int()
        kw = dict(block_table=table)
    else:
        k = torch.randn(b + 1, cap, hk, d, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        idx = torch.tensor([(i + 1) % (b + 1) for i in range(b)], device="cuda", dtype=torch.int32)
        kw = dict(cache_batch_idx=idx)
    seq = torch.tensor(lens[:b], device="cuda", dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    o, lse = attngen.decode(q, k, v, cache_seqlens=seq, num_splits=splits, variant=variant, return_lse=True,
                            out=out, **kw)
    ro, rl = reference_decode(q, k, v, seq, **kw)
    err = (o.float() - ro).abs().max().item()
    fin = torch.isfinite(rl)
    lerr = (lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    lbad = bool((torch.isfinite(lse) != fin).any())
    return err, lerr, lbad


def main():
    bad = 0
    n = 0
    for d, group, q_len, variant, splits, paged in itertools.product(
            (64, 128, 256), (1, 4, 16), (1, 4, 8), ("fused", "unfused"), (1, 3, 0), (False, True)):
        if group * q_len > 128:
            continue
        try:
            err, lerr, lbad = case(d, group, q_len, variant, splits, paged)
            ok = err < 2e-2 and lerr < 1e-2 and not lbad
        except Exception as e:  # report and go on
            err, lerr, lbad, ok = float("nan"), float("nan"), True, False
            print(f"EXC d={d} g={group} ql={q_len} {variant} s={splits} paged={paged}: {e}", flush=True)
        n += 1
        bad += not ok
        if not ok:
            print(f"BAD d={d} g={group} ql={q_len} {variant} s={splits} paged={paged} err={err:.3g} lse={lerr:.3g} "
                  f"inf_mismatch={lbad}", flush=True)
    print(f"decode check: {n - bad}/{n} ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
