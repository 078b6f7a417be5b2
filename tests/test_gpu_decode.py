"""attngen.decode on a real GPU against an fp32 reference (pytest -m gpu).

Fresh random inputs for every case, outputs poisoned with NaN before the launch, NaN never
passes. Every cache position a row must not read (past its length, cache rows no batch row
names, paged blocks no table entry reaches, table entries past a row's last block) holds
NaN, so a kernel that reads or multiplies such a value (even by a zero probability) fails:
loads past the length must be predicated off or zero-filled.
"""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from tests.gpu_reference import fresh_generator, reference_decode  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}        # relative L2 of out
MAX_ABS = {torch.bfloat16: 6e-2, torch.float16: 1e-2}    # max |out - ref|; |v| < ~5
LSE_MAX_ABS = 2e-2
NAN = float("nan")

# One batch of ragged lengths: 1 key, odd, tile boundaries +-1, long and not a multiple of anything.
RAGGED = [1, 17, 63, 64, 65, 127, 128, 129, 1000, 4097]
VARIANTS = ["fused", "unfused"]



def _rand(*shape, dtype, gen):
    return torch.randn(*shape, dtype=torch.float32, device="cuda", generator=gen).to(dtype)


def rel_l2(out, ref):
    out = out.float()
    return (torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30)).item()


class Case:
    """Inputs of one decode call: q, a poisoned cache (contiguous or paged) and the row lengths."""

    def __init__(self, lengths, *, q_len=1, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                 block_size=None, cache_batch_idx=None, cache_batch=None, pad=5, spare_blocks=3):
        gen = fresh_generator()
        self.seed = gen.initial_seed()   # named in failure messages, to replay a case
        self.lengths = [int(n) for n in lengths]
        b = len(self.lengths)
        self.dtype = dtype
        self.q = _rand(b, q_len, heads, head_dim, dtype=dtype, gen=gen)
        self.block_table = None
        self.cache_batch_idx = None
        shape_tail = (kv_heads, head_dim)
        if block_size is None:
            idx = list(range(b)) if cache_batch_idx is None else [int(i) for i in cache_batch_idx]
            rows = max(idx) + 1 if cache_batch is None else cache_batch
            max_len = max(self.lengths + [0]) + pad
            self.k_cache = torch.full((rows, max_len, *shape_tail), NAN, dtype=dtype, device="cuda")
            self.v_cache = torch.full_like(self.k_cache, NAN)
            # A cache row that several batch rows share holds keys up to the longest of them.
            need = {}
            for r, n in zip(idx, self.lengths):
                need[r] = max(need.get(r, 0), n)
            for r, n in need.items():
                self.k_cache[r, :n] = _rand(n, *shape_tail, dtype=dtype, gen=gen)
                self.v_cache[r, :n] = _rand(n, *shape_tail, dtype=dtype, gen=gen)
            if cache_batch_idx is not None:
                self.cache_batch_idx = torch.tensor(idx, dtype=torch.int32, device="cuda")
        else:
            bs = block_size
            nblk = [(n + bs - 1) // bs for n in self.lengths]
            num_blocks = sum(nblk) + spare_blocks
            max_blocks = max(nblk + [0]) + 1
            cpu_gen = torch.Generator()
            cpu_gen.manual_seed(self.seed)
            perm = torch.randperm(num_blocks, generator=cpu_gen).tolist()   # blocks scattered over the pool
            spare = perm[sum(nblk):]                                   # never written: all NaN
            self.k_cache = torch.full((num_blocks, bs, *shape_tail), NAN, dtype=dtype, device="cuda")
            self.v_cache = torch.full_like(self.k_cache, NAN)
            table = []
            at = 0
            for n, m in zip(self.lengths, nblk):
                own = perm[at:at + m]
                at += m
                # Entries past the row's last block point at a poisoned spare block.
                table.append(own + [spare[0] if spare else 0] * (max_blocks - m))
                if m:
                    blocks = torch.tensor(own, dtype=torch.long, device="cuda")
                    for cache in (self.k_cache, self.v_cache):
                        dense = torch.full((m * bs, *shape_tail), NAN, dtype=dtype, device="cuda")
                        dense[:n] = _rand(n, *shape_tail, dtype=dtype, gen=gen)
                        cache[blocks] = dense.view(m, bs, *shape_tail)
            self.block_table = torch.tensor(table, dtype=torch.int32, device="cuda")
        self.seqlens = torch.tensor(self.lengths, dtype=torch.int32, device="cuda")

    def kwargs(self, seqlens=None):
        kw = dict(cache_seqlens=self.seqlens if seqlens is None else seqlens)
        if self.cache_batch_idx is not None:
            kw["cache_batch_idx"] = self.cache_batch_idx
        if self.block_table is not None:
            kw["block_table"] = self.block_table
        return kw

    def reference(self, sm_scale=None):
        return reference_decode(self.q, self.k_cache, self.v_cache, self.seqlens,
                                cache_batch_idx=self.cache_batch_idx, block_table=self.block_table,
                                sm_scale=sm_scale)


def check(case, o, lse, *, sm_scale=None):
    """out (and lse, when given) against the fp32 reference."""
    b, ql, h, d = case.q.shape
    assert o.shape == (b, ql, h, d) and o.dtype == case.dtype
    ref_o, ref_l = case.reference(sm_scale)
    at = f"lengths {case.lengths}, seed {case.seed}"
    assert torch.isfinite(o).all(), (f"{int((~torch.isfinite(o)).sum())} unwritten (NaN) or non-finite outputs; {at}")
    err = rel_l2(o, ref_o)
    mx = (o.float() - ref_o).abs().max().item()
    assert err < TOL[case.dtype], f"rel L2 error {err:.3e} (max abs {mx:.3e}); {at}"
    assert mx < MAX_ABS[case.dtype], f"max abs error {mx:.3e} (rel L2 {err:.3e}); {at}"
    # Queries that see no key (L = 0, or position L - q_len + i < 0) are exactly zero.
    empty = torch.isinf(ref_l).transpose(1, 2)  # [b, q_len, h]
    if empty.any():
        assert (o[empty] == 0).all(), f"a query that sees no key must give zeros; {at}"
    if lse is not None:
        assert lse.shape == (b, h, ql) and lse.dtype == torch.float32
        assert not torch.isnan(lse).any(), f"NaN in the LSE; {at}"
        fin = torch.isfinite(ref_l)
        assert torch.equal(torch.isfinite(lse), fin), f"LSE finite where the reference is -inf, or the reverse; {at}"
        assert (lse[~fin] == float("-inf")).all()
        if fin.any():
            lerr = (lse[fin] - ref_l[fin]).abs().max().item()
            assert lerr < LSE_MAX_ABS, f"LSE max abs error {lerr:.3e}; {at}"
    return err


def run(case, *, variant="auto", num_splits=0, return_lse=True, sm_scale=None, use_out=True, seqlens=None):
    """One call with a NaN-poisoned ``out`` (or, without, a poisoned allocator), then the check."""
    if use_out:
        out = torch.full_like(case.q, NAN)
    else:
        out = None
        # The caching allocator hands this NaN block back to decode's own allocation of the same size.
        torch.full_like(case.q, NAN)
    res = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(seqlens), num_splits=num_splits,
                         sm_scale=sm_scale, return_lse=return_lse, out=out, variant=variant)
    torch.cuda.synchronize()
    o, lse = res if return_lse else (res, None)
    if use_out:
        assert o is out, "decode must return the out it was given"
    assert isinstance(o, torch.Tensor)
    return check(case, o, lse, sm_scale=sm_scale)


# --- contiguous cache -------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["auto"] + VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("q_len", [1, 4])
def test_contiguous_ragged(variant, dtype, d, q_len):
    run(Case(RAGGED, q_len=q_len, heads=8, kv_heads=2, head_dim=d, dtype=dtype), variant=variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
def test_q_len_with_short_rows(variant, q_len):
    # Rows shorter than q_len: the first q_len - L queries see nothing; L = 0 sees nothing at all.
    lengths = [0, 1, 2, 3, 7, 8, 9, 100, 129, 1000]
    run(Case(lengths, q_len=q_len, heads=8, kv_heads=4, head_dim=128, dtype=torch.float16), variant=variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("q_len", [1, 8])
def test_gqa_groups(variant, group, q_len):
    # group 16 with q_len 8: 128 query rows packed per KV head.
    kv_heads = 2
    run(Case([1, 65, 300, 1000, 4097], q_len=q_len, heads=group * kv_heads, kv_heads=kv_heads, head_dim=128,
             dtype=torch.bfloat16), variant=variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("num_splits", [0, 1, 2, 3, 7, 64])
def test_num_splits(variant, num_splits):
    # 64 splits on rows of 1 or 17 keys: most splits are empty and the merge must ignore them.
    run(Case([1, 17, 129, 1000, 4097], q_len=2, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16),
        variant=variant, num_splits=num_splits)


@pytest.mark.parametrize("d", [64, 256])
def test_many_splits_every_head_dim(d):
    run(Case([5, 300, 2049], q_len=3, heads=4, kv_heads=4, head_dim=d, dtype=torch.float16), num_splits=7)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group,q_len", [(1, 1), (4, 2), (16, 8)], ids=["g1q1", "g4q2", "g16q8"])
def test_cluster_merge(d, group, q_len, paged):
    # sm_90: the splits of a row run as one cluster and merge in shared memory (no workspace, no merge
    # launch). Both ways against the reference and against each other, with rows of no key and rows
    # whose late splits get no tile, contiguous and paged. Clusters need a ring of 4 stages, one CTA
    # an SM (cluster_limit): the default at head_dim 128 (4 stages of 64 keys pinned at 16 paged rows, where the
    # default takes 3: TUNED_PLAIN), 4 stages of 128 keys at 64.
    from attngen.families.decode import op

    # 8 rows x 8 KV heads: enough CTAs that the clusters are taken (cluster_limit) with every kernel here,
    # paged too (64 clusters of 2 fill 90% of an H100's SMs)
    case = Case([0, 1, 17, 129, 1000, 4097, 300, 2000], q_len=q_len, heads=group * 8, kv_heads=8, head_dim=d,
                dtype=torch.bfloat16, block_size=48 if paged else None)
    spec = (attngen.DecodeSpec(cta_tile_kv=128, num_warps=8, num_stages=4) if d == 64 else
            attngen.DecodeSpec(cta_tile_kv=64, num_warps=4, num_stages=4) if paged and group * q_len <= 16 else None)
    got = {}
    for cluster in (True, False):
        was = op.set_cluster_merge(op.CLUSTER_MAX if cluster else 0)
        try:
            for splits in (2, 5, 8, 9):
                out = torch.full_like(case.q, NAN)
                o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=splits,
                                        out=out, return_lse=True, spec=spec)
                torch.cuda.synchronize()
                check(case, o, lse)
                got[cluster, splits] = (o.float(), lse)
            calls = list(op._calls.values())
        finally:
            op.set_cluster_merge(was)
        if torch.cuda.get_device_capability() == (9, 0):
            for c in calls:
                fits = c.grid[0] <= op.cluster_limit(c.kern, c.grid[1] * c.grid[2])
                assert bool(c.cluster) == (cluster and fits), (cluster, fits, c.cluster)
            assert not cluster or any(c.cluster for c in calls), "no call here took the cluster merge"
    for splits in (2, 5, 8, 9):
        (o1, l1), (o2, l2) = got[True, splits], got[False, splits]
        assert (o1 - o2).abs().max().item() < 2e-2, splits  # the same partials, merged in another order
        fin = torch.isfinite(l2)
        assert torch.equal(torch.isfinite(l1), fin) and (l1[fin] - l2[fin]).abs().max().item() < 1e-4


@pytest.mark.parametrize("n", [1000, 32768])
def test_cluster_merge_is_taken(n):
    # The default kernel at head_dim 128 (one CTA an SM) at batch 1 with 8 KV heads: with a 1k cache the splits
    # merge in clusters on sm_90; with a 32k cache too where the memory is served at full rate by the cluster's 64
    # CTAs (an H100), not where the merge launch's more splits read faster (an H200: op.grid_steps); elsewhere
    # always the merge launch. Right every way.
    from attngen.families import split_kv
    from attngen.families.decode import op

    case = Case([n], heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    op.set_cluster_merge(op.CLUSTER_MAX)  # calls worked out afresh
    run(case)
    (c,) = [c for c in op._calls.values() if c.grid and c.grid[1:] == (8, 1)]
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    assert 1 < c.grid[0], c.grid
    if n == 1000 or not sm90:
        assert bool(c.cluster) == sm90, (c.grid, c.cluster)
    elif split_kv.saturating_share(0) > 0.6:
        assert not c.cluster and c.grid[0] > op.CLUSTER_MAX, (c.grid, c.cluster)


@pytest.mark.parametrize("batch,kv_heads,q_len", [(4, 8, 1), (8, 4, 4), (2, 8, 4), (20, 8, 1)])
def test_cluster_grid_in_one_wave(batch, kv_heads, q_len):
    # A cluster merge is taken only with a size whose clusters (one a row and KV head) are all resident at
    # once: 32 clusters of 4 (an H100 holds 30) ran the last ones as a second wave, 1.3-1.45x slower than
    # the merge launch. Whatever size is taken, the output is right.
    from attngen.families.decode import op

    op.set_cluster_merge(op.CLUSTER_MAX)
    case = Case([8192 - 37 * i for i in range(batch)], q_len=q_len, heads=32, kv_heads=kv_heads, head_dim=128,
                dtype=torch.bfloat16)
    run(case)
    (c,) = [c for c in op._calls.values() if c.grid and c.grid[1:] == (kv_heads, batch)]
    if c.cluster:
        assert c.kern.max_clusters(c.cluster) >= batch * kv_heads, (c.grid, c.cluster)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("cfg", [None, (64, 8, 3)], ids=["default", "kv64-w8-st3"])
def test_many_packed_rows(paged, cfg):
    # 64 packed rows a KV head (GQA 16 x q_len 4): the fused default takes 64x8x3 where it fits (TUNED_ROWS; two
    # warps across each tile's keys); ragged rows, some shorter than q_len or a tile, fused and unfused.
    from attngen.families.decode import op

    spec = None if cfg is None else attngen.DecodeSpec(cta_tile_kv=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    case = Case([1, 17, 700, 5000], q_len=4, heads=32, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                block_size=64 if paged else None)
    op._calls.clear()
    for variant in ("fused", "unfused"):
        out = torch.full_like(case.q, NAN)
        o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), out=out, return_lse=True,
                                spec=spec, variant=variant)
        torch.cuda.synchronize()
        check(case, o, lse)
    c = [c for c in op._calls.values() if c.grid and not c.unfused][0]
    rs = c.kern.spec
    assert rs.q_rows == 64
    if cfg is None and torch.cuda.get_device_capability() in ((9, 0), (8, 0), (10, 0)):
        assert (rs.cta_tile_kv, rs.num_warps, rs.num_stages) == (64, 8, 3), rs


# --- tile configs: every ring depth, tile and warp grid, not only the defaults ------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("cfg", [(128, 4, 1), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 8, 3), (128, 4, 3)],
                         ids=lambda c: "kv%d-w%d-st%d" % c)
def test_tile_configs(variant, paged, cfg):
    # Rows shorter than the ring, rows of one tile plus one key, and long rows; some splits get no tiles.
    spec = attngen.DecodeSpec(cta_tile_kv=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
    case = Case([1, 33, 129, 700, 5000], q_len=2, heads=16, kv_heads=4, head_dim=128, dtype=torch.bfloat16,
                block_size=32 if paged else None)
    for splits in (1, 3):
        out = torch.full_like(case.q, NAN)
        o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=splits,
                                variant=variant, spec=spec, out=out, return_lse=True)
        torch.cuda.synchronize()
        check(case, o, lse)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_stage_empty_splits(variant):
    # Short rows and 64 splits: most CTAs get no tile, so with one stage their Q copy is the only one in
    # flight when the epilogue reuses its shared memory. Repeated: a missed wait shows only sometimes.
    spec = attngen.DecodeSpec(cta_tile_kv=128, num_warps=4, num_stages=1)
    case = Case([1, 2, 33, 129] * 8, q_len=2, heads=16, kv_heads=4, head_dim=128, dtype=torch.bfloat16)
    for _ in range(5):
        out = torch.full_like(case.q, NAN)
        o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=64, variant=variant,
                                spec=spec, out=out, return_lse=True)
        torch.cuda.synchronize()
        check(case, o, lse)


# --- cache_batch_idx --------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["permutation", "repeated"])
def test_cache_batch_idx(variant, kind):
    lengths = [1, 65, 1000, 129, 4097, 17]
    if kind == "permutation":
        idx = [9, 2, 0, 7, 4, 5]            # cache of 10 rows, 4 of them never read (all NaN)
    else:
        idx = [3, 3, 0, 3, 8, 0]            # rows shared by several batch rows of different lengths
    case = Case(lengths, q_len=2, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                cache_batch_idx=idx, cache_batch=10)
    assert case.k_cache.shape[0] == 10 > len(lengths)
    run(case, variant=variant)


# --- paged cache ------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("q_len", [1, 4])
def test_paged(variant, block_size, q_len):
    run(Case(RAGGED, q_len=q_len, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16, block_size=block_size),
        variant=variant)


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_paged_head_dims(d, dtype):
    run(Case([3, 64, 65, 700, 2000], q_len=2, heads=16, kv_heads=2, head_dim=d, dtype=dtype, block_size=64))


@pytest.mark.parametrize("stages", [1, 2, 3])
@pytest.mark.parametrize("block_size", [16, 48, 64, 256])
def test_paged_head_dim_256_stepped_copies(stages, block_size):
    # Four warps at head_dim 256: each thread copies four rows of a 16-row group, stepping from the group's
    # first row (load_rows); every ring depth that fits, blocks of one group and of many, rows ending inside
    # a group, splits with no tile.
    spec = attngen.DecodeSpec(cta_tile_kv=64, num_warps=4, num_stages=stages, paged=True)
    case = Case([1, 17, 64, 65, 700, 2001], q_len=2, heads=16, kv_heads=2, head_dim=256, dtype=torch.bfloat16,
                block_size=block_size)
    for splits in (1, 5):
        out = torch.full_like(case.q, NAN)
        o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=splits, spec=spec,
                                out=out, return_lse=True)
        torch.cuda.synchronize()
        check(case, o, lse)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_paged_splits_and_short_rows(num_splits):
    run(Case([0, 1, 2, 16, 17, 255, 257, 3000], q_len=4, heads=32, kv_heads=4, head_dim=128,
             dtype=torch.bfloat16, block_size=16), num_splits=num_splits)


def test_paged_python_int_seqlens():
    case = Case([777] * 3, q_len=4, heads=8, kv_heads=1, head_dim=128, dtype=torch.bfloat16, block_size=256)
    run(case, seqlens=777)


# --- other arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_python_int_seqlens(variant):
    case = Case([513] * 4, q_len=3, heads=8, kv_heads=2, head_dim=64, dtype=torch.float16)
    run(case, variant=variant, seqlens=513)


@pytest.mark.parametrize("variant", ["auto"] + VARIANTS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_all_lengths_zero(variant, paged):
    case = Case([0, 0, 0], q_len=2, heads=4, kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                block_size=64 if paged else None)
    out = torch.full_like(case.q, NAN)
    o, lse = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), return_lse=True, out=out,
                            variant=variant)
    torch.cuda.synchronize()
    assert o is out and (o == 0).all()
    assert (lse == float("-inf")).all()
    o = attngen.decode(case.q, case.k_cache, case.v_cache, cache_seqlens=0, variant=variant,
                       block_table=case.block_table)
    torch.cuda.synchronize()
    assert (o == 0).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_returned_tensor_without_out_and_lse(variant):
    run(Case([1, 100, 1025], q_len=1, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16),
        variant=variant, return_lse=False, use_out=False)


def test_sm_scale():
    run(Case([1, 100, 1025], q_len=2, heads=8, kv_heads=2, head_dim=128, dtype=torch.float16), sm_scale=0.3)


def test_deterministic_with_fixed_splits():
    case = Case([1000, 4097], q_len=1, heads=8, kv_heads=2, head_dim=128, dtype=torch.bfloat16)
    a = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=5)
    b = attngen.decode(case.q, case.k_cache, case.v_cache, **case.kwargs(), num_splits=5)
    assert torch.equal(a, b)


def test_runs_on_callers_stream():
    case = Case([1, 300, 4097], q_len=2, heads=8, kv_heads=2, head_dim=128, dtype=torch.float16)
    q_late = torch.full_like(case.q, NAN)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        # q becomes valid only after a long sleep on s: a launch on any other stream reads NaN.
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(100_000_000)
        q_late.copy_(case.q)
        out = torch.full_like(case.q, NAN)
        o, lse = attngen.decode(q_late, case.k_cache, case.v_cache, **case.kwargs(), out=out, return_lse=True)
        o_snap, lse_snap = o.clone(), lse.clone()   # ordered after the kernel on the same stream
    s.synchronize()
    torch.cuda.synchronize()
    check(case, o_snap, lse_snap)


def test_cupy_arrays():
    cp = pytest.importorskip("cupy")
    case = Case([1, 129, 1000], q_len=2, heads=8, kv_heads=2, head_dim=64, dtype=torch.float16, block_size=64)
    torch.cuda.synchronize()
    cq, ck, cv = (cp.asarray(t) for t in (case.q, case.k_cache, case.v_cache))
    bt, sl = cp.asarray(case.block_table), cp.asarray(case.seqlens)
    out = cp.full(cq.shape, cp.nan, dtype=cp.float16)
    o, lse = attngen.decode(cq, ck, cv, cache_seqlens=sl, block_table=bt, return_lse=True, out=out)
    cp.cuda.get_current_stream().synchronize()
    assert isinstance(o, cp.ndarray) and isinstance(lse, cp.ndarray)
    assert o is out
    check(case, torch.as_tensor(o, device="cuda"), torch.as_tensor(lse, device="cuda"))


# --- bad inputs -------------------------------------------------------------------------------------

BAD = {
    # name: (what to change, words of which the message must contain one)
    "q_len_9": ("q_len", "seqlen_q", "query length"),
    "head_dim_300": ("head_dim",),
    "heads_not_multiple": ("kv_heads",),
    "group_over_128": ("group", "128"),
    "dtype_mismatch": ("dtype",),
    "seqlens_shape": ("cache_seqlens",),
    "seqlens_dtype": ("cache_seqlens",),
    "idx_with_table": ("cache_batch_idx",),
    "table_dtype": ("block_table",),
    "q_rank": ("q",),
    "q_on_cpu": ("q",),
    "out_dtype": ("out",),
}


@pytest.mark.parametrize("bad", sorted(BAD))
def test_bad_inputs_raise_launch_error(bad):
    b, hk, d = 2, 2, 64
    ql, h, bs = 1, 4, None
    if bad == "q_len_9":
        ql = 9
    elif bad == "head_dim_300":  # (every head dim up to 256 runs, padded where no kernel is built for it)
        d = 300
    elif bad == "heads_not_multiple":
        h = 3
    elif bad == "group_over_128":
        h, hk = 258, 2
    elif bad in ("idx_with_table", "table_dtype"):
        bs = 16
    q = torch.randn(b, ql, h, d, device="cuda", dtype=torch.float16)
    if bs is None:
        k = torch.randn(b, 64, hk, d, device="cuda", dtype=torch.float16)
    else:
        k = torch.randn(8, bs, hk, d, device="cuda", dtype=torch.float16)
    v = k.clone()
    kw = dict(cache_seqlens=torch.tensor([10, 20], dtype=torch.int32, device="cuda"))
    if bs is not None:
        kw["block_table"] = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device="cuda")
    if bad == "dtype_mismatch":
        k = k.to(torch.bfloat16)
    elif bad == "seqlens_shape":
        kw["cache_seqlens"] = torch.tensor([10, 20, 30], dtype=torch.int32, device="cuda")
    elif bad == "seqlens_dtype":
        kw["cache_seqlens"] = torch.tensor([10, 20], dtype=torch.float32, device="cuda")
    elif bad == "idx_with_table":
        kw["cache_batch_idx"] = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    elif bad == "table_dtype":
        kw["block_table"] = kw["block_table"].to(torch.float32)
    elif bad == "q_rank":
        q = q[:, 0]
    elif bad == "q_on_cpu":
        q = q.cpu()
    elif bad == "out_dtype":
        kw["out"] = torch.empty(b, ql, h, d, device="cuda", dtype=torch.float32)
    with pytest.raises(attngen.LaunchError) as ei:
        attngen.decode(q, k, v, **kw)
    msg = str(ei.value).lower()
    words = BAD[bad]
    assert any(w.lower() in msg for w in words), f"message {str(ei.value)!r} names none of {words}"
    assert isinstance(ei.value, attngen.AttngenError)


def test_reference_is_finite_on_poisoned_cache():
    # The harness itself: the poison sits where the reference (and a correct kernel) never reads.
    case = Case([1, 65, 300], q_len=4, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16, block_size=16)
    assert torch.isnan(case.k_cache).any() and torch.isnan(case.v_cache).any()
    o, lse = case.reference()
    assert torch.isfinite(o).all() and not torch.isnan(lse).any()
    assert math.isinf(lse[0, 0, 0].item())   # L=1 with q_len 4: query 0 sees nothing
