"""Where a decode call's time goes: attngen's decode with its default config and with other
tile configs (automatic split count), against a plain streaming read of the same K/V bytes and
SDPA's cuDNN backend, all timed as ``attngen bench decode --rotate`` does (one CUDA graph of
back-to-back calls over their own K/V copies, no L2 flush).

The streaming read is one kernel that loads every byte of K and V once with 16-byte loads over
the whole GPU: about what any decode of one launch could do on these bytes.

    PYTHONPATH=. python3 tools/probe_decode.py --out OUT/probe.json [--configs] [--label new] [--paged 64]

``--paged BS`` times attngen on a paged copy of each cache (blocks of BS positions in a shuffled
table); the bare read and cuDNN still read the contiguous bytes, the same count. ``rows_read`` is a bare
read in decode's shape (each CTA one kv head's rows of a range of positions), ``rows_read_paged`` the same
through the paged copy's table: their ratio is what paging costs the memory system itself.
``rows_cluster`` and ``rows_last`` (contiguous caches) add to that read the cheapest combine of a row's
splits, through a cluster's shared memory or the last CTA of the row: the floor of any split decode.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attngen  # noqa: E402
from attngen.bench import _event_bench, _graphed, _rel_check, environment  # noqa: E402
from attngen.bench.core import measure_copy_bandwidth, stream_reader  # noqa: E402
from attngen.families.decode import op as decode_op  # noqa: E402
from attngen.families.decode.bench import decode_reference, paged_copy, rotate_copies  # noqa: E402

# A bare read in decode's shape: CTA (split, batch x kv head) loads its positions' K and V rows of one head,
# rows of ROW_CHUNKS 16-byte pieces, 32 rows a pass of 512 threads; through a block table where one is given
# (position p of row b in physical row table[b, p / block_size] * block_size + p % block_size), else in place.
# What reading a paged cache costs the memory system alone, apart from any decode kernel.
#
# The floor of a split-KV decode: the same read of a contiguous cache, then the splits of each (batch, kv head)
# combined into one value written to global memory, with no queries, no math and no output rows. rows_cluster:
# 8 splits a row, one cluster of 8 CTAs, combined through distributed shared memory after a cluster barrier
# (decode's cluster merge). rows_last: any split count, each CTA writes its value and counts itself on an atomic
# counter; the last CTA of a row combines the row's values and resets the counter (the cheapest combine through
# global memory, one launch). What any decode of that grid must at least take beyond a bare read.
_ROWS_SRC = r"""
// This thread's share of the read of split `split` of (b, h)'s positions, folded into one word.
__device__ __forceinline__ unsigned rows_xor(const uint4* k, const uint4* v, const int* table, int table_stride,
                                             int block_size, int seqlen, int kv_heads, int row_chunks, int b,
                                             int h, int split, int splits) {
  const int per = (seqlen + splits - 1) / splits;
  const int p0 = split * per, p1 = min(seqlen, p0 + per);
  const int rows = blockDim.x / row_chunks, c = threadIdx.x % row_chunks;
  unsigned x = 0;
#pragma unroll 4
  for (int p = p0 + threadIdx.x / row_chunks; p < p1; p += rows) {
    const long long at = table ? (long long)table[(long long)b * table_stride + p / block_size] * block_size
                                     + p % block_size
                               : (long long)b * seqlen + p;
    const long long off = (at * kv_heads + h) * row_chunks + c;
    const uint4 a = __ldcs(k + off), e = __ldcs(v + off);
    x ^= a.x ^ a.y ^ a.z ^ a.w ^ e.x ^ e.y ^ e.z ^ e.w;
  }
  return x;
}

extern "C" __global__ void rows_read(const uint4* k, const uint4* v, const int* table, int table_stride,
                                     int block_size, int seqlen, int kv_heads, int row_chunks, int splits,
                                     unsigned* sink) {
  const int bh = blockIdx.y, b = bh / kv_heads, h = bh % kv_heads;
  const unsigned x = rows_xor(k, v, table, table_stride, block_size, seqlen, kv_heads, row_chunks, b, h,
                              blockIdx.x, splits);
  if (x == 0x9e3779b9u) sink[0] = x;  // keeps the loads; practically never true
}

// The CTA's words folded into one, which every thread returns.
__device__ __forceinline__ unsigned cta_xor(unsigned x) {
  for (int o = 16; o; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
  __shared__ unsigned warp_x[32];
  if (threadIdx.x % 32 == 0) warp_x[threadIdx.x / 32] = x;
  __syncthreads();
  x = 0;
  for (int w = 0; w < blockDim.x / 32; ++w) x ^= warp_x[w];
  return x;
}

extern "C" __global__ void __cluster_dims__(8, 1, 1)
rows_cluster(const uint4* k, const uint4* v, int seqlen, int kv_heads, int row_chunks, unsigned* out) {
  const int bh = blockIdx.y, b = bh / kv_heads, h = bh % kv_heads;
  __shared__ unsigned mine;
  const unsigned x = cta_xor(rows_xor(k, v, nullptr, 0, 1, seqlen, kv_heads, row_chunks, b, h, blockIdx.x, 8));
  if (threadIdx.x == 0) mine = x;
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
  if (blockIdx.x == 0 && threadIdx.x < 8) {
    unsigned local = (unsigned)__cvta_generic_to_shared(&mine), remote, y;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"((int)threadIdx.x));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(y) : "r"(remote) : "memory");
    for (int o = 4; o; o >>= 1) y ^= __shfl_xor_sync(0xffu, y, o);
    if (threadIdx.x == 0) out[bh] = y;
  }
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

extern "C" __global__ void rows_last(const uint4* k, const uint4* v, int seqlen, int kv_heads, int row_chunks,
                                     unsigned* part, unsigned* count, unsigned* out) {
  const int bh = blockIdx.y, b = bh / kv_heads, h = bh % kv_heads, splits = gridDim.x;
  const unsigned x = cta_xor(rows_xor(k, v, nullptr, 0, 1, seqlen, kv_heads, row_chunks, b, h, blockIdx.x,
                                      splits));
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part[(long long)bh * splits + blockIdx.x] = x;
    __threadfence();
    last = atomicAdd(count + bh, 1u) == (unsigned)splits - 1;
  }
  __syncthreads();
  if (last) {
    __threadfence();
    unsigned y = 0;
    for (int s = threadIdx.x; s < splits; s += blockDim.x) y ^= __ldcg(part + (long long)bh * splits + s);
    for (int o = 16; o; o >>= 1) y ^= __shfl_xor_sync(0xffffffffu, y, o);
    if (threadIdx.x == 0) count[bh] = 0;
    if (threadIdx.x % 32 == 0) atomicXor(out + bh, y);
  }
}
"""


@functools.lru_cache(maxsize=None)
def _rows_module():
    """The three kernels above, compiled once; with the SM count."""
    import cupy as cp
    import torch

    mod = cp.RawModule(code=_ROWS_SRC, options=("-std=c++17",))
    return mod, torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _rows_splits(sms: int, batch: int, kv_heads: int, seqlen: int) -> int:
    """The split count of the rows reads: about 4 CTAs an SM, 32 positions a CTA at least."""
    return max(1, min(-(-4 * sms // (batch * kv_heads)), -(-seqlen // 32)))


def rows_reader():
    """``read(k, v, seqlen, table=None)``: the rows read above on torch's current stream, k and v
    ``[batch, seqlen, kv_heads, head_dim]`` or paged ``[blocks, block_size, kv_heads, head_dim]``, with
    about 4 CTAs an SM."""
    import cupy as cp
    import torch

    mod, sms = _rows_module()
    kern = mod.get_function("rows_read")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")

    def read(k, v, batch, seqlen, table=None):
        hk, d = k.shape[2], k.shape[3]
        splits = _rows_splits(sms, batch, hk, seqlen)
        paged = table is not None
        # (pointers as Python ints, as stream_reader passes them; the int parameters as int32)
        ints = (table.stride(0) if paged else 0, k.shape[1] if paged else 1, seqlen, hk, d * k.element_size() // 16,
                splits)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            kern((splits, batch * hk), (512,), (k.data_ptr(), v.data_ptr(), table.data_ptr() if paged else 0,
                                                *map(cp.int32, ints), sink.data_ptr()))
    return read


def floor_readers():
    """``(cluster(k, v, batch, seqlen), last(k, v, batch, seqlen, splits=0))``: the rows read of a
    contiguous cache with the two combines above on torch's current stream (``splits`` 0: rows_read's
    count, about 4 CTAs an SM; 1024 threads a CTA in clusters of 8, 512 otherwise)."""
    import cupy as cp
    import torch

    mod, sms = _rows_module()
    k_cluster, k_last = mod.get_function("rows_cluster"), mod.get_function("rows_last")
    scratch = {}

    def buffers(rows, splits):
        if scratch.get("shape", (0, 0))[0] < rows or scratch["shape"][1] < splits:
            scratch["shape"] = (rows, splits)
            scratch["part"] = torch.zeros(rows * splits, dtype=torch.int32, device="cuda")
            scratch["count"] = torch.zeros(rows, dtype=torch.int32, device="cuda")
            scratch["out"] = torch.zeros(rows, dtype=torch.int32, device="cuda")
        return scratch["part"].data_ptr(), scratch["count"].data_ptr(), scratch["out"].data_ptr()

    def shape_args(k, seqlen):
        hk, d = k.shape[2], k.shape[3]
        return hk, (cp.int32(seqlen), cp.int32(hk), cp.int32(d * k.element_size() // 16))

    def cluster(k, v, batch, seqlen):
        hk, ints = shape_args(k, seqlen)
        _, _, out = buffers(batch * hk, 1)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            k_cluster((8, batch * hk), (1024,), (k.data_ptr(), v.data_ptr(), *ints, out))

    def last(k, v, batch, seqlen, splits=0):
        hk, ints = shape_args(k, seqlen)
        splits = splits or _rows_splits(sms, batch, hk, seqlen)
        part, count, out = buffers(batch * hk, splits)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            k_last((splits, batch * hk), (512,), (k.data_ptr(), v.data_ptr(), *ints, part, count, out))
    return cluster, last


# (batch, kv_len, heads, kv_heads), bf16, q_len 1 (head_dim 128 unless --head-dim)
SHAPES = [(1, 32768, 32, 8), (1, 32768, 32, 4), (1, 32768, 64, 8), (1, 8192, 32, 8), (16, 4096, 32, 4),
          (16, 4096, 32, 8), (16, 1024, 32, 8), (64, 8192, 32, 8)]
# --merges: the default kernel with each merge of a split decode forced, as attngen.families.decode.op's
# set_cluster_merge: the merge launch; a cluster on sm_90 wherever one fits (else the launch)
MERGES = {"launch": 0, "cluster": 8}
# (cta_tile_kv, num_warps, num_stages) tried with --configs
CONFIGS = [(128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 8, 2), (128, 8, 3), (128, 4, 1),
           (32, 8, 2), (32, 4, 3), (64, 4, 1)]


def _shapes(text):
    try:
        return [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BxLxHxHK[,...] (e.g. 1x4096x32x8)") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", default="", help="names this tree in the output")
    ap.add_argument("--configs", action="store_true", help="also time every config in CONFIGS")
    ap.add_argument("--merges", action="store_true", help="also time the default kernel with each merge in MERGES")
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--head-dim", type=int, default=128, choices=attngen.DecodeSpec.HEAD_DIMS)
    ap.add_argument("--paged", type=int, default=0, metavar="BS", help="attngen reads a paged cache of BS-position blocks")
    ap.add_argument("--shapes", type=_shapes, default=SHAPES, help="BxLxHxHK,... (default: the eight above)")
    args = ap.parse_args()

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    stream_read = stream_reader()
    rows_read = rows_reader()
    rows_cluster, rows_last = floor_readers()

    copy = measure_copy_bandwidth()
    rows = []
    for b, n, h, hk in args.shapes:
        d = args.head_dim
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        kc = torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(b, n, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
        nbytes = kc.numel() * 2 * 2
        copies = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(rotate_copies(nbytes) - 1)]
        ref = decode_reference(q, kc, vc)
        kw = {}
        if args.paged:  # one seed: every copy scattered by the same table
            pages = [paged_copy(kk, vv, args.paged) for kk, vv in copies]
            attn_copies = [(kp, vp) for kp, vp, _ in pages]
            kw["block_table"] = pages[0][2]
        else:
            attn_copies = copies
        rec = {"batch": b, "kv_len": n, "heads": h, "kv_heads": hk, "bytes": nbytes, "copies": len(copies),
               "us": {}, "checks": {}}

        def timed(name, make, pairs=copies):
            replay = _graphed(*(make(kk, vv) for kk, vv in pairs))
            rec["us"][name] = 1e3 * _event_bench(replay, 25.0, args.rep_ms, None, flush=False) / len(copies)

        runs = [("default", None, None)]
        if args.merges:
            runs += [("merge " + m, None, m) for m in MERGES]
        if args.configs:
            runs += [("kv%d w%d st%d" % cfg, cfg, None) for cfg in CONFIGS]
        for name, cfg, merge in runs:
            spec = None if cfg is None else attngen.DecodeSpec(cta_tile_kv=cfg[0], num_warps=cfg[1], num_stages=cfg[2],
                                                               paged=bool(args.paged))
            if args.merges:
                decode_op.set_cluster_merge(MERGES[merge] if merge else decode_op.CLUSTER_MAX)
            out = torch.full_like(q, float("nan"))
            try:
                attngen.decode(q, *attn_copies[0], cache_seqlens=n, out=out, spec=spec, **kw)
            except attngen.AttngenError as e:
                rec["checks"][name] = str(e)[:200]
                continue
            torch.cuda.synchronize()
            rec["checks"][name] = _rel_check(out, ref)["rel_l2"]
            timed(name, lambda kk, vv, spec=spec: (lambda: attngen.decode(q, kk, vv, cache_seqlens=n, spec=spec, **kw)),
                  attn_copies)
        timed("stream_read", lambda kk, vv: (lambda: stream_read(kk, vv)))
        timed("rows_read", lambda kk, vv: (lambda: rows_read(kk, vv, b, n)))
        if not args.paged:
            timed("rows_cluster", lambda kk, vv: (lambda: rows_cluster(kk, vv, b, n)))
            timed("rows_last", lambda kk, vv: (lambda: rows_last(kk, vv, b, n)))
        if args.paged:
            timed("rows_read_paged", lambda kk, vv: (lambda: rows_read(kk, vv, b, n, kw["block_table"])), attn_copies)
        qt = q.transpose(1, 2)

        def cudnn(kk, vv):
            kt, vt = kk.transpose(1, 2), vv.transpose(1, 2)

            def call():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            return call
        timed("cudnn", cudnn)
        rows.append(rec)
        print(f"[{args.label}] b={b} L={n} h={h}/{hk} ({nbytes / 1e6:.0f} MB): "
              + "  ".join(f"{k} {v:.1f}" for k, v in sorted(rec["us"].items(), key=lambda kv: kv[1])), flush=True)
        bad = {k: v for k, v in rec["checks"].items() if not isinstance(v, float) or v > 1e-2}
        if bad:
            print("    FAILED or refused:", bad, flush=True)
        copies = attn_copies = pages = kc = vc = None
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"label": args.label, "paged": args.paged, "head_dim": args.head_dim, "env": environment(True), "copy": copy, "rows": rows},
                                   indent=1, default=str))
    print(f"[{args.label}] copy {copy['gbps']:.0f} GB/s; median rel L2 "
          f"{statistics.median(v for r in rows for v in r['checks'].values() if isinstance(v, float)):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
