// The epilogue of prefill_fwd (prefill/fwd.cuh.jinja), on one warp's rows: O is staged in Q's tile, or
// (OWN_O: PERSISTENT where it fits) in a tile of its own, whose layout LO gives.
// O_IN_Q (PERSISTENT, where sO does not fit: head_dim 256): O is staged in Q's tile instead. A warpgroup
// stages its rows once its own warps are done with them, and Q is released once every warp has read its
// rows out; the producer issues the next tile's first key tiles before it waits for that.
//
// prefill_fwd runs the epilogue's barriers itself, then store_tile: in a function of their own, the barriers moved
// code around them (the PTX of sm_100's 128-row mma.sync kernels). Before the store: TMA, every consumer warp is
// done with sQ (the producer has left); OWN_O: O has a tile of its own; O_IN_Q: the warpgroup's wgmma, which read
// its 64 rows of sQ, have landed in each of its warps. cp.async: with one stage, a CTA with no KV tile never
// committed Q's copies, hence the wait for all. VARLEN: the sequence's first row is read again rather than held
// across the loop (registers). O_IN_Q: the staging addresses are the same every pass, and ptxas kept them from the
// kernel's start in local memory (head_dim 256's 32 column tiles), reloaded one by one in every epilogue, a long
// stall a tile: the thread's coordinates plus a zero that depends on the pass (z = m0 >> 31) make them this pass's.
namespace attngen {

// A row's final normalisation with an attention sink (SINKS): the head's sink logit s joins the softmax
// denominator as one more term that adds no value. The row's state is its max m in raw score units and its sum l
// of exp(x - m sm_scale); with M = max(m sm_scale, s) the denominator is l exp(m sm_scale - M) + exp(s - M), O
// takes exp(m sm_scale - M) over it, and the LSE is M + log of it: no exp can overflow, whatever the finite sink.
// A row that saw no key (l = 0) gets O = 0 and LSE s; a sink of -inf leaves the row as it was.
struct SinkRow {
  float inv;  // O's factor
  float lse;
};
__device__ __forceinline__ SinkRow sink_row(float sink, float row_max, float l, float sm_scale) {
  const float m = l > 0.f ? row_max * sm_scale : -ATTNGEN_INF;
  const float top = fmaxf(m, sink);
  const float keep = l > 0.f ? expf(m - top) : 0.f;
  const float total = l * keep + (sink == -ATTNGEN_INF ? 0.f : expf(sink - top));
  return {total > 0.f ? keep / total : 0.f, total > 0.f ? top + logf(total) : -ATTNGEN_INF};
}

// The epilogue: normalise O (SINKS: with the head's sink in the denominator, sink_row), write the LSE, stage O
// through this warp's rows of sO (layout LO) and store it with 16-byte writes of whole rows. q_row0: VARLEN, the
// sequence's first row.
template <bool BF16, bool RETURN_LSE, bool VARLEN, int WARP_M, int HEAD_DIM_V, class LO, bool SINKS, int M_TILES,
          int D_TILES, class T>
__device__ __forceinline__ void store_tile(float (&acc_o)[M_TILES][D_TILES][4], const float (&row_max)[M_TILES][2],
                                           const float (&row_sum)[M_TILES][2], const PrefillParams<T>& p, T* sO,
                                           int m0, int warp_row0, int head, int batch, long long q_row0, int seqlen_q,
                                           int lane, int g, int t) {
  const float sink = SINKS ? p.sinks[head] : 0.f;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      float inv, sink_lse = 0.f;
      if constexpr (SINKS) {
        const SinkRow sr = sink_row(sink, row_max[mt][r], l, p.sm_scale);
        inv = sr.inv;
        sink_lse = sr.lse;
      } else {
        inv = l > 0.f ? 1.f / l : 0.f;
      }
#pragma unroll
      for (int d = 0; d < D_TILES; ++d) {
        acc_o[mt][d][2 * r] *= inv;
        acc_o[mt][d][2 * r + 1] *= inv;
      }
      if constexpr (RETURN_LSE) {
        const int i = m0 + warp_row0 + mt * 16 + g + 8 * r;
        if (t == 0 && i < seqlen_q) {
          const float lse = SINKS ? sink_lse : l > 0.f ? row_max[mt][r] * p.sm_scale + logf(l) : -ATTNGEN_INF;
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

template <class K>
struct FwdEpilogue {
  using T = typename K::T;
  // PERSISTENT: this warp's rows of the staging tile read out before the next query tile's are written there.
  static __device__ __forceinline__ void release(unsigned bars, int lane) {
    if constexpr (K::O_IN_Q) {
      // its rows of sQ read out, through the generic proxy, before the producer's TMA writes the next Q there
      WgmmaOps<K::BF16>::fence_proxy();
      __syncwarp();
      if (lane == 0) WgmmaOps<K::BF16>::mbar_arrive(K::qe_bar(bars));
    } else {
      __syncwarp();  // every lane has read its rows of sO before the next tile's are written
    }
  }
};

}  // namespace attngen
