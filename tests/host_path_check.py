"""Run by tests/test_host_path.py in a process of its own: attngen.prefill's host path on the stub driver.

Checks what reaches cuLaunchKernel (grid, block, shared memory, stream, the parameter bytes)
against values computed here from the tensors, the context push where the primary context is
not current, launches from a second thread, error messages, and the choice of a tuned spec.
Exits non-zero (an AssertionError) on the first failure; prints "ok" at the end.
"""

import os
import struct
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

P = struct.Struct("<5Q12q4i2f2i")
TUNED = dict(cta_tile_q=64, cta_tile_kv=32, num_warps=4, num_stages=2, mma="mma_sync")


def main():
    root = tempfile.mkdtemp(prefix="attngen-host-")
    os.environ["ATTNGEN_CACHE_DIR"] = root
    os.environ.pop("ATTNGEN_NO_TUNED", None)
    fake_cuda.prebuild(extra=[("PrefillSpec", dict(head_dim=64, dtype="bf16", **TUNED)),
                              ("DecodeSpec", dict(head_dim=128, dtype="bf16", q_rows=16)),
                              ("DecodeSpec", dict(head_dim=128, dtype="bf16", q_rows=16, local=True))])
    fake_cuda.install()
    wrap = fake_cuda.patch_torch_cuda()

    import torch

    import attngen
    from attngen import PrefillSpec, builder, cache
    from attngen.compiler import nvrtc_version
    from attngen.families.prefill import op

    def rand(*shape, dtype=torch.bfloat16):
        return wrap(torch.randn(*shape).to(dtype))

    def expect_launch(q, k, v, out, lse=None, causal=False, window=(-1, -1), scale=None):
        b, sq, h, d = q.shape
        sk, hk = k.shape[1], k.shape[2]
        kern = op.kernel_for(q, k, v, causal=causal, window=window, return_lse=lse is not None)
        left, right = window
        if causal:
            right = 0
        s = d ** -0.5 if scale is None else scale
        want = P.pack(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 0 if lse is None else lse.data_ptr(),
                      *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
                      sq, sk, h, h // hk, s, s * 1.4426950408889634, left, right)
        spec = kern.spec
        if spec.tma:  # the TMA kernel's three maps first (the stub's: address, head dim, length, dtype code)
            code = {torch.bfloat16: 9, torch.float16: 6}[q.dtype]
            want = b"".join(struct.pack("<4Q", t.data_ptr(), t.shape[3], max(t.shape[1], 1), code) + bytes(96)
                            for t in (q, k, v)) + want
        assert fake_cuda.last_params(len(want)) == want, "parameter bytes differ"
        got = fake_cuda.last_launch()
        tq = spec.cta_tile_q
        tiles = (sq + tq - 1) // tq
        if spec.tma and spec.is_persistent:  # units of two query tiles of a head over the CTAs the SMs hold
            from attngen.families.split_kv import ctas_per_sm

            assert got["grid"] == (min((tiles + 1) // 2 * h * b, 132 * ctas_per_sm(kern)), 1, 1), got
            tail = fake_cuda.last_params(len(want) + 24 + 116 + 4)[len(want) + 24:]
            assert tail == bytes(116) + struct.pack("<i", b), "zero padding, then batch_count"
        else:
            assert got["grid"] == (tiles, h, b), got
        assert got["threads"] == kern.threads and got["smem"] == kern.smem_bytes, got
        return kern

    # Plain call, allocated output.
    q, k, v = rand(2, 100, 8, 64), rand(2, 130, 2, 64), rand(2, 130, 2, 64)
    n0 = fake_cuda.counts()["launches"]
    out = attngen.prefill(q, k, v)
    assert fake_cuda.counts()["launches"] == n0 + 1
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    expect_launch(q, k, v, out)
    # A call's launch is worked out once per key (the infos and the other arguments): repeats carry
    # their own output, and every argument that differs reaches the kernel.
    for causal, scale in ((False, None), (True, None), (True, 0.5), (False, None), (True, 0.5)):
        o = attngen.prefill(q, k, v, causal=causal, sm_scale=scale)
        assert o.data_ptr() != out.data_ptr()
        expect_launch(q, k, v, o, causal=causal, scale=scale)
    # LSE, causal, window, sm_scale, a strided q from a packed qkv tensor, out=.
    qkv = rand(1, 77, 3, 4, 64, dtype=torch.float16)
    q2, k2, v2 = (wrap(qkv[:, :, i]) for i in range(3))  # slices of the stand-in come back plain
    assert not q2.is_contiguous()
    out2 = wrap(torch.empty(1, 77, 4, 64, dtype=torch.float16))
    o, lse = attngen.prefill(q2, k2, v2, causal=True, window=(16, -1), return_lse=True, out=out2, sm_scale=0.25)
    assert o is out2 and lse.shape == (1, 4, 77) and lse.dtype == torch.float32
    expect_launch(q2, k2, v2, out2, lse=lse, causal=True, window=(16, -1), scale=0.25)
    # The primary context not current: pushed for the launch, popped after.
    c = fake_cuda.counts()
    fake_cuda.make_current(None)
    attngen.prefill(q, k, v, out=out)
    c2 = fake_cuda.counts()
    assert c2["launches"] == c["launches"] + 1 and c2["pushes"] == c["pushes"] + 1 and c2["pops"] == c["pops"] + 1
    fake_cuda.make_current(0x1000)
    attngen.prefill(q, k, v, out=out)
    assert fake_cuda.counts()["pushes"] == c2["pushes"], "pushed although the primary context was current"
    # Another thread has its own parameter buffer.
    errors = []

    def worker():
        try:
            for _ in range(50):
                attngen.prefill(q, k, v, out=out)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expect_launch(q, k, v, out)
    # Errors keep their wording; shapes print as tuples. (Twice: operands that passed the checks are
    # remembered, and no failing triple among them may slip through the second time.)
    odd = wrap(torch.randn(2 * 100 * 8 * 64 + 1).to(torch.bfloat16)[1:].view(2, 100, 8, 64))
    for args, kw, text in 2 * [
        ((wrap(q[0]), k, v), {}, "q has shape (100, 8, 64); expected [batch, seqlen, heads, head_dim]"),
        ((q, rand(2, 130, 3, 64), rand(2, 130, 3, 64)), {}, "heads=8 must be a multiple of kv_heads=3"),
        ((q, k, rand(2, 131, 2, 64)), {}, "k (2, 130, 2, 64) and v (2, 131, 2, 64) must have the same shape"),
        ((q, k, v), {"out": wrap(torch.empty(2, 100, 8, 64))}, "out must match q with v's head dim: torch (2, 100, 8, 64) bf16"),
        ((q, k, v), {"window": (1,)}, "window=(1,) must be a pair"),
        ((q, k, v), {"mask_plan": object()}, "mask_plan needs the mask it was built from (mask=)"),
        ((q, k, v), {"sm_scale": float("inf")}, "sm_scale=inf must be finite and > 0"),
        ((q, k, v), {"sm_scale": -0.5}, "sm_scale=-0.5 must be finite and > 0"),
        ((q.float(), k, v), {}, "q is on cpu"),
        ((odd, k, v), {}, "q must be 16-byte aligned"),
        ((q, k, rand(2, 130, 2, 300)), {}, "v's head dim=300 is not supported"),
    ]:
        try:
            attngen.prefill(*args, **kw)
        except attngen.LaunchError as e:
            assert text in str(e), (text, str(e))
        else:
            raise AssertionError(f"no error for {text}")
    # Head dims outside the rule past 256 (below it the ops pad: tests/host_path_fa55.py) are named before the
    # strides they make misaligned, through FlashAttention's names too; a multiple of 8 up to 256 launches.
    for d in (259, 264, 300):
        x = rand(1, 16, 4, d)
        try:
            attngen.flash_attn_func(x, x, x)
        except attngen.LaunchError as e:
            assert f"head_dim={d} is not supported; allowed: a multiple of 8 from 32 to 256" in str(e), str(e)
        else:
            raise AssertionError(f"flash_attn_func took head_dim={d}")
    x = rand(1, 16, 4, 40)
    n0 = fake_cuda.counts()["launches"]
    attngen.flash_attn_func(x, x, x)
    assert fake_cuda.counts()["launches"] == n0 + 1
    # A tuned winner for this GPU is used; ATTNGEN_NO_TUNED=1 and an explicit spec are not.
    default = op.kernel_for(q, k, v).spec
    assert default == attngen.resolve(PrefillSpec(head_dim=64, dtype="bf16"), "sm_90a")
    gpu = attngen.runtime.driver().device_name(0)
    fields = {"head_dim": 64, "dtype": "bf16", "mask": "none", "return_lse": False, "softcap": False, "alibi": False,
              "custom_mask": False, "varlen": False, "paged": False}
    from attngen.tuned import TunedStore

    TunedStore().put({"family": "prefill", "fields": fields, "arch": "sm_90a", "gpu": gpu, "nvrtc": nvrtc_version(),
                      "attngen": attngen.__version__, "seqlen": 512, "tuning": TUNED})
    attngen.runtime.clear_loaded()
    builder.clear_memory()
    tuned = op.kernel_for(q, k, v).spec
    assert tuned == PrefillSpec(head_dim=64, dtype="bf16", **TUNED), tuned
    attngen.prefill(q, k, v, out=out)
    expect_launch(q, k, v, out)
    assert op.kernel_for(q, k, v, spec=PrefillSpec()).spec == default
    causal = attngen.resolve(PrefillSpec(head_dim=64, dtype="bf16", mask="causal"), "sm_90a")
    # other untuned fields: no entry, the default for the call's rows (100: short causal rows' 64-row tiles)
    from attngen.families.prefill.choose import by_rows

    assert op.kernel_for(q, k, v, causal=True).spec == by_rows(causal, "sm_90a")[1][0]
    os.environ["ATTNGEN_NO_TUNED"] = "1"
    attngen.runtime.clear_loaded()
    assert op.kernel_for(q, k, v).spec == default
    # What the op launches is what the family's choice function returns for the call.
    from attngen import MaskMode
    from attngen.families.choice import device_facts
    from attngen.families.prefill import choose

    for causal in (False, True):
        o = attngen.prefill(q, k, v, causal=causal)
        c = choose.choose(choose.Problem(64, "bf16", MaskMode.CAUSAL if causal else MaskMode.NONE, rows=100, heads=8,
                                         batch=2), device_facts(0))
        assert op.kernel_for(q, k, v, causal=causal).spec == c.spec, (causal, c.spec)
        expect_launch(q, k, v, o, causal=causal)
        assert fake_cuda.last_launch()["grid"] == c.launch.grid, (causal, c.launch)
    assert fake_cuda.last_launch()["pdl"] == 0, "prefill's kernels do not wait for the kernel before them"
    check_decode(torch, wrap)
    print("ok")


def check_decode(torch, wrap):
    """decode on the stub's sm_90 device: the split and merge launches (the split kernel with
    programmatic dependent launch unless it is turned off, the merge without), and the parameter
    bytes they carry."""
    import attngen
    from attngen import runtime
    from attngen.families.decode.spec import MERGE_THREADS

    dparams = struct.Struct("<12Q14q9iI2f2fQqQii")
    dq = wrap(torch.randn(1, 1, 32, 128).to(torch.bfloat16))
    kc, vc = (wrap(torch.randn(1, 4096, 8, 128).to(torch.bfloat16)) for _ in range(2))
    lens = wrap(torch.tensor([3000], dtype=torch.int32))
    from attngen.families.decode import op

    # sm_90: the splits of a row are one cluster, which merges them: one launch, no workspace.
    n0 = fake_cuda.counts()["launches"]
    out = attngen.decode(dq, kc, vc, cache_seqlens=lens, num_splits=4)
    assert fake_cuda.counts()["launches"] == n0 + 1, "one launch"
    got = fake_cuda.last_launch()
    assert got["cluster"] == 4 and got["grid"] == (4, 8, 1) and got["pdl"] == 1, got
    vals = dparams.unpack(fake_cuda.last_params(dparams.size))
    assert vals[3] == out.data_ptr() and vals[8:10] == (0, 0), "no workspace: o_part null asks for the cluster merge"
    attngen.decode(dq, kc, vc, cache_seqlens=lens, num_splits=9)  # past the portable size
    assert fake_cuda.last_launch()["cluster"] == 0
    # An automatic count: a cluster at 4k positions; at 8k the merge launch, whose 16 splits read faster than a
    # cluster's 8 by more than the launch costs on the stub's H200 (choose.grid_steps).
    attngen.decode(dq, kc, vc, cache_seqlens=lens)
    assert fake_cuda.last_launch()["cluster"] in range(2, op.CLUSTER_MAX + 1), "the automatic count fits a cluster"
    from attngen.families.choice import device_facts
    from attngen.families.decode import choose

    c = choose.choose(choose.Problem(128, "bf16", 1, 32, 8, 1, 4096), device_facts(0))
    assert (fake_cuda.last_launch()["grid"], fake_cuda.last_launch()["cluster"]) == (c.launch.grid, c.launch.cluster)
    k8, v8 = (wrap(torch.randn(1, 8192, 8, 128).to(torch.bfloat16)) for _ in range(2))
    n0 = fake_cuda.counts()["launches"]
    attngen.decode(dq, k8, v8, cache_seqlens=8000)
    split_grid = list(op._calls.values())[-1].grid
    assert fake_cuda.counts()["launches"] == n0 + 2 and split_grid[0] > op.CLUSTER_MAX, split_grid
    # A paged cache never clusters (1.5x slower, H100), and its 48-position blocks come with the
    # multiplier of the kernel's division-free block lookup: ceil(2^(31 + 6) / 48).
    kp, vp = (wrap(torch.randn(70, 48, 8, 128).to(torch.bfloat16)) for _ in range(2))
    table = wrap(torch.randperm(70)[:64].to(torch.int32).reshape(1, 64))
    attngen.decode(dq, kp, vp, cache_seqlens=lens, block_table=table, num_splits=4)
    vals = dparams.unpack(fake_cuda.last_params(dparams.size))
    assert fake_cuda.last_launch()["cluster"] == 0 and vals[31:36] == (48, 64 * 48, 70, 0, -(-2 ** 37 // 48)), vals
    # The workspace and the merge launch, as on the other archs.
    op.set_cluster_merge(0)
    n0 = fake_cuda.counts()["launches"]
    out = attngen.decode(dq, kc, vc, cache_seqlens=lens, num_splits=4)
    assert fake_cuda.counts()["launches"] == n0 + 2, "a split launch and a merge launch"
    got = fake_cuda.last_launch()
    assert got["cluster"] == 0, got
    assert got["pdl"] == 0, f"the merge launches without programmatic dependent launch: {got}"
    vals = dparams.unpack(fake_cuda.last_params(dparams.size))
    assert vals[:4] == (dq.data_ptr(), kc.data_ptr(), vc.data_ptr(), out.data_ptr()), vals[:4]
    assert vals[5] == lens.data_ptr() and vals[8] and vals[9], "lengths and the split workspace"
    assert vals[21:24] == (32 * 128, 32 * 128, 128), "out's strides: a fresh contiguous array"
    assert vals[26:31] == (1, 1, 32, 4, 4), "batch, q_len, heads, group, splits"
    assert got["grid"] == (-(-32 // (MERGE_THREADS // 32)), 1, 1), got
    was = runtime.set_pdl(False)
    attngen.decode(dq, kc, vc, cache_seqlens=3000, num_splits=1, out=out)
    got = fake_cuda.last_launch()
    assert got["pdl"] == 0 and got["grid"] == (1, 8, 1), got
    assert dparams.unpack(fake_cuda.last_params(dparams.size))[34] == 3000, "the fixed length"
    runtime.set_pdl(was)
    attngen.decode(dq, kc, vc, cache_seqlens=3000, num_splits=1, out=out)
    assert fake_cuda.last_launch()["pdl"] == 1

    # A call's launch is worked out once per key (the infos and the other arguments): a repeat
    # carries its own allocations, and every argument that differs reaches the kernel.
    def split_params():  # the split launch's parameters: the one before the merge's
        return dparams.unpack(fake_cuda.last_params(dparams.size))

    outs = []
    for i in range(3):
        o, lse = attngen.decode(dq, kc, vc, cache_seqlens=lens, num_splits=4, return_lse=True)
        outs.append((o, lse))
        vals = split_params()
        assert vals[3:5] == (o.data_ptr(), lse.data_ptr()), (i, vals[3:5])
    assert len({o.data_ptr() for o, _ in outs}) == 3, "three outputs"
    for n in (3000, 2000, 3000):
        attngen.decode(dq, kc, vc, cache_seqlens=n, num_splits=1, out=out)
        assert split_params()[34] == n
    attngen.decode(dq, kc, vc, cache_seqlens=3000, num_splits=1, out=out, sm_scale=0.5)
    assert split_params()[36] == 0.5
    other = torch.empty(1, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    attngen.decode(dq, kc, vc, cache_seqlens=3000, num_splits=1, out=other)
    assert split_params()[3] == other.data_ptr()
    # Failing calls are refused every time, also beside a remembered key of the same tensors.
    bad = [dict(num_splits=True), dict(sm_scale=-1.0), dict(variant=["fused"]), dict(cache_seqlens=True),
           dict(out=wrap(torch.empty(1, 1, 32, 64).to(torch.bfloat16))), dict(softcap=-1.0),
           dict(cache_seqlens=wrap(torch.tensor([3000], dtype=torch.int64)))]
    for kw in bad:
        args = dict(cache_seqlens=3000, num_splits=1) | kw
        for _ in range(2):
            try:
                attngen.decode(dq, kc, vc, **args)
            except attngen.LaunchError:
                pass
            else:
                raise AssertionError(f"decode accepted {kw}")
    for n in range(1, 300):
        attngen.decode(dq, kc, vc, cache_seqlens=n, num_splits=1, out=out)
    assert 0 < len(op._calls) <= runtime._MAX_CALLS
    check_window_decode(torch, wrap, dq, kc, vc, lens, out, dparams)
    op.set_cluster_merge(op.CLUSTER_MAX)


def check_window_decode(torch, wrap, dq, kc, vc, lens, out, dparams):
    """A sliding window with left pads takes the `local` kernel, whose parameters end with the pads'
    pointer and the window's sides (a plain call's: null, the unbounded left side, right 0 for causal);
    its automatic split count is chosen for the window's keys, not the cache's."""
    import attngen
    from attngen.families.decode import op

    def launched():
        return [c for c in op._calls.values() if c.grid is not None]

    attngen.decode(dq, kc, vc, cache_seqlens=lens, num_splits=1, out=out)
    assert dparams.unpack(fake_cuda.last_params(dparams.size))[-3:] == (0, 1 << 30, 0)
    assert not any(c.kern.spec.local for c in launched()), "no call so far needed the local kernel"
    pads = wrap(torch.tensor([100], dtype=torch.int32))
    attngen.decode(dq, kc, vc, cache_seqlens=lens, num_splits=2, out=out, window=(255, 0), cache_leftpad=pads)
    vals = dparams.unpack(fake_cuda.last_params(dparams.size))
    assert vals[-3:] == (pads.data_ptr(), 255, 0) and vals[5] == lens.data_ptr(), vals[-3:]
    assert [c.kern.spec.local for c in launched()].count(True) == 1
    n0 = len(launched())
    attngen.decode(dq, kc, vc, cache_seqlens=lens, window=(255, 0))
    (call,) = launched()[n0:]
    assert call.kern.spec.local and 1 <= call.grid[0] <= -(-(255 + 1 + call.kern.spec.cta_tile_kv) //
                                                          call.kern.spec.cta_tile_kv), call.grid
    try:
        attngen.decode(dq, kc, vc, cache_seqlens=lens, window=(-3, 0))
    except attngen.LaunchError as e:
        assert "window=(-3, 0) must be a pair" in str(e), e
    else:
        raise AssertionError("decode accepted window=(-3, 0)")


if __name__ == "__main__":
    main()
