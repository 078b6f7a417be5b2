// The consumer side of an fp8-cache decode CTA (DecodeFp8, decode/fp8.cuh), per warp: S = Q K^T and O += P V in
// fp16 MMAs, with K and V read as fragments straight from the ring's fp8 slots and widened in registers (the rest
// of a tile's work, masks and the online softmax, is DecodeConsumer's).
//
// How ldmatrix reads fp8 rows as K and V fragments, and the chunk order of Q and O that follows: common/fp8.cuh (Q's
// chunks are stored in that order by DecodeFp8::load_q; finish() puts O's dims back).
// The ring's rows are swizzled (16-byte chunk index XOR a function of the row) where a row's chunk count is a power
// of two, else padded to an odd number of chunks: either way the 8 rows of one matrix, and a warp's cp.async
// writes, fall on distinct bank groups.
namespace attngen {

template <class S>
struct DecodeFp8Consumer {
  using T = typename S::T;
  using Lane = typename S::Lane;
  using Math = DecodeConsumer<S>;
  static constexpr bool Q_IN_REGS = S::Q_IN_REGS;
  static constexpr int FMT = S::KV_FP8, HEAD_DIM = S::HEAD_DIM, BLOCK_N = S::BLOCK_N;
  static constexpr int M_TILES = S::M_TILES, KW = S::KW, KW_TILES = S::KW_TILES, D_TILES = S::D_TILES;
  // 16-byte chunks of an fp8 row (16 head dims each); a slot's row stride and size in bytes.
  static constexpr int CHUNKS = HEAD_DIM / 16;
  static constexpr bool SWIZZLED = (CHUNKS & (CHUNKS - 1)) == 0;
  static constexpr int ROW_BYTES = SWIZZLED ? HEAD_DIM : (CHUNKS | 1) * 16;
  static constexpr int TILE_BYTES = BLOCK_N * ROW_BYTES;
  // Swizzled rows: LINE_ROWS rows share a 128-byte line, and chunk j of row r sits at j ^ ((r / LINE_ROWS) % SPAN),
  // so 8 consecutive rows' chunk j take the line's 8 16-byte bank groups once each.
  static constexpr int SPAN = CHUNKS < 8 ? CHUNKS : 8;
  static constexpr int LINE_ROWS = CHUNKS < 8 ? 8 / CHUNKS : 1;
  static_assert(KW % 16 == 0 && D_TILES == 2 * CHUNKS, "fp8 tile shape");

  // Byte offset of chunk j of row r in a slot.
  static __device__ __forceinline__ int at(int r, int j) {
    if constexpr (SWIZZLED) {
      return r * ROW_BYTES + ((j ^ ((r / LINE_ROWS) % SPAN)) << 4);
    } else {
      return r * ROW_BYTES + (j << 4);
    }
  }

  // Q's A fragment of 16-row tile mt over chunk kk: kept in registers (Q_IN_REGS) or read from shared memory.
  static __device__ __forceinline__ void q_at(unsigned (&a)[4], const typename Math::QFrag& q_frag, const T* sQ,
                                              int mt, int kk, const Lane& l) {
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = q_frag[mt][kk][e];
    } else {
      Math::q_fragment(a, sQ, mt, kk, l);
    }
  }

  // S = Q K^T over this warp's KW keys of the fp8 K slot sK, Q in fp16 (unmasked; Math::mask_scores masks). Each x4
  // reads 16 keys x 2 chunks: registers (keys 0-7, chunk j), (keys 8-15, j), (keys 0-7, j + 1), (keys 8-15, j + 1); an
  // odd last chunk takes an x2.
  static __device__ __forceinline__ void scores(float (&acc_s)[M_TILES][KW_TILES][4],
                                                const typename Math::QFrag& q_frag, const T* sQ,
                                                const unsigned char* sK, const Lane& l) {
    Math::zero(acc_s);
    const int mat = l.lane / 8;
#pragma unroll
    for (int j = 0; j < CHUNKS; j += 2) {
      const bool pair = j + 1 < CHUNKS;
      unsigned a[2][M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        q_at(a[0][mt], q_frag, sQ, mt, j, l);
        if (pair) q_at(a[1][mt], q_frag, sQ, mt, j + 1, l);
      }
#pragma unroll
      for (int n2 = 0; n2 < KW_TILES / 2; ++n2) {
        const int key = l.key0 + n2 * 16 + (mat % 2) * 8 + l.lane % 8;
        unsigned x[4];
        if (pair) {
          ldmatrix_x4(x[0], x[1], x[2], x[3], smem_addr(sK + at(key, j + mat / 2)));
        } else {
          ldmatrix_x2(x[0], x[1], smem_addr(sK + at(key, j)));
        }
#pragma unroll
        for (int s = 0; s < (pair ? 2 : 1); ++s)
#pragma unroll
          for (int h = 0; h < 2; ++h) {  // keys 0-7, then 8-15 of the 16: n8 tiles 2 n2 and 2 n2 + 1
            unsigned b0, b1;
            fp8x4_to_f16x2<FMT>(x[2 * s + h], b0, b1);
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) mma_16816<false>(acc_s[mt][2 * n2 + h], a[s][mt], b0, b1);
          }
      }
    }
  }

  // O += P V over this warp's KW keys of the fp8 V slot sV, in fp16 (P rounded to fp16, V widened to it). Each
  // x4.trans reads 16 keys x 2 chunks, registers in the order scores() takes them; chunk j's even and odd dims go
  // to accumulator tiles 2j and 2j + 1.
  static __device__ __forceinline__ void accumulate_pv(float (&acc_o)[M_TILES][D_TILES][4],
                                                       const float (&acc_p)[M_TILES][KW_TILES][4],
                                                       const unsigned char* sV, const Lane& l) {
    const int mat = l.lane / 8;
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      unsigned a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) p_fragment<false>(acc_p[mt], kk, a[mt]);
      const int key = l.key0 + kk * 16 + (mat % 2) * 8 + l.lane % 8;
#pragma unroll
      for (int j = 0; j < CHUNKS; j += 2) {
        const bool pair = j + 1 < CHUNKS;
        unsigned x[4];
        if (pair) {
          ldmatrix_x4_trans(x[0], x[1], x[2], x[3], smem_addr(sV + at(key, j + mat / 2)));
        } else {
          ldmatrix_x2_trans(x[0], x[1], smem_addr(sV + at(key, j)));
        }
#pragma unroll
        for (int s = 0; s < (pair ? 2 : 1); ++s) {
          unsigned even0, odd0, even1, odd1;  // keys 0-7 (b0) and 8-15 (b1) of the k16 step
          fp8x4_split_f16<FMT>(x[2 * s], even0, odd0);
          fp8x4_split_f16<FMT>(x[2 * s + 1], even1, odd1);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
            mma_16816<false>(acc_o[mt][2 * (j + s)], a[mt], even0, even1);
            mma_16816<false>(acc_o[mt][2 * (j + s) + 1], a[mt], odd0, odd1);
          }
        }
      }
    }
  }

  // O's accumulator back in the 16-bit kernel's layout (DecodeEnd's epilogue reads tile d as columns 8d + 2t,
  // 8d + 2t + 1), times v_scale: fp8_dims_in_order (common/fp8.cuh) per 16-row tile, once a CTA.
  static __device__ __forceinline__ void finish(float (&acc_o)[M_TILES][D_TILES][4], float vs, const Lane& l) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) fp8_dims_in_order<CHUNKS>(acc_o[mt], vs, l.lane, l.t);
  }
};

}  // namespace attngen
