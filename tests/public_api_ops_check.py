"""Run by tests/test_public_api.py in a process of its own: the ops' ``spec=`` on the stub driver.

Each op given the same spec as an object, as its text and as a dict launches the same kernel (one
with the pinned, non-default tuning fields); another family's spec or a value of the wrong type is
refused with a SpecError naming what was given. Exits non-zero on the first failure; prints "ok".
"""

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

# Non-default tuning fields on the stub's sm_90a device, so a spec that was dropped would show.
PREFILL = dict(cta_tile_q=64, cta_tile_kv=32, num_warps=4, num_stages=2, mma="mma_sync")
DECODE = dict(cta_tile_kv=64, num_warps=4, num_stages=2)


def forms(cls, family: str, fields: dict) -> list:
    return [cls(**fields), f"{family}:" + ",".join(f"{k}={v}" for k, v in fields.items()),
            {"family": family, **fields}]


refused = functools.partial(fake_cuda.refused, error="SpecError")


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-api-")

    import torch

    import attngen
    from attngen.runtime import recorded_launches
    from attngen.families.prefill import op

    def launched(call) -> list:
        with recorded_launches(lambda one: (one.kernel.spec, one.entry)) as seen:
            call()
        assert seen, "nothing launched"
        return seen

    q, k, v = rand(1, 100, 4, 64), rand(1, 130, 2, 64), rand(1, 130, 2, 64)
    prefill_forms = forms(attngen.PrefillSpec, "prefill", PREFILL)
    kernels = {op.kernel_for(q, k, v, spec=s).spec for s in prefill_forms}
    assert len(kernels) == 1, kernels
    (ks,) = kernels
    kern = op.kernel_for(q, k, v, spec=prefill_forms[0])
    shown = repr(kern)
    assert len(shown) < 500 and f"cubin={len(kern.binary.cubin)} bytes" in shown and "\\x" not in shown, shown
    assert all(getattr(ks, f) == getattr(attngen.PrefillSpec(**PREFILL), f) for f in PREFILL), ks
    runs = [launched(lambda: attngen.prefill(q, k, v, spec=s)) for s in prefill_forms]
    assert runs[0][0][0] == ks and runs[0] == runs[1] == runs[2], runs

    # varlen: two sequences packed
    qv, kv_, vv = rand(100, 4, 64), rand(130, 2, 64), rand(130, 2, 64)
    cq = i32([0, 40, 100])
    ck = i32([0, 60, 130])
    runs = [launched(lambda: attngen.prefill_varlen(qv, kv_, vv, cq, ck, 60, 70, spec=s)) for s in prefill_forms]
    assert runs[0] == runs[1] == runs[2] and runs[0][0][0].cta_tile_kv == 32, runs

    mask = wrap(torch.rand(100, 130) > 0.5)
    plans = [attngen.mask_plan(mask, q, k, spec=s) for s in prefill_forms]
    assert len({p.tiles for p in plans}) == 1 and plans[0].tiles == (64, 32), [p.tiles for p in plans]
    assert repr(plans[0]).startswith("MaskPlan(tiles=64x32, seqlen_q=100, seqlen_k=130"), repr(plans[0])

    dq = rand(1, 1, 32, 128)
    kc, vc = rand(1, 4096, 8, 128), rand(1, 4096, 8, 128)
    runs = [launched(lambda: attngen.decode(dq, kc, vc, cache_seqlens=3000, num_splits=1, spec=s))
            for s in forms(attngen.DecodeSpec, "decode", DECODE)]
    assert runs[0] == runs[1] == runs[2], runs
    assert (runs[0][0][0].cta_tile_kv, runs[0][0][0].num_stages) == (64, 2), runs[0]

    # another family's spec, in each form, and values that are no spec at all
    for s in ("decode:head_dim=64", {"family": "decode"}, attngen.DecodeSpec()):
        refused(lambda: attngen.prefill(q, k, v, spec=s), "attngen.prefill takes a prefill spec", "is a decode spec")
        refused(lambda: attngen.prefill_varlen(qv, kv_, vv, cq, ck, 60, 70, spec=s),
                "attngen.prefill_varlen takes a prefill spec")
        refused(lambda: attngen.mask_plan(mask, q, k, spec=s), "attngen.mask_plan takes a prefill spec")
    for s in ("prefill:head_dim=64", {"family": "prefill"}, attngen.MlaDecodeSpec()):
        refused(lambda: attngen.decode(dq, kc, vc, cache_seqlens=3000, spec=s), "attngen.decode takes a decode spec")
    for bad in (5, ["prefill"], 2.5):
        refused(lambda: attngen.prefill(q, k, v, spec=bad), f"got type {type(bad).__name__}")
        refused(lambda: attngen.decode(dq, kc, vc, cache_seqlens=3000, spec=bad), f"got type {type(bad).__name__}")
    print("ok")


if __name__ == "__main__":
    main()
