// MLA decode, the consumer: one ring tile's S = Q K^T for the warp's rows and keys, the online softmax
// and O += P V over the warp's columns of ckv, by mma.sync or (sm_90a) wgmma.
//
// Warp (rt, cg) holds rows [16 rt, 16 rt + 16) and O's columns [cg ON, (cg + 1) ON). QK_SHARD chooses how S is
// made:
//   true:  the WARPS_N warps of a row tile split the tile's keys (SN = BLOCK_N / WARPS_N each), trade
//          their partial row maxima through shared memory and all-gather P there (16-bit);
//   false: every warp computes S for all BLOCK_N keys of its rows (the QK work done WARPS_N times),
//          keeps its own softmax and feeds P to the PV MMAs from registers: no exchange at all.
//
// WGMMA (sm_90a, ROWS = 64, 8 warps): warp (rt, cg) is warp rt of warpgroup cg, so a warpgroup holds
// all 64 rows and column group cg; S and O += P V are wgmma with Q, the cache tile and (sharded) P
// read from shared memory through descriptors, P from registers when not sharded. The accumulators
// land in the mma.sync layout per warp, so the mask, the softmax and the epilogue are shared. Q and
// the tiles are then stored in 128-byte-swizzled 64-column blocks (WgmmaLayout).
//
// Every array these functions use (acc_s, acc_s2, mx, corr, besides O and the row state) is declared by
// MlaDecode::run, in the order its one-piece loop declared them, and passed in: an array local to an
// inlined function is placed before the caller's, which renumbered the loop's values and changed how
// ptxas allocated registers (all non-sharded kernels for mx, the wgmma ones for corr).
namespace attngen {

template <class K>
struct MlaConsumer {
  using T = typename K::Elem;
  using LQ = typename K::LQ;
  using LT = typename K::LT;
  using LP = typename K::LP;
  static constexpr bool BF16 = K::MMA_BF16, QK_SHARD = K::QK_SHARD_, WGMMA = K::WGMMA_, TMA = K::TMA_;
  static constexpr int DQK = K::DQK, ROW = K::ROW, P_ROW = K::P_ROW, ROWS = K::ROWS_, BLOCK_N = K::BLOCK_N_;
  static constexpr int WARPS_N = K::WARPS_N, SN = K::SN, ON = K::ON;

  // The last key each of the thread's two rows (the first packed row gr0, then gr0 + 8) may see: token qi sits
  // at seqlen - q_len + qi.
  static __device__ __forceinline__ void limits(const MlaParams<T>& p, int gr0, int rows_total, int seqlen,
                                                int (&lim)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int gr = gr0 + 8 * r;
      lim[r] = gr < rows_total ? seqlen - p.q_len + gr / p.num_heads : seqlen - 1;
    }
  }

  // S = Q K^T for this warp's 16 rows (row0..) and SN keys (key0..) of the tile at sT; acc_s2 is the second
  // chain's accumulator (below).
  static __device__ __forceinline__ void scores(const T* sQ, const T* sT, int row0, int key0, int lane,
                                                float (&acc_s)[SN / 8][4], float (&acc_s2)[SN / 8][4]) {
#pragma unroll
    for (int n = 0; n < SN / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc_s[n][c] = 0.f;
    if constexpr (WGMMA) {
      // This warpgroup's SN keys (rows key0.. of the tile, whole 1024-byte swizzle atoms) against
      // all 64 Q rows.
      using W = WgmmaOps<BF16>;
      const unsigned q_lo = W::desc_lo(smem_addr(sQ), 16);
      const unsigned k_lo = W::desc_lo_warp(smem_addr(sT) + key0 * 128, 16);  // this warpgroup's keys
      W::fence();
#pragma unroll
      for (int kk = 0; kk < DQK / 16; ++kk)
        Wgmma<SN, BF16>::ss(acc_s, W::desc_step(q_lo, W::k_bytes(kk, LQ::BLOCK_BYTES)),
                            W::desc_step(k_lo, W::k_bytes(kk, LT::BLOCK_BYTES)), kk > 0);
      W::commit();
      W::template wait<0>();
      W::hold(acc_s);
    } else {
      // A warp with few keys (SN <= 16) sums its two 16-column steps in two accumulators, added at the end, and
      // unrolls by two: one chain of 36 dependent MMAs a tile was what a CTA's tile waited on at batch 1.
      constexpr int CHAINS = SN <= 16 ? 2 : 1;
#pragma unroll
      for (int n = 0; n < SN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc_s2[n][c] = 0.f;
#pragma unroll CHAINS
      for (int kp = 0; kp < DQK / 32; ++kp) {
        unsigned a0[4], a1[4];
        const unsigned qa = smem_addr(sQ + (row0 + lane % 16) * ROW + kp * 32 + (lane / 16) * 8);
        ldmatrix_x4(a0[0], a0[1], a0[2], a0[3], qa);
        ldmatrix_x4(a1[0], a1[1], a1[2], a1[3], qa + 32);
#pragma unroll
        for (int n = 0; n < SN / 8; ++n) {
          unsigned b0, b1, b2, b3;
          // (LT::offset is key * ROW + col without the ring; written out there, ptxas keeps the cp.async kernels'
          // machine code as it was: with LT::offset the sm_86 8-warp kernels compiled differently)
          const int key = key0 + n * 8 + lane % 8, col = kp * 32 + (lane / 8) * 8;
          ldmatrix_x4(b0, b1, b2, b3, smem_addr(sT + (TMA ? LT::offset(key, col) : key * ROW + col)));
          mma_16816<BF16>(acc_s[n], a0, b0, b1);
          mma_16816<BF16>(CHAINS == 2 ? acc_s2[n] : acc_s[n], a1, b2, b3);
        }
      }
      if constexpr (CHAINS == 2)
#pragma unroll
        for (int n = 0; n < SN / 8; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_s[n][c] += acc_s2[n][c];
    }
  }

  // The online softmax of S (this warp's rows, SN keys): the row maxima mx (traded through sRed across a row
  // tile's column groups when sharded), P = exp2 of the scaled scores in place, O and the row sums rescaled
  // (wgmma: lazily, by the factors corr).
  static __device__ __forceinline__ void softmax(const MlaParams<T>& p, float* sRed, int row0, int cg, int g, int t,
                                                 float (&acc_s)[SN / 8][4], float (&mx)[2], float (&corr)[2],
                                                 float (&acc_o)[ON / 8][4],
                                                 float (&row_max)[2], float (&row_sum)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) mx[r] = frag_row_max<SN>(acc_s, r);
    if constexpr (QK_SHARD) {
      if (t == 0) {
        sRed[cg * ROWS + row0 + g] = mx[0];
        sRed[cg * ROWS + row0 + g + 8] = mx[1];
      }
      K::consumers_sync();
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int c = 0; c < WARPS_N; ++c) mx[r] = fmaxf(mx[r], sRed[c * ROWS + row0 + g + 8 * r]);
    }
    if constexpr (WGMMA) {
      // lazy rescaling (lazy_max, online_softmax.cuh)
      bool moved = false;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float before = row_max[r];
        corr[r] = lazy_softmax_row<SN>(acc_s, r, mx[r], row_max[r], row_sum[r], p.scale_log2);
        moved |= row_max[r] != before;
      }
      if (__any_sync(0xffffffffu, moved)) scale_rows(acc_o, corr);
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float m = fmaxf(row_max[r], mx[r]);
        // A row that has seen only masked keys keeps max -inf; subtracting 0 keeps exp2 at 0.
        const float base = m == -ATTNGEN_INF ? 0.f : m * p.scale_log2;
        const float corr = fast_exp2(row_max[r] * p.scale_log2 - base);
        row_max[r] = m;
        row_sum[r] = row_sum[r] * corr + frag_exp_row<SN>(acc_s, r, p.scale_log2, base);
#pragma unroll
        for (int d = 0; d < ON / 8; ++d) {
          acc_o[d][2 * r] *= corr;
          acc_o[d][2 * r + 1] *= corr;
        }
      }
    }
  }

  // O += P V over the tile's keys and this warp's ON columns of ckv; sharded, P goes through sP first.
  static __device__ __forceinline__ void pv(T* sP, const T* sT, int row0, int key0, int cg, int g, int t, int lane,
                                            const float (&acc_s)[SN / 8][4], float (&acc_o)[ON / 8][4]) {
    if constexpr (QK_SHARD) {
#pragma unroll
      for (int n = 0; n < SN / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<unsigned*>(sP + LP::offset(row0 + g + 8 * r, key0 + n * 8) + 2 * t) =
              pack2<BF16>(acc_s[n][2 * r], acc_s[n][2 * r + 1]);
      if constexpr (WGMMA) WgmmaOps<BF16>::fence_proxy();
      K::consumers_sync();
    }
    if constexpr (WGMMA) {
      // V is N-major here; this warpgroup's ON columns start at 64-column block cg * ON / 64.
      using W = WgmmaOps<BF16>;
      const unsigned v_lo = W::desc_lo_warp(smem_addr(sT) + (cg * ON / 64) * LT::BLOCK_BYTES, LT::BLOCK_BYTES);
      const unsigned p_lo = W::desc_lo(smem_addr(sP), 16);
      W::fence();
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        const unsigned long long dv = W::desc_step(v_lo, W::mn_bytes(kk));
        if constexpr (QK_SHARD) {
          Wgmma<ON, BF16>::template ss<1>(acc_o, W::desc_step(p_lo, W::k_bytes(kk, LP::BLOCK_BYTES)), dv, 1);
        } else {
          unsigned a[4];
          p_fragment<BF16>(acc_s, kk, a);
          Wgmma<ON, BF16>::rs(acc_o, a, dv);
        }
      }
      W::commit();
      W::template wait<0>();
      W::hold(acc_o);
    } else {
#pragma unroll
      for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
        unsigned a[4];
        if constexpr (QK_SHARD) {
          ldmatrix_x4(a[0], a[1], a[2], a[3], smem_addr(sP + (row0 + lane % 16) * P_ROW + kk * 16 + (lane / 16) * 8));
        } else {
          p_fragment<BF16>(acc_s, kk, a);
        }
        const int vrow = kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, vcol = cg * ON + (lane / 16) * 8;
        const unsigned va = smem_addr(sT + vrow * ROW + vcol);
#pragma unroll
        for (int d2 = 0; d2 < ON / 16; ++d2) {
          unsigned b0, b1, b2, b3;
          ldmatrix_x4_trans(b0, b1, b2, b3, TMA ? smem_addr(sT + LT::offset(vrow, vcol + d2 * 16)) : va + d2 * 32);
          mma_16816<BF16>(acc_o[2 * d2], a, b0, b1);
          mma_16816<BF16>(acc_o[2 * d2 + 1], a, b2, b3);
        }
      }
    }
  }
};

}  // namespace attngen
