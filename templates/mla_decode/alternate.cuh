// MLA decode, qk_shard=alternate (sm_90a: wgmma, the TMA ring, 64-key tiles, two slots): the loop of
// MlaDecode (mla_decode/fwd.cuh) for this form, from Q in shared memory to the accumulators the epilogue
// stores.
//
// Warpgroup 0 takes the even tiles of the split and warpgroup 1 the odd ones, each computing S for its whole tile (a 64-key wgmma, so
// no QK work is repeated and no S wgmma is narrower than 64 keys); warpgroup 0 holds O's left half
// of the columns, warpgroup 1 the right. Per pair of tiles (a in slot 0, b in slot 1):
//   wg0: S_a, its row max m0 and P_a, O_L = O_L s0 + P_a V_a,L;   -> s0, m0 (BAR_S0)
//   wg1: S_b, m1 = max(m0, rowmax S_b), P_b;   -> s1, m1 (BAR_S1), P_b (BAR_P1)
//   wg0: P_a s1 -> shared (BAR_P0); O_L = O_L s1 + P_b V_b,L;   wg1: O_R = O_R s0 s1 + (P_a s1) V_a,R + P_b V_b,R
// so one warpgroup's softmax runs while the other's MMAs do. Each half of a slot (ckv's left
// columns; its right columns and kpe) has its own mbarrier and is refilled by the warpgroup that
// reads it last: warpgroup 0 the left halves, warpgroup 1 the right. Q's rope columns move to
// registers, and their shared memory holds P_b. Paged blocks of any size (GATHER, mla_decode/gather.cuh): a
// producer warpgroup gathers the halves instead, each into its own half of the slot once the warpgroup that
// reads it last hands it back (where the TMA form refills it).
namespace attngen {

template <class K>
struct MlaAlternate {
  using T = typename K::Elem;
  using LQ = typename K::LQ;
  using LT = typename K::LT;
  using LP = typename K::LP;
  using W = WgmmaOps<K::IS_BF16>;
  using Tiles = MlaTiles<K>;
  static constexpr bool BF16 = K::IS_BF16;
  static constexpr int DC = K::DC_, DR = K::DR_, ROWS = K::ROWS_, BLOCK_N = K::BLOCK_N_, TILE_ELEMS = K::TILE_ELEMS;

  static constexpr int HALF_BLOCKS = DC / 128;  // ckv blocks of one half
  static constexpr int ROPE_KK = DR / 16;
  static constexpr bool GATHER = K::GATHER;

  // The mbarrier that says half `half` of `slot` has landed (the gather's full_half, MlaGather, is the same one).
  static __device__ __forceinline__ unsigned half_bar(unsigned bar0, int slot, int half) {
    return bar0 + 16 * slot + 8 * half;
  }
  // Half `half` of `slot` waited for until landed; a gathered half (written through the generic proxy) fenced for
  // the wgmma reads.
  static __device__ __forceinline__ void wait_half(unsigned bar0, int slot, int half, unsigned par) {
    W::mbar_wait(half_bar(bar0, slot, half), par);
    if constexpr (GATHER) W::fence_proxy();
  }
  // Half HALF of `slot`, read for the last time by this warpgroup: refilled with tile `tile` where the split has it
  // (`more`), by TMA from the warpgroup's first thread (BOX_LANES: its first warp, a box a lane,
  // MlaTiles::tma_tile_lanes); or (GATHER) handed back to the producer warpgroup, which gathers the next tile into it.
  template <int HALF>
  static __device__ __forceinline__ void refill_half(const MlaParams<T>& p, const TmaDesc* maps, unsigned ring,
                                                unsigned bar0, const int* table, int batch, int seqlen, int wtid,
                                                bool more, int tile, int slot) {
    if constexpr (GATHER) {
      if (wtid == 0) W::mbar_arrive(K::ProducerWg::free_half(bar0, slot, HALF));
    } else if constexpr (K::BOX_LANES_) {
      if (wtid < 32 && more)
        Tiles::template tma_tile_lanes<HALF * HALF_BLOCKS, (HALF + 1) * HALF_BLOCKS, HALF == 1>(
            p, maps, ring, half_bar(bar0, slot, HALF), Tiles::box_entry(p, table, seqlen, tile, wtid), seqlen, tile,
            slot, wtid);
    } else if (wtid == 0 && more) {
      Tiles::template tma_tile<HALF * HALF_BLOCKS, (HALF + 1) * HALF_BLOCKS, HALF == 1>(
          p, maps, ring, half_bar(bar0, slot, HALF), table, batch, seqlen, tile, slot);
    }
  }

  // The steps of run's loop (lambdas of run once; taking what they read, they compile to the same code).

  // This warpgroup's columns of V, in rows past the sequence of tile `tile` (in `slot`): zeroed,
  // as a box may have read them from the cache (P is 0 there, V must be finite).
  static __device__ __forceinline__ void zero_tail(T* sRing, int seqlen, int wg, int wtid, int slot, int tile) {
    const int valid = seqlen - tile * BLOCK_N;
    if (GATHER || valid >= BLOCK_N) return;  // (the gather zero-fills rows past the sequence)
    Tiles::template zero_rows<DC / 2>(sRing + slot * TILE_ELEMS, valid, wg * (DC / 2), wtid, 128);
    W::fence_proxy();
    W::bar_sync(5 + wg, 128);
  }
  // S = Q K^T of the tile in `slot`, all 64 keys; keys past a row's token masked. Each half of the tile
  // is waited for just before its k-steps, the half refilled first (`first`) taken first.
  static __device__ __forceinline__ void scores(const MlaParams<T>& p, T* sQ, unsigned ring, unsigned bar0,
                                                unsigned (&rq)[ROPE_KK][4], const int (&lim)[2], int t, int seqlen,
                                                int slot, int tile, int first, unsigned par,
                                                float (&sc)[BLOCK_N / 8][4]) {
#pragma unroll
    for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) sc[n][c] = 0.f;
    W::hold(sc);  // zeroed before the fence (operand copies after it: C7519, NVRTC 13.0)
    // the steps' descriptors as uniform adds to each tile's low word (WgmmaOps::desc_step)
    const unsigned q_lo = W::desc_lo(smem_addr(sQ), 16);
    const unsigned k_lo = W::desc_lo(ring + slot * TILE_ELEMS * (int)sizeof(T), 16);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int half = h ^ first;
      wait_half(bar0, slot, half, par);
      W::fence();  // after the wait's loop (before it: C7519, NVRTC 13.0)
#pragma unroll
      for (int kk = 0; kk < DC / 32; ++kk) {
        const int k = half * (DC / 32) + kk;
        Wgmma<BLOCK_N, BF16>::ss(sc, W::desc_step(q_lo, W::k_bytes(k, LQ::BLOCK_BYTES)),
                                 W::desc_step(k_lo, W::k_bytes(k, LT::BLOCK_BYTES)), h > 0 || kk > 0);
      }
      if (half == 1)
#pragma unroll
        for (int kk = 0; kk < ROPE_KK; ++kk)
          Wgmma<BLOCK_N, BF16>::template rs<0>(sc, rq[kk],
                                               W::desc_step(k_lo, W::k_bytes(DC / 16 + kk, LT::BLOCK_BYTES)));
    }
    W::commit();
    W::template wait<0>();
    W::hold(sc);
    Tiles::template mask_keys<BLOCK_N>(sc, tile * BLOCK_N, 0, seqlen, p.q_len, lim, t);
  }
  // Lazy rescaling (lazy_max, online_softmax.cuh): a factor is exactly 1 where a row kept its max, and a warp
  // whose rows all did skips the multiplies.
  static __device__ __forceinline__ void scale_o(float (&acc_o)[DC / 16][4], const float (&f)[2]) {
    if (__any_sync(0xffffffffu, f[0] != 1.f || f[1] != 1.f)) scale_rows(acc_o, f);
  }
  static __device__ __forceinline__ void store_p(T* dst, int row0, int g, int t, const float (&sc)[BLOCK_N / 8][4],
                                                 const float (&f)[2]) {
#pragma unroll
    for (int n = 0; n < BLOCK_N / 8; ++n)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        *reinterpret_cast<unsigned*>(dst + LP::offset(row0 + g + 8 * r, n * 8) + 2 * t) =
            pack2<BF16>(sc[n][2 * r] * f[r], sc[n][2 * r + 1] * f[r]);
  }
  // The descriptor low word of this warpgroup's V columns (its half of the ckv blocks) of the tile in `slot`.
  static __device__ __forceinline__ unsigned v_desc_lo(unsigned ring, int wg, int slot) {
    return W::desc_lo(ring + slot * TILE_ELEMS * (int)sizeof(T) + wg * HALF_BLOCKS * LT::BLOCK_BYTES, LT::BLOCK_BYTES);
  }
  // O += P V over this warpgroup's columns of the tile in `slot`: P from registers, or from shared memory.
  static __device__ __forceinline__ void pv_regs(float (&acc_o)[DC / 16][4], unsigned ring, int wg,
                                                 const float (&sc)[BLOCK_N / 8][4], int slot) {
    const unsigned v_lo = v_desc_lo(ring, wg, slot);
    // every P fragment packed, and held there, before the fence (packing between the wgmma: C7519, NVRTC 13.0)
    unsigned a[BLOCK_N / 16][4];
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      p_fragment<BF16>(sc, kk, a[kk]);
      asm volatile("" : "+r"(a[kk][0]), "+r"(a[kk][1]), "+r"(a[kk][2]), "+r"(a[kk][3]));
    }
    W::fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
      Wgmma<DC / 2, BF16>::rs(acc_o, a[kk], W::desc_step(v_lo, W::mn_bytes(kk)));
    W::commit();
  }
  static __device__ __forceinline__ void pv_smem(float (&acc_o)[DC / 16][4], unsigned ring, int wg, const T* sp,
                                                 int slot) {
    const unsigned v_lo = v_desc_lo(ring, wg, slot);
    const unsigned p_lo = W::desc_lo(smem_addr(sp), 16);
    W::fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
      Wgmma<DC / 2, BF16>::template ss<1>(acc_o, W::desc_step(p_lo, W::k_bytes(kk, LP::BLOCK_BYTES)),
                                          W::desc_step(v_lo, W::mn_bytes(kk)), 1);
    W::commit();
  }

  static __device__ __forceinline__ void run(const MlaParams<T>& p, const TmaDesc* maps, T* sQ, T* sRing, T* sP0,
                                             float* sX, unsigned bar0, const int* table, int batch, int seqlen,
                                             int tile_begin, int n_tiles, const int (&lim)[2], float (&acc_o)[DC / 16][4],
                                             float (&row_max)[2], float (&row_sum)[2]) {
    constexpr int BAR_S0 = 1, BAR_S1 = 2, BAR_P0 = 3, BAR_P1 = 4;  // named barriers of both warpgroups (256)
    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);  // warp-uniform to the compiler: no wgmma serialised
    const int wtid = tid % 128;
    const int row0 = (warp % 4) * 16;
    T* sP1 = sQ + (DC / 64) * ROWS * 64;
    float* sM0 = sX;
    float* sM1 = sX + ROWS;
    float* sSc0 = sX + 2 * ROWS;
    float* sSc1 = sX + 3 * ROWS;
    const float sl2 = p.scale_log2;
    const unsigned ring = smem_addr(sRing);

    unsigned rq[ROPE_KK][4];
#pragma unroll
    for (int kk = 0; kk < ROPE_KK; ++kk)
      ldmatrix_x4(rq[kk][0], rq[kk][1], rq[kk][2], rq[kk][3],
                  smem_addr(sQ + LQ::offset(row0 + lane % 16, DC + kk * 16 + (lane / 16) * 8)));
    K::consumers_sync();  // the rope block is P_b's from here on

    for (int j = 0; 2 * j < n_tiles; ++j) {
      const bool has_b = 2 * j + 1 < n_tiles;
      const int ta = tile_begin + 2 * j;
      const int tb = ta + 1;
      const int refill = 2 * j + 2;  // local index of the next tile of slot 0 (slot 1: refill + 1)
      const unsigned par = j & 1;
      float sc[BLOCK_N / 8][4];
      if (wg == 0) {
        scores(p, sQ, ring, bar0, rq, lim, t, seqlen, 0, ta, 0, par, sc);
        zero_tail(sRing, seqlen, wg, wtid, 0, ta);
        float s0[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          s0[r] = lazy_softmax_row<BLOCK_N>(sc, r, frag_row_max<BLOCK_N>(sc, r), row_max[r], row_sum[r], sl2);
          if (t == 0) {
            sM0[row0 + g + 8 * r] = row_max[r];
            sSc0[row0 + g + 8 * r] = s0[r];
          }
        }
        W::bar_arrive(BAR_S0, 256);
        scale_o(acc_o, s0);
        pv_regs(acc_o, ring, wg, sc, 0);
        W::bar_sync(BAR_S1, 256);
        float s1[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          s1[r] = sSc1[row0 + g + 8 * r];
          row_max[r] = sM1[row0 + g + 8 * r];
          row_sum[r] *= s1[r];
        }
        store_p(sP0, row0, g, t, sc, s1);
        W::fence_proxy();
        W::bar_arrive(BAR_P0, 256);
        W::template wait<0>();
        W::hold(acc_o);
        // Slot 0's left half is read by this warpgroup only: refilled now, the right half at the pair's end.
        refill_half<0>(p, maps, ring, bar0, table, batch, seqlen, wtid, refill < n_tiles, ta + 2, 0);
        scale_o(acc_o, s1);
        if (has_b) {
          wait_half(bar0, 1, 0, par);
          zero_tail(sRing, seqlen, wg, wtid, 1, tb);
          W::bar_sync(BAR_P1, 256);
          pv_smem(acc_o, ring, wg, sP1, 1);
          W::template wait<0>();
          W::hold(acc_o);
        }
        refill_half<0>(p, maps, ring, bar0, table, batch, seqlen, wtid, refill + 1 < n_tiles, tb + 2, 1);
      } else {
        if (has_b) {
          // The right half first where warpgroup 1's own TMA refill brought it back; gathered, the producer's
          // pairs fill the halves in the order they are handed back, and warpgroup 0 hands the left one back first.
          scores(p, sQ, ring, bar0, rq, lim, t, seqlen, 1, tb, GATHER ? 0 : 1, par, sc);
          zero_tail(sRing, seqlen, wg, wtid, 1, tb);
        }
        W::bar_sync(BAR_S0, 256);
        float f[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m0 = sM0[row0 + g + 8 * r];
          const float s0 = sSc0[row0 + g + 8 * r];
          float m1 = m0, s1 = 1.f, sum = 0.f;
          if (has_b) {
            m1 = lazy_max(m0, fmaxf(m0, frag_row_max<BLOCK_N>(sc, r)), sl2);
            const float base = m1 == -ATTNGEN_INF ? 0.f : m1 * sl2;
            s1 = m1 != m0 ? fast_exp2(m0 * sl2 - base) : 1.f;
            sum = frag_exp_row<BLOCK_N>(sc, r, sl2, base);
          }
          row_max[r] = m1;
          row_sum[r] = row_sum[r] * s0 * s1 + sum;
          f[r] = s0 * s1;
          if (t == 0) {
            sM1[row0 + g + 8 * r] = m1;
            sSc1[row0 + g + 8 * r] = s1;
          }
        }
        W::bar_arrive(BAR_S1, 256);
        scale_o(acc_o, f);
        if (has_b) {
          const float one[2] = {1.f, 1.f};
          store_p(sP1, row0, g, t, sc, one);
          W::fence_proxy();
          W::bar_arrive(BAR_P1, 256);
        }
        wait_half(bar0, 0, 1, par);
        zero_tail(sRing, seqlen, wg, wtid, 0, ta);
        W::bar_sync(BAR_P0, 256);
        pv_smem(acc_o, ring, wg, sP0, 0);
        if (has_b) pv_regs(acc_o, ring, wg, sc, 1);
        // Slot 0's right half, read last by P_a V_a,R, goes back first: the next pair's S_a waits on it.
        if (has_b)
          W::template wait<1>();
        else
          W::template wait<0>();
        refill_half<1>(p, maps, ring, bar0, table, batch, seqlen, wtid, refill < n_tiles, ta + 2, 0);
        W::template wait<0>();
        W::hold(acc_o);
        refill_half<1>(p, maps, ring, bar0, table, batch, seqlen, wtid, refill + 1 < n_tiles, tb + 2, 1);
      }
    }
  }
};

}  // namespace attngen
