// MLA decode over paged blocks of any size on sm_90a's ring (spec page_rows with pipeline=tma; GATHER in
// mla_decode/fwd.cuh): the consumers are the TMA ring's (the wgmma kernel's two warpgroups, or the mma.sync warps
// reading its swizzled tiles), and a third warpgroup, the producer, gathers each tile into its slot by cp.async, a
// table lookup a key row. A TMA box cannot cross a block, so at blocks of one or a few positions the TMA ring would
// issue one copy per key row and 64-column block; the TMA unit then bounds the load (pages of 16: 36 boxes a 64-key
// tile). The producer warps do nothing but the copies, so a tile's loads go out the moment its slot has been read,
// and the consumers wait only on the slot's mbarrier.
//
// Each producer thread copies one 16-byte column chunk of every 64-column block (ckv's, then kpe's) of BLOCK_N / 16
// rows of a tile, looking up those rows' blocks itself, a tile ahead; rows past the sequence are zero-filled from an
// address inside the pool. It then signals the slot's full mbarrier when its own copies have landed
// (cp.async.mbarrier.arrive.noinc: 128 arrivals a phase).
//
// mbarriers a slot (bar0 + 8 (kind * NUM_STAGES + slot)): 0 full (the producer's 128 threads, by their copies),
// 1 read (the consumers' threads, after their last read of the tile). A consumer that reads by wgmma (the async proxy)
// fences after its wait, as the copies wrote through the generic one.
//
// Alternate tiles (K::ALT_, mla_decode/alternate.cuh) read a slot by halves, each handed back by the warpgroup that
// reads it last, at its own time: the producer's first two warps gather the left halves (ckv's first DC / 2
// columns) and its last two the right ones (the rest of ckv, and kpe), each pair on its own run of the tiles.
// mbarriers (bar0 + 16 slot + 8 half): full, 64 arrivals (the pair's copies); then (+ 32) free, one arrival (the
// reading warpgroup's first thread).
namespace attngen {

template <class K>
struct MlaGather {
  using T = typename K::Elem;
  using LT = typename K::LT;
  using Tiles = MlaTiles<K>;
  using Producer = MlaProducer<K>;
  using W = WgmmaOps<K::IS_BF16>;
  static constexpr bool WGMMA = K::WGMMA_;
  static constexpr int DC = K::DC_, DR = K::DR_, BLOCK_N = K::BLOCK_N_, NUM_STAGES = K::NUM_STAGES_;
  static constexpr int THREADS = K::THREADS, TILE_ELEMS = K::TILE_ELEMS, PRODUCER_THREADS = K::PRODUCER_THREADS;
  static constexpr bool ALT = K::ALT_;
  static constexpr int RJ = BLOCK_N / 16;  // rows a producer thread copies
  static constexpr int HALF_BLOCKS = DC / 128;  // (ALT) ckv's 64-column blocks of a half
  // setmaxnreg: the consumers take the producer's share (as the fp8 wgmma kernel's do; at the launch bounds' 168 a
  // thread the 32-row mma.sync consumers spilled). Four consumer warps (one stage, MlaDecodeSpec.two_ctas) leave
  // room for two CTAs an SM, the register file halved between them.
  static constexpr int CTAS = THREADS == 128 ? 2 : 1;
  // Alternate tiles' consumers hold a whole tile's S beside their half of O (about 250 registers where they run
  // alone at rank 512; at 232 ptxas serialises their wgmma), so there the producer keeps the pool's remaining 24
  // (produce_half is written to fit them).
  static constexpr bool NARROW_PRODUCER = ALT && DC >= 512;
  static constexpr int PRODUCER_REGS = NARROW_PRODUCER ? 24 : 56;
  static constexpr int CONSUMER_REGS = CTAS == 2 ? 200 : NARROW_PRODUCER ? 240 : 224;
  static_assert(PRODUCER_THREADS == 128 && BLOCK_N % 16 == 0 && DC % 64 == 0 && DR <= 64, "the gather");
  static_assert(!ALT || (NUM_STAGES == 2 && DC % 128 == 0), "the gather by halves");
  static_assert(PRODUCER_THREADS * PRODUCER_REGS + THREADS * CONSUMER_REGS <=
                    W::reg_pool(THREADS + PRODUCER_THREADS, CTAS), "register pool");

  static __device__ __forceinline__ unsigned full(unsigned bar0, int slot) { return bar0 + 8 * slot; }
  static __device__ __forceinline__ unsigned read(unsigned bar0, int slot) { return bar0 + 8 * (NUM_STAGES + slot); }
  // (ALT) half `half` of `slot`'s mbarriers: full where MlaAlternate::half_bar waits, then free after every full one.
  static __device__ __forceinline__ unsigned full_half(unsigned bar0, int slot, int half) {
    return bar0 + 16 * slot + 8 * half;
  }
  static __device__ __forceinline__ unsigned free_half(unsigned bar0, int slot, int half) {
    return full_half(bar0 + 16 * NUM_STAGES, slot, half);
  }

  // Every thread: the barriers and Q (the consumers, by cp.async), then the roles. The producer warpgroup runs its
  // loop and returns true (its threads then leave the kernel); a consumer returns false once Q is in place.
  static __device__ __forceinline__ bool start(const MlaParams<T>& p, const TmaDesc*, T* sQ, T* sRing, unsigned bar0,
                                               const int* table, int batch, int seqlen, int r_begin, int rows_total,
                                               int tile_begin, int n_tiles, int, int tid) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < NUM_STAGES; ++s) {
        if constexpr (ALT) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            W::mbar_init(full_half(bar0, s, h), PRODUCER_THREADS / 2);
            W::mbar_init(free_half(bar0, s, h), 1);
          }
        } else {
          W::mbar_init(full(bar0, s), PRODUCER_THREADS);
          W::mbar_init(read(bar0, s), THREADS);
        }
      }
      W::mbar_init_fence();
    }
    if (tid < THREADS) {
      Producer::load_q(p, sQ, batch, r_begin, rows_total, tid);
      cp_async_commit();
    }
    __syncthreads();  // the barriers initialised
    if (tid >= THREADS) {
      W::template regs_dec<PRODUCER_REGS>();
      const int ptid = tid - THREADS;
      if constexpr (ALT) {
        if (ptid < PRODUCER_THREADS / 2)
          produce_half<0>(p, sRing, bar0, table, seqlen, tile_begin, n_tiles, ptid);
        else
          produce_half<1>(p, sRing, bar0, table, seqlen, tile_begin, n_tiles, ptid - PRODUCER_THREADS / 2);
      } else {
        produce(p, sRing, bar0, table, seqlen, tile_begin, n_tiles, ptid);
      }
      return true;
    }
    W::template regs_inc<CONSUMER_REGS>();
    cp_async_wait<0>();
    if constexpr (WGMMA) W::fence_proxy();
    K::consumers_sync();  // Q in place
    return false;
  }

  // Row r0 + 16 j's table entry (clamped to the pool, as MlaTiles::block_slot clamps) and slot, j < RJ, for tile `tile`.
  static __device__ __forceinline__ void lookup(const MlaParams<T>& p, const int* table, int seqlen, int tile, int r0,
                                                int (&entry)[RJ], int (&at)[RJ]) {
#pragma unroll
    for (int j = 0; j < RJ; ++j) {
      const int pos = tile * BLOCK_N + r0 + 16 * j;
      const int blk = Tiles::block_of(pos, p);
      entry[j] = pos < seqlen ? min(max(__ldg(table + blk), 0), p.num_blocks - 1) : 0;
      at[j] = pos - blk * p.block_size;
    }
  }

  // The producer (thread ptid of its warpgroup): each tile gathered once the consumers have read the tile NUM_STAGES
  // before it out of the slot. Lane l of warp w copies 16-byte chunk l % 8 of every 64-column block of rows
  // 4 w + l / 8 + 16 j (a warp's copy: four rows' 128 bytes of one block), their table entries read a tile ahead.
  static __device__ __forceinline__ void produce(const MlaParams<T>& p, T* sRing, unsigned bar0, const int* table,
                                                 int seqlen, int tile_begin, int n_tiles, int ptid) {
    const int lane = ptid % 32;
    const int r0 = (ptid / 32) * 4 + lane / 8;
    const int c = (lane % 8) * 8;
    int entry[RJ], at[RJ];
    if (n_tiles > 0) lookup(p, table, seqlen, tile_begin, r0, entry, at);
#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
      const int slot = it % NUM_STAGES;
      const int n0 = (tile_begin + it) * BLOCK_N;
      if (it >= NUM_STAGES) W::mbar_wait(read(bar0, slot), ((it / NUM_STAGES) & 1) ^ 1);
      T* dst = sRing + slot * TILE_ELEMS;
#pragma unroll 1
      for (int j = 0; j < RJ; ++j) {
        const int r = r0 + 16 * j;
        const bool ok = n0 + r < seqlen;
        const T* ckv = p.ckv + entry[j] * p.c_sb + at[j] * p.c_ss + c;
#pragma unroll
        for (int cb = 0; cb < DC / 64; ++cb) cp_async_16(smem_addr(dst + LT::offset(r, cb * 64 + c)), ckv + cb * 64, ok);
        if (c < DR)
          cp_async_16(smem_addr(dst + LT::offset(r, DC + c)), p.kpe + entry[j] * p.p_sb + at[j] * p.p_ss + c, ok);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full(bar0, slot)) : "memory");
      if (it + 1 < n_tiles) lookup(p, table, seqlen, tile_begin + it + 1, r0, entry, at);
    }
    cp_async_wait_all();  // (its last copies land before its threads leave)
  }

  // (ALT) Half HALF of each tile, by the producer's two warps of that half (thread ptid of 64), into its slot once
  // the warpgroup reading it last has handed it back. Lane l of warp w copies 16-byte chunk l % 8 of each of the
  // half's 64-column blocks of rows 4 w + l / 8 + 8 j. The producer may have 24 registers here (NARROW_PRODUCER), so a
  // tile's table entries are held as the cp.async kernels hold them (MlaTiles::row_pages, two rows a lane), read a
  // tile ahead, and the loop over rows keeps one counter (the row) beside the shared address: the thread's own
  // places (its rows and column) are worked out again from its index each tile rather than held across the loop.
  template <int HALF>
  static __device__ __forceinline__ void produce_half(const MlaParams<T>& p, T* sRing, unsigned bar0,
                                                      const int* table, int seqlen, int tile_begin, int n_tiles,
                                                      int ptid) {
    int4 next = n_tiles > 0 ? Tiles::row_pages(p, table, seqlen, tile_begin, ptid % 32) : int4{};
#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
      const int slot = it % NUM_STAGES;
      const int4 pages = next;
      if (it >= NUM_STAGES) W::mbar_wait(free_half(bar0, slot, HALF), ((it / NUM_STAGES) & 1) ^ 1);
      const int t = half_thread();
      const int r0 = (t / 32) * 4 + (t % 32) / 8, c = (t % 8) * 8;
      const int live = seqlen - (tile_begin + it) * BLOCK_N;  // rows of the tile inside the sequence
      // Rows 8 apart keep their chunk's place in the 128-byte swizzle, and a tile's 64-column blocks are
      // LT::BLOCK_BYTES apart: one shared address a tile (and so few registers)
      unsigned to = smem_addr(sRing + slot * TILE_ELEMS) + LT::offset(r0, c) * (int)sizeof(T);
#pragma unroll 1
      for (int r = r0; r < BLOCK_N; r += 8, to += 8 * 128) {
        const int2 at = Tiles::block_slot(pages, r, p);
        const bool ok = r < live;
        const T* ckv = p.ckv + at.x * p.c_sb + at.y * p.c_ss + c;
#pragma unroll
        for (int cb = HALF * HALF_BLOCKS; cb < (HALF + 1) * HALF_BLOCKS; ++cb)
          cp_async_16(to + cb * LT::BLOCK_BYTES, ckv + cb * 64, ok);
        if (HALF == 1 && c < DR)
          cp_async_16(to + (DC / 64) * LT::BLOCK_BYTES, p.kpe + at.x * p.p_sb + at.y * p.p_ss + c, ok);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full_half(bar0, slot, HALF))
                   : "memory");
      if (it + 1 < n_tiles) next = Tiles::row_pages(p, table, seqlen, tile_begin + it + 1, half_thread() % 32);
    }
    cp_async_wait_all();
  }

  // (ALT) The producer thread's index within its half's 64, read afresh (volatile: not a value the compiler keeps
  // live across the loop over rows, where the narrow producer has no register to spare for it).
  static __device__ __forceinline__ int half_thread() {
    unsigned t;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
    return (int)(t - THREADS) % (PRODUCER_THREADS / 2);
  }

  // The consumers' side of the ring (MlaWalk::tiles): tile `it`'s slot waited for until gathered (and, for wgmma,
  // fenced for the async proxy), and handed back to the producer once read.
  static __device__ __forceinline__ void acquire(unsigned bar0, int it, int slot) {
    W::mbar_wait(full(bar0, slot), (it / NUM_STAGES) & 1);
    if constexpr (WGMMA) W::fence_proxy();
  }
  static __device__ __forceinline__ void release(unsigned bar0, int slot) { W::mbar_arrive(read(bar0, slot)); }
};

}  // namespace attngen
