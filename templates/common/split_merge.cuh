// The merge of split-KV partial results, shared by the decode families: WARPS warps per WARP_COLS
// columns of a (batch, token, head) output row of HEAD_DIM columns (wide rows are cut so that a
// few rows with many splits still spread over many warps). Params names o_part [splits, batch, q_len, heads,
// HEAD_DIM] (fp32, each split's normalised partial output; zeros for a split that saw no key),
// lse_part [splits, batch, heads, q_len], the output o with strides o_sb/o_ss/o_sh, lse (or null),
// batch, q_len, num_heads and num_splits; with SINKS also sinks (fp32 [num_heads]).
namespace attngen {

// An attention sink joins a merged row once: `lse` (the log of the row's keys' softmax denominator, -inf where it
// saw none) becomes the log of the whole denominator, exp(lse) + exp(sink), and the returned factor (the keys'
// share of it) scales the row's output normalised by the keys alone. Only the exp of minus their distance is
// taken (at most 1), so nothing overflows for any finite sink or LSE; a sink of -inf leaves both exactly as they
// were (factor 1), and a row with no key gets the sink as its LSE exactly (factor 0). The approximate intrinsics
// err far below the output's fp16/bf16 rounding; expf and log1pf took registers that spilled in the epilogue of
// the largest tiles (sm_80, sm_90a).
__device__ __forceinline__ float join_sink(float& lse, float sink) {
  if (sink == -ATTNGEN_INF) return 1.f;
  const float d = sink - lse;  // +inf where the row saw no key
  const float e = __expf(-fabsf(d));  // in [0, 1]
  lse = fmaxf(lse, sink) + __logf(1.f + e);
  return (d <= 0.f ? 1.f : e) / (1.f + e);
}

// Lanes first hold the LSE of splits lane, lane + 32, ...; the max and the weight sum come from
// shuffles, then the partial rows are read UNROLL splits at a time so their loads overlap, and the last
// fewer than UNROLL one at a time (a group padded to UNROLL loads would cost each merge of few splits
// UNROLL rows' instructions: the merge is bound by its instructions, not its bytes). With WARPS > 1 the
// warps of a CTA share one row's columns (a few rows with many splits: one warp walking every split UNROLL
// at a time waits on memory once a group): each takes a contiguous share of the splits, and their sums
// meet in shared memory. SINKS: each row's head's sink joins once, after the splits (join_sink); the
// partial states carry none. Row and chunk indices are 32-bit (the launch's rows times chunks fit an int):
// the 64-bit divisions they replace were most of a warp's instructions.
// VARLEN (decode's packed, ragged q; p.q_len its most tokens a request, p.q_len_min its fewest): rows past a
// request's tokens, and every row of a request with fewer than q_len_min or more than q_len, are skipped (their
// partials were never written); the output and the LSE of token qi of request b are row cu_seqlens_q[b] + qi of o
// ([total_q, heads, ...]) and of lse ([heads, total_q], lse_sh apart).
template <int PER>
__device__ __forceinline__ void merge_load(float (&x)[PER], const float* row) {
  if constexpr (PER % 4 == 0) {
#pragma unroll
    for (int i = 0; i < PER; i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(row + i);
      x[i] = v.x;
      x[i + 1] = v.y;
      x[i + 2] = v.z;
      x[i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < PER; i += 2) {
      const float2 v = *reinterpret_cast<const float2*>(row + i);
      x[i] = v.x;
      x[i + 1] = v.y;
    }
  }
}

template <class T, bool BF16, int HEAD_DIM, int WARP_COLS, int UNROLL = 8, int WARPS = 1, bool SINKS = false,
          bool VARLEN = false, class Params>
__device__ __forceinline__ void split_merge(const Params& p) {
  static_assert(HEAD_DIM % WARP_COLS == 0 && WARP_COLS % 8 == 0, "a warp's columns");
  static_assert(!VARLEN || WARPS == 1, "a skipped row returns its warp alone");
  // Elements per lane, contiguous: WARP_COLS / 32, or for a width not a multiple of 64 the power of two
  // (2, 4 or 8) that covers it, the lanes past the columns reading lane 0's and writing nothing.
  constexpr int PER = WARP_COLS % 64 == 0 ? WARP_COLS / 32 : WARP_COLS <= 64 ? 2 : WARP_COLS <= 128 ? 4 : 8;
  constexpr bool ALL_LANES = 32 * PER == WARP_COLS;
  static_assert(ALL_LANES || (WARP_COLS <= 256 && WARPS == 1), "a warp's columns");
  constexpr int CHUNKS = HEAD_DIM / WARP_COLS;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool cols = ALL_LANES || lane * PER < WARP_COLS;  // this lane has columns
  const int rows = p.batch * p.q_len * p.num_heads;
  const int gw = blockIdx.x * (blockDim.x / 32 / WARPS) + warp / WARPS;
  const int idx = gw / CHUNKS;
  const int col0 = (gw % CHUNKS) * WARP_COLS;
  if (idx >= rows) return;
  const int head = idx % p.num_heads;
  const int bq = idx / p.num_heads;
  const int qi = bq % p.q_len;
  const int b = bq / p.q_len;
  int q0 = 0, live = 0;
  if constexpr (VARLEN) {
    // A skipped row counts no split, so that its max stays -inf and it reads no partial, and returns before the
    // writes (a return here spilled on sm_90a at head_dim 256).
    q0 = p.cu_seqlens_q[b];
    const int n = p.cu_seqlens_q[b + 1] - q0;
    live = qi >= n || n > p.q_len || n < p.q_len_min ? 0 : p.num_splits;
  }
  const int lse_stride = rows;  // lse_part is [splits, batch, heads, q_len]: rows entries a split
  const float* lse_row = p.lse_part + (b * p.num_heads + head) * p.q_len + qi;

  float mx = -ATTNGEN_INF;
  for (int s = lane; s < (VARLEN ? live : p.num_splits); s += 32) mx = fmaxf(mx, lse_row[(long long)s * lse_stride]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));

  float acc[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) acc[i] = 0.f;
  float wsum = 0.f;
  int s_lo = 0, s_hi = p.num_splits;  // this warp's splits: all of them, or (WARPS > 1) its share
  if constexpr (WARPS > 1) {
    const int share = (p.num_splits + WARPS - 1) / WARPS;
    s_lo = min(p.num_splits, warp % WARPS * share);
    s_hi = min(p.num_splits, s_lo + share);
  }
  if (mx != -ATTNGEN_INF) {
    const long long split_elems = (long long)rows * HEAD_DIM;
    const float* src = p.o_part + (long long)idx * HEAD_DIM + col0 + (cols ? lane * PER : 0);
    for (int s0 = s_lo; s0 < s_hi; s0 += 32) {
      // Every split's partial row is written (zeros for a split with no keys), so weights of 0
      // multiply finite values.
      const int n = min(32, s_hi - s0);
      const float ls = lane < n ? lse_row[(long long)(s0 + lane) * lse_stride] : -ATTNGEN_INF;
      const float my_w = ls == -ATTNGEN_INF ? 0.f : __expf(ls - mx);
      wsum += my_w;
      const float* base = src + s0 * split_elems;
      int j = 0;
      for (; j + UNROLL <= n; j += UNROLL) {
        float x[UNROLL][PER];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) merge_load<PER>(x[u], base + (j + u) * split_elems);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          const float w = __shfl_sync(0xffffffffu, my_w, j + u);
#pragma unroll
          for (int i = 0; i < PER; ++i) acc[i] = fmaf(w, x[u][i], acc[i]);
        }
      }
      for (; j < n; ++j) {
        float x[PER];
        merge_load<PER>(x, base + j * split_elems);
        const float w = __shfl_sync(0xffffffffu, my_w, j);
#pragma unroll
        for (int i = 0; i < PER; ++i) acc[i] = fmaf(w, x[i], acc[i]);
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
  }
  if constexpr (WARPS > 1) {  // the warps' sums, added up by the CTA's first warp
    __shared__ float part[WARPS][WARP_COLS + 1];
#pragma unroll
    for (int i = 0; i < PER; ++i) part[warp][lane * PER + i] = acc[i];
    if (lane == 0) part[warp][WARP_COLS] = wsum;
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int w = 1; w < WARPS; ++w) {
#pragma unroll
      for (int i = 0; i < PER; ++i) acc[i] += part[w][lane * PER + i];
      wsum += part[w][WARP_COLS];
    }
  }
  float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  float lse = 0.f;
  if constexpr (SINKS) {
    lse = wsum > 0.f ? mx + logf(wsum) : -ATTNGEN_INF;
    inv *= join_sink(lse, p.sinks[head]);
  }
  T* dst;
  if constexpr (VARLEN) {
    if (live == 0) return;
    dst = p.o + (long long)(q0 + qi) * p.o_ss + head * p.o_sh + col0 + lane * PER;
  } else {
    dst = p.o + b * p.o_sb + qi * p.o_ss + head * p.o_sh + col0 + lane * PER;
  }
#pragma unroll
  for (int i = 0; i < PER; i += 2)
    if (cols) *reinterpret_cast<unsigned*>(dst + i) = pack2<BF16>(acc[i] * inv, acc[i + 1] * inv);
  if constexpr (VARLEN) {
    if (lane == 0 && col0 == 0 && p.lse)
      p.lse[head * p.lse_sh + q0 + qi] = SINKS ? lse : wsum > 0.f ? mx + logf(wsum) : -ATTNGEN_INF;
  } else {
    if (lane == 0 && col0 == 0 && p.lse)
      p.lse[(b * p.num_heads + head) * p.q_len + qi] = SINKS ? lse : wsum > 0.f ? mx + logf(wsum) : -ATTNGEN_INF;
  }
}

// The splits of one row block launched as one cluster (sm_90): each CTA left its normalised fp32
// output rows [rows][COLS] at sPart and their LSE at sLse in its shared memory. CTA `rank` merges
// every split's rows for the float4 columns rank, rank + splits, ... of the rows, reading the others'
// shared memory, and hands each to out(row, col, merged float4, the splits' largest LSE, the sum of
// their weights; the row's LSE is the first plus log of the second where the sum is positive). The
// second barrier keeps every CTA's shared memory until all have read.
template <int COLS, int THREADS, class Out>
__device__ __forceinline__ void cluster_merge_rows(const float* sPart, const float* sLse, int rows, int rank,
                                                   int splits, int tid, Out&& out) {
  constexpr int C4 = COLS / 4;
  cluster_sync();
  const unsigned part = smem_addr(sPart), lse_at = smem_addr(sLse);
  for (int i = rank * THREADS + tid; i < rows * C4; i += splits * THREADS) {
    const int row = i / C4;
    const int col = (i - row * C4) * 4;
    float mx = -ATTNGEN_INF;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, cluster_load_f32(cluster_map(lse_at + 4 * row, s)));
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = 0.f;
    if (mx != -ATTNGEN_INF) {
      for (int s = 0; s < splits; ++s) {
        const float ls = cluster_load_f32(cluster_map(lse_at + 4 * row, s));
        // every split's row is written (zeros for a split that saw no key): a weight of 0 multiplies finite values
        const float w = ls == -ATTNGEN_INF ? 0.f : __expf(ls - mx);
        const float4 x = cluster_load_f4(cluster_map(part + 4 * (row * COLS + col), s));
        acc.x = fmaf(w, x.x, acc.x);
        acc.y = fmaf(w, x.y, acc.y);
        acc.z = fmaf(w, x.z, acc.z);
        acc.w = fmaf(w, x.w, acc.w);
        wsum += w;
      }
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    out(row, col, make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv), mx, wsum);
  }
  cluster_sync();
}

// Row r of an mma.sync accumulator (acc [N][4], columns col + 8 d; this split's, normalised by inv, its LSE lse)
// merged with the other splits' normalised rows pushed into this CTA's shared memory: sPart [splits x mrows]
// [COLS] and their LSE sLse, row `local` of each split's mrows. On return acc times inv is the merged row and lse
// its LSE. A split that saw no key has LSE -inf and weight 0 (its row is finite: zeros).
template <int COLS, int N>
__device__ __forceinline__ void merge_pushed_row(float (&acc)[N][4], int r, float& inv, float& lse, const float* sPart,
                                                 const float* sLse, int split, int splits, int mrows, int local,
                                                 int col) {
  float mx = lse;
  for (int s = 0; s < splits; ++s)
    if (s != split) mx = fmaxf(mx, sLse[s * mrows + local]);
  float wsum = 0.f;
  if (mx != -ATTNGEN_INF) {
    wsum = lse == -ATTNGEN_INF ? 0.f : __expf(lse - mx);
    const float own = wsum * inv;
#pragma unroll
    for (int d = 0; d < N; ++d) {
      acc[d][2 * r] *= own;
      acc[d][2 * r + 1] *= own;
    }
    for (int s = 0; s < splits; ++s) {
      if (s == split) continue;
      const float ls = sLse[s * mrows + local];
      const float w = ls == -ATTNGEN_INF ? 0.f : __expf(ls - mx);
      const float* x = sPart + (s * mrows + local) * COLS + col;
#pragma unroll
      for (int d = 0; d < N; ++d) {
        const float2 v = *reinterpret_cast<const float2*>(x + 8 * d);
        acc[d][2 * r] = fmaf(w, v.x, acc[d][2 * r]);
        acc[d][2 * r + 1] = fmaf(w, v.y, acc[d][2 * r + 1]);
      }
      wsum += w;
    }
  }
  inv = wsum > 0.f ? 1.f / wsum : 0.f;
  lse = wsum > 0.f ? mx + logf(wsum) : -ATTNGEN_INF;
}

}  // namespace attngen
