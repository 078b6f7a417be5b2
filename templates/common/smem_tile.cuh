// Shared-memory tiles of ROWS x HEAD_DIM 16-bit elements, addressed in 16-byte chunks.
// Rows whose length is a multiple of 128 bytes are XOR-swizzled (chunk ^ row within each group
// of 8 chunks), so the 8 row addresses of one ldmatrix phase hit 8 different bank groups; other
// rows are padded by one chunk, which staggers them the same way.
namespace attngen {

template <int HEAD_DIM, int ROW_ELEMS, bool SWIZZLE>
struct SmemLayout {
  static constexpr int CHUNKS = HEAD_DIM / 8;

  // Element offset of the chunk holding column `col` (a multiple of 8) of row `row`.
  __device__ __forceinline__ static int offset(int row, int col) {
    if constexpr (SWIZZLE) {
      const int chunk = col >> 3;
      const int phys = (chunk & ~7) | ((chunk ^ row) & 7);
      return row * ROW_ELEMS + (phys << 3);
    } else {
      return row * ROW_ELEMS + col;
    }
  }
};

// wgmma's operations (wgmma.cuh.jinja), declared here so that kernels name them through a template
// argument; defined only in sm_90a kernels.
template <bool BF16>
struct WgmmaOps;
template <int N, bool BF16>
struct Wgmma;

// The layout wgmma reads through a 128-byte-swizzle descriptor: the tile is stored as HEAD_DIM/64
// column blocks of ROWS rows x 128 bytes, and within each 8-row (1024-byte) atom chunk c of row r
// sits at chunk c ^ (r % 8). The tile must start 1024-byte aligned.
template <int HEAD_DIM, int ROWS>
struct WgmmaLayout {
  static constexpr int CHUNKS = HEAD_DIM / 8;
  static constexpr int BLOCK_BYTES = ROWS * 128;  // one 64-column block

  __device__ __forceinline__ static int offset(int row, int col) {
    return ((col >> 6) * ROWS + row) * 64 + ((((col >> 3) ^ row) & 7) << 3);
  }
};

// Zero rows [first, ROWS) of a tile in WgmmaLayout of BLOCKS 64-column blocks, with THREADS threads (tid among them).
// A row of a block is 128 contiguous bytes (the swizzle moves 16-byte chunks only within them), so whole rows are
// cleared whatever the swizzle.
template <class Layout, int ROWS, int BLOCKS, int THREADS, class T>
__device__ __forceinline__ void zero_rows_from(T* tile, int first, int tid) {
  constexpr int CHUNKS = BLOCKS * ROWS * 8;  // 16-byte chunks
  static_assert(CHUNKS % THREADS == 0, "whole chunks a thread");
  unsigned char* base = reinterpret_cast<unsigned char*>(tile);
#pragma unroll 1
  for (int j = 0; j < CHUNKS / THREADS; ++j) {
    const int i = tid + j * THREADS;
    const int row = (i / 8) % ROWS;
    if (row >= first)
      *reinterpret_cast<uint4*>(base + (i / (ROWS * 8)) * Layout::BLOCK_BYTES + row * 128 + (i % 8) * 16) =
          make_uint4(0u, 0u, 0u, 0u);
  }
}

// A CUDA tensor map (CUtensorMap: 128 opaque bytes, 64-byte aligned) built on the host by
// cuTensorMapEncodeTiled; TMA copies (sm_90a) read it from a __grid_constant__ kernel parameter.
struct alignas(64) TmaDesc {
  unsigned long long opaque[16];
};

template <bool C, class A, class B>
struct Select {
  using type = A;
};
template <class A, class B>
struct Select<false, A, B> {
  using type = B;
};

// Issue cp.async for ROWS rows starting at `src` (row stride `stride` elements); rows at or past
// `valid_rows` are zero-filled. Consecutive threads take consecutive chunks of a row: coalesced.
// When THREADS is a multiple of the chunks per row, each thread keeps one column and steps down
// the rows: one pointer and one increment live across the KV loop instead of a hoisted address
// per copy (which pushed head_dim 256 into spills).
template <class Layout, int ROWS, int THREADS, class T>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, long long stride, int valid_rows, int tid) {
  constexpr int TOTAL = ROWS * Layout::CHUNKS;
  if constexpr (THREADS % Layout::CHUNKS == 0) {
    constexpr int ROW_STEP = THREADS / Layout::CHUNKS;
    constexpr int ITERS = (ROWS + ROW_STEP - 1) / ROW_STEP;
    const int r0 = tid / Layout::CHUNKS;
    const int c = (tid % Layout::CHUNKS) * 8;
    const T* s = src + r0 * stride + c;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int r = r0 + it * ROW_STEP;
      if (ROWS % ROW_STEP == 0 || r < ROWS) {
        const bool ok = r < valid_rows;
        cp_async_16(smem_addr(dst + Layout::offset(r, c)), ok ? s : src, ok);
      }
      s += ROW_STEP * stride;
    }
  } else {
    constexpr int ITERS = (TOTAL + THREADS - 1) / THREADS;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int idx = it * THREADS + tid;
      if (TOTAL % THREADS == 0 || idx < TOTAL) {
        const int r = idx / Layout::CHUNKS;
        const int c = (idx % Layout::CHUNKS) * 8;
        const bool ok = r < valid_rows;
        cp_async_16(smem_addr(dst + Layout::offset(r, c)), ok ? src + r * stride + c : src, ok);
      }
    }
  }
}

// Two tiles of ROWS rows whose rows lie anywhere (a paged cache): row_offsets(r) gives the element
// offsets of row r from `a` and from `b` (a longlong2), asked once per row chunk of `a` for both
// copies, by every lane of a warp together (it may shuffle; ROWS * CHUNKS and THREADS are
// multiples of 32, so a warp's lanes agree on every branch); rows at or past `valid_rows` (>= 1)
// are zero-filled and ask for row 0's offsets. `b`'s rows may be narrower (split QK/V head dims):
// its chunks ride along with `a`'s first ones. Unrolled by two: fully unrolled, every row's offsets
// were hoisted and held at once (spills at head_dim 128 and 256).
template <class LayoutA, class LayoutB, int ROWS, int THREADS, class T, class RowOffsets>
__device__ __forceinline__ void load_pair_rows_async(T* dst_a, T* dst_b, const T* a, const T* b, int valid_rows,
                                                     int tid, RowOffsets row_offsets) {
  static_assert(LayoutB::CHUNKS <= LayoutA::CHUNKS, "b's rows are at most as wide as a's");
  constexpr int TOTAL = ROWS * LayoutA::CHUNKS;
  constexpr int ITERS = (TOTAL + THREADS - 1) / THREADS;
#pragma unroll 2
  for (int it = 0; it < ITERS; ++it) {
    const int idx = it * THREADS + tid;
    if (TOTAL % THREADS == 0 || idx < TOTAL) {
      const int r = idx / LayoutA::CHUNKS;
      const int c = (idx % LayoutA::CHUNKS) * 8;
      const bool ok = r < valid_rows;
      const longlong2 off = row_offsets(ok ? r : 0);
      const unsigned at = smem_addr(dst_a + LayoutA::offset(r, c));
      cp_async_16(at, a + off.x + c, ok);
      if (LayoutB::CHUNKS == LayoutA::CHUNKS || c < LayoutB::CHUNKS * 8)
        cp_async_16(smem_addr(dst_b + LayoutB::offset(r, c)), b + off.y + c, ok);
    }
  }
}

}  // namespace attngen
