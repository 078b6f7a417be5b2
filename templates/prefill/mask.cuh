// Which keys a query row may see. Query row i (0-based within seqlen_q) is aligned with key
// i + (seqlen_k - seqlen_q), FlashAttention's bottom-right convention. The masks are the library variants
// Causal and Window (common/variant.cuh): a window (left, right) keeps keys j with i' - left <= j <= i' + right
// where i' is the aligned position; -1 means unbounded on that side. Causal is the window (-1, 0).
namespace attngen {

enum MaskMode : int { MASK_NONE = 0, MASK_CAUSAL = 1, MASK_WINDOW = 2 };

// The mask variant of a MASK mode.
template <int MASK>
struct MaskOf {
  using type = NoMask;
};
template <>
struct MaskOf<MASK_CAUSAL> {
  using type = Causal;
};
template <>
struct MaskOf<MASK_WINDOW> {
  using type = Window;
};
template <int MASK>
using MaskVariant = typename MaskOf<MASK>::type;

struct KeyRange {
  int shift;        // seqlen_k - seqlen_q
  int left, right;  // the mask variant's sides (Window::State; -1: unbounded)
  int seqlen_k;

  // The sides as the Window variant's state. (Kept as two ints here: held as a Window::State member, the struct's
  // accesses changed the PTX and the machine code of sm_90a's persistent causal kernel.)
  __device__ __forceinline__ Window::State sides() const {
    Window::State st;
    st.left = left;
    st.right = right;
    return st;
  }

  // Keys [lo(row_lo), hi(row_hi)) some row of [row_lo, row_hi] may see; for one row i, [lo(i), hi(i)): the
  // window's edges (Window::first_key, last_key) about the aligned position, within the sequence.
  __device__ __forceinline__ int lo(int row_lo) const {
    return left < 0 ? 0 : max(0, Window::first_key(sides(), row_lo + shift));
  }
  __device__ __forceinline__ int hi(int row_hi) const {
    return right < 0 ? seqlen_k : min(seqlen_k, Window::last_key(sides(), row_hi + shift) + 1);
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
    return n1 <= seqlen_k && (right < 0 || n1 - 1 <= Window::last_key(sides(), row_lo + shift)) &&
           (left < 0 || n0 >= Window::first_key(sides(), row_hi + shift));
  }
};

// The key range of a MASK mode: its variant's sides (Window's as the params give them; causal the window (-1, 0),
// no mask both sides unbounded). P: any params with win_left and win_right.
template <int MASK, class P>
__device__ __forceinline__ KeyRange key_range(int seqlen_q, int seqlen_k, const P& p) {
  const Window::State win = MaskVariant<MASK>::state(p, 0, 0);  // (read first, as the sides once were: PTX order)
  KeyRange keys;
  keys.shift = seqlen_k - seqlen_q;
  keys.seqlen_k = seqlen_k;
  keys.left = win.left;
  keys.right = win.right;
  return keys;
}

}  // namespace attngen
