// The merge family's launch parameters (MergeParams in attngen/families/merge/op.py packs the same fields).
// Strides are in elements. Two states (a pair): state 0 is v0/s0, state 1 v1/s1, each with its own token and
// head strides. Several (many): v0 [tokens, states, heads, HEAD_DIM] and s0 [tokens, states, heads], state i at
// i * v_n and i * s_n past state 0; v1 and s1 unused. The output o [tokens, heads, HEAD_DIM] and its LSE
// lse [tokens, heads].
namespace attngen {

template <class T>
struct MergeParams {
  const T* v0;
  const T* v1;
  const float* s0;
  const float* s1;
  T* o;
  float* lse;
  long long v0_st, v0_sh, v1_st, v1_sh, v_n;
  long long s0_st, s0_sh, s1_st, s1_sh, s_n;
  long long o_st, o_sh, lse_st, lse_sh;
  int tokens, heads, num_states;
};

template <class T_, bool BF16_, int HEAD_DIM_, int VEC_, int CHUNKS_, int WARPS_, bool MANY_>
struct MergeShape {
  using T = T_;
  static constexpr bool BF16 = BF16_;        // T is __nv_bfloat16 (else __half or float)
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int VEC = VEC_;           // elements of a 16-byte vector
  static constexpr int VECS = HEAD_DIM_ / VEC_;  // vectors a row
  static constexpr int CHUNKS = CHUNKS_;     // warps a row with several states, up to 32 vectors each
  static constexpr int WARPS = WARPS_;       // warps a CTA
  static constexpr bool MANY = MANY_;
  // States whose vectors are in flight at once (merge_states): their loads overlap.
  static constexpr int UNROLL = 4;
  static_assert(HEAD_DIM % VEC == 0 && VEC * sizeof(T) == 16, "rows are whole 16-byte vectors");
  static_assert(CHUNKS * 32 * VEC >= HEAD_DIM && (CHUNKS - 1) * 32 * VEC < HEAD_DIM, "chunks cover the row");
};

}  // namespace attngen
