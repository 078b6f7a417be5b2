// MLA decode: the pieces of a tile step of MlaDecode (mla_decode/fwd.cuh) that its loop and MlaAlternate's
// (mla_decode/alternate.cuh) share: a cache tile's loads (cp.async by every thread, or TMA boxes by one), the rows
// zeroed past the sequence, and the keys masked past a row's token.
namespace attngen {

template <class K>
struct MlaTiles {
  using T = typename K::Elem;
  using LT = typename K::LT;
  static constexpr bool BF16 = K::IS_BF16, PAGED = K::PAGED_, TMA = K::TMA_, ALT = K::ALT_, PAGE_ROWS = K::PAGE_ROWS_;
  using Pages = typename K::Pages;
  static constexpr int DC = K::DC_, ROWS = K::ROWS_, BLOCK_N = K::BLOCK_N_, THREADS = K::THREADS;
  static constexpr int TILE_ELEMS = K::TILE_ELEMS;

  // COLS columns of ROWS cache rows from `base` (one row block: element stride s_pos per position,
  // or per paged slot) into the tile's columns [col0, col0 + COLS): each thread keeps one column
  // chunk and steps down the rows. Rows at or past the sequence are zero-filled and never read.
  // Paged: lane j of each warp holds `pages` of the tile's 16-row group j, or (PAGE_ROWS) of its rows j and j + 32
  // (pages_of in MlaDecode::run).
  template <int COLS>
  static __device__ __forceinline__ void load_cols(T* tile, int col0, const T* base, long long s_blk, long long s_pos,
                                                   const MlaParams<T>& p, Pages pages, int n0, int seqlen, int tid) {
    constexpr int CHUNKS = COLS / 8;
    constexpr int ROW_STEP = THREADS / CHUNKS;
    const int c = (tid % CHUNKS) * 8;
    if constexpr (PAGED) {
      // Clamped to the pool: a bad table entry reads a wrong block instead of faulting. The address is in
      // the pool whether or not the row is in the sequence (the slot lies in the block), so it is not
      // chosen on ok: that choice compiled to a branch around each row's copy, and the paged cache fell well
      // behind the contiguous one (16 heads, batch 64-128); without it, it keeps up. Two rows a step at 16 rows
      // a CTA (one a step was slower there); one at more rows (two spilled on sm_90a).
      constexpr int UNROLL = ROWS <= 16 ? 2 : 1;
#pragma unroll UNROLL
      for (int r = tid / CHUNKS; r < BLOCK_N; r += ROW_STEP) {
        const int2 at = block_slot(pages, r, p);
        cp_async_16(smem_addr(tile + LT::offset(r, col0 + c)), base + at.x * s_blk + at.y * s_pos + c, n0 + r < seqlen);
      }
    } else {
#pragma unroll 2
      for (int r = tid / CHUNKS; r < BLOCK_N; r += ROW_STEP) {
        const int pos = n0 + r;
        const bool ok = pos < seqlen;
        const T* src = base;
        if (ok) src = base + pos * s_pos + c;
        cp_async_16(smem_addr(tile + LT::offset(r, col0 + c)), src, ok);
      }
    }
  }

  // PAGE_ROWS: lane `lane`'s pages of tile `tile` as block_slot reads them, rows lane and lane + 32's table entries
  // (0 past the sequence) and slots.
  static __device__ __forceinline__ int4 row_pages(const MlaParams<T>& p, const int* table, int seqlen, int tile,
                                                   int lane) {
    const int pos0 = tile * BLOCK_N + lane, pos1 = pos0 + 32;
    const int blk0 = block_of(pos0, p), blk1 = block_of(pos1, p);
    return make_int4(pos0 < seqlen ? __ldg(table + blk0) : 0, pos0 - blk0 * p.block_size,
                     pos1 < seqlen && BLOCK_N > 32 ? __ldg(table + blk1) : 0, pos1 - blk1 * p.block_size);
  }

  // Paged, cp.async: tile row r's block, clamped to the pool (its address stays inside it whether or not the row is
  // live), and its slot in that block, from the lane of `pages` that holds them (pages_of in MlaDecode::run): lane
  // r / 16 holds the 16-row group's block and first slot, or (PAGE_ROWS) lane r % 32 rows r % 32 and r % 32 + 32's.
  // Every lane shuffles both halves: the rows of one call may differ between lanes.
  static __device__ __forceinline__ int2 block_slot(Pages pages, int r, const MlaParams<T>& p) {
    if constexpr (PAGE_ROWS) {
      const int lo_b = __shfl_sync(0xffffffffu, pages.x, r % 32), lo_s = __shfl_sync(0xffffffffu, pages.y, r % 32);
      int2 at = make_int2(lo_b, lo_s);
      if constexpr (BLOCK_N > 32) {
        const int hi_b = __shfl_sync(0xffffffffu, pages.z, r % 32), hi_s = __shfl_sync(0xffffffffu, pages.w, r % 32);
        at = r < 32 ? at : make_int2(hi_b, hi_s);
      }
      return make_int2(min(max(at.x, 0), p.num_blocks - 1), at.y);
    } else {
      const int b = min(max(__shfl_sync(0xffffffffu, pages.x, r / 16), 0), p.num_blocks - 1);
      const int slot = __shfl_sync(0xffffffffu, pages.y, r / 16) + r % 16;
      return make_int2(b, slot);
    }
  }

  // Keys past a row's token (and past the sequence) set to -inf in S of NK keys, the first being key
  // `first` of the tile at n0; lim holds the last key each of the thread's two rows may see.
  template <int NK>
  static __device__ __forceinline__ void mask_keys(float (&s)[NK / 8][4], int n0, int first, int seqlen, int q_len,
                                                   const int (&lim)[2], int t) {
    if (n0 + BLOCK_N - 1 > seqlen - q_len) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int hi = lim[r] - (n0 + first + 2 * t);
#pragma unroll
        for (int n = 0; n < NK / 8; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            if (n * 8 + c > hi) s[n][2 * r + c] = -ATTNGEN_INF;
      }
    }
  }
  // Rows [valid, BLOCK_N) of columns [col0, col0 + COLS) of the (TMA) tile at sT zeroed, 16 bytes per
  // thread idx0, idx0 + step, ...: rows past the sequence a box read from the cache, or none did.
  template <int COLS>
  static __device__ __forceinline__ void zero_rows(T* sT, int valid, int col0, int idx0, int step) {
    for (int idx = idx0; idx < (BLOCK_N - valid) * (COLS / 8); idx += step)
      *reinterpret_cast<uint4*>(sT + LT::offset(valid + idx / (COLS / 8), col0 + (idx % (COLS / 8)) * 8)) =
          make_uint4(0u, 0u, 0u, 0u);
  }

  // A paged position's block: a shift where block_size is a power of two (block_shift >= 0), else a division.
  static __device__ __forceinline__ int block_of(int pos, const MlaParams<T>& p) {
    return p.block_shift >= 0 ? pos >> p.block_shift : pos / p.block_size;
  }

  // TMA (one thread): tile `tile`'s rows up to the sequence's end into ring slot `slot`, in boxes of
  // `box` rows: ckv's 64-column blocks [CB_LO, CB_HI) and, with KPE, one block (zero-filled past DR)
  // of kpe, completing mbarrier `bar`. A template so that only the TMA kernel instantiates it
  // (WgmmaOps exists only there).
  template <int CB_LO, int CB_HI, bool KPE, bool ON = TMA>
  static __device__ __forceinline__ void tma_tile(const MlaParams<T>& p, const TmaDesc* maps, unsigned ring,
                                                  unsigned bar, const int* table, int batch, int seqlen, int tile,
                                                  int slot) {
    using W = typename Select<ON, WgmmaOps<BF16>, void>::type;
    const int n0 = tile * BLOCK_N;
    const int box = PAGED ? box_rows(p) : BLOCK_N;
    const int pieces = (min(BLOCK_N, seqlen - n0) + box - 1) / box;
    const unsigned dst = ring + slot * TILE_ELEMS * (int)sizeof(T);
    W::mbar_expect(bar, pieces * box * ((CB_HI - CB_LO) * 64 + (KPE ? 64 : 0)) * (int)sizeof(T));
    // ckv and kpe first out of L2 where the host asks (op.kv_evict_first; never for alternate tiles, whose
    // kernels keep the plain loads' code)
    const bool evict_first = !ALT && p.kv_evict_first != 0;
    const unsigned long long policy = W::l2_evict_first();
    for (int pc = 0; pc < pieces; ++pc) {
      const int pos = n0 + pc * box;
      int c1 = pos, c2 = batch;
      if constexpr (PAGED) {
        const int blk = block_of(pos, p);
        c1 = pos - blk * p.block_size;
        c2 = min(max(__ldg(table + blk), 0), p.num_blocks - 1);  // clamped as load_cols does
      }
      boxes<CB_LO, CB_HI, KPE, ON>(maps, dst + pc * box * 128, bar, c1, c2, evict_first, policy);
    }
  }
  // One box's 64-column blocks (tma_tile's) into the slot at `at`, from cache coordinates (c1, c2).
  template <int CB_LO, int CB_HI, bool KPE, bool ON = TMA>
  static __device__ __forceinline__ void boxes(const TmaDesc* maps, unsigned at, unsigned bar, int c1, int c2,
                                               bool evict_first, unsigned long long policy) {
    using W = typename Select<ON, WgmmaOps<BF16>, void>::type;
    auto load_box = [&](unsigned to, const TmaDesc* map, int c0) {
      if (evict_first) W::tma_load3(to, map, bar, c0, c1, c2, policy);
      else W::tma_load3(to, map, bar, c0, c1, c2);
    };
#pragma unroll
    for (int cb = CB_LO; cb < CB_HI; ++cb) load_box(at + cb * BLOCK_N * 128, maps, cb * 64);
    if constexpr (KPE) load_box(at + (DC / 64) * BLOCK_N * 128, maps + 1, 0);
  }

  // Paged: the rows of a TMA box, the largest power of two dividing the block size, up to a tile.
  static __device__ __forceinline__ int box_rows(const MlaParams<T>& p) {
    return min(BLOCK_N, p.block_size & -p.block_size);
  }
  // Lane `lane`'s table entry: box `lane` of tile `tile` (0 past the tile's boxes or the sequence). One load a warp.
  static __device__ __forceinline__ int box_entry(const MlaParams<T>& p, const int* table, int seqlen, int tile,
                                                  int lane) {
    const int shift = __popc(box_rows(p) - 1);  // boxes are powers of two
    const int pos = tile * BLOCK_N + (lane << shift);
    return lane < (BLOCK_N >> shift) && pos < seqlen ? __ldg(table + block_of(pos, p)) : 0;
  }
  // BOX_LANES (spec box_lanes: paged blocks smaller than a tile, several boxes a tile): tma_tile's loads issued by
  // the lanes of one warp, lane j's box j from `entry`, its box_entry of the tile (the whole warp calls both), lane 0
  // arming the barrier. One thread issuing every box looks their table entries up one after another, each waited
  // for before its box, and that thread is a consumer's, whose warpgroup's next MMAs wait for it. The lanes are not
  // held for lane 0's arming (a __syncwarp spilled the alternate tiles' kernel): a box that lands first takes the
  // barrier's tx-count below zero, the arming raises it, and the phase cannot complete before lane 0 arrives.
  template <int CB_LO, int CB_HI, bool KPE, bool ON = TMA>
  static __device__ __forceinline__ void tma_tile_lanes(const MlaParams<T>& p, const TmaDesc* maps, unsigned ring,
                                                        unsigned bar, int entry, int seqlen, int tile, int slot,
                                                        int lane) {
    using W = typename Select<ON, WgmmaOps<BF16>, void>::type;
    const int n0 = tile * BLOCK_N;
    const int shift = __popc(box_rows(p) - 1);
    const int pieces = (min(BLOCK_N, seqlen - n0) + (1 << shift) - 1) >> shift;
    if (lane == 0)
      W::mbar_expect(bar, (pieces << shift) * ((CB_HI - CB_LO) * 64 + (KPE ? 64 : 0)) * (int)sizeof(T));
    if (lane < pieces) {
      const int pos = n0 + (lane << shift);
      boxes<CB_LO, CB_HI, KPE, ON>(maps, ring + slot * TILE_ELEMS * (int)sizeof(T) + (lane << shift) * 128, bar,
                                   pos - block_of(pos, p) * p.block_size, min(max(entry, 0), p.num_blocks - 1),
                                   !ALT && p.kv_evict_first != 0, W::l2_evict_first());
    }
  }
};

}  // namespace attngen
