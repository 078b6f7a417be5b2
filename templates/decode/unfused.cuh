// The unfused decode variant, built on the pieces of Decode (decode/fused.cuh): two kernels a split, the first
// storing raw scores to the workspace with each row's max and sum, the second forming P from them and O = P V.
namespace attngen {

template <class S>
struct DecodeUnfused {
  using T = typename S::T;
  using Cta = typename S::Cta;
  using Lane = typename S::Lane;
  using Load = DecodeProducer<S>;
  using Math = DecodeConsumer<S>;
  using End = DecodeEnd<S>;
  static constexpr bool LOCAL = S::LOCAL;
  static constexpr int ROWS = S::ROWS, BLOCK_N = S::BLOCK_N, NUM_STAGES = S::NUM_STAGES, THREADS = S::THREADS;
  static constexpr int M_TILES = S::M_TILES, KW_TILES = S::KW_TILES, D_TILES = S::D_TILES;
  static constexpr int S_LD = S::S_LD, TILE_ELEMS = S::TILE_ELEMS, Q_ELEMS = S::Q_ELEMS;

  // The workspace of this CTA's batch row and KV head: its raw scores [rows_valid][scores_ld], and its split's
  // per-row (max, sum) [ROWS][2].
  static __device__ __forceinline__ float* scores_of(const DecodeParams<T>& p, const Cta& c) {
    return p.scores + ((long long)c.batch * gridDim.y + c.kv_head) * c.rows_valid * p.scores_ld;
  }
  static __device__ __forceinline__ float* stats_of(const DecodeParams<T>& p, const Cta& c) {
    return p.stats + (((long long)c.split * p.batch + c.batch) * gridDim.y + c.kv_head) * ROWS * 2;
  }

  // ---- unfused, first kernel: raw scores to the workspace, per-row max and sum per split ---------
  static __device__ __forceinline__ void unfused_qk(const DecodeParams<T>& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Q_ELEMS;
    const Cta c = S::cta_of(p);
    const Lane l = S::lane_of();

    typename Load::Pages pg;
    Load::lookup(pg, p, c, c.tile_begin, l.tid);
    Load::load_q(sQ, p, c, l.tid);
    Load::zero_pads(sQ, sK, l.tid);
    const auto load = [&](int tile, int slot) {
      Load::template load_rows<true, false>(sK + slot * TILE_ELEMS, nullptr, p, c, pg, tile, l.tid);
      Load::lookup(pg, p, c, tile + 1, l.tid);
    };
    Load::ring_fill(c, load);
    float row_max[M_TILES][2], row_sum[M_TILES][2];
    Math::start_rows(row_max, row_sum);
    int lim[M_TILES][2];
    Math::row_limits(lim, p, c, l);
    typename Math::QFrag q_frag;
    float* gS = scores_of(p, c);

    Load::ring(
        c, load,
        [&](int tile, int it, int slot) {
          const int n0 = tile * BLOCK_N;
          float acc_s[M_TILES][KW_TILES][4];
          Math::tile_scores(acc_s, q_frag, sQ, sK + slot * TILE_ELEMS, lim, it, n0, p, c, l);
          // Masked scores are stored as -inf; keys past the sequence are not stored.
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = l.row(mt, r);
              if (row >= c.rows_valid) continue;
#pragma unroll
              for (int n = 0; n < KW_TILES; ++n) {
                const int col = n0 + l.key0 + n * 8 + 2 * l.t;
                float* dst = gS + row * p.scores_ld + col;
                if (col + 1 < c.seqlen) {
                  *reinterpret_cast<float2*>(dst) = make_float2(acc_s[mt][n][2 * r], acc_s[mt][n][2 * r + 1]);
                } else if (col < c.seqlen) {
                  dst[0] = acc_s[mt][n][2 * r];
                }
              }
            }
          float corr[M_TILES][2];
          Math::softmax_step(acc_s, row_max, row_sum, corr, p.scale_log2);
        });
    cp_async_wait_all();  // with one stage, a CTA with no tile never committed Q's copies
    __syncthreads();
    float factor[M_TILES][2];
    End::merge_stats(reinterpret_cast<float*>(smem_raw), row_max, row_sum, factor, p.scale_log2, l);
    if (l.wn == 0 && l.t == 0) {
      float* gStat = stats_of(p, c);
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = l.row(mt, r);
          *reinterpret_cast<float2*>(gStat + 2 * row) = make_float2(row_max[mt][r], row_sum[mt][r]);
        }
    }
  }

  // ---- unfused, second kernel: P = exp(S - max) from the stored scores, O = P V / sum ------------
  static __device__ __forceinline__ void load_scores(float* dst, const float* gS, const DecodeParams<T>& p,
                                                     const Cta& c, int tile, int tid) {
    constexpr int CHUNKS = BLOCK_N / 4;
    const int n0 = tile * BLOCK_N;
#pragma unroll
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS;
      const int col = (idx % CHUNKS) * 4;
      // A chunk that starts inside the sequence may run past it (scores_ld is padded to 4);
      // those values are never used: P is selected to 0 past each row's limit.
      const bool ok = r < c.rows_valid && n0 + col < c.seqlen;
      cp_async_16(smem_addr(dst + r * S_LD + col), ok ? gS + r * p.scores_ld + n0 + col : gS, ok);
    }
  }

  static __device__ __forceinline__ void unfused_pv(const DecodeParams<T>& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sV = reinterpret_cast<T*>(smem_raw) + Q_ELEMS;
    float* sS = reinterpret_cast<float*>(sV + NUM_STAGES * TILE_ELEMS);
    const Cta c = S::cta_of(p);
    const Lane l = S::lane_of();
    const float* gS = scores_of(p, c);
    typename Load::Pages pg;
    Load::lookup(pg, p, c, c.tile_begin, l.tid);
    const auto load = [&](int tile, int slot) {
      Load::template load_rows<false, true>(nullptr, sV + slot * TILE_ELEMS, p, c, pg, tile, l.tid);
      load_scores(sS + slot * ROWS * S_LD, gS, p, c, tile, l.tid);
      Load::lookup(pg, p, c, tile + 1, l.tid);
    };
    Load::ring_fill(c, load);
    const float* gStat = stats_of(p, c);
    float row_max[M_TILES][2], row_sum[M_TILES][2], base[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = l.row(mt, r);
        const float2 st = *reinterpret_cast<const float2*>(gStat + 2 * row);
        row_max[mt][r] = st.x;
        // The sum enters the merge once per row: from the first key warp's first lane.
        row_sum[mt][r] = l.wn == 0 && l.t == 0 ? st.y : 0.f;
        base[mt][r] = st.x == -ATTNGEN_INF ? 0.f : st.x * p.scale_log2;
      }
    float acc_o[M_TILES][D_TILES][4];
    Math::zero(acc_o);
    int lim[M_TILES][2];
    Math::row_limits(lim, p, c, l);

    Load::ring(
        c, load,
        [&](int tile, int, int slot) {
          const float* sSs = sS + slot * ROWS * S_LD;
          const int n0 = tile * BLOCK_N;
          float acc_p[M_TILES][KW_TILES][4];
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int row = l.row(mt, r);
              int lo = 0, hi = lim[mt][r] - (n0 + l.key0 + 2 * l.t);
              if constexpr (LOCAL) Math::key_bounds(lo, hi, lim[mt][r], n0 + l.key0 + 2 * l.t, p, c);
#pragma unroll
              for (int n = 0; n < KW_TILES; ++n) {
                const float2 s = *reinterpret_cast<const float2*>(sSs + row * S_LD + l.key0 + n * 8 + 2 * l.t);
                const bool in0 = n * 8 <= hi && (!LOCAL || n * 8 >= lo);
                const bool in1 = n * 8 + 1 <= hi && (!LOCAL || n * 8 + 1 >= lo);
                acc_p[mt][n][2 * r] = in0 ? fast_exp2(fmaf(s.x, p.scale_log2, -base[mt][r])) : 0.f;
                acc_p[mt][n][2 * r + 1] = in1 ? fast_exp2(fmaf(s.y, p.scale_log2, -base[mt][r])) : 0.f;
              }
            }
          Math::accumulate_pv(acc_o, acc_p, sV + slot * TILE_ELEMS, l);
        });
    End::epilogue(p, c, smem_raw, acc_o, row_max, row_sum, l);
  }
};

}  // namespace attngen
