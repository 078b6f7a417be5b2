// MLA decode, the consumer: one ring tile's S = Q K^T for the warp's rows and keys, the online softmax
// and O += P V over the warp's columns of ckv, by mma.sync or (sm_90a) wgmma.
namespace attngen {

template <class K>
struct MlaConsumer {
  using T = typename K::Elem;
  using LQ = typename K::LQ;
  using LT = typename K::LT;
  using LP = typename K::LP;
  static constexpr bool BF16 = K::IS_BF16, QK_SHARD = K::QK_SHARD_, WGMMA = K::WGMMA_, TMA = K::TMA_;
  static constexpr int DQK = K::DQK, ROW = K::ROW, P_ROW = K::P_ROW, ROWS = K::ROWS_, BLOCK_N = K::BLOCK_N_;
  static constexpr int WARPS_N = K::WARPS_N, SN = K::SN, ON = K::ON;

  // S = Q K^T for this warp's 16 rows (row0..) and SN keys (key0..) of the tile at sT; acc_s2 is the
  // second chain's accumulator (below), the caller's so that it is declared after acc_s: an array of
  // this function's own came first after inlining, and the loop's values were numbered in another order.
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
      const unsigned q_at = smem_addr(sQ);
      const unsigned k_at = smem_addr(sT) + key0 * 128;
      W::fence();
#pragma unroll
      for (int kk = 0; kk < DQK / 16; ++kk)
        Wgmma<SN, BF16>::ss(acc_s, W::desc_k(q_at, kk, LQ::BLOCK_BYTES), W::desc_k(k_at, kk, LT::BLOCK_BYTES),
                            kk > 0);
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
};

}  // namespace attngen
