"""The MLA decode family on a real GPU against an fp32 reference (pytest -m gpu).

Fresh random inputs, outputs poisoned with NaN. Queries sit inside larger NaN-filled buffers;
every cache position past a row's length, and every paged block no table names, holds NaN (a
stray read turns the output NaN, even one multiplied by a zero probability); the output sits
inside a buffer whose border holds a sentinel (a stray write changes it).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.arch import arch_for_capability  # noqa: E402
from attngen.families.mla_decode.spec import MlaDecodeSpec  # noqa: E402
from attngen.spec import Mma, Pipeline, tuning_candidates  # noqa: E402
from tests.gpu_reference import check_output_and_lse, fresh_generator, reference_mla  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
SENTINEL = 7.0
NAN = float("nan")



def _randn(shape, dtype, gen):
    return torch.randn(shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)


def _inside_nan(shape, dtype, gen):
    """A random [b, s, h, d] tensor viewed inside a NaN buffer (a row before and after, one head
    past it, 8 elements past each row)."""
    b, s, h, d = shape
    buf = torch.full((b, s + 2, h + 1, d + 8), NAN, dtype=dtype, device="cuda")
    view = buf[:, 1:1 + s, :h, :d]
    view.copy_(_randn(shape, dtype, gen))
    return view


def make_cache(seqlens, dim, dtype, gen, block_size=None, table=None, row_scale=None):
    """Contiguous: a [b, cap, dim] view (rows padded by 8 NaN elements) with NaN past each length.
    Paged: the pool [num_blocks, block_size, dim] filled through ``table``; unnamed blocks and
    slots past a length hold NaN. ``row_scale(cap)``: a factor for each position. Returns (cache,
    dense [b, cap, dim] fp32 copy of the live part)."""
    b = len(seqlens)
    cap = max(max(seqlens), 1)
    dense = torch.randn((b, cap, dim), device="cuda", generator=gen)
    if row_scale is not None:
        dense *= row_scale(cap).view(1, cap, 1)
    dense = dense.to(dtype)
    for i, n in enumerate(seqlens):
        dense[i, n:] = NAN
    if block_size is None:
        buf = torch.full((b, cap + 1, dim + 8), NAN, dtype=dtype, device="cuda")
        view = buf[:, :cap, :dim]
        view.copy_(dense)
        return view, dense.float()
    pool = torch.full((int(table.max().item()) + 3, block_size, dim), NAN, dtype=dtype, device="cuda")
    for i in range(b):
        for j in range(-(-seqlens[i] // block_size)):
            n = min(block_size, seqlens[i] - j * block_size)
            pool[table[i, j], :n] = dense[i, j * block_size: j * block_size + n]
    return pool, dense.float()


def shuffled_table(b: int, per_row: int, seed: int):
    """A block table [b, per_row] (int32, on the GPU): the first b x per_row of b x per_row + 4 block ids shuffled
    (CPU generator seeded with ``seed``), so the pool has a gap of unnamed (NaN) blocks among the named ones."""
    perm = torch.randperm(b * per_row + 4, generator=torch.Generator().manual_seed(seed))
    return perm[:b * per_row].reshape(b, per_row).to(torch.int32).cuda()


def run_case(seqlens, heads, q_len, dtype=torch.bfloat16, rank=512, rope=64, block_size=None, spec=None,
             num_splits=0, seqlen_as_int=False, kpe_scale=None):
    gen = fresh_generator()
    b = len(seqlens)
    q_nope = _inside_nan((b, q_len, heads, rank), dtype, gen)
    q_pe = _inside_nan((b, q_len, heads, rope), dtype, gen)
    table = None
    if block_size is not None:
        per_row = max(1, -(-max(seqlens) // block_size))
        table = shuffled_table(b, per_row, int(gen.initial_seed() % 2**31))
    ckv, ckv_ref = make_cache(seqlens, rank, dtype, gen, block_size, table)
    kpe, kpe_ref = make_cache(seqlens, rope, dtype, gen, block_size, table, kpe_scale)
    scale = 1.0 / (rank // 4 + rope) ** 0.5
    obuf = torch.full((b, q_len + 2, heads, rank + 8), SENTINEL, dtype=dtype, device="cuda")
    out = obuf[:, 1:1 + q_len, :, :rank]
    out.fill_(NAN)
    lens = seqlens[0] if seqlen_as_int else torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    o, lse = attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, block_table=table, sm_scale=scale,
                                num_splits=num_splits, return_lse=True, out=out, spec=spec)
    torch.cuda.synchronize()
    assert o is out
    border = obuf.clone()
    border[:, 1:1 + q_len, :, :rank] = SENTINEL
    assert (border == SENTINEL).all(), "a write landed outside the output"
    assert torch.isfinite(o).all(), "unwritten (NaN) or non-finite output elements: a stray read or no write"
    ref_o, ref_l = reference_mla(q_nope, q_pe, ckv_ref, kpe_ref, seqlens, scale)
    return check_output_and_lse(o, lse, ref_o, ref_l, TOL[dtype])


def _arch():
    return arch_for_capability(*torch.cuda.get_device_capability())


@pytest.fixture
def launches():
    """Every launch of a kernel module's entries from here on, as (entry suffix, cluster size)."""
    from attngen import runtime

    with runtime.recorded_launches(lambda one: (one.entry, one.cluster_x)) as seen:
        yield seen


def _chosen(monkeypatch, field=None):
    """The list to which every kernel mla_decode loads from here on adds its spec's ``field`` (None: the spec)."""
    from attngen.families.mla_decode import choose, op

    seen = []
    real = op.get_kernel

    def spy(spec, **kw):
        k = real(spec, **kw)
        seen.append(k.spec if field is None else getattr(k.spec, field))
        return k

    monkeypatch.setattr(op, "get_kernel", spy)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("q_len", [1, 2, 4])
def test_heads_and_q_len(dtype, heads, q_len):
    run_case([1, 17, 1000, 3001], heads, q_len, dtype)


@pytest.mark.parametrize("q_len", [1, 3])
def test_long_and_ragged(q_len):
    run_case([32768, 5, 2, 0, 12345], 16, q_len)


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128, 256])
@pytest.mark.parametrize("heads", [16, 128])
def test_paged(block_size, heads):
    run_case([1, 63, 700, 2049], heads, 2, block_size=block_size)


@pytest.mark.parametrize("block_size", [1, 3, 8, 24, 100, 255])
@pytest.mark.parametrize("heads", [16, 32, 128])
@pytest.mark.parametrize("pipeline", [None, "sync"], ids=["default", "sync"])
def test_page_rows(block_size, heads, pipeline, monkeypatch):
    """Blocks that are not a multiple of 16 (SGLang's page 1 among them) run the page_rows kernels: every key row's
    block looked up, on sm_90a by default gathered into the TMA ring by a producer warpgroup, with pipeline=sync by
    every thread on the cp.async ring; ragged rows, one- and two-token steps, forced splits through the merge."""
    ran = _chosen(monkeypatch, "gather")
    spec = None if pipeline is None else f"mla_decode:pipeline={pipeline}"
    run_case([1, 63, 700, 2049], heads, 2, block_size=block_size, spec=spec)
    run_case([3000, 65, 1], heads, 1, block_size=block_size, num_splits=3, spec=spec)
    assert ran and all(g == (pipeline is None and _arch().has_wgmma) for g in ran)


@pytest.mark.parametrize("shard", ["true", "false"])
@pytest.mark.parametrize("tile", [32, 64])
def test_page_rows_gather_pins(shard, tile):
    """The gathered ring's other tile configs (sm_90a): S sharded or whole, 32- and 64-key tiles, at 64 and 16 rows."""
    if not _arch().has_wgmma:
        pytest.skip("the gathered TMA ring is sm_90a's")
    stages = 2 if tile == 64 else 4
    for heads in (128, 16):
        mma = "wgmma" if heads == 128 else "mma_sync"
        if mma == "wgmma" and shard == "true" and tile == 32:
            stages = 3
        spec = f"mla_decode:qk_shard={shard},cta_tile_kv={tile},num_stages={stages},mma={mma},pipeline=tma"
        run_case([1, 300, 2049], heads, 1, block_size=5, spec=spec)


@pytest.mark.parametrize("block_size", [1, 5, 24, 100])
@pytest.mark.parametrize("heads", [128, 64])
def test_page_rows_gather_alternate(block_size, heads):
    """Alternate tiles over the gathered ring (sm_90a): the producer's two pairs of warps gather a slot's halves each
    on its own run of the tiles; ragged rows with a part tile last, two tokens,
    forced splits, an empty row, fp16 with 256 + 32 dims."""
    if not _arch().has_wgmma:
        pytest.skip("the gathered TMA ring is sm_90a's")
    spec = "mla_decode:qk_shard=alternate"
    run_case([1, 63, 700, 2049], heads, 1, block_size=block_size, spec=spec)
    run_case([3000, 65, 0, 129], heads, 2, block_size=block_size, num_splits=3, spec=spec)
    run_case([1, 500, 2000], heads, 1, torch.float16, rank=256, rope=32, block_size=block_size, spec=spec)


@pytest.mark.parametrize("block_size", [1, 7])
def test_page_rows_gather_two_ctas(block_size):
    """The one-stage gather of four consumer warps, two CTAs an SM (sm_90a), at 16 rows: 16 heads, 8 x 2 tokens."""
    if not _arch().has_wgmma:
        pytest.skip("the gathered TMA ring is sm_90a's")
    spec = "mla_decode:num_stages=1,num_warps=4,mma=mma_sync,pipeline=tma"
    run_case([1, 63, 700, 2049], 16, 1, block_size=block_size, spec=spec)
    run_case([3000, 65, 1], 8, 2, block_size=block_size, num_splits=3, spec=spec)


@pytest.mark.parametrize("block_size", [16, 1])
def test_one_stage_gather_chosen(block_size, monkeypatch):
    """16 heads over a grid of many tiles an SM: on a GPU whose memory needs most of its SMs (an H200) the op takes
    the one-stage gather, two CTAs an SM, for blocks of 16 as for pages of 1; the answer is right on every GPU."""
    from attngen.families.choice import device_facts
    from attngen.families.mla_decode.choose import FAST_MEMORY_SHARE

    ran = _chosen(monkeypatch, "gather")
    seqlens = [4096] * 36 + [1, 77, 3000, 4095]
    run_case(seqlens, 16, 1, block_size=block_size)
    facts = device_facts(torch.cuda.current_device())
    if _arch().has_wgmma and facts.memory_share >= FAST_MEMORY_SHARE and facts.sm_count <= 132:
        assert ran == [True]


@pytest.mark.parametrize("block_size", [16, 48, 32])
@pytest.mark.parametrize("heads", [32, 128])
def test_blocks_of_16_rows_gathered(block_size, heads, monkeypatch):
    """32 and 128 heads over split rows (sm_90a): blocks that cut a tile into 16-row boxes (16, 48) take the
    producer warpgroup's gather, blocks of 32 the TMA boxes; ragged rows, an empty one and a part tile last."""
    ran = _chosen(monkeypatch, "gather")
    run_case([8192, 5000, 0, 8191, 33, 6000, 7777, 4096], heads, 1, block_size=block_size)
    if _arch().has_wgmma:
        assert ran == [block_size % 32 != 0]


@pytest.mark.parametrize("heads", [16, 64, 128])
def test_page_rows_fp16_small_dims_and_default_splits(heads):
    """Page 1 at fp16 with 256 + 32 dims, and long rows whose split count the op chooses."""
    run_case([1, 500, 2000], heads, 1, torch.float16, rank=256, rope=32, block_size=1)
    run_case([16384, 9000], heads, 1, block_size=1)



@pytest.mark.parametrize("splits", [1, 2, 7, 64])
def test_forced_splits(splits):
    run_case([100, 1500, 3], 32, 1, num_splits=splits)


@pytest.mark.parametrize("heads,q_len,seqlens,splits,entry", [
    (16, 1, [32768], 128, "_merge_wide"),    # batch 1, 16 heads: 16 splits a warp of the wide merge
    (8, 4, [5000], 33, "_merge_wide"),       # 33 splits over 8 warps: shares of 5, 3 and none
    (32, 1, [3000], 40, "_merge_wide"),
    (8, 1, [3, 4000, 0], 256, "_merge_wide"),  # most splits see no key; a row sees none
    (16, 1, [1000] * 48, 16, "_merge"),      # few splits, 768 rows: a warp 256 columns
    (32, 2, [700, 9000], 12, "_merge_fine"),  # past a cluster, under the wide merge; 128 rows: a warp 64 columns
])
def test_merge_entries(heads, q_len, seqlens, splits, entry, launches):
    """Every merge entry against the fp32 reference; on a GPU of 132 SMs (the lent H100 and H200) each case
    takes the entry named."""
    run_case(seqlens, heads, q_len, num_splits=splits)
    if torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count == 132:
        assert launches == [("", 0), (entry, 0)]


def test_fixed_length_and_empty_rows():
    run_case([777, 777], 16, 2, seqlen_as_int=True)
    run_case([0, 1, 2, 3], 16, 4)  # tokens that see no key give zeros and LSE -inf


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("q_rows", [16, 32, 64])
def test_rope_32_rank_256(paged, q_rows):
    heads = {16: 16, 32: 32, 64: 64}[q_rows]
    run_case([1, 500, 2000], heads, 1, rank=256, rope=32, block_size=64 if paged else None)


def _fitting_configs():
    arch = _arch()
    return [s for q_rows in (16, 64) for s in tuning_candidates(MlaDecodeSpec(q_rows=q_rows), arch)]


def test_every_config_that_fits():
    """qk_shard on and off, every stage count and tile that fits this GPU, q_rows 16 and 64; on
    sm_90a both mma_sync and wgmma."""
    specs = _fitting_configs()
    assert any(s.sharded for s in specs) and any(not s.sharded for s in specs)
    if _arch().name == "sm_90a":
        assert {s.mma for s in specs} == {Mma.SYNC, Mma.WGMMA}
    for spec in specs:
        heads = 16 if spec.q_rows == 16 else 128
        for paged in (None, 32):
            run_case([1, 130, 1999], heads, 1, spec=spec, block_size=paged)


@pytest.mark.parametrize("mma", ["mma_sync", "wgmma"])
@pytest.mark.parametrize("heads,q_len", [(64, 1), (128, 4), (40, 2)])
def test_mma_paths_agree(mma, heads, q_len):
    """Both instruction paths where the GPU has both (the default takes wgmma at 64 rows on sm_90a):
    full and partial row blocks, paged and split."""
    if mma == "wgmma" and _arch().name != "sm_90a":
        pytest.skip("wgmma needs sm_90a")
    spec = MlaDecodeSpec(mma=mma)
    run_case([1, 17, 1000, 3001], heads, q_len, spec=spec)
    run_case([5000, 64, 129], heads, q_len, spec=spec, block_size=64, num_splits=3)
    run_case([700, 2], heads, q_len, dtype=torch.float16, rank=256, rope=32, spec=spec)


def test_cuda_graph():
    """Captured once, replayed with new lengths and queries: no host sync in the call."""
    gen = fresh_generator()
    b, heads, q_len, cap = 4, 16, 1, 4096
    q_nope = _randn((b, q_len, heads, 512), torch.bfloat16, gen)
    q_pe = _randn((b, q_len, heads, 64), torch.bfloat16, gen)
    ckv = _randn((b, cap, 512), torch.bfloat16, gen)
    kpe = _randn((b, cap, 64), torch.bfloat16, gen)
    lens = torch.tensor([100, 4000, 1, 2500], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q_nope)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, sm_scale=0.1, out=out, num_splits=8)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, sm_scale=0.1, out=out, num_splits=8)
    for new in ([4096, 7, 300, 1], [5, 5, 5, 5]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        q_nope.copy_(_randn(q_nope.shape, torch.bfloat16, gen))
        out.fill_(NAN)
        g.replay()
        torch.cuda.synchronize()
        ref, _ = reference_mla(q_nope, q_pe, ckv.float(), kpe.float(), new, 0.1)
        err = (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()
        assert err < 2e-2


def test_bad_inputs():
    q = torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16, device="cuda")
    qp = torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16, device="cuda")
    c = torch.zeros(2, 64, 512, dtype=torch.bfloat16, device="cuda")
    p = torch.zeros(2, 64, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(attngen.LaunchError, match="q_len=5"):
        attngen.mla_decode(torch.zeros(2, 5, 16, 512, dtype=torch.bfloat16, device="cuda"),
                           torch.zeros(2, 5, 16, 64, dtype=torch.bfloat16, device="cuda"), c, p,
                           cache_seqlens=10, sm_scale=0.1)
    with pytest.raises(attngen.LaunchError, match="kv_lora_rank=384"):
        attngen.mla_decode(torch.zeros(2, 1, 16, 384, dtype=torch.bfloat16, device="cuda"), qp,
                           torch.zeros(2, 64, 384, dtype=torch.bfloat16, device="cuda"), p,
                           cache_seqlens=10, sm_scale=0.1)
    with pytest.raises(attngen.LaunchError, match=r"block_size=300 \(ckv_cache.shape\[1\]\) is not supported; "
                                                  r"allowed: an int from 1 to 256"):
        attngen.mla_decode(q, qp, torch.zeros(4, 300, 512, dtype=torch.bfloat16, device="cuda"),
                           torch.zeros(4, 300, 64, dtype=torch.bfloat16, device="cuda"), cache_seqlens=10,
                           block_table=torch.zeros(2, 2, dtype=torch.int32, device="cuda"), sm_scale=0.1)
    with pytest.raises(attngen.LaunchError, match="share a dtype"):
        attngen.mla_decode(q, qp, c.half(), p, cache_seqlens=10, sm_scale=0.1)
    with pytest.raises(attngen.LaunchError, match="sm_scale"):
        attngen.mla_decode(q, qp, c, p, cache_seqlens=10, sm_scale=-1.0)


def _sm90a_only():
    if _arch().name != "sm_90a":
        pytest.skip("the TMA pipeline needs sm_90a")


@pytest.mark.parametrize("block_size", [16, 32, 48, 64])
@pytest.mark.parametrize("heads,splits", [(16, 1), (64, 3), (128, 1), (128, 4)])
def test_box_lanes(block_size, heads, splits, monkeypatch):
    """Blocks smaller than the tile on sm_90a's TMA ring take the box_lanes kernels (a warp issues each tile's boxes
    from the table entries its lanes looked up, a tile ahead on the ring of the 16-row and sharded kernels), blocks
    of whole tiles one thread's issue; against fp32 over rows that end inside a box and a tile, an empty one, and
    splits that get no tile. The lanes' form pinned over whole-tile blocks gives the same bits as one thread's."""
    specs = _chosen(monkeypatch)
    seqlens = [4100, 1, 0, 2049, 63, 700, 3001, 17]
    run_case(seqlens, heads, 1, block_size=block_size, num_splits=splits)
    for sp in specs:
        assert sp.box_lanes == (sp.tma and not sp.page_rows and sp.cta_tile_kv > block_size), sp.to_text()
    if block_size == 64 and _arch().has_wgmma:
        gen = fresh_generator()
        table = torch.randperm(len(seqlens) * 65, generator=torch.Generator().manual_seed(3))
        table = table.reshape(len(seqlens), 65).to(torch.int32).cuda()
        ckv, _ = make_cache(seqlens, 512, torch.bfloat16, gen, 64, table)
        kpe, _ = make_cache(seqlens, 64, torch.bfloat16, gen, 64, table)
        q_nope = torch.randn(len(seqlens), 1, heads, 512, dtype=torch.bfloat16, device="cuda", generator=gen)
        q_pe = torch.randn(len(seqlens), 1, heads, 64, dtype=torch.bfloat16, device="cuda", generator=gen)
        lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
        outs = [attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, block_table=table, sm_scale=0.07,
                                   num_splits=splits, spec=MlaDecodeSpec(paged=True, box_lanes=lanes))
                for lanes in (False, True)]
        assert specs[-1].box_lanes and not specs[-2].box_lanes
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("mma,heads,q_len", [("wgmma", 128, 2), ("mma_sync", 16, 1), ("mma_sync", 16, 2)])
@pytest.mark.parametrize("rank,rope", [(512, 64), (256, 32)])
@pytest.mark.parametrize("block_size", [None, 16, 48, 64, 256], ids=lambda b: f"paged{b}" if b else "contiguous")
@pytest.mark.parametrize("shard,tile,stages", [("true", 64, 2), ("false", 64, 2), ("true", 32, 4), ("true", 64, 1)])
def test_tma_and_cp_async_agree_bitwise(mma, heads, q_len, rank, rope, block_size, shard, tile, stages, monkeypatch):
    """The TMA ring loads the same tiles as the cp.async one, so the outputs are the same bits: lengths
    that end inside a tile and inside a box (the rows past them NaN in the cache), splits that get no
    tile, paged blocks smaller and larger than the tile. The wgmma kernel at 128 heads, and mma.sync's at
    16 and 32 rows (whose ldmatrix reads the ring's swizzled tiles)."""
    _sm90a_only()
    from attngen.families.mla_decode import choose, op

    monkeypatch.setattr(choose, "MERGE_CLUSTER_MAX", 0)  # the same merge for both forms
    gen = fresh_generator()
    seqlens = [1, 17, 63, 64, 65, 700, 3001, 0]
    b = len(seqlens)
    table = None
    if block_size is not None:
        per_row = -(-max(seqlens) // block_size)
        table = shuffled_table(b, per_row, 7)
    ckv, ckv_ref = make_cache(seqlens, rank, torch.bfloat16, gen, block_size, table)
    kpe, kpe_ref = make_cache(seqlens, rope, torch.bfloat16, gen, block_size, table)
    q_nope = _inside_nan((b, q_len, heads, rank), torch.bfloat16, gen)
    q_pe = _inside_nan((b, q_len, heads, rope), torch.bfloat16, gen)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    got = {}
    # The TMA form as the arch resolves it, and the cp.async form of the same tiles and warps.
    tspec = attngen.resolve(MlaDecodeSpec(q_rows=MlaDecodeSpec.rows_for(heads, q_len), paged=block_size is not None,
                                          kv_lora_rank=rank, rope_dim=rope, mma=mma, pipeline="tma", qk_shard=shard,
                                          cta_tile_kv=tile, num_stages=stages), _arch())
    for pipeline, spec in (("tma", tspec), ("sync", tspec.replace(pipeline=Pipeline.SYNC))):
        for splits in (1, 5):
            out = torch.full((b, q_len, heads, rank), NAN, dtype=torch.bfloat16, device="cuda")
            o, lse = attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, block_table=table, sm_scale=0.07,
                                        num_splits=splits, return_lse=True, out=out, spec=spec)
            got[pipeline, splits] = (o, lse)
    torch.cuda.synchronize()
    for splits in (1, 5):
        (o_t, l_t), (o_s, l_s) = got["tma", splits], got["sync", splits]
        assert torch.equal(o_t, o_s) and torch.equal(l_t, l_s), f"splits={splits}"
    ref_o, ref_l = reference_mla(q_nope, q_pe, ckv_ref, kpe_ref, seqlens, 0.07)
    check_output_and_lse(*got["tma", 5], ref_o, ref_l, TOL[torch.bfloat16])


def test_tma_refused_map_falls_back(monkeypatch):
    """Where the driver builds no tensor map, a default call runs the cp.async kernel of the same tiles;
    a spec that pins pipeline=tma gets the driver's refusal."""
    _sm90a_only()
    from attngen.families.mla_decode import choose, op

    def refuse(dtype, ptr, dims, strides, box, what):
        raise attngen.LaunchError(what("CUDA_ERROR_INVALID_VALUE"))

    monkeypatch.setattr(op, "tiled_map", refuse)
    run_case([1, 700, 3001], 64, 1)
    with pytest.raises(attngen.LaunchError, match="pipeline=sync"):
        run_case([1, 700], 64, 1, spec=MlaDecodeSpec(pipeline="tma"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rank,rope", [(512, 64), (256, 32)])
@pytest.mark.parametrize("block_size", [None, 16, 48, 256], ids=lambda b: f"paged{b}" if b else "contiguous")
@pytest.mark.parametrize("q_len", [1, 4])
def test_alternate_tiles(dtype, rank, rope, block_size, q_len):
    """qk_shard=alternate: the warpgroups take alternate tiles, so splits with an odd number of tiles
    (the last pair has one), lengths ending inside a tile and splits with no tile; a token that sees no
    key; partial row blocks."""
    _sm90a_only()
    spec = MlaDecodeSpec(qk_shard="alternate")
    run_case([1, 17, 63, 64, 65, 129, 700, 3001, 0], 128, q_len, dtype, rank, rope, block_size, spec=spec)
    run_case([5000, 64, 129, 2], 40, q_len, dtype, rank, rope, block_size, spec=spec, num_splits=7)


@pytest.mark.parametrize("block_size", [16, 32, 48])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_alternate_box_lanes_bitwise(block_size, dtype, monkeypatch):
    """qk_shard=alternate over blocks smaller than a tile (box_lanes: a warp's lanes issue each refill's boxes) loads
    the same tiles as over blocks of 64 (one thread's refill), so the outputs are the same bits: splits of 1 to 4 tiles
    and of an odd number, lengths ending inside a box, an empty row, shuffled blocks."""
    _sm90a_only()
    specs = _chosen(monkeypatch)
    seqlens = [4100, 1, 0, 129, 191, 256, 3001, 17]
    b = len(seqlens)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q_nope = _randn((b, 1, 128, 512), dtype, gen)
    q_pe = _randn((b, 1, 128, 64), dtype, gen)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    outs, lanes = [], []
    for bs in (block_size, 64):
        per_row = -(-max(seqlens) // bs)
        table = shuffled_table(b, per_row, bs)
        ckv, _ = make_cache(seqlens, 512, dtype, torch.Generator(device="cuda").manual_seed(5), bs, table)
        kpe, _ = make_cache(seqlens, 64, dtype, torch.Generator(device="cuda").manual_seed(6), bs, table)
        for splits in (1, 3, 16):
            outs.append(attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, block_table=table,
                                           sm_scale=0.07, num_splits=splits, spec=MlaDecodeSpec(qk_shard="alternate")))
        assert all(sp.alternate for sp in specs), [sp.to_text() for sp in specs]
        lanes.append({sp.box_lanes for sp in specs})
        specs.clear()
    assert lanes == [{True}, {False}]
    for small, whole in zip(outs[:3], outs[3:]):
        assert not small.isnan().any()
        assert torch.equal(small, whole)


@pytest.mark.parametrize("q_len,splits", [(1, 1), (2, 3)])
def test_alternate_tiles_with_far_apart_maxima(q_len, splits):
    """qk_shard=alternate: each warpgroup's softmax runs against its own tile's maximum and is moved to the
    pair's after, so scores whose maxima jump up and down by many units from one 64-key tile to the next
    (kpe scaled by a factor a tile) must still match fp32."""
    _sm90a_only()

    def jumps(cap):
        f = torch.tensor([1.0, 9.0, 0.3, 14.0, 4.0, 0.1, 11.0, 2.0], device="cuda")
        return f[(torch.arange(cap, device="cuda") // 64) % len(f)]

    run_case([1024, 700, 3001, 130], 128, q_len, spec=MlaDecodeSpec(qk_shard="alternate"), num_splits=splits,
             kpe_scale=jumps)


@pytest.mark.parametrize("shard", ["true", "false", "alternate"])
@pytest.mark.parametrize("pattern", ["climb", "fall"])
@pytest.mark.parametrize("q_len,splits", [(1, 1), (3, 4)])
def test_lazy_rescale_climbing_scores(shard, pattern, q_len, splits):
    """The wgmma kernels keep a row's running max while a tile raises it by at most 2^8 (exp2 domain; P then runs
    above 1): kpe scaled up (or down) steadily along the keys, so the maxima climb a little every tile, or never
    move after the first, against fp32."""
    _sm90a_only()

    def ramp(cap):
        x = torch.linspace(0.05, 40.0, cap, device="cuda")
        return x if pattern == "climb" else x.flip(0)

    run_case([8192, 3001, 700, 1], 128, q_len, spec=MlaDecodeSpec(mma="wgmma", qk_shard=shard), num_splits=splits,
             kpe_scale=ramp)
    run_case([5000, 129], 64, q_len, spec=MlaDecodeSpec(mma="wgmma", qk_shard=shard), num_splits=splits,
             kpe_scale=ramp)


def test_auto_takes_alternate_tiles_for_many_rows_and_long_runs(monkeypatch):
    """qk_shard=auto: the alternate-tile kernel where a sequence's rows fill two 64-row blocks (or one, on
    fast memory, with ALTERNATE_ONE_BLOCK_MIN_BATCH blocks in the batch) and every CTA gets
    ALTERNATE_MIN_TILES tiles (ALTERNATE_MIN_TILES_UNSPLIT unsplit on fast memory with two blocks), the sharded one
    otherwise or when the caller pins qk_shard."""
    _sm90a_only()
    from attngen.families.mla_decode import choose, op

    seen = _chosen(monkeypatch, "qk_shard")
    for name in ("ALTERNATE_MIN_TILES", "ALTERNATE_MIN_TILES_UNSPLIT"):
        monkeypatch.setattr(choose, name, 2)
    run_case([4000, 3000, 129], 128, 1, num_splits=1)
    assert seen[-1] is choose.QkShard.ALTERNATE
    run_case([4000, 3000, 129], 64, 1, num_splits=1)  # one row block
    assert seen[-1] is choose.QkShard.TRUE
    run_case([4000, 3000, 129], 128, 1, num_splits=1, spec=MlaDecodeSpec(qk_shard="true"))
    assert seen[-1] is choose.QkShard.TRUE
    run_case([60, 30], 128, 1, num_splits=1)  # 1 tile a CTA: too few
    assert seen[-1] is choose.QkShard.TRUE
    # One 64-row block where the memory's share of SMs allows (here on any GPU) and the batch fills enough blocks.
    monkeypatch.setattr(choose, "FAST_MEMORY_SHARE", 0.0)
    monkeypatch.setattr(choose, "ALTERNATE_ONE_BLOCK_MIN_BATCH", 3)
    run_case([4000, 3000, 129], 64, 1, num_splits=1)
    assert seen[-1] is choose.QkShard.ALTERNATE
    run_case([4000, 3000, 129, 0], 32, 1, num_splits=2, block_size=64)  # 32 rows on the 64-row kernel, paged
    assert seen[-1] is choose.QkShard.ALTERNATE
    run_case([4000, 3000], 64, 1, num_splits=1)  # two sequences: too few blocks
    assert seen[-1] is choose.QkShard.TRUE


def test_auto_takes_one_stage_for_many_tiles_an_sm(monkeypatch):
    """16 rows on sm_90a's TMA ring: the one-stage kernel on four warps (two CTAs an SM) where the grid
    holds ONE_STAGE_MIN_TILES 64-key tiles an SM (and the memory's share of SMs allows, here on any
    GPU), contiguous, paged in blocks of whole tiles, or (the gather, page_rows) in blocks that are not; the
    two-stage default otherwise, and when the caller pins num_stages or num_warps."""
    _sm90a_only()
    from attngen.families.mla_decode import choose, op

    seen = _chosen(monkeypatch, "num_stages")
    monkeypatch.setattr(choose, "ONE_STAGE_MIN_TILES", 1)
    monkeypatch.setattr(choose, "FAST_MEMORY_SHARE", 0.0)
    run_case([4000, 3000, 129, 0], 16, 1)  # 63 tiles x 4 rows >= 132 SMs x 1
    assert seen[-1] == 1
    run_case([4000, 3000, 129, 0], 16, 1, num_splits=7)
    assert seen[-1] == 1
    run_case([4000, 3000, 129, 0], 16, 1, rank=256, rope=32, dtype=torch.float16)
    assert seen[-1] == 1
    run_case([4000, 3000, 129, 0], 16, 1, spec=MlaDecodeSpec(num_stages=2))
    assert seen[-1] == 2
    run_case([4000, 3000, 129, 0], 16, 1, spec=MlaDecodeSpec(num_warps=8))
    assert seen[-1] == 2
    run_case([4000, 3000, 129, 0], 16, 1, block_size=64)
    assert seen[-1] == 1
    run_case([4000, 3000, 129, 0], 16, 1, block_size=256, num_splits=5)
    assert seen[-1] == 1
    gathered = _chosen(monkeypatch, "page_rows")
    run_case([4000, 3000, 129, 0], 16, 1, block_size=48)
    assert seen[-1] == 1 and gathered == [True]
    run_case([60, 30], 16, 1)  # 1 tile x 2 rows: too few
    assert seen[-1] == 2
    run_case([4000, 3000], 64, 1)  # 64 rows: the wgmma kernel
    assert seen[-1] == 2


def test_auto_takes_the_wgmma_kernel_for_32_rows_on_fast_memory(monkeypatch):
    """32 packed rows on sm_90a: one 64-row block of the wgmma kernel (half its rows empty) where the
    device's memory needs FAST_MEMORY_SHARE of its SMs (here any GPU), checked against fp32 for 32
    heads, 16 heads x 2 tokens, 24 heads, rank 256 and paged blocks of 64 and 128; the 32-row kernel for
    paged blocks that are not whole tiles, a spec that pins a tuning field (mma, num_warps, pipeline), and
    where the share is below the bar."""
    _sm90a_only()
    from attngen.families.mla_decode import choose, op

    seen = _chosen(monkeypatch, "q_rows")
    monkeypatch.setattr(choose, "FAST_MEMORY_SHARE", 0.0)
    run_case([4000, 3000, 129, 0], 32, 1)
    assert seen[-1] == 64
    run_case([4000, 700, 1], 16, 2, num_splits=5)
    assert seen[-1] == 64
    run_case([3001, 64, 65], 24, 1, rank=256, rope=32, dtype=torch.float16)
    assert seen[-1] == 64
    run_case([4000, 3000, 129, 0], 32, 1, block_size=64)
    assert seen[-1] == 64
    run_case([4000, 700, 1], 16, 2, block_size=128, num_splits=3)
    assert seen[-1] == 64
    run_case([4000, 3000, 129, 0], 32, 1, block_size=48)
    assert seen[-1] == 32
    run_case([4000, 3000], 32, 1, spec=MlaDecodeSpec(mma="mma_sync"))
    assert seen[-1] == 32
    run_case([4000, 3000], 32, 1, spec=MlaDecodeSpec(num_warps=4))
    assert seen[-1] == 32
    run_case([4000, 3000], 32, 1, spec=MlaDecodeSpec(pipeline="tma"))
    assert seen[-1] == 32
    monkeypatch.setattr(choose, "FAST_MEMORY_SHARE", 1.01)
    run_case([4000, 3000], 32, 1)
    assert seen[-1] == 32


@pytest.mark.parametrize("heads,q_len,seqlens,splits,block_size", [
    (16, 1, [1000, 3000, 17, 0], 2, None),   # a row with no key, splits that see none
    (8, 3, [5000, 40], 5, None),             # 24 of 32 rows
    (32, 1, [2000, 1], 8, 64),               # paged
    (16, 2, [3000, 2500], 3, None),          # 32 rows
    (16, 1, [700] * 4, 2, 48),               # paged, a block size not a power of two
    (32, 1, [3000, 2000, 5], 7, None),       # 32 rows pushed over 7 splits: 5 a CTA, the last merging 2
    # 64 rows: the wgmma kernel's cluster_merge form
    (16, 4, [4100], 4, None),
    (128, 1, [3000, 1500, 17], 2, None),     # two row blocks a sequence, a row shorter than a tile a split
    (128, 2, [2000, 900], 5, 64),            # paged, 4 row blocks, 13 rows a CTA (the last merging 12)
    (64, 1, [1000, 0, 4100], 8, None),       # a row with no key; 8 rows a CTA
])
def test_cluster_merge(heads, q_len, seqlens, splits, block_size, monkeypatch, launches):
    """sm_90a: the splits of a row block as one cluster merging in shared memory (no workspace, no merge
    launch; the mma.sync kernels, and the wgmma kernel as its cluster_merge form), against fp32, and the merge
    launch with clusters off."""
    _sm90a_only()
    from attngen.families.mla_decode import choose, op

    monkeypatch.setattr(choose, "CLUSTER_MIN_FILL", 0.0)  # these few row blocks merge in clusters too
    monkeypatch.setattr(choose, "FAST_MEMORY_SHARE", 1.01)  # 32 rows on the mma.sync kernel on any GPU
    seen = _chosen(monkeypatch, "cluster_merge")
    run_case(seqlens, heads, q_len, block_size=block_size, num_splits=splits)
    assert launches == [("", splits)]
    assert seen[-1] == (MlaDecodeSpec.rows_for(heads, q_len) == 64)  # the wgmma kernel's cluster form
    del launches[:]
    monkeypatch.setattr(choose, "MERGE_CLUSTER_MAX", 0)
    run_case(seqlens, heads, q_len, block_size=block_size, num_splits=splits)
    assert launches == [("", 0), ("_merge_fine", 0)]
    assert not seen[-1]


def test_cluster_merge_by_default_where_row_blocks_fill_the_sms(launches):
    """Without pins: a cluster where the row blocks fill CLUSTER_MIN_FILL of the SMs (64 rows of 16
    heads, 2 splits: 64 clusters of 2, which an H100 holds at once), the merge launch where they do
    not (8 rows)."""
    _sm90a_only()
    run_case([300, 1500, 0, 64] * 16, 16, 1, num_splits=2)
    if torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count == 132:  # H100, H200
        assert launches == [("", 2)]
    del launches[:]
    run_case([300, 1500, 0, 64] * 2, 16, 1, num_splits=2)
    assert launches == [("", 0), ("_merge_fine", 0)]
    # 128 heads, batch 28 x 1k keys: 56 row blocks of the wgmma kernel, 2 splits, its cluster_merge form
    del launches[:]
    run_case([1024] * 27 + [700], 128, 1)
    if torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count == 132:
        assert launches == [("", 2)]



@pytest.mark.parametrize("heads,seqlens,splits,block_size,hinted", [
    (16, [8192], 64, None, True),       # one row block, the merge launch
    (64, [3000, 700], 8, 64, True),     # paged
    (32, [5000, 1, 0], 6, None, True),  # rows that end inside a tile or see no key
    (128, [8192], 16, None, True),      # two row blocks, 8 tiles a CTA: the sharded kernel
    (128, [8192], 4, None, False),      # 32 tiles a CTA: alternate tiles, plain loads
    (16, [8192], 1, None, False),       # no split
    (64, [4000, 4000], 2, None, False),  # fewer splits than EVICT_FIRST_MIN_SPLITS
])
def test_kv_lines_first_out_of_l2(heads, seqlens, splits, block_size, hinted, monkeypatch):
    """sm_90a: the TMA kernels other than alternate tiles load ckv and kpe as the first lines out of L2 where
    the merge launch reads back the partials of enough splits (``choose.kv_evict_first``), and nowhere else; the
    call matches fp32, and the hinted loads give the same bits as plain ones."""
    _sm90a_only()
    from attngen import runtime
    from attngen.families.mla_decode import choose, op

    monkeypatch.setattr(choose, "MERGE_CLUSTER_MAX", 0)  # the merge launch at any batch
    # MlaParams' last field, kv_evict_first, of each main-entry launch
    with runtime.recorded_launches(lambda one: None if one.entry else one.values[-1]) as flags:
        run_case(seqlens, heads, 1, block_size=block_size, num_splits=splits)
    assert flags == [int(hinted)]

    gen = fresh_generator()
    b, rank, rope = len(seqlens), 512, 64
    table = None
    if block_size is not None:
        per_row = -(-max(seqlens) // block_size)
        table = torch.randperm(b * per_row, device="cuda").to(torch.int32).reshape(b, per_row)
    ckv, _ = make_cache(seqlens, rank, torch.bfloat16, gen, block_size, table)
    kpe, _ = make_cache(seqlens, rope, torch.bfloat16, gen, block_size, table)
    q_nope = _randn((b, 1, heads, rank), torch.bfloat16, gen)
    q_pe = _randn((b, 1, heads, rope), torch.bfloat16, gen)
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    outs = []
    with runtime.recorded_launches(lambda one: None if one.entry else one.values[-1]) as flags:
        for on in (True, False):
            monkeypatch.setattr(choose, "kv_evict_first", lambda *a, on=on: on)
            outs.append(attngen.mla_decode(q_nope, q_pe, ckv, kpe, cache_seqlens=lens, block_table=table,
                                           sm_scale=0.1, num_splits=splits, return_lse=True))
    assert flags == [1, 0]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_bench_records_the_kernel_that_ran(monkeypatch):
    """``attngen bench mla`` records the spec of the kernel a call launched, after the op's per-call
    choices (here the 32-row rule), not the spec the call started from."""
    _sm90a_only()
    from attngen.bench.core import stream_reader
    from attngen.families.mla_decode import bench, choose

    monkeypatch.setattr(choose, "FAST_MEMORY_SHARE", 0.0)
    rec = bench.run_shape(8, 2048, 32, "bf16", ["attngen"], stream_reader(), warmup_ms=1, rep_ms=2, seed=0)
    assert rec["checks"]["attngen"]["ok"]
    assert "q_rows=64" in rec["specs"]["attngen"] and "mma=wgmma" in rec["specs"]["attngen"]
    monkeypatch.setattr(choose, "FAST_MEMORY_SHARE", 1.01)
    rec = bench.run_shape(8, 2048, 32, "bf16", ["attngen"], stream_reader(), warmup_ms=1, rep_ms=2, seed=0)
    assert "q_rows=32" in rec["specs"]["attngen"]
