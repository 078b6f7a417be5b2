// The merge, one 16-byte vector of a (token, head) row a thread: with two states each thread on its own, with
// several a warp a chunk of a row, its lanes sharing the states' LSE through shuffles. Weights exp(s_i - max s) in
// fp32, the output the weighted mean of the states' rows, the LSE max s + log(sum of the weights). A state
// whose LSE is -inf (no key) has weight 0 and its values are never added, whatever they hold; a row whose
// states are all empty gets zeros and LSE -inf. A NaN LSE makes the row NaN (its weight is NaN, never 0).
namespace attngen {

template <class S>
__device__ __forceinline__ void add_weighted(float (&acc)[S::VEC], float w, const float (&x)[S::VEC]) {
  if (w != 0.f) {
#pragma unroll
    for (int i = 0; i < S::VEC; ++i) acc[i] = fmaf(w, x[i], acc[i]);
  }
}

__device__ __forceinline__ float state_weight(float s, float mx) { return s == -ATTNGEN_INF ? 0.f : __expf(s - mx); }

// The states of merge_states: LSE pass first (each lane a state, the max by shuffles), then groups of 32
// states, each lane's weight broadcast while the warp reads UNROLL states' vectors at a time.
template <class S>
__device__ __forceinline__ float merge_many(const MergeParams<typename S::T>& p, long long t, int h, int col,
                                            bool live, float (&acc)[S::VEC], float& mx) {
  const int n = p.num_states;
  const int lane = threadIdx.x % 32;
  const float* srow = p.s0 + t * p.s0_st + h * p.s0_sh;
  const typename S::T* vrow = p.v0 + t * p.v0_st + h * p.v0_sh + col;
  mx = -ATTNGEN_INF;
  for (int i = lane; i < n; i += 32) mx = fmaxf(mx, srow[i * p.s_n]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float wsum = 0.f;
  for (int i0 = 0; i0 < n; i0 += 32) {
    const int m = min(32, n - i0);
    const float my_w = lane < m ? state_weight(srow[(i0 + lane) * p.s_n], mx) : 0.f;
    wsum += my_w;
    for (int j0 = 0; j0 < m; j0 += S::UNROLL) {
      float x[S::UNROLL][S::VEC];
#pragma unroll
      for (int u = 0; u < S::UNROLL; ++u) {
        if (live && j0 + u < m) {
          load_vec<typename S::T, S::BF16, S::VEC>(vrow + (i0 + j0 + u) * p.v_n, x[u]);
        } else {
#pragma unroll
          for (int i = 0; i < S::VEC; ++i) x[u][i] = 0.f;
        }
      }
#pragma unroll
      for (int u = 0; u < S::UNROLL; ++u) {
        const float w = __shfl_sync(0xffffffffu, my_w, min(j0 + u, 31));
        if (j0 + u < m) add_weighted<S>(acc, w, x[u]);
      }
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
  return wsum;
}

// The two states of merge_state, each in its own tensor.
template <class S>
__device__ __forceinline__ float merge_pair(const MergeParams<typename S::T>& p, long long t, int h, int col,
                                            bool live, float (&acc)[S::VEC], float& mx) {
  const float sa = p.s0[t * p.s0_st + h * p.s0_sh];
  const float sb = p.s1[t * p.s1_st + h * p.s1_sh];
  mx = fmaxf(sa, sb);
  const float wa = state_weight(sa, mx), wb = state_weight(sb, mx);
  if (live) {
    float xa[S::VEC], xb[S::VEC];
    load_vec<typename S::T, S::BF16, S::VEC>(p.v0 + t * p.v0_st + h * p.v0_sh + col, xa);
    load_vec<typename S::T, S::BF16, S::VEC>(p.v1 + t * p.v1_st + h * p.v1_sh + col, xb);
    add_weighted<S>(acc, wa, xa);
    add_weighted<S>(acc, wb, xb);
  }
  return wa + wb;
}

template <class S>
__device__ __forceinline__ void merge_rows(const MergeParams<typename S::T>& p) {
  long long row;  // token * heads + head
  int col;
  bool first;     // writes the row's LSE
  if constexpr (S::MANY) {
    const int lane = threadIdx.x % 32;
    const long long gw = (long long)blockIdx.x * S::WARPS + threadIdx.x / 32;
    row = gw / S::CHUNKS;  // the same for every lane: a warp returns below as a whole
    const int chunk = gw % S::CHUNKS;
    col = (chunk * 32 + lane) * S::VEC;
    first = chunk == 0 && lane == 0;
  } else {
    // no lane waits on another: a row narrower than 32 vectors leaves no lane idle
    const long long g = (long long)blockIdx.x * (S::WARPS * 32) + threadIdx.x;
    row = g / S::VECS;
    col = (g % S::VECS) * S::VEC;
    first = col == 0;
  }
  if (row >= (long long)p.tokens * p.heads) return;
  const long long t = row / p.heads;
  const int h = row % p.heads;
  const bool live = col < S::HEAD_DIM;  // the last chunk of a row not a multiple of 32 vectors (several states)
  float acc[S::VEC];
#pragma unroll
  for (int i = 0; i < S::VEC; ++i) acc[i] = 0.f;
  float mx;
  float wsum;
  if constexpr (S::MANY) {
    wsum = merge_many<S>(p, t, h, col, live, acc, mx);
  } else {
    wsum = merge_pair<S>(p, t, h, col, live, acc, mx);
  }
  // == 0, not <= 0: a NaN sum stays NaN in the output and its LSE
  const float inv = wsum == 0.f ? 0.f : 1.f / wsum;
  if (live) {
#pragma unroll
    for (int i = 0; i < S::VEC; ++i) acc[i] *= inv;
    store_vec<typename S::T, S::BF16, S::VEC>(p.o + t * p.o_st + h * p.o_sh + col, acc);
  }
  if (first) p.lse[t * p.lse_st + h * p.lse_sh] = wsum == 0.f ? -ATTNGEN_INF : mx + logf(wsum);
}

}  // namespace attngen
