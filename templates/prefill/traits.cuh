// The constants of one prefill_fwd instance (prefill/fwd.cuh.jinja): its template parameters, the shapes
// derived from them, the shared-memory layouts and the TMA ring's mbarriers. The role headers (producer.cuh,
// consumer.cuh, epilogue.cuh) take it as K. prefill_fwd names a few of these as constexpr locals it no longer
// reads (LQ, LK, THREADS, QK_DIM, PAD_DIMS, GROUPS, LO): dropped, they renumbered the PTX, and with it the SASS,
// of sm_90a's persistent serial kernels (the front end's locals order the values the optimiser then numbers).
namespace attngen {

template <class T>
struct IsBf16 {
  static constexpr bool value = false;
};
template <>
struct IsBf16<__nv_bfloat16> {
  static constexpr bool value = true;
};

template <class T_, bool BF16_, int HEAD_DIM_, int HEAD_DIM_V_, int BLOCK_M_, int BLOCK_N_, int NUM_WARPS_,
          int NUM_STAGES_, int MASK_, bool RETURN_LSE_, bool Q_IN_REGS_, int ROW_ELEMS_, int ROW_ELEMS_V_,
          bool SWIZZLE_, bool SWIZZLE_V_, bool WGMMA_, class V_, bool VARLEN_, bool PAGED_,
          bool MASK_LIST_, int TMA_CTAS_, bool OVERLAP_, bool PINGPONG_, bool PERSISTENT_, bool O_IN_Q_,
          bool FP8_ = false, int KV8_ = 0>
struct FwdTraits {
  // T: q's and O's 16-bit type; BF16: the MMAs' (the same but for Q16, below)
  using T = T_;
  static constexpr bool BF16 = BF16_;
  static constexpr bool OUT_BF16 = IsBf16<T>::value;
  static constexpr int HEAD_DIM = HEAD_DIM_;
  static constexpr int HEAD_DIM_V = HEAD_DIM_V_;
  static constexpr int BLOCK_M = BLOCK_M_;
  static constexpr int BLOCK_N = BLOCK_N_;
  static constexpr int NUM_WARPS = NUM_WARPS_;
  static constexpr int NUM_STAGES = NUM_STAGES_;
  static constexpr int MASK = MASK_;
  static constexpr bool RETURN_LSE = RETURN_LSE_;
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;
  static constexpr int ROW_ELEMS = ROW_ELEMS_;
  static constexpr int ROW_ELEMS_V = ROW_ELEMS_V_;
  static constexpr bool SWIZZLE = SWIZZLE_;
  static constexpr bool SWIZZLE_V = SWIZZLE_V_;
  static constexpr bool WGMMA = WGMMA_;
  using V = V_;  // the logits transforms the spec turns on (common/variant.cuh)
  static constexpr bool VARLEN = VARLEN_;
  static constexpr bool PAGED = PAGED_;
  static constexpr bool MASK_LIST = MASK_LIST_;
  static constexpr int TMA_CTAS = TMA_CTAS_;
  static constexpr bool OVERLAP = OVERLAP_;
  static constexpr bool PINGPONG = PINGPONG_;
  static constexpr bool PERSISTENT = PERSISTENT_;
  static constexpr bool O_IN_Q = O_IN_Q_;
  // FP8 (qkv_dtype e4m3): q and k rows of HEAD_DIM bytes, held as rows of QK_COLS 16-bit columns (the same
  // bytes, so the 16-bit layouts, ldmatrix addresses and k-step descriptors serve fp8's 32-element k-steps); V
  // transposed (fp8 wgmma reads B K-major only, and ldmatrix transposes 16-bit elements only): a slot holds
  // HEAD_DIM_V rows of BLOCK_N keys (prefill/fp8.cuh's `_vt` writes them). T is the output's 16-bit type.
  static constexpr bool FP8 = FP8_;
  static constexpr int QK_COLS = FP8 ? HEAD_DIM / 2 : HEAD_DIM;
  // KV8 (kv_dtype: 1 e4m3, 2 e5m2): the cache's fp8 rows widened into q's dtype in shared memory, which the consumers
  // read as ever. The cp.async kernel: the rows (HEAD_DIM / 2 16-bit pairs) land in a ring of their own (L8,
  // K8_ELEMS a slot, K's and V's), and each tile is widened into sK, sV (prefill/step.cuh.jinja); the loads' layouts
  // and slots: LKld, LVld. TMA: the fp8 boxes land inside the 16-bit ring's slots, widened in place (prefill/widen.cuh).
  static constexpr int KV8 = KV8_;
  static constexpr int ROW8 = (HEAD_DIM / 2) % 64 == 0 ? HEAD_DIM / 2 : HEAD_DIM / 2 + 8;
  using L8 = SmemLayout<HEAD_DIM / 2, ROW8, (HEAD_DIM / 2) % 64 == 0>;
  static constexpr int K8_ELEMS = KV8 ? BLOCK_N * ROW8 : 0;

  // Q16 (KV8 on TMA, a bf16 q): the MMAs run in fp16 (BF16 false), whose widening of the cache is one convert a
  // pair; the producer's widening warps carry Q's tile into fp16 by a power of two (prefill/widen.cuh), which the
  // logits' scale takes back.
  static constexpr bool Q16 = KV8 != 0 && TMA_CTAS_ > 0 && OUT_BF16;
  static_assert(BF16 == (OUT_BF16 && !Q16), "BF16: T's type, but fp16 for Q16");

  using L = SmemLayout<QK_COLS, ROW_ELEMS, SWIZZLE>;
  using LQ = typename Select<WGMMA, WgmmaLayout<QK_COLS, BLOCK_M>, L>::type;
  using LK = typename Select<WGMMA, WgmmaLayout<QK_COLS, BLOCK_N>, L>::type;
  using LVs = typename Select<FP8, SmemLayout<BLOCK_N / 2, ROW_ELEMS_V, SWIZZLE_V>,
                              SmemLayout<HEAD_DIM_V, ROW_ELEMS_V, SWIZZLE_V>>::type;
  using LV = typename Select<FP8 && WGMMA, WgmmaLayout<BLOCK_N / 2, HEAD_DIM_V>,
                             typename Select<WGMMA, WgmmaLayout<HEAD_DIM_V, BLOCK_N>, LVs>::type>::type;
  static constexpr int Q_ELEMS = WGMMA ? BLOCK_M * QK_COLS : BLOCK_M * ROW_ELEMS;
  static constexpr int K_ELEMS = WGMMA ? BLOCK_N * QK_COLS : BLOCK_N * ROW_ELEMS;
  static constexpr int V_ELEMS = WGMMA ? BLOCK_N * HEAD_DIM_V / (FP8 ? 2 : 1)
                                      : (FP8 ? HEAD_DIM_V : BLOCK_N) * ROW_ELEMS_V;
  using LKld = typename Select<KV8 != 0, L8, LK>::type;
  using LVld = typename Select<KV8 != 0, L8, LV>::type;
  static constexpr int K_LD_ELEMS = KV8 ? K8_ELEMS : K_ELEMS;
  static constexpr int V_LD_ELEMS = KV8 ? K8_ELEMS : V_ELEMS;
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int WARP_M = BLOCK_M / NUM_WARPS;
  static constexpr int M_TILES = WARP_M / 16;
  static constexpr int N_TILES = BLOCK_N / 8;  // 8-wide column tiles of S
  // The widths the mma.sync GEMMs run over: head dims rounded up to 16 (m16n8k16's K, and ldmatrix's 16-column
  // blocks of V). A head dim of 8 mod 16 (40, 56, ...) loads its real 16-byte chunks only; the pad chunk after
  // them in each shared-memory row is zeroed once (zero_pad), so Q K^T over it adds nothing and P V's pad
  // columns of O are never stored. Every other head dim runs over itself, as before.
  static constexpr int QK_DIM = (HEAD_DIM + 15) / 16 * 16;
  static constexpr int PV_DIM = (HEAD_DIM_V + 15) / 16 * 16;
  static constexpr bool PAD_DIMS = QK_DIM != HEAD_DIM || PV_DIM != HEAD_DIM_V;
  static constexpr int D_TILES = PV_DIM / 8;   // 8-wide column tiles of O
  static constexpr int K_STEPS = FP8 ? HEAD_DIM / 32 : QK_DIM / 16;  // k-steps of Q K^T
  static_assert(WARP_M % 16 == 0 && BLOCK_N % 16 == 0 && HEAD_DIM % 8 == 0 && HEAD_DIM_V % 8 == 0, "tile shape");
  static_assert(!PAD_DIMS || (!WGMMA && !SWIZZLE && !SWIZZLE_V && ROW_ELEMS >= QK_DIM && ROW_ELEMS_V >= PV_DIM),
                "head dims of 8 mod 16: mma.sync on padded rows");
  static_assert(HEAD_DIM_V <= HEAD_DIM, "O is staged in Q's tile");
  // TMA_CTAS: 0, the cp.async pipeline; else the TMA pipeline, its registers split for that many CTAs
  // an SM (PrefillSpec.tma_ctas, which the entry's launch bounds also take).
  static constexpr bool TMA = TMA_CTAS > 0;
  static_assert(!KV8 || (!FP8 && !MASK_LIST && HEAD_DIM_V == HEAD_DIM && HEAD_DIM % 16 == 0),
                "KV8: whole 16-byte chunks of fp8 rows, V as wide as K");
  static_assert(!KV8 || !TMA || (NUM_WARPS == 8 && BLOCK_N % 32 == 0 && !PERSISTENT),
                "KV8 (TMA): two consumer warpgroups (the producer's widening warps take registers), 32-key units");
  static_assert(!FP8 || (!PAGED && !MASK_LIST && HEAD_DIM % 128 == 0 && HEAD_DIM_V == HEAD_DIM &&
                         BLOCK_N % (TMA ? 128 : 32) == 0),
                "FP8: whole 128-byte rows of q and k, V's transposed keys in 32-key steps (TMA: 128-byte boxes)");
  static_assert(!TMA || (WGMMA && (!PAGED || VARLEN)),
                "TMA: wgmma on the dense layout, varlen batches (contiguous or paged) or a mask's tile lists");
  static_assert(!(TMA && (VARLEN || MASK_LIST) && PERSISTENT), "VARLEN, MASK_LIST (TMA): one CTA a work-list slot");
  static_assert(!OVERLAP || (TMA && NUM_STAGES >= 2), "OVERLAP: the TMA ring, tile i's V and i+1's K in it");
  static_assert(!PINGPONG || (OVERLAP && NUM_WARPS >= 8), "PINGPONG: two or three consumer warpgroups take turns");
  static_assert(NUM_WARPS != 12 || TMA, "three consumer warpgroups: the TMA pipeline's (setmaxnreg)");
  static_assert(!PERSISTENT || TMA, "PERSISTENT: the TMA pipeline's producer loads the next tile's Q");
  static_assert(!O_IN_Q || PERSISTENT, "O_IN_Q: the persistent kernel's choice; one CTA a tile stages O in Q's");
  // O's staging tile of its own (FP8: Q's tile holds half of O's bytes)
  static constexpr bool OWN_O = (PERSISTENT && !O_IN_Q) || FP8;
  // OWN_O: O's staging tile after the V slots (otherwise O is staged in Q's).
  using LO = typename Select<OWN_O, WgmmaLayout<HEAD_DIM_V, BLOCK_M>, LQ>::type;
  static constexpr int GROUPS = NUM_WARPS / 4;  // consumer warpgroups (wgmma)

  // TMA: the ring's mbarriers after the V slots (and sO), 8 bytes each from bars: Q's, then per slot K full, V full,
  // empty (OVERLAP: K's slot empty, then per slot V's: tile i's K is done with a step before its V), then
  // (PERSISTENT) Q's empty.
  static __device__ __forceinline__ unsigned k_bar(unsigned bars, int s) { return bars + 8u * (1 + s); }
  static __device__ __forceinline__ unsigned v_bar(unsigned bars, int s) { return bars + 8u * (1 + NUM_STAGES + s); }
  static __device__ __forceinline__ unsigned e_bar(unsigned bars, int s) {
    return bars + 8u * (1 + 2 * NUM_STAGES + s);
  }
  static __device__ __forceinline__ unsigned ev_bar(unsigned bars, int s) {
    return bars + 8u * (1 + 3 * NUM_STAGES + s);
  }
  static __device__ __forceinline__ unsigned qe_bar(unsigned bars) {
    return bars + 8u * (1 + (OVERLAP ? 4 : 3) * NUM_STAGES);
  }
  // KV8 (TMA, never PERSISTENT): per slot K's and V's fp8 bytes landed (the TMA's), after the others; K full and V
  // full then mean widened (prefill/widen.cuh)
  static __device__ __forceinline__ unsigned lk_bar(unsigned bars, int s) { return qe_bar(bars) + 8u * s; }
  static __device__ __forceinline__ unsigned lv_bar(unsigned bars, int s) {
    return qe_bar(bars) + 8u * (NUM_STAGES + s);
  }
  // Q16: Q's bytes landed (the TMA's; Q's own mbarrier then means carried into fp16), then four words (widen.cuh's
  // q_words: the widening warps' largest |q|, and the power of two the consumers take)
  static __device__ __forceinline__ unsigned lq_bar(unsigned bars) { return qe_bar(bars) + 16u * NUM_STAGES; }
};

}  // namespace attngen
