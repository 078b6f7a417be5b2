// FlashAttention-2-style forward pass for one (query tile, head, batch) per CTA (PERSISTENT: several in turn).
// Q and K rows are HEAD_DIM wide, V and O rows HEAD_DIM_V (at most HEAD_DIM: O is staged in Q's
// tile for the store).
//
// Each warp owns WARP_M = BLOCK_M / NUM_WARPS query rows (M_TILES tiles of 16) and the whole
// KV tile, so the softmax of a row never leaves its warp. K and V tiles stream through a
// NUM_STAGES-deep cp.async ring; S = Q K^T and O += P V run on mma.sync m16n8k16 with fp32
// accumulators; the softmax is online, in fp32, with exp2 and the scale folded into one FMA.
// Tiles no row can see are never loaded; tiles every row sees entirely skip the mask.
//
// WGMMA (sm_90a): each warpgroup of 4 warps owns 64 query rows; S = Q K^T reads Q and K from
// shared memory through descriptors, O += P V takes P from registers (the S accumulators packed to
// 16 bits, the same fragment as mma.sync's A) and V through a transposed descriptor. Tiles are then
// stored 128-byte swizzled (WgmmaLayout); the softmax and epilogue are the same code.
//
// TMA (wgmma, dense layout): one more warpgroup, the producer, whose one elected thread loads Q and
// then every K and V tile with TMA (a copy per 64-column block, from tensor maps built on the host)
// into the NUM_STAGES-slot ring. Each slot has three mbarriers: K full and V full (the copies
// complete them), and empty (each consumer warp arrives once its wgmma on the slot have waited).
// The consumer warps wait on K before S = Q K^T and on V before O += P V, and no CTA barrier is
// left in the loop. setmaxnreg moves the producer's registers to the consumers. The overlapped
// schedules (OVERLAP, PINGPONG; see the KV loop) run the softmax under the GEMMs, with a fourth
// mbarrier a slot: K's and V's slots are emptied apart.
//
// PERSISTENT (TMA): a grid of at most the CTAs the SMs hold walks the query tiles (TileWalk). Q has
// one more mbarrier, empty: each consumer warp arrives once the tile's last S = Q K^T has landed,
// and the producer then loads the next tile's Q while the consumers finish the tile. The ring runs
// on across tiles, and O is staged in a tile of its own (sO), so no CTA barrier is left at all.
namespace attngen {

template <class T, bool BF16, int HEAD_DIM, int HEAD_DIM_V, int BLOCK_M, int BLOCK_N, int NUM_WARPS, int NUM_STAGES,
          int MASK, bool RETURN_LSE, bool Q_IN_REGS, int ROW_ELEMS, int ROW_ELEMS_V, bool SWIZZLE, bool SWIZZLE_V,
          bool WGMMA, bool SOFTCAP = false, bool ALIBI = false, bool VARLEN = false, bool PAGED = false,
          bool MASK_LIST = false, int TMA_CTAS = 0, bool OVERLAP = false, bool PINGPONG = false,
          bool PERSISTENT = false>
__device__ __forceinline__ void prefill_fwd(const PrefillParams<T>& p, const TmaDesc* maps = nullptr) {
  using L = SmemLayout<HEAD_DIM, ROW_ELEMS, SWIZZLE>;
  using LQ = typename Select<WGMMA, WgmmaLayout<HEAD_DIM, BLOCK_M>, L>::type;
  using LK = typename Select<WGMMA, WgmmaLayout<HEAD_DIM, BLOCK_N>, L>::type;
  using LVs = SmemLayout<HEAD_DIM_V, ROW_ELEMS_V, SWIZZLE_V>;
  using LV = typename Select<WGMMA, WgmmaLayout<HEAD_DIM_V, BLOCK_N>, LVs>::type;
  constexpr int Q_ELEMS = WGMMA ? BLOCK_M * HEAD_DIM : BLOCK_M * ROW_ELEMS;
  constexpr int K_ELEMS = WGMMA ? BLOCK_N * HEAD_DIM : BLOCK_N * ROW_ELEMS;
  constexpr int V_ELEMS = WGMMA ? BLOCK_N * HEAD_DIM_V : BLOCK_N * ROW_ELEMS_V;
  constexpr int THREADS = NUM_WARPS * 32;
  constexpr int WARP_M = BLOCK_M / NUM_WARPS;
  constexpr int M_TILES = WARP_M / 16;
  constexpr int N_TILES = BLOCK_N / 8;     // 8-wide column tiles of S
  constexpr int D_TILES = HEAD_DIM_V / 8;  // 8-wide column tiles of O
  constexpr int K_STEPS = HEAD_DIM / 16;   // k-steps of Q K^T
  static_assert(WARP_M % 16 == 0 && BLOCK_N % 16 == 0 && HEAD_DIM % 16 == 0 && HEAD_DIM_V % 16 == 0, "tile shape");
  static_assert(HEAD_DIM_V <= HEAD_DIM, "O is staged in Q's tile");
  // TMA_CTAS: 0, the cp.async pipeline; else the TMA pipeline, its registers split for that many CTAs
  // an SM (PrefillSpec.tma_ctas, which the entry's launch bounds also take).
  constexpr bool TMA = TMA_CTAS > 0;
  static_assert(!TMA || (WGMMA && !VARLEN && !PAGED && !MASK_LIST), "TMA: wgmma on the dense layout");
  static_assert(!OVERLAP || (TMA && NUM_STAGES >= 2), "OVERLAP: the TMA ring, tile i's V and i+1's K in it");
  static_assert(!PINGPONG || (OVERLAP && NUM_WARPS >= 8), "PINGPONG: two or three consumer warpgroups take turns");
  static_assert(NUM_WARPS != 12 || TMA, "three consumer warpgroups: the TMA pipeline's (setmaxnreg)");
  static_assert(!PERSISTENT || TMA, "PERSISTENT: the TMA pipeline's producer loads the next tile's Q");
  // TMA: registers per thread of the producer warpgroup and of the consumers, after setmaxnreg. Two
  // consumer warpgroups run one CTA an SM, launched with 168 (384 threads): 24 + 2 x 240 (40 + 2 x 232 read
  // 0.2% slower over the 72-shape sweep, 2.7% at head_dim 64 without a mask below 2048 rows; H100,
  // 2026-11-26). Three (192-row tiles, launched with 128 for 512 threads): 32 + 3 x 160. With two CTAs an SM (one consumer warpgroup,
  // launched with 128): 24 + 232. One consumer warpgroup alone on an SM has every register it can use, and
  // no setmaxnreg.
  constexpr int GROUPS = NUM_WARPS / 4;  // consumer warpgroups (wgmma)
  constexpr bool MOVE_REGS = NUM_WARPS >= 8 || TMA_CTAS == 2;
  constexpr int PRODUCER_REGS = NUM_WARPS == 12 ? 32 : 24;
  constexpr int CONSUMER_REGS = NUM_WARPS == 12 ? 160 : NUM_WARPS == 8 ? 240 : 232;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned char* smem_base = WGMMA ? aligned_smem<1024>(smem_raw) : smem_raw;
  T* sQ = reinterpret_cast<T*>(smem_base);
  T* sK = sQ + Q_ELEMS;
  T* sV = sK + NUM_STAGES * K_ELEMS;
  // PERSISTENT: O's staging tile after the V slots (otherwise O is staged in Q's).
  using LO = typename Select<PERSISTENT, WgmmaLayout<HEAD_DIM_V, BLOCK_M>, LQ>::type;
  T* sO = PERSISTENT ? sV + NUM_STAGES * V_ELEMS : sQ;
  // TMA: the ring's mbarriers after the V slots (and sO), 8 bytes each: Q's, then per slot K full, V full,
  // empty (OVERLAP: K's slot empty, then per slot V's: tile i's K is done with a step before its V), then
  // (PERSISTENT) Q's empty.
  const unsigned bars = TMA ? smem_addr(sV + NUM_STAGES * V_ELEMS + (PERSISTENT ? BLOCK_M * HEAD_DIM_V : 0)) : 0u;
  const unsigned q_bar = bars;
  auto k_bar = [&](int s) { return bars + 8u * (1 + s); };
  auto v_bar = [&](int s) { return bars + 8u * (1 + NUM_STAGES + s); };
  auto e_bar = [&](int s) { return bars + 8u * (1 + 2 * NUM_STAGES + s); };
  auto ev_bar = [&](int s) { return bars + 8u * (1 + 3 * NUM_STAGES + s); };
  const unsigned qe_bar = bars + 8u * (1 + (OVERLAP ? 4 : 3) * NUM_STAGES);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;  // row within an 8-row group of an mma fragment
  const int t = lane % 4;  // column pair within an 8-wide fragment

  // TMA: split_producer sets up the mbarriers, then the producer warpgroup gives its registers to the consumers
  // and its one elected thread runs copies(); true in the producer warpgroup, which then leaves the kernel.
  // produce issues one query tile's copies (its Q, then its KV tiles from the ring's ring-th place on): the
  // ring's r-th tile (r counts on across the CTA's query tiles) goes to slot r % NUM_STAGES once the
  // consumers have released the tile that slot held; PERSISTENT, a query tile's Q once they have released
  // the previous one's.
  auto split_producer = [&](auto&& copies) {
    if constexpr (TMA) {  // compiled only there: WgmmaOps exists on sm_90a alone
      using W = WgmmaOps<BF16>;
      if (tid == 0) {
        W::mbar_init(q_bar, 1);
#pragma unroll
        for (int s = 0; s < NUM_STAGES; ++s) {
          W::mbar_init(k_bar(s), 1);
          W::mbar_init(v_bar(s), 1);
          W::mbar_init(e_bar(s), NUM_WARPS);
          if constexpr (OVERLAP) W::mbar_init(ev_bar(s), NUM_WARPS);
        }
        if constexpr (PERSISTENT) W::mbar_init(qe_bar, NUM_WARPS);
        W::mbar_init_fence();
      }
      __syncthreads();
      if (warp >= NUM_WARPS) {
        if constexpr (MOVE_REGS) W::template regs_dec<PRODUCER_REGS>();
        if (tid == THREADS) copies();
        return true;
      }
      if constexpr (MOVE_REGS) W::template regs_inc<CONSUMER_REGS>();
    }
    return false;
  };
  auto produce = [&](int pass, int ring, int m0, int head, int kv_head, int batch, int tile_begin, int n_tiles) {
    if constexpr (TMA) {  // compiled only there: WgmmaOps exists on sm_90a alone
      using W = WgmmaOps<BF16>;
      if (PERSISTENT && pass > 0) W::mbar_wait(qe_bar, (pass - 1) & 1);
      W::mbar_expect(q_bar, Q_ELEMS * sizeof(T));
#pragma unroll
      for (int b = 0; b < HEAD_DIM / 64; ++b)
        W::tma_load(smem_addr(sQ) + b * LQ::BLOCK_BYTES, maps, q_bar, 64 * b, m0, head, batch);
      for (int it = 0; it < n_tiles; ++it) {
        const int r = ring + it;  // the tile's place in the ring
        const int slot = r % NUM_STAGES;
        if (r >= NUM_STAGES) W::mbar_wait(e_bar(slot), ((r / NUM_STAGES) + 1) & 1);
        const int n0 = (tile_begin + it) * BLOCK_N;
        W::mbar_expect(k_bar(slot), K_ELEMS * sizeof(T));
#pragma unroll
        for (int b = 0; b < HEAD_DIM / 64; ++b)
          W::tma_load(smem_addr(sK + slot * K_ELEMS) + b * LK::BLOCK_BYTES, maps + 1, k_bar(slot), 64 * b, n0, kv_head,
                      batch);
        if constexpr (OVERLAP) {
          if (r >= NUM_STAGES) W::mbar_wait(ev_bar(slot), ((r / NUM_STAGES) + 1) & 1);
        }
        W::mbar_expect(v_bar(slot), V_ELEMS * sizeof(T));
#pragma unroll
        for (int b = 0; b < HEAD_DIM_V / 64; ++b)
          W::tma_load(smem_addr(sV + slot * V_ELEMS) + b * LV::BLOCK_BYTES, maps + 2, v_bar(slot), 64 * b, n0, kv_head,
                      batch);
      }
    }
  };
  if constexpr (PERSISTENT) {
    // The producer walks the same query tiles as the consumers, ahead of them.
    if (split_producer([&]() {
          int ring = 0;
          TileWalk<BLOCK_M> walk;
          for (int pass = 0;; ++pass) {
            int m_block, head, batch, seqlen_q, seqlen_k;
            if (!walk.tile(p, m_block, head, batch, seqlen_q, seqlen_k)) break;
            const int m0 = m_block * BLOCK_M;
            const KeyRange keys = key_range<MASK>(seqlen_q, seqlen_k, p.win_left, p.win_right);
            const KeyRange::Span span = keys.tiles<BLOCK_N>(m0, min(m0 + BLOCK_M, seqlen_q) - 1);
            produce(pass, ring, m0, head, head / p.group, batch, span.first, span.count);
            ring += span.count;
            walk.next(p);
          }
        }))
      return;
  }

  // One pass per query tile the CTA computes (PERSISTENT; otherwise one pass). ring0: the ring tiles the
  // CTA's earlier query tiles took.
  int ring0 = 0;
  TileWalk<BLOCK_M> walk;  // PERSISTENT
  for (int pass = 0;; ++pass) {
    // Which (query tile, head, batch) this CTA computes: cta_tile, or, MASK_LIST, the work list's
    // slot order (unit, query tile), built heaviest first on the GPU; PERSISTENT, the walk's.
    int m_block, head, batch, seqlen_q, seqlen_k;
    long long q_row0 = 0, k_row0 = 0;  // VARLEN: the sequence's first row in q / k
    long long list_at = 0;             // MASK_LIST: where this tile's live KV tiles start in p.tiles
    int unit = 0;                      // MASK_LIST: the mask's (batch, head) unit
    int n_tiles;
    if constexpr (MASK_LIST) {
      const int2 item = p.work[blockIdx.x];
      m_block = item.y;
      unit = item.x;
      batch = p.mask_units_b > 1 ? unit / p.mask_units_h : blockIdx.z;
      head = p.mask_units_h > 1 ? unit % p.mask_units_h : blockIdx.y;
      seqlen_q = p.seqlen_q;
      seqlen_k = p.seqlen_k;
      const long long at = (long long)unit * p.num_q_tiles + m_block;
      list_at = at * p.max_tiles;
      n_tiles = p.tile_count[at];
    } else if constexpr (PERSISTENT) {
      if (!walk.tile(p, m_block, head, batch, seqlen_q, seqlen_k)) break;
    } else {
      if (past_work<VARLEN>(p)) return;
      cta_tile<VARLEN, PAGED>(p, m_block, head, batch, seqlen_q, seqlen_k, q_row0, k_row0);
    }
    const int kv_head = head / p.group;
    const int m0 = m_block * BLOCK_M;
    const int m_last = min(m0 + BLOCK_M, seqlen_q) - 1;

    const KeyRange keys = key_range<MASK>(seqlen_q, seqlen_k, p.win_left, p.win_right);
    const KeyRange::Span span = keys.tiles<BLOCK_N>(m0, m_last);
    const int tile_begin = span.first;
    if constexpr (!MASK_LIST) n_tiles = span.count;
    // The it-th KV tile this CTA visits (MASK_LIST: the list's entry, bit 31 = mask all kept).
    auto tile_at = [&](int it) { return MASK_LIST ? (p.tiles[list_at + it] & 0x7fffffff) : tile_begin + it; };

    const float alibi_u = ALIBI ? p.alibi[batch * p.alibi_sb + head] / p.sm_scale : 0.f;
    const T* gQ = p.q + (VARLEN ? 0 : batch * p.q_sb) + head * p.q_sh + (q_row0 + m0) * p.q_ss;
    if constexpr (VARLEN) q_row0 = 0;  // dead until the epilogue reads it again
    const T* gK = p.k + (VARLEN ? 0 : batch * p.k_sb) + kv_head * p.k_sh + k_row0 * p.k_ss;
    const T* gV = p.v + (VARLEN ? 0 : batch * p.v_sb) + kv_head * p.v_sh + k_row0 * p.v_ss;

    // PAGED: lane j of each warp holds the j-th table entry of the tile load_kv fills next (tiles
    // are consecutive there: paged is varlen, never a mask list), read one tile ahead so that the
    // table load's latency is not paid before each tile's copies.
    // Key position -> block: a shift when block_size is a power of two (the usual sizes), else a
    // division.
    const int bs_shift = PAGED && (p.block_size & (p.block_size - 1)) == 0 ? __popc(p.block_size - 1) : -1;
    auto block_of = [&](int pos) { return bs_shift >= 0 ? pos >> bs_shift : pos / p.block_size; };
    auto table_lane = [&](int tile) {
      if constexpr (!PAGED) return 0;
      const int first = block_of(tile * BLOCK_N);
      const int last = block_of(min(tile * BLOCK_N + BLOCK_N, seqlen_k) - 1);
      return first + lane <= last ? p.block_table[batch * p.bt_sb + first + lane] : 0;
    };
    int next_table = table_lane(tile_begin);
    auto load_kv = [&](int tile, int slot) {
      const int n0 = tile * BLOCK_N;
      if constexpr (PAGED) {
        // The tile's keys lie in at most BLOCK_N / 16 + 1 blocks. Blocks are whole multiples of 16
        // rows and n0 is one too, so the 16 rows of group r / 16 share a block: lane g (mod the
        // groups) works out group g's block and first row in it, and each row takes them by shuffle.
        const int lane_blk = next_table;
        next_table = table_lane(tile + 1);
        const int first = block_of(n0);
        const int gpos = n0 + 16 * (lane % (BLOCK_N / 16));
        const int gbi = block_of(gpos);
        const int g_blk = min(max(__shfl_sync(0xffffffffu, lane_blk, gbi - first), 0), p.num_blocks - 1);
        const int g_row = gpos - gbi * p.block_size;
        load_pair_rows_async<LK, LV, BLOCK_N, THREADS>(
            sK + slot * K_ELEMS, sV + slot * V_ELEMS, gK, gV, seqlen_k - n0, tid, [&](int r) {
              const long long blk = __shfl_sync(0xffffffffu, g_blk, r / 16);
              const long long row = __shfl_sync(0xffffffffu, g_row, r / 16) + r % 16;
              return make_longlong2(blk * p.k_sb + row * p.k_ss, blk * p.v_sb + row * p.v_ss);
            });
      } else {
        load_tile_async<LK, BLOCK_N, THREADS>(sK + slot * K_ELEMS, gK + (long long)n0 * p.k_ss, p.k_ss,
                                               seqlen_k - n0, tid);
        load_tile_async<LV, BLOCK_N, THREADS>(sV + slot * V_ELEMS, gV + (long long)n0 * p.v_ss, p.v_ss,
                                               seqlen_k - n0, tid);
      }
    };

    if constexpr (TMA) {
      if constexpr (!PERSISTENT) {
        if (split_producer([&]() { produce(0, 0, m0, head, kv_head, batch, tile_begin, n_tiles); })) return;
      }
      WgmmaOps<BF16>::mbar_wait(q_bar, pass & 1);
    } else {
      // Prologue: Q with the first K/V tile in one group, then the next NUM_STAGES - 2 tiles.
      load_tile_async<LQ, BLOCK_M, THREADS>(sQ, gQ, p.q_ss, seqlen_q - m0, tid);
      if constexpr (NUM_STAGES > 1) {
#pragma unroll
        for (int s = 0; s < NUM_STAGES - 1; ++s) {
          if (s < n_tiles) load_kv(tile_at(s), s);
          cp_async_commit();
        }
      }
    }

    float acc_o[M_TILES][D_TILES][4];
    float row_max[M_TILES][2];
    float row_sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int d = 0; d < D_TILES; ++d)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc_o[mt][d][c] = 0.f;
      row_max[mt][0] = row_max[mt][1] = -ATTNGEN_INF;
      row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }

    const int warp_row0 = warp * WARP_M;
    // This warp's query rows that exist; a warp wholly past seqlen_q gets a one-row range.
    const int warp_lo = m0 + warp_row0;
    const int warp_hi = max(warp_lo, min(warp_lo + WARP_M, seqlen_q) - 1);
    unsigned q_frag[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? K_STEPS : 1][4];

    // OVERLAP (TMA): step `it` issues S = Q K^T of tile it, then rescales O for tile it - 1's softmax
    // and issues tile it - 1's O += P V; tile it's softmax runs while P V does, and P V is waited for
    // only after it. The last tile's P V follows the loop. PINGPONG: the consumer warpgroups take turns
    // issuing their GEMMs, in order, so that one's softmax runs under the others' GEMMs: warpgroup w waits
    // on named barrier 2 + w before its GEMMs and arrives on the next one's after them. The last warpgroup
    // lets warpgroup 0 go first and skips its last arrival: each barrier sees as many arrivals as waits.
    const int wg = warp / 4;
    unsigned p_frag[OVERLAP ? BLOCK_N / 16 : 1][4];  // P of the tile whose P V is issued next
    float corr_o[M_TILES][2];                        // and its softmax's correction of O
    auto turn_begin = [&]() {
      if constexpr (PINGPONG) WgmmaOps<BF16>::bar_sync(2 + wg, 256);
    };
    auto turn_end = [&](bool last) {
      if constexpr (PINGPONG) {
        // (two warpgroups: spelled as before three existed, which keeps their machine code)
        if (!last || (GROUPS == 2 ? wg == 0 : wg != GROUPS - 1))
          WgmmaOps<BF16>::bar_arrive(GROUPS == 2 ? 3 - wg : 2 + (wg + 1) % GROUPS, 256);
      }
    };
    // O takes the correction once the P V before has landed, not between S = Q K^T's issue and P V's: an
    // access to an accumulator register there makes ptxas wait for S = Q K^T to land before P V can issue
    // (C7517, NVRTC 13.0), which puts the rescale and P V's issue between the two GEMMs of every turn. Head_dim
    // 64 keeps it there (RESCALE_IN_TURN): its softmax, not its GEMMs, is what a step waits on, and the rescale
    // rides the wait for S. H100, 2026-11-26: 1.03-1.06x at head_dim 128 and 1.02-1.04x at 256 (ping-pong) from
    // 1k keys; 0.98-0.99x at 64. (At the start of the turn, before S = Q K^T's issue, ptxas serialised every
    // wgmma instead: C7515.)
    constexpr bool RESCALE_IN_TURN = HEAD_DIM <= 64;
    auto rescale_o = [&]() {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int d = 0; d < D_TILES; ++d)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_o[mt][d][c] *= corr_o[mt][c / 2];
    };
    auto issue_pv = [&](int r) {  // r: the tile's place in the ring
      if constexpr (OVERLAP) {  // compiled only there: WgmmaOps exists on sm_90a alone
        using W = WgmmaOps<BF16>;
        if constexpr (RESCALE_IN_TURN) rescale_o();
        const int slot = r % NUM_STAGES;
        W::mbar_wait(v_bar(slot), (r / NUM_STAGES) & 1);
        const unsigned v_at = smem_addr(sV + slot * V_ELEMS);
        W::fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk)
          Wgmma<HEAD_DIM_V, BF16>::rs(acc_o[0], p_frag[kk], W::desc_mn(v_at, kk, LV::BLOCK_BYTES));
      }
    };
    if constexpr (PINGPONG && PERSISTENT) {
      // The same, without a branch on the warpgroup: the others arrive on barrier 2 + GROUPS, which nothing
      // waits on (4 warps complete it). Between one query tile's wgmma and the next, a branch taken by one
      // warpgroup made ptxas serialise them (C7519, NVRTC 13.5).
      const bool lead = wg == GROUPS - 1 && n_tiles > 0;
      WgmmaOps<BF16>::bar_arrive(lead ? 2 : 2 + GROUPS, lead ? 256 : 128);
    } else if constexpr (PINGPONG) {
      if (wg == GROUPS - 1 && n_tiles > 0) WgmmaOps<BF16>::bar_arrive(2, 256);
    }

    for (int it = 0; it < n_tiles; ++it) {
      const int tile = tile_at(it);
      const int r = ring0 + it;  // the tile's place in the ring
      const int slot = NUM_STAGES > 1 ? r % NUM_STAGES : 0;
      if constexpr (TMA) {
        WgmmaOps<BF16>::mbar_wait(k_bar(slot), (r / NUM_STAGES) & 1);
        turn_begin();
      } else if constexpr (NUM_STAGES > 1) {
        cp_async_wait<NUM_STAGES - 2>();
        if constexpr (WGMMA) WgmmaOps<BF16>::fence_proxy();
        __syncthreads();
        // The slot refilled here held tile - 1, which every warp finished before the barrier.
        if (it + NUM_STAGES - 1 < n_tiles) load_kv(tile_at(it + NUM_STAGES - 1), (it + NUM_STAGES - 1) % NUM_STAGES);
        cp_async_commit();
      } else {
        load_kv(tile, 0);
        cp_async_commit();
        cp_async_wait<0>();
        if constexpr (WGMMA) WgmmaOps<BF16>::fence_proxy();
        __syncthreads();
      }
      if constexpr (Q_IN_REGS) {
        if (it == 0) {
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int kk = 0; kk < K_STEPS; ++kk)
              ldmatrix_x4(q_frag[mt][kk][0], q_frag[mt][kk][1], q_frag[mt][kk][2], q_frag[mt][kk][3],
                          smem_addr(sQ + L::offset(warp_row0 + mt * 16 + (lane % 16), kk * 16 + (lane / 16) * 8)));
        }
      }
      const T* sKs = sK + slot * K_ELEMS;
      const T* sVs = sV + slot * V_ELEMS;

      // ---- S = Q K^T ------------------------------------------------------------------------
      float acc_s[M_TILES][N_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
          for (int c = 0; c < 4; ++c) acc_s[mt][n][c] = 0.f;

      if constexpr (WGMMA) {
        // Q rows of this warpgroup x the K tile.
        using W = WgmmaOps<BF16>;
        const unsigned q_at = smem_addr(sQ) + (warp / 4) * 64 * 128;
        const unsigned k_at = smem_addr(sKs);
        W::fence();
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk)
          Wgmma<BLOCK_N, BF16>::ss(acc_s[0], W::desc_k(q_at, kk, LQ::BLOCK_BYTES), W::desc_k(k_at, kk, LK::BLOCK_BYTES),
                                   kk > 0);
        W::commit();
        if constexpr (OVERLAP) {
          // P V's group (empty in the first step, so that one wait serves every step), then S = Q K^T's
          // landing, with P V left running
          if (it > 0) issue_pv(r - 1);
          W::commit();
          turn_end(false);
          W::template wait<1>();
          if (lane == 0) W::mbar_arrive(e_bar(slot));  // this warp is done with tile it's K
        } else {
          W::template wait<0>();
        }
        W::hold(acc_s[0]);
      } else {
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) {
          unsigned a[M_TILES][4];
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
            if constexpr (Q_IN_REGS) {
#pragma unroll
              for (int c = 0; c < 4; ++c) a[mt][c] = q_frag[mt][kk][c];
            } else {
              ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                          smem_addr(sQ + L::offset(warp_row0 + mt * 16 + (lane % 16), kk * 16 + (lane / 16) * 8)));
            }
          }
#pragma unroll
          for (int n2 = 0; n2 < N_TILES / 2; ++n2) {
            unsigned b0, b1, b2, b3;
            ldmatrix_x4(b0, b1, b2, b3,
                        smem_addr(sKs + L::offset(n2 * 16 + (lane % 8) + (lane / 16) * 8,
                                                  kk * 16 + ((lane / 8) % 2) * 8)));
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
              mma_16816<BF16>(acc_s[mt][2 * n2], a[mt], b0, b1);
              mma_16816<BF16>(acc_s[mt][2 * n2 + 1], a[mt], b2, b3);
            }
          }
        }
      }

      const int n0 = tile * BLOCK_N;
      transform_scores<SOFTCAP, ALIBI>(acc_s, p, keys, m0, warp_row0, n0, g, t, alibi_u);

      // ---- custom mask (MASK_LIST; only tiles it does not keep whole) ----------------------------
      if constexpr (MASK_LIST) {
        if (p.tiles[list_at + it] >= 0) {
          // This thread's columns 2t, 2t+1 of 8-column tile n are bits (n % 4) * 8 + 2t (+1) of word n / 4.
          constexpr int WORDS = BLOCK_N / 32;
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
              const int i = m0 + warp_row0 + mt * 16 + g + 8 * r;
              // Addressed from the unit here, not through a pointer held across the loop (registers).
              const unsigned* row =
                  p.mask_bits + unit * p.bits_su + (long long)min(i, seqlen_q - 1) * p.bits_words + n0 / 32;
              unsigned w[WORDS];
#pragma unroll
              for (int q = 0; q < WORDS; ++q) w[q] = i < seqlen_q ? __ldg(row + q) : 0u;
#pragma unroll
              for (int n = 0; n < N_TILES; ++n)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                  if (!((w[n / 4] >> ((n % 4) * 8 + 2 * t + c)) & 1u)) acc_s[mt][n][2 * r + c] = -ATTNGEN_INF;
            }
        }
      }

      mask_key_range<BLOCK_N>(acc_s, keys, m0, warp_row0, warp_lo, warp_hi, n0, g, t);

      // ---- online softmax (fp32, exp2) ------------------------------------------------------
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = row_max[mt][r];
#pragma unroll
          for (int n = 0; n < N_TILES; ++n) mx = fmaxf(mx, fmaxf(acc_s[mt][n][2 * r], acc_s[mt][n][2 * r + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          // A row that has seen only masked keys keeps max -inf; subtracting 0 then keeps exp2 at 0.
          const float base = mx == -ATTNGEN_INF ? 0.f : mx * p.scale_log2;
          const float corr = fast_exp2(row_max[mt][r] * p.scale_log2 - base);
          row_max[mt][r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int n = 0; n < N_TILES; ++n) {
#pragma unroll
            for (int c = 2 * r; c < 2 * r + 2; ++c) {
              const float e = fast_exp2(fmaf(acc_s[mt][n][c], p.scale_log2, -base));
              acc_s[mt][n][c] = e;
              sum += e;
            }
          }
          row_sum[mt][r] = row_sum[mt][r] * corr + sum;
          if constexpr (OVERLAP) {
            corr_o[mt][r] = corr;  // O takes it once the previous P V has landed
          } else {
#pragma unroll
            for (int d = 0; d < D_TILES; ++d) {
              acc_o[mt][d][2 * r] *= corr;
              acc_o[mt][d][2 * r + 1] *= corr;
            }
          }
        }
      }

      // ---- O += P V ---------------------------------------------------------------------------
      if constexpr (OVERLAP) {
        // Tile it - 1's P V has landed: its V slot is released, and P takes this tile's (issued next step).
        using W = WgmmaOps<BF16>;
        W::template wait<0>();
        W::hold(acc_o[0]);
        if (it > 0 && lane == 0) W::mbar_arrive(ev_bar((r - 1) % NUM_STAGES));  // and with tile it - 1's V
        if constexpr (!RESCALE_IN_TURN) rescale_o();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) p_fragment<BF16>(acc_s[0], kk, p_frag[kk]);
      } else if constexpr (WGMMA) {
        // V is N-major for this product.
        using W = WgmmaOps<BF16>;
        const unsigned v_at = smem_addr(sVs);
        if constexpr (TMA) W::mbar_wait(v_bar(slot), (r / NUM_STAGES) & 1);
        W::fence();
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
          unsigned a[4];
          p_fragment<BF16>(acc_s[0], kk, a);
          Wgmma<HEAD_DIM_V, BF16>::rs(acc_o[0], a, W::desc_mn(v_at, kk, LV::BLOCK_BYTES));
        }
        W::commit();
        W::template wait<0>();
        W::hold(acc_o[0]);
      } else {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
          unsigned a[M_TILES][4];
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt) {
            p_fragment<BF16>(acc_s[mt], kk, a[mt]);
          }
#pragma unroll
          for (int d2 = 0; d2 < HEAD_DIM_V / 16; ++d2) {
            unsigned b0, b1, b2, b3;
            ldmatrix_x4_trans(b0, b1, b2, b3,
                              smem_addr(sVs + LV::offset(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                         d2 * 16 + (lane / 16) * 8)));
#pragma unroll
            for (int mt = 0; mt < M_TILES; ++mt) {
              mma_16816<BF16>(acc_o[mt][2 * d2], a[mt], b0, b1);
              mma_16816<BF16>(acc_o[mt][2 * d2 + 1], a[mt], b2, b3);
            }
          }
        }
      }
      if constexpr (TMA) {
        // this warp's wgmma on the slot have waited (OVERLAP: K's and V's slots are released above)
        if (!OVERLAP && lane == 0) WgmmaOps<BF16>::mbar_arrive(e_bar(slot));
      } else if constexpr (NUM_STAGES == 1) {
        __syncthreads();  // the single slot is refilled next
      }
    }
    // PERSISTENT: every S = Q K^T of this warp has landed (none is left in flight): Q's tile is released
    if constexpr (PERSISTENT) {
      if (lane == 0) WgmmaOps<BF16>::mbar_arrive(qe_bar);
    }
    if constexpr (OVERLAP) {
      if (n_tiles > 0) {
        turn_begin();
        issue_pv(ring0 + n_tiles - 1);
        WgmmaOps<BF16>::commit();
        WgmmaOps<BF16>::template wait<0>();
        WgmmaOps<BF16>::hold(acc_o[0]);
        turn_end(true);
        // PERSISTENT: the ring runs on into the next query tile, which needs this tile's V slot back
        if (PERSISTENT && lane == 0) WgmmaOps<BF16>::mbar_arrive(ev_bar((ring0 + n_tiles - 1) % NUM_STAGES));
      }
    }

    // ---- epilogue: normalise, write LSE, stage O through this warp's rows of sQ (PERSISTENT: sO) ---
    // VARLEN: the sequence's first row, read again rather than held across the loop (registers).
    if constexpr (VARLEN) q_row0 = min(max(p.cu_q[batch], 0), p.total_q);
    if constexpr (TMA) {
      // every consumer warp is done with sQ (the producer has left); PERSISTENT: O has a tile of its own
      if constexpr (!PERSISTENT) WgmmaOps<BF16>::bar_sync(1, THREADS);
    } else {
      cp_async_wait_all();  // with one stage, a CTA with no KV tile never committed Q's copies
      __syncthreads();
    }
    store_tile<BF16, RETURN_LSE, VARLEN, WARP_M, HEAD_DIM_V, LO>(acc_o, row_max, row_sum, p, sO, m0, warp_row0, head,
                                                                 batch, q_row0, seqlen_q, lane, g, t);
    if constexpr (!PERSISTENT) {
      break;
    } else {
      walk.next(p);
      ring0 += n_tiles;
      __syncwarp();  // every lane has read its rows of sO before the next tile's are written
    }
  }
}

}  // namespace attngen
