// A mask_mod's block plan (included by custom-mask kernels with a user's mask_mod only, after plan.cuh): per (unit,
// query tile, KV tile) the state mask_lists compacts, found by evaluating mask_mod on the tile's pairs, so that the
// kernel walks only the KV tiles it keeps somewhere and runs it per element only on those it keeps in part, or reads
// their keep bits from the plan's pool (ModPlanParams::pool) where they are there. No mask tensor: the kernel knows
// such a plan by its null mask_bits (prefill/step.cuh.jinja).
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
  // The keep bits of the partial tiles, for the kernel to read rather than run mask_mod there (null: none kept).
  // A partial tile takes the next slot while there is one; past pool_tiles it keeps none (slot -1) and the kernel
  // runs mask_mod on it. pool_used is zero before the launch.
  unsigned* pool;      // [pool_tiles][BLOCK_M][BLOCK_N / 32], row r's word w: keys n0 + 32 w + bit
  int* slots;          // [units, num_q_tiles, num_kv_tiles]: a partial tile's slot, else -1 (written for every cell)
  int* pool_used;
  int pool_tiles;
};

// grid (num_kv_tiles, num_q_tiles, units), PLAN_THREADS threads: one tile. Warp w takes rows w, w + 8, ..., its
// lanes consecutive keys (an aux tensor indexed by kv_idx is read coalesced). With a pool, every counted pair is
// evaluated and a row's bits gathered a 32-key word at a time (a ballot; uncounted pairs 0) in shared memory, then
// copied to the tile's slot if it is partial; without one, every warp stops once the CTA has seen both a kept and a
// dropped pair (the tile is partial whatever the rest holds).
template <int BLOCK_M, int BLOCK_N, int MASK>
__device__ __forceinline__ void mod_tiles(const ModPlanParams& mp) {
  const PlanParams& p = mp.p;
  constexpr int WARPS = PLAN_THREADS / 32;
  constexpr int WORDS = BLOCK_N % 32 == 0 ? BLOCK_N / 32 : 1;  // (a pool only where tiles are whole words)
  __shared__ int s_keep, s_drop, s_slot;
  __shared__ unsigned s_bits[BLOCK_M * WORDS];
  if (threadIdx.x == 0) s_keep = s_drop = 0;
  __syncthreads();
  const int kt = blockIdx.x, qt = blockIdx.y, unit = blockIdx.z;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const KeyRange keys = key_range<MASK>(p.seqlen_q, p.seqlen_k, p);
  const int m0 = qt * BLOCK_M, n0 = kt * BLOCK_N;
  const KeyRange::Span span = keys.tiles<BLOCK_N>(m0, min(m0 + BLOCK_M, p.seqlen_q) - 1);
  const bool pooled = BLOCK_N % 32 == 0 && mp.pool != nullptr;
  if (kt >= span.first && kt < span.first + span.count) {  // else dead by the built-in mask alone
    const int b = p.units_b > 1 ? unit / p.units_h : 0;
    const int h = p.units_h > 1 ? unit % p.units_h : 0;
    volatile int* keep_seen = &s_keep;
    volatile int* drop_seen = &s_drop;
    for (int r = warp; r < BLOCK_M; r += WARPS) {
      const int i = m0 + r;
      // Made uniform in the warp: its lanes may read the shared flags at different times.
      if (__any_sync(0xffffffffu, i >= p.seqlen_q || (!pooled && *keep_seen && *drop_seen))) break;
      const int q_idx = i + keys.shift;
      const int lo = max(keys.lo(i), n0), hi = min(keys.hi(i), n0 + BLOCK_N);
      bool keep = false, drop = false;
      if (pooled) {
#pragma unroll 1
        for (int w = 0; w < WORDS; ++w) {
          const int j = n0 + 32 * w + lane;
          const bool counted = j >= lo && j < hi;
          const bool k = counted && q_idx >= 0 && UserMods::keep(mp, {}, Pair(b, h, q_idx, j));
          keep |= k;
          drop |= counted && !k;
          const unsigned bits = __ballot_sync(0xffffffffu, k);
          if (lane == 0) s_bits[r * WORDS + w] = bits;
        }
      } else {
        for (int j = lo + lane; j < hi; j += 32) {
          const bool k = q_idx >= 0 && UserMods::keep(mp, {}, Pair(b, h, q_idx, j));
          keep |= k;
          drop |= !k;
        }
      }
      if (__any_sync(0xffffffffu, keep) && lane == 0) *keep_seen = 1;
      if (__any_sync(0xffffffffu, drop) && lane == 0) *drop_seen = 1;
    }
  }
  __syncthreads();
  const long long cell = ((long long)unit * p.num_q_tiles + qt) * p.num_kv_tiles + kt;
  const bool partial = s_keep && s_drop;
  if (threadIdx.x == 0) {
    p.states[cell] = s_keep ? (s_drop ? 1 : 2) : 0;
    int slot = -1;
    if (pooled && partial) {
      slot = atomicAdd(mp.pool_used, 1);
      if (slot >= mp.pool_tiles) slot = -1;
    }
    if (mp.slots != nullptr) mp.slots[cell] = slot;
    s_slot = slot;
  }
  __syncthreads();
  if (pooled && s_slot >= 0) {
    // (rows past seqlen_q were never written: the kernel drops them whatever their bits)
    unsigned* dst = mp.pool + (long long)s_slot * (BLOCK_M * WORDS);
    for (int x = threadIdx.x; x < BLOCK_M * WORDS; x += PLAN_THREADS) dst[x] = s_bits[x];
  }
}

}  // namespace attngen
