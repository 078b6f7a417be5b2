// What every piece of a decode kernel reads: the launch's parameters (DecodeParams) and the shape of its CTAs
// (DecodeShape: the spec's constants, what follows from them, where a CTA and a lane sit).
namespace attngen {

template <class T>
struct DecodeParams {
  const T* q;
  const T* k;
  const T* v;
  T* o;
  float* lse;              // [batch, heads, q_len], or null
  const int* seqlens;      // [batch], or null: every row has seqlen_fixed keys
  const int* batch_idx;    // [batch] cache row of each batch row, or null
  const int* block_table;  // [batch, max_blocks] when paged
  float* o_part;           // [splits, batch, q_len, heads, HEAD_DIM] when num_splits > 1
  float* lse_part;         // [splits, batch, heads, q_len] when num_splits > 1
  float* scores;           // unfused: [batch, kv_heads, group * q_len, scores_ld] raw q.k
  float* stats;            // unfused: [splits, batch, kv_heads, ROWS, 2] (max, sum) per row
  long long q_sb, q_ss, q_sh;
  long long k_sb, k_ss, k_sh;  // contiguous: cache row, position, head; paged: block, slot, head
  long long v_sb, v_ss, v_sh;
  long long o_sb, o_ss, o_sh;
  long long bt_sb;
  long long scores_ld;
  int batch, q_len, num_heads, group;
  int num_splits, block_size, capacity, num_blocks;  // num_blocks: paged blocks, or cache rows
  int seqlen_fixed;
  unsigned block_mul;  // paged: ceil(2^(31 + ceil(log2(block_size))) / block_size), for DecodeProducer::block_of
  float sm_scale, scale_log2;
  float softcap_u, inv_softcap_u;  // cap / sm_scale and its inverse (SOFTCAP)
  const float* alibi;              // fp32 slopes [batch, heads] or [heads] (ALIBI)
  long long alibi_sb;              // batch stride of alibi: heads, or 0
  // LOCAL: key j is seen by the token at position i where leftpad <= j, i - window_left <= j <= i + window_right
  // (and j < seqlen); the host passes an unbounded side as 2^30, past any cache.
  const int* leftpad;              // [batch] each row's first cache position, or null (0)
  int window_left, window_right;
  // SINKS: each query head's sink, an fp32 logit [heads] (scaled, like sm_scale * q.k), joining the softmax
  // denominator of each of the head's rows once, where the row is normalised over every key it saw (end.cuh).
  const float* sinks;
  // KV_FP8 (decode/fp8.cuh): fp32 dequantisation scales on the device, read at [kv_head * stride] (stride 0: one
  // for the tensor), or null: k_scale 1 (the host folded a number into sm_scale), v_scale v_scale_f.
  const float* k_scale;
  const float* v_scale;
  int k_scale_sh, v_scale_sh;
  float v_scale_f;
#ifdef ATTNGEN_DECODE_VARLEN
  // VARLEN: q, out are [total_q, heads, head_dim] (q_ss, o_ss their row strides; q_sb, o_sb unused), request b's
  // tokens rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, the last of its cache; q_len is the most a CTA takes
  // (max_q_len), and a request with more, or fewer than q_len_min (at least 1; below, after batch_order), is not
  // computed. The LSE is [heads, total_q] (lse_sh: total_q); the partials keep [splits, batch, q_len, ...] rows,
  // those past a request's tokens unwritten. TREE: tree_mask [total_q], bit j of a token's word: it sees its
  // request's draft token j (the key at seqlen - its q_len + j).
  const int* cu_seqlens_q;
  const long long* tree_mask;
  long long lse_sh;
  // The request each blockIdx.z computes, or null (blockIdx.z itself): a longest-first order keeps long requests
  // out of the launch's tail (BatchAttention's plan sorts them).
  const int* batch_order;
  // Two launches of one step split its requests by token count (BatchAttention: the rows of a one-token
  // request's CTA are fewer than those of a verify request's).
  int q_len_min;
#endif
#ifdef ATTNGEN_MODS
  // A kernel with a user's score_mod / mask_mod (attngen/families/snippets.py): their aux tensors. After every other
  // field, and only in such kernels, so that every other kernel keeps its parameters as they were.
  ModArgs mods;
#endif
};

// Grid: (num_splits, kv_heads, batch). A CTA takes its split's run of BLOCK_N-key tiles (cta_of). Its warps
// form a WARPS_M x WARPS_N grid: WARPS_M along the packed rows (M_TILES tiles of 16 each), WARPS_N along the
// keys of each tile (KW keys each). The pieces of the kernel (producer, consumer, end) are templated on this
// struct and read its members; the template parameters carry a trailing _ so the members can take their names.
template <class T_, bool BF16_, int HEAD_DIM_, int ROWS_, int BLOCK_N_, int NUM_WARPS_, int WARPS_M_, int NUM_STAGES_,
          bool PAGED_, bool Q_IN_REGS_, class V_ = Variants<>, bool LOCAL_ = false,
          bool SINKS_ = false, int KV_FP8_ = 0, bool VARLEN_ = false, bool TREE_ = false>
struct DecodeShape {
  using T = T_;
  static constexpr bool BF16 = BF16_, PAGED = PAGED_, Q_IN_REGS = Q_IN_REGS_;
  using V = V_;  // the logits transforms the spec turns on (common/variant.cuh)
  static constexpr bool LOCAL = LOCAL_, SINKS = SINKS_;
  static constexpr bool VARLEN = VARLEN_, TREE = TREE_;  // a packed, ragged q; tree masks over its draft tokens
  static constexpr int KV_FP8 = KV_FP8_;  // the cache's format: 0 q's dtype, 1 e4m3, 2 e5m2 (decode/fp8.cuh)
  static constexpr int HEAD_DIM = HEAD_DIM_, ROWS = ROWS_, BLOCK_N = BLOCK_N_;
  static constexpr int NUM_WARPS = NUM_WARPS_, WARPS_M = WARPS_M_, NUM_STAGES = NUM_STAGES_;
  // Head dims that are multiples of 64 keep 128-byte XOR-swizzled rows; the others (multiples of 8) are
  // unswizzled rows padded to an odd number of 16-byte chunks, which staggers ldmatrix's row addresses
  // the same way. Where head_dim % 16 == 8 the last MMA step over the head dim reads one chunk past the
  // row's data: that chunk is zeroed in Q and K (zero_pads) and its columns of P V are dropped.
  static constexpr bool PADDED = HEAD_DIM % 64 != 0;
  static constexpr int ROW_ELEMS = PADDED ? (HEAD_DIM + 15) / 16 * 16 + 8 : HEAD_DIM;
  using L = SmemLayout<HEAD_DIM, ROW_ELEMS, !PADDED>;
  // Rows whose 16-byte chunks do not divide among the threads (padded rows, head_dim 192) take load_rows_any.
  static constexpr bool ANY_CHUNKS = PADDED || (NUM_WARPS * 32) % (HEAD_DIM / 8) != 0;
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int WARPS_N = NUM_WARPS / WARPS_M;
  static constexpr int M_TILES = ROWS / 16 / WARPS_M;
  static constexpr int KW = BLOCK_N / WARPS_N;  // keys of a tile one warp takes
  static constexpr int KW_TILES = KW / 8;
  // Past head_dim 256 a row's fp32 output outgrows a thread's registers: D_PARTS CTAs (blockIdx.y's low
  // digit) share a KV head, each computing the whole S = Q K^T and the output columns [part * D_OUT, + D_OUT).
  static constexpr int D_PARTS = HEAD_DIM > 256 ? 2 : 1;
  static constexpr int D_OUT = HEAD_DIM / D_PARTS;
  static constexpr int D_TILES = D_OUT / 8;
  static constexpr int K_STEPS = (HEAD_DIM + 15) / 16;
  static constexpr int TILE_ELEMS = BLOCK_N * ROW_ELEMS;  // one K or V tile in shared memory
  static constexpr int Q_ELEMS = ROWS * ROW_ELEMS;
  static constexpr int S_LD = BLOCK_N + 4;  // fp32 score tile row (unfused P V), padded
  // Copying a K or V tile: each thread keeps one 16-byte column chunk and steps down the rows.
  static constexpr int ROW_STEP = THREADS / L::CHUNKS;
  static constexpr int ROW_ITERS = (BLOCK_N + ROW_STEP - 1) / ROW_STEP;
  // Paged: blocks are whole multiples of 16 positions and tiles start at one, so each 16-row group
  // of a tile lies in one block. A thread's rows (ROW_STEP apart) take ROWS_PER_ENTRY to a group
  // and PAGE_ENTRIES table entries a tile. ATTNGEN_PAGE_ROWS (spec page_rows, blocks of any size):
  // every row takes its own entry.
#ifdef ATTNGEN_PAGE_ROWS
  static constexpr bool PAGE_ROWS = true;
  static constexpr int ROWS_PER_ENTRY = 1;
#else
  static constexpr bool PAGE_ROWS = false;
  static constexpr int ROWS_PER_ENTRY = ROW_STEP < 16 ? 16 / ROW_STEP : 1;
#endif
  static constexpr int PAGE_ENTRIES = ROW_ITERS / ROWS_PER_ENTRY;
  static_assert(ANY_CHUNKS || THREADS % L::CHUNKS == 0, "threads must cover whole rows");
  static_assert(WARPS_M * WARPS_N == NUM_WARPS && M_TILES * 16 * WARPS_M == ROWS, "warp grid");
  static_assert(KW % 16 == 0 && HEAD_DIM % (PADDED ? 8 : 64) == 0, "tile shape");

  struct Cta {
    int split, kv_head, batch, seqlen, rows_valid, tile_begin, tile_end;
    int pad, key_lo;  // LOCAL: the row's left pad and the first key any of its tokens sees (else 0)
    int block_shift;  // paged: 31 + ceil(log2(block_size)), for DecodeProducer::block_of
    const T* k;  // this head of this row's cache (paged: of block 0)
    const T* v;
    const int* table;
  };

  struct Lane {
    int tid, warp, lane, g, t, wn, row0, key0;
    int dcol0;  // the first output column of this CTA (D_PARTS > 1), else 0
    // The packed row of this thread's row r (0: g, 1: g + 8) of its warp's 16-row tile mt.
    __device__ __forceinline__ int row(int mt, int r) const { return row0 + mt * 16 + g + 8 * r; }
  };

  // This thread's place: its warp in the warp grid, its lane in the MMA fragments (g: row, t: column pair).
  static __device__ __forceinline__ Lane lane_of() {
    Lane l;
    l.tid = threadIdx.x;
    l.warp = l.tid / 32;
    l.lane = l.tid % 32;
    l.g = l.lane / 4;
    l.t = l.lane % 4;
    l.wn = l.warp / WARPS_M;
    l.row0 = (l.warp % WARPS_M) * M_TILES * 16;
    l.key0 = l.wn * KW;
    l.dcol0 = D_PARTS > 1 ? (int)(blockIdx.y % D_PARTS) * D_OUT : 0;
    return l;
  }

  // The CTA's tokens, its request's (VARLEN) or the call's q_len, and (VARLEN) the q row of its first. Read from
  // cu_seqlens_q where they are used rather than held in the Cta through the KV loop: at head_dim 256 the kernel
  // has no register to spare for them (ptxas spilled on sm_90a).
  static __device__ __forceinline__ int q_len_of(const DecodeParams<T>& p, const Cta& c) {
    if constexpr (VARLEN) {
      return p.cu_seqlens_q[c.batch + 1] - p.cu_seqlens_q[c.batch];
    } else {
      return p.q_len;
    }
  }
  static __device__ __forceinline__ int q0_of(const DecodeParams<T>& p, const Cta& c) {
    if constexpr (VARLEN) {
      return p.cu_seqlens_q[c.batch];
    } else {
      return 0;
    }
  }

  // This CTA's place (the tile walk): its split's run of its row's tiles, and its KV head's cache. VARLEN: a
  // request of fewer tokens than q_len_min, or more than the kernel's rows take, gets no tile and no valid row (the
  // kernel returns).
  static __device__ __forceinline__ Cta cta_of(const DecodeParams<T>& p) {
    Cta c;
    c.split = blockIdx.x;
    c.kv_head = D_PARTS > 1 ? blockIdx.y / D_PARTS : blockIdx.y;
    c.batch = blockIdx.z;
    if constexpr (VARLEN) {
      if (p.batch_order) c.batch = min(max(p.batch_order[blockIdx.z], 0), p.batch - 1);
    }
    const int len = p.seqlens ? p.seqlens[c.batch] : p.seqlen_fixed;
    c.seqlen = min(max(len, 0), p.capacity);
    c.rows_valid = p.group * p.q_len;
    if constexpr (VARLEN) {
      const int n = q_len_of(p, c);
      c.rows_valid = n < p.q_len_min || n > p.q_len ? 0 : p.group * n;
    }
    c.pad = c.key_lo = 0;
    if constexpr (LOCAL) {
      // Only the live keys are split: from the first token's first key (leftpad or its window's left edge).
      c.pad = p.leftpad ? max(p.leftpad[c.batch], 0) : 0;
      c.key_lo = min(max(c.pad, c.seqlen - q_len_of(p, c) - p.window_left), c.seqlen);
      const int first = c.key_lo / BLOCK_N, tiles = (c.seqlen + BLOCK_N - 1) / BLOCK_N - first;
      const int per = (tiles + p.num_splits - 1) / p.num_splits;
      c.tile_begin = first + min(tiles, c.split * per);
      c.tile_end = first + min(tiles, c.split * per + per);
    } else {
      // The row's tiles dealt out in equal runs; late splits of a short row may get none.
      const int tiles = (c.seqlen + BLOCK_N - 1) / BLOCK_N;
      const int per = (tiles + p.num_splits - 1) / p.num_splits;
      c.tile_begin = min(tiles, c.split * per);
      c.tile_end = min(tiles, c.tile_begin + per);
    }
    if constexpr (PAGED) {
      c.k = p.k + c.kv_head * p.k_sh;
      c.v = p.v + c.kv_head * p.v_sh;
      c.table = p.block_table + c.batch * p.bt_sb;
      c.block_shift = 63 - __clz(p.block_size - 1);
    } else {
      // Clamped to the cache's rows, like paged blocks: a bad index reads a wrong row, never faults.
      const int row = p.batch_idx ? min(max(p.batch_idx[c.batch], 0), p.num_blocks - 1) : c.batch;
      c.k = p.k + row * p.k_sb + c.kv_head * p.k_sh;
      c.v = p.v + row * p.v_sb + c.kv_head * p.v_sh;
      c.table = nullptr;
      c.block_shift = 0;
    }
    return c;
  }
};

}  // namespace attngen
