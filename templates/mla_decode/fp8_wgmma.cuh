// MLA decode against an fp8 latent cache on sm_90a's wgmma kernel (kv_dtype with mma=wgmma, pipeline=tma). The two
// consumer warpgroups are the 16-bit kernel's (MlaConsumer: wgmma S = Q K^T and O += P V through descriptors of the
// 128-byte-swizzled tile, WgmmaLayout), in fp16 for either q (K::MMA_BF16: a bf16 q's tile is carried into fp16 by a
// power of two, start): they read an fp16 tile. A third warpgroup, the producer, makes it: its first warp loads the
// fp8 tiles by TMA (half the 16-bit tile's bytes) as soon as their slots are free, and its three other warps widen
// each in shared memory into fp16 (exact: common/fp8.cuh, fp8x16_widen), in the layout the 16-bit TMA ring leaves.
// ckv is read as K and as V from the one widened tile.
//
// Who widens: a tile is 2,304 16-byte fp8 chunks (512 + 64 columns, 64 keys), each one shared-memory load, eight
// converts (into bf16 it would be three more instructions a pair) and two stores: a thousand warp instructions a tile. The
// consumers spend their wgmma chains waiting on the tensor cores with nothing to issue; producer warps on the SM's
// sub-partitions issue the widening in those idle slots, and the TMA wait and the widening stay off the consumers'
// path (they wait only on a widened slot). Widened by the consumers between their own MMAs, each tile's widening would
// wait on the TMA of the tile after it inside the consumers' loop. The TMA warp does nothing else, so that a load is
// issued the moment its slot is read, not after the widening of the tile before it (with more stages than two, the
// loads run that many tiles ahead). The producer keeps few registers (setmaxnreg: 56; at 40 ptxas spilled) and gives
// the rest to the consumers (224, over the 204 the 16-bit kernel's use).
//
// The ring: NUM_STAGES slots the size of the 16-bit tile; the producer widens tile it + 1 while the consumers compute
// tile it. A slot's fp8 tile lands inside it, by units of 32 keys x one 64-column block (4096 bytes widened): the
// unit's 2048 fp8 bytes (32 rows of 64, unswizzled boxes) in the second half of its own 4096. One warp widens a unit:
// it reads the unit's fp8 bytes whole into registers (16 a lane) before it stores any of the widened rows over them,
// so a unit needs no barrier but the warp's own. (A widened ring of two stages and a separate fp8 stage would need
// 266,240 bytes with Q and P at 64-key tiles, over sm_90a's 232,448; in place, the fp8 kernel takes the 16-bit
// kernel's bytes and three mbarriers a slot.)
//
// mbarriers a slot (bar0 + 8 (kind * NUM_STAGES + slot)): 0 the TMA's bytes landed (one arrival and the bytes),
// 1 widened (the 96 threads of the widening warps, each after fencing its stores for the async proxy), 2 read (the
// consumers' 256 threads, after their last wgmma of the tile). The consumers meet among themselves on named barrier 1
// (MlaDecode::consumers_sync), where the 16-bit kernel calls __syncthreads.
namespace attngen {

template <class K>
struct MlaFp8Wgmma {
  using T = typename K::Elem;
  using LT = typename K::LT;
  using Tiles = MlaTiles<K>;
  using Producer = MlaProducer<K>;
  using W = WgmmaOps<K::IS_BF16>;
  static constexpr bool BF16 = K::MMA_BF16, PAGED = K::PAGED_;  // (the widening's type: fp16)
  static constexpr int FMT = K::KV_FP8_;
  static constexpr int DC = K::DC_, BLOCK_N = K::BLOCK_N_, NUM_STAGES = K::NUM_STAGES_, THREADS = K::THREADS;
  static constexpr int TILE_ELEMS = K::TILE_ELEMS;
  static constexpr int BLOCKS = K::BLOCK_COLS / 64;  // ckv's 64-column blocks, then kpe's one (zero-filled past DR)
  static constexpr int HALVES = BLOCK_N / 32;        // units of a block
  static constexpr int UNITS = BLOCKS * HALVES;
  static constexpr int PRODUCER_THREADS = K::PRODUCER_THREADS;
  static constexpr int WIDEN_WARPS = PRODUCER_THREADS / 32 - 1;  // the producer's warps but the TMA one
  static constexpr int PRODUCER_REGS = 56, CONSUMER_REGS = 224;
  static_assert(BLOCK_N % 32 == 0 && LT::BLOCK_BYTES == BLOCK_N * 128 && K::BLOCK_COLS == DC + 64, "fp8 units");
  static_assert(PRODUCER_THREADS == 128 && THREADS == 256, "one producer warpgroup, two consumer warpgroups");
  static_assert(PRODUCER_THREADS * PRODUCER_REGS + THREADS * CONSUMER_REGS <= W::reg_pool(THREADS + PRODUCER_THREADS),
                "register pool");

  static __device__ __forceinline__ unsigned landed(unsigned bar0, int slot) { return bar0 + 8 * slot; }
  static __device__ __forceinline__ unsigned widened(unsigned bar0, int slot) {
    return bar0 + 8 * (NUM_STAGES + slot);
  }
  static __device__ __forceinline__ unsigned read(unsigned bar0, int slot) {
    return bar0 + 8 * (2 * NUM_STAGES + slot);
  }

  // Every thread: the barriers, Q (the consumers, by cp.async as the 16-bit kernel; a bf16 q then times 2^q_shift
  // into fp16 in place, q_to_fp16), then the roles. The producer warpgroup runs its loop and returns true (its threads
  // then leave the kernel); a consumer returns false once Q is in place for wgmma.
  static __device__ __forceinline__ bool start(const MlaParams<T>& p, const TmaDesc* maps, T* sQ, T* sRing,
                                               unsigned bar0, const int* table, int batch, int seqlen, int r_begin,
                                               int rows_total, int tile_begin, int n_tiles, int q_shift, int tid) {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < NUM_STAGES; ++s) {
        W::mbar_init(landed(bar0, s), 1);
        W::mbar_init(widened(bar0, s), 32 * WIDEN_WARPS);
        W::mbar_init(read(bar0, s), THREADS);
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
      produce(p, maps, sRing, bar0, table, batch, seqlen, tile_begin, n_tiles, tid - THREADS);
      return true;
    }
    W::template regs_inc<CONSUMER_REGS>();
    cp_async_wait<0>();
    if constexpr (K::IS_BF16) q_to_fp16(sQ, q_shift, tid);
    W::fence_proxy();
    K::consumers_sync();  // Q in place
    return false;
  }

  // A bf16 q's tile (landed: every consumer's copies) times 2^k into fp16 in place (k: MlaFp8::q_shift, exact wherever
  // |q| >= 2^-28 of the CTA's largest), element by element, so the swizzle is no matter.
  static __device__ __forceinline__ void q_to_fp16(T* sQ, int k, int tid) {
    K::consumers_sync();
    bf16_tile_to_f16_scaled<K::Q_ELEMS / 8, THREADS>(sQ, k, tid);
  }

  // The producer (thread ptid of its warpgroup). Warp 0 (its first thread): each tile's fp8 boxes in once the
  // consumers have read the tile NUM_STAGES before it out of the slot. Warps 1-3: each tile widened once its bytes
  // have landed, and the slot handed to the consumers.
  static __device__ __forceinline__ void produce(const MlaParams<T>& p, const TmaDesc* maps, T* sRing, unsigned bar0,
                                                 const int* table, int batch, int seqlen, int tile_begin, int n_tiles,
                                                 int ptid) {
    if (ptid < 32) {
      if (ptid == 0) {
#pragma unroll 1
        for (int it = 0; it < n_tiles; ++it) {
          const int slot = it % NUM_STAGES;
          if (it >= NUM_STAGES) W::mbar_wait(read(bar0, slot), ((it / NUM_STAGES) & 1) ^ 1);
          load(p, maps, smem_addr(sRing + slot * TILE_ELEMS), landed(bar0, slot), table, batch, seqlen,
               tile_begin + it);
        }
      }
      return;
    }
#pragma unroll 1
    for (int it = 0; it < n_tiles; ++it) {
      const int slot = it % NUM_STAGES;
      W::mbar_wait(landed(bar0, slot), (it / NUM_STAGES) & 1);
      widen(sRing + slot * TILE_ELEMS, min(BLOCK_N, seqlen - (tile_begin + it) * BLOCK_N), ptid / 32 - 1, ptid % 32);
      W::fence_proxy();  // the widened tile is read by wgmma (the async proxy)
      W::mbar_arrive(widened(bar0, slot));
    }
  }

  // TMA (one thread): tile `tile`'s rows up to the sequence's end as fp8 boxes of `box` rows x 64 bytes, each into
  // its unit's second half (above), completing mbarrier `bar`. Paged, a box is at most the largest power of two
  // dividing the block size (a box never crosses a block); the block index is clamped to the pool as the 16-bit
  // loads clamp it.
  static __device__ __forceinline__ void load(const MlaParams<T>& p, const TmaDesc* maps, unsigned slot_at,
                                              unsigned bar, const int* table, int batch, int seqlen, int tile) {
    const int n0 = tile * BLOCK_N;
    const int box = PAGED ? min(32, p.block_size & -p.block_size) : 32;
    const int pieces = (min(BLOCK_N, seqlen - n0) + box - 1) / box;
    W::mbar_expect(bar, pieces * box * 64 * BLOCKS);
    const bool evict_first = p.kv_evict_first != 0;
    const unsigned long long policy = W::l2_evict_first();
    for (int pc = 0; pc < pieces; ++pc) {
      const int key = pc * box;
      int c1 = n0 + key, c2 = batch;
      if constexpr (PAGED) {
        const int blk = Tiles::block_of(n0 + key, p);
        c1 = n0 + key - blk * p.block_size;
        c2 = min(max(__ldg(table + blk), 0), p.num_blocks - 1);
      }
      const unsigned at = slot_at + (key / 32) * 4096 + 2048 + (key % 32) * 64;
#pragma unroll
      for (int cb = 0; cb < BLOCKS; ++cb) {
        const TmaDesc* map = cb < DC / 64 ? maps : maps + 1;
        const int c0 = cb < DC / 64 ? cb * 64 : 0;
        if (evict_first) W::tma_load3(at + cb * LT::BLOCK_BYTES, map, bar, c0, c1, c2, policy);
        else W::tma_load3(at + cb * LT::BLOCK_BYTES, map, bar, c0, c1, c2);
      }
    }
  }

  // Widening warp w (0..WIDEN_WARPS - 1) widens units w, w + WIDEN_WARPS, ... (common/fp8.cuh's fp8_widen_unit).
  // Rows at or past `valid` (past the sequence) are written as zeros and never read.
  static __device__ __forceinline__ void widen(T* sT, int valid, int w, int lane) {
    unsigned char* base = reinterpret_cast<unsigned char*>(sT);
#pragma unroll 1
    for (int u = w; u < UNITS; u += WIDEN_WARPS) {
      const int key0 = (u % HALVES) * 32;
      unsigned char* unit = base + (u / HALVES) * LT::BLOCK_BYTES + (u % HALVES) * 4096;
      fp8_widen_unit<FMT, BF16>(unit, key0, valid, lane);
    }
  }

  // The consumers' side of the ring (MlaWalk::tiles): tile `it`'s slot waited for until widened, and handed back to
  // the loads once read.
  static __device__ __forceinline__ void acquire(unsigned bar0, int it, int slot) {
    W::mbar_wait(widened(bar0, slot), (it / NUM_STAGES) & 1);
  }
  static __device__ __forceinline__ void release(unsigned bar0, int slot) { W::mbar_arrive(read(bar0, slot)); }
};

}  // namespace attngen
