// Decode against an fp8 KV cache (the spec's kv_dtype): K and V tiles travel through the cp.async ring as fp8, half
// the bytes of a 16-bit cache (what a decode step is bound by), and are widened in shared memory to q's dtype before
// the 16-bit kernel's MMAs (DecodeConsumer, decode/consumer.cuh). The widening is exact: every e4m3 and e5m2 value
// is an fp16 and a bf16 value. The dequantisation scales cost nothing a key: k_scale multiplies the softmax scale of
// the CTA's KV head, v_scale the split's output once at its end (each split's own, so the merge is unchanged).
namespace attngen {

// Two e4m3 values (the low 16 bits of x, the first in the low byte) -> fp16x2 (the first in the low half), by bits,
// for archs without cvt's fp8 forms (sm_80, sm_86). Each byte's exponent and mantissa move into fp16's places
// (an exponent 8 short of fp16's bias), and a multiply by 2^8 restores the bias: exact, and it normalises e4m3's
// subnormals (fp16 arithmetic keeps subnormal inputs). e4m3 has no infinities; its NaN (magnitude 0x7f) would
// come out as 480 and is set back to a NaN.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2_bits(unsigned x) {
  const unsigned h = __byte_perm(x, 0u, 0x1404);  // each byte at the top of its 16-bit half
  const unsigned mag = (h >> 1) & 0x3f803f80u;
  unsigned r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(mag | (h & 0x80008000u)), "r"(0x5c005c00u));
  return r | ((mag & 0xffffu) == 0x3f80u ? 0x7e00u : 0u) | ((mag >> 16) == 0x3f80u ? 0x7e000000u : 0u);
}

// Two fp8 values of format FMT (1: e4m3, 2: e5m2) in the low 16 bits of x -> fp16x2, the first in the low half.
template <int FMT>
__device__ __forceinline__ unsigned fp8x2_to_f16x2(unsigned x) {
  if constexpr (FMT == 2) {
    // e5m2 is the top byte of an fp16 (sign, 5-bit exponent of bias 15, the mantissa's first 2 bits): one byte
    // permute on every arch, cheaper than cvt.
    return __byte_perm(x, 0u, 0x1404);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)x));
    return r;
#else
    return e4m3x2_to_f16x2_bits(x);
#endif
  }
}

// Two fp8 values -> two of q's dtype in one register, the first in the low half. bf16 through fp32: every fp16
// value an fp8 value widens to is a bf16 value (at most 4 significant bits, exponents from -16 to 15).
template <bool BF16, int FMT>
__device__ __forceinline__ unsigned fp8x2_widen(unsigned x) {
  const unsigned h = fp8x2_to_f16x2<FMT>(x);
  if constexpr (BF16) {
    float lo, hi;
    asm("{.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, u;\n}"
        : "=f"(lo), "=f"(hi) : "r"(h));
    return pack2<true>(lo, hi);
  } else {
    return h;
  }
}

template <class S>
struct DecodeFp8 {
  using T = typename S::T;
  using L = typename S::L;
  using Cta = typename S::Cta;
  using Lane = typename S::Lane;
  using Load = DecodeProducer<S>;
  using Math = DecodeConsumer<S>;
  static constexpr bool BF16 = S::BF16, PAGED = S::PAGED, LOCAL = S::LOCAL;
  static constexpr int FMT = S::KV_FP8, HEAD_DIM = S::HEAD_DIM, BLOCK_N = S::BLOCK_N, THREADS = S::THREADS;
  static constexpr int M_TILES = S::M_TILES, D_TILES = S::D_TILES, KW_TILES = S::KW_TILES;
  static constexpr int NUM_STAGES = S::NUM_STAGES, TILE_ELEMS = S::TILE_ELEMS, Q_ELEMS = S::Q_ELEMS;
  // A ring slot: BLOCK_N dense rows of HEAD_DIM bytes, copied in 16-byte chunks.
  static constexpr int CHUNKS = HEAD_DIM / 16, TILE_BYTES = BLOCK_N * HEAD_DIM;
  // Past head_dim 128 one widened tile takes K, then V (a barrier more a tile): two did not fit beside the ring
  // on the archs of 99 KB of shared memory at 16 rows (DecodeSpec.fp8_tiles counts the same).
  static constexpr int WIDE_TILES = HEAD_DIM > 128 ? 1 : 2;
  static_assert(S::KV_FP8 == 1 || S::KV_FP8 == 2, "fp8 format");
  static_assert(HEAD_DIM % 16 == 0 && S::D_PARTS == 1, "fp8 rows: 16-byte chunks, one CTA a KV head");

  // Rows [tile * BLOCK_N, + BLOCK_N) of the CTA's head of the K and V caches into a ring slot; rows at or past the
  // sequence (LOCAL: or before key_lo) are zero-filled, so their widened keys and values are zeros as in the 16-bit
  // kernel. A paged row reads its block from the table (clamped to the pool) as it goes.
  static __device__ __forceinline__ void load_rows(unsigned char* dk, unsigned char* dv, const DecodeParams<T>& p,
                                                   const Cta& c, int tile, int tid) {
    // The head's (contiguous: and the cache row's) start in bytes: c.k - p.k counts elements, one byte each here.
    const unsigned char* kb = reinterpret_cast<const unsigned char*>(p.k) + (c.k - p.k);
    const unsigned char* vb = reinterpret_cast<const unsigned char*>(p.v) + (c.v - p.v);
    constexpr int TOTAL = BLOCK_N * CHUNKS;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
      const int idx = it * THREADS + tid;
      if (TOTAL % THREADS == 0 || idx < TOTAL) {
        const int r = idx / CHUNKS;
        const int col = (idx - r * CHUNKS) * 16;
        const int pos = tile * BLOCK_N + r;
        const bool ok = pos < c.seqlen && (!LOCAL || pos >= c.key_lo);
        long long ko = 0, vo = 0;
        if (ok) {
          if constexpr (PAGED) {
            const int b = Load::block_of(pos, p, c);
            const long long blk = min(max(c.table[b], 0), p.num_blocks - 1);
            const long long slot = pos - b * p.block_size;
            ko = blk * p.k_sb + slot * p.k_ss;
            vo = blk * p.v_sb + slot * p.v_ss;
          } else {
            ko = pos * p.k_ss;
            vo = pos * p.v_ss;
          }
        }
        cp_async_16(smem_addr(dk + r * HEAD_DIM + col), kb + ko + col, ok);
        cp_async_16(smem_addr(dv + r * HEAD_DIM + col), vb + vo + col, ok);
      }
    }
  }

  // A landed fp8 tile -> the tile of q's dtype the consumer reads (its swizzled or padded rows): each thread widens
  // 8 bytes into one 16-byte chunk, so a warp's reads and writes are both contiguous runs.
  static __device__ __forceinline__ void widen(T* dst, const unsigned char* src, int tid) {
    constexpr int TOTAL = BLOCK_N * HEAD_DIM / 8;
#pragma unroll
    for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
      const int idx = it * THREADS + tid;
      if (TOTAL % THREADS != 0 && idx >= TOTAL) break;
      const int r = idx / (HEAD_DIM / 8);
      const int col = (idx - r * (HEAD_DIM / 8)) * 8;
      const uint2 x = *reinterpret_cast<const uint2*>(src + r * HEAD_DIM + col);
      *reinterpret_cast<uint4*>(dst + L::offset(r, col)) =
          make_uint4(fp8x2_widen<BF16, FMT>(x.x), fp8x2_widen<BF16, FMT>(x.x >> 16),
                     fp8x2_widen<BF16, FMT>(x.y), fp8x2_widen<BF16, FMT>(x.y >> 16));
    }
  }

  // Decode::fused (decode/fused.cuh) over fp8 tiles: the ring holds fp8 slots, each tile is widened into one K and
  // one V tile of q's dtype (WIDE_TILES: or K, then V, in one; a barrier after each widening, the ring's own barrier
  // before the next tile's), and the
  // parameters carry the KV head's k_scale in the softmax scale (the LSE included).
  static __device__ __forceinline__ void fused(const DecodeParams<T>& params) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Q_ELEMS;
    T* sV = sK + (WIDE_TILES - 1) * TILE_ELEMS;
    unsigned char* rK = reinterpret_cast<unsigned char*>(sK + WIDE_TILES * TILE_ELEMS);
    unsigned char* rV = rK + NUM_STAGES * TILE_BYTES;
    const Cta c = S::cta_of(params);
    const Lane l = S::lane_of();
    DecodeParams<T> p = params;
    const float ks = params.k_scale ? params.k_scale[c.kv_head * params.k_scale_sh] : 1.f;
    const float vs = params.v_scale ? params.v_scale[c.kv_head * params.v_scale_sh] : params.v_scale_f;
    p.sm_scale *= ks;
    p.scale_log2 *= ks;

    Load::load_q(sQ, p, c, l.tid);
    const auto load = [&](int tile, int slot) {
      load_rows(rK + slot * TILE_BYTES, rV + slot * TILE_BYTES, p, c, tile, l.tid);
    };
    Load::ring_fill(c, load);
    float acc_o[M_TILES][D_TILES][4];
    float row_max[M_TILES][2], row_sum[M_TILES][2];
    Math::zero(acc_o);
    Math::start_rows(row_max, row_sum);
    int lim[M_TILES][2];
    Math::row_limits(lim, p, c, l);
    typename Math::QFrag q_frag;

    Load::ring(
        c, load,
        [&](int tile, int it, int slot) {
          widen(sK, rK + slot * TILE_BYTES, l.tid);
          if constexpr (WIDE_TILES == 2) widen(sV, rV + slot * TILE_BYTES, l.tid);
          __syncthreads();
          const int n0 = tile * BLOCK_N;
          float acc_s[M_TILES][KW_TILES][4];
          Math::tile_scores(acc_s, q_frag, sQ, sK, lim, it, n0, p, c, l);
          float corr[M_TILES][2];
          Math::softmax_step(acc_s, row_max, row_sum, corr, p.scale_log2);
          scale_rows(acc_o, corr);
          if constexpr (WIDE_TILES == 1) {
            __syncthreads();  // every warp is done with the widened K
            widen(sV, rV + slot * TILE_BYTES, l.tid);
            __syncthreads();
          }
          Math::accumulate_pv(acc_o, acc_s, sV, l);
        });
    // v_scale: the split's unnormalised output once, before the epilogue normalises it.
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int d = 0; d < D_TILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[mt][d][e] *= vs;
    DecodeEnd<S>::epilogue(p, c, smem_raw, acc_o, row_max, row_sum, l);
  }
};

}  // namespace attngen
