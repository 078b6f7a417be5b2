// The chunked kernel's epilogue: the row sums of all column groups added up (through shared memory), O
// normalised (SINKS: with the head's sink in the denominator) and stored (each warp its rows and its column group's
// columns), and the LSE.
namespace attngen {

template <class K>
struct ChunkedEpilogue {
  using T = typename K::T;
  static constexpr int MT = K::MT, ON = K::ON, BLOCK_M = K::BLOCK_M;

  __device__ __forceinline__ static void run(const PrefillParams<T>& p, const ChunkedSmem<K>& sm, ChunkedCta<K>& cta,
                                             const float (&acc_o)[MT][ON / 8][4], const float (&row_max)[MT][2],
                                             const float (&row_sum)[MT][2]) {
    // (the column group from threadIdx, not cta.cg: this function is optimised before it is inlined, and seeing how
    // cg is made it tests the LSE writer as the kernel written whole did, which kept the LSE kernels' SASS)
    const int tid = threadIdx.x;
    const int cg = K::WGMMA ? tid / 32 / 4 : tid / 32 % K::WARPS_N;  // (as ChunkedCta's)
    const int row0 = cta.row0, g = cta.g, t = cta.t, m0 = cta.m0;
    if constexpr (!K::TMA) cp_async_wait_all();
    ChunkedCta<K>::consumers_sync();  // every warp is past its last read of sm.red
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float l = row_sum[mt][r];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (t == 0) sm.red[cg * BLOCK_M + row0 + mt * 16 + g + 8 * r] = l;
      }
    ChunkedCta<K>::consumers_sync();
    // VARLEN: the sequence's first row, read again rather than held across the loop (registers).
    if constexpr (K::VARLEN) cta.q_row0 = min(max(p.cu_q[cta.batch], 0), p.total_q);
    const long long q_row0 = cta.q_row0;
    const float sink = K::SINKS ? p.sinks[cta.head] : 0.f;
    T* gO = p.o + (K::VARLEN ? 0 : cta.batch * p.o_sb) + cta.head * p.o_sh + (q_row0 + m0) * p.o_ss + cta.vs * K::DV +
            cg * ON;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + mt * 16 + g + 8 * r;
        float l = 0.f;
#pragma unroll
        for (int c = 0; c < K::WARPS_N; ++c) l += sm.red[c * BLOCK_M + row];
        float inv, sink_lse = 0.f;
        if constexpr (K::SINKS) {  // (epilogue.cuh: sink_row)
          const SinkRow sr = sink_row(sink, row_max[mt][r], l, p.sm_scale);
          inv = sr.inv;
          sink_lse = sr.lse;
        } else {
          inv = l > 0.f ? 1.f / l : 0.f;
        }
        const bool live = m0 + row < cta.seqlen_q;
        if constexpr (K::RETURN_LSE) {
          if (cg == 0 && t == 0 && live && cta.vs == 0) {
            const float lse =
                K::SINKS ? sink_lse : l > 0.f ? row_max[mt][r] * p.sm_scale + logf(l) : -ATTNGEN_INF;
            // VARLEN: [heads, total_q], FlashAttention's varlen layout; else [batch, heads, seqlen_q].
            if constexpr (K::VARLEN)
              p.lse[(long long)cta.head * p.total_q + q_row0 + m0 + row] = lse;
            else
              p.lse[((long long)cta.batch * p.num_heads + cta.head) * p.seqlen_q + m0 + row] = lse;
          }
        }
        if (live) {
#pragma unroll
          for (int d = 0; d < ON / 8; ++d)
            if (K::DV_PAD == K::DV || cg * ON + d * 8 < K::DV)
              *reinterpret_cast<unsigned*>(gO + row * p.o_ss + d * 8 + 2 * t) =
                  pack2<K::BF16>(acc_o[mt][d][2 * r] * inv, acc_o[mt][d][2 * r + 1] * inv);
        }
      }
  }
};

}  // namespace attngen
