// The end of a decode CTA, for Decode (decode/fused.cuh) and its unfused variant: the per-warp row statistics
// merged through shared memory, then the output normalised and written (one split), the split's fp32 partial and
// LSE written for the merge launch (several), or the splits of a row merged in a thread-block cluster (sm_90).
// An attention sink (SINKS) joins a row where it is normalised over all its keys: here with one split or in the
// cluster, else in the `_merge` entry (split_merge); the partial states of several splits carry none.
namespace attngen {

template <class S>
struct DecodeEnd {
  using T = typename S::T;
  using Cta = typename S::Cta;
  using Lane = typename S::Lane;
  static constexpr bool BF16 = S::BF16, SINKS = S::SINKS, VARLEN = S::VARLEN;
  static constexpr int HEAD_DIM = S::HEAD_DIM, ROWS = S::ROWS, THREADS = S::THREADS, WARPS_N = S::WARPS_N;
  static constexpr int M_TILES = S::M_TILES, D_TILES = S::D_TILES;
  // A CTA's output columns: all HEAD_DIM, or (D_PARTS > 1) D_OUT of them from Lane::dcol0.
  static constexpr int D_OUT = S::D_OUT, D_PARTS = S::D_PARTS;

  // The LSE entry of token qi of the CTA's row, query head `head`: [batch, heads, q_len], or (VARLEN) [heads, total_q].
  static __device__ __forceinline__ long long lse_at(const DecodeParams<T>& p, const Cta& c, int head, int qi) {
    if constexpr (VARLEN) {
      return head * p.lse_sh + S::q0_of(p, c) + qi;
    } else {
      return ((long long)c.batch * p.num_heads + head) * p.q_len + qi;
    }
  }

  // Merge the WARPS_N per-warp (max, sum) of each row through shared memory (the ring's bytes,
  // free once every cp.async has landed). Returns per row the CTA's max, its sum, and this
  // warp's factor exp2((own max - CTA max) * scale_log2). row_sum is this thread's partial sum.
  static __device__ __forceinline__ void merge_stats(float* sStat, float (&row_max)[M_TILES][2],
                                                     float (&row_sum)[M_TILES][2], float (&factor)[M_TILES][2],
                                                     float scale_log2, const Lane& l) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float s = row_sum[mt][r];
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        row_sum[mt][r] = s;
        if (l.t == 0) {
          const int row = l.row(mt, r);
          sStat[l.wn * ROWS + row] = row_max[mt][r];
          sStat[(WARPS_N + l.wn) * ROWS + row] = s;
        }
      }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = l.row(mt, r);
        float mg = -ATTNGEN_INF;
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) mg = fmaxf(mg, sStat[w * ROWS + row]);
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS_N; ++w) {
          const float m = sStat[w * ROWS + row];
          if (m != -ATTNGEN_INF) sum += sStat[(WARPS_N + w) * ROWS + row] * fast_exp2((m - mg) * scale_log2);
        }
        factor[mt][r] = row_max[mt][r] == -ATTNGEN_INF ? 0.f : fast_exp2((row_max[mt][r] - mg) * scale_log2);
        row_max[mt][r] = mg;
        row_sum[mt][r] = sum;
      }
  }

  // After the KV loop the shared memory holds, from its start: the per-row max and sum of every warp
  // [2][WARPS_N][ROWS], the fp32 partial outputs of the warps past the first along the keys
  // [WARPS_N - 1][ROWS][D_OUT + 4], and (a cluster merge) the CTA's normalised output [ROWS][HEAD_DIM]
  // and its LSE [ROWS] at PART_AT floats (DecodeSpec.cluster_merge_bytes counts the same).
  static constexpr int PART_AT = (2 * WARPS_N * ROWS + (WARPS_N - 1) * ROWS * (D_OUT + 4) + 3) / 4 * 4;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000  // measured on sm_90 only (Kernel.cluster_fits)
  static constexpr bool CAN_CLUSTER = D_PARTS == 1;  // (the output halves of D_PARTS > 1 merge through the launch)
#else
  static constexpr bool CAN_CLUSTER = false;
#endif

  // The splits of one (batch, kv head) launched as one cluster (sm_90, o_part null): each CTA left
  // its normalised output and LSE in its shared memory; cluster_merge_rows (split_merge.cuh) merges
  // them, CTA `split` writing its share of the output.
  static __device__ __forceinline__ void cluster_merge(const DecodeParams<T>& p, const Cta& c, const float* sPart,
                                                       const float* sLse, int tid) {
    cluster_merge_rows<HEAD_DIM, THREADS>(sPart, sLse, c.rows_valid, c.split, p.num_splits, tid,
                                          [&](int row, int col, float4 x, float mx, float wsum) {
      const int qi = row / p.group;
      const int head = c.kv_head * p.group + (row - qi * p.group);
      float lse = 0.f;
      if constexpr (SINKS) {
        lse = wsum > 0.f ? mx + logf(wsum) : -ATTNGEN_INF;
        const float f = join_sink(lse, p.sinks[head]);
        x = make_float4(x.x * f, x.y * f, x.z * f, x.w * f);
      }
      T* dst;
      if constexpr (VARLEN) {
        dst = p.o + (long long)(S::q0_of(p, c) + qi) * p.o_ss + head * p.o_sh + col;
      } else {
        dst = p.o + c.batch * p.o_sb + qi * p.o_ss + head * p.o_sh + col;
      }
      *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<BF16>(x.x, x.y), pack2<BF16>(x.z, x.w));
      if (col == 0 && p.lse)
        p.lse[lse_at(p, c, head, qi)] = SINKS ? lse : wsum > 0.f ? mx + logf(wsum) : -ATTNGEN_INF;
    });
  }

  // Normalise and write: the output (one split), fp32 partials and their LSE (several), or, with the
  // splits a cluster, the CTA's share of the merged output (cluster_merge).
  static __device__ __forceinline__ void epilogue(const DecodeParams<T>& p, const Cta& c, unsigned char* smem,
                                                  float (&acc_o)[M_TILES][D_TILES][4], float (&row_max)[M_TILES][2],
                                                  float (&row_sum)[M_TILES][2], const Lane& l) {
    cp_async_wait_all();  // with one stage, a CTA with no tile never committed Q's copies
    __syncthreads();
    float* sStat = reinterpret_cast<float*>(smem);  // [2][WARPS_N][ROWS]
    float* sO = sStat + 2 * WARPS_N * ROWS;         // [WARPS_N - 1][ROWS][D_OUT + 4]
    float* sPart = sStat + PART_AT;                 // cluster merge: [ROWS][HEAD_DIM], then the LSE [ROWS]
    float* sLse = sPart + ROWS * HEAD_DIM;
    const bool cl = CAN_CLUSTER && p.num_splits > 1 && p.o_part == nullptr;
    float factor[M_TILES][2];
    merge_stats(sStat, row_max, row_sum, factor, p.scale_log2, l);
    if constexpr (WARPS_N > 1) {
      if (l.wn > 0) {
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
          for (int d = 0; d < D_TILES; ++d)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = l.row(mt, r);
              *reinterpret_cast<float2*>(sO + ((l.wn - 1) * ROWS + row) * (D_OUT + 4) + d * 8 + 2 * l.t) =
                  make_float2(acc_o[mt][d][2 * r] * factor[mt][r], acc_o[mt][d][2 * r + 1] * factor[mt][r]);
            }
      }
      __syncthreads();
      if (l.wn > 0) {
        if (cl) cluster_merge(p, c, sPart, sLse, l.tid);
        return;
      }
    }
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = l.row(mt, r);
        if (row >= c.rows_valid) continue;
        const int qi = row / p.group;
        const int head = c.kv_head * p.group + (row - qi * p.group);
        const float sum = row_sum[mt][r];
        float inv = sum > 0.f ? 1.f / sum : 0.f;
        float lse = sum > 0.f ? row_max[mt][r] * p.sm_scale + logf(sum) : -ATTNGEN_INF;
        const bool one = p.num_splits == 1;
        // (both output halves of D_PARTS > 1 take the same sink into the same statistics)
        if constexpr (SINKS) {
          if (one) inv *= join_sink(lse, p.sinks[head]);
        }
        T* gO;
        if constexpr (VARLEN) {
          gO = p.o + (long long)(S::q0_of(p, c) + qi) * p.o_ss + head * p.o_sh;
        } else {
          gO = p.o + c.batch * p.o_sb + qi * p.o_ss + head * p.o_sh + (D_PARTS > 1 ? l.dcol0 : 0);
        }
        float* gP = p.o_part + (((long long)c.split * p.batch + c.batch) * p.q_len + qi) * p.num_heads * HEAD_DIM +
                    (long long)head * HEAD_DIM + (D_PARTS > 1 ? l.dcol0 : 0);
#pragma unroll
        for (int d = 0; d < D_TILES; ++d) {
          float x0 = acc_o[mt][d][2 * r] * factor[mt][r];
          float x1 = acc_o[mt][d][2 * r + 1] * factor[mt][r];
          const int col = d * 8 + 2 * l.t;
#pragma unroll
          for (int w = 1; w < WARPS_N; ++w) {
            const float2 y = *reinterpret_cast<const float2*>(sO + ((w - 1) * ROWS + row) * (D_OUT + 4) + col);
            x0 += y.x;
            x1 += y.y;
          }
          if (one) {
            *reinterpret_cast<unsigned*>(gO + col) = pack2<BF16>(x0 * inv, x1 * inv);
          } else if (cl) {
            *reinterpret_cast<float2*>(sPart + row * HEAD_DIM + col) = make_float2(x0 * inv, x1 * inv);
          } else {
            *reinterpret_cast<float2*>(gP + col) = make_float2(x0 * inv, x1 * inv);
          }
        }
        if (l.t == 0 && (D_PARTS == 1 || l.dcol0 == 0)) {  // (every part has the same LSE)
          if (one) {
            if (p.lse) p.lse[lse_at(p, c, head, qi)] = lse;
          } else if (cl) {
            sLse[row] = lse;
          } else {
            p.lse_part[(((long long)c.split * p.batch + c.batch) * p.num_heads + head) * p.q_len + qi] = lse;
          }
        }
      }
    if (cl) cluster_merge(p, c, sPart, sLse, l.tid);
  }
};

}  // namespace attngen
