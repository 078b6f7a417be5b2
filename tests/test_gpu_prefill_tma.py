"""The TMA prefill pipeline (``pipeline=tma``: a producer warpgroup, TMA copies into an mbarrier ring) on a
real sm_90 GPU, against an fp64 reference (pytest -m gpu), in each of its schedules (serial, overlap,
pingpong).

Inputs sit inside NaN-filled buffers and outputs are written into NaN-poisoned views of a
sentinel-filled buffer (tests/test_gpu_prefill_serving.py's helpers): a copy past a tensor map's
end that is not zero-filled turns the output NaN, a stray write changes the sentinel. The same
inputs through the cp.async kernel of the same tiles must give the same bits: the math is shared, and
the overlapped schedules only reorder when it runs (O is rescaled, then takes P V, in the same order).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator  # noqa: E402
from tests.test_gpu_prefill_serving import (TOL, check_sentinel, compare, guarded, range_keep,  # noqa: E402
                                            reference, rel_l2, sentinel_out)

BF16, FP16 = torch.bfloat16, torch.float16


def _spec(**fields):
    """The resolved wgmma spec with ``fields`` (pipeline=tma unless given), or a skip where it cannot run."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    arch = attngen.runtime.device_arch(torch.cuda.current_device())
    spec = attngen.PrefillSpec(mma="wgmma", **{"pipeline": "tma", **fields})
    try:
        return attngen.resolve(spec, arch)
    except attngen.SpecError as e:
        pytest.skip(f"{spec.to_text()} does not run on {arch.name}: {e}")


def run(spec, b, sq, sk, h, hk, dtype, causal=False, window=(-1, -1), same_as_cp_async=True, **kw):
    gen = fresh_generator()
    d, dv = spec.head_dim, spec.dim_v
    q = guarded(b, sq, h, d, dtype=dtype, gen=gen)
    k = guarded(b, sk, hk, d, dtype=dtype, gen=gen)
    v = guarded(b, sk, hk, dv, dtype=dtype, gen=gen)
    spec = spec.replace(dtype="bf16" if dtype is BF16 else "fp16")
    out, buf, guards = sentinel_out((b, sq, h, dv), dtype)
    o, lse = attngen.prefill(q, k, v, causal=causal, window=window, return_lse=True, out=out, spec=spec, **kw)
    torch.cuda.synchronize()
    assert o is out
    check_sentinel(buf, guards)
    if not kw:
        ref_o, ref_l = reference(q, k, v, range_keep(sq, sk, causal, window)[None, None], d ** -0.5)
        compare(o, lse, ref_o, ref_l, dtype)
    if same_as_cp_async:
        o2, lse2 = attngen.prefill(q, k, v, causal=causal, window=window, return_lse=True, spec=_sync(spec), **kw)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), "TMA and cp.async kernels of one tile config differ"
    return o, lse


def _sync(spec):
    """The cp.async kernel of ``spec``'s tiles."""
    return spec.replace(pipeline="sync", schedule="serial", persistent=False)


SCHEDULES = ["serial", "overlap", "pingpong"]
SHAPES = [(1, 1), (17, 1000), (1000, 17), (333, 1031), (3001, 3001)]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 192), (256, 256), (192, 128), (256, 128), (128, 64)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tma_matches_reference(dtype, d, dv, causal, sq, sk, schedule):
    run(_spec(head_dim=d, head_dim_v=dv, schedule=schedule), 2, sq, sk, 4, 2, dtype, causal=causal)


def _ramped(b, s, h, d, dtype, gen, unit, heights, noise=0.1):
    """A guarded tensor whose rows are ``heights[row] * unit`` plus noise: scores against it follow the heights."""
    x = guarded(b, s, h, d, dtype=dtype, gen=gen)
    rows = heights[None, :, None, None] * unit + noise * torch.randn(b, s, h, d, generator=gen, device="cuda")
    x.copy_(rows.to(dtype))
    return x


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pattern", ["rise", "fall", "steps"])
@pytest.mark.parametrize("kernel", ["serial", "overlap", "pingpong", "sync"])
def test_lazy_rescale_scores_that_climb(dtype, d, causal, pattern, kernel):
    """A row keeps its running max while a tile raises it by at most 2^8 (exp2 domain), so its P runs above 1: scores
    that climb along the keys (a little every tile, or in jumps past the bound at a few keys), or fall, against
    fp64, with the LSE."""
    fields = {"pipeline": "sync", "schedule": "serial"} if kernel == "sync" else {"schedule": kernel}
    _climbing_case(_spec(head_dim=d, **fields), d, dtype, causal, pattern)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", [(512, 512), (576, 512), (320, 320)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("pattern", ["rise", "fall", "steps"])
@pytest.mark.parametrize("pipeline", ["tma", "sync"])
def test_lazy_rescale_chunked(dtype, d, dv, causal, pattern, pipeline):
    """The same scores through the chunked wgmma kernel (head dims above 256)."""
    _climbing_case(_spec(head_dim=d, head_dim_v=dv, pipeline=pipeline), d, dtype, causal, pattern, dv)


def _climbing_case(spec, d, dtype, causal, pattern, dv=None):
    dv = dv or d
    spec = spec.replace(dtype="bf16" if dtype is BF16 else "fp16")
    b, sq, sk, h, hk = 2, 700, 3001, 4, 2
    gen = fresh_generator()
    unit = torch.randn(d, generator=gen, device="cuda")
    unit /= unit.norm()
    # scores q.k * d^-0.5 of about 60 across a row's keys: 87 in the exp2 domain, 1-3 a key tile
    pos = torch.arange(sk, device="cuda", dtype=torch.float32) / (sk - 1)
    ramp = {"rise": pos, "fall": 1 - pos, "steps": (pos * 5).floor() / 5}[pattern] * 60 * d ** 0.5
    q = _ramped(b, sq, h, d, dtype, gen, unit, torch.ones(sq, device="cuda"))
    k = _ramped(b, sk, hk, d, dtype, gen, unit, ramp)
    v = guarded(b, sk, hk, dv, dtype=dtype, gen=gen)
    out, buf, guards = sentinel_out((b, sq, h, dv), dtype)
    o, lse = attngen.prefill(q, k, v, causal=causal, return_lse=True, out=out, spec=spec)
    torch.cuda.synchronize()
    check_sentinel(buf, guards)
    ref_o, ref_l = reference(q, k, v, range_keep(sq, sk, causal, (-1, -1))[None, None], d ** -0.5)
    compare(o, lse, ref_o, ref_l, dtype)


# (cta_tile_kv, num_warps, num_stages): one and two consumer warpgroups, rings of one to four slots.
TILES = [(64, 4, 1), (128, 4, 2), (64, 8, 2), (128, 8, 3), (32, 8, 4), (128, 8, 2)]


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("kv,warps,stages", TILES)
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tma_tile_configs(d, kv, warps, stages, mask, schedule):
    spec = _spec(head_dim=d, cta_tile_kv=kv, num_warps=warps, num_stages=stages, schedule=schedule)
    window = (100, 7) if mask == "window" else (-1, -1)
    run(spec, 1, 1111, 1537, 4, 1, BF16, causal=mask == "causal", window=window)


# Key tiles that are not a power of two (wgmma's N is any multiple of 8 up to 256): the widths FlashAttention-3
# takes at head dims 64 (192 keys), 128 (176; FlashInfer's fa3 192) and 256 (80), and others between. Where a
# schedule or the persistent kernel does not fit the shared memory, it is skipped.
WIDE = [(64, 160), (64, 176), (64, 192), (128, 96), (128, 144), (128, 160), (128, 176), (128, 192), (256, 80)]


@pytest.mark.parametrize("d,kv", WIDE)
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("schedule,persistent", [(s, False) for s in SCHEDULES] + [("pingpong", True)])
def test_tma_wide_kv_tiles(d, kv, mask, schedule, persistent):
    spec = _spec(head_dim=d, cta_tile_q=128, cta_tile_kv=kv, num_warps=8, num_stages=2, schedule=schedule,
                 persistent=persistent)
    window = (100, 7) if mask == "window" else (-1, -1)
    try:  # the cp.async kernel of the same tiles, where its register estimate lets it (limit 176, TMA's 200)
        attngen.validate(_sync(spec), attngen.runtime.device_arch(torch.cuda.current_device()))
        twin = True
    except attngen.SpecError:
        twin = False
    run(spec, 2, 1111, 1537, 4, 2, BF16, causal=mask == "causal", window=window, same_as_cp_async=twin)
    run(spec, 1, 17, 3001, 2, 1, FP16, causal=mask == "causal", window=window, same_as_cp_async=False)
    if persistent:  # several query tiles a CTA (864 tiles)
        run(spec, 6, 1111, 1537, 16, 4, BF16, causal=mask == "causal", window=window, same_as_cp_async=twin)


# The same widths with one consumer warpgroup (64-row tiles, two CTAs an SM where they fit), as `attngen tune` tries them.
@pytest.mark.parametrize("d,kv", [(64, 192), (128, 96), (128, 160), (256, 80)])
@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("schedule,persistent", [("serial", False), ("overlap", False), ("serial", True)])
def test_tma_wide_kv_tiles_one_warpgroup(d, kv, mask, schedule, persistent):
    spec = _spec(head_dim=d, cta_tile_q=64, cta_tile_kv=kv, num_warps=4, num_stages=2, schedule=schedule,
                 persistent=persistent)
    run(spec, 2, 1111, 1537, 4, 2, BF16, causal=mask == "causal", same_as_cp_async=False)
    run(spec, 3, 17, 3001, 8, 1, FP16, causal=mask == "causal", same_as_cp_async=False)


# Three consumer warpgroups (192-row tiles on 12 warps, FlashAttention-3's form at head_dim 64; ping-pong takes turns
# among the three): one CTA a tile and persistent (several query tiles a CTA), ragged lengths, query tiles with no
# key. No cp.async twin exists (its kernel has no 12-warp form); each is checked against the fp64 reference.
THREE = [(64, 128, 2), (64, 96, 3), (64, 80, 2), (128, 64, 2)]


@pytest.mark.parametrize("d,kv,stages", THREE)
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("persistent", [False, True], ids=["one", "persistent"])
def test_tma_three_warpgroups(d, kv, stages, mask, schedule, persistent):
    spec = _spec(head_dim=d, cta_tile_q=192, cta_tile_kv=kv, num_warps=12, num_stages=stages, schedule=schedule,
                 persistent=persistent)
    causal, window = mask == "causal", (100, 7) if mask == "window" else (-1, -1)
    run(spec, 2, 1111, 1537, 4, 2, BF16, causal=causal, window=window, same_as_cp_async=False)
    run(spec, 1, 17, 3001, 2, 1, FP16, causal=causal, window=window, same_as_cp_async=False)
    run(spec, 2, 1000, 17, 4, 4, BF16, causal=causal, window=window, same_as_cp_async=False)
    if causal:  # most query tiles see no key (ping-pong: their warpgroups take no turn)
        run(spec, 2, 4096, 64, 8, 2, BF16, causal=True, same_as_cp_async=False)
    if persistent:  # several query tiles a CTA (6 x 16 x 6 = 576 tiles)
        for _ in range(2):
            run(spec, 6, 1111, 1537, 16, 4, BF16, causal=causal, window=window, same_as_cp_async=False)


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tma_ctas_without_keys(stages, schedule):
    # Causal with sq >> sk: most CTAs visit no KV tile; they still wait for Q's copy before the epilogue
    # reuses its tile (pingpong: and take no turn). Repeated: a missed wait shows only sometimes.
    spec = _spec(head_dim=128, cta_tile_kv=64, num_warps=8, num_stages=stages, schedule=schedule)
    for _ in range(3):
        run(spec, 2, 4096, 64, 8, 2, BF16, causal=True)


# (512: the chunked kernel's TMA form)
@pytest.mark.parametrize("d", [128, 512])
def test_tma_empty_keys(d):
    spec = _spec(head_dim=d)
    q = torch.randn(1, 5, 4, d, device="cuda", dtype=BF16)
    k = torch.randn(1, 0, 4, d, device="cuda", dtype=BF16)
    o, lse = attngen.prefill(q, k, k, return_lse=True, spec=spec)
    torch.cuda.synchronize()
    assert (o == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("d", [128, 512])
def test_tma_strided_views_from_packed_qkv(d):
    gen = fresh_generator()
    b, s, h = 2, 300, 4
    qkv = torch.randn(b, s, 3, h, d, generator=gen, device="cuda").to(BF16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    spec = _spec(head_dim=d)
    o = attngen.prefill(q, k, v, causal=True, spec=spec)
    ref, _ = reference(q, k, v, range_keep(s, s, True, (-1, -1))[None, None], d ** -0.5)
    assert torch.isfinite(o).all() and rel_l2(o, ref) < TOL[BF16]
    assert torch.equal(o, attngen.prefill(q, k, v, causal=True, spec=_sync(spec)))


@pytest.mark.parametrize("d", [128, 512])
def test_tma_batch_broadcast_kv(d):
    # k and v expanded over the batch (stride 0). A spec that pins pipeline=tma gets the driver's map or
    # an error naming pipeline=sync; the default (TMA on sm_90a) falls back to the cp.async kernel of
    # its tiles where no map can be built. Never a wrong result.
    gen = fresh_generator()
    q = torch.randn(3, 200, 4, d, generator=gen, device="cuda").to(BF16)
    k = torch.randn(1, 300, 2, d, generator=gen, device="cuda").to(BF16).expand(3, -1, -1, -1)
    v = torch.randn(1, 300, 2, d, generator=gen, device="cuda").to(BF16).expand(3, -1, -1, -1)
    spec = _spec(head_dim=d)
    want = attngen.prefill(q, k, v, spec=_sync(spec))
    assert torch.equal(attngen.prefill(q, k, v), want)
    try:
        o = attngen.prefill(q, k, v, spec=spec)
    except attngen.LaunchError as e:
        assert "pipeline=sync" in str(e)
    else:
        assert torch.equal(o, want)


def test_default_is_tma_on_sm90a_dense_only():
    _spec(head_dim=128)  # skips off sm_90a
    q = torch.randn(1, 64, 4, 128, device="cuda", dtype=BF16)
    from attngen.families.prefill.op import kernel_for

    assert kernel_for(q, q, q).spec.pipeline.value == "tma"
    assert kernel_for(q, q, q[..., :64]).spec.pipeline.value == "sync"  # v narrower: not tuned for TMA yet


def _default_call_checked(q, k, v, causal, dtype, **mods):
    """attngen.prefill without a spec (the default for the call's rows) into a NaN-poisoned view of a sentinel
    buffer, with the LSE: the sentinel intact, out and LSE against the fp32 reference (with ``mods``, softcap and
    ALiBi). Returns (out, the reference's out)."""
    from tests.gpu_reference import reference_attention

    out, buf, guards = sentinel_out((*q.shape[:3], v.shape[3]), dtype)
    o, lse = attngen.prefill(q, k, v, causal=causal, return_lse=True, out=out, **mods)
    torch.cuda.synchronize()
    check_sentinel(buf, guards)
    if mods:
        ref_o, ref_l = reference_attention(q, k, v, causal=causal, **mods)
    else:
        ref_o, ref_l = reference(q, k, v, range_keep(q.shape[1], k.shape[1], causal, (-1, -1))[None, None],
                                 q.shape[3] ** -0.5)
    compare(o, lse, ref_o, ref_l, dtype)
    return o, ref_o


@pytest.mark.parametrize("causal,sq,sk,h", [(False, 2048, 2048, 4), (False, 3001, 1537, 4), (True, 8192, 8192, 2)])
def test_default_long_rows_take_three_warpgroups(causal, sq, sk, h):
    # head_dim 64 without a spec: from 2048 query rows (causal: 8192) the call runs 192-row tiles on three
    # consumer warpgroups, below it the 128-row default; a call whose inputs no TMA map describes falls back to
    # the cp.async kernel of the same key tiles on two warpgroups (its own grid).
    _spec(head_dim=64)  # skips off sm_90a
    from attngen.families.prefill.op import kernel_for

    gen = fresh_generator()
    q = guarded(1, sq, h, 64, dtype=BF16, gen=gen)
    k = guarded(1, sk, 1, 64, dtype=BF16, gen=gen)
    v = guarded(1, sk, 1, 64, dtype=BF16, gen=gen)
    long = kernel_for(q, k, v, causal=causal).spec
    assert (long.cta_tile_q, long.num_warps, long.schedule.value, long.is_persistent) == (192, 12, "pingpong", False)
    assert kernel_for(q[:, : sq // 2 - 1], k, v, causal=causal).spec.cta_tile_q == 128
    o, ref_o = _default_call_checked(q, k, v, causal, BF16)
    assert torch.equal(o, attngen.prefill(q, k, v, causal=causal, spec=long))
    # k and v broadcast over a batch of 2 (stride 0)
    q2 = torch.cat([q, q.flip(1)])
    k2, v2 = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    twin = long.replace(cta_tile_q=128, num_warps=8, pipeline="sync", schedule="serial")
    o2 = attngen.prefill(q2, k2, v2, causal=causal)
    try:
        tma_o2 = attngen.prefill(q2, k2, v2, causal=causal, spec=long)
    except attngen.LaunchError as e:  # no map: the default ran the cp.async twin
        assert "pipeline=sync" in str(e)
        assert torch.equal(o2, attngen.prefill(q2, k2, v2, causal=causal, spec=twin))
    else:
        assert torch.equal(o2, tma_o2)
    assert rel_l2(o2[:1], ref_o) < TOL[BF16]


@pytest.mark.parametrize("sq,sk", [(512, 512), (1023, 700), (1, 3001)])
def test_default_short_causal_rows_take_64_row_tiles(sq, sk):
    # head_dim 64, causal, without a spec: below 1024 query rows the call runs 64x64 tiles on one warpgroup
    # (the cp.async ring), from 1024 the 128-row default.
    _spec(head_dim=64)  # skips off sm_90a
    from attngen.families.prefill.op import kernel_for

    gen = fresh_generator()
    q = guarded(3, sq, 4, 64, dtype=FP16, gen=gen)
    k = guarded(3, sk, 2, 64, dtype=FP16, gen=gen)
    v = guarded(3, sk, 2, 64, dtype=FP16, gen=gen)
    short = kernel_for(q, k, v, causal=True).spec
    assert (short.cta_tile_q, short.cta_tile_kv, short.num_warps, short.pipeline.value) == (64, 64, 4, "sync")
    assert kernel_for(q, k, v).spec.cta_tile_q == 128  # no mask: the default at every length below 2048
    long_q = torch.empty(3, 1024, 4, 64, device="cuda", dtype=FP16)
    assert kernel_for(long_q, k, v, causal=True).spec.cta_tile_q == 128
    o, _ = _default_call_checked(q, k, v, True, FP16)
    assert torch.equal(o, attngen.prefill(q, k, v, causal=True, spec=short))


@pytest.mark.parametrize("d,causal,sq,sk,tiles", [(64, False, 2048, 2100, (192, 128)), (64, True, 512, 777, (64, 64)),
                                                  (64, True, 8192, 8192, (192, 128)), (64, True, 8191, 8191, (128, 128)),
                                                  (256, False, 1100, 1500, (128, 80)),
                                                  (128, True, 700, 900, (64, 64)), (128, True, 768, 768, (128, 128)),
                                                  (256, True, 3001, 3001, (128, 80)), (256, False, 16384, 16384, (128, 80)),
                                                  (128, False, 8192, 8300, (128, 192)),
                                                  (128, False, 8191, 8191, (128, 128))])
def test_defaults_by_rows_with_softcap_alibi_gqa(d, causal, sq, sk, tiles):
    # the defaults by rows (head_dim 64: three warpgroups, 64-row tiles; 128: 64-row tiles, 192-key tiles; 256: 128x80
    # ping-pong) with the score mods, GQA and the LSE, against the fp32 reference that applies them
    _spec(head_dim=d)  # skips off sm_90a
    from attngen.families.prefill.op import kernel_for

    gen = fresh_generator()
    h, hk = (4, 2) if sq < 16384 else (2, 1)
    q = guarded(1, sq, h, d, dtype=BF16, gen=gen)
    k = guarded(1, sk, hk, d, dtype=BF16, gen=gen)
    v = guarded(1, sk, hk, d, dtype=BF16, gen=gen)
    slopes = torch.rand(h, device="cuda", dtype=torch.float32, generator=gen)
    spec = kernel_for(q, k, v, causal=causal).spec
    assert (spec.cta_tile_q, spec.cta_tile_kv) == tiles
    _default_call_checked(q, k, v, causal, BF16, softcap=30.0, alibi_slopes=slopes)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tma_softcap_alibi_gqa(schedule):
    spec = _spec(head_dim=128, softcap=True, alibi=True, schedule=schedule)
    slopes = torch.rand(8, device="cuda", dtype=torch.float32)
    run(spec, 2, 700, 900, 8, 2, BF16, causal=True, softcap=30.0, alibi_slopes=slopes)


def test_tma_maps_follow_new_buffers():
    # The host keeps tensor maps by (pointer, shape, strides): a call on other buffers of the same shapes,
    # or on the same buffers with other values, must read what is there now.
    spec = _spec(head_dim=64)
    for _ in range(3):
        run(spec, 1, 500, 700, 4, 4, FP16, causal=True, same_as_cp_async=False)
    gen = fresh_generator()
    q = torch.randn(1, 256, 4, 64, generator=gen, device="cuda").to(FP16)
    k = torch.randn(1, 256, 4, 64, generator=gen, device="cuda").to(FP16)
    o1 = attngen.prefill(q, k, k, spec=spec).clone()
    k.mul_(-1.0)
    o2 = attngen.prefill(q, k, k, spec=spec)
    assert torch.equal(o2, attngen.prefill(q, k, k, spec=_sync(spec)))
    assert not torch.equal(o1, o2)


# ---- persistent: a grid of at most the CTAs the SMs hold walks the query tiles (pairs, heavy first) ----

@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (192, 128), (128, 64), (256, 256), (256, 128)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SHAPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_persistent_matches_reference(dtype, d, dv, causal, sq, sk, schedule):
    run(_spec(head_dim=d, head_dim_v=dv, schedule=schedule, persistent=True), 2, sq, sk, 4, 2, dtype, causal=causal)


@pytest.mark.parametrize("b,sq,sk,h,hk", [
    (8, 1000, 1000, 16, 4),   # 8 query tiles a head: 4 units of two, ~4 units a CTA
    (4, 1500, 1500, 32, 8),   # an odd count of query tiles (12 of 128, 24 of 64): a middle tile alone
    (16, 129, 300, 8, 8),     # two query tiles, the last of one row
    (3, 777, 2049, 24, 3),    # q and k lengths apart
])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_persistent_many_tiles_a_cta(b, sq, sk, h, hk, mask, schedule):
    # More query tiles than CTAs: each CTA walks several, the ring and the mbarriers' phases run on across
    # them. Repeated: a phase or a release missed shows only sometimes.
    spec = _spec(head_dim=128, schedule=schedule, persistent=True)
    window = (200, 31) if mask == "window" else (-1, -1)
    for _ in range(2):
        run(spec, b, sq, sk, h, hk, BF16, causal=mask == "causal", window=window)


@pytest.mark.parametrize("kv,schedule", [(64, "serial"), (64, "pingpong"), (80, "pingpong"), (80, "overlap")])
@pytest.mark.parametrize("b,sq,sk,h,hk", [(4, 1000, 1000, 16, 4), (2, 1500, 2049, 8, 8), (16, 129, 300, 8, 2)])
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_persistent_o_in_q_many_tiles(kv, schedule, b, sq, sk, h, hk, mask):
    # Head dim 256: O is staged in Q's tile (o_in_q), so each next Q waits for the epilogue to read O out, and the
    # producer issues that tile's first key tiles before it. Several query tiles a CTA, repeated as above. (The
    # cp.async kernel has no 128x80 form at 256: its registers.)
    spec = _spec(head_dim=256, cta_tile_kv=kv, num_warps=8, num_stages=2, schedule=schedule, persistent=True)
    assert spec.o_in_q
    window = (300, 0) if mask == "window" else (-1, -1)
    for _ in range(2):
        run(spec, b, sq, sk, h, hk, BF16, causal=mask == "causal", window=window, same_as_cp_async=kv == 64)


@pytest.mark.parametrize("kv,warps,stages", TILES)
@pytest.mark.parametrize("mask", ["full", "causal"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_persistent_tile_configs(kv, warps, stages, mask, schedule):
    spec = _spec(head_dim=64, cta_tile_kv=kv, num_warps=warps, num_stages=stages, schedule=schedule,
                 persistent=True)
    run(spec, 6, 1111, 1537, 16, 4, BF16, causal=mask == "causal")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_persistent_tiles_without_keys(schedule):
    # Causal with sq >> sk: most query tiles see no key; their CTA still waits for each Q and releases it.
    spec = _spec(head_dim=128, cta_tile_kv=64, num_warps=8, num_stages=2, schedule=schedule, persistent=True)
    for _ in range(3):
        run(spec, 4, 4096, 64, 16, 4, BF16, causal=True)


def test_persistent_softcap_alibi_and_strided():
    spec = _spec(head_dim=128, persistent=True)
    slopes = torch.rand(8, device="cuda", dtype=torch.float32)
    run(spec, 2, 700, 900, 8, 2, BF16, causal=True, softcap=30.0, alibi_slopes=slopes)
    gen = fresh_generator()
    qkv = torch.randn(3, 1300, 3, 8, 128, generator=gen, device="cuda").to(BF16)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    o = attngen.prefill(q, k, v, causal=True, spec=spec)
    assert torch.equal(o, attngen.prefill(q, k, v, causal=True, spec=_sync(spec)))


# ---- the chunked kernel's TMA form (head dims above 256; each CTA's V columns whole 64-column boxes) ----

# (320, 448, 576, 640/192: each warpgroup's V columns end in a 32-column tail, one box of a 5-d map)
CHUNKED_DIMS = [(384, 384), (512, 512), (576, 512), (1024, 512), (768, 768), (1024, 1024), (512, 1024), (320, 1024),
                (320, 320), (448, 448), (576, 576), (640, 192)]
CHUNKED_SHAPES = [(1, 1), (17, 1000), (1000, 17), (333, 1031)]


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d,dv", CHUNKED_DIMS)
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
def test_chunked_tma_matches_reference(dtype, d, dv, mask):
    spec = _spec(head_dim=d, head_dim_v=dv)
    assert spec.chunked and spec.tma
    window = (100, 37) if mask == "window" else (-1, -1)
    for sq, sk in CHUNKED_SHAPES:
        run(spec, 2, sq, sk, 6, 2, dtype, causal=mask == "causal", window=window)


# (cta_tile_kv, num_stages, head_dim_chunk): rings of 3-8 slots, 32- to 128-key tiles, 64- and 128-wide chunks
CHUNKED_TILES = [(64, 3, 64), (128, 8, 64), (32, 4, 64), (128, 3, 128), (64, 4, 128), (128, 5, 64)]


@pytest.mark.parametrize("kv,stages,chunk", CHUNKED_TILES)
@pytest.mark.parametrize("mask", ["full", "causal"])
def test_chunked_tma_tile_configs(kv, stages, chunk, mask):
    spec = _spec(head_dim=512, cta_tile_kv=kv, num_stages=stages, head_dim_chunk=chunk)
    assert (spec.cta_tile_kv, spec.num_stages, spec.head_dim_chunk) == (kv, stages, chunk) and spec.tma
    run(spec, 1, 1111, 1537, 4, 1, BF16, causal=mask == "causal")


def test_chunked_tma_ctas_without_keys():
    # causal with sq >> sk: most query tiles see no key; the producer issues nothing for them
    spec = _spec(head_dim=512)
    for _ in range(3):
        run(spec, 2, 2048, 64, 4, 2, BF16, causal=True)


@pytest.mark.parametrize("d", [512, 1024])
def test_chunked_tma_softcap_alibi_gqa(d):
    spec = _spec(head_dim=d, softcap=True, alibi=True)
    slopes = torch.rand(8, device="cuda", dtype=torch.float32)
    run(spec, 2, 700, 900, 8, 2, BF16, causal=True, softcap=30.0, alibi_slopes=slopes)


