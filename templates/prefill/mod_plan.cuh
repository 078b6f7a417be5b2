// A mask_mod's block plan (included by custom-mask kernels with a user's mask_mod only, after plan.cuh): per (unit,
// query tile, KV tile) the state mask_lists compacts, found by evaluating mask_mod on the tile's pairs, so that the
// kernel walks only the KV tiles it keeps somewhere and runs it per element only on those it keeps in part. No mask
// tensor, no bits: the kernel knows such a plan by its null mask_bits (prefill/step.cuh.jinja).
//
// A pair (row i, key j) counts where it exists (i < seqlen_q, j < seqlen_k) and the built-in mask (causal, window)
// lets row i see key j; mask_mod keeps it where q_idx = i + seqlen_k - seqlen_q is >= 0 and it returns true, as in
// the kernel. State 0: it keeps no counted pair (dead, never read); 2: it keeps every one (full: the kernel skips
// mask_mod there, the built-in mask still applies as on every tile); 1: some (partial).
//
// unit = plan batch * units_h + plan head. A plan of units_b == 1 (a mask_mod that never names b) is evaluated at
// b = 0 and serves every batch row; units_h == 1 likewise at h = 0 for every head (snippets.reads_batch_head).
namespace attngen {

struct ModPlanParams {
  PlanParams p;
  ModArgs mods;
};

// grid (num_kv_tiles, num_q_tiles, units), PLAN_THREADS threads: one tile. Warp w takes rows w, w + 8, ..., its
// lanes consecutive keys (an aux tensor indexed by kv_idx is read coalesced); every warp stops once the CTA has
// seen both a kept and a dropped pair (the tile is partial whatever the rest holds).
template <int BLOCK_M, int BLOCK_N, int MASK>
__device__ __forceinline__ void mod_tiles(const ModPlanParams& mp) {
  const PlanParams& p = mp.p;
  constexpr int WARPS = PLAN_THREADS / 32;
  __shared__ int s_keep, s_drop;
  if (threadIdx.x == 0) s_keep = s_drop = 0;
  __syncthreads();
  const int kt = blockIdx.x, qt = blockIdx.y, unit = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const KeyRange keys = key_range<MASK>(p.seqlen_q, p.seqlen_k, p);
  const int m0 = qt * BLOCK_M, n0 = kt * BLOCK_N;
  const KeyRange::Span span = keys.tiles<BLOCK_N>(m0, min(m0 + BLOCK_M, p.seqlen_q) - 1);
  if (kt >= span.first && kt < span.first + span.count) {  // else dead by the built-in mask alone
    const int b = p.units_b > 1 ? unit / p.units_h : 0;
    const int h = p.units_h > 1 ? unit % p.units_h : 0;
    volatile int* keep_seen = &s_keep;
    volatile int* drop_seen = &s_drop;
    for (int r = warp; r < BLOCK_M; r += WARPS) {
      const int i = m0 + r;
      // Made uniform in the warp: its lanes may read the shared flags at different times.
      if (__any_sync(0xffffffffu, i >= p.seqlen_q || (*keep_seen && *drop_seen))) break;
      const int q_idx = i + keys.shift;
      const int lo = max(keys.lo(i), n0), hi = min(keys.hi(i), n0 + BLOCK_N);
      bool keep = false, drop = false;
      for (int j = lo + lane; j < hi; j += 32) {
        const bool k = q_idx >= 0 && UserMods::keep(mp, {}, Pair(b, h, q_idx, j));
        keep |= k;
        drop |= !k;
      }
      if (__any_sync(0xffffffffu, keep) && lane == 0) *keep_seen = 1;
      if (__any_sync(0xffffffffu, drop) && lane == 0) *drop_seen = 1;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0)
    p.states[((long long)unit * p.num_q_tiles + qt) * p.num_kv_tiles + kt] = s_keep ? (s_drop ? 1 : 2) : 0;
}

}  // namespace attngen
