// The epilogue of prefill_fwd (prefill/fwd.cuh.jinja), on one warp's rows: O is staged in Q's tile, or
// (OWN_O: PERSISTENT where it fits) in a tile of its own, whose layout LO gives.
namespace attngen {

// The epilogue: normalise O, write the LSE, stage O through this warp's rows of sO (layout LO) and
// store it with 16-byte writes of whole rows. q_row0: VARLEN, the sequence's first row.
template <bool BF16, bool RETURN_LSE, bool VARLEN, int WARP_M, int HEAD_DIM_V, class LO, int M_TILES, int D_TILES,
          class T>
__device__ __forceinline__ void store_tile(float (&acc_o)[M_TILES][D_TILES][4], const float (&row_max)[M_TILES][2],
                                           const float (&row_sum)[M_TILES][2], const PrefillParams<T>& p, T* sO,
                                           int m0, int warp_row0, int head, int batch, long long q_row0, int seqlen_q,
                                           int lane, int g, int t) {
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int d = 0; d < D_TILES; ++d) {
        acc_o[mt][d][2 * r] *= inv;
        acc_o[mt][d][2 * r + 1] *= inv;
      }
      if constexpr (RETURN_LSE) {
        const int i = m0 + warp_row0 + mt * 16 + g + 8 * r;
        if (t == 0 && i < seqlen_q) {
          const float lse = l > 0.f ? row_max[mt][r] * p.sm_scale + logf(l) : -ATTNGEN_INF;
          // VARLEN: [heads, total_q], FlashAttention's varlen layout; else [batch, heads, seqlen_q].
          if constexpr (VARLEN)
            p.lse[(long long)head * p.total_q + q_row0 + i] = lse;
          else
            p.lse[((long long)batch * p.num_heads + head) * p.seqlen_q + i] = lse;
        }
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int d = 0; d < D_TILES; ++d)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = warp_row0 + mt * 16 + g + 8 * r;
        *reinterpret_cast<unsigned*>(sO + LO::offset(row, d * 8) + 2 * t) =
            pack2<BF16>(acc_o[mt][d][2 * r], acc_o[mt][d][2 * r + 1]);
      }
  __syncwarp();
  T* gO = p.o + (VARLEN ? 0 : batch * p.o_sb) + head * p.o_sh + (q_row0 + m0) * p.o_ss;
  constexpr int O_CHUNKS = HEAD_DIM_V / 8;  // 16-byte chunks of an output row
  constexpr int CHUNKS = WARP_M * O_CHUNKS;
#pragma unroll
  for (int idx = lane; idx < CHUNKS; idx += 32) {
    const int r = warp_row0 + idx / O_CHUNKS;
    const int c = (idx % O_CHUNKS) * 8;
    if (m0 + r < seqlen_q)
      *reinterpret_cast<uint4*>(gO + r * p.o_ss + c) = *reinterpret_cast<const uint4*>(sO + LO::offset(r, c));
  }
}

}  // namespace attngen
