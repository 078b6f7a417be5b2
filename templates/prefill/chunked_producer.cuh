// The chunked kernel's producer: a step's Q/K or V chunks into a ring slot, by cp.async from every thread
// (load_step; the first steps before the loop, first_steps) or, in the TMA form, by the one elected thread of a
// producer warpgroup (tma).
//
// TMA (wgmma, dense layout, V's columns unpadded): a producer warpgroup more, whose one elected thread
// loads Q's tile once, whole (a QK step's slot holds K's chunk alone: Q is not copied again each key
// tile), and issues every step's copies as TMA boxes into the ring, each slot once the
// consumers have released it (a full and an empty mbarrier a slot; the empty one counts a warp's arrival
// once the wgmma that read the slot has completed), so the ring runs NUM_STAGES steps ahead and no CTA
// barrier is left in the steps (V_TAIL: the tail step is one box of a 5-d map, each warpgroup's 32
// columns in a 64-column block of its own). The two warpgroups meet twice a tile: for the row max, and once both
// halves of P are written. setmaxnreg gives the producer's registers to them (240 a thread; the kernel is
// declared one CTA an SM, without which ptxas ignores setmaxnreg).
namespace attngen {

// Copy ROWS x COLS 16-bit elements into a tile of layout L with cp.async; tile column c (a multiple
// of 8) comes from global column col_of(c) of row r (src + r * stride); rows at or past valid_rows
// are zero-filled, and with CLIP_COLS so are columns at or past valid_cols. Each thread keeps one
// column and steps down the rows, so a copy's addresses are one pointer plus immediates.
template <class L, int ROWS, int COLS, int THREADS, bool CLIP_COLS = false, class T, class ColOf>
__device__ __forceinline__ void load_cols_async(T* dst, const T* src, long long stride, int valid_rows, int tid,
                                                ColOf col_of, int valid_cols = 0) {
  constexpr int CHUNKS = COLS / 8;
  static_assert(THREADS % CHUNKS == 0, "a thread keeps one column");
  constexpr int ROW_STEP = THREADS / CHUNKS;
  static_assert(!L::SWIZZLED || ROW_STEP % 8 == 0, "a swizzled tile's rows step by whole 8-row atoms");
  constexpr int ITERS = (ROWS + ROW_STEP - 1) / ROW_STEP;
  const int r0 = tid / CHUNKS;
  const int c = (tid % CHUNKS) * 8;
  const int gc = col_of(c);
  const T* s = src + r0 * stride + gc;
  if constexpr (CLIP_COLS) {
    if (gc >= valid_cols) valid_rows = 0;  // zeros; nothing is read
  }
  // (padded: the sum left to associate as written, which keeps the mma.sync kernels' machine code)
  const unsigned d = L::SWIZZLED ? smem_addr(dst + L::offset(r0, c)) : smem_addr(dst + r0 * L::ROW_ELEMS + c);
#pragma unroll
  for (int it = 0; it < ITERS; ++it) {
    const int r = r0 + it * ROW_STEP;
    if (ROWS % ROW_STEP == 0 || r < ROWS) {
      const bool ok = r < valid_rows;
      cp_async_16(d + it * ROW_STEP * L::ROW_ELEMS * 2, ok ? s : src, ok);
    }
    s += ROW_STEP * stride;
  }
}

template <class K>
struct ChunkedProducer {
  using T = typename K::T;
  static constexpr int THREADS = K::THREADS, BLOCK_M = K::BLOCK_M, BLOCK_N = K::BLOCK_N, DK = K::DK, VK = K::VK,
                       VC = K::VC, VCW = K::VCW, ON = K::ON, QK_STEPS = K::QK_STEPS, V_COL_STEPS = K::V_COL_STEPS;
  using LQ = typename K::LQ;
  using LK = typename K::LK;
  using LV = typename K::LV;
  using LVT = typename K::LVT;

  // Step s (0 <= s < STEPS) of KV tile `tile` into ring slot `slot`, by cp.async from every thread.
  // The step's column offset is made opaque to the compiler: otherwise, with the step loop
  // unrolled, it hoists every step's copy addresses out of the KV loop and holds them all (spills).
  __device__ __forceinline__ static void load_step(const PrefillParams<T>& p, const ChunkedSmem<K>& sm,
                                                   const ChunkedCta<K>& cta, int tile, int s, int slot) {
    T* dst = sm.ring + slot * K::STAGE_ELEMS;
    const int n0 = tile * BLOCK_N;
    if (s < QK_STEPS) {
      const int c0 = chunked_opaque(s * DK);
      auto col = [&](int c) { return c0 + c; };
      load_cols_async<LQ, BLOCK_M, DK, THREADS>(dst, cta.gQ, p.q_ss, cta.seqlen_q - cta.m0, cta.tid, col);
      load_cols_async<LK, BLOCK_N, DK, THREADS>(dst + BLOCK_M * (K::WGMMA ? DK : K::DK_ROW),
                                                cta.gK + (long long)n0 * p.k_ss, p.k_ss, cta.seqlen_k - n0, cta.tid,
                                                col);
    } else {
      const int v = s - QK_STEPS;
      const int k0 = n0 + chunked_opaque((v / V_COL_STEPS) * VK);
      const int c0 = chunked_opaque((v % V_COL_STEPS) * VCW);
      if (K::V_TAIL && v % V_COL_STEPS == V_COL_STEPS - 1) {
        // The tail: column c of the block belongs to warpgroup c / 32, its column ON - 32 + c % 32.
        load_cols_async<LVT, VK, 64, THREADS>(dst, cta.gV + (long long)k0 * p.v_ss, p.v_ss, cta.seqlen_k - k0,
                                              cta.tid, [&](int c) { return (c / 32) * ON + c0 + c % 32; });
      } else {
        // Step column c belongs to warp column c / VCW: output column (c / VCW) ON + c0 + c % VCW.
        load_cols_async<LV, VK, VC, THREADS, (K::DV_PAD > K::DV)>(
            dst, cta.gV + (long long)k0 * p.v_ss, p.v_ss, cta.seqlen_k - k0, cta.tid,
            [&](int c) { return (c / VCW) * ON + c0 + c % VCW; }, K::DV);
      }
    }
  }

  // cp.async: the ring's first AHEAD steps, before the loop.
  __device__ __forceinline__ static void first_steps(const PrefillParams<T>& p, const ChunkedSmem<K>& sm,
                                                     const ChunkedCta<K>& cta) {
    if (cta.n_tiles > 0) {
#pragma unroll
      for (int s = 0; s < K::AHEAD; ++s) {
        load_step(p, sm, cta, cta.tile_begin, s, s);
        cp_async_commit();
      }
    }
  }

  // TMA: the elected thread's work, every step's copies, each into the next ring slot once the consumers have
  // released it.
  __device__ __forceinline__ static void tma(const TmaDesc* maps, const ChunkedSmem<K>& sm, const ChunkedCta<K>& cta) {
    using W = WgmmaOps<K::BF16>;
    const int vs = cta.vs;
    // phase: the parity of the slot's current use, from the ring's first pass. (Declared before slot: the other
    // order, in this function, changed the order of the loop's registers and the SASS.)
    int phase = 0, slot = 0;
    if (cta.n_tiles > 0) {
      // Q's tile once (QK_PAIR: this CTA's half of its columns), in 64-column blocks
      W::mbar_expect(sm.q_bar(), K::Q_ELEMS * sizeof(T));
#pragma unroll
      for (int b = 0; b < K::QK_COLS / 64; ++b)
        W::tma_load(smem_addr(sm.q) + b * LQ::BLOCK_BYTES, maps, sm.q_bar(), (K::QK_PAIR ? vs * K::QK_COLS : 0) + 64 * b,
                    cta.m0, cta.head, cta.batch);
    }
    for (int it = 0; it < cta.n_tiles; ++it) {
      const int n0 = (cta.tile_begin + it) * BLOCK_N;
      for (int s = 0; s < K::STEPS; ++s) {
        if (it * K::STEPS + s >= K::NUM_STAGES) W::mbar_wait(sm.empty_bar(slot), phase ^ 1);
        const unsigned dst = smem_addr(sm.ring + slot * K::STAGE_ELEMS);
        const unsigned bar = sm.full_bar(slot);
        if (s < QK_STEPS) {
          W::mbar_expect(bar, BLOCK_N * DK * sizeof(T));
          const int c0 = (K::QK_PAIR ? vs * K::QK_COLS : 0) + s * DK;
#pragma unroll
          for (int b = 0; b < DK / 64; ++b)
            W::tma_load(dst + b * LK::BLOCK_BYTES, maps + 1, bar, c0 + 64 * b, n0, cta.kv_head, cta.batch);
        } else if (K::V_TAIL && (s - QK_STEPS) % V_COL_STEPS == V_COL_STEPS - 1) {
          // The tail step: one box of the 5-d map (32 columns, keys, the two warpgroups' tails, heads,
          // batch); TMA pads each 32-column row to the swizzle's 128 bytes, so each warpgroup's tail lands
          // in the first 32 columns of a block of its own (VK rows of 128 bytes).
          W::mbar_expect(bar, VK * 64 * sizeof(T));
          W::tma_load5(dst, maps + 3, bar, 0, n0 + ((s - QK_STEPS) / V_COL_STEPS) * VK, 2 * vs, cta.kv_head, cta.batch);
        } else {
          const int v = s - QK_STEPS;
          const int k0 = n0 + (v / V_COL_STEPS) * VK;
          const int c0 = vs * K::DV + (v % V_COL_STEPS) * VCW;
          W::mbar_expect(bar, VK * VC * sizeof(T));
          // block b of the step: warp column (64 b) / VCW's columns, (64 b) % VCW into them
#pragma unroll
          for (int b = 0; b < VC / 64; ++b)
            W::tma_load(dst + b * LV::BLOCK_BYTES, maps + 2, bar, c0 + (64 * b / VCW) * ON + (64 * b) % VCW, k0,
                        cta.kv_head, cta.batch);
        }
        if (++slot == K::NUM_STAGES) {
          slot = 0;
          phase ^= 1;
        }
      }
    }
  }
};

}  // namespace attngen
