// MLA decode, the producer: Q into shared memory, the ring's first tiles (and, TMA, its mbarriers), and each
// tile's wait and refill: cp.async by every thread (load_tile, a lambda of MlaDecode::run), or TMA boxes by
// thread 0 with the rows past the sequence zeroed.
//
// TMA (with WGMMA): thread 0 loads each cache tile as TMA boxes (64 columns of BOX rows: the whole
// tile when contiguous, the largest power of two dividing the block size when paged) into the ring,
// completing the slot's mbarrier; the other threads never issue a copy. Issued by every thread, the
// cp.async of a 74 KB tile held the warps until much of it had landed, so loads and MMAs ran one
// after the other. The cache rows a box reads past the sequence, and the rows no box covers, are
// zeroed in shared memory before the last tile is read (P is 0 there; V must be finite).
//
// Paged, cp.async: lane j holds the table entry of the 16-row group j % (BLOCK_N / 16) of the tile load_tile
// fills next, and that group's first slot in its block (blocks are whole multiples of 16 positions, tiles start
// at one). Read a tile ahead and kept as read (load_cols clamps it): a lookup where the copies are issued made
// every thread wait for it, every tile. (pages_of and load_tile are lambdas of run: they carry next_pages.)
namespace attngen {

template <class K>
struct MlaProducer {
  using T = typename K::Elem;
  using LQ = typename K::LQ;
  using Tiles = MlaTiles<K>;
  static constexpr bool BF16 = K::IS_BF16, TMA = K::TMA_, ALT = K::ALT_, WGMMA = K::WGMMA_;
  static constexpr int DC = K::DC_, DQK = K::DQK, ROWS = K::ROWS_, BLOCK_N = K::BLOCK_N_, THREADS = K::THREADS;
  static constexpr int NUM_STAGES = K::NUM_STAGES_, BARS = K::BARS, TILE_ELEMS = K::TILE_ELEMS;

  // Q: ROWS packed rows from r_begin (rows past the last head of the last token are zeros), by cp.async. QT threads
  // share a row, thread tid taking its 16-byte chunk of each run of QT chunks, so a row's two pointers are computed
  // once and each chunk sits at a constant offset: walking the flat chunk index instead (a division by the chunks of
  // a row, then the head split, per chunk) was half of a short sequence's instructions.
  static constexpr int QT = THREADS / ROWS >= 16 ? 16 : 8;
  static __device__ __forceinline__ void load_q(const MlaParams<T>& p, T* sQ, int batch, int r_begin, int rows_total,
                                                int tid) {
    static_assert(DC % (8 * QT) == 0 && THREADS % QT == 0, "Q's runs of chunks");
    const int cc = (tid % QT) * 8;
#pragma unroll
    for (int r = tid / QT; r < ROWS; r += THREADS / QT) {
      const int gr = r_begin + r;
      const bool ok = gr < rows_total;
      const T* nope = p.q_nope;
      const T* pe = p.q_pe;
      if (ok) {
        const int2 th = K::token_head(p, gr);
        nope += batch * p.qn_sb + th.x * p.qn_ss + th.y * p.qn_sh + cc;
        pe += batch * p.qp_sb + th.x * p.qp_ss + th.y * p.qp_sh + cc;
      }
#pragma unroll
      for (int j = 0; j < (DQK + 8 * QT - 1) / (8 * QT); ++j) {
        const int c0 = j * 8 * QT;  // the run's first column
        if (c0 + 8 * QT <= DQK || cc < DQK - c0)  // the last run may be cut short (rope 32)
          cp_async_16(smem_addr(sQ + LQ::offset(r, c0 + cc)), c0 < DC ? nope + c0 : pe + (c0 - DC), ok);
      }
    }
  }

  // The barriers (TMA) and the ring's first NUM_STAGES - 1 tiles (alternate tiles: both slots, by halves), then
  // (TMA) Q waited for.
  template <class LoadTile>
  static __device__ __forceinline__ void prologue(const MlaParams<T>& p, const TmaDesc* maps, T* sRing, unsigned bar0,
                                                  const int* table, int batch, int seqlen, int tile_begin, int n_tiles,
                                                  int tid, LoadTile& load_tile) {
    if constexpr (TMA) {
      cp_async_commit();  // Q
      if (tid == 0) {
        using W = WgmmaOps<BF16>;
#pragma unroll
        for (int s = 0; s < BARS; ++s) W::mbar_init(bar0 + 8 * s, 1);
        W::mbar_init_fence();
        if constexpr (ALT) {  // both slots, each half on its own barrier (2 slot + half)
#pragma unroll
          for (int s = 0; s < 2; ++s)
            if (s < n_tiles) {
              Tiles::template tma_tile<0, DC / 128, false>(p, maps, smem_addr(sRing), bar0 + 16 * s, table, batch,
                                                           seqlen, tile_begin + s, s);
              Tiles::template tma_tile<DC / 128, DC / 64, true>(p, maps, smem_addr(sRing), bar0 + 16 * s + 8, table,
                                                                batch, seqlen, tile_begin + s, s);
            }
        } else {
#pragma unroll
          for (int s = 0; s < NUM_STAGES - 1; ++s)
            if (s < n_tiles)
              Tiles::template tma_tile<0, DC / 64, true>(p, maps, smem_addr(sRing), bar0 + 8 * s, table, batch, seqlen,
                                                         tile_begin + s, s);
        }
      }
      cp_async_wait<0>();
      WgmmaOps<BF16>::fence_proxy();
      __syncthreads();  // Q in place, the barriers initialised
    } else if constexpr (NUM_STAGES > 1) {
#pragma unroll
      for (int s = 0; s < NUM_STAGES - 1; ++s) {
        if (s < n_tiles) load_tile(tile_begin + s, s);
        cp_async_commit();  // the first group holds Q too
      }
    } else {
      cp_async_commit();
    }
  }

  // BOX_LANES: warp 0's table entries of the first tile acquire refills (its next_entry).
  static __device__ __forceinline__ int first_entry(const MlaParams<T>& p, const int* table, int seqlen,
                                                    int tile_begin, int tid) {
    return tid < 32 ? Tiles::box_entry(p, table, seqlen, tile_begin + NUM_STAGES - 1, tid) : 0;
  }

  // Tile `tile` (local index it, ring slot `slot`, first key n0) in place for every warp, and the slot read last
  // refilled: by thread 0, or (BOX_LANES) by warp 0 from next_entry, the table entries of the refill's boxes, which
  // then become the next refill's, read a tile ahead.
  template <class LoadTile>
  static __device__ __forceinline__ void acquire(const MlaParams<T>& p, const TmaDesc* maps, T* sRing, unsigned bar0,
                                                 const int* table, int batch, int seqlen, int n_tiles, int tid, int it,
                                                 int tile, int n0, int slot, LoadTile& load_tile, int& next_entry) {
    if constexpr (TMA) {
      // The slot of tile it - 1 is refilled once every warp is done with it (the barrier).
      if (it > 0) __syncthreads();
      const bool more = it + NUM_STAGES - 1 < n_tiles;
      const int at = (it + NUM_STAGES - 1) % NUM_STAGES;
      if constexpr (K::BOX_LANES_) {
        if (tid < 32) {
          if (more)
            Tiles::template tma_tile_lanes<0, DC / 64, true>(p, maps, smem_addr(sRing), bar0 + 8 * at, next_entry,
                                                             seqlen, tile + NUM_STAGES - 1, at, tid);
          next_entry = Tiles::box_entry(p, table, seqlen, tile + NUM_STAGES, tid);
        }
      } else if (tid == 0 && more) {
        Tiles::template tma_tile<0, DC / 64, true>(p, maps, smem_addr(sRing), bar0 + 8 * at, table, batch, seqlen,
                                                   tile + NUM_STAGES - 1, at);
      }
      WgmmaOps<BF16>::mbar_wait(bar0 + 8 * slot, (it / NUM_STAGES) & 1);
      if (n0 + BLOCK_N > seqlen) {
        // Rows [seqlen - n0, BLOCK_N) of V: past the sequence (read by a box, or stale).
        Tiles::template zero_rows<DC>(sRing + slot * TILE_ELEMS, seqlen - n0, 0, tid, THREADS);
        WgmmaOps<BF16>::fence_proxy();
        __syncthreads();
      }
    } else if constexpr (NUM_STAGES > 1) {
      cp_async_wait<NUM_STAGES - 2>();
      if constexpr (WGMMA) WgmmaOps<BF16>::fence_proxy();
      __syncthreads();
      // The slot filled here was read in iteration it - 1, which every warp finished before the barrier.
      if (it + NUM_STAGES - 1 < n_tiles) load_tile(tile + NUM_STAGES - 1, (it + NUM_STAGES - 1) % NUM_STAGES);
      cp_async_commit();
    } else {
      if (it > 0) __syncthreads();  // every warp is done with the previous tile
      load_tile(tile, 0);
      cp_async_commit();
      cp_async_wait<0>();
      if constexpr (WGMMA) WgmmaOps<BF16>::fence_proxy();
      __syncthreads();
    }
  }
};

}  // namespace attngen
