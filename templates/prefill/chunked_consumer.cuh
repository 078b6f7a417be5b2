// The chunked kernel's consumers: each step's MMA on its ring slot (S += Q_c K_c^T or O += P V, by mma.sync or
// wgmma) and, once a tile's S is whole, the QK pair's exchange, the score transforms and mask, and the online
// softmax that writes P.
//
// Warps form WARPS_M row groups of 32 query rows (two 16-row m-tiles) x WARPS_N column groups.
// In the QK steps warp (rg, cg) computes S for its 32 rows and keys [cg SN, (cg+1) SN) of the
// tile; in the V steps it accumulates O for its 32 rows and output columns [cg ON, (cg+1) ON):
// O stays in registers, split over the column groups, so it needs DV / WARPS_N floats per thread
// per m-tile pair whatever DV is. The row max is exchanged through shared memory (every warp of
// a row group computes the same new max from the same partials, so the running max and the
// rescale agree bit for bit); P goes through shared memory to every warp of its rows; each warp
// keeps a partial row sum, added up once in the epilogue.
//
// WGMMA (sm_90a; 64 query rows, 8 warps): the column groups are the two warpgroups. Warp w of
// warpgroup cg owns rows [16 w, 16 w + 16) (one m-tile), warpgroup cg all 64 rows of its keys and
// output columns. The tiles are stored in 128-byte-swizzled 64-column blocks (WgmmaLayout) and every
// MMA is a wgmma reading shared memory through descriptors: S += Q_c K_c^T and O += P V (P from
// shared memory, V N-major). A step's wgmma runs while the next step waits for its copies: each step
// waits only for the step before it, so the ring refills the slot read two steps back
// (NUM_STAGES - 2 steps run ahead). Each warpgroup's V (and O) columns are whole 64-column blocks,
// plus a 32-column tail where its half ends mid-block (320, 448, 576: the last V step's one block
// holds both tails, each warpgroup's wgmma starting at its own); other widths are padded to whole
// blocks (zeros loaded, never stored), and past what one CTA's registers hold, V_SPLITS CTAs each take a
// slice of V's (and O's) columns. They repeat the QK work, or with QK_PAIR (two splits whose halves
// of head_dim are whole chunks) form a cluster that splits it: each CTA computes S over its half of
// the QK columns, writes it into the other CTA's shared memory (thread by thread, the same fragment;
// st.async, counted on that CTA's mbarrier of the slot) and, once the other's has landed in its own,
// adds it (a + b == b + a, so both hold the same S bit for bit and run the same softmax). No cluster
// barrier a tile: a CTA waits only for the data it needs. A slot is written again two tiles on, by a
// CTA that has received this CTA's fragment of the tile between, sent only after this CTA read the
// slot; every write into a CTA lands before that CTA's wait for it, so either may exit after its
// last tile.
namespace attngen {

template <class K>
struct ChunkedConsumer {
  using T = typename K::T;
  static constexpr bool BF16 = K::BF16;
  static constexpr int MT = K::MT, SN = K::SN, ON = K::ON, DK = K::DK, VK = K::VK, VCW = K::VCW,
                       BLOCK_M = K::BLOCK_M, QK_STEPS = K::QK_STEPS, V_COL_STEPS = K::V_COL_STEPS, STEPS = K::STEPS;
  using LQ = typename K::LQ;
  using LK = typename K::LK;
  using LV = typename K::LV;
  using LVT = typename K::LVT;
  using LP = typename K::LP;

  // wgmma, step s on its slot `st`: S (+)= Q_c K_c^T or O += P V for this warpgroup, then the wait that leaves
  // at most this step's wgmma running (none at the end of S and of the tile).
  __device__ __forceinline__ static void wgmma_step(const ChunkedSmem<K>& sm, const ChunkedCta<K>& cta, const T* st,
                                                    int s, float (&acc_s)[MT][SN / 8][4],
                                                    float (&acc_o)[MT][ON / 8][4]) {
    using W = WgmmaOps<BF16>;
    const int cg = cta.cg;
    W::fence();
    if (s < QK_STEPS) {
      // S (+)= Q_c K_c^T: all 64 rows against this warpgroup's SN keys (whole 8-row swizzle atoms).
      // (TMA: Q's chunk s of its own tile, the slot K's chunk alone)
      // (the steps' descriptors as uniform adds to each tile's low word: WgmmaOps::desc_step)
      const unsigned q_lo = W::desc_lo(K::TMA ? smem_addr(sm.q) + s * (DK / 64) * LQ::BLOCK_BYTES : smem_addr(st), 16);
      const unsigned k_lo = W::desc_lo_warp(smem_addr(st + (K::TMA ? 0 : BLOCK_M * DK)) + cg * SN * 128, 16);
#pragma unroll
      for (int kk = 0; kk < DK / 16; ++kk)
        Wgmma<SN, BF16>::ss(acc_s[0], W::desc_step(q_lo, W::k_bytes(kk, LQ::BLOCK_BYTES)),
                            W::desc_step(k_lo, W::k_bytes(kk, LK::BLOCK_BYTES)), s > 0 || kk > 0);
    } else {
      // O[:, this step's VCW columns of the warpgroup] += P[:, VK keys] V (N-major).
      const int v = s - QK_STEPS;
      const int kb = v / V_COL_STEPS;
      const int cs = v % V_COL_STEPS;
      const unsigned p_lo = W::desc_lo(smem_addr(sm.p), 16);
      if (K::V_TAIL && cs == V_COL_STEPS - 1) {
        // The tail: this warpgroup's 32 columns start 64 bytes into each row of the block for the
        // second one (the swizzle is a function of the address: the atom stays 1024-byte aligned).
        auto& o = *reinterpret_cast<float(*)[4][4]>(&acc_o[0][(ON - 32) / 8]);
        // (TMA: each warpgroup's tail in a block of its own, VK rows of 128 bytes)
        const unsigned v_lo = W::desc_lo_warp(smem_addr(st) + cg * (K::TMA ? VK * 128 : 64), LVT::BLOCK_BYTES);
#pragma unroll
        for (int kk = 0; kk < VK / 16; ++kk)
          Wgmma<32, BF16>::template ss<1>(o, W::desc_step(p_lo, W::k_bytes(kb * (VK / 16) + kk, LP::BLOCK_BYTES)),
                                          W::desc_step(v_lo, W::mn_bytes(kk)), 1);
      } else {
        auto& o = *reinterpret_cast<float(*)[VCW / 8][4]>(&acc_o[0][cs * (VCW / 8)]);
        const unsigned v_lo = W::desc_lo_warp(smem_addr(st) + (cg * VCW / 64) * LV::BLOCK_BYTES, LV::BLOCK_BYTES);
#pragma unroll
        for (int kk = 0; kk < VK / 16; ++kk)
          Wgmma<VCW, BF16>::template ss<1>(o, W::desc_step(p_lo, W::k_bytes(kb * (VK / 16) + kk, LP::BLOCK_BYTES)),
                                           W::desc_step(v_lo, W::mn_bytes(kk)), 1);
      }
    }
    W::commit();
    if (s == QK_STEPS - 1) {
      W::template wait<0>();  // S is whole, and every P V before it done (the softmax rescales O)
      W::hold(acc_s[0]);
      W::hold(acc_o[0]);
    } else if (s == STEPS - 1) {
      // The tile's last step is waited for whole: where the loop ends, O's registers are moved
      // (ptxas serialised every wgmma when a P V could still be running there).
      W::template wait<0>();
      W::hold(acc_o[0]);
    } else {
      W::template wait<1>();  // the step before: its slot may be refilled after the next barrier
    }
  }

  // mma.sync: S += Q_c K_c^T over this DK-wide chunk (slot `st`: Q's chunk, then K's).
  __device__ __forceinline__ static void qk_step(const T* st, const ChunkedCta<K>& cta,
                                                 float (&acc_s)[MT][SN / 8][4]) {
    const int lane = cta.lane, row0 = cta.row0;
    const T* sQc = st;
    const T* sKc = st + BLOCK_M * K::DK_ROW;
#pragma unroll 1
    for (int kk = 0; kk < DK / 16; ++kk) {
      unsigned a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                    smem_addr(sQc + padded<K::DK_ROW>(row0 + mt * 16 + (lane % 16), kk * 16 + (lane / 16) * 8)));
#pragma unroll
      for (int n2 = 0; n2 < SN / 16; ++n2) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3,
                    smem_addr(sKc + padded<K::DK_ROW>(cta.cg * SN + n2 * 16 + (lane % 8) + (lane / 16) * 8,
                                                      kk * 16 + ((lane / 8) % 2) * 8)));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_16816<BF16>(acc_s[mt][2 * n2], a[mt], b0, b1);
          mma_16816<BF16>(acc_s[mt][2 * n2 + 1], a[mt], b2, b3);
        }
      }
    }
  }

  // mma.sync: O += P V over step s's VK keys and this warp's VCW columns (slot `st`: V's rows).
  __device__ __forceinline__ static void pv_step(const ChunkedSmem<K>& sm, const T* st, const ChunkedCta<K>& cta,
                                                 int s, float (&acc_o)[MT][ON / 8][4]) {
    // (the lane read from threadIdx, not cta.lane: this function is optimised before it is inlined, and knowing the
    // lane below 32 it associates V's addresses as the kernel written whole did, which kept the 32-row kernels' SASS)
    const int tid = threadIdx.x;
    const int lane = tid % 32, cg = cta.cg, row0 = cta.row0;
    const int v = s - QK_STEPS;
    const int kb = v / V_COL_STEPS;
    const int cs = v % V_COL_STEPS;
#pragma unroll 1
    for (int kk = 0; kk < VK / 16; ++kk) {
      unsigned a[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
        ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                    smem_addr(sm.p + padded<K::P_ROW>(row0 + mt * 16 + (lane % 16), kb * VK + kk * 16 + (lane / 16) * 8)));
#pragma unroll
      for (int d2 = 0; d2 < VCW / 16; ++d2) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3,
                          smem_addr(st + padded<K::VC_ROW>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                           cg * VCW + d2 * 16 + (lane / 16) * 8)));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma_16816<BF16>(acc_o[mt][cs * (VCW / 8) + 2 * d2], a[mt], b0, b1);
          mma_16816<BF16>(acc_o[mt][cs * (VCW / 8) + 2 * d2 + 1], a[mt], b2, b3);
        }
      }
    }
  }

  // QK_PAIR: S over this CTA's QK columns (tile it of its run), plus the other CTA's.
  __device__ __forceinline__ static void exchange(const ChunkedSmem<K>& sm, const ChunkedCta<K>& cta, int it,
                                                  float (&acc_s)[MT][SN / 8][4]) {
    const int xs = it & 1;
    const float4* slot = sm.x + xs * (SN / 8) * K::THREADS + cta.tid;
    const unsigned bar = smem_addr(sm.xbar) + 8 * xs;
    // every thread's arrival, with the bytes of its fragment to come (no branch: one by thread 0 alone
    // cost ptxas 12 registers and a spill at 1024)
    WgmmaOps<BF16>::mbar_expect(bar, K::X_THREAD_BYTES);
    // (the other CTA's slot and barrier: the same offsets from its shared memory's base)
    const unsigned their_base = cluster_map(smem_addr(sm.raw), cluster_rank() ^ 1) - smem_addr(sm.raw);
#pragma unroll
    for (int n = 0; n < SN / 8; ++n)
      cluster_store_async_f4(their_base + smem_addr(slot + n * K::THREADS),
                             make_float4(acc_s[0][n][0], acc_s[0][n][1], acc_s[0][n][2], acc_s[0][n][3]),
                             their_base + bar);
    cluster_mbar_wait(bar, (it >> 1) & 1);  // the slot's uses alternate the barrier's phases
#pragma unroll
    for (int n = 0; n < SN / 8; ++n) {
      const float4 o = slot[n * K::THREADS];
      acc_s[0][n][0] += o.x;
      acc_s[0][n][1] += o.y;
      acc_s[0][n][2] += o.z;
      acc_s[0][n][3] += o.w;
    }
  }

  // The logits transforms (K::V: softcap, ALiBi) and the mask on this warp's S block of the tile at key n0.
  __device__ __forceinline__ static void scores(const PrefillParams<T>& p, const ChunkedCta<K>& cta, int n0,
                                                float (&acc_s)[MT][SN / 8][4]) {
    const int row0 = cta.row0, g = cta.g;
    const int col0 = n0 + cta.cg * SN + 2 * cta.t;
    if constexpr (K::V::LOGITS) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int pos = cta.m0 + row0 + mt * 16 + g + 8 * r + cta.keys.shift;
#pragma unroll
          for (int n = 0; n < SN / 8; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c)
              acc_s[mt][n][2 * r + c] = K::V::logits(p, cta.vstate, acc_s[mt][n][2 * r + c],
                                                     Pair(cta.batch, cta.head, pos, col0 + n * 8 + c));
        }
    }
    if (!cta.keys.all_visible(cta.warp_lo, cta.warp_hi, n0 + cta.cg * SN, n0 + cta.cg * SN + SN)) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = cta.m0 + row0 + mt * 16 + g + 8 * r;
          const int lo = cta.keys.lo(i) - col0;
          const int hi = cta.keys.hi(i) - col0;
#pragma unroll
          for (int n = 0; n < SN / 8; ++n)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int j = n * 8 + c;
              if (j < lo || j >= hi) acc_s[mt][n][2 * r + c] = -ATTNGEN_INF;
            }
        }
    }
  }

  // The tile's row max, this warp's part of it into shared memory for every column group, and the meeting after
  // which each warp reads all of them (softmax).
  __device__ __forceinline__ static void tile_max(const ChunkedSmem<K>& sm, const ChunkedCta<K>& cta,
                                                  const float (&acc_s)[MT][SN / 8][4]) {
    const int row0 = cta.row0, g = cta.g, t = cta.t, cg = cta.cg;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float mx = frag_row_max<SN>(acc_s[mt], r);
        if (t == 0) sm.red[cg * BLOCK_M + row0 + mt * 16 + g + 8 * r] = mx;
      }
    ChunkedCta<K>::consumers_sync();
  }

  // The online softmax of the tile, its row max across the column groups read back (tile_max): the rows' running
  // max and sum, P into shared memory for every warp of its rows, and O's correction (corr_o). mma.sync rescales O
  // here; wgmma rescales lazily (lazy_max, online_softmax.cuh): corr_o is exactly 1 where a row kept its max, and
  // the caller multiplies O only where this returns true (one of the warp's rows moved).
  __device__ __forceinline__ static bool softmax(const PrefillParams<T>& p, const ChunkedSmem<K>& sm,
                                                 const ChunkedCta<K>& cta, const float (&acc_s)[MT][SN / 8][4],
                                                 float (&acc_o)[MT][ON / 8][4], float (&row_max)[MT][2],
                                                 float (&row_sum)[MT][2], float (&corr_o)[MT][2]) {
    const int row0 = cta.row0, g = cta.g, t = cta.t, cg = cta.cg;
    constexpr bool LAZY_RESCALE = K::WGMMA;
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + mt * 16 + g + 8 * r;
        float mx = row_max[mt][r];
#pragma unroll
        for (int c = 0; c < K::WARPS_N; ++c) mx = fmaxf(mx, sm.red[c * BLOCK_M + row]);
        bool moved_row = true;
        if constexpr (LAZY_RESCALE) {
          mx = lazy_max(row_max[mt][r], mx, p.scale_log2);
          moved_row = mx != row_max[mt][r];
          moved |= moved_row;
        }
        // A row that has seen only masked keys keeps max -inf; subtracting 0 keeps exp2 at 0.
        const float base = mx == -ATTNGEN_INF ? 0.f : mx * p.scale_log2;
        const float corr = moved_row ? fast_exp2(row_max[mt][r] * p.scale_log2 - base) : 1.f;
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < SN / 8; ++n) {
          const float e0 = fast_exp2(fmaf(acc_s[mt][n][2 * r], p.scale_log2, -base));
          const float e1 = fast_exp2(fmaf(acc_s[mt][n][2 * r + 1], p.scale_log2, -base));
          sum += e0 + e1;
          *reinterpret_cast<unsigned*>(sm.p + LP::offset(row, cg * SN + n * 8) + 2 * t) = pack2<BF16>(e0, e1);
        }
        row_sum[mt][r] = row_sum[mt][r] * corr + sum;
        corr_o[mt][r] = corr;
        if constexpr (!LAZY_RESCALE)
#pragma unroll
          for (int d = 0; d < ON / 8; ++d) {
            acc_o[mt][d][2 * r] *= corr;
            acc_o[mt][d][2 * r + 1] *= corr;
          }
      }
    return moved;
  }

  // After the tile's P is written: P is read by the V steps after their ring barrier; the row-max exchange (sm.red) is written again only
  // after the next tile's QK steps, several barriers on. (wgmma: P's last reader, this tile's last V step, is waited
  // for at the next tile's first step.) TMA: no ring barrier; the warpgroups meet here once both halves of P are
  // written. A warpgroup writes P and sm.red again only past the next tile's first meeting, which the other reaches
  // after its last P V of this tile has completed.
  __device__ __forceinline__ static void p_written() {
    if constexpr (K::TMA) {
      WgmmaOps<BF16>::fence_proxy();  // P before wgmma reads it
      ChunkedCta<K>::consumers_sync();
    }
  }
};

}  // namespace attngen
