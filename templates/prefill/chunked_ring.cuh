// The chunked kernel's ring of NUM_STAGES slots, the consumers' side: the barriers set up before the loop (init),
// each step's wait for its slot (cp.async: and the refill of the slot AHEAD steps on, issued by every thread),
// and, with TMA, each slot given back to the producer once the wgmma that read it has completed.
namespace attngen {

template <class K>
struct ChunkedRing {
  using T = typename K::T;
  using W = WgmmaOps<K::BF16>;
  int slot = 0;         // the ring slot step (it, s) reads
  int fill = K::AHEAD;  // the slot the next load fills
  int phase = 0;        // TMA: the parity of that slot's current use
  int last = 0;         // TMA: the slot the step before read

  // The exchange's and the TMA ring's mbarriers, set before any thread uses them.
  __device__ __forceinline__ static void init(const ChunkedSmem<K>& sm, const ChunkedCta<K>& cta) {
    if constexpr (K::QK_PAIR || K::TMA) {
      if (cta.tid == 0) {
        if constexpr (K::QK_PAIR) {
          W::mbar_init(smem_addr(sm.xbar), K::THREADS);
          W::mbar_init(smem_addr(sm.xbar + 1), K::THREADS);
        }
        if constexpr (K::TMA) {
#pragma unroll
          for (int s = 0; s < K::NUM_STAGES; ++s) {
            W::mbar_init(sm.full_bar(s), 1);
            W::mbar_init(sm.empty_bar(s), K::NUM_WARPS);
          }
          W::mbar_init(sm.q_bar(), 1);
        }
        W::mbar_init_fence();
      }
      if constexpr (K::QK_PAIR)
        cluster_sync();  // both CTAs have started, their barriers set, before either writes into the other
      else
        __syncthreads();
    }
  }

  // Step s of tile `tile` (the it-th of the CTA): wait until its slot (`slot`) has landed; cp.async, refill the
  // slot AHEAD steps on.
  __device__ __forceinline__ void wait(const PrefillParams<T>& p, const ChunkedSmem<K>& sm, const ChunkedCta<K>& cta,
                                       int it, int tile, int s) {
    if constexpr (K::TMA) {
      W::mbar_wait(sm.full_bar(slot), phase);
    } else {
      cp_async_wait<K::AHEAD - 1>();
      if constexpr (K::WGMMA) W::fence_proxy();  // the copies (and P) before wgmma reads them
      __syncthreads();
      // The slot filled here was read by step (it, s) - LAG, which every warp finished before the
      // barrier (wgmma: each warpgroup waited for it at step (it, s) - 1).
      const int ahead = s + K::AHEAD;
      if (ahead < K::STEPS)
        ChunkedProducer<K>::load_step(p, sm, cta, tile, ahead, fill);
      else if (it + 1 < cta.n_tiles)
        ChunkedProducer<K>::load_step(p, sm, cta, tile + 1, ahead - K::STEPS, fill);
      cp_async_commit();
      fill = fill + 1 == K::NUM_STAGES ? 0 : fill + 1;
    }
  }

  // On to the next step's slot.
  __device__ __forceinline__ void advance() {
    slot = slot + 1 == K::NUM_STAGES ? 0 : slot + 1;
    if (K::TMA && slot == 0) phase ^= 1;
  }

  // TMA, after step s's wgmma wait (wgmma_step): the slots whose wgmma has now completed go back to the producer:
  // the step before's (unless its own wait already gave it back) and, after a whole wait, this one's (`cur`).
  __device__ __forceinline__ void release(const ChunkedSmem<K>& sm, int lane, int s, int cur) {
    if constexpr (K::TMA) {
      if (lane == 0) {
        if (s > 0 && s - 1 != K::QK_STEPS - 1) W::mbar_arrive(sm.empty_bar(last));
        if (s == K::QK_STEPS - 1 || s == K::STEPS - 1) W::mbar_arrive(sm.empty_bar(cur));
      }
      last = cur;
    }
  }
};

}  // namespace attngen
