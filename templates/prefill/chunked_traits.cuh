// The chunked kernel's constants: its template arguments, the warp grid, the steps of a KV tile, the ring and the
// tile layouts, derived once (ChunkedTraits) and read by every role (walk, ring, producer, consumer, epilogue).
namespace attngen {

// Element offset of (row, col) in a padded tile: rows of ROW_ELEMS = columns + 8, so the 8 rows of
// an ldmatrix phase start 16 bytes apart in the banks, and offsets of different columns differ by
// constants (the swizzled layout's XOR gave every column its own register when unrolled).
template <int ROW_ELEMS>
__device__ __forceinline__ int padded(int row, int col) {
  return row * ROW_ELEMS + col;
}

// The chunked kernel's tile layouts: padded rows (mma.sync), or wgmma's swizzled 64-column blocks
// (WgmmaLayout), where a thread stepping down the rows in steps of 8 stays on the same swizzle phase.
// ROW_ELEMS: the elements from one row to the next at the same column.
template <int ROW_ELEMS_>
struct Padded {
  static constexpr int ROW_ELEMS = ROW_ELEMS_;
  static constexpr bool SWIZZLED = false;
  __device__ __forceinline__ static int offset(int row, int col) { return padded<ROW_ELEMS>(row, col); }
};
template <int COLS, int ROWS>
struct Swizzled : WgmmaLayout<COLS, ROWS> {
  static constexpr int ROW_ELEMS = 64;
  static constexpr bool SWIZZLED = true;
};

// x, its value hidden from the compiler: a step's offsets and the ring's slots, which the unrolled step loop would
// otherwise know at compile time and hoist out of the KV loop (held in registers across it, they spill).
__device__ __forceinline__ int chunked_opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

// (DV is the columns one CTA computes: its split of head_dim_v.)
template <class T_, bool BF16_, int DQK_, int DV_, int BLOCK_M_, int BLOCK_N_, int NUM_WARPS_, int NUM_STAGES_, int DK_,
          int VK_, int VCW_, int MASK_, bool RETURN_LSE_, class V_, bool SINKS_, bool VARLEN_,
          bool WGMMA_, int V_SPLITS_, bool QK_PAIR_, bool TMA_>
struct ChunkedTraits {
  using T = T_;
  static constexpr bool BF16 = BF16_, RETURN_LSE = RETURN_LSE_, SINKS = SINKS_,
                        VARLEN = VARLEN_, WGMMA = WGMMA_, QK_PAIR = QK_PAIR_, TMA = TMA_;
  using V = V_;  // the logits transforms the spec turns on (common/variant.cuh)
  static constexpr int DQK = DQK_, DV = DV_, BLOCK_M = BLOCK_M_, BLOCK_N = BLOCK_N_, NUM_WARPS = NUM_WARPS_,
                       NUM_STAGES = NUM_STAGES_, DK = DK_, VK = VK_, VCW = VCW_, MASK = MASK_, V_SPLITS = V_SPLITS_;

  static constexpr int THREADS = NUM_WARPS * 32;  // the warps that compute (TMA: and a producer warpgroup more)
  static constexpr int MT = WGMMA ? 1 : 2;  // 16-row m-tiles a warp owns
  static constexpr int WARPS_M = WGMMA ? 1 : BLOCK_M / 32;  // wgmma: the warps of a warpgroup split its 64 rows
  static constexpr int WARPS_N = WGMMA ? NUM_WARPS / 4 : NUM_WARPS / WARPS_M;
  static constexpr int SN = BLOCK_N / WARPS_N;  // keys of S per warp
  // wgmma: each warpgroup's columns are whole 64-column blocks and, where its half of DV ends 32
  // columns into one (320, 448, 576), a 32-column tail step that takes half of one block (V_TAIL);
  // else V's columns are padded to whole blocks (zeros loaded, never stored).
  static constexpr bool V_TAIL = WGMMA && DV >= 192 && DV % 64 == 0 && (DV / 2) % 64 == 32;
  static constexpr int DV_PAD = WGMMA && !V_TAIL ? (DV + 127) / 128 * 128 : DV;
  static constexpr int ON = DV_PAD / WARPS_N;  // output columns per warp
  static constexpr int VC = VCW * WARPS_N;     // columns of a V step (the tail step's: 64)
  static constexpr int TAIL = V_TAIL ? 32 : 0;
  static_assert(!QK_PAIR || (V_SPLITS == 2 && WGMMA && (DQK / 2) % DK == 0), "a pair splits QK in whole chunks");
  static constexpr int QK_COLS = QK_PAIR ? DQK / 2 : DQK;  // the QK columns this CTA computes S over
  static constexpr int QK_STEPS = QK_COLS / DK;
  static constexpr int V_KEY_STEPS = BLOCK_N / VK;
  static constexpr int V_COL_STEPS = (ON - TAIL) / VCW + (V_TAIL ? 1 : 0);
  static constexpr int STEPS = QK_STEPS + V_KEY_STEPS * V_COL_STEPS;
  // Steps whose ring slots may still be read when a step starts: the one before (mma.sync reads its
  // slot synchronously) or, with wgmma, the two before (one step's wgmma is left running).
  static constexpr int LAG = WGMMA ? 2 : 1;
  static constexpr int AHEAD = NUM_STAGES - LAG;  // steps loading while one computes
  static_assert(BLOCK_M % 32 == 0 && NUM_WARPS % WARPS_M == 0, "warp grid");
  static_assert(SN % 16 == 0 && (ON - TAIL) % VCW == 0 && VCW % 16 == 0 && VK % 16 == 0 && BLOCK_N % VK == 0, "tiles");
  static_assert(DQK % DK == 0 && DK % 16 == 0 && AHEAD >= 1 && STEPS >= AHEAD, "steps");
  static_assert(!WGMMA || (BLOCK_M == 64 && NUM_WARPS == 8 && DK % 64 == 0 && VCW % 64 == 0 && QK_STEPS >= 2),
                "wgmma: 64 rows, two warpgroups, whole 64-column swizzle blocks");
  static_assert(!TMA || (WGMMA && !VARLEN && DV_PAD == DV),
                "TMA: wgmma on the dense layout, every copy a 64-column box of the tensor (or the two tails)");
  // TMA: registers per thread after setmaxnreg, the producer warpgroup's and the two consumers' (launched
  // with 168 a thread: 384 threads)
  static constexpr int PRODUCER_REGS = 24;
  static constexpr int CONSUMER_REGS = 240;

  // Padded tiles (rows of DK, VC or BLOCK_N elements plus 8), or wgmma's dense swizzled blocks.
  static constexpr int DK_ROW = DK + 8;
  static constexpr int VC_ROW = VC + 8;
  static constexpr int P_ROW = BLOCK_N + 8;
  using LQ = typename Select<WGMMA, Swizzled<DK, BLOCK_M>, Padded<DK_ROW>>::type;
  using LK = typename Select<WGMMA, Swizzled<DK, BLOCK_N>, Padded<DK_ROW>>::type;
  using LV = typename Select<WGMMA, Swizzled<VC, VK>, Padded<VC_ROW>>::type;
  using LVT = Swizzled<64, VK>;  // V_TAIL: the tail step's one block, each warpgroup's 32 columns side by side
  using LP = typename Select<WGMMA, Swizzled<BLOCK_N, BLOCK_M>, Padded<P_ROW>>::type;
  // TMA: Q is loaded once, whole, into a tile of its own (Q_ELEMS); a QK step's slot holds K's chunk alone
  static constexpr int Q_ELEMS = TMA ? BLOCK_M * QK_COLS : 0;
  static constexpr int QK_ELEMS = (TMA ? BLOCK_N : BLOCK_M + BLOCK_N) * (WGMMA ? DK : DK_ROW);
  static constexpr int V_ELEMS = VK * (WGMMA ? VC : VC_ROW);
  static constexpr int STAGE_ELEMS = QK_ELEMS > V_ELEMS ? QK_ELEMS : V_ELEMS;
  static_assert(!(TMA && V_TAIL) || 2 * VK * 64 <= STAGE_ELEMS, "TMA: the tail step's two blocks fit a slot");
  // (wgmma: P's 64-column blocks are whole even where the tile has 32 keys)
  static constexpr int P_ELEMS = BLOCK_M * (WGMMA ? (BLOCK_N + 63) / 64 * 64 : P_ROW);
  // QK_PAIR: the bytes of a thread's fragment of S sent to the other CTA
  static constexpr unsigned X_THREAD_BYTES = (SN / 8) * 16;
};

}  // namespace attngen
