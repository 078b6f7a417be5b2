// Which keys a query row may see. Query row i (0-based within seqlen_q) is aligned with key
// i + (seqlen_k - seqlen_q), FlashAttention's bottom-right convention. A window (left, right)
// keeps keys j with i' - left <= j <= i' + right where i' is the aligned position; -1 means
// unbounded on that side. Causal is the window (-1, 0).
namespace attngen {

enum MaskMode : int { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_WINDOW = 2 };

struct KeyRange {
  int shift;   // seqlen_k - seqlen_q
  int left;    // -1: unbounded
  int right;   // -1: unbounded
  int seqlen_k;

  // Keys [lo(row_lo), hi(row_hi)) some row of [row_lo, row_hi] may see; for one row i, [lo(i), hi(i)).
  __device__ __forceinline__ int lo(int row_lo) const { return left < 0 ? 0 : max(0, row_lo + shift - left); }
  __device__ __forceinline__ int hi(int row_hi) const {
    return right < 0 ? seqlen_k : min(seqlen_k, row_hi + shift + right + 1);
  }
  // The BLOCK_N-key tiles some row of [row_lo, row_hi] may see: [first, first + count).
  struct Span {
    int first, count;
  };
  template <int BLOCK_N>
  __device__ __forceinline__ Span tiles(int row_lo, int row_hi) const {
    const int n_lo = lo(row_lo), n_hi = hi(row_hi);
    const int first = n_lo / BLOCK_N;
    return {first, n_hi > n_lo ? (n_hi + BLOCK_N - 1) / BLOCK_N - first : 0};
  }
  // True when every row of [row_lo, row_hi] sees every key of [n0, n1): the tile needs no mask.
  __device__ __forceinline__ bool all_visible(int row_lo, int row_hi, int n0, int n1) const {
    return n1 <= seqlen_k && (right < 0 || n1 - 1 <= row_lo + shift + right) &&
           (left < 0 || n0 >= row_hi + shift - left);
  }
};

// The key range of a MASK mode: the window's sides as the call gives them (read only for
// MASK_WINDOW; causal is the window (-1, 0), no mask leaves both sides unbounded).
template <int MASK>
__device__ __forceinline__ KeyRange key_range(int seqlen_q, int seqlen_k, int win_left, int win_right) {
  KeyRange keys;
  keys.shift = seqlen_k - seqlen_q;
  keys.seqlen_k = seqlen_k;
  keys.left = MASK == MASK_WINDOW ? win_left : -1;
  keys.right = MASK == MASK_CAUSAL ? 0 : (MASK == MASK_WINDOW ? win_right : -1);
  return keys;
}

}  // namespace attngen
