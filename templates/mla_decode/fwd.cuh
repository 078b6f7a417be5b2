// MLA decode (the absorbed form of multi-head latent attention): every query head attends to one
// shared compressed cache. A cache row holds ckv (DC = kv_lora_rank columns) and kpe (DR = rope
// dim columns); a query row holds q_nope (DC) and q_pe (DR). S = q_nope ckv^T + q_pe kpe^T and
// O = softmax(S sm_scale) ckv, DC wide.
//
// Grid: (num_splits, row blocks, batch). The packed query rows of one sequence (row r = token
// r / heads, head r % heads) are cut into blocks of ROWS; a CTA takes one block over its split's
// run of BLOCK_N-key tiles. Q (ROWS x (DC + DR)) stays in shared memory; the cache tiles (ckv and
// kpe side by side in one padded row) go through a NUM_STAGES-deep cp.async ring, and ckv is read
// from the same tile as K and as V.
//
// Warps form WARPS_M = ROWS / 16 row tiles x WARPS_N column groups; warp (rt, cg) accumulates O for
// rows [16 rt, 16 rt + 16) and output columns [cg ON, (cg + 1) ON) (how S is made: consumer.cuh).
// One split writes O (normalised) and the LSE; several write fp32 partials and their LSE, merged by
// the module's `_merge` entries (split_merge.cuh), or, on sm_90 with the splits of a row block one
// cluster, in the cluster's shared memory (cluster_merge_rows at 16 rows, merge_pushed_row at 32).
//
// MlaDecode::run places the CTA and its threads, then hands out the roles: the producer (Q and the ring's
// tiles in, mla_decode/producer.cuh), the tile walk (mla_decode/walk.cuh; alternate tiles: alternate.cuh) with the
// consumer (S, softmax, O += P V: mla_decode/consumer.cuh), and the epilogue (mla_decode/epilogue.cuh; where O and
// the LSE are written is still run's, see there). Arrays live in run and are passed by reference (consumer.cuh
// says why). An fp8 cache on the wgmma kernel (PRODUCER_WG) has a warpgroup of its own past the consumers that loads
// and widens the tiles (mla_decode/fp8_wgmma.cuh); the consumers walk the widened tiles as the 16-bit kernel's.
namespace attngen {

// qk_shard=alternate's loop (mla_decode/alternate.cuh, included only in those kernels).
template <class K>
struct MlaAlternate;
// The pieces of a tile step that MlaDecode's loop and MlaAlternate's share (mla_decode/tiles.cuh).
template <class K>
struct MlaTiles;
// One tile's S, softmax and O += P V (mla_decode/consumer.cuh).
template <class K>
struct MlaConsumer;
// The split's tiles, each acquired and consumed (mla_decode/walk.cuh).
template <class K>
struct MlaWalk;
// Q and the ring's tiles in (mla_decode/producer.cuh).
template <class K>
struct MlaProducer;
// Row sums, O and the LSE written or merged (mla_decode/epilogue.cuh).
template <class K>
struct MlaEpilogue;
// An fp8 cache's Q, tiles and MMAs (mla_decode/fp8.cuh, included only in those kernels).
template <class K>
struct MlaFp8;
// An fp8 cache widened in shared memory for the wgmma consumers (mla_decode/fp8_wgmma.cuh, only in those kernels).
template <class K>
struct MlaFp8Wgmma;
// Paged blocks of any size gathered into the TMA ring by a producer warpgroup (mla_decode/gather.cuh, page_rows only).
template <class K>
struct MlaGather;

template <class T, bool BF16, int DC, int DR, int ROWS, int BLOCK_N, int NUM_WARPS, int NUM_STAGES, bool QK_SHARD,
          bool PAGED, bool WGMMA, bool TMA, bool ALT, int KV_FP8 = 0, bool PAGE_ROWS = false, bool BOX_LANES = false>
struct MlaDecode {
  using Elem = T;
  static constexpr bool IS_BF16 = BF16;
  static constexpr int DC_ = DC, DR_ = DR, ROWS_ = ROWS, BLOCK_N_ = BLOCK_N;
  static constexpr bool PAGED_ = PAGED, TMA_ = TMA, ALT_ = ALT, QK_SHARD_ = QK_SHARD, WGMMA_ = WGMMA;
  static constexpr int NUM_STAGES_ = NUM_STAGES;
  // PAGE_ROWS (spec page_rows): paged blocks of any size, a table entry looked up for every key row (pages_of; on the
  // TMA ring, GATHER: a producer warpgroup's gather, mla_decode/gather.cuh)
  static constexpr bool PAGE_ROWS_ = PAGE_ROWS;
  static constexpr bool GATHER = PAGE_ROWS && TMA;
  static_assert(!PAGE_ROWS || (PAGED && BLOCK_N <= 64 && !(KV_FP8 && TMA)), "page_rows: a paged cache");
  // BOX_LANES (spec box_lanes): paged blocks smaller than a tile on the TMA ring (16-bit cache), each tile's boxes
  // issued by a warp's lanes (MlaTiles::tma_tile_lanes)
  static constexpr bool BOX_LANES_ = BOX_LANES;
  static_assert(!BOX_LANES || (PAGED && TMA && !PAGE_ROWS && !KV_FP8), "box_lanes: a paged 16-bit cache's boxes");
  // Paged, cp.async: a tile's table entries as its loads take them (MlaTiles::load_cols): a 16-row group's block and
  // first slot in lane j, or (PAGE_ROWS) rows j and j + 32's blocks and slots in lane j.
  using Pages = typename Select<PAGE_ROWS, int4, int2>::type;
  // KV_FP8: 0, or the cache's fp8 format (1: e4m3, 2: e5m2), its rows FP8_ROW_BYTES apart in the ring
  // (mla_decode/fp8.cuh)
  static constexpr int KV_FP8_ = KV_FP8;
  static constexpr bool FP8 = KV_FP8 != 0;
  // fp8 on the wgmma kernel: a producer warpgroup past the NUM_WARPS consumer warps loads and widens the tiles; GATHER:
  // one gathers them
  static constexpr bool PRODUCER_WG = (FP8 && WGMMA) || GATHER;
  // The MMAs' 16-bit type: q's, but fp16 on the fp8 wgmma kernel, whose widening of the cache is then one convert a
  // pair and whose Q is carried into fp16 by a power of two (MlaFp8::run, MlaFp8Wgmma::start); O is written in T.
  static constexpr bool MMA_BF16 = BF16 && !(FP8 && WGMMA);
  static constexpr int PRODUCER_THREADS = PRODUCER_WG ? 128 : 0;
  using Fp8 = MlaFp8<MlaDecode>;
  using Fp8Wgmma = MlaFp8Wgmma<MlaDecode>;
  using ProducerWg = typename Select<FP8, Fp8Wgmma, MlaGather<MlaDecode>>::type;  // (PRODUCER_WG)
  using Tiles = MlaTiles<MlaDecode>;  // its tile pieces (mla_decode/tiles.cuh)
  using Producer = MlaProducer<MlaDecode>;
  using Consumer = MlaConsumer<MlaDecode>;
  using Walk = MlaWalk<MlaDecode>;
  using Epilogue = MlaEpilogue<MlaDecode>;
  static constexpr int THREADS = NUM_WARPS * 32;
  static constexpr int WARPS_M = ROWS / 16;
  static constexpr int WARPS_N = NUM_WARPS / WARPS_M;
  static constexpr int DQK = DC + DR;
  static constexpr int ROW = DQK + 8;      // padded row of Q and of a cache tile (elements)
  static constexpr int FP8_ROW_BYTES = (DQK / 16 | 1) * 16;  // an fp8 tile's row: an odd number of 16-byte chunks
  static constexpr int P_ROW = BLOCK_N + 8;
  static constexpr int ON = DC / WARPS_N;  // output columns per warp
  static constexpr int SN = QK_SHARD ? BLOCK_N / WARPS_N : BLOCK_N;  // keys of S per warp
  // wgmma: 64-column blocks, the last one whole even where the row ends inside it (rope 32). The TMA
  // ring's tiles are such blocks too (its boxes write them, 128-byte swizzled), also under mma.sync,
  // whose Q and P keep padded rows (Q then padded to a whole 1024-byte atom, so the ring starts on one).
  static constexpr int BLOCK_COLS = (DQK + 63) / 64 * 64;
  static constexpr bool SWIZZLED_TILES = WGMMA || TMA;
  using LQ = typename Select<WGMMA, WgmmaLayout<BLOCK_COLS, ROWS>, SmemLayout<DQK, ROW, false>>::type;
  using LT = typename Select<SWIZZLED_TILES, WgmmaLayout<BLOCK_COLS, BLOCK_N>, SmemLayout<DQK, ROW, false>>::type;
  using LP = typename Select<WGMMA, WgmmaLayout<64, ROWS>, SmemLayout<BLOCK_N, P_ROW, false>>::type;
  static constexpr int Q_ELEMS = WGMMA ? ROWS * BLOCK_COLS : TMA ? (ROWS * ROW + 511) / 512 * 512 : ROWS * ROW;
  static constexpr int TILE_ELEMS =
      SWIZZLED_TILES ? BLOCK_N * BLOCK_COLS : FP8 ? BLOCK_N * FP8_ROW_BYTES / 2 : BLOCK_N * ROW;
  static constexpr int P_ELEMS = !(QK_SHARD || ALT) ? 0 : WGMMA ? ROWS * 64 : ROWS * P_ROW;
  static constexpr int ALIGN_SLACK = SWIZZLED_TILES ? 1024 : 0;  // swizzle atoms start 1024-byte aligned
  static_assert(WARPS_M * WARPS_N == NUM_WARPS, "warp grid");
  static_assert(!WGMMA || (ROWS == 64 && NUM_WARPS == 8 && SN >= 16 && BLOCK_N <= 64), "wgmma shape");
  static_assert(!ALT || (TMA && !QK_SHARD && BLOCK_N == 64 && NUM_STAGES == 2 && DR <= 64), "alternate tiles");
  static_assert(!FP8 || WGMMA == TMA, "fp8 tiles: mma.sync on the cp.async ring, or wgmma on the TMA ring");
  // mbarriers: a slot's, each half's (ALT), a slot's three (fp8 on wgmma: landed, widened, read), two (GATHER:
  // full, read), or four (ALT and GATHER: each half's full and free)
  static constexpr int BARS = TMA ? NUM_STAGES * (ALT && GATHER ? 4 : ALT || GATHER ? 2 : PRODUCER_WG ? 3 : 1) : 0;
  static_assert(SN % 8 == 0 && BLOCK_N % 16 == 0 && ON % 16 == 0 && DQK % 32 == 0, "tile shape");
  static_assert(DC % 8 == 0 && DR % 8 == 0 && THREADS % (DC / 8) == 0 && THREADS % (DR / 8) == 0, "copies");

  // Shared memory: Q, the ring, P (QK_SHARD; ALT: one warpgroup's P), WARPS_N x ROWS floats for the row
  // exchange, (ALT) 4 x ROWS floats of row maxima and rescale factors, then the mbarriers.
  static constexpr int SMEM_BYTES =
      2 * (Q_ELEMS + NUM_STAGES * TILE_ELEMS + P_ELEMS) + 4 * WARPS_N * ROWS + (ALT ? 16 * ROWS : 0) + ALIGN_SLACK + 8 * BARS;
  // The splits of a row block as one cluster (sm_90, o_part null; mma.sync, or wgmma with the spec's
  // cluster_merge): after the loop each CTA leaves its normalised fp32 rows and their LSE over its Q and ring (16
  // rows: [ROWS][DC], for cluster_merge_rows) or pushes them over those of the CTA that merges them (32 rows or more,
  // PUSH_MERGE: at most ROWS + 7 rows of every split together, up to 8 splits). MlaDecodeSpec.cluster_merge_fits
  // counts the same. Compiled into every wgmma kernel, the path cost their other launches registers and time, so
  // only the cluster_merge kernel (ATTNGEN_MLA_CLUSTER_WGMMA) has it there.
  static constexpr bool PUSH_MERGE = ROWS >= 32;
#ifdef ATTNGEN_MLA_CLUSTER_WGMMA
  static constexpr bool CLUSTER_KERNEL = true;
#else
  static constexpr bool CLUSTER_KERNEL = !WGMMA;
#endif
  static constexpr bool CLUSTER_FITS = CLUSTER_KERNEL && !FP8 && !GATHER &&
      4 * (ROWS + (PUSH_MERGE ? 7 : 0)) * (DC + 1) <= 2 * (Q_ELEMS + NUM_STAGES * TILE_ELEMS);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000  // measured on sm_90 only
  static constexpr bool CAN_CLUSTER = CLUSTER_FITS;
#else
  static constexpr bool CAN_CLUSTER = false;
#endif

  // Packed query row gr's token and head (row r: token r / heads, head r % heads); one token (most decode steps)
  // needs no division.
  static __device__ __forceinline__ int2 token_head(const MlaParams<T>& p, int gr) {
    const int qi = p.q_len == 1 ? 0 : gr / p.num_heads;
    return make_int2(qi, gr - qi * p.num_heads);
  }

  // Where the consumer warps meet: the whole CTA, or (PRODUCER_WG) named barrier 1 of the consumers alone.
  static __device__ __forceinline__ void consumers_sync() {
    if constexpr (PRODUCER_WG)
      asm volatile("bar.sync 1, %0;\n" ::"n"(THREADS) : "memory");
    else
      __syncthreads();
  }

  // q_shift and o_scale: an fp8 cache's (MlaFp8::run): Q's power of two, O's factor.
  static __device__ __forceinline__ void run(const MlaParams<T>& p, const TmaDesc* maps = nullptr, int q_shift = 0,
                                             float o_scale = 1.f) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned char* smem_base = SWIZZLED_TILES ? aligned_smem<1024>(smem_raw) : smem_raw;
    T* sQ = reinterpret_cast<T*>(smem_base);
    T* sRing = sQ + Q_ELEMS;
    T* sP = sRing + NUM_STAGES * TILE_ELEMS;
    float* sRed = reinterpret_cast<float*>(sP + P_ELEMS);  // [WARPS_N][ROWS]
    float* sX = sRed + WARPS_N * ROWS;  // ALT: row maxima and rescale factors
    const unsigned bar0 = smem_addr(sX + (ALT ? 4 * ROWS : 0));  // TMA: mbarrier i at bar0 + 8 i

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int rt = warp % WARPS_M;  // row tile
    const int cg = warp / WARPS_M;  // column group
    const int row0 = rt * 16;
    const int key0 = QK_SHARD ? cg * SN : 0;

    const int split = blockIdx.x;
    const int rblock = blockIdx.y;
    const int batch = blockIdx.z;
    const int rows_total = p.q_len * p.num_heads;
    const int r_begin = rblock * ROWS;
    const int len = p.seqlens ? p.seqlens[batch] : p.seqlen_fixed;
    const int seqlen = min(max(len, 0), p.capacity);
    // The row's tiles dealt out in equal runs; late splits of a short row may get none.
    const int tiles = (seqlen + BLOCK_N - 1) / BLOCK_N;
    const int per = (tiles + p.num_splits - 1) / p.num_splits;
    const int tile_begin = min(tiles, split * per);
    const int n_tiles = min(tiles, tile_begin + per) - tile_begin;

    // The cache: paged, one pool of blocks and this row's block table; else this row's own rows.
    const T* ckv = PAGED ? p.ckv : p.ckv + batch * p.c_sb;
    const T* kpe = PAGED ? p.kpe : p.kpe + batch * p.p_sb;
    const int* table = PAGED ? p.block_table + batch * p.bt_sb : nullptr;

    // ---- Q: ROWS packed rows (rows past the last head of the last token are zeros) -----------------
    if constexpr (PRODUCER_WG) {
      // the producer warpgroup's whole part (its threads leave here); the consumers go on with Q in place
      if (ProducerWg::start(p, maps, sQ, sRing, bar0, table, batch, seqlen, r_begin, rows_total, tile_begin, n_tiles,
                            q_shift, tid))
        return;
    } else if constexpr (FP8) {
      Fp8::load_q(p, sQ, batch, r_begin, rows_total, q_shift, tid);
    } else {
      Producer::load_q(p, sQ, batch, r_begin, rows_total, tid);
    }

    // Paged, cp.async: the table entries of the tile load_tile fills next, read a tile ahead (producer.cuh).
    auto pages_of = [&](int tile) {
      if constexpr (PAGE_ROWS) {
        return Tiles::row_pages(p, table, seqlen, tile, lane);
      } else {
        const int gpos = tile * BLOCK_N + 16 * (lane % (BLOCK_N / 16));
        const int blk = Tiles::block_of(gpos, p);
        return make_int2(gpos < seqlen ? __ldg(table + blk) : 0, gpos - blk * p.block_size);
      }
    };
    Pages next_pages = Pages{};
    if constexpr (PAGED && !TMA) next_pages = pages_of(tile_begin);
    auto load_tile = [&](int tile, int slot) {
      T* dst = sRing + slot * TILE_ELEMS;
      const int n0 = tile * BLOCK_N;
      const Pages pages = next_pages;
      if constexpr (PAGED) next_pages = pages_of(tile + 1);
      if constexpr (FP8 && !WGMMA) {
        Fp8::load_tile(dst, p, batch, pages, n0, seqlen, tid);
      } else {
        Tiles::template load_cols<DC>(dst, 0, ckv, p.c_sb, p.c_ss, p, pages, n0, seqlen, tid);
        Tiles::template load_cols<DR>(dst, DC, kpe, p.p_sb, p.p_ss, p, pages, n0, seqlen, tid);
      }
    };
    if constexpr (!PRODUCER_WG)
      Producer::prologue(p, maps, sRing, bar0, table, batch, seqlen, tile_begin, n_tiles, tid, load_tile);

    int lim[2];
    Consumer::limits(p, r_begin + row0 + g, rows_total, seqlen, lim);

    float acc_o[ON / 8][4];
#pragma unroll
    for (int d = 0; d < ON / 8; ++d)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc_o[d][c] = 0.f;
    float row_max[2] = {-ATTNGEN_INF, -ATTNGEN_INF};
    float row_sum[2] = {0.f, 0.f};
    // A tile's S (acc_s2: its second chain) and its softmax's row maxima and factors (see consumer.cuh).
    float acc_s[SN / 8][4], acc_s2[SN / 8][4], mx[2], corr[2];

    if constexpr (ALT)
      MlaAlternate<MlaDecode>::run(p, maps, sQ, sRing, sP, sX, bar0, table, batch, seqlen, tile_begin, n_tiles, lim,
                                   acc_o, row_max, row_sum);
    else
      Walk::tiles(p, maps, sQ, sRing, sP, sRed, bar0, table, batch, seqlen, tile_begin, n_tiles, tid, lane, g, t, row0,
                  key0, cg, lim, load_tile, acc_s, acc_s2, mx, corr, acc_o, row_max, row_sum);
    if constexpr (FP8) Fp8::finish(acc_o, o_scale, lane, t);

    // ---- epilogue: row sums (across the column groups when sharded), normalise, write ---------------
    float l[2];
    Epilogue::row_sums(sRed, g, t, row0, cg, row_sum, l);
    const long long out_rows = (long long)p.batch * rows_total;
    const bool cl = CAN_CLUSTER && p.num_splits > 1 && p.o_part == nullptr;
    // The splits a cluster (cl): see epilogue.cuh.
    const int valid = min(ROWS, rows_total - r_begin);
    const int mrows = (valid + p.num_splits - 1) / p.num_splits;
    float* sPart = reinterpret_cast<float*>(smem_base);
    float* sLse = sPart + (PUSH_MERGE ? p.num_splits * mrows : ROWS) * DC;
    auto inv_of = [&](int r) { return l[r] > 0.f ? 1.f / l[r] : 0.f; };
    auto lse_of = [&](int r) { return l[r] > 0.f ? row_max[r] * p.sm_scale + logf(l[r]) : -ATTNGEN_INF; };
    // One split: O staged over Q (O_ROW: see Epilogue::store_rows), every warp past its last read of Q first (the
    // sharded and alternate forms' row sums met after the loop already).
    static_assert(ROWS * Epilogue::O_ROW <= Q_ELEMS, "O staged over Q");
    T* sO = sQ;
    if (!(QK_SHARD || ALT) && p.num_splits == 1) consumers_sync();
    if (cl && !PUSH_MERGE) __syncthreads();  // every warp is past its last read of Q and the ring
    if (cl && PUSH_MERGE) {
      cluster_sync();  // every CTA of the cluster is past its last read of Q and the ring
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + g + 8 * r;
        const int owner = row / mrows;
        if (row >= valid || owner == split) continue;
        const int at = split * mrows + row - owner * mrows;
        const unsigned dst = cluster_map(smem_addr(sPart + at * DC + cg * ON + 2 * t), owner);
        const float inv = inv_of(r);
#pragma unroll
        for (int d = 0; d < ON / 8; ++d)
          cluster_store_f2(dst + 32 * d, make_float2(acc_o[d][2 * r] * inv, acc_o[d][2 * r + 1] * inv));
        if (cg == 0 && t == 0) cluster_store_f32(cluster_map(smem_addr(sLse + at), owner), lse_of(r));
      }
      cluster_sync();  // the rows pushed
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = row0 + g + 8 * r;
      const int gr = r_begin + row;
      if (gr >= rows_total) continue;
      const int qi = gr / p.num_heads;
      const int head = gr - qi * p.num_heads;
      float inv = inv_of(r);
      float lse = lse_of(r);
      if (cl && PUSH_MERGE) {
        if (row / mrows != split) continue;  // its owner writes it
        merge_pushed_row<DC>(acc_o, r, inv, lse, sPart, sLse, split, p.num_splits, mrows, row - split * mrows,
                             cg * ON + 2 * t);
      }
      if (p.num_splits == 1 || (cl && PUSH_MERGE)) {
        T* dst = p.num_splits == 1 ? sO + row * Epilogue::O_ROW + cg * ON + 2 * t
                                   : p.o + batch * p.o_sb + qi * p.o_ss + head * p.o_sh + cg * ON + 2 * t;
#pragma unroll
        for (int d = 0; d < ON / 8; ++d)
          *reinterpret_cast<unsigned*>(dst + d * 8) = pack2<BF16>(acc_o[d][2 * r] * inv, acc_o[d][2 * r + 1] * inv);
        if (p.lse && cg == 0 && t == 0) p.lse[((long long)batch * p.num_heads + head) * p.q_len + qi] = lse;
      } else if (cl) {
        float* dst = sPart + row * DC + cg * ON + 2 * t;
#pragma unroll
        for (int d = 0; d < ON / 8; ++d)
          *reinterpret_cast<float2*>(dst + d * 8) = make_float2(acc_o[d][2 * r] * inv, acc_o[d][2 * r + 1] * inv);
        if (cg == 0 && t == 0) sLse[row] = lse;
      } else {
        // Row (batch, qi, head) of split `split`, in the merge's layout.
        const long long orow = ((long long)batch * p.q_len + qi) * p.num_heads + head;
        float* dst = p.o_part + ((long long)split * out_rows + orow) * DC + cg * ON + 2 * t;
#pragma unroll
        for (int d = 0; d < ON / 8; ++d)
          *reinterpret_cast<float2*>(dst + d * 8) = make_float2(acc_o[d][2 * r] * inv, acc_o[d][2 * r + 1] * inv);
        if (cg == 0 && t == 0)
          p.lse_part[(long long)split * out_rows + ((long long)batch * p.num_heads + head) * p.q_len + qi] = lse;
      }
    }
    if (p.num_splits == 1) {
      consumers_sync();  // the rows staged
      Epilogue::store_rows(p, sO, batch, r_begin, rows_total, tid);
    }
    if (cl && !PUSH_MERGE) Epilogue::cluster_rows(p, sPart, sLse, valid, split, batch, r_begin, tid);
  }
};

}  // namespace attngen
