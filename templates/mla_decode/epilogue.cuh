// MLA decode, the epilogue: after the split's last tile, the row sums (across a row tile's column groups when
// the warps split the keys or the tiles), then O normalised and the LSE, written to o and lse (one split),
// to the fp32 partials the `_merge` entries combine, or merged in the shared memory of the splits' cluster.
namespace attngen {

template <class K>
struct MlaEpilogue {
  using T = typename K::Elem;
  static constexpr bool BF16 = K::IS_BF16, QK_SHARD = K::QK_SHARD_, ALT = K::ALT_;
  static constexpr bool CAN_CLUSTER = K::CAN_CLUSTER, PUSH_MERGE = K::PUSH_MERGE;
  static constexpr int DC = K::DC_, ROWS = K::ROWS_, THREADS = K::THREADS, WARPS_N = K::WARPS_N, ON = K::ON;

  // The rows' sums l (the caller's array, see consumer.cuh) once every copy has landed: the thread's quad, then
  // (sharded, or alternate tiles) the row tile's column groups through sRed.
  static __device__ __forceinline__ void row_sums(float* sRed, int g, int t, int row0, int cg,
                                                  const float (&row_sum)[2], float (&l)[2]) {
    cp_async_wait_all();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[r] = row_sum[r];
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
      l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    if constexpr (QK_SHARD || ALT) {
      __syncthreads();  // every warp is past its last read of sRed
      if (t == 0) {
        sRed[cg * ROWS + row0 + g] = l[0];
        sRed[cg * ROWS + row0 + g + 8] = l[1];
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[r] = 0.f;
#pragma unroll
        for (int c = 0; c < WARPS_N; ++c) l[r] += sRed[c * ROWS + row0 + g + 8 * r];
      }
    }
  }
};

}  // namespace attngen
