// Prefill for large head dims (and split QK / V head dims): the tiling lowered to the MMA level,
// so shared memory does not grow with the head dim (but for the TMA form's Q tile, below).
//
// A CTA owns BLOCK_M query rows and walks the KV tiles. Per tile it runs a fixed sequence of
// steps, each one stage of a cp.async ring of NUM_STAGES equal slots:
//   QK steps (DQK / DK): a DK-wide column chunk of Q and of the K tile, S += Q_c K_c^T;
//   V steps (BLOCK_N / VK x ON / VCW): VK keys of the V tile, VCW columns for each warp column.
// The ring runs ahead across steps and tiles alike, so the next tile's Q/K chunks load while this
// tile's V steps compute. Nothing is held whole in shared memory: per CTA it is the ring, P
// (BLOCK_M x BLOCK_N, 16-bit) and a row-max exchange, whatever the head dims (TMA: and Q's tile,
// BLOCK_M rows of the CTA's QK columns, loaded once).
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
//
// (The template argument DV is the columns one CTA computes: its split of head_dim_v.)
namespace attngen {

// Element offset of (row, col) in a padded tile: rows of ROW_ELEMS = columns + 8, so the 8 rows of
// an ldmatrix phase start 16 bytes apart in the banks, and offsets of different columns differ by
// constants (the swizzled layout's XOR gave every column its own register when unrolled).
template <int ROW_ELEMS>
__device__ __forceinline__ int padded(int row, int col) {
  return row * ROW_ELEMS + col;
}

// The chunked kernel's tile layouts: padded rows (mma.sync), or wgmma's swizzled 64-column blocks
// (WgmmaLayout), where a thread stepping down the rows in steps of 8 stays on the same swizzle phase.
// ROW_ELEMS: the elements from one row to the next at the same column.
template <int ROW_ELEMS_>
struct Padded {
  static constexpr int ROW_ELEMS = ROW_ELEMS_;
  static constexpr bool SWIZZLED = false;
  __device__ __forceinline__ static int offset(int row, int col) { return padded<ROW_ELEMS>(row, col); }
};
template <int COLS, int ROWS>
struct Swizzled : WgmmaLayout<COLS, ROWS> {
  static constexpr int ROW_ELEMS = 64;
  static constexpr bool SWIZZLED = true;
};

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

template <class T, bool BF16, int DQK, int DV, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int NUM_STAGES, int DK,
          int VK, int VCW, int MASK, bool RETURN_LSE, bool SOFTCAP, bool ALIBI, bool VARLEN = false, bool WGMMA = false,
          int V_SPLITS = 1, bool QK_PAIR = false, bool TMA = false>
__device__ __forceinline__ void prefill_chunked(const PrefillParams<T>& p, const TmaDesc* maps = nullptr) {
  constexpr int THREADS = NUM_WARPS * 32;  // the warps that compute (TMA: and a producer warpgroup more)
  constexpr int MT = WGMMA ? 1 : 2;  // 16-row m-tiles a warp owns
  constexpr int WARPS_M = WGMMA ? 1 : BLOCK_M / 32;  // wgmma: the warps of a warpgroup split its 64 rows
  constexpr int WARPS_N = WGMMA ? NUM_WARPS / 4 : NUM_WARPS / WARPS_M;
  constexpr int SN = BLOCK_N / WARPS_N;  // keys of S per warp
  // wgmma: each warpgroup's columns are whole 64-column blocks and, where its half of DV ends 32
  // columns into one (320, 448, 576), a 32-column tail step that takes half of one block (V_TAIL);
  // else V's columns are padded to whole blocks (zeros loaded, never stored).
  constexpr bool V_TAIL = WGMMA && DV >= 192 && DV % 64 == 0 && (DV / 2) % 64 == 32;
  constexpr int DV_PAD = WGMMA && !V_TAIL ? (DV + 127) / 128 * 128 : DV;
  constexpr int ON = DV_PAD / WARPS_N;   // output columns per warp
  constexpr int VC = VCW * WARPS_N;      // columns of a V step (the tail step's: 64)
  constexpr int TAIL = V_TAIL ? 32 : 0;
  static_assert(!QK_PAIR || (V_SPLITS == 2 && WGMMA && (DQK / 2) % DK == 0), "a pair splits QK in whole chunks");
  constexpr int QK_COLS = QK_PAIR ? DQK / 2 : DQK;  // the QK columns this CTA computes S over
  constexpr int QK_STEPS = QK_COLS / DK;
  constexpr int V_KEY_STEPS = BLOCK_N / VK;
  constexpr int V_COL_STEPS = (ON - TAIL) / VCW + (V_TAIL ? 1 : 0);
  constexpr int STEPS = QK_STEPS + V_KEY_STEPS * V_COL_STEPS;
  // Steps whose ring slots may still be read when a step starts: the one before (mma.sync reads its
  // slot synchronously) or, with wgmma, the two before (one step's wgmma is left running).
  constexpr int LAG = WGMMA ? 2 : 1;
  constexpr int AHEAD = NUM_STAGES - LAG;  // steps loading while one computes
  static_assert(BLOCK_M % 32 == 0 && NUM_WARPS % WARPS_M == 0, "warp grid");
  static_assert(SN % 16 == 0 && (ON - TAIL) % VCW == 0 && VCW % 16 == 0 && VK % 16 == 0 && BLOCK_N % VK == 0, "tiles");
  static_assert(DQK % DK == 0 && DK % 16 == 0 && AHEAD >= 1 && STEPS >= AHEAD, "steps");
  static_assert(!WGMMA || (BLOCK_M == 64 && NUM_WARPS == 8 && DK % 64 == 0 && VCW % 64 == 0 && QK_STEPS >= 2),
                "wgmma: 64 rows, two warpgroups, whole 64-column swizzle blocks");
  static_assert(!TMA || (WGMMA && !VARLEN && DV_PAD == DV),
                "TMA: wgmma on the dense layout, every copy a 64-column box of the tensor (or the two tails)");
  // TMA: registers per thread after setmaxnreg, the producer warpgroup's and the two consumers' (launched
  // with 168 a thread: 384 threads)
  constexpr int PRODUCER_REGS = 24;
  constexpr int CONSUMER_REGS = 240;

  // Padded tiles (rows of DK, VC or BLOCK_N elements plus 8), or wgmma's dense swizzled blocks.
  constexpr int DK_ROW = DK + 8;
  constexpr int VC_ROW = VC + 8;
  constexpr int P_ROW = BLOCK_N + 8;
  using LQ = typename Select<WGMMA, Swizzled<DK, BLOCK_M>, Padded<DK_ROW>>::type;
  using LK = typename Select<WGMMA, Swizzled<DK, BLOCK_N>, Padded<DK_ROW>>::type;
  using LV = typename Select<WGMMA, Swizzled<VC, VK>, Padded<VC_ROW>>::type;
  using LVT = Swizzled<64, VK>;  // V_TAIL: the tail step's one block, each warpgroup's 32 columns side by side
  using LP = typename Select<WGMMA, Swizzled<BLOCK_N, BLOCK_M>, Padded<P_ROW>>::type;
  // TMA: Q is loaded once, whole, into a tile of its own (Q_ELEMS); a QK step's slot holds K's chunk alone
  constexpr int Q_ELEMS = TMA ? BLOCK_M * QK_COLS : 0;
  constexpr int QK_ELEMS = (TMA ? BLOCK_N : BLOCK_M + BLOCK_N) * (WGMMA ? DK : DK_ROW);
  constexpr int V_ELEMS = VK * (WGMMA ? VC : VC_ROW);
  constexpr int STAGE_ELEMS = QK_ELEMS > V_ELEMS ? QK_ELEMS : V_ELEMS;
  static_assert(!(TMA && V_TAIL) || 2 * VK * 64 <= STAGE_ELEMS, "TMA: the tail step's two blocks fit a slot");
  // (wgmma: P's 64-column blocks are whole even where the tile has 32 keys)
  constexpr int P_ELEMS = BLOCK_M * (WGMMA ? (BLOCK_N + 63) / 64 * 64 : P_ROW);

  extern __shared__ __align__(128) unsigned char smem_raw[];
  // wgmma's swizzle atoms start 1024-byte aligned (smem_bytes() reserves the slack).
  T* sRing = reinterpret_cast<T*>(WGMMA ? aligned_smem<1024>(smem_raw) : smem_raw);
  T* sQ = sRing + NUM_STAGES * STAGE_ELEMS;  // (TMA)
  T* sP = sQ + Q_ELEMS;
  float* sRed = reinterpret_cast<float*>(sP + P_ELEMS);  // [WARPS_N][BLOCK_M]
  // QK_PAIR: two slots of the other CTA's partial S, each [SN / 8][THREADS] float4s (a thread's fragment),
  // and a barrier a slot whose phase completes when the other CTA's fragments have landed in it
  float4* sX = reinterpret_cast<float4*>(sRed + WARPS_N * BLOCK_M);
  unsigned long long* sXbar = reinterpret_cast<unsigned long long*>(sX + (QK_PAIR ? 2 * (SN / 8) * THREADS : 0));
  constexpr unsigned X_THREAD_BYTES = (SN / 8) * 16;
  // TMA: per ring slot a full barrier (the producer's arrival with the slot's bytes) and an empty one (each
  // consumer warp's arrival once the wgmma that read the slot has completed), after the exchange's
  const unsigned tbars = smem_addr(sXbar + (QK_PAIR ? 2 : 0));
  auto full_bar = [&](int s) { return tbars + 8u * s; };
  auto empty_bar = [&](int s) { return tbars + 8u * (NUM_STAGES + s); };
  const unsigned q_bar = tbars + 16u * NUM_STAGES;  // Q's tile landed

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int rg = WGMMA ? warp % 4 : warp / WARPS_N;  // row group: rows [16 MT rg, 16 MT (rg + 1))
  const int cg = WGMMA ? warp / 4 : warp % WARPS_N;  // column group (wgmma: the warpgroup)
  // The computing warps meet (TMA: a named barrier, the producer warpgroup having left).
  auto consumers_sync = [&]() {
    if constexpr (TMA)
      WgmmaOps<BF16>::bar_sync(1, THREADS);
    else
      __syncthreads();
  };

  int m_block, head, batch, seqlen_q, seqlen_k;
  long long q_row0 = 0, k_row0 = 0;  // VARLEN: the sequence's first row in q / k
  if (past_work<VARLEN>(p)) return;
  cta_tile<VARLEN, false>(p, m_block, head, batch, seqlen_q, seqlen_k, q_row0, k_row0);
  // V_SPLITS: the grid's y runs over heads x splits; split vs computes V's (and O's) columns
  // [vs DV, (vs + 1) DV) and repeats the QK work (the splits of a head run side by side: K shared in L2).
  int vs = 0;
  if constexpr (V_SPLITS > 1) {
    vs = head % V_SPLITS;
    head /= V_SPLITS;
  }
  const int kv_head = head / p.group;
  const int m0 = m_block * BLOCK_M;
  const int m_last = min(m0 + BLOCK_M, seqlen_q) - 1;

  const KeyRange keys = key_range<MASK>(seqlen_q, seqlen_k, p.win_left, p.win_right);
  const KeyRange::Span span = keys.tiles<BLOCK_N>(m0, m_last);
  const int tile_begin = span.first;
  const int n_tiles = span.count;

  const float alibi_u = ALIBI ? p.alibi[batch * p.alibi_sb + head] / p.sm_scale : 0.f;
  // (QK_PAIR: this CTA's half of the QK columns, vs being its rank in the cluster)
  const T* gQ = p.q + (VARLEN ? 0 : batch * p.q_sb) + head * p.q_sh + (q_row0 + m0) * p.q_ss + (QK_PAIR ? vs * QK_COLS : 0);
  if constexpr (VARLEN) q_row0 = 0;  // dead until the epilogue reads it again
  const T* gK = p.k + (VARLEN ? 0 : batch * p.k_sb) + kv_head * p.k_sh + k_row0 * p.k_ss + (QK_PAIR ? vs * QK_COLS : 0);
  const T* gV = p.v + (VARLEN ? 0 : batch * p.v_sb) + kv_head * p.v_sh + k_row0 * p.v_ss + vs * DV;

  // Step s (0 <= s < STEPS) of KV tile `tile` into ring slot `slot`.
  // The step's column offset is made opaque to the compiler: otherwise, with the step loop
  // unrolled, it hoists every step's copy addresses out of the KV loop and holds them all (spills).
  auto opaque = [](int x) {
    asm volatile("" : "+r"(x));
    return x;
  };
  auto load_step = [&](int tile, int s, int slot) {
    T* dst = sRing + slot * STAGE_ELEMS;
    const int n0 = tile * BLOCK_N;
    if (s < QK_STEPS) {
      const int c0 = opaque(s * DK);
      auto col = [&](int c) { return c0 + c; };
      load_cols_async<LQ, BLOCK_M, DK, THREADS>(dst, gQ, p.q_ss, seqlen_q - m0, tid, col);
      load_cols_async<LK, BLOCK_N, DK, THREADS>(dst + BLOCK_M * (WGMMA ? DK : DK_ROW), gK + (long long)n0 * p.k_ss,
                                                p.k_ss, seqlen_k - n0, tid, col);
    } else {
      const int v = s - QK_STEPS;
      const int k0 = n0 + opaque((v / V_COL_STEPS) * VK);
      const int c0 = opaque((v % V_COL_STEPS) * VCW);
      if (V_TAIL && v % V_COL_STEPS == V_COL_STEPS - 1) {
        // The tail: column c of the block belongs to warpgroup c / 32, its column ON - 32 + c % 32.
        load_cols_async<LVT, VK, 64, THREADS>(dst, gV + (long long)k0 * p.v_ss, p.v_ss, seqlen_k - k0, tid,
                                              [&](int c) { return (c / 32) * ON + c0 + c % 32; });
      } else {
        // Step column c belongs to warp column c / VCW: output column (c / VCW) ON + c0 + c % VCW.
        load_cols_async<LV, VK, VC, THREADS, (DV_PAD > DV)>(dst, gV + (long long)k0 * p.v_ss, p.v_ss, seqlen_k - k0,
                                                            tid, [&](int c) { return (c / VCW) * ON + c0 + c % VCW; }, DV);
      }
    }
  };

  if constexpr (!TMA) {
    if (n_tiles > 0) {
#pragma unroll
      for (int s = 0; s < AHEAD; ++s) {
        load_step(tile_begin, s, s);
        cp_async_commit();
      }
    }
  }
  if constexpr (QK_PAIR || TMA) {
    if (tid == 0) {
      if constexpr (QK_PAIR) {
        WgmmaOps<BF16>::mbar_init(smem_addr(sXbar), THREADS);
        WgmmaOps<BF16>::mbar_init(smem_addr(sXbar + 1), THREADS);
      }
      if constexpr (TMA) {
#pragma unroll
        for (int s = 0; s < NUM_STAGES; ++s) {
          WgmmaOps<BF16>::mbar_init(full_bar(s), 1);
          WgmmaOps<BF16>::mbar_init(empty_bar(s), NUM_WARPS);
        }
        WgmmaOps<BF16>::mbar_init(q_bar, 1);
      }
      WgmmaOps<BF16>::mbar_init_fence();
    }
    if constexpr (QK_PAIR)
      cluster_sync();  // both CTAs have started, their barriers set, before either writes into the other
    else
      __syncthreads();
  }
  if constexpr (TMA) {
    // The producer warpgroup gives its registers to the consumers; its one elected thread issues every
    // step's copies, each into the next ring slot once the consumers have released it.
    using W = WgmmaOps<BF16>;
    if (warp >= NUM_WARPS) {
      W::template regs_dec<PRODUCER_REGS>();
      if (tid == THREADS) {
        int slot = 0, phase = 0;  // phase: the parity of the slot's current use, from the ring's first pass
        if (n_tiles > 0) {
          // Q's tile once (QK_PAIR: this CTA's half of its columns), in 64-column blocks
          W::mbar_expect(q_bar, Q_ELEMS * sizeof(T));
#pragma unroll
          for (int b = 0; b < QK_COLS / 64; ++b)
            W::tma_load(smem_addr(sQ) + b * LQ::BLOCK_BYTES, maps, q_bar, (QK_PAIR ? vs * QK_COLS : 0) + 64 * b, m0,
                        head, batch);
        }
        for (int it = 0; it < n_tiles; ++it) {
          const int n0 = (tile_begin + it) * BLOCK_N;
          for (int s = 0; s < STEPS; ++s) {
            if (it * STEPS + s >= NUM_STAGES) W::mbar_wait(empty_bar(slot), phase ^ 1);
            const unsigned dst = smem_addr(sRing + slot * STAGE_ELEMS);
            const unsigned bar = full_bar(slot);
            if (s < QK_STEPS) {
              W::mbar_expect(bar, BLOCK_N * DK * sizeof(T));
              const int c0 = (QK_PAIR ? vs * QK_COLS : 0) + s * DK;
#pragma unroll
              for (int b = 0; b < DK / 64; ++b)
                W::tma_load(dst + b * LK::BLOCK_BYTES, maps + 1, bar, c0 + 64 * b, n0, kv_head, batch);
            } else if (V_TAIL && (s - QK_STEPS) % V_COL_STEPS == V_COL_STEPS - 1) {
              // The tail step: one box of the 5-d map (32 columns, keys, the two warpgroups' tails, heads,
              // batch); TMA pads each 32-column row to the swizzle's 128 bytes, so each warpgroup's tail lands
              // in the first 32 columns of a block of its own (VK rows of 128 bytes).
              W::mbar_expect(bar, VK * 64 * sizeof(T));
              W::tma_load5(dst, maps + 3, bar, 0, n0 + ((s - QK_STEPS) / V_COL_STEPS) * VK, 2 * vs, kv_head, batch);
            } else {
              const int v = s - QK_STEPS;
              const int k0 = n0 + (v / V_COL_STEPS) * VK;
              const int c0 = vs * DV + (v % V_COL_STEPS) * VCW;
              W::mbar_expect(bar, VK * VC * sizeof(T));
              // block b of the step: warp column (64 b) / VCW's columns, (64 b) % VCW into them
#pragma unroll
              for (int b = 0; b < VC / 64; ++b)
                W::tma_load(dst + b * LV::BLOCK_BYTES, maps + 2, bar, c0 + (64 * b / VCW) * ON + (64 * b) % VCW, k0,
                            kv_head, batch);
            }
            if (++slot == NUM_STAGES) {
              slot = 0;
              phase ^= 1;
            }
          }
        }
      }
      return;
    }
    W::template regs_inc<CONSUMER_REGS>();
  }

  float acc_o[MT][ON / 8][4];
  float row_max[MT][2], row_sum[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int d = 0; d < ON / 8; ++d)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc_o[mt][d][c] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -ATTNGEN_INF;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const int row0 = rg * 16 * MT;  // this warp's first row in the tile
  const int warp_lo = m0 + row0;
  const int warp_hi = max(warp_lo, min(warp_lo + 16 * MT, seqlen_q) - 1);

  if constexpr (TMA) {
    if (n_tiles > 0) WgmmaOps<BF16>::mbar_wait(q_bar, 0);
  }
  int slot = 0;       // the ring slot step (it, s) reads
  int fill = AHEAD;   // the slot the next load fills
  int phase = 0;      // TMA: the parity of that slot's current use
  int last = 0;       // TMA: the slot the step before read
  for (int it = 0; it < n_tiles; ++it) {
    const int tile = tile_begin + it;
    const int n0 = tile * BLOCK_N;
    if constexpr (WGMMA) {
      // Where a tile's steps are a multiple of the ring, every step would read a slot known at compile
      // time: ptxas then hoists each step's wgmma descriptors out of the KV loop and spills.
      slot = opaque(slot);
      fill = opaque(fill);
    }
    float acc_s[MT][SN / 8][4];
    if constexpr (!WGMMA) {  // wgmma's first S step overwrites them
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < SN / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc_s[mt][n][c] = 0.f;
    }

#pragma unroll
    for (int s = 0; s < STEPS; ++s) {
      const int cur = slot;
      if constexpr (TMA) {
        WgmmaOps<BF16>::mbar_wait(full_bar(cur), phase);
      } else {
        cp_async_wait<AHEAD - 1>();
        if constexpr (WGMMA) WgmmaOps<BF16>::fence_proxy();  // the copies (and P) before wgmma reads them
        __syncthreads();
        // The slot filled here was read by step (it, s) - LAG, which every warp finished before the
        // barrier (wgmma: each warpgroup waited for it at step (it, s) - 1).
        const int ahead = s + AHEAD;
        if (ahead < STEPS)
          load_step(tile, ahead, fill);
        else if (it + 1 < n_tiles)
          load_step(tile + 1, ahead - STEPS, fill);
        cp_async_commit();
        fill = fill + 1 == NUM_STAGES ? 0 : fill + 1;
      }
      const T* st = sRing + cur * STAGE_ELEMS;
      slot = slot + 1 == NUM_STAGES ? 0 : slot + 1;
      if (TMA && slot == 0) phase ^= 1;

      if constexpr (WGMMA) {
        using W = WgmmaOps<BF16>;
        W::fence();
        if (s < QK_STEPS) {
          // S (+)= Q_c K_c^T: all 64 rows against this warpgroup's SN keys (whole 8-row swizzle atoms).
          // (TMA: Q's chunk s of its own tile, the slot K's chunk alone)
          const unsigned q_at = TMA ? smem_addr(sQ) + s * (DK / 64) * LQ::BLOCK_BYTES : smem_addr(st);
          const unsigned k_at = smem_addr(st + (TMA ? 0 : BLOCK_M * DK)) + cg * SN * 128;
#pragma unroll
          for (int kk = 0; kk < DK / 16; ++kk)
            Wgmma<SN, BF16>::ss(acc_s[0], W::desc_k(q_at, kk, LQ::BLOCK_BYTES), W::desc_k(k_at, kk, LK::BLOCK_BYTES),
                                s > 0 || kk > 0);
        } else {
          // O[:, this step's VCW columns of the warpgroup] += P[:, VK keys] V (N-major).
          const int v = s - QK_STEPS;
          const int kb = v / V_COL_STEPS;
          const int cs = v % V_COL_STEPS;
          const unsigned p_at = smem_addr(sP);
          if (V_TAIL && cs == V_COL_STEPS - 1) {
            // The tail: this warpgroup's 32 columns start 64 bytes into each row of the block for the
            // second one (the swizzle is a function of the address: the atom stays 1024-byte aligned).
            auto& o = *reinterpret_cast<float(*)[4][4]>(&acc_o[0][(ON - 32) / 8]);
            // (TMA: each warpgroup's tail in a block of its own, VK rows of 128 bytes)
            const unsigned v_at = smem_addr(st) + cg * (TMA ? VK * 128 : 64);
#pragma unroll
            for (int kk = 0; kk < VK / 16; ++kk)
              Wgmma<32, BF16>::template ss<1>(o, W::desc_k(p_at, kb * (VK / 16) + kk, LP::BLOCK_BYTES),
                                              W::desc_mn(v_at, kk, LVT::BLOCK_BYTES), 1);
          } else {
            auto& o = *reinterpret_cast<float(*)[VCW / 8][4]>(&acc_o[0][cs * (VCW / 8)]);
            const unsigned v_at = smem_addr(st) + (cg * VCW / 64) * LV::BLOCK_BYTES;
#pragma unroll
            for (int kk = 0; kk < VK / 16; ++kk)
              Wgmma<VCW, BF16>::template ss<1>(o, W::desc_k(p_at, kb * (VK / 16) + kk, LP::BLOCK_BYTES),
                                               W::desc_mn(v_at, kk, LV::BLOCK_BYTES), 1);
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
        if constexpr (TMA) {
          // The slots whose wgmma has now completed go back to the producer: the step before's (unless
          // its own wait already gave it back) and, after a whole wait, this one's.
          if (lane == 0) {
            if (s > 0 && s - 1 != QK_STEPS - 1) W::mbar_arrive(empty_bar(last));
            if (s == QK_STEPS - 1 || s == STEPS - 1) W::mbar_arrive(empty_bar(cur));
          }
          last = cur;
        }
      } else if (s < QK_STEPS) {
        // ---- S += Q_c K_c^T over this DK-wide chunk --------------------------------------------
        const T* sQc = st;
        const T* sKc = st + BLOCK_M * DK_ROW;
#pragma unroll 1
        for (int kk = 0; kk < DK / 16; ++kk) {
          unsigned a[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                        smem_addr(sQc + padded<DK_ROW>(row0 + mt * 16 + (lane % 16), kk * 16 + (lane / 16) * 8)));
#pragma unroll
          for (int n2 = 0; n2 < SN / 16; ++n2) {
            unsigned b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3,
                        smem_addr(sKc + padded<DK_ROW>(cg * SN + n2 * 16 + (lane % 8) + (lane / 16) * 8,
                                                   kk * 16 + ((lane / 8) % 2) * 8)));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              mma_16816<BF16>(acc_s[mt][2 * n2], a[mt], b0, b1);
              mma_16816<BF16>(acc_s[mt][2 * n2 + 1], a[mt], b2, b3);
            }
          }
        }
      } else {
        // ---- O += P V over VK keys and this warp's VCW columns -----------------------------------
        const int v = s - QK_STEPS;
        const int kb = v / V_COL_STEPS;
        const int cs = v % V_COL_STEPS;
#pragma unroll 1
        for (int kk = 0; kk < VK / 16; ++kk) {
          unsigned a[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
            ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                        smem_addr(sP + padded<P_ROW>(row0 + mt * 16 + (lane % 16), kb * VK + kk * 16 + (lane / 16) * 8)));
#pragma unroll
          for (int d2 = 0; d2 < VCW / 16; ++d2) {
            unsigned b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3,
                              smem_addr(st + padded<VC_ROW>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                        cg * VCW + d2 * 16 + (lane / 16) * 8)));
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              mma_16816<BF16>(acc_o[mt][cs * (VCW / 8) + 2 * d2], a[mt], b0, b1);
              mma_16816<BF16>(acc_o[mt][cs * (VCW / 8) + 2 * d2 + 1], a[mt], b2, b3);
            }
          }
        }
      }

      if (s == QK_STEPS - 1) {
        if constexpr (QK_PAIR) {
          // ---- S over this CTA's QK columns, plus the other CTA's ---------------------------------
          const int xs = it & 1;
          const float4* slot = sX + xs * (SN / 8) * THREADS + tid;
          const unsigned bar = smem_addr(sXbar) + 8 * xs;
          // every thread's arrival, with the bytes of its fragment to come (no branch: one by thread 0 alone
          // cost ptxas 12 registers and a spill at 1024)
          WgmmaOps<BF16>::mbar_expect(bar, X_THREAD_BYTES);
          // (the other CTA's slot and barrier: the same offsets from its shared memory's base)
          const unsigned their_base = cluster_map(smem_addr(smem_raw), cluster_rank() ^ 1) - smem_addr(smem_raw);
#pragma unroll
          for (int n = 0; n < SN / 8; ++n)
            cluster_store_async_f4(their_base + smem_addr(slot + n * THREADS),
                                   make_float4(acc_s[0][n][0], acc_s[0][n][1], acc_s[0][n][2], acc_s[0][n][3]),
                                   their_base + bar);
          cluster_mbar_wait(bar, (it >> 1) & 1);  // the slot's uses alternate the barrier's phases
#pragma unroll
          for (int n = 0; n < SN / 8; ++n) {
            const float4 o = slot[n * THREADS];
            acc_s[0][n][0] += o.x;
            acc_s[0][n][1] += o.y;
            acc_s[0][n][2] += o.z;
            acc_s[0][n][3] += o.w;
          }
        }
        // ---- score transforms and mask on this warp's S block ---------------------------------
        const int col0 = n0 + cg * SN + 2 * t;
        if constexpr (SOFTCAP || ALIBI) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int pos = m0 + row0 + mt * 16 + g + 8 * r + keys.shift;
#pragma unroll
              for (int n = 0; n < SN / 8; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                  acc_s[mt][n][2 * r + c] = score_transform<SOFTCAP, ALIBI>(
                      acc_s[mt][n][2 * r + c], p.softcap_u, p.inv_softcap_u, alibi_u, pos - (col0 + n * 8 + c));
            }
        }
        if (!keys.all_visible(warp_lo, warp_hi, n0 + cg * SN, n0 + cg * SN + SN)) {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int i = m0 + row0 + mt * 16 + g + 8 * r;
              const int lo = keys.lo(i) - col0;
              const int hi = keys.hi(i) - col0;
#pragma unroll
              for (int n = 0; n < SN / 8; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                  const int j = n * 8 + c;
                  if (j < lo || j >= hi) acc_s[mt][n][2 * r + c] = -ATTNGEN_INF;
                }
            }
        }
        // ---- row max across the column groups, then P into shared memory -----------------------
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float mx = -ATTNGEN_INF;
#pragma unroll
            for (int n = 0; n < SN / 8; ++n) mx = fmaxf(mx, fmaxf(acc_s[mt][n][2 * r], acc_s[mt][n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            if (t == 0) sRed[cg * BLOCK_M + row0 + mt * 16 + g + 8 * r] = mx;
          }
        consumers_sync();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int row = row0 + mt * 16 + g + 8 * r;
            float mx = row_max[mt][r];
#pragma unroll
            for (int c = 0; c < WARPS_N; ++c) mx = fmaxf(mx, sRed[c * BLOCK_M + row]);
            // A row that has seen only masked keys keeps max -inf; subtracting 0 keeps exp2 at 0.
            const float base = mx == -ATTNGEN_INF ? 0.f : mx * p.scale_log2;
            const float corr = fast_exp2(row_max[mt][r] * p.scale_log2 - base);
            row_max[mt][r] = mx;
            float sum = 0.f;
#pragma unroll
            for (int n = 0; n < SN / 8; ++n) {
              const float e0 = fast_exp2(fmaf(acc_s[mt][n][2 * r], p.scale_log2, -base));
              const float e1 = fast_exp2(fmaf(acc_s[mt][n][2 * r + 1], p.scale_log2, -base));
              sum += e0 + e1;
              *reinterpret_cast<unsigned*>(sP + LP::offset(row, cg * SN + n * 8) + 2 * t) = pack2<BF16>(e0, e1);
            }
            row_sum[mt][r] = row_sum[mt][r] * corr + sum;
#pragma unroll
            for (int d = 0; d < ON / 8; ++d) {
              acc_o[mt][d][2 * r] *= corr;
              acc_o[mt][d][2 * r + 1] *= corr;
            }
          }
        // P is read by the V steps after their ring barrier; sRed is written again only after
        // the next tile's QK steps, several barriers on. (wgmma: P's last reader, this tile's last
        // V step, is waited for at the next tile's first step.)
        // TMA: no ring barrier; the warpgroups meet here once both halves of P are written. A warpgroup
        // writes P and sRed again only past the next tile's first meeting, which the other reaches
        // after its last P V of this tile has completed.
        if constexpr (TMA) {
          WgmmaOps<BF16>::fence_proxy();  // P before wgmma reads it
          consumers_sync();
        }
      }
    }
  }

  // ---- epilogue: the row sums of all column groups, normalise, LSE, O ---------------------------
  if constexpr (!TMA) cp_async_wait_all();
  consumers_sync();  // every warp is past its last read of sRed
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = row_sum[mt][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (t == 0) sRed[cg * BLOCK_M + row0 + mt * 16 + g + 8 * r] = l;
    }
  consumers_sync();
  // VARLEN: the sequence's first row, read again rather than held across the loop (registers).
  if constexpr (VARLEN) q_row0 = min(max(p.cu_q[batch], 0), p.total_q);
  T* gO = p.o + (VARLEN ? 0 : batch * p.o_sb) + head * p.o_sh + (q_row0 + m0) * p.o_ss + vs * DV + cg * ON;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + mt * 16 + g + 8 * r;
      float l = 0.f;
#pragma unroll
      for (int c = 0; c < WARPS_N; ++c) l += sRed[c * BLOCK_M + row];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const bool live = m0 + row < seqlen_q;
      if constexpr (RETURN_LSE) {
        if (cg == 0 && t == 0 && live && vs == 0) {
          const float lse = l > 0.f ? row_max[mt][r] * p.sm_scale + logf(l) : -ATTNGEN_INF;
          // VARLEN: [heads, total_q], FlashAttention's varlen layout; else [batch, heads, seqlen_q].
          if constexpr (VARLEN)
            p.lse[(long long)head * p.total_q + q_row0 + m0 + row] = lse;
          else
            p.lse[((long long)batch * p.num_heads + head) * p.seqlen_q + m0 + row] = lse;
        }
      }
      if (live) {
#pragma unroll
        for (int d = 0; d < ON / 8; ++d)
          if (DV_PAD == DV || cg * ON + d * 8 < DV)
            *reinterpret_cast<unsigned*>(gO + row * p.o_ss + d * 8 + 2 * t) =
                pack2<BF16>(acc_o[mt][d][2 * r] * inv, acc_o[mt][d][2 * r + 1] * inv);
      }
    }
}

}  // namespace attngen
