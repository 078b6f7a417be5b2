// The work-list slot a MASK_LIST CTA of prefill_fwd (prefill/fwd.cuh.jinja) computes: the list's slot order (unit,
// query tile) is built heaviest first on the GPU (plan.cuh); its live KV tiles are n_tiles entries of p.tiles from
// list_at on. (The other kernels' tiles: cta_tile and TileWalk, params.cuh.)
namespace attngen {

template <class T>
__device__ __forceinline__ void mask_list_tile(const PrefillParams<T>& p, int& m_block, int& head, int& batch,
                                               int& seqlen_q, int& seqlen_k, long long& list_at, int& unit,
                                               int& n_tiles) {
  const int2 item = p.work[blockIdx.x];
  m_block = item.y;
  unit = item.x;
  batch = p.mask_units_b > 1 ? unit / p.mask_units_h : blockIdx.z;
  head = p.mask_units_h > 1 ? unit % p.mask_units_h : blockIdx.y;
  seqlen_q = p.seqlen_q;
  seqlen_k = p.seqlen_k;
  const long long at = (long long)unit * p.num_q_tiles + m_block;
  list_at = at * p.max_tiles;
  n_tiles = p.tile_count[at];
}

}  // namespace attngen
