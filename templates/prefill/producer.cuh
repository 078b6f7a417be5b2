// The TMA producer of prefill_fwd (prefill/fwd.cuh.jinja; wgmma, not PAGED): one more warpgroup, whose one
// elected thread loads Q and then every K and V tile with TMA (a copy per 64-column block, from tensor maps built on
// the host) into the NUM_STAGES-slot ring. Each slot has three mbarriers: K full and V full (the copies complete
// them), and empty (each consumer warp arrives once its wgmma on the slot have waited). The consumer warps wait on
// K before S = Q K^T and on V before O += P V, and no CTA barrier is left in the loop. setmaxnreg moves the
// producer's registers to the consumers. The overlapped schedules (OVERLAP, PINGPONG; consumer.cuh) run the
// softmax under the GEMMs, with a fourth mbarrier a slot: K's and V's slots are emptied apart.
//
// VARLEN (TMA): the maps cover the packed q, k and v (one batch), and a tile's rows are offset by its sequence's
// first row; a tile crossing the sequence's end reads the next one's rows, which the mask leaves out of S and
// clear_v_tail zeroes in V. PAGED (TMA, blocks of a multiple of 16 rows): k's and v's maps are the cache's
// [num_blocks, block_size, kv_heads, head_dim], and a key tile is copied in boxes of one block's rows each
// (load_pages), which the warpgroup's four warps share. MASK_LIST (TMA): the producer copies the KV tiles the plan
// lists for the query tile.
// KV8 (TMA, an fp8 cache): the producer is a warp copying the fp8 boxes (contiguous or paged) into the slots, whose
// three other warps widen them there (prefill/widen.cuh). Every function here is compiled only where TMA is set:
// WgmmaOps exists on sm_90a alone.
namespace attngen {

template <class K>
struct FwdWiden;  // prefill/widen.cuh (rendered where the spec has an fp8 cache)

template <class K>
struct FwdProducer {
  using T = typename K::T;
  using W = WgmmaOps<K::BF16>;
  static constexpr int NUM_STAGES = K::NUM_STAGES;
  // Registers per thread of the producer warpgroup and of the consumers, after setmaxnreg. Two
  // consumer warpgroups run one CTA an SM, launched with 168 (384 threads): 24 + 2 x 240 (40 + 2 x 232 was
  // slower, most at head_dim 64 without a mask on short sequences). Three (192-row tiles, launched with 128 for
  // 512 threads): 32 + 3 x 160. With two CTAs an SM (one consumer warpgroup,
  // launched with 128): 24 + 232. One consumer warpgroup alone on an SM has every register it can use, and
  // no setmaxnreg. KV8 (two consumer warpgroups): the widening warps hold 64, the consumers 216 (at 56 the
  // widening of fp16 MMAs' tiles spilled under a causal mask; the consumers fit in 216).
  static constexpr bool MOVE_REGS = K::NUM_WARPS >= 8 || K::TMA_CTAS == 2;
  static constexpr int PRODUCER_REGS = K::KV8 ? 64 : K::NUM_WARPS == 12 ? 32 : 24;
  static constexpr int CONSUMER_REGS = K::KV8 ? 216 : K::NUM_WARPS == 12 ? 160 : K::NUM_WARPS == 8 ? 240 : 232;
  static_assert(!MOVE_REGS || 128 * PRODUCER_REGS + K::THREADS * CONSUMER_REGS <=
                                   W::reg_pool(K::THREADS + 128, K::TMA_CTAS),
                "register pool");
  static constexpr int WIDEN_THREADS = 96;  // KV8: the warps that widen (prefill/widen.cuh), who fill K and V

  // Sets up the mbarriers, then the producer warpgroup gives its registers to the consumers and its one elected
  // thread (PAGED, KV8: every warp) runs copies(); true in the producer warpgroup, which then leaves the kernel.
  template <class Copies>
  static __device__ __forceinline__ bool split(unsigned bars, int tid, int warp, Copies&& copies) {
    if (tid == 0) {
      W::mbar_init(bars, K::Q16 ? WIDEN_THREADS : 1);  // Q16: Q carried into fp16 by the widening warps
      if constexpr (K::Q16) W::mbar_init(K::lq_bar(bars), 1);
#pragma unroll
      for (int s = 0; s < NUM_STAGES; ++s) {
        W::mbar_init(K::k_bar(bars, s), K::KV8 ? WIDEN_THREADS : 1);
        W::mbar_init(K::v_bar(bars, s), K::KV8 ? WIDEN_THREADS : 1);
        if constexpr (K::KV8 != 0) {
          W::mbar_init(K::lk_bar(bars, s), 1);
          W::mbar_init(K::lv_bar(bars, s), 1);
        }
        W::mbar_init(K::e_bar(bars, s), K::NUM_WARPS);
        if constexpr (K::OVERLAP) W::mbar_init(K::ev_bar(bars, s), K::NUM_WARPS);
      }
      if constexpr (K::PERSISTENT) W::mbar_init(K::qe_bar(bars), K::NUM_WARPS);
      W::mbar_init_fence();
    }
    __syncthreads();
    if (warp >= K::NUM_WARPS) {
      if constexpr (MOVE_REGS) W::template regs_dec<PRODUCER_REGS>();
      if (K::KV8 != 0 || K::PAGED || tid == K::THREADS) copies();
      return true;
    }
    if constexpr (MOVE_REGS) W::template regs_inc<CONSUMER_REGS>();
    return false;
  }

  // The CTA's one query tile (not PERSISTENT): split, the producer thread issuing the tile's copies. VARLEN: q_row0
  // and k_row0 offset its rows in the maps, which cover the packed tensors (one batch).
  // PAGED: batch is the sequence, whose block table row the producer reads, and seqlen_k its keys. KV8: the warps
  // after the first widen the tiles.
  static __device__ __forceinline__ bool split_one(const PrefillParams<T>& p, const TmaDesc* maps, T* sQ, T* sK, T* sV,
                                                   unsigned bars, int tid, int warp, long long q_row0,
                                                   long long k_row0, int m0, int head, int kv_head, int batch,
                                                   int tile_begin, int n_tiles, long long list_at, int seqlen_k,
                                                   int vt_col = 0) {
    return split(bars, tid, warp, [&]() {
      if constexpr (K::KV8 != 0) {
        if (warp > K::NUM_WARPS) {
          FwdWiden<K>::tiles(sQ, sK, sV, bars, tile_begin, n_tiles, seqlen_k, warp - K::NUM_WARPS - 1, tid % 32);
          return;
        }
      }
      produce(p, maps, sQ, sK, sV, bars, 0, 0, K::VARLEN ? (int)q_row0 + m0 : m0, head, kv_head,
              K::VARLEN && !K::PAGED ? 0 : batch, tile_begin, n_tiles, K::VARLEN ? (int)k_row0 : 0, list_at, seqlen_k,
              vt_col);
    });
  }

  // One query tile's copies (its Q, then its KV tiles from the ring's ring-th place on): the ring's r-th tile
  // (r counts on across the CTA's query tiles) goes to slot r % NUM_STAGES once the consumers have released the
  // tile that slot held; PERSISTENT, a query tile's Q once they have released the previous one's (O_IN_Q: after
  // the tile's first NUM_STAGES key tiles, which need only the ring). m0 and k_row: the first row of Q's tile and
  // of the key tiles in the maps; VARLEN, offset by the sequence's. MASK_LIST: the it-th KV tile is the plan's
  // list entry at list_at + it, not tile_begin + it. FP8: V's transposed copy has the sequence's keys from column
  // vt_col (fp8_vt_col). PAGED: batch is the sequence (q's map has one batch), seqlen_k its keys.
  static __device__ __forceinline__ void produce(const PrefillParams<T>& p, const TmaDesc* maps, T* sQ, T* sK, T* sV,
                                                 unsigned bars, int pass, int ring, int m0, int head, int kv_head,
                                                 int batch, int tile_begin, int n_tiles, int k_row, long long list_at,
                                                 int seqlen_k, int vt_col = 0) {
    // PAGED, KV8: lane j of a warp copies box j of each key tile (load_pages, load_fp8). PAGED (16-bit): the
    // warpgroup's four warps share the boxes, warps 0 and 1 K's, 2 and 3 V's, each every other 64-column block (one
    // warp issuing them all fell behind the MMAs at blocks of 16 rows: a 128-key tile is then 32 boxes of 2 KB); warp
    // 0's lane 0 (lead) arms K's barriers and copies Q, warp 2's (v_lead) arms V's. KV8: one warp, lane 0 the lead
    // (the others widen). Otherwise one thread.
    constexpr bool SPREAD = K::PAGED && K::KV8 == 0;
    const int lane = K::PAGED || K::KV8 != 0 ? threadIdx.x % 32 : 0;
    const int pw = SPREAD ? threadIdx.x / 32 - K::NUM_WARPS : 0;  // the producer warp
    const bool lead = lane == 0 && pw == 0;
    const bool v_lead = lane == 0 && pw == (SPREAD ? 2 : 0);
    const bool k_warp = pw < 2, v_warp = !SPREAD || pw >= 2;
    auto load_q = [&]() {
      if (K::PERSISTENT && pass > 0) W::mbar_wait(K::qe_bar(bars), (pass - 1) & 1);
      if (lead) {
        const unsigned q_bar = K::Q16 ? K::lq_bar(bars) : bars;  // Q16: landed, then carried into fp16 (widen.cuh)
        W::mbar_expect(q_bar, K::Q_ELEMS * sizeof(T));
#pragma unroll
        for (int b = 0; b < K::QK_COLS / 64; ++b)
          W::tma_load(smem_addr(sQ) + b * K::LQ::BLOCK_BYTES, maps, q_bar, 64 * b, m0, head, K::PAGED ? 0 : batch);
      }
    };
    // PAGED: the table row; the block size's shift where it is a power of two; the rows a box, the largest power of
    // two that divides both block_size and the tile's keys (so each box lies in one block, and a tile is whole
    // boxes), and the boxes a tile (at most 8). KV8: at most 32 rows a box, which lands in one 32-key unit of the
    // slot (widen.cuh).
    const int* table = K::PAGED ? p.block_table + (long long)batch * p.bt_sb : nullptr;
    const int bs_shift = K::PAGED && (p.block_size & (p.block_size - 1)) == 0 ? __popc(p.block_size - 1) : -1;
    const int block_box = K::PAGED ? min(K::BLOCK_N & -K::BLOCK_N, p.block_size & -p.block_size) : K::BLOCK_N;
    const int box = K::KV8 ? min(block_box, 32) : block_box;
    const int boxes = K::BLOCK_N / box;
    // PAGED: the table entry of this lane's box of the key tile from key n0, read before the wait for the tile's slot
    // (the lanes' loads are one instruction, and their latency passes in the wait). A box past the sequence's end
    // reads no entry.
    auto page_entry = [&](int n0) {
      const int pos = n0 + lane * box;
      return lane < boxes && pos < seqlen_k ? __ldg(table + (bs_shift >= 0 ? pos >> bs_shift : pos / p.block_size))
                                            : 0;
    };
    // PAGED: key pos's row within its block, and the block a box from pos copies: blk clamped into the pool (as the
    // cp.async copies clamp it), or past the sequence's end block num_blocks, past the map's end, which TMA fills with
    // zeros.
    auto page_row = [&](int pos) { return bs_shift >= 0 ? pos & (p.block_size - 1) : pos % p.block_size; };
    auto page_block = [&](int pos, int blk) {
      return pos < seqlen_k ? min(max(blk, 0), p.num_blocks - 1) : p.num_blocks;
    };
    // PAGED: this lane's box into the slot at dst (64-column blocks of block_bytes) through map, from the block
    // page_block names for it, at its row within the block. After lane 0 has armed the slot's barrier.
    auto load_pages = [&](int blk, unsigned dst, int blocks, int block_bytes, const TmaDesc* map, unsigned bar,
                          int n0) {
      __syncwarp();
      const int pos = n0 + lane * box;
      if (lane < boxes) {
        const int row = page_row(pos);
        const int at = page_block(pos, blk);
#pragma unroll
        for (int b = 0; b < blocks; ++b)
          if (!SPREAD || (b & 1) == (pw & 1))
            W::tma_load(dst + b * block_bytes + lane * box * 128, map, bar, 64 * b, row, kv_head, at);
      }
    };
    // KV8: a tile's fp8 K or V (a whole tile of bytes, its barrier armed by lane 0), lane j's box (paged, as
    // load_pages'; contiguous, rows n0 + j * 32 of the packed cache) into the second half of its 32-row unit of the
    // 16-bit slot at dst, 64 bytes a row (widen.cuh widens it there).
    auto load_fp8 = [&](int blk, unsigned dst, int blocks, int block_bytes, const TmaDesc* map, unsigned bar,
                        int n0) {
      if (lead) W::mbar_expect(bar, blocks * 64 * K::BLOCK_N);
      __syncwarp();
      const int key = lane * box;
      if (lane < boxes) {
        const int row = K::PAGED ? page_row(n0 + key) : n0 + key;
        const int at = K::PAGED ? page_block(n0 + key, blk) : batch;
        for (int b = 0; b < blocks; ++b)
          W::tma_load(dst + b * block_bytes + key / 32 * 4096 + 2048 + key % 32 * 64, map, bar, 64 * b, row, kv_head,
                      at);
      }
    };
    auto load_kv = [&](int it) {
      const int r = ring + it;  // the tile's place in the ring
      const int slot = r % NUM_STAGES;
      const int blk = K::PAGED ? page_entry((tile_begin + it) * K::BLOCK_N) : 0;
      // (OVERLAP: V's warps wait for V's slot alone, below)
      if (r >= NUM_STAGES && (k_warp || !K::OVERLAP)) W::mbar_wait(K::e_bar(bars, slot), ((r / NUM_STAGES) + 1) & 1);
      const int n0 = k_row + (K::MASK_LIST ? (p.tiles[list_at + it] & 0x7fffffff) : tile_begin + it) * K::BLOCK_N;
      if constexpr (K::KV8 != 0) {
        // (the copies complete the landed barriers; the widening completes k_bar)
        load_fp8(blk, smem_addr(sK + slot * K::K_ELEMS), K::QK_COLS / 64, K::LK::BLOCK_BYTES, maps + 1,
                 K::lk_bar(bars, slot), n0);
      } else {
        if (lead) W::mbar_expect(K::k_bar(bars, slot), K::K_ELEMS * sizeof(T));
        if constexpr (K::PAGED) {
          if (k_warp)
            load_pages(blk, smem_addr(sK + slot * K::K_ELEMS), K::QK_COLS / 64, K::LK::BLOCK_BYTES, maps + 1,
                       K::k_bar(bars, slot), n0);
        } else {
#pragma unroll
          for (int b = 0; b < K::QK_COLS / 64; ++b)
            W::tma_load(smem_addr(sK + slot * K::K_ELEMS) + b * K::LK::BLOCK_BYTES, maps + 1, K::k_bar(bars, slot),
                        64 * b, n0, kv_head, batch);
        }
      }
      if constexpr (K::OVERLAP) {
        if (r >= NUM_STAGES && v_warp) W::mbar_wait(K::ev_bar(bars, slot), ((r / NUM_STAGES) + 1) & 1);
      }
      if constexpr (K::KV8 != 0) {
        load_fp8(blk, smem_addr(sV + slot * K::V_ELEMS), K::HEAD_DIM_V / 64, K::LV::BLOCK_BYTES, maps + 2,
                 K::lv_bar(bars, slot), n0);
        return;
      }
      if (v_lead) W::mbar_expect(K::v_bar(bars, slot), K::V_ELEMS * sizeof(T));
      if constexpr (K::FP8) {
        // V's transposed copy (bytes): a box of 128 keys x HEAD_DIM_V rows a 128-byte block
#pragma unroll
        for (int b = 0; b < K::BLOCK_N / 128; ++b)
          W::tma_load(smem_addr(sV + slot * K::V_ELEMS) + b * K::LV::BLOCK_BYTES, maps + 2, K::v_bar(bars, slot),
                      n0 - k_row + vt_col + 128 * b, 0, kv_head, batch);
      } else if constexpr (K::PAGED) {
        if (v_warp)
          load_pages(blk, smem_addr(sV + slot * K::V_ELEMS), K::HEAD_DIM_V / 64, K::LV::BLOCK_BYTES, maps + 2,
                     K::v_bar(bars, slot), n0);
      } else {
#pragma unroll
        for (int b = 0; b < K::HEAD_DIM_V / 64; ++b)
          W::tma_load(smem_addr(sV + slot * K::V_ELEMS) + b * K::LV::BLOCK_BYTES, maps + 2, K::v_bar(bars, slot),
                      64 * b, n0, kv_head, batch);
      }
    };
    // O staged in Q's tile: the first key tiles go out before Q, which waits for the last tile's O to be read
    const int early = K::O_IN_Q ? min(n_tiles, NUM_STAGES) : 0;
    for (int it = 0; it < early; ++it) load_kv(it);
    load_q();
    for (int it = early; it < n_tiles; ++it) load_kv(it);
  }

  // PERSISTENT: the producer walks the same query tiles as the consumers (TileWalk), ahead of them.
  static __device__ __forceinline__ void produce_walk(const PrefillParams<T>& p, const TmaDesc* maps, T* sQ, T* sK,
                                                      T* sV, unsigned bars) {
    int ring = 0;
    TileWalk<K::BLOCK_M> walk;
    for (int pass = 0;; ++pass) {
      int m_block, head, batch, seqlen_q, seqlen_k;
      if (!walk.tile(p, m_block, head, batch, seqlen_q, seqlen_k)) break;
      const int m0 = m_block * K::BLOCK_M;
      const KeyRange keys = key_range<K::MASK>(seqlen_q, seqlen_k, p);
      const KeyRange::Span span = keys.tiles<K::BLOCK_N>(m0, min(m0 + K::BLOCK_M, seqlen_q) - 1);
      produce(p, maps, sQ, sK, sV, bars, pass, ring, m0, head, head / p.group, batch, span.first, span.count, 0, 0,
              seqlen_k);
      ring += span.count;
      walk.next(p);
    }
  }
};

// cp.async (no TMA): every thread of the CTA copies; K and V tiles stream through a NUM_STAGES-deep ring, Q with the
// first tile. The kernel keeps a lambda over these (load_kv), which reads its locals the way a function of them
// would not: held in a struct, they renumbered the PTX of every cp.async kernel.
template <class K>
struct FwdLoads {
  using T = typename K::T;
  static constexpr int BLOCK_N = K::BLOCK_N;
#ifdef ATTNGEN_PAGE_ROWS
  // Spec page_rows: blocks of any size (1, 24, ...), a tile's keys over up to BLOCK_N of them, more than a warp's
  // lanes hold; each row reads its own table entry as it is copied.
  static constexpr bool PAGE_ROWS = K::PAGED;
#else
  static constexpr bool PAGE_ROWS = false;
#endif

  // PAGED: key position -> block: a shift when block_size is a power of two (the usual sizes), else a division.
  static __device__ __forceinline__ int block_shift(const PrefillParams<T>& p) {
    return K::PAGED && (p.block_size & (p.block_size - 1)) == 0 ? __popc(p.block_size - 1) : -1;
  }
  static __device__ __forceinline__ int block_of(const PrefillParams<T>& p, int bs_shift, int pos) {
    return bs_shift >= 0 ? pos >> bs_shift : pos / p.block_size;
  }
  // PAGED: lane j of each warp holds the j-th table entry of KV tile `tile` (tiles are consecutive there: paged is
  // varlen, never a mask list), read one tile ahead so that the table load's latency is not paid before each
  // tile's copies.
  static __device__ __forceinline__ int table_lane(const PrefillParams<T>& p, int bs_shift, int tile, int seqlen_k,
                                                   int batch, int lane) {
    if constexpr (!K::PAGED || PAGE_ROWS) return 0;
    const int first = block_of(p, bs_shift, tile * BLOCK_N);
    const int last = block_of(p, bs_shift, min(tile * BLOCK_N + BLOCK_N, seqlen_k) - 1);
    return first + lane <= last ? p.block_table[batch * p.bt_sb + first + lane] : 0;
  }

  // KV tile `tile` into slot `slot` of the ring (PAGED: next_table, this tile's table lanes, becomes the next's; KV8:
  // sK, sV are the fp8 rows' ring, LKld / LVld their layout).
  static __device__ __forceinline__ void load_kv(const PrefillParams<T>& p, T* sK, T* sV, const T* gK, const T* gV,
                                                 int tile, int slot, int seqlen_k, int batch, int tid, int lane,
                                                 int bs_shift, int& next_table) {
    const int n0 = tile * BLOCK_N;
    if constexpr (PAGE_ROWS) {
      // Row r's block and slot from its own position; r is 0 for rows past the sequence, whose copies are
      // zero-fills, so every entry read lies inside the sequence's table row. Clamped to the pool: a bad table
      // entry reads a wrong block instead of faulting.
      const int* table = p.block_table + (long long)batch * p.bt_sb;
      load_pair_rows_async<typename K::LKld, typename K::LVld, BLOCK_N, K::THREADS>(
          sK + slot * K::K_LD_ELEMS, sV + slot * K::V_LD_ELEMS, gK, gV, seqlen_k - n0, tid, [&](int r) {
            const int pos = n0 + r;
            const int bi = block_of(p, bs_shift, pos);
            const long long blk = min(max(table[bi], 0), p.num_blocks - 1);
            const long long row = pos - bi * p.block_size;
            return make_longlong2(blk * p.k_sb + row * p.k_ss, blk * p.v_sb + row * p.v_ss);
          });
    } else if constexpr (K::PAGED) {
      // The tile's keys lie in at most BLOCK_N / 16 + 1 blocks. Blocks are whole multiples of 16
      // rows and n0 is one too, so the 16 rows of group r / 16 share a block: lane g (mod the
      // groups) works out group g's block and first row in it, and each row takes them by shuffle.
      const int lane_blk = next_table;
      next_table = table_lane(p, bs_shift, tile + 1, seqlen_k, batch, lane);
      const int first = block_of(p, bs_shift, n0);
      const int gpos = n0 + 16 * (lane % (BLOCK_N / 16));
      const int gbi = block_of(p, bs_shift, gpos);
      const int g_blk = min(max(__shfl_sync(0xffffffffu, lane_blk, gbi - first), 0), p.num_blocks - 1);
      const int g_row = gpos - gbi * p.block_size;
      load_pair_rows_async<typename K::LKld, typename K::LVld, BLOCK_N, K::THREADS>(
          sK + slot * K::K_LD_ELEMS, sV + slot * K::V_LD_ELEMS, gK, gV, seqlen_k - n0, tid, [&](int r) {
            const long long blk = __shfl_sync(0xffffffffu, g_blk, r / 16);
            const long long row = __shfl_sync(0xffffffffu, g_row, r / 16) + r % 16;
            return make_longlong2(blk * p.k_sb + row * p.k_ss, blk * p.v_sb + row * p.v_ss);
          });
    } else {
      load_tile_async<typename K::LKld, BLOCK_N, K::THREADS>(sK + slot * K::K_LD_ELEMS, gK + (long long)n0 * p.k_ss,
                                                             p.k_ss,
                                                           seqlen_k - n0, tid);
      if constexpr (K::FP8) {
        // V's transposed copy: HEAD_DIM_V rows of the tile's keys (16-bit pairs; zero past the sequence there)
        load_tile_async<typename K::LV, K::HEAD_DIM_V, K::THREADS>(sV + slot * K::V_ELEMS, gV + n0 / 2, p.v_ss,
                                                                   K::HEAD_DIM_V, tid);
      } else {
        load_tile_async<typename K::LVld, BLOCK_N, K::THREADS>(sV + slot * K::V_LD_ELEMS, gV + (long long)n0 * p.v_ss,
                                                             p.v_ss, seqlen_k - n0, tid);
      }
    }
  }

  // KV8: one tile's fp8 rows (its slot of the fp8 ring, L8) widened into q's dtype in the consumers' layouts (LK, LV)
  // by every thread (exact: common/fp8.cuh's fp8x16_widen). Rows past the sequence are zeros there, and stay zeros.
  static __device__ __forceinline__ void widen(const T* k8, const T* v8, T* k, T* v, int tid) {
    if constexpr (K::KV8 != 0) {
      constexpr int CH = K::HEAD_DIM / 16;  // 16-byte chunks (16 fp8 values) of a row
      // (one chunk of K and one of V at a time: beside a head dim of 256's O more in flight spilled)
#pragma unroll 1
      for (int i = tid; i < BLOCK_N * CH; i += K::THREADS) {
        const int r = i / CH, c = i % CH;
        uint4 lo, hi;
        fp8x16_widen<K::KV8, K::BF16>(*reinterpret_cast<const uint4*>(k8 + K::L8::offset(r, c * 8)), lo, hi);
        *reinterpret_cast<uint4*>(k + K::LK::offset(r, c * 16)) = lo;
        *reinterpret_cast<uint4*>(k + K::LK::offset(r, c * 16 + 8)) = hi;
        fp8x16_widen<K::KV8, K::BF16>(*reinterpret_cast<const uint4*>(v8 + K::L8::offset(r, c * 8)), lo, hi);
        *reinterpret_cast<uint4*>(v + K::LV::offset(r, c * 16)) = lo;
        *reinterpret_cast<uint4*>(v + K::LV::offset(r, c * 16 + 8)) = hi;
      }
    }
  }

  // Zeroes the pad chunks (PAD_DIMS), then the prologue: Q with the first K/V tile in one group, then the next
  // NUM_STAGES - 2 tiles.
  template <class LoadKv, class TileAt>
  static __device__ __forceinline__ void prologue(const PrefillParams<T>& p, T* sQ, T* sV, const T* gQ, int seqlen_q,
                                                  int m0, int tid, int n_tiles, LoadKv& load_kv,
                                                  const TileAt& tile_at) {
    if constexpr (K::PAD_DIMS) {
      // The pad chunk (columns HEAD_DIM to QK_DIM) of every row of Q, the K slots (which follow Q's rows at
      // the same stride) and the V slots: no copy writes there, and the first step's barrier orders these
      // stores before any read.
      auto zero_pad = [&](T* tile, int rows, int row_elems, int col) {
        for (int r = tid; r < rows; r += K::THREADS)
          *reinterpret_cast<uint4*>(tile + r * row_elems + col) = make_uint4(0u, 0u, 0u, 0u);
      };
      if constexpr (K::QK_DIM != K::HEAD_DIM)
        zero_pad(sQ, K::BLOCK_M + K::NUM_STAGES * BLOCK_N, K::ROW_ELEMS, K::HEAD_DIM);
      if constexpr (K::PV_DIM != K::HEAD_DIM_V) zero_pad(sV, K::NUM_STAGES * BLOCK_N, K::ROW_ELEMS_V, K::HEAD_DIM_V);
    }
    load_tile_async<typename K::LQ, K::BLOCK_M, K::THREADS>(sQ, gQ, p.q_ss, seqlen_q - m0, tid);
    if constexpr (K::NUM_STAGES > 1) {
#pragma unroll
      for (int s = 0; s < K::NUM_STAGES - 1; ++s) {
        if (s < n_tiles) load_kv(tile_at(s), s);
        cp_async_commit();
      }
    }
  }
};

}  // namespace attngen
