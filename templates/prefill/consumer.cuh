// The consumer warps of prefill_fwd (prefill/fwd.cuh.jinja): pieces of the step of a KV tile
// (prefill/step.cuh.jinja), on one warp's rows: the scores' transform and key range before the softmax (the
// custom mask, which the step applies itself, between them) and wgmma's issues of S = Q K^T and O += P V. Each warp owns WARP_M = BLOCK_M / NUM_WARPS query rows (M_TILES
// tiles of 16) and the whole KV tile, so the softmax of a row never leaves its warp. S = Q K^T and O += P V run on
// mma.sync m16n8k16 with fp32 accumulators; the softmax is online, in fp32, with exp2 and the scale folded into
// one FMA. The accumulators hold the warp's rows m0 + warp_row0 + 16 mt + g (+8) and this thread's columns
// 8 n + 2 t (+1) of a tile, as mma.sync's C fragment (and wgmma's) lays them out.
//
// WGMMA (sm_90a): each warpgroup of 4 warps owns 64 query rows; S = Q K^T reads Q and K from shared memory through
// descriptors, O += P V takes P from registers (the S accumulators packed to 16 bits, the same fragment as
// mma.sync's A) and V through a transposed descriptor. Tiles are then stored 128-byte swizzled (WgmmaLayout); the
// softmax and epilogue are the same code.
namespace attngen {

template <bool SOFTCAP, bool ALIBI, int M_TILES, int N_TILES, class T>
__device__ __forceinline__ void transform_scores(float (&acc_s)[M_TILES][N_TILES][4], const PrefillParams<T>& p,
                                                 const KeyRange& keys, int m0, int warp_row0, int n0, int g, int t,
                                                 float alibi_u) {
  // ---- logit capping and ALiBi, before the mask ----------------------------------------------
  if constexpr (SOFTCAP || ALIBI) {
    const int col0 = n0 + 2 * t;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int pos = m0 + warp_row0 + mt * 16 + g + 8 * r + keys.shift;  // the row's aligned key position
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c)
            acc_s[mt][n][2 * r + c] = score_transform<SOFTCAP, ALIBI>(
                acc_s[mt][n][2 * r + c], p.softcap_u, p.inv_softcap_u, alibi_u, pos - (col0 + n * 8 + c));
      }
  }
}

template <int BLOCK_N, int M_TILES, int N_TILES>
__device__ __forceinline__ void mask_key_range(float (&acc_s)[M_TILES][N_TILES][4], const KeyRange& keys, int m0,
                                               int warp_row0, int warp_lo, int warp_hi, int n0, int g, int t) {
  // ---- mask (only tiles some row cannot see whole) --------------------------------------
  if (!keys.all_visible(warp_lo, warp_hi, n0, n0 + BLOCK_N)) {
    // One visible key range [lo, hi) per row, relative to this thread's first column, then a
    // compare per element: fewer live values than testing every (row, key) pair.
    const int col0 = n0 + 2 * t;
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = m0 + warp_row0 + mt * 16 + g + 8 * r;
        const int lo = keys.lo(i) - col0;
        const int hi = keys.hi(i) - col0;
#pragma unroll
        for (int n = 0; n < N_TILES; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = n * 8 + c;
            if (j < lo || j >= hi) acc_s[mt][n][2 * r + c] = -ATTNGEN_INF;
          }
      }
  }
}

// The pieces that take the kernel's constants (traits.cuh): wgmma's issues. The step's other pieces (mma.sync's
// S = Q K^T and O += P V, the custom mask's bits, the softmax, the packing of P for wgmma) stay in its text: each
// moved into a function renumbered the PTX's registers, which ptxas allocates from, and changed the machine code:
// the mma.sync loops and the mask bits on sm_80 (P V at 2 row tiles a warp), the softmax on sm_90a's persistent
// ping-pong kernel, P's packing on sm_90a.
template <class K>
struct FwdConsumer {
  using T = typename K::T;
  static constexpr int M_TILES = K::M_TILES;
  static constexpr int N_TILES = K::N_TILES;
  static constexpr int D_TILES = K::D_TILES;
  static constexpr bool BF16 = K::BF16;

  // S = Q K^T issued on wgmma: Q rows of this warpgroup x the K tile (the step commits and waits).
  static __device__ __forceinline__ void qk_wgmma(float (&acc_s)[M_TILES][N_TILES][4], const T* sQ, const T* sKs,
                                                  int warp) {
    using W = WgmmaOps<BF16>;  // compiled only where called: WgmmaOps exists on sm_90a alone
    const unsigned q_at = smem_addr(sQ) + (warp / 4) * 64 * 128;
    const unsigned k_at = smem_addr(sKs);
    W::fence();
#pragma unroll
    for (int kk = 0; kk < K::K_STEPS; ++kk)
      Wgmma<K::BLOCK_N, BF16>::ss(acc_s[0], W::desc_k(q_at, kk, K::LQ::BLOCK_BYTES),
                                  W::desc_k(k_at, kk, K::LK::BLOCK_BYTES), kk > 0);
  }

  // O += P V issued on wgmma, P packed in a, V (N-major) at v_at (the step commits and waits).
  static __device__ __forceinline__ void pv_wgmma(float (&acc_o)[M_TILES][D_TILES][4],
                                                  const unsigned (&a)[K::BLOCK_N / 16][4], unsigned v_at) {
    using W = WgmmaOps<BF16>;  // compiled only where called: WgmmaOps exists on sm_90a alone
    W::fence();
#pragma unroll
    for (int kk = 0; kk < K::BLOCK_N / 16; ++kk)
      Wgmma<K::HEAD_DIM_V, BF16>::rs(acc_o[0], a[kk], W::desc_mn(v_at, kk, K::LV::BLOCK_BYTES));
  }
};

}  // namespace attngen
