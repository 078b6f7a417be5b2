// The MLA decode kernels' parameters (what attngen.families.mla_decode.op packs): MlaParams, which
// every entry of the module takes, and MlaTmaParams, the TMA kernel's (tensor maps first).
namespace attngen {

template <class T>
struct MlaParams {
  const T* q_nope;         // [batch, q_len, heads, DC]
  const T* q_pe;           // [batch, q_len, heads, DR]
  const T* ckv;            // [batch, capacity, DC] or, paged, [num_blocks, block_size, DC]
  const T* kpe;            // the same with DR columns
  T* o;                    // [batch, q_len, heads, DC]
  float* lse;              // [batch, heads, q_len], or null
  const int* seqlens;      // [batch], or null: every row has seqlen_fixed keys
  const int* block_table;  // [batch, max_blocks] when paged
  float* o_part;           // [splits, batch, q_len, heads, DC] when num_splits > 1; null: a cluster merges them
  float* lse_part;         // [splits, batch, heads, q_len] when o_part is set
  long long qn_sb, qn_ss, qn_sh;
  long long qp_sb, qp_ss, qp_sh;
  long long c_sb, c_ss;  // ckv: cache row (paged: block) and position (paged: slot) strides
  long long p_sb, p_ss;  // kpe: the same
  long long o_sb, o_ss, o_sh;
  long long bt_sb;
  int batch, q_len, num_heads, num_splits;
  int block_size, capacity, num_blocks;  // num_blocks: paged blocks, or cache rows
  int seqlen_fixed, block_shift;         // block_shift: log2(block_size) when a power of two, else -1
  float sm_scale, scale_log2;
  int kv_evict_first;  // TMA: ckv and kpe first out of L2 (op.kv_evict_first); last, so that no other field moves
};

// The TMA kernel's parameter: tensor maps of ckv and kpe (3-d: columns, positions or paged slots,
// cache rows or blocks), then the parameters every kernel takes.
template <class T>
struct MlaTmaParams {
  TmaDesc maps[2];
  MlaParams<T> p;
};

}  // namespace attngen
