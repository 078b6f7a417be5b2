// MLA decode, the epilogue: after the split's last tile, the row sums (across a row tile's column groups when
// the warps split the keys or the tiles), then O normalised and the LSE, written to o and lse (one split),
// to the fp32 partials the `_merge` entries combine, or merged in the shared memory of the splits' cluster.
//
// The splits a cluster: 16 rows merged by cluster_merge_rows (each CTA leaves its rows [ROWS][DC] and their LSE
// over its Q and ring; the cluster reads them), 32 by merge_pushed_row (CTA `split` merges rows [split mrows,
// split mrows + mrows), its own from registers, the other splits' pushed over its Q and ring: [splits x mrows]
// [DC], then their LSE). Pushing pays at 32 rows (large batches, a few thousand keys) and not at 16, whose
// rows the cluster reads where they lie.
//
// Where O and the LSE are written (the end of MlaDecode::run) stays in run: as a function taking cg and t, its
// test cg == 0 && t == 0 was simplified before inlining, without tid's form, and compiled to other code.
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
      K::consumers_sync();  // every warp is past its last read of sRed
      if (t == 0) {
        sRed[cg * ROWS + row0 + g] = l[0];
        sRed[cg * ROWS + row0 + g + 8] = l[1];
      }
      K::consumers_sync();
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[r] = 0.f;
#pragma unroll
        for (int c = 0; c < WARPS_N; ++c) l[r] += sRed[c * ROWS + row0 + g + 8 * r];
      }
    }
  }

  // One split's O, staged in shared memory as [ROWS][O_ROW] (a row padded by 16 bytes, so the fragment stores of a
  // warp's 8 rows fall in distinct banks), written a whole row at a time: a warp a row, a lane 16 bytes of each 512.
  // Written from the fragments, a warp's store was 8 rows of 16 bytes; those stores held the most stall samples of
  // a short sequence's CTA.
  static constexpr int O_ROW = DC + 8;
  static_assert(DC % 256 == 0, "a row in 16-byte lanes");
  static __device__ __forceinline__ void store_rows(const MlaParams<T>& p, const T* sO, int batch, int r_begin,
                                                    int rows_total, int tid) {
    const int lane = tid % 32;
#pragma unroll 1
    for (int row = tid / 32; row < ROWS; row += THREADS / 32) {
      const int gr = r_begin + row;
      if (gr >= rows_total) break;
      const int2 th = K::token_head(p, gr);
      T* dst = p.o + batch * p.o_sb + th.x * p.o_ss + th.y * p.o_sh;
#pragma unroll
      for (int c = lane * 8; c < DC; c += 256)
        *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(sO + row * O_ROW + c);
    }
  }

  // 16 rows, the splits a cluster: the rows every CTA left in sPart and sLse merged, each CTA writing its share
  // of them to o and lse.
  static __device__ __forceinline__ void cluster_rows(const MlaParams<T>& p, float* sPart, float* sLse, int valid,
                                                      int split, int batch, int r_begin, int tid) {
    cluster_merge_rows<DC, THREADS>(sPart, sLse, valid, split, p.num_splits, tid,
                                    [&](int row, int col, float4 x, float mx, float wsum) {
      const int qi = (r_begin + row) / p.num_heads;
      const int head = r_begin + row - qi * p.num_heads;
      T* dst = p.o + batch * p.o_sb + qi * p.o_ss + head * p.o_sh + col;
      *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<BF16>(x.x, x.y), pack2<BF16>(x.z, x.w));
      if (col == 0 && p.lse)
        p.lse[((long long)batch * p.num_heads + head) * p.q_len + qi] = wsum > 0.f ? mx + logf(wsum) : -ATTNGEN_INF;
    });
  }
};

}  // namespace attngen
