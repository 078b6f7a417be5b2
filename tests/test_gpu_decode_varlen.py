"""attngen.decode with a packed, ragged q (cu_seqlens_q, max_q_len) and tree masks on a real GPU (pytest -m gpu),
against an fp32 reference computed request by request.

The caches are tests/test_gpu_decode.py's (every position a request must not read holds NaN). q is packed
[total_q, heads, head_dim]; each request's tokens are the last q_len_b of its cache. Outputs are poisoned with NaN
before each call: the rows of the requests the kernel must skip (no token, or more than max_q_len) must still be NaN
afterwards, every other row finite and within the 16-bit decode tests' tolerances.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_fp32_reference")]

torch = pytest.importorskip("torch")

import attngen  # noqa: E402
from attngen.families.decode import op  # noqa: E402
from tests.gpu_reference import _score_mods, fresh_generator  # noqa: E402
from tests.test_gpu_decode import LSE_MAX_ABS, MAX_ABS, NAN, TOL, Case, rel_l2  # noqa: E402

MAX_Q_LEN = 16
# (q_len, cache length) a request: none, one token, a few, the most, and one past max_q_len (skipped); lengths at
# tile boundaries and past them, one request whose cache is only its own tokens (no prefix), long ones for splits.
MIXED = [(0, 40), (1, 1), (1, 700), (2, 65), (5, 129), (8, 8), (16, 1000), (16, 16), (17, 300), (5, 2049),
         (0, 0), (3, 64)]
LAYOUTS = {"contiguous": None, "paged16": 16, "paged64": 64}


class Packed:
    """A packed, ragged batch: the cache (Case's, NaN where no request may read), q [total_q, heads, head_dim],
    cu_seqlens_q, and optionally tree-mask words (one python int a token)."""

    def __init__(self, reqs, *, heads, kv_heads, head_dim, dtype, block_size, fp8=None):
        self.reqs = reqs
        self.case = Case([n for _, n in reqs], heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                         block_size=block_size)
        # What the call reads (k, v and their scales) and what the reference reads (fp32; an fp8 cache dequantised).
        self.k, self.v, self.scales = self.case.k_cache, self.case.v_cache, {}
        self.k_ref, self.v_ref = self.case.k_cache, self.case.v_cache
        if fp8 is not None:
            fmt = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fp8]
            ks, vs = 0.25, 0.125  # |x| < ~5: |x / scale| < ~40, inside both formats' range; NaN stays NaN
            self.k, self.v = (self.case.k_cache.float() / ks).to(fmt), (self.case.v_cache.float() / vs).to(fmt)
            self.k_ref, self.v_ref = self.k.float() * ks, self.v.float() * vs
            self.scales = dict(k_scale=ks, v_scale=vs)
        gen = fresh_generator()
        self.seed = self.case.seed
        total = sum(q for q, _ in reqs)
        self.q = torch.randn(total, heads, head_dim, device="cuda", generator=gen).to(dtype)
        cu = [0]
        for q, _ in reqs:
            cu.append(cu[-1] + q)
        self.cu = cu
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device="cuda")
        self.words = None
        self.dtype = dtype

    def set_tree(self, words):
        """The tree-mask words (python ints, one a token) the call takes and the reference applies."""
        self.words = list(words)
        signed = [w - (1 << 64) if w >= (1 << 63) else w for w in self.words]
        self.tree_mask = torch.tensor(signed, dtype=torch.int64, device="cuda")

    def keys(self, b):
        """Request b's keys and values [L, kv_heads, head_dim] in fp32, read through its cache layout."""
        c, n = self.case, self.reqs[b][1]
        if c.block_table is None:
            return self.k_ref[b, :n].float(), self.v_ref[b, :n].float()
        bs = c.k_cache.shape[1]
        j = torch.arange(n, device="cuda")
        blk = c.block_table[b].long()[j // bs]
        return self.k_ref[blk, j % bs].float(), self.v_ref[blk, j % bs].float()

    def visible(self, b, max_q_len):
        """[q_len, L] bool: which keys each token of request b sees (causal, or the tree over the draft block)."""
        q_len, n = self.reqs[b]
        start = n - q_len
        j = torch.arange(n, device="cuda")
        if self.words is None:
            i = torch.arange(q_len, device="cuda")
            return j[None, :] <= start + i[:, None]
        rows = []
        for i in range(q_len):
            w = self.words[self.cu[b] + i]
            draft = torch.tensor([(w >> k) & 1 == 1 for k in range(q_len)], device="cuda")
            rows.append(torch.cat((torch.ones(start, dtype=torch.bool, device="cuda"), draft)))
        return torch.stack(rows)

    def reference(self, b, max_q_len, sm_scale, sinks=None, window_left=-1, pads=None, softcap=0.0, alibi=None):
        """Request b's (out [q_len, heads, d], LSE [heads, q_len]) in fp32; a token that sees nothing gives zeros and
        LSE -inf (with sinks: its sink). ``window_left``: a token at position i sees no key before i - window_left;
        ``pads``: each request's first key; ``softcap`` and ``alibi`` ([heads] slopes) as attngen.prefill's."""
        q_len, n = self.reqs[b]
        q = self.q[self.cu[b]:self.cu[b + 1]].float()  # [q_len, h, d]
        h = q.shape[1]
        k, v = self.keys(b)
        group = h // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", q, k) * sm_scale
        pos = torch.arange(n - q_len, n, device="cuda")[:, None]
        j = torch.arange(n, device="cuda")[None, :]
        s = _score_mods(s, softcap, alibi, pos - j)
        vis = self.visible(b, max_q_len)
        if window_left >= 0:
            vis = vis & (j >= pos - window_left)
        if pads is not None:
            vis = vis & (j >= pads[b])
        s = s.masked_fill(~vis[None], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # [h, q_len]
        if sinks is not None:
            lse_all = torch.logaddexp(lse, sinks[:, None].float().expand_as(lse))
        else:
            lse_all = lse
        p = torch.exp(s - lse_all[..., None]).nan_to_num(0.0)
        p = torch.where(torch.isinf(lse_all)[..., None], torch.zeros_like(p), p)
        out = torch.einsum("hij,jhd->ihd", p, v)
        return out, lse_all


def check(pk, o, lse, max_q_len, sm_scale, sinks=None, **ref):
    at = f"requests {pk.reqs}, seed {pk.seed}"
    assert o.shape == pk.q.shape and o.dtype == pk.dtype
    for b, (q_len, _) in enumerate(pk.reqs):
        rows = o[pk.cu[b]:pk.cu[b + 1]]
        if q_len == 0:
            continue
        if q_len > max_q_len:
            assert torch.isnan(rows).all(), f"request {b} ({q_len} tokens > max_q_len) was written; {at}"
            continue
        ref_o, ref_l = pk.reference(b, max_q_len, sm_scale, sinks, **ref)
        assert torch.isfinite(rows).all(), f"request {b}: unwritten (NaN) or non-finite outputs; {at}"
        err, mx = rel_l2(rows, ref_o), (rows.float() - ref_o).abs().max().item()
        assert err < TOL[pk.dtype] or ref_o.abs().max().item() == 0, f"request {b}: rel L2 {err:.3e}; {at}"
        assert mx < MAX_ABS[pk.dtype], f"request {b}: max abs error {mx:.3e}; {at}"
        empty = torch.isinf(ref_l).transpose(0, 1)  # [q_len, h]
        if empty.any():
            assert (rows[empty] == 0).all(), f"request {b}: a token that sees no key must give zeros; {at}"
        if lse is not None:
            got = lse[:, pk.cu[b]:pk.cu[b + 1]]
            fin = torch.isfinite(ref_l)
            assert torch.equal(torch.isfinite(got), fin), f"request {b}: LSE finite where the reference is not; {at}"
            assert (got[~fin] == ref_l[~fin]).all(), f"request {b}: LSE of a token that sees nothing; {at}"
            if fin.any():
                lerr = (got[fin] - ref_l[fin]).abs().max().item()
                assert lerr < LSE_MAX_ABS, f"request {b}: LSE max abs error {lerr:.3e}; {at}"


def run(pk, *, num_splits=0, max_q_len=MAX_Q_LEN, return_lse=True, use_out=True, cluster=True, tree=False,
        sinks=None, ref=None, **kw):
    """One call with a NaN-poisoned ``out`` (or, without, a poisoned allocator), then the check."""
    out = torch.full_like(pk.q, NAN)
    if not use_out:
        del out
        out = None
        torch.full_like(pk.q, NAN)  # the caching allocator hands this block back to decode's own out
    was = op.set_cluster_merge(op.CLUSTER_MAX if cluster else 0)
    try:
        res = attngen.decode(pk.q, pk.k, pk.v, **pk.case.kwargs(), cu_seqlens_q=pk.cu_seqlens_q, max_q_len=max_q_len,
                             tree_mask=pk.tree_mask if tree else None, num_splits=num_splits, return_lse=return_lse,
                             out=out, sinks=sinks, **pk.scales, **kw)
        torch.cuda.synchronize()
    finally:
        op.set_cluster_merge(was)
    o, lse = res if return_lse else (res, None)
    if use_out:
        assert o is out, "decode must return the out it was given"
    if lse is not None:
        assert lse.shape == (pk.q.shape[1], pk.q.shape[0]) and lse.dtype == torch.float32
    d = pk.q.shape[-1]
    check(pk, o, lse, max_q_len, kw.get("sm_scale") or d ** -0.5, sinks, **(ref or {}))


# (num_splits, cluster merge allowed): "four" merges in a cluster on sm_90 where the launch's rules take one
# (test_cluster_merge_is_taken makes sure of one), "four_launch" through the merge launch.
SPLITS = {"one": (1, True), "four": (4, True), "four_launch": (4, False), "auto": (0, True)}


@pytest.mark.parametrize("splits", list(SPLITS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa32_8", "mha8_8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_batch(layout, heads, d, dtype, splits):
    pk = Packed(MIXED, heads=heads[0], kv_heads=heads[1], head_dim=d, dtype=dtype, block_size=LAYOUTS[layout])
    num_splits, cluster = SPLITS[splits]
    run(pk, num_splits=num_splits, cluster=cluster)


def random_tree(n, gen):
    """Words of a random tree over n draft tokens: each token sees its ancestors and itself (token 0 a root; each
    later token's parent an earlier token)."""
    words = []
    for i in range(n):
        parent = int(torch.randint(-1, i, (1,), generator=gen).item()) if i else -1
        words.append((1 << i) | (words[parent] if parent >= 0 else 0))
    return words


TREE_REQS = [(1, 1), (5, 300), (8, 8), (16, 1000), (16, 129), (2, 65), (17, 400), (0, 30), (12, 2049)]


@pytest.mark.parametrize("splits", ["one", "four", "four_launch"])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)], ids=["gqa32_8", "mha8_8"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tree_masks(layout, heads, splits):
    pk = Packed(TREE_REQS, heads=heads[0], kv_heads=heads[1], head_dim=128, dtype=torch.bfloat16,
                block_size=LAYOUTS[layout])
    gen = torch.Generator()
    gen.manual_seed(pk.seed)
    words = []
    for b, (q_len, _) in enumerate(TREE_REQS):
        if b == 1:  # random bits, past q_len too (ignored), the sign bit included
            words += [int(torch.randint(0, 1 << 62, (1,), generator=gen).item()) * 3 + (1 << 63) for _ in range(q_len)]
        elif b == 2:  # no prefix: a token with an all-zero word sees nothing
            tree = random_tree(q_len, gen)
            tree[3] = 0
            words += tree
        elif b == 4:  # an all-zero word with a prefix: the prefix only
            tree = random_tree(q_len, gen)
            tree[0] = 0
            words += tree
        else:
            words += random_tree(q_len, gen)
    pk.set_tree([w % (1 << 64) for w in words])
    num_splits, cluster = SPLITS[splits]
    run(pk, num_splits=num_splits, cluster=cluster, tree=True)


@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_tree_fp16_d64_auto_splits(layout):
    pk = Packed(TREE_REQS, heads=32, kv_heads=8, head_dim=64, dtype=torch.float16, block_size=LAYOUTS[layout])
    gen = torch.Generator()
    gen.manual_seed(pk.seed)
    pk.set_tree([w for q_len, _ in TREE_REQS for w in random_tree(q_len, gen)])
    run(pk, tree=True)


@pytest.mark.parametrize("splits", ["one", "four_launch"])
def test_no_lse_and_own_allocation(splits):
    pk = Packed(MIXED, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    num_splits, cluster = SPLITS[splits]
    o = attngen.decode(pk.q, pk.case.k_cache, pk.case.v_cache, **pk.case.kwargs(), cu_seqlens_q=pk.cu_seqlens_q,
                       max_q_len=MAX_Q_LEN, num_splits=num_splits)
    torch.cuda.synchronize()
    assert o.shape == pk.q.shape
    for b, (q_len, _) in enumerate(pk.reqs):
        if 0 < q_len <= MAX_Q_LEN:
            ref_o, _ = pk.reference(b, MAX_Q_LEN, 128 ** -0.5)
            assert rel_l2(o[pk.cu[b]:pk.cu[b + 1]], ref_o) < TOL[pk.dtype], (b, pk.seed)
    run(pk, num_splits=num_splits, cluster=cluster, return_lse=False)


@pytest.mark.parametrize("splits", ["one", "four", "four_launch"])
def test_strided_out(splits):
    # out rows further apart than q's (a view into a wider buffer): any row stride.
    pk = Packed(MIXED, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=None)
    num_splits, cluster = SPLITS[splits]
    wide = torch.full((pk.q.shape[0], 40, 128), NAN, dtype=pk.dtype, device="cuda")
    out = wide[:, 4:36]
    was = op.set_cluster_merge(op.CLUSTER_MAX if cluster else 0)
    try:
        o, lse = attngen.decode(pk.q, pk.case.k_cache, pk.case.v_cache, **pk.case.kwargs(),
                                cu_seqlens_q=pk.cu_seqlens_q, max_q_len=MAX_Q_LEN, num_splits=num_splits, out=out,
                                return_lse=True)
        torch.cuda.synchronize()
    finally:
        op.set_cluster_merge(was)
    assert o is out
    assert torch.isnan(wide[:, :4]).all() and torch.isnan(wide[:, 36:]).all(), "written outside out"
    check(pk, o, lse, MAX_Q_LEN, 128 ** -0.5)


@pytest.mark.parametrize("max_q_len", [1, 4, 8])
def test_smaller_max_q_len_skips_longer_requests(max_q_len):
    pk = Packed(MIXED, heads=16, kv_heads=4, head_dim=128, dtype=torch.bfloat16, block_size=64)
    run(pk, max_q_len=max_q_len, num_splits=2, cluster=False)


@pytest.mark.parametrize("splits", ["one", "four", "four_launch"])
def test_sinks(splits):
    pk = Packed(MIXED, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    sinks = torch.randn(32, device="cuda")
    num_splits, cluster = SPLITS[splits]
    run(pk, num_splits=num_splits, cluster=cluster, sinks=sinks)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("heads", [(8, 8), (32, 8)], ids=["mha8_8", "gqa32_8"])
def test_few_requests_with_the_cluster_merge_allowed(heads, tree):
    # Few requests (few CTAs), four splits, the sm_90 cluster merge allowed (the host chooses it or the merge
    # launch): the rows past a request's tokens and the skipped requests' rows left alone either way.
    reqs = [(16, 3000), (5, 129), (0, 50), (17, 100), (1, 700)]
    pk = Packed(reqs, heads=heads[0], kv_heads=heads[1], head_dim=128, dtype=torch.bfloat16, block_size=None)
    gen = torch.Generator()
    gen.manual_seed(pk.seed)
    if tree:
        pk.set_tree([w for q_len, _ in reqs for w in random_tree(q_len, gen)])
    kw = {} if heads[0] == heads[1] else dict(spec="decode:cta_tile_kv=64,num_warps=8,num_stages=4")
    run(pk, num_splits=4, cluster=True, tree=tree, **kw)


@pytest.mark.parametrize("splits", ["one", "four_launch"])
def test_window_and_left_pads(splits):
    pk = Packed(MIXED, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    pads = [0, 0, 300, 10, 3, 0, 500, 2, 0, 1000, 0, 20]
    num_splits, cluster = SPLITS[splits]
    run(pk, num_splits=num_splits, cluster=cluster, window=(100, 0),
        cache_leftpad=torch.tensor(pads, dtype=torch.int32, device="cuda"), ref=dict(window_left=100, pads=pads))


@pytest.mark.parametrize("tree", [False, True])
def test_softcap_and_alibi(tree):
    pk = Packed(TREE_REQS, heads=32, kv_heads=8, head_dim=128, dtype=torch.float16, block_size=None)
    gen = torch.Generator()
    gen.manual_seed(pk.seed)
    if tree:
        pk.set_tree([w for q_len, _ in TREE_REQS for w in random_tree(q_len, gen)])
    slopes = torch.rand(32, device="cuda") * 0.05
    run(pk, num_splits=3, cluster=False, tree=tree, softcap=2.0, alibi_slopes=slopes,
        ref=dict(softcap=2.0, alibi=slopes))


@pytest.mark.parametrize("splits", ["one", "four_launch"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("layout", ["contiguous", "paged16"])
def test_fp8_cache(layout, tree, splits):
    # An e4m3 cache with a bf16 q against the dequantised cache (tests/test_gpu_fp8_decode.py's tolerances).
    pk = Packed(TREE_REQS, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=LAYOUTS[layout],
                fp8="e4m3")
    if tree:
        gen = torch.Generator()
        gen.manual_seed(pk.seed)
        pk.set_tree([w for q_len, _ in TREE_REQS for w in random_tree(q_len, gen)])
    num_splits, cluster = SPLITS[splits]
    run(pk, num_splits=num_splits, cluster=cluster, tree=tree)


def test_fp8_e5m2_fp16_paged64_auto_splits():
    pk = Packed(MIXED, heads=8, kv_heads=8, head_dim=64, dtype=torch.float16, block_size=64, fp8="e5m2")
    run(pk)


@pytest.mark.parametrize("splits", ["one", "four", "four_launch"])
@pytest.mark.parametrize("tree", [False, True])
def test_batch_order_longest_first(splits, tree):
    """The requests' CTAs in another order (longest cache first, as BatchAttention's plan sorts them) compute the
    same thing, in each split and merge."""
    pk = Packed(MIXED, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    if tree:
        gen = torch.Generator()
        gen.manual_seed(pk.seed)
        pk.set_tree([w for q_len, _ in MIXED for w in random_tree(q_len, gen)])
    lens = torch.tensor([n for _, n in pk.reqs], device="cuda")
    order = torch.argsort(lens, descending=True).to(torch.int32)
    num_splits, cluster = SPLITS[splits]
    run(pk, num_splits=num_splits, cluster=cluster, tree=tree, batch_order=order)


@pytest.mark.parametrize("splits", ["one", "four", "four_launch"])
@pytest.mark.parametrize("min_q_len", [2, 5])
def test_min_q_len_skips_shorter_requests_into_the_callers_lse(splits, min_q_len):
    """min_q_len (a serving step's second launch, its verify requests): a request of fewer tokens is not computed,
    its rows of out and of the caller's lse (given, NaN-poisoned) stay NaN, through the merge too; the others are
    the reference's, written into that lse."""
    pk = Packed(MIXED, heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, block_size=16)
    num_splits, cluster = SPLITS[splits]
    out = torch.full_like(pk.q, NAN)
    lse = torch.full((pk.q.shape[1], pk.q.shape[0]), NAN, device="cuda")
    was = op.set_cluster_merge(op.CLUSTER_MAX if cluster else 0)
    try:
        o, got = attngen.decode(pk.q, pk.k, pk.v, **pk.case.kwargs(), cu_seqlens_q=pk.cu_seqlens_q, max_q_len=8,
                                min_q_len=min_q_len, num_splits=num_splits, return_lse=True, out=out, lse=lse)
        torch.cuda.synchronize()
    finally:
        op.set_cluster_merge(was)
    assert o is out and got is lse
    for b, (q_len, _) in enumerate(pk.reqs):
        rows, cols = o[pk.cu[b]:pk.cu[b + 1]], lse[:, pk.cu[b]:pk.cu[b + 1]]
        if not min_q_len <= q_len <= 8:
            assert torch.isnan(rows).all() and torch.isnan(cols).all(), f"request {b} ({q_len} tokens) was written"
            continue
        ref_o, ref_l = pk.reference(b, 8, 128 ** -0.5)
        assert rel_l2(rows, ref_o) < TOL[pk.dtype], f"request {b}: rel L2 {rel_l2(rows, ref_o):.3e}"
        assert (rows.float() - ref_o).abs().max().item() < MAX_ABS[pk.dtype]
        assert (cols - ref_l).abs().max().item() < LSE_MAX_ABS, f"request {b}: LSE"
