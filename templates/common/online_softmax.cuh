// Online-softmax pieces on the mma.sync / wgmma accumulator layout (a thread holds two rows, g and g + 8, of
// each 16-row tile, in pairs of columns; a quad of four threads holds a row): shared by prefill, decode and MLA decode.
namespace attngen {

// Lazy rescaling of an online softmax (the wgmma kernels of prefill and MLA decode): a row keeps its running max
// while a tile raises it by at most LAZY_LOG2 in the exp2 domain. Its P then reaches at most 2^LAZY_LOG2 (in range
// for bf16 and fp16; the fp32 sum, O and the LSE all use the same max), and after a row's first tiles its max rarely
// moves that far, so O's correction (a multiply per accumulator, each tile) is mostly skipped: a warp multiplies
// only where one of its rows moved, and a row that did not takes a correction of exactly 1.
constexpr float LAZY_LOG2 = 8.f;
// The max a row goes on with: `seen` (the running max and the tile's, unscaled) or, within the bound, `running`.
// From -inf, a first finite max is taken (inf above the bound); -inf twice compares as NaN and gives -inf.
__device__ __forceinline__ float lazy_max(float running, float seen, float scale_log2) {
  return (seen - running) * scale_log2 <= LAZY_LOG2 ? running : seen;
}

// The maximum of the thread's row r (0: g, 1: g + 8) over the NK columns its quad holds.
template <int NK>
__device__ __forceinline__ float frag_row_max(const float (&s)[NK / 8][4], int r) {
  float m = -ATTNGEN_INF;
#pragma unroll
  for (int n = 0; n < NK / 8; ++n) m = fmaxf(m, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  return fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
}

// P = exp2(S scale_log2 - base) in place for row r (base: the row max in log2 units, 0 for a row that has seen no
// key yet); returns the thread's part of the row sum.
template <int NK>
__device__ __forceinline__ float frag_exp_row(float (&s)[NK / 8][4], int r, float scale_log2, float base) {
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < NK / 8; ++n) {
    s[n][2 * r] = fast_exp2(fmaf(s[n][2 * r], scale_log2, -base));
    s[n][2 * r + 1] = fast_exp2(fmaf(s[n][2 * r + 1], scale_log2, -base));
    sum += s[n][2 * r] + s[n][2 * r + 1];
  }
  return sum;
}

// One row's online-softmax step with lazy rescaling, its max over this tile's columns given (tile_max): the row goes
// on with lazy_max's max, S becomes P in place and the row sum takes it; returns O's correction, exactly 1 where the
// row kept its max.
template <int NK>
__device__ __forceinline__ float lazy_softmax_row(float (&s)[NK / 8][4], int r, float tile_max, float& row_max,
                                                  float& row_sum, float scale_log2) {
  const float m = lazy_max(row_max, fmaxf(row_max, tile_max), scale_log2);
  const float base = m == -ATTNGEN_INF ? 0.f : m * scale_log2;
  const float corr = m != row_max ? fast_exp2(row_max * scale_log2 - base) : 1.f;
  row_max = m;
  row_sum = row_sum * corr + frag_exp_row<NK>(s, r, scale_log2, base);
  return corr;
}

// One row's online-softmax step rescaling at every tile (decode): the row's max goes on over this tile's columns,
// S becomes P in place, the row sum takes it and corr is O's correction. The max starts from the running one and
// each P joins the sum as it is formed (frag_row_max and frag_exp_row take the same values in another order, which
// rounds the sum differently and changes the machine code). corr is an out-parameter, not the return value: returned,
// its exp2 moved past the sum's and sm_100's machine code changed.
template <int NK>
__device__ __forceinline__ void softmax_row(float (&s)[NK / 8][4], int r, float& row_max, float& row_sum, float& corr,
                                            float scale_log2) {
  float mx = row_max;
#pragma unroll
  for (int n = 0; n < NK / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  // A row that has seen only masked keys keeps max -inf; subtracting 0 then keeps exp2 at 0.
  const float base = mx == -ATTNGEN_INF ? 0.f : mx * scale_log2;
  corr = fast_exp2(row_max * scale_log2 - base);
  row_max = mx;
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < NK / 8; ++n)
#pragma unroll
    for (int e = 2 * r; e < 2 * r + 2; ++e) {
      const float x = fast_exp2(fmaf(s[n][e], scale_log2, -base));
      s[n][e] = x;
      sum += x;
    }
  row_sum = row_sum * corr + sum;
}

// An accumulator's rows times their corrections: corr[mt][0] for row g of 16-row tile mt, corr[mt][1] for row g + 8
// (the one-tile form: corr[0], corr[1]).
template <int MT, int DT>
__device__ __forceinline__ void scale_rows(float (&acc)[MT][DT][4], const float (&corr)[MT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int d = 0; d < DT; ++d)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[mt][d][c] *= corr[mt][c / 2];
}
template <int DT>
__device__ __forceinline__ void scale_rows(float (&acc)[DT][4], const float (&corr)[2]) {
#pragma unroll
  for (int d = 0; d < DT; ++d)
#pragma unroll
    for (int c = 0; c < 4; ++c) acc[d][c] *= corr[c / 2];
}

}  // namespace attngen
