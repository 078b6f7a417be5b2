"""Run by tests/test_prefill_sinks.py in a process of its own: attention sinks through every prefill entry point on
the stub driver.

Each entry point that takes ``sinks`` (attngen.prefill dense, with a custom mask, at a padded head dim and at a
chunked one; prefill_varlen contiguous and paged; FlashAttention's names and their packed forms) is called with a
sinks tensor of its own: the kernel launched must be a sinks kernel (spec sinks=true) and its parameters must end
with that tensor's pointer (after batch_count, at offset 312 of PrefillParams, behind the tensor maps of a TMA
kernel, which the stub's sm_90 device runs where the choice takes one). A call without sinks must launch a kernel
without them. The checks of the tensor and of a caller's spec name ``sinks``. Exits non-zero on the first
failure; prints "ok" at the end.
"""

import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import fake_cuda  # noqa: E402

SINKS_AT = 312  # PrefillParams' sinks (templates/prefill/params.cuh)


def sinks_at(spec) -> int:
    """Where ``spec``'s kernel finds the sinks' pointer: PrefillParams' field, behind three or four tensor maps."""
    return SINKS_AT + (128 * (4 if spec.v_tail else 3) if spec.tma else 0)


def main():
    wrap, rand, i32 = fake_cuda.stub_session("attngen-sinks-", propagate=True)

    import torch

    import attngen
    from attngen import runtime

    launched = []  # (entry, spec) of each launch, in order
    launch_struct = runtime.Kernel.launch_struct

    def recording(self, layout, grid, stream, *values, entry="", **kw):
        launched.append((entry, self.spec))
        return launch_struct(self, layout, grid, stream, *values, entry=entry, **kw)

    runtime.Kernel.launch_struct = recording

    b, h, hk, d = 2, 4, 2, 64
    sq, sk = 37, 90
    q, k, v = rand(b, sq, h, d), rand(b, sk, hk, d), rand(b, sk, hk, d)
    qkv, kv = rand(b, sq, 3, h, d), rand(b, sk, 2, hk, d)
    q60, k60, v60 = rand(b, sq, h, 60), rand(b, sk, hk, 60), rand(b, sk, hk, 60)
    q512, k512, v512 = rand(1, 20, h, 512), rand(1, 30, hk, 512), rand(1, 30, hk, 512)
    mask = wrap(torch.rand(sq, sk) > 0.3)
    cu_q, cu_k = i32([0, 30, 37]), i32([0, 50, 90])
    vq, vk, vv = rand(37, h, d), rand(90, hk, d), rand(90, hk, d)
    vqkv, vkv, cu_same = rand(37, 3, h, d), rand(90, 2, hk, d), i32([0, 20, 37])
    pk, pv = rand(6, 16, hk, d), rand(6, 16, hk, d)
    table = i32([[0, 2, 4], [1, 3, 5]])

    calls = [
        ("attngen.prefill", lambda s: attngen.prefill(q, k, v, causal=True, sinks=s)),
        ("attngen.prefill return_lse", lambda s: attngen.prefill(q, k, v, return_lse=True, sinks=s)),
        ("attngen.prefill mask", lambda s: attngen.prefill(q, k, v, mask=mask, sinks=s)),
        ("attngen.prefill head_dim 60 (padded)", lambda s: attngen.prefill(q60, k60, v60, sinks=s)),
        ("attngen.prefill head_dim 512 (chunked)", lambda s: attngen.prefill(q512, k512, v512, sinks=s)),
        ("attngen.prefill_varlen", lambda s: attngen.prefill_varlen(vq, vk, vv, cu_q, cu_k, 30, 50, sinks=s)),
        ("attngen.prefill_varlen paged", lambda s: attngen.prefill_varlen(vq, pk, pv, cu_q, cu_k, 30, 50,
                                                                          block_table=table, sinks=s)),
        ("flash_attn_func", lambda s: attngen.flash_attn_func(q, k, v, sinks=s)),
        ("flash_attn_qkvpacked_func", lambda s: attngen.flash_attn_qkvpacked_func(qkv, sinks=s)),
        ("flash_attn_kvpacked_func", lambda s: attngen.flash_attn_kvpacked_func(q, kv, sinks=s)),
        ("flash_attn_varlen_func", lambda s: attngen.flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, 30, 50, sinks=s)),
        ("flash_attn_varlen_func paged", lambda s: attngen.flash_attn_varlen_func(vq, pk, pv, cu_q, cu_k, 30, 50,
                                                                                  block_table=table, sinks=s)),
        ("flash_attn_varlen_qkvpacked_func",
         lambda s: attngen.flash_attn_varlen_qkvpacked_func(vqkv, cu_same, 20, sinks=s)),
        ("flash_attn_varlen_kvpacked_func",
         lambda s: attngen.flash_attn_varlen_kvpacked_func(vq, vkv, cu_q, cu_k, 30, 50, sinks=s)),
    ]
    keep = []  # every sinks tensor stays alive: each call's pointer is one no earlier call packed
    for name, call in calls:
        sinks = wrap(torch.randn(h))
        keep.append(sinks)
        for given in (sinks, None):
            del launched[:]
            try:
                call(given)
            except Exception as e:
                raise AssertionError(f"{name} with sinks={'a tensor' if given is not None else None}: "
                                     f"{type(e).__name__}: {e}") from e
            mains = [spec for entry, spec in launched if entry == ""]
            assert len(mains) == 1, (name, launched)
            assert mains[0].sinks is (given is not None), (name, mains[0])
            if given is not None:
                at = sinks_at(mains[0])
                got = fake_cuda.last_params(at + 8)[at:]
                assert got == struct.pack("<Q", sinks.data_ptr()), f"{name}: the sinks' pointer is not packed last"
    # The checks name sinks, in every entry point.
    wrong = (
        (wrap(torch.randn(h).double()), "sinks must be an fp32 torch array"),
        (wrap(torch.randn(h + 1)), f"got fp32 torch of shape ({h + 1},)"),
        (wrap(torch.randn(h, 2))[:, 0], "contiguous"),
        (torch.randn(h), "sinks is on cpu"),
    )
    for name, call in calls:
        for bad, text in wrong:
            try:
                call(bad)
            except attngen.LaunchError as e:
                assert text in str(e) and "sinks" in str(e), (name, text, str(e))
            else:
                raise AssertionError(f"{name} accepted sinks {bad}")
    # A caller's spec must say sinks=true exactly when sinks are given.
    sinks = wrap(torch.randn(h))
    for call, text in (
            (lambda: attngen.prefill(q, k, v, spec="prefill:head_dim=64,sinks=true"), "spec has sinks=true"),
            (lambda: attngen.prefill(q, k, v, spec="prefill:head_dim=64", sinks=sinks), "spec has sinks=false"),
            (lambda: attngen.prefill(q, k, v, mask=mask, spec="prefill:head_dim=64", sinks=sinks),
             "spec has sinks=false"),
            (lambda: attngen.prefill_varlen(vq, vk, vv, cu_q, cu_k, 30, 50, spec="prefill:head_dim=64,sinks=true"),
             "spec has sinks=true"),
            (lambda: attngen.prefill_varlen(vq, vk, vv, cu_q, cu_k, 30, 50, spec=attngen.PrefillSpec(head_dim=64),
                                            sinks=sinks), "spec has sinks=false")):
        try:
            call()
        except attngen.LaunchError as e:
            assert text in str(e), (text, str(e))
        else:
            raise AssertionError(f"a spec that disagrees with the sinks argument was taken ({text})")
    del launched[:]
    attngen.prefill(q, k, v, spec="prefill:head_dim=64,sinks=true,cta_tile_q=64", sinks=sinks)
    assert launched[-1][1].sinks and launched[-1][1].cta_tile_q == 64, launched
    print("ok")


if __name__ == "__main__":
    main()
