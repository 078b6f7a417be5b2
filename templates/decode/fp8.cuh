// Decode against an fp8 KV cache (the spec's kv_dtype): K and V tiles travel through the cp.async ring as fp8, half
// the bytes of a 16-bit cache (what a decode step is bound by), and each warp reads its MMA fragments straight from
// the fp8 slots and widens them in registers (DecodeFp8Consumer, decode/fp8_consumer.cuh), so each cache byte
// crosses shared memory once. The widening is exact: every e4m3 and e5m2 value is an fp16 and a bf16 value. Both
// MMAs run in fp16 whatever q's dtype, as an fp8 value becomes an fp16 one in one instruction (sm_89+'s cvt; e5m2:
// a byte permute): P is rounded to fp16 for P V (probabilities in [0, 1]: fp16 keeps more of their bits than bf16),
// and a bf16 q is scaled by a power of two into fp16 (DecodeFp8::load_q: exact but for elements under 2^-28 of the
// CTA's largest |q|, rounded at 2^-39 of it, far below the fp32 accumulation's own rounding). The
// dequantisation scales cost nothing a key: k_scale multiplies the softmax scale of the CTA's KV head, v_scale the
// split's output once at its end (each split's own, so the merge is unchanged).
namespace attngen {

template <class S>
struct DecodeFp8Consumer;

template <class S>
struct DecodeFp8 {
  using T = typename S::T;
  using L = typename S::L;
  using Cta = typename S::Cta;
  using Lane = typename S::Lane;
  using Load = DecodeProducer<S>;
  using Math = DecodeConsumer<S>;
  using Fp8Math = DecodeFp8Consumer<S>;
  static constexpr bool BF16 = S::BF16, PAGED = S::PAGED, LOCAL = S::LOCAL;
  static constexpr int HEAD_DIM = S::HEAD_DIM, ROWS = S::ROWS, BLOCK_N = S::BLOCK_N, THREADS = S::THREADS;
  static constexpr int M_TILES = S::M_TILES, D_TILES = S::D_TILES, KW_TILES = S::KW_TILES;
  static constexpr int NUM_STAGES = S::NUM_STAGES, Q_ELEMS = S::Q_ELEMS;
  static constexpr int CHUNKS = Fp8Math::CHUNKS, ROW_BYTES = Fp8Math::ROW_BYTES, TILE_BYTES = Fp8Math::TILE_BYTES;
  static_assert(S::KV_FP8 == 1 || S::KV_FP8 == 2, "fp8 format");
  static_assert(HEAD_DIM % 16 == 0 && S::D_PARTS == 1, "fp8 rows: 16-byte chunks, one CTA a KV head");

  // The source of Q's 16-column chunk `col` of packed row r (a valid one).
  static __device__ __forceinline__ const uint4* q_chunk(const DecodeParams<T>& p, const Cta& c, int r, int col) {
    const int qi = r / p.group;
    const int head = c.kv_head * p.group + (r - qi * p.group);
    if constexpr (S::VARLEN) {
      return reinterpret_cast<const uint4*>(p.q + (long long)(S::q0_of(p, c) + qi) * p.q_ss + head * p.q_sh + col);
    } else {
      return reinterpret_cast<const uint4*>(p.q + c.batch * p.q_sb + qi * p.q_ss + head * p.q_sh + col);
    }
  }

  // bf16 q: the power of two k that carries the CTA's q into fp16 (fp16_shift_of, common/fp8.cuh). A reduction over
  // the CTA through shared memory (`scratch`, free until Q is stored), once.
  static __device__ __forceinline__ int q_shift(const DecodeParams<T>& p, const Cta& c, int tid, unsigned* scratch) {
    unsigned m = 0;  // the largest finite |q| as bf16 bits (ordered as integers)
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS;
      if (r < c.rows_valid) {
        const uint4* src = q_chunk(p, c, r, (idx - r * CHUNKS) * 16);
        const uint4 x[2] = {src[0], src[1]};
#pragma unroll
        for (int h = 0; h < 2; ++h) m = bf16x8_finite_max(x[h], m);
      }
    }
    return fp16_shift_of<THREADS>(m, scratch, tid);
  }

  // Q into shared memory in fp16 (bf16 q times 2^k; fp16 q as it is), each 16-column chunk in the order the fp8 K
  // fragments read the head dim (fp8_chunk_order, common/fp8.cuh). Plain loads and stores (the ring's first barrier orders them before any read); rows past the
  // packed ones are zeros.
  static __device__ __forceinline__ void load_q(T* sQ, const DecodeParams<T>& p, const Cta& c, int k, int tid) {
    const float f = __int_as_float((127 + k) << 23);
    for (int idx = tid; idx < ROWS * CHUNKS; idx += THREADS) {
      const int r = idx / CHUNKS;
      const int col = (idx - r * CHUNKS) * 16;
      uint4 x[2] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
      if (r < c.rows_valid) {
        const uint4* src = q_chunk(p, c, r, col);
        x[0] = src[0];
        x[1] = src[1];
      }
      if constexpr (BF16) {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int w = 0; w < 4; ++w) (&x[h].x)[w] = bf16x2_to_f16x2_scaled((&x[h].x)[w], f);
      }
      fp8_chunk_order(x, *reinterpret_cast<uint4*>(sQ + L::offset(r, col)),
                      *reinterpret_cast<uint4*>(sQ + L::offset(r, col + 8)));
    }
  }

  // Where a row's chunks divide among the threads (every swizzled row: 2 to 16 chunks), each thread copies one
  // chunk column of rows STEP apart: its shared-memory offsets step by a constant (the swizzle repeats every 8
  // rows), its cache addresses by a stride, and a paged cache's table entries of a tile are read one tile ahead
  // (Pages), as the 16-bit kernel's producer does (decode/producer.cuh).
  static constexpr bool FIXED = THREADS % CHUNKS == 0 && Fp8Math::SWIZZLED;
  static constexpr int STEP = FIXED ? THREADS / CHUNKS : 1;
  static constexpr int ITERS = FIXED ? (BLOCK_N + STEP - 1) / STEP : 1;
  static_assert(!FIXED || STEP % 8 == 0, "a thread's rows keep one swizzle phase");

  struct Pages {
    int block[PAGED && FIXED ? ITERS : 1];  // as loaded (0 past the sequence); load_rows clamps them
  };

  static __device__ __forceinline__ void lookup(Pages& pg, const DecodeParams<T>& p, const Cta& c, int tile, int tid) {
    if constexpr (PAGED && FIXED) {
      const int r0 = tid / CHUNKS;
      // Entries by a 32-bit index from the table's start (the launch checks the table's extent fits:
      // check_paged): the row's start is one uniform value, where c.table, a 64-bit pointer the copies' registers
      // left no room for, was rebuilt for every lookup.
      const unsigned row = (unsigned)c.batch * (unsigned)p.bt_sb;
#pragma unroll
      for (int i = 0; i < ITERS; ++i) {
        const int pos = tile * BLOCK_N + r0 + i * STEP;
        pg.block[i] = (BLOCK_N % STEP == 0 || r0 + i * STEP < BLOCK_N) && pos < c.seqlen
                          ? p.block_table[row + (unsigned)Load::block_of(pos, p, c)] : 0;
      }
    }
  }

  // Rows [tile * BLOCK_N, + BLOCK_N) of the CTA's head of the K and V caches into a ring slot (its rows swizzled or
  // padded: DecodeFp8Consumer::at); rows at or past the sequence (LOCAL: or before key_lo) are zero-filled, so
  // their keys and values are zeros as in the 16-bit kernel.
  static __device__ __forceinline__ void load_rows(unsigned char* dk, unsigned char* dv, const DecodeParams<T>& p,
                                                   const Cta& c, const Pages& pg, int tile, int tid) {
    // The head's (contiguous: and the cache row's) start in bytes: c.k - p.k counts elements, one byte each here.
    const unsigned char* kb = reinterpret_cast<const unsigned char*>(p.k) + (c.k - p.k);
    const unsigned char* vb = reinterpret_cast<const unsigned char*>(p.v) + (c.v - p.v);
    if constexpr (FIXED) {
      const int r0 = tid / CHUNKS, j = tid % CHUNKS;
      const int at = Fp8Math::at(r0, j);
      const int pos0 = tile * BLOCK_N + r0;
      if constexpr (PAGED) {
        // Strides in 32 bits (the launch checks they fit: decode/fp8.py check_paged): a row's block and slot
        // offsets are one 32 x 32 -> 64-bit multiply-add each, where products of 64-bit strides took several
        // instructions each, for every row of every tile.
        const unsigned ksb = (unsigned)p.k_sb, vsb = (unsigned)p.v_sb, kss = (unsigned)p.k_ss, vss = (unsigned)p.v_ss;
        const unsigned char* kj = kb + j * 16;
        const unsigned char* vj = vb + j * 16;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
          if (BLOCK_N % STEP == 0 || r0 + i * STEP < BLOCK_N) {
            const int pos = pos0 + i * STEP;
            const bool ok = pos < c.seqlen && (!LOCAL || pos >= c.key_lo);
            // the address is in the pool whether or not the row is in the sequence (the block clamped, the slot
            // in it), so it is not chosen on ok
            const unsigned blk = (unsigned)min(max(pg.block[i], 0), p.num_blocks - 1);
            const unsigned slot = (unsigned)(pos - Load::block_of(pos, p, c) * p.block_size);
            cp_async_16(smem_addr(dk + at + i * STEP * ROW_BYTES),
                        kj + (unsigned long long)blk * ksb + (unsigned long long)slot * kss, ok);
            cp_async_16(smem_addr(dv + at + i * STEP * ROW_BYTES),
                        vj + (unsigned long long)blk * vsb + (unsigned long long)slot * vss, ok);
          }
        }
      } else {
        // a tile wholly inside the live keys (all but a row's first and last) copies without a check a row
        const bool whole = (tile + 1) * BLOCK_N <= c.seqlen && (!LOCAL || tile * BLOCK_N >= c.key_lo);
        const unsigned char* gk = kb + pos0 * p.k_ss + j * 16;
        const unsigned char* gv = vb + pos0 * p.v_ss + j * 16;
        const long long sk = STEP * p.k_ss, sv = STEP * p.v_ss;
        if (whole) {
#pragma unroll
          for (int i = 0; i < ITERS; ++i) {
            if (BLOCK_N % STEP == 0 || r0 + i * STEP < BLOCK_N) {
              cp_async_16(smem_addr(dk + at + i * STEP * ROW_BYTES), gk + i * sk, true);
              cp_async_16(smem_addr(dv + at + i * STEP * ROW_BYTES), gv + i * sv, true);
            }
          }
        } else {
#pragma unroll
          for (int i = 0; i < ITERS; ++i) {
            if (BLOCK_N % STEP == 0 || r0 + i * STEP < BLOCK_N) {
              const int pos = pos0 + i * STEP;
              const bool ok = pos < c.seqlen && (!LOCAL || pos >= c.key_lo);
              // (past the cache's rows a zero-filled copy still names an address inside it)
              cp_async_16(smem_addr(dk + at + i * STEP * ROW_BYTES), ok ? gk + i * sk : kb, ok);
              cp_async_16(smem_addr(dv + at + i * STEP * ROW_BYTES), ok ? gv + i * sv : vb, ok);
            }
          }
        }
      }
    } else {
      // padded rows (an odd chunk count): each thread steps over (row, chunk) pairs, a paged row reading its block
      // from the table (clamped to the pool) as it goes
      constexpr int TOTAL = BLOCK_N * CHUNKS;
#pragma unroll
      for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
        const int idx = it * THREADS + tid;
        if (TOTAL % THREADS == 0 || idx < TOTAL) {
          const int r = idx / CHUNKS;
          const int j = idx - r * CHUNKS;
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
          const int at = Fp8Math::at(r, j);
          cp_async_16(smem_addr(dk + at), kb + ko + j * 16, ok);
          cp_async_16(smem_addr(dv + at), vb + vo + j * 16, ok);
        }
      }
    }
  }

  // Decode::fused (decode/fused.cuh) over fp8 tiles: the ring holds fp8 slots, the consumer widens its fragments as
  // it reads them, and the parameters carry the KV head's k_scale in the softmax scale (the LSE included).
  static __device__ __forceinline__ void fused(const DecodeParams<T>& params) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    unsigned char* rK = reinterpret_cast<unsigned char*>(sQ + Q_ELEMS);
    unsigned char* rV = rK + NUM_STAGES * TILE_BYTES;
    const Cta c = S::cta_of(params);
    if constexpr (S::VARLEN) {
      if (c.rows_valid == 0) return;  // a request with no token or more than the rows take: nothing written
    }
    const Lane l = S::lane_of();
    DecodeParams<T> p = params;
    const float ks = params.k_scale ? params.k_scale[c.kv_head * params.k_scale_sh] : 1.f;
    const float vs = params.v_scale ? params.v_scale[c.kv_head * params.v_scale_sh] : params.v_scale_f;
    p.sm_scale *= ks;
    p.scale_log2 *= ks;

    Pages pg;
    lookup(pg, p, c, c.tile_begin, l.tid);
    const auto load = [&](int tile, int slot) {
      load_rows(rK + slot * TILE_BYTES, rV + slot * TILE_BYTES, p, c, pg, tile, l.tid);
      lookup(pg, p, c, tile + 1, l.tid);
    };
    Load::ring_fill(c, load);
    // (after the fill: the first tiles' copies are in flight while Q's loads wait) The scores come out times 2^k,
    // which the softmax scale takes back (the LSE included).
    const int k = BF16 ? q_shift(p, c, l.tid, reinterpret_cast<unsigned*>(smem_raw)) : 0;
    load_q(sQ, p, c, k, l.tid);
    p.sm_scale *= __int_as_float((127 - k) << 23);
    p.scale_log2 *= __int_as_float((127 - k) << 23);
    float acc_o[M_TILES][D_TILES][4];
    float row_max[M_TILES][2], row_sum[M_TILES][2];
    Math::zero(acc_o);
    Math::start_rows(row_max, row_sum);
    int lim[M_TILES][2];
    Math::row_limits(lim, p, c, l);
    typename Math::TreeWords tw;
    Math::tree_words(tw, p, c, l);
    typename Math::QFrag q_frag;

    Load::ring(
        c, load,
        [&](int tile, int it, int slot) {
          const int n0 = tile * BLOCK_N;
          float acc_s[M_TILES][KW_TILES][4];
          if (it == 0) Math::load_q_frags(q_frag, sQ, l);
          Fp8Math::scores(acc_s, q_frag, sQ, rK + slot * TILE_BYTES, l);
          if constexpr (S::TREE) {
            if (Math::needs_mask(p, c, n0, l)) Math::mask_tree(acc_s, tw, n0, p, c, l);
          } else {
            if (Math::needs_mask(p, c, n0, l)) Math::mask_scores(acc_s, lim, n0, p, c, l);
          }
          float corr[M_TILES][2];
          Math::softmax_step(acc_s, row_max, row_sum, corr, p.scale_log2);
          // O's rescale, skipped (warp-uniformly) where no row of the warp has a new max: corr is then exactly 1
          bool grew = false;
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) grew |= corr[mt][0] != 1.f || corr[mt][1] != 1.f;
          if (__any_sync(0xffffffffu, grew)) scale_rows(acc_o, corr);
          Fp8Math::accumulate_pv(acc_o, acc_s, rV + slot * TILE_BYTES, l);
        });
    // the output's head dims back in order, and v_scale: the split's unnormalised output once, before the epilogue
    // normalises it
    Fp8Math::finish(acc_o, vs, l);
    DecodeEnd<S>::epilogue(p, c, smem_raw, acc_o, row_max, row_sum, l);
  }
};

}  // namespace attngen
