// The consumer warps of prefill_fwd (prefill/fwd.cuh.jinja): pieces of the step of a KV tile
// (prefill/step.cuh.jinja), on one warp's rows: the scores' transform and key range before the softmax (the
// custom mask, which the step applies itself, between them), wgmma's issues of S = Q K^T and O += P V, and the
// overlapped schedules' turns and rescale.
//
// OVERLAP (TMA): step `it` issues S = Q K^T of tile it, then rescales O for tile it - 1's softmax and issues tile
// it - 1's O += P V; tile it's softmax runs while P V does, and P V is waited for only after it. The last tile's
// P V follows the loop. PINGPONG: the consumer warpgroups take turns issuing their GEMMs, in order, so that one's
// softmax runs under the others' GEMMs: warpgroup w waits on named barrier 2 + w before its GEMMs and arrives on
// the next one's after them. The last warpgroup lets warpgroup 0 go first and skips its last arrival: each barrier
// sees as many arrivals as waits. Each warp owns WARP_M = BLOCK_M / NUM_WARPS query rows (M_TILES
// tiles of 16) and the whole KV tile, so the softmax of a row never leaves its warp. S = Q K^T and O += P V run on
// mma.sync m16n8k16 with fp32 accumulators; the softmax is online, in fp32, with exp2 and the scale folded into
// one FMA. The accumulators hold the warp's rows m0 + warp_row0 + 16 mt + g (+8) and this thread's columns
// 8 n + 2 t (+1) of a tile, as mma.sync's C fragment (and wgmma's) lays them out.
//
// WGMMA (sm_90a): each warpgroup of 4 warps owns 64 query rows; S = Q K^T reads Q and K from shared memory through
// descriptors, O += P V takes P from registers (the S accumulators packed to 16 bits, the same fragment as
// mma.sync's A) and V through a transposed descriptor. Tiles are then stored 128-byte swizzled (WgmmaLayout); the
// softmax and epilogue are the same code.
namespace attngen {

// The logits transforms V (softcap, ALiBi: common/variant.cuh) on this warp's scores, before the masks.
template <class V, int M_TILES, int N_TILES, class T>
__device__ __forceinline__ void transform_scores(float (&acc_s)[M_TILES][N_TILES][4], const PrefillParams<T>& p,
                                                 const KeyRange& keys, int m0, int warp_row0, int n0, int g, int t,
                                                 const typename V::State& vstate, int batch, int head) {
  if constexpr (V::LOGITS) {
    const int col0 = n0 + 2 * t;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pos = m0 + warp_row0 + mt * 16 + g + 8 * r + keys.shift;  // the row's aligned key position
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            acc_s[mt][n][2 * r + c] =
                V::logits(p, vstate, acc_s[mt][n][2 * r + c], Pair(batch, head, pos, col0 + n * 8 + c));
      }
  }
}

template <int BLOCK_N, int M_TILES, int N_TILES>
__device__ __forceinline__ void mask_key_range(float (&acc_s)[M_TILES][N_TILES][4], const KeyRange& keys, int m0,
                                               int warp_row0, int warp_lo, int warp_hi, int n0, int g, int t) {
  // ---- mask (only tiles some row cannot see whole) --------------------------------------
  if (!keys.all_visible(warp_lo, warp_hi, n0, n0 + BLOCK_N)) {
    // One visible key range [lo, hi) per row, relative to this thread's first column, then a
    // compare per element: fewer live values than testing every (row, key) pair.
    const int col0 = n0 + 2 * t;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = m0 + warp_row0 + mt * 16 + g + 8 * r;
        const int lo = keys.lo(i) - col0;
        const int hi = keys.hi(i) - col0;
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = n * 8 + c;
            if (j < lo || j >= hi) acc_s[mt][n][2 * r + c] = -ATTNGEN_INF;
          }
      }
  }
}

// The pieces that take the kernel's constants (traits.cuh): wgmma's issues. The step's other pieces (mma.sync's
// S = Q K^T and O += P V, the custom mask's bits, the softmax, the packing of P for wgmma) stay in its text: each
// moved into a function renumbered the PTX's registers, which ptxas allocates from, and changed the machine code:
// the mma.sync loops and the mask bits on sm_80 (P V at 2 row tiles a warp), the softmax on sm_90a's persistent
// ping-pong kernel, P's packing on sm_90a. So do the accumulators' first values (prefill/fwd.cuh.jinja: in a
// function, sm_80's head_dim 256 kernel's PTX was reordered).
template <class K>
struct FwdConsumer {
  using T = typename K::T;
  static constexpr int M_TILES = K::M_TILES;
  static constexpr int N_TILES = K::N_TILES;
  static constexpr int D_TILES = K::D_TILES;
  static constexpr bool BF16 = K::BF16;
  // LAZY_RESCALE (wgmma; lazy_max in online_softmax.cuh): a warp multiplies its O by the correction only where
  // one of its rows took a new max (o_moved, the same in the whole warp). Not for a 64-column O under a mask, where
  // the multiplies it saves are few and rows move often, so the check costs about what it saves; nor in the paged
  // kernels, where it did not pay either. Wider O rows save more multiplies a skipped correction.
  static constexpr bool LAZY_RESCALE =
      K::WGMMA && !K::PAGED && (K::HEAD_DIM_V > 64 || (K::MASK == MASK_NONE && !K::MASK_LIST));
  // Where O takes the correction. Head_dim 64 (RESCALE_IN_TURN): in the turn, between S = Q K^T's issue and
  // P V's, where the multiplies run while S does; its softmax, not its GEMMs, is what a step waits on. Larger
  // head dims: once the P V before has landed. With the loop as it was before the first step ran apart (see
  // step_body), an accumulator access in the turn made ptxas wait for S to land before P V could issue
  // (C7517, NVRTC 13.0), so the larger head dims, whose P V is the longer wait, took it out of the turn; at 64
  // it stayed, where the softmax is the wait. Since, the turn is free of that wait at every head dim, and
  // the two places time alike at 128 and 256. (At the turn's start, before S's issue, ptxas serialised every
  // wgmma: C7515.)
  static constexpr bool RESCALE_IN_TURN = K::HEAD_DIM <= 64;

  // S = Q K^T issued on wgmma: Q rows of this warpgroup x the K tile (the step commits and waits).
  static __device__ __forceinline__ void qk_wgmma(float (&acc_s)[M_TILES][N_TILES][4], const T* sQ, const T* sKs,
                                                  int warp) {
    using W = WgmmaOps<BF16>;  // compiled only where called: WgmmaOps exists on sm_90a alone
    const unsigned q_lo = W::desc_lo_warp(smem_addr(sQ) + (warp / 4) * 64 * 128, 16);  // the warpgroup's Q rows
    const unsigned k_lo = W::desc_lo(smem_addr(sKs), 16);
    W::fence();
#pragma unroll
    for (int kk = 0; kk < K::K_STEPS; ++kk) {
      const unsigned long long dq = W::desc_step(q_lo, W::k_bytes(kk, K::LQ::BLOCK_BYTES));
      const unsigned long long dk = W::desc_step(k_lo, W::k_bytes(kk, K::LK::BLOCK_BYTES));
      if constexpr (K::FP8)
        Wgmma<K::BLOCK_N, BF16>::ss8(acc_s[0], dq, dk, kk > 0);
      else
        Wgmma<K::BLOCK_N, BF16>::ss(acc_s[0], dq, dk, kk > 0);
    }
  }

  // Q_SCALED (spec q_scaled: a score_mod kernel whose sm_scale is a power of two): this warp's 16 rows of Q's tile as
  // wgmma's A fragments, times sm_scale, read once a query tile. The product is exact (a power of two moves the
  // exponent alone; in fp16, but for q below 2^-14 / sm_scale: choose.scales_exactly), so S = Q K^T then holds the
  // logits themselves and score_mod takes them with no multiply.
  static __device__ __forceinline__ void load_q_scaled(unsigned (&q)[K::K_STEPS][4], const T* sQ, int warp_row0,
                                                       int lane, float sm_scale) {
    const unsigned s2 = pack2<BF16>(sm_scale, sm_scale);
#pragma unroll
    for (int kk = 0; kk < K::K_STEPS; ++kk) {
      ldmatrix_x4(q[kk][0], q[kk][1], q[kk][2], q[kk][3],
                  smem_addr(sQ + K::LQ::offset(warp_row0 + (lane % 16), kk * 16 + (lane / 16) * 8)));
#pragma unroll
      for (int c = 0; c < 4; ++c) q[kk][c] = mul2<BF16>(q[kk][c], s2);
    }
  }

  // S = Q K^T issued on wgmma with Q's fragments in registers (load_q_scaled; the step commits and waits).
  static __device__ __forceinline__ void qk_wgmma_rs(float (&acc_s)[M_TILES][N_TILES][4],
                                                     const unsigned (&q)[K::K_STEPS][4], const T* sKs) {
    using W = WgmmaOps<BF16>;
    const unsigned k_lo = W::desc_lo(smem_addr(sKs), 16);
    W::fence();
#pragma unroll
    for (int kk = 0; kk < K::K_STEPS; ++kk)
      Wgmma<K::BLOCK_N, BF16>::template rs<0>(acc_s[0], q[kk], W::desc_step(k_lo, W::k_bytes(kk, K::LK::BLOCK_BYTES)),
                                              kk > 0);
  }

  // O += P V issued on wgmma, P packed in a, V (N-major) at v_at (the step commits and waits). FP8: P in e4m3 in
  // the first BLOCK_N / 32 of a (p_fragment8), V transposed (K-major).
  static __device__ __forceinline__ void pv_wgmma(float (&acc_o)[M_TILES][D_TILES][4],
                                                  const unsigned (&a)[K::BLOCK_N / 16][4], unsigned v_at) {
    using W = WgmmaOps<BF16>;  // compiled only where called: WgmmaOps exists on sm_90a alone
    W::fence();
    if constexpr (K::FP8) {
      const unsigned v_lo = W::desc_lo(v_at, 16);
#pragma unroll
      for (int kk = 0; kk < K::BLOCK_N / 32; ++kk)
        Wgmma<K::HEAD_DIM_V, BF16>::rs8(acc_o[0], a[kk], W::desc_step(v_lo, W::k_bytes(kk, K::LV::BLOCK_BYTES)));
    } else {
      const unsigned v_lo = W::desc_lo(v_at, K::LV::BLOCK_BYTES);
#pragma unroll
      for (int kk = 0; kk < K::BLOCK_N / 16; ++kk)
        Wgmma<K::HEAD_DIM_V, BF16>::rs(acc_o[0], a[kk], W::desc_step(v_lo, W::mn_bytes(kk)));
    }
  }

  // P packed for O += P V: 16-bit, or FP8 e4m3 (p_fragment8).
  static __device__ __forceinline__ void pack_p(const float (&s)[N_TILES][4], unsigned (&a)[K::BLOCK_N / 16][4]) {
    if constexpr (K::FP8) {
#pragma unroll
      for (int kk = 0; kk < K::BLOCK_N / 32; ++kk) p_fragment8(s, kk, a[kk]);
    } else {
#pragma unroll
      for (int kk = 0; kk < K::BLOCK_N / 16; ++kk) p_fragment<BF16>(s, kk, a[kk]);
    }
  }

  // PINGPONG: warpgroup wg's turn to issue its GEMMs begins, and ends (last: after the query tile's last P V).
  static __device__ __forceinline__ void turn_begin(int wg) {
    if constexpr (K::PINGPONG) WgmmaOps<BF16>::bar_sync(2 + wg, 256);
  }
  static __device__ __forceinline__ void turn_end(int wg, bool last) {
    if constexpr (K::PINGPONG) {
      constexpr int GROUPS = K::GROUPS;
      // (two warpgroups: spelled as before three existed, which keeps their machine code)
      if (!last || (GROUPS == 2 ? wg == 0 : wg != GROUPS - 1))
        WgmmaOps<BF16>::bar_arrive(GROUPS == 2 ? 3 - wg : 2 + (wg + 1) % GROUPS, 256);
    }
  }
  // PINGPONG: before a query tile's first turn, the last warpgroup lets warpgroup 0 go first.
  static __device__ __forceinline__ void turn_start(int wg, int n_tiles) {
    constexpr int GROUPS = K::GROUPS;
    if constexpr (K::PINGPONG && K::PERSISTENT) {
      // The same, without a branch on the warpgroup: the others arrive on barrier 2 + GROUPS, which nothing
      // waits on (4 warps complete it). Between one query tile's wgmma and the next, a branch taken by one
      // warpgroup made ptxas serialise them (C7519, NVRTC 13.5).
      const bool lead = wg == GROUPS - 1 && n_tiles > 0;
      WgmmaOps<BF16>::bar_arrive(lead ? 2 : 2 + GROUPS, lead ? 256 : 128);
    } else if constexpr (K::PINGPONG) {
      if (wg == GROUPS - 1 && n_tiles > 0) WgmmaOps<BF16>::bar_arrive(2, 256);
    }
  }

  // O takes the softmax's correction (LAZY_RESCALE: only where a row of the warp's took a new max).
  static __device__ __forceinline__ void rescale_o(float (&acc_o)[M_TILES][D_TILES][4],
                                                   const float (&corr_o)[M_TILES][2], bool o_moved) {
    if (!LAZY_RESCALE || o_moved) scale_rows(acc_o, corr_o);
  }

  // VARLEN (TMA): V's rows past the sequence's end (the next sequence's) zeroed once V has landed, before a
  // warpgroup's P V reads them: their P is zero, but 0 x inf is NaN. Every warpgroup clears them for itself (the
  // others write the same zeros); the fence hands the stores to wgmma's proxy and to the producer's next copy.
  static __device__ __forceinline__ void clear_v_tail(T* sV, int slot, int tile, int seqlen_k, int tid, int wg) {
    if constexpr (K::TMA && K::VARLEN && !K::FP8) {  // (FP8: V's transposed copy is zero past each sequence)
      const int valid = seqlen_k - tile * K::BLOCK_N;
      if (valid < K::BLOCK_N) {
        zero_rows_from<typename K::LV, K::BLOCK_N, K::HEAD_DIM_V / 64, 128>(sV + slot * K::V_ELEMS, valid, tid % 128);
        WgmmaOps<BF16>::fence_proxy();
        WgmmaOps<BF16>::bar_sync(12 + wg, 128);
      }
    }
  }

  // OVERLAP: O += P V issued for the ring's r-th tile (the query tile's KV tiles from tile_begin take the ring's
  // places from ring0), P from p_frag, once O has its correction (RESCALE_IN_TURN) and V has landed.
  static __device__ __forceinline__ void issue_pv(float (&acc_o)[M_TILES][D_TILES][4],
                                                  const unsigned (&p_frag)[K::BLOCK_N / 16][4],
                                                  const float (&corr_o)[M_TILES][2], bool o_moved, T* sV,
                                                  unsigned bars, int r, int tile_begin, int ring0, int seqlen_k,
                                                  int tid, int wg) {
    using W = WgmmaOps<BF16>;
    if constexpr (RESCALE_IN_TURN) rescale_o(acc_o, corr_o, o_moved);
    const int slot = r % K::NUM_STAGES;
    W::mbar_wait(K::v_bar(bars, slot), (r / K::NUM_STAGES) & 1);
    if constexpr (K::VARLEN) clear_v_tail(sV, slot, tile_begin + r - ring0, seqlen_k, tid, wg);
    const unsigned v_at = smem_addr(sV + slot * K::V_ELEMS);
    pv_wgmma(acc_o, p_frag, v_at);
  }

  // OWN_O (after a query tile's loop): every S = Q K^T of this warp has landed (none is left in flight): Q's tile is
  // released.
  static __device__ __forceinline__ void release_q(unsigned bars, int lane) {
    if constexpr (K::OWN_O && K::PERSISTENT) {
      if (lane == 0) WgmmaOps<BF16>::mbar_arrive(K::qe_bar(bars));
    }
  }

  // OVERLAP: the query tile's last P V (of its n_tiles KV tiles, the ring's from ring0), after its loop; else none.
  static __device__ __forceinline__ void last_pv(float (&acc_o)[M_TILES][D_TILES][4],
                                                 const unsigned (&p_frag)[K::OVERLAP ? K::BLOCK_N / 16 : 1][4],
                                                 const float (&corr_o)[M_TILES][2], bool o_moved, T* sV, unsigned bars,
                                                 int ring0, int n_tiles, int tile_begin, int seqlen_k, int tid, int wg,
                                                 int lane) {
    if constexpr (K::OVERLAP) {
      if (n_tiles > 0) {
        using W = WgmmaOps<BF16>;
        turn_begin(wg);
        const int r = ring0 + n_tiles - 1;  // the last tile's place in the ring
        issue_pv(acc_o, p_frag, corr_o, o_moved, sV, bars, r, tile_begin, ring0, seqlen_k, tid, wg);
        W::commit();
        W::template wait<0>();
        W::hold(acc_o[0]);
        turn_end(wg, true);
        // PERSISTENT: the ring runs on into the next query tile, which needs this tile's V slot back
        if (K::PERSISTENT && lane == 0) W::mbar_arrive(K::ev_bar(bars, r % K::NUM_STAGES));
      }
    }
  }
};

}  // namespace attngen
