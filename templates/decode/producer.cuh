// The producer side of a decode CTA: Q, and each K/V tile of its split, copied into shared memory with cp.async
// (paged caches through their block table, read one tile ahead), and the ring of NUM_STAGES slots the tiles
// stream through.
namespace attngen {

template <class S>
struct DecodeProducer {
  using T = typename S::T;
  using L = typename S::L;
  using Cta = typename S::Cta;
  static constexpr bool PAGED = S::PAGED, LOCAL = S::LOCAL;
  // Rows copied by load_rows_any, which reads each row's table entry as it goes: rows whose chunks do not divide
  // among the threads, and (page_rows) a thread's rows past 8 a tile, whose entries read a tile ahead spilled
  // (head_dim 256 at 4 warps: 16 rows a thread, 96 bytes on sm_90a).
  static constexpr bool ANY_CHUNKS = S::ANY_CHUNKS || (S::PAGE_ROWS && S::ROW_ITERS > 8);
  static constexpr int HEAD_DIM = S::HEAD_DIM, ROWS = S::ROWS, BLOCK_N = S::BLOCK_N, THREADS = S::THREADS;
  static constexpr int NUM_STAGES = S::NUM_STAGES, ROW_ELEMS = S::ROW_ELEMS, ROW_STEP = S::ROW_STEP;
  static constexpr int ROW_ITERS = S::ROW_ITERS, ROWS_PER_ENTRY = S::ROWS_PER_ENTRY, PAGE_ENTRIES = S::PAGE_ENTRIES;
  // A tile's copies: a one-stage ring copies each row's K and V together, deeper rings all of K, then all of V
  // (load_rows says why).
  static constexpr int PASSES = NUM_STAGES == 1 ? 1 : 2;

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
        if constexpr (S::VARLEN) {
          src = p.q + (long long)(S::q0_of(p, c) + qi) * p.q_ss + head * p.q_sh + col;
        } else {
          src = p.q + c.batch * p.q_sb + qi * p.q_ss + head * p.q_sh + col;
        }
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
};

}  // namespace attngen
