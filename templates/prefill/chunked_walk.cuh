// The chunked kernel's tile walk: where a thread stands (ChunkedCta: its warp's rows and columns; the CTA's query
// tile, head, V split and run of KV tiles, and where its Q, K and V start) and the shared memory's carve-up
// (ChunkedSmem). One query tile a CTA (a varlen batch's from the work list); the loop over its KV tiles is
// prefill_chunked's.
namespace attngen {

template <class K>
struct ChunkedSmem {
  using T = typename K::T;
  unsigned char* raw;  // the dynamic shared memory's start (QK_PAIR: the base of the other CTA's window)
  T* ring;
  T* q;  // (TMA)
  T* p;
  float* red;  // [WARPS_N][BLOCK_M]
  // QK_PAIR: two slots of the other CTA's partial S, each [SN / 8][THREADS] float4s (a thread's fragment),
  // and a barrier a slot whose phase completes when the other CTA's fragments have landed in it
  float4* x;
  unsigned long long* xbar;
  // TMA: per ring slot a full barrier (the producer's arrival with the slot's bytes) and an empty one (each
  // consumer warp's arrival once the wgmma that read the slot has completed), after the exchange's
  unsigned tbars;

  __device__ __forceinline__ explicit ChunkedSmem(unsigned char* raw_) : raw(raw_) {
    // wgmma's swizzle atoms start 1024-byte aligned (smem_bytes() reserves the slack).
    ring = reinterpret_cast<T*>(K::WGMMA ? aligned_smem<1024>(raw) : raw);
    q = ring + K::NUM_STAGES * K::STAGE_ELEMS;
    p = q + K::Q_ELEMS;
    red = reinterpret_cast<float*>(p + K::P_ELEMS);
    x = reinterpret_cast<float4*>(red + K::WARPS_N * K::BLOCK_M);
    xbar = reinterpret_cast<unsigned long long*>(x + (K::QK_PAIR ? 2 * (K::SN / 8) * K::THREADS : 0));
    tbars = smem_addr(xbar + (K::QK_PAIR ? 2 : 0));
  }
  __device__ __forceinline__ unsigned full_bar(int s) const { return tbars + 8u * s; }
  __device__ __forceinline__ unsigned empty_bar(int s) const { return tbars + 8u * (K::NUM_STAGES + s); }
  __device__ __forceinline__ unsigned q_bar() const { return tbars + 16u * K::NUM_STAGES; }  // Q's tile landed
};

template <class K>
struct ChunkedCta {
  using T = typename K::T;
  // The thread's place: warp (rg, cg) of the warp grid (wgmma: cg is the warpgroup).
  int tid, warp, lane, g, t;
  int rg;  // row group: rows [16 MT rg, 16 MT (rg + 1))
  int cg;  // column group (wgmma: the warpgroup)
  // The CTA's work (start)
  int m_block, head, batch, seqlen_q, seqlen_k;
  long long q_row0 = 0, k_row0 = 0;  // VARLEN: the sequence's first row in q / k
  int vs = 0;                        // V_SPLITS: this CTA's slice of V's columns
  int kv_head, m0, m_last;
  KeyRange keys;
  int tile_begin, n_tiles;
  typename K::V::State vstate;  // the logits transforms' (ALiBi: the head's slope)
  const T* gQ;
  const T* gK;
  const T* gV;
  // The consumer warp's rows (consumer_rows)
  int row0;  // this warp's first row in the tile
  int warp_lo, warp_hi;

  __device__ __forceinline__ ChunkedCta() {
    tid = threadIdx.x;
    warp = tid / 32;
    lane = tid % 32;
    g = lane / 4;
    t = lane % 4;
    rg = K::WGMMA ? warp % 4 : warp / K::WARPS_N;
    cg = K::WGMMA ? warp / 4 : warp % K::WARPS_N;
  }

  // The CTA's query tile, head and run of KV tiles, and where its Q, K and V start (the caller has asked
  // past_work first).
  __device__ __forceinline__ void start(const PrefillParams<T>& p) {
    cta_tile<K::VARLEN, false>(p, m_block, head, batch, seqlen_q, seqlen_k, q_row0, k_row0);
    // V_SPLITS: the grid's y runs over heads x splits; split vs computes V's (and O's) columns
    // [vs DV, (vs + 1) DV) and repeats the QK work (the splits of a head run side by side: K shared in L2).
    if constexpr (K::V_SPLITS > 1) {
      vs = head % K::V_SPLITS;
      head /= K::V_SPLITS;
    }
    kv_head = head / p.group;
    m0 = m_block * K::BLOCK_M;
    m_last = min(m0 + K::BLOCK_M, seqlen_q) - 1;

    keys = key_range<K::MASK>(seqlen_q, seqlen_k, p);
    const KeyRange::Span span = keys.tiles<K::BLOCK_N>(m0, m_last);
    tile_begin = span.first;
    n_tiles = span.count;

    vstate = K::V::state(p, batch, head);
    // (QK_PAIR: this CTA's half of the QK columns, vs being its rank in the cluster)
    gQ = p.q + (K::VARLEN ? 0 : batch * p.q_sb) + head * p.q_sh + (q_row0 + m0) * p.q_ss +
         (K::QK_PAIR ? vs * K::QK_COLS : 0);
    if constexpr (K::VARLEN) q_row0 = 0;  // dead until the epilogue reads it again
    gK = p.k + (K::VARLEN ? 0 : batch * p.k_sb) + kv_head * p.k_sh + k_row0 * p.k_ss +
         (K::QK_PAIR ? vs * K::QK_COLS : 0);
    gV = p.v + (K::VARLEN ? 0 : batch * p.v_sb) + kv_head * p.v_sh + k_row0 * p.v_ss + vs * K::DV;
  }

  __device__ __forceinline__ void consumer_rows() {
    row0 = rg * 16 * K::MT;
    warp_lo = m0 + row0;
    warp_hi = max(warp_lo, min(warp_lo + 16 * K::MT, seqlen_q) - 1);
  }

  // The computing warps meet (TMA: a named barrier, the producer warpgroup having left).
  __device__ __forceinline__ static void consumers_sync() {
    if constexpr (K::TMA)
      WgmmaOps<K::BF16>::bar_sync(1, K::THREADS);
    else
      __syncthreads();
  }
};

}  // namespace attngen
