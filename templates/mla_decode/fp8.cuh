// MLA decode against an fp8 latent cache (the spec's kv_dtype): ckv and kpe travel through the cp.async ring as fp8,
// half the bytes of a 16-bit cache, one padded byte row a key (ckv then kpe, an odd number of 16-byte chunks, so the
// 8 rows of one ldmatrix fall on distinct bank groups), and each warp reads its fragments straight from the slot and
// widens them in registers (common/fp8.cuh): K of S = Q K^T is the whole row, V of O += P V its ckv columns, the same
// bytes. Both MMAs run in fp16: a bf16 q is carried into fp16 by a power of two 2^k chosen per CTA (fp16_shift_of),
// P is rounded to fp16. k_scale (one for the cache, as serving engines keep it) and 2^-k multiply the softmax scale
// (the LSE included), k_scale the split's output once at its end. On sm_90a's wgmma kernel the tiles are widened in
// shared memory instead (mla_decode/fp8_wgmma.cuh), into fp16 as well: its Q is loaded as it is and then carried into
// fp16 by the same 2^k in shared memory, and k_scale and 2^-k are folded in the same way (run, finish).
namespace attngen {

// The fp8 kernel's parameter (what attngen.families.mla_decode.op packs): MlaParams, then the cache's scale, read
// from the device where k_scale is set, else k_scale_f. The module's merge entries take MlaParams alone.
template <class T>
struct MlaFp8Params {
  MlaParams<T> p;
  const float* k_scale;  // [] or [1] fp32, or null
  float k_scale_f;
};

// The wgmma kernel's (TMA ring): tensor maps of the fp8 ckv and kpe (bytes, unswizzled boxes), then MlaFp8Params.
template <class T>
struct MlaFp8TmaParams {
  TmaDesc maps[2];
  MlaFp8Params<T> f;
};

template <class K>
struct MlaFp8 {
  using T = typename K::Elem;
  static constexpr bool BF16 = K::IS_BF16, PAGED = K::PAGED_, QK_SHARD = K::QK_SHARD_;
  static constexpr int FMT = K::KV_FP8_;
  static constexpr int DC = K::DC_, DR = K::DR_, DQK = K::DQK, ROW = K::ROW, P_ROW = K::P_ROW;
  static constexpr int ROWS = K::ROWS_, BLOCK_N = K::BLOCK_N_, THREADS = K::THREADS;
  static constexpr int SN = K::SN, ON = K::ON;
  static constexpr int CHUNKS = DQK / 16;  // 16-byte chunks of a cache row (16 columns each)
  static constexpr int ROW_BYTES = K::FP8_ROW_BYTES;
  static_assert(FMT == 1 || FMT == 2, "fp8 format");
  static_assert(ROW_BYTES == (CHUNKS | 1) * 16 && CHUNKS % 2 == 0 && ON % 32 == 0, "fp8 tile shape");

  // Where Q's chunk of columns [col, col + 16) of packed row gr (token x head) of batch row `batch` lies.
  static __device__ __forceinline__ const uint4* q_chunk(const MlaParams<T>& p, int batch, int gr, int col) {
    const int2 th = K::token_head(p, gr);
    const T* src = col < DC ? p.q_nope + batch * p.qn_sb + th.x * p.qn_ss + th.y * p.qn_sh + col
                            : p.q_pe + batch * p.qp_sb + th.x * p.qp_ss + th.y * p.qp_sh + col - DC;
    return reinterpret_cast<const uint4*>(src);
  }

  // bf16 q: the power of two that carries the CTA's Q rows into fp16 (fp16_shift_of), through `scratch` (shared
  // memory free until Q is stored); fp16 q: 0. Every thread of the CTA (the wgmma kernel's producer warpgroup too).
  static __device__ __forceinline__ int q_shift(const MlaParams<T>& p, unsigned* scratch) {
    if constexpr (!BF16) return 0;
    constexpr int ALL = THREADS + K::PRODUCER_THREADS;
    const int tid = threadIdx.x, batch = blockIdx.z, r_begin = blockIdx.y * ROWS;
    const int valid = min(ROWS, p.q_len * p.num_heads - r_begin);
    unsigned m = 0;
    for (int idx = tid; idx < valid * CHUNKS; idx += ALL) {
      const int r = idx / CHUNKS;
      const uint4* src = q_chunk(p, batch, r_begin + r, (idx - r * CHUNKS) * 16);
      const uint4 x[2] = {src[0], src[1]};
#pragma unroll
      for (int h = 0; h < 2; ++h) m = bf16x8_finite_max(x[h], m);
    }
    return fp16_shift_of<ALL>(m, scratch, tid);
  }

  // Q into shared memory in fp16 (bf16 q times 2^k), each chunk in the fp8 fragments' order (fp8_chunk_order); rows
  // past the packed ones are zeros. Plain loads and stores: the ring's first barrier orders them before any read.
  static __device__ __forceinline__ void load_q(const MlaParams<T>& p, T* sQ, int batch, int r_begin, int rows_total,
                                                int k, int tid) {
    const float f = __int_as_float((127 + k) << 23);
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS;
      const int col = (idx - r * CHUNKS) * 16;
      uint4 x[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
      if (r_begin + r < rows_total) {
        const uint4* src = q_chunk(p, batch, r_begin + r, col);
        x[0] = src[0];
        x[1] = src[1];
      }
      if constexpr (BF16) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int w = 0; w < 4; ++w) (&x[h].x)[w] = bf16x2_to_f16x2_scaled((&x[h].x)[w], f);
      }
      fp8_chunk_order(x, *reinterpret_cast<uint4*>(sQ + r * ROW + col),
                      *reinterpret_cast<uint4*>(sQ + r * ROW + col + 8));
    }
  }

  // COLS bytes (columns) of the tile's rows from `base` (byte strides s_blk, s_pos) into byte columns [col0, col0 +
  // COLS) of the slot at `tile`: each thread keeps one 16-byte chunk and steps down the rows; rows at or past the
  // sequence are zero-filled. Paged: the tile's table entries in `pages` (MlaTiles::load_cols). Blocks of a
  // multiple of 16 rows take one lookup a thread per 16-row group and step its pointer down the group: a lookup
  // a row (two shuffles and a 64-bit product a 16-byte copy) made the copies a large share of the instructions
  // that bound the kernel.
  template <int COLS>
  static __device__ __forceinline__ void load_cols(unsigned char* tile, int col0, const unsigned char* base,
                                                   long long s_blk, long long s_pos, const MlaParams<T>& p,
                                                   typename K::Pages pages, int n0, int seqlen, int tid) {
    constexpr int CH = COLS / 16;
    constexpr int ROW_STEP = THREADS / CH;
    static_assert(THREADS % CH == 0, "fp8 copies");
    const int c = (tid % CH) * 16;
    unsigned char* dst = tile + col0 + c;
    if constexpr (PAGED && !K::PAGE_ROWS_ && ROW_STEP <= 16) {
      static_assert(16 % ROW_STEP == 0 && BLOCK_N % 16 == 0, "fp8 paged copies");
      constexpr int PER = 16 / ROW_STEP;  // a thread's rows in one 16-row group
      const int r0 = tid / CH;
      const int live = seqlen - n0 - r0;  // the thread's row k (row r0 + k ROW_STEP) is in the sequence below this
      unsigned char* row0 = dst + r0 * ROW_BYTES;
      // (groups unrolled, each group's pointer lived across the others' copies and spilled sm_89's 16-row tile)
#pragma unroll 1
      for (int grp = 0; grp < BLOCK_N / 16; ++grp) {
        const int2 at = MlaTiles<K>::block_slot(pages, grp * 16 + r0, p);
        const unsigned char* src = base + at.x * s_blk + at.y * s_pos + c;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const int k = grp * PER + i;
          cp_async_16(smem_addr(row0 + k * ROW_STEP * ROW_BYTES), src, k * ROW_STEP < live);
          src += ROW_STEP * s_pos;
        }
      }
      return;
    }
#pragma unroll 2
    for (int r = tid / CH; r < BLOCK_N; r += ROW_STEP) {
      const bool ok = n0 + r < seqlen;
      const unsigned char* src = base;
      if constexpr (PAGED) {
        // clamped to the pool, and in it whether or not the row is live (MlaTiles::block_slot)
        const int2 at = MlaTiles<K>::block_slot(pages, r, p);
        src = base + at.x * s_blk + at.y * s_pos + c;
      } else if (ok) {
        src = base + (n0 + r) * s_pos + c;
      }
      cp_async_16(smem_addr(dst + r * ROW_BYTES), src, ok);
    }
  }

  // A tile (first key n0) of batch row `batch`'s ckv and kpe into ring slot `slot` (T elements from the ring's start).
  // The caches are fp8 bytes: their strides count bytes (MlaDecode::run's ckv and kpe step by T elements).
  static __device__ __forceinline__ void load_tile(T* slot, const MlaParams<T>& p, int batch, typename K::Pages pages,
                                                   int n0, int seqlen, int tid) {
    unsigned char* dst = reinterpret_cast<unsigned char*>(slot);
    const unsigned char* ckv = reinterpret_cast<const unsigned char*>(p.ckv) + (PAGED ? 0 : batch * p.c_sb);
    const unsigned char* kpe = reinterpret_cast<const unsigned char*>(p.kpe) + (PAGED ? 0 : batch * p.p_sb);
    load_cols<DC>(dst, 0, ckv, p.c_sb, p.c_ss, p, pages, n0, seqlen, tid);
    load_cols<DR>(dst, DC, kpe, p.p_sb, p.p_ss, p, pages, n0, seqlen, tid);
  }

  // S = Q K^T for this warp's 16 rows (row0..) and SN keys (key0..) of the fp8 tile at sT, in fp16; acc_s2 the second
  // chain where a warp has few keys (MlaConsumer::scores says why). Per pair of chunks (32 columns): Q's two A
  // fragments, then per 16 keys one x4 (keys 0-7 and 8-15 of both chunks), or per 8 keys one x2.
  static __device__ __forceinline__ void scores(const T* sQ, const T* sT, int row0, int key0, int lane,
                                                float (&acc_s)[SN / 8][4], float (&acc_s2)[SN / 8][4]) {
    constexpr int CHAINS = SN <= 16 ? 2 : 1;
    const unsigned char* rows = reinterpret_cast<const unsigned char*>(sT);
#pragma unroll
    for (int n = 0; n < SN / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc_s[n][c] = acc_s2[n][c] = 0.f;
#pragma unroll CHAINS
    for (int j = 0; j < CHUNKS; j += 2) {
      unsigned a0[4], a1[4];
      const unsigned qa = smem_addr(sQ + (row0 + lane % 16) * ROW + j * 16 + (lane / 16) * 8);
      ldmatrix_x4(a0[0], a0[1], a0[2], a0[3], qa);
      ldmatrix_x4(a1[0], a1[1], a1[2], a1[3], qa + 32);
      if constexpr (SN % 16 == 0) {
#pragma unroll
        for (int n2 = 0; n2 < SN / 16; ++n2) {
          // registers: (keys 0-7, chunk j), (keys 0-7, j + 1), (keys 8-15, j), (keys 8-15, j + 1)
          const int key = key0 + n2 * 16 + (lane / 16) * 8 + lane % 8;
          unsigned x[4];
          ldmatrix_x4(x[0], x[1], x[2], x[3], smem_addr(rows + key * ROW_BYTES + (j + (lane / 8) % 2) * 16));
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            unsigned b0, b1, b2, b3;
            fp8x4_to_f16x2<FMT>(x[2 * h], b0, b1);
            fp8x4_to_f16x2<FMT>(x[2 * h + 1], b2, b3);
            mma_16816<false>(acc_s[2 * n2 + h], a0, b0, b1);
            mma_16816<false>(CHAINS == 2 ? acc_s2[2 * n2 + h] : acc_s[2 * n2 + h], a1, b2, b3);
          }
        }
      } else {
#pragma unroll
        for (int n = 0; n < SN / 8; ++n) {
          const int key = key0 + n * 8 + lane % 8;
          unsigned x0, x1, b0, b1, b2, b3;
          ldmatrix_x2(x0, x1, smem_addr(rows + key * ROW_BYTES + (j + (lane / 8) % 2) * 16));
          fp8x4_to_f16x2<FMT>(x0, b0, b1);
          fp8x4_to_f16x2<FMT>(x1, b2, b3);
          mma_16816<false>(acc_s[n], a0, b0, b1);
          mma_16816<false>(CHAINS == 2 ? acc_s2[n] : acc_s[n], a1, b2, b3);
        }
      }
    }
    if constexpr (CHAINS == 2)
#pragma unroll
      for (int n = 0; n < SN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc_s[n][c] += acc_s2[n][c];
  }

  // O += P V over the tile's keys and this warp's ON columns of ckv (the slot's first DC bytes a row), in fp16 (P
  // rounded to fp16); sharded, P goes through sP first. Each x4.trans reads 16 keys x 2 chunks; chunk j's even and odd
  // dims go to accumulator tiles 2j and 2j + 1 (finish puts them back).
  static __device__ __forceinline__ void pv(T* sP, const T* sT, int row0, int key0, int cg, int g, int t, int lane,
                                            const float (&acc_s)[SN / 8][4], float (&acc_o)[ON / 8][4]) {
    if constexpr (QK_SHARD) {
#pragma unroll
      for (int n = 0; n < SN / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r)
          *reinterpret_cast<unsigned*>(sP + (row0 + g + 8 * r) * P_ROW + key0 + n * 8 + 2 * t) =
              pack2<false>(acc_s[n][2 * r], acc_s[n][2 * r + 1]);
      __syncthreads();
    }
    const unsigned char* rows = reinterpret_cast<const unsigned char*>(sT);
    const int mat = lane / 8;
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      unsigned a[4];
      if constexpr (QK_SHARD) {
        ldmatrix_x4(a[0], a[1], a[2], a[3], smem_addr(sP + (row0 + lane % 16) * P_ROW + kk * 16 + (lane / 16) * 8));
      } else {
        p_fragment<false>(acc_s, kk, a);
      }
      const unsigned va = smem_addr(rows + (kk * 16 + (mat % 2) * 8 + lane % 8) * ROW_BYTES + cg * ON + (mat / 2) * 16);
#pragma unroll
      for (int j = 0; j < ON / 16; j += 2) {
        unsigned x[4];
        ldmatrix_x4_trans(x[0], x[1], x[2], x[3], va + j * 16);
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          unsigned even0, odd0, even1, odd1;  // keys 0-7 (b0) and 8-15 (b1) of the k16 step
          fp8x4_split_f16<FMT>(x[2 * s], even0, odd0);
          fp8x4_split_f16<FMT>(x[2 * s + 1], even1, odd1);
          mma_16816<false>(acc_o[2 * (j + s)], a, even0, even1);
          mma_16816<false>(acc_o[2 * (j + s) + 1], a, odd0, odd1);
        }
      }
    }
  }

  // The kernel: Q's power of two and the cache's scale folded into a copy of the parameters' softmax scales (the
  // LSE's too), then MlaDecode::run over fp8 tiles (maps: the wgmma kernel's TMA maps).
  static __device__ __forceinline__ void run(const MlaFp8Params<T>& params, const TmaDesc* maps = nullptr) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    MlaParams<T> p = params.p;
    const float ks = params.k_scale ? *params.k_scale : params.k_scale_f;
    const int k = q_shift(p, reinterpret_cast<unsigned*>(smem_raw));
    const float f = ks * __int_as_float((127 - k) << 23);
    p.sm_scale *= f;
    p.scale_log2 *= f;
    K::run(p, maps, k, ks);
  }

  // O times the cache's scale; mma.sync: its columns back in order (the epilogue's layout) first.
  static __device__ __forceinline__ void finish(float (&acc_o)[ON / 8][4], float scale, int lane, int t) {
    if constexpr (K::WGMMA_) {
#pragma unroll
      for (int d = 0; d < ON / 8; ++d)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc_o[d][c] *= scale;
    } else {
      fp8_dims_in_order<ON / 16>(acc_o, scale, lane, t);
    }
  }
};

}  // namespace attngen
