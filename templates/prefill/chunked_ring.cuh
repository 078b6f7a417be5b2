// The chunked kernel's ring of NUM_STAGES slots, the consumers' side: the barriers set up before the loop (init),
// with cp.async each step's wait for its slot and the refill of the slot AHEAD steps on, issued by every thread
// (refill), with TMA each slot given back to the producer once the wgmma that read it has completed (release).
// (The cursor, which slot a step reads and which it fills, is kept by the KV loop in prefill_chunked.)
namespace attngen {

template <class K>
struct ChunkedRing {
  using T = typename K::T;
  using W = WgmmaOps<K::BF16>;

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

  // cp.async, before step s of tile `tile` (the CTA's it-th): wait for the step's slot, then refill slot `fill`, the
  // one AHEAD steps on.
  __device__ __forceinline__ static void refill(const PrefillParams<T>& p, const ChunkedSmem<K>& sm,
                                                const ChunkedCta<K>& cta, int it, int tile, int s, int fill) {
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
  }

  // TMA, after step s's wgmma wait (wgmma_step): the slots whose wgmma has now completed go back to the producer:
  // the step before's (`last`, unless its own wait already gave it back) and, after a whole wait, this one's (`cur`).
  __device__ __forceinline__ static void release(const ChunkedSmem<K>& sm, int lane, int s, int cur, int last) {
    if (lane == 0) {
      if (s > 0 && s - 1 != K::QK_STEPS - 1) W::mbar_arrive(sm.empty_bar(last));
      if (s == K::QK_STEPS - 1 || s == K::STEPS - 1) W::mbar_arrive(sm.empty_bar(cur));
    }
  }
};

}  // namespace attngen
