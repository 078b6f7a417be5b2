// The prefill kernels' parameters and which tile a CTA computes: PrefillParams (every launch of the
// FlashAttention-2 and chunked kernels), PrefillTmaParams (the TMA kernel's, tensor maps first), the
// varlen row ranges and the dense / work-list tile assignment.
namespace attngen {

template <class T>
struct PrefillParams {
  const T* q;
  const T* k;
  const T* v;
  T* o;
  float* lse;  // [batch, heads, seqlen_q], or null
  long long q_sb, q_ss, q_sh;
  long long k_sb, k_ss, k_sh;
  long long v_sb, v_ss, v_sh;
  long long o_sb, o_ss, o_sh;
  int seqlen_q, seqlen_k, num_heads, group;
  float sm_scale, scale_log2;
  int win_left, win_right;
  float softcap_u, inv_softcap_u;  // cap / sm_scale and its inverse (SOFTCAP)
  const float* alibi;              // fp32 slopes [batch, heads] or [heads] (ALIBI)
  long long alibi_sb;              // batch stride of alibi: heads, or 0
  // ---- read only by the VARLEN, PAGED and MASK_LIST kernels (a dense launch packs none of it) ----
  // VARLEN: q, o [total_q, heads, head_dim], k, v [total_k, kv_heads, head_dim] (batch strides
  // unused); sequence s holds rows [cu_q[s], cu_q[s+1]) and [cu_k[s], cu_k[s+1]), clamped in range.
  const int* cu_q;
  const int* cu_k;
  // PAGED: k, v [num_blocks, block_size, kv_heads, head_dim] (k_sb: block stride); key j of
  // sequence s at block block_table[s * bt_sb + j / block_size], clamped to the blocks.
  const int* block_table;
  // VARLEN and MASK_LIST: the work list, slot -> (unit, query tile), heaviest first; a CTA is
  // (slot, head or mask-broadcast head, mask-broadcast batch). VARLEN: unit = sequence,
  // *work_count slots are live.
  const int2* work;
  const int* work_count;
  // MASK_LIST: unit = mask batch * mask_units_h + mask head. Per unit and query tile, tile_count
  // live KV tiles listed at tiles[(unit * num_q_tiles + q tile) * max_tiles], each the tile index
  // with bit 31 set when the custom mask keeps all of it; the mask itself as bits, one uint32 per
  // 32 keys, bits_words a row, bits_su a unit.
  const unsigned* mask_bits;
  const int* tiles;
  const int* tile_count;
  long long bt_sb, bits_su;
  int block_size, num_blocks, total_q, total_k, bits_words, max_tiles, num_q_tiles;
  int mask_units_h, mask_units_b;
  int batch_count;  // PERSISTENT (the TMA kernel): the batch, which its one row of CTAs does not give
  // SINKS: fp32 sink logits [heads] (the query heads), read once per row by the epilogue. Last, so that every
  // other field keeps its offset (a launch without sinks packs none of it).
  const float* sinks;
#ifdef ATTNGEN_MODS
  // A kernel with a user's score_mod / mask_mod (attngen/families/snippets.py): their aux tensors. After every other
  // field, and only in such kernels, so that every other kernel keeps its parameters as they were.
  ModArgs mods;
  // A mask_mod plan's keep bits of its partial tiles, its pool and slots (prefill/mod_plan.cuh), or null.
  const unsigned* mod_bits;
  const int* mod_slots;
#endif
};

// The TMA kernel's parameter: tensor maps of q, k and v (4-d: head_dim, seqlen, heads, batch;
// 64-column boxes of BLOCK_M rows for q, BLOCK_N for k and v, 128-byte swizzled, zero fill past
// the ends), then the parameters every kernel takes. (MAPS 4: the chunked kernel's V tail, a 5-d map
// of v's two 32-column tails a CTA side by side: prefill/chunked_producer.cuh.)
template <class T, int MAPS = 3>
struct PrefillTmaParams {
  TmaDesc maps[MAPS];
  PrefillParams<T> p;
};

// Sequence s of a varlen batch, clamped into the tensors: q rows [q_lo, q_lo + sq) (varlen_q_rows; the serving
// plan takes its key counts elsewhere) and k rows [k_lo, k_lo + sk). Paged, keys go through the block table: k_lo
// is 0 and sk at most total_k.
__device__ __forceinline__ void varlen_q_rows(const int* cu_q, int total_q, int s, int& q_lo, int& sq) {
  q_lo = min(max(cu_q[s], 0), total_q);
  sq = min(max(cu_q[s + 1], q_lo), total_q) - q_lo;
}

__device__ __forceinline__ void varlen_rows(const int* cu_q, const int* cu_k, int total_q, int total_k, bool paged,
                                            int s, int& q_lo, int& sq, int& k_lo, int& sk) {
  varlen_q_rows(cu_q, total_q, s, q_lo, sq);
  if (paged) {
    k_lo = 0;
    sk = min(max(cu_k[s + 1] - cu_k[s], 0), total_k);
  } else {
    k_lo = min(max(cu_k[s], 0), total_k);
    sk = min(max(cu_k[s + 1], k_lo), total_k) - k_lo;
  }
}

// VARLEN: true for a CTA past the work list's live slots (the grid is sized for the most there can
// be). Asked by the kernel itself before cta_tile: an early return from inside cta_tile cost the
// chunked kernel 10 registers and a spill on sm_120 (NVRTC 13.5).
template <bool VARLEN, class T>
__device__ __forceinline__ bool past_work(const PrefillParams<T>& p) {
  if constexpr (VARLEN) {
    const int slot = blockIdx.x;
    return slot >= *p.work_count;
  }
  return false;
}

// Which (query tile, head, batch) this CTA computes, with its sequence's lengths. Dense: off the
// grid, heaviest query tiles (the last ones, under a causal mask) first. VARLEN: off the work list
// (sequence, query tile), built heaviest first on the GPU (past_work first). The sequence's rows are
// clamped into the tensors: q rows [q_row0, q_row0 + seqlen_q), k rows [k_row0, k_row0 + seqlen_k)
// (PAGED: k_row0 is left alone, keys go through the block table). Heads vary slowest in both, so
// the CTAs running together share one head's K/V in L2 (heads varying fastest thrashed L2 on long
// sequences).
template <bool VARLEN, bool PAGED, class T>
__device__ __forceinline__ void cta_tile(const PrefillParams<T>& p, int& m_block, int& head, int& batch,
                                         int& seqlen_q, int& seqlen_k, long long& q_row0, long long& k_row0) {
  if constexpr (VARLEN) {
    const int2 item = p.work[blockIdx.x];
    batch = item.x;
    m_block = item.y;
    head = blockIdx.y;
    int q_lo, k_lo;
    varlen_rows(p.cu_q, p.cu_k, p.total_q, p.total_k, PAGED, batch, q_lo, seqlen_q, k_lo, seqlen_k);
    q_row0 = q_lo;
    if constexpr (!PAGED) k_row0 = k_lo;
  } else {
    m_block = gridDim.x - 1 - blockIdx.x;
    head = blockIdx.y;
    batch = blockIdx.z;
    seqlen_q = p.seqlen_q;
    seqlen_k = p.seqlen_k;
  }
}

// The query tiles a CTA of the persistent TMA kernel computes in turn (a grid of at most as many CTAs as
// the SMs run): a static round-robin over units of two query tiles of one (head, batch), the j-th
// heaviest then the j-th lightest (query tiles M-1-j and j; an odd M's middle tile alone), so that under
// a causal mask every unit costs the same and the round-robin is balanced without a counter in global
// memory (which a CUDA graph replayed on two streams would share). Units run j fastest, then heads, then
// batches: the CTAs running together share a few heads' K/V in L2. (A CTA of the other kernels computes
// the one tile cta_tile gives.)
template <int BLOCK_M>
struct TileWalk {
  int unit = blockIdx.x;
  bool second = false;  // the unit's light tile

  // This step's tile; false past the CTA's last.
  template <class T>
  __device__ __forceinline__ bool tile(const PrefillParams<T>& p, int& m_block, int& head, int& batch, int& seqlen_q,
                                       int& seqlen_k) const {
    seqlen_q = p.seqlen_q;
    seqlen_k = p.seqlen_k;
    const int m_blocks = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int pairs = (m_blocks + 1) / 2;
    const int j = unit % pairs;
    const int hb = unit / pairs;
    head = hb % p.num_heads;
    batch = hb / p.num_heads;
    m_block = second ? j : m_blocks - 1 - j;
    return batch < p.batch_count;
  }
  // To the next tile.
  template <class T>
  __device__ __forceinline__ void next(const PrefillParams<T>& p) {
    const int m_blocks = (p.seqlen_q + BLOCK_M - 1) / BLOCK_M;
    const int pairs = (m_blocks + 1) / 2;
    if (!second && 2 * (unit % pairs) + 1 != m_blocks) {
      second = true;
    } else {
      second = false;
      unit += gridDim.x;
    }
  }
};

}  // namespace attngen
