// An fp8 cache on the TMA kernel (KV8 with TMA; prefill/fwd.cuh.jinja): the producer warpgroup's first warp copies
// each key tile's fp8 rows by TMA (FwdProducer::produce, a lane a box), and its three other warps, here, widen them
// into the MMAs' 16-bit type inside the same slot of the 16-bit ring, which the consumers then read as from the
// 16-bit kernel. That type is fp16 for either q (Q16: a bf16 q is carried into fp16 first, q_tile): an fp8 value
// widens to fp16 by one convert a pair (e5m2 by a byte permute), and to bf16 through fp32, which made the widening,
// bound by the instructions it issues, the bf16 kernel's bottleneck.
//
// A slot's 16-bit tile (WgmmaLayout: 64-column blocks of BLOCK_N 128-byte rows) is units of 32 rows of a block
// (4,096 bytes); a unit's fp8 rows (32 x 64 bytes, unswizzled boxes) land in its second half and are widened in place
// by one warp (common/fp8.cuh's fp8_widen_unit), so the fp8 kernel takes the 16-bit kernel's shared memory and
// stages. mbarriers a slot: K's and V's bytes landed (lk_bar, lv_bar: the TMA's), K full and V full (k_bar, v_bar:
// the 96 widening threads arrive, each after fencing its stores for wgmma's async proxy), and the consumers' empty
// ones as in the 16-bit kernel, which the TMA warp waits on before the slot's next copy.
//
// Why the producer's warps: the consumers wait on the tensor cores through their wgmma chains, and the widening's
// loads, converts and stores issue in those idle slots, off the consumers' path (they wait on a widened slot only);
// the TMA warp does nothing else, so that a copy is issued the moment its slot is released. The producer keeps 64
// registers a thread (the widening holds a unit's 64 bytes a lane), the consumers 216 (FwdProducer's counts).
namespace attngen {

template <class K>
struct FwdWiden {
  using T = typename K::T;
  using W = WgmmaOps<K::BF16>;
  static constexpr int WARPS = 3;  // the producer warpgroup's warps but the TMA one
  static constexpr int HALVES = K::BLOCK_N / 32;  // units of a 64-column block
  static_assert(WARPS * 32 == FwdProducer<K>::WIDEN_THREADS, "K full and V full count every widening thread");

  // Widening warp w's units of one tile of BLOCKS 64-column blocks at sT (w, w + WARPS, ...); rows at or past
  // `valid` written as zeros.
  template <int BLOCKS>
  static __device__ __forceinline__ void tile(T* sT, int valid, int w, int lane) {
    unsigned char* base = reinterpret_cast<unsigned char*>(sT);
#pragma unroll 1
    for (int u = w; u < BLOCKS * HALVES; u += WARPS)
      fp8_widen_unit<K::KV8, K::BF16>(base + (u / HALVES) * (K::BLOCK_N * 128) + (u % HALVES) * 4096,
                                      (u % HALVES) * 32, valid, lane);
  }

  // Q16: the words after Q's landed mbarrier (the mbarriers follow the V slots; lq_bar(0) is its offset from the
  // first): the widening warps' largest |q| (bf16 bits, one a warp), then 2^-k for the consumers.
  static __device__ __forceinline__ unsigned* q_words(T* sV) {
    return reinterpret_cast<unsigned*>(reinterpret_cast<unsigned char*>(sV + K::NUM_STAGES * K::V_ELEMS) +
                                       K::lq_bar(0u) + 8u);
  }
  // The consumers' factor on the logits' scale, 2^-k, read where it is used: held across the loop, it took
  // registers the causal kernels' consumers spilled for.
  static __device__ __forceinline__ float q_unit(T* sV) { return __uint_as_float(q_words(sV)[WARPS]); }

  // Q16: Q's tile (bf16, landed on lq_bar) carried into fp16 in place, times 2^k (fp16_shift_from of its largest
  // finite |q|, exact wherever |q| >= 2^-28 of it); every element on its own, so the swizzle is no matter. Then Q's
  // own mbarrier, which the consumers wait on (96 arrivals).
  static __device__ __forceinline__ void q_tile(T* sQ, T* sV, unsigned bars, int w, int lane) {
    constexpr int CHUNKS = K::Q_ELEMS / 8;  // 16-byte chunks
    uint4* q = reinterpret_cast<uint4*>(sQ);
    const int i0 = w * 32 + lane;
    W::mbar_wait(K::lq_bar(bars), 0);
    unsigned m = 0u;
#pragma unroll 1
    for (int i = i0; i < CHUNKS; i += WARPS * 32) m = bf16x8_finite_max(q[i], m);
    m = __reduce_max_sync(0xffffffffu, m);
    unsigned* words = q_words(sV);
    if (lane == 0) words[w] = m;
    W::bar_sync(15, WARPS * 32);  // (named barrier 15: the consumers take 1-14)
    // k in [-113, 126]: 2^k and 2^-k are normal floats
    m = words[0];
#pragma unroll
    for (int v = 1; v < WARPS; ++v) m = max(m, words[v]);
    const int k = fp16_shift_from(m);
    if (w == 0 && lane == 0) words[WARPS] = (127 - k) << 23;
    bf16_tile_to_f16_scaled<CHUNKS, WARPS * 32>(sQ, k, i0);
    W::fence_proxy();  // read by wgmma (the async proxy)
    W::mbar_arrive(bars);
  }

  // Widening warp w (0..WARPS - 1): Q16, the query tile first (q_tile); then the query tile's n_tiles key tiles from
  // tile_begin, the r-th in slot r % NUM_STAGES (one query tile a CTA: the ring starts at 0), K then V, each once its
  // bytes have landed; rows past seqlen_k (another sequence's, or a block's rows past the sequence's end) become zeros.
  static __device__ __forceinline__ void tiles(T* sQ, T* sK, T* sV, unsigned bars, int tile_begin, int n_tiles,
                                               int seqlen_k, int w, int lane) {
    if constexpr (K::Q16) q_tile(sQ, sV, bars, w, lane);
#pragma unroll 1
    for (int r = 0; r < n_tiles; ++r) {
      const int slot = r % K::NUM_STAGES;
      const int phase = (r / K::NUM_STAGES) & 1;
      const int valid = seqlen_k - (tile_begin + r) * K::BLOCK_N;
      W::mbar_wait(K::lk_bar(bars, slot), phase);
      tile<K::HEAD_DIM / 64>(sK + slot * K::K_ELEMS, valid, w, lane);
      W::fence_proxy();  // the widened tile is read by wgmma (the async proxy)
      W::mbar_arrive(K::k_bar(bars, slot));
      W::mbar_wait(K::lv_bar(bars, slot), phase);
      tile<K::HEAD_DIM_V / 64>(sV + slot * K::V_ELEMS, valid, w, lane);
      W::fence_proxy();
      W::mbar_arrive(K::v_bar(bars, slot));
    }
  }
};

}  // namespace attngen
