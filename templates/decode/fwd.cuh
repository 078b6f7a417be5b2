// Decode against a KV cache: q_len (1..8) new tokens per sequence, every query head of one KV
// head packed into the rows of one CTA (row r = token (r / group), head (r % group) of the
// group), so each K/V byte is read once per split of the sequence.
//
// Grid: (num_splits, kv_heads, batch). A CTA takes its split's run of BLOCK_N-key tiles
// through a NUM_STAGES-deep cp.async ring. Its warps form a WARPS_M x WARPS_N grid: WARPS_M
// along the packed rows (M_TILES tiles of 16 each), WARPS_N along the keys of each tile
// (KW keys each). Each warp keeps its own online softmax; at the end (DecodeEnd, decode/end.cuh)
// the WARPS_N partial results of a row are merged in shared memory. With one split the CTA writes
// the output; with several it writes fp32 partial outputs and their LSE, and the `_merge` entry
// combines them (or, in a cluster, the CTAs of a row do). The unfused variant (decode/unfused.cuh, built on this struct) runs QK^T + per-row
// max/sum (`unfused_qk`, K only) and then P V (`unfused_pv`, V and the stored scores) as two
// kernels with the same grid.
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
  unsigned block_mul;  // paged: ceil(2^(31 + ceil(log2(block_size))) / block_size), for Decode::block_of
  float sm_scale, scale_log2;
  float softcap_u, inv_softcap_u;  // cap / sm_scale and its inverse (SOFTCAP)
  const float* alibi;              // fp32 slopes [batch, heads] or [heads] (ALIBI)
  long long alibi_sb;              // batch stride of alibi: heads, or 0
  // LOCAL: key j is seen by the token at position i where leftpad <= j, i - window_left <= j <= i + window_right
  // (and j < seqlen); the host passes an unbounded side as 2^30, past any cache.
  const int* leftpad;              // [batch] each row's first cache position, or null (0)
  int window_left, window_right;
};

// The end of a CTA (decode/end.cuh): its warps' row statistics merged, then the output or the split's partial written.
template <class D>
struct DecodeEnd;

template <class T, bool BF16, int HEAD_DIM, int ROWS, int BLOCK_N, int NUM_WARPS, int WARPS_M, int NUM_STAGES,
          bool PAGED, bool Q_IN_REGS, bool SOFTCAP = false, bool ALIBI = false, bool LOCAL = false>
struct Decode {
  // Head dims that are multiples of 64 keep 128-byte XOR-swizzled rows; the others (multiples of 8) are
  // unswizzled rows padded to an odd number of 16-byte chunks, which staggers ldmatrix's row addresses
  // the same way. Where head_dim % 16 == 8 the last MMA step over the head dim reads one chunk past the
  // row's data: that chunk is zeroed in Q and K (zero_pads) and its columns of P V are dropped.
  static constexpr bool PADDED = HEAD_DIM % 64 != 0;
  static constexpr int ROW_ELEMS = PADDED ? (HEAD_DIM + 15) / 16 * 16 + 8 : HEAD_DIM;
  using L = SmemLayout<HEAD_DIM, ROW_ELEMS, !PADDED>;
  // Rows whose 16-byte chunks do not divide among the threads (padded rows, head_dim 192) take load_rows_any.
  static constexpr bool ANY_CHUNKS = PADDED || (NUM_WARPS * 32) % (HEAD_DIM / 8) != 0;
  using Elem = T;  // (what DecodeEnd, decode/end.cuh, reads of this struct)
  static constexpr bool IS_BF16 = BF16;
  static constexpr int HEAD_DIM_ = HEAD_DIM, ROWS_ = ROWS;  // (and D_OUT, D_PARTS)
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
  // and PAGE_ENTRIES table entries a tile.
  static constexpr int ROWS_PER_ENTRY = ROW_STEP < 16 ? 16 / ROW_STEP : 1;
  static constexpr int PAGE_ENTRIES = ROW_ITERS / ROWS_PER_ENTRY;
  static_assert(ANY_CHUNKS || THREADS % L::CHUNKS == 0, "threads must cover whole rows");
  static_assert(WARPS_M * WARPS_N == NUM_WARPS && M_TILES * 16 * WARPS_M == ROWS, "warp grid");
  static_assert(KW % 16 == 0 && HEAD_DIM % (PADDED ? 8 : 64) == 0, "tile shape");

  struct Cta {
    int split, kv_head, batch, seqlen, rows_valid, tile_begin, tile_end;
    int pad, key_lo;  // LOCAL: the row's left pad and the first key any of its tokens sees (else 0)
    int block_shift;  // paged: 31 + ceil(log2(block_size)), for block_of
    const T* k;  // this head of this row's cache (paged: of block 0)
    const T* v;
    const int* table;
  };

  struct Lane {
    int tid, warp, lane, g, t, wn, row0, key0;
    int dcol0;  // the first output column of this CTA (D_PARTS > 1), else 0
  };

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

  static __device__ __forceinline__ Cta cta_of(const DecodeParams<T>& p) {
    Cta c;
    c.split = blockIdx.x;
    c.kv_head = D_PARTS > 1 ? blockIdx.y / D_PARTS : blockIdx.y;
    c.batch = blockIdx.z;
    const int len = p.seqlens ? p.seqlens[c.batch] : p.seqlen_fixed;
    c.seqlen = min(max(len, 0), p.capacity);
    c.rows_valid = p.group * p.q_len;
    c.pad = c.key_lo = 0;
    if constexpr (LOCAL) {
      // Only the live keys are split: from the first token's first key (leftpad or its window's left edge).
      c.pad = p.leftpad ? max(p.leftpad[c.batch], 0) : 0;
      c.key_lo = min(max(c.pad, c.seqlen - p.q_len - p.window_left), c.seqlen);
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

  // A key position's paged block, pos / block_size for 0 <= pos < 2^31, as a multiply and a shift.
  // A division (or a choice of a shift or a division) compiled to a branch around every row's copy,
  // which kept ptxas from batching a tile's copies. Exact: block_mul exceeds 2^shift / block_size
  // by less than 1, which moves pos * block_mul / 2^shift by less than 2^31 / 2^shift <= 1 / block_size.
  static __device__ __forceinline__ int block_of(int pos, const DecodeParams<T>& p, const Cta& c) {
    return (int)(((unsigned long long)(unsigned)pos * p.block_mul) >> c.block_shift);
  }

  static __device__ __forceinline__ void load_q(T* sQ, const DecodeParams<T>& p, const Cta& c, int tid) {
    for (int idx = tid; idx < ROWS * L::CHUNKS; idx += THREADS) {
      const int r = idx / L::CHUNKS;
      const int col = (idx % L::CHUNKS) * 8;
      const bool ok = r < c.rows_valid;
      const T* src = p.q;
      if (ok) {
        const int qi = r / p.group;
        const int head = c.kv_head * p.group + (r - qi * p.group);
        src = p.q + c.batch * p.q_sb + qi * p.q_ss + head * p.q_sh + col;
      }
      cp_async_16(smem_addr(sQ + L::offset(r, col)), src, ok);
    }
  }

  // Paged caches: the table entry of each 16-row group this thread copies from in one tile, read
  // one tile ahead and kept as loaded (0 past the sequence); load_rows clamps it. Clamping here
  // would wait for the read at once, every tile.
  struct Pages {
    int block[PAGED && !ANY_CHUNKS ? PAGE_ENTRIES : 1];
  };

  static __device__ __forceinline__ void lookup(Pages& pg, const DecodeParams<T>& p, const Cta& c, int tile, int tid) {
    if constexpr (PAGED && !ANY_CHUNKS) {
      const int r0 = tid / L::CHUNKS;
#pragma unroll
      for (int e = 0; e < PAGE_ENTRIES; ++e) {
        const int pos = tile * BLOCK_N + r0 + e * ROWS_PER_ENTRY * ROW_STEP;  // the group's first row here
        pg.block[e] = pos < c.seqlen ? c.table[block_of(pos, p, c)] : 0;
      }
    }
  }

  // Rows [tile * BLOCK_N, + BLOCK_N) of one head of the K (LOAD_K) and V (LOAD_V) caches into
  // swizzled tiles; rows at or past the sequence (LOCAL: or before key_lo, where a left pad may hold
  // anything, NaN included, that P V would carry) are zero-filled and never read. A one-stage ring
  // copies each row's K and V together, deeper rings all of K first: the order that keeps head_dim
  // 256 (255 registers a thread) from spilling on each (ptxas 13.5; the other order spilled 40 bytes
  // on sm_80/sm_86 at one stage, 8 on sm_90a at two).
  template <bool LOAD_K, bool LOAD_V>
  static __device__ __forceinline__ void load_rows(T* dst_k, T* dst_v, const DecodeParams<T>& p, const Cta& c,
                                                   const Pages& pg, int tile, int tid) {
    constexpr int PASSES = NUM_STAGES == 1 ? 1 : 2;
    const int r0 = tid / L::CHUNKS;
    const int col = (tid % L::CHUNKS) * 8;
    if constexpr (ANY_CHUNKS) {
      load_rows_any<LOAD_K, LOAD_V>(dst_k, dst_v, p, c, tile, tid);
    } else if constexpr (PAGED && ROWS_PER_ENTRY >= 4) {
      // Four rows or more of a thread to a 16-row group (head_dim 256 at 4 warps): the group's first row
      // here finds the block (clamped to the pool: a bad table entry reads a wrong block instead of
      // faulting), the others step from its address. That address is in the pool whether or not the
      // row is in the sequence, so it is not chosen on `ok`: at head_dim 256 that choice compiled to a
      // branch around each row's copy (117 branch regions against the contiguous kernel's 58, ptxas
      // 13.5) and the paged kernel fell well behind the contiguous one; stepping keeps up with it. At
      // two rows a group (head_dim 128) stepping was slower at batch 1, so those keep the form below.
      // (Two loops rather than one with the choice inside: the shared loop changed the contiguous kernels'
      // machine code on sm_100.)
#pragma unroll
      for (int pass = 0; pass < PASSES; ++pass) {
        const bool load_k = LOAD_K && (PASSES == 1 || pass == 0);
        const bool load_v = LOAD_V && (PASSES == 1 || pass == 1);
        const T* gk = c.k;
        const T* gv = c.v;
#pragma unroll
        for (int it = 0; it < ROW_ITERS; ++it) {
          const int r = r0 + it * ROW_STEP;
          if (BLOCK_N % ROW_STEP == 0 || r < BLOCK_N) {
            const int pos = tile * BLOCK_N + r;
            const bool ok = pos < c.seqlen && (!LOCAL || pos >= c.key_lo);
            const int at = L::offset(r, col);
            if (it % ROWS_PER_ENTRY == 0) {
              const long long slot = pos - block_of(pos, p, c) * p.block_size;
              const long long blk = min(max(pg.block[it / ROWS_PER_ENTRY], 0), p.num_blocks - 1);
              if (load_k) gk = c.k + blk * p.k_sb + slot * p.k_ss + col;
              if (load_v) gv = c.v + blk * p.v_sb + slot * p.v_ss + col;
            } else {
              if (load_k) gk += ROW_STEP * p.k_ss;
              if (load_v) gv += ROW_STEP * p.v_ss;
            }
            if (load_k) cp_async_16(smem_addr(dst_k + at), gk, ok);
            if (load_v) cp_async_16(smem_addr(dst_v + at), gv, ok);
          }
        }
      }
    } else {
      // Paged at 16 rows a CTA: each row's address is computed whether or not the row is in the sequence
      // (it is in the pool: the block is clamped, the slot lies in it), not chosen on `ok`: without the
      // choice head_dim 128 paged has fewer branch regions (86 down to 50) and runs faster. At 32 rows the
      // choice stays: without it head_dim 64 and 256 spilled on sm_90a.
      constexpr bool ANY_ROW = PAGED && ROWS <= 16;
#pragma unroll
      for (int pass = 0; pass < PASSES; ++pass) {
#pragma unroll
        for (int it = 0; it < ROW_ITERS; ++it) {
          const int r = r0 + it * ROW_STEP;
          if (BLOCK_N % ROW_STEP == 0 || r < BLOCK_N) {
            const int pos = tile * BLOCK_N + r;
            const bool ok = pos < c.seqlen && (!LOCAL || pos >= c.key_lo);
            const int at = L::offset(r, col);
            int blk = 0, slot = pos;
            if constexpr (PAGED) {
              // The rows of a 16-row group lie in one block, found from the group's first row here.
              // Clamped to the pool: a bad table entry reads a wrong block instead of faulting.
              slot = pos - block_of(pos - (it % ROWS_PER_ENTRY) * ROW_STEP, p, c) * p.block_size;
              blk = min(max(pg.block[it / ROWS_PER_ENTRY], 0), p.num_blocks - 1);
            }
            if (LOAD_K && (PASSES == 1 || pass == 0))
              cp_async_16(smem_addr(dst_k + at), ANY_ROW || ok ? c.k + blk * p.k_sb + slot * p.k_ss + col : c.k, ok);
            if (LOAD_V && (PASSES == 1 || pass == 1))
              cp_async_16(smem_addr(dst_v + at), ANY_ROW || ok ? c.v + blk * p.v_sb + slot * p.v_ss + col : c.v, ok);
          }
        }
      }
    }
  }

  // load_rows for rows whose 16-byte chunks do not divide among the threads: each thread steps over
  // (row, chunk) pairs, a paged row reading its block from the table (clamped to the pool) as it goes.
  template <bool LOAD_K, bool LOAD_V>
  static __device__ __forceinline__ void load_rows_any(T* dst_k, T* dst_v, const DecodeParams<T>& p, const Cta& c,
                                                       int tile, int tid) {
    constexpr int PASSES = NUM_STAGES == 1 ? 1 : 2;
    constexpr int TOTAL = BLOCK_N * L::CHUNKS;
    constexpr int ITERS = (TOTAL + THREADS - 1) / THREADS;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
#pragma unroll
      for (int it = 0; it < ITERS; ++it) {
        const int idx = it * THREADS + tid;
        if (TOTAL % THREADS == 0 || idx < TOTAL) {
          const int r = idx / L::CHUNKS;
          const int col = (idx - r * L::CHUNKS) * 8;
          const int pos = tile * BLOCK_N + r;
          const bool ok = pos < c.seqlen && (!LOCAL || pos >= c.key_lo);
          long long ko = 0, vo = 0;
          if (ok) {
            if constexpr (PAGED) {
              const int b = block_of(pos, p, c);
              const long long blk = min(max(c.table[b], 0), p.num_blocks - 1);
              const long long slot = pos - b * p.block_size;
              ko = blk * p.k_sb + slot * p.k_ss;
              vo = blk * p.v_sb + slot * p.v_ss;
            } else {
              ko = pos * p.k_ss;
              vo = pos * p.v_ss;
            }
          }
          const int at = L::offset(r, col);
          if (LOAD_K && (PASSES == 1 || pass == 0)) cp_async_16(smem_addr(dst_k + at), c.k + ko + col, ok);
          if (LOAD_V && (PASSES == 1 || pass == 1)) cp_async_16(smem_addr(dst_v + at), c.v + vo + col, ok);
        }
      }
    }
  }

  // Where head_dim % 16 == 8: zero the chunk past each row's data in Q and in every K slot of the ring, which
  // the last MMA step over the head dim reads (the copies never write it, so once is enough; the ring's first
  // barrier orders these stores before any read).
  static __device__ __forceinline__ void zero_pads(T* sQ, T* sK, int tid) {
    if constexpr (HEAD_DIM % 16 != 0) {
      for (int r = tid; r < ROWS + NUM_STAGES * BLOCK_N; r += THREADS) {
        T* row = r < ROWS ? sQ + r * ROW_ELEMS : sK + (r - ROWS) * ROW_ELEMS;
        *reinterpret_cast<uint4*>(row + HEAD_DIM) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }

  // Each of this thread's rows' position: token qi sits at seqlen - q_len + qi, which is also the last
  // key it sees unless LOCAL (where key_bounds gives both ends). Rows past the packed ones (zero
  // queries, never written) are placed at the sequence's end.
  static __device__ __forceinline__ void row_limits(int (&lim)[M_TILES][2], const DecodeParams<T>& p, const Cta& c,
                                                    const Lane& l) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = l.row0 + mt * 16 + l.g + 8 * r;
        lim[mt][r] = row < c.rows_valid ? c.seqlen - p.q_len + row / p.group : c.seqlen - 1;
      }
  }

  // Some key of this warp's slice of the tile lies past the first token's last key (LOCAL: or before
  // the last token's first).
  static __device__ __forceinline__ bool needs_mask(const DecodeParams<T>& p, const Cta& c, int n0, const Lane& l) {
    if constexpr (LOCAL) {
      const int pos0 = c.seqlen - p.q_len;
      return n0 + l.key0 + KW - 1 > min(pos0 + p.window_right, c.seqlen - 1) ||
             n0 + l.key0 < max(c.pad, pos0 + p.q_len - 1 - p.window_left);
    } else {
      return n0 + l.key0 + KW - 1 > c.seqlen - p.q_len;
    }
  }

  // LOCAL: the first and last key (relative to col0) the token at position `pos` sees.
  static __device__ __forceinline__ void key_bounds(int& lo, int& hi, int pos, int col0, const DecodeParams<T>& p,
                                                    const Cta& c) {
    lo = max(c.pad, pos - p.window_left) - col0;
    hi = min(pos + p.window_right, c.seqlen - 1) - col0;
  }

  static __device__ __forceinline__ void load_q_frags(unsigned (&q_frag)[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? K_STEPS : 1][4],
                                                      const T* sQ, const Lane& l) {
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk)
          ldmatrix_x4(q_frag[mt][kk][0], q_frag[mt][kk][1], q_frag[mt][kk][2], q_frag[mt][kk][3],
                      smem_addr(sQ + L::offset(l.row0 + mt * 16 + (l.lane % 16), kk * 16 + (l.lane / 16) * 8)));
    }
  }

  // S = Q K^T over this warp's KW keys of the tile in sKs, capped and ALiBi-biased where the spec
  // asks, masked to each row's limit.
  static __device__ __forceinline__ void scores(float (&acc_s)[M_TILES][KW_TILES][4],
                                                const unsigned (&q_frag)[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? K_STEPS : 1][4],
                                                const T* sQ, const T* sKs, const int (&lim)[M_TILES][2], bool mask,
                                                int n0, const DecodeParams<T>& p, const Cta& c, const Lane& l) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int n = 0; n < KW_TILES; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mt][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
      unsigned a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        if constexpr (Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][kk][e];
        } else {
          ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                      smem_addr(sQ + L::offset(l.row0 + mt * 16 + (l.lane % 16), kk * 16 + (l.lane / 16) * 8)));
        }
      }
#pragma unroll
      for (int n2 = 0; n2 < KW_TILES / 2; ++n2) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4(b0, b1, b2, b3,
                    smem_addr(sKs + L::offset(l.key0 + n2 * 16 + (l.lane % 8) + (l.lane / 16) * 8,
                                              kk * 16 + ((l.lane / 8) % 2) * 8)));
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16816<BF16>(acc_s[mt][2 * n2], a[mt], b0, b1);
          mma_16816<BF16>(acc_s[mt][2 * n2 + 1], a[mt], b2, b3);
        }
      }
    }
    if constexpr (SOFTCAP || ALIBI) {
      const int col0 = n0 + l.key0 + 2 * l.t;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // The packed row's query head and position (lim: the last key it sees, its own).
          const int row = l.row0 + mt * 16 + l.g + 8 * r;
          const float slope_u =
              ALIBI ? p.alibi[c.batch * p.alibi_sb + c.kv_head * p.group + row % p.group] / p.sm_scale : 0.f;
#pragma unroll
          for (int n = 0; n < KW_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              acc_s[mt][n][2 * r + e] = score_transform<SOFTCAP, ALIBI>(acc_s[mt][n][2 * r + e], p.softcap_u,
                                                                        p.inv_softcap_u, slope_u,
                                                                        lim[mt][r] - (col0 + n * 8 + e));
        }
    }
    if (mask) {
      const int col0 = n0 + l.key0 + 2 * l.t;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          int lo = 0, hi = lim[mt][r] - col0;
          if constexpr (LOCAL) key_bounds(lo, hi, lim[mt][r], col0, p, c);
#pragma unroll
          for (int n = 0; n < KW_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (n * 8 + e > hi || (LOCAL && n * 8 + e < lo)) acc_s[mt][n][2 * r + e] = -ATTNGEN_INF;
        }
    }
  }

  // The scores of one K tile for fused and unfused_qk: Q's fragments come from shared memory on
  // the CTA's first tile (it == 0), masking only where some key of the warp's slice needs it.
  static __device__ __forceinline__ void tile_scores(float (&acc_s)[M_TILES][KW_TILES][4],
                                                     unsigned (&q_frag)[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? K_STEPS : 1][4],
                                                     const T* sQ, const T* sKs, const int (&lim)[M_TILES][2], int it,
                                                     int n0, const DecodeParams<T>& p, const Cta& c, const Lane& l) {
    if (it == 0) load_q_frags(q_frag, sQ, l);
    scores(acc_s, q_frag, sQ, sKs, lim, needs_mask(p, c, n0, l), n0, p, c, l);
  }

  // Online softmax of one tile's scores: updates max and sum, turns acc_s into probabilities and
  // returns through corr the factor older accumulations must be scaled by.
  static __device__ __forceinline__ void softmax_step(float (&acc_s)[M_TILES][KW_TILES][4], float (&row_max)[M_TILES][2],
                                                      float (&row_sum)[M_TILES][2], float (&corr)[M_TILES][2],
                                                      float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mt][r];
#pragma unroll
        for (int n = 0; n < KW_TILES; ++n) mx = fmaxf(mx, fmaxf(acc_s[mt][n][2 * r], acc_s[mt][n][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -ATTNGEN_INF ? 0.f : mx * scale_log2;
        corr[mt][r] = fast_exp2(row_max[mt][r] * scale_log2 - base);
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < KW_TILES; ++n)
#pragma unroll
          for (int e = 2 * r; e < 2 * r + 2; ++e) {
            const float x = fast_exp2(fmaf(acc_s[mt][n][e], scale_log2, -base));
            acc_s[mt][n][e] = x;
            sum += x;
          }
        row_sum[mt][r] = row_sum[mt][r] * corr[mt][r] + sum;
      }
  }

  // O += P V over this warp's KW keys of the tile in sVs; P in the accumulator layout of S.
  static __device__ __forceinline__ void accumulate_pv(float (&acc_o)[M_TILES][D_TILES][4],
                                                       const float (&acc_p)[M_TILES][KW_TILES][4], const T* sVs,
                                                       const Lane& l) {
#pragma unroll
    for (int kk = 0; kk < KW / 16; ++kk) {
      unsigned a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) p_fragment<BF16>(acc_p[mt], kk, a[mt]);
#pragma unroll
      for (int d2 = 0; d2 < (D_OUT + 15) / 16; ++d2) {
        unsigned b0, b1, b2, b3;
        ldmatrix_x4_trans(b0, b1, b2, b3,
                          smem_addr(sVs + L::offset(l.key0 + kk * 16 + (l.lane % 8) + ((l.lane / 8) % 2) * 8,
                                                    (D_PARTS > 1 ? l.dcol0 : 0) + d2 * 16 + (l.lane / 16) * 8)));
#pragma unroll
        for (int mt = 0; mt < M_TILES; ++mt) {
          mma_16816<BF16>(acc_o[mt][2 * d2], a[mt], b0, b1);
          if (2 * d2 + 1 < D_TILES) mma_16816<BF16>(acc_o[mt][2 * d2 + 1], a[mt], b2, b3);  // else the pad
        }
      }
    }
  }

  // The CTA's tiles through a NUM_STAGES-slot cp.async ring: load(tile, slot) issues one tile's
  // copies, body(tile, it, slot) consumes it (it counts from 0). ring_fill issues the first
  // NUM_STAGES - 1 tiles; callers set up their accumulators between the two, where the loops had
  // it before they were shared, and ptxas keeps their registers (set up before the fill, head_dim
  // 128 paged took 182, not 166: two CTAs an SM, not three). Each step waits for its tile, then
  // refills the slot the previous step freed. (Refilling first, with a second barrier, keeps one
  // more tile in flight while waiting: faster on decode calls under ~1 GB of cache, slower on
  // larger ones.)
  template <class Load>
  static __device__ __forceinline__ void ring_fill(const Cta& c, Load&& load) {
#pragma unroll
    for (int s = 0; s < NUM_STAGES - 1; ++s) {
      if (c.tile_begin + s < c.tile_end) load(c.tile_begin + s, s);
      cp_async_commit();
    }
  }
  template <class Load, class Body>
  static __device__ __forceinline__ void ring(const Cta& c, Load&& load, Body&& body) {
    for (int tile = c.tile_begin; tile < c.tile_end; ++tile) {
      const int it = tile - c.tile_begin;
      if constexpr (NUM_STAGES > 1) {
        cp_async_wait<NUM_STAGES - 2>();
        __syncthreads();  // tile has landed, and every warp is done with tile - 1, whose slot is refilled
        const int next = tile + NUM_STAGES - 1;
        if (next < c.tile_end) load(next, (it + NUM_STAGES - 1) % NUM_STAGES);
        cp_async_commit();
      } else {
        load(tile, 0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
      }
      body(tile, it, it % NUM_STAGES);
      if constexpr (NUM_STAGES == 1) __syncthreads();  // the one slot is refilled next
    }
  }

  // ---- fused: S, softmax and P V per tile -------------------------------------------------------
  static __device__ __forceinline__ void fused(const DecodeParams<T>& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Q_ELEMS;
    T* sV = sK + NUM_STAGES * TILE_ELEMS;
    const Cta c = cta_of(p);
    const Lane l = lane_of();

    Pages pg;
    lookup(pg, p, c, c.tile_begin, l.tid);
    load_q(sQ, p, c, l.tid);
    zero_pads(sQ, sK, l.tid);
    const auto load = [&](int tile, int slot) {
      load_rows<true, true>(sK + slot * TILE_ELEMS, sV + slot * TILE_ELEMS, p, c, pg, tile, l.tid);
      lookup(pg, p, c, tile + 1, l.tid);
    };
    ring_fill(c, load);
    float acc_o[M_TILES][D_TILES][4];
    float row_max[M_TILES][2], row_sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int d = 0; d < D_TILES; ++d)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[mt][d][e] = 0.f;
      row_max[mt][0] = row_max[mt][1] = -ATTNGEN_INF;
      row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    int lim[M_TILES][2];
    row_limits(lim, p, c, l);
    unsigned q_frag[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? K_STEPS : 1][4];

    ring(
        c, load,
        [&](int tile, int it, int slot) {
          const int n0 = tile * BLOCK_N;
          float acc_s[M_TILES][KW_TILES][4];
          tile_scores(acc_s, q_frag, sQ, sK + slot * TILE_ELEMS, lim, it, n0, p, c, l);
          float corr[M_TILES][2];
          softmax_step(acc_s, row_max, row_sum, corr, p.scale_log2);
#pragma unroll
          for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
            for (int d = 0; d < D_TILES; ++d)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc_o[mt][d][e] *= corr[mt][e / 2];
          accumulate_pv(acc_o, acc_s, sV + slot * TILE_ELEMS, l);
        });
    DecodeEnd<Decode>::epilogue(p, c, smem_raw, acc_o, row_max, row_sum, l);
  }
};

}  // namespace attngen
