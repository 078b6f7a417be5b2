// Decode against a KV cache: q_len (1..8; a packed, ragged q: up to 64) new tokens per sequence, every query head of one KV
// head packed into the rows of one CTA (row r = token (r / group), head (r % group) of the
// group), so each K/V byte is read once per split of the sequence.
//
// A CTA (its shape: DecodeShape, decode/params.cuh) takes its split's run of BLOCK_N-key tiles through a
// NUM_STAGES-deep cp.async ring (DecodeProducer, decode/producer.cuh). Each warp computes S, its online
// softmax and P V over its slice of a tile's keys (DecodeConsumer, decode/consumer.cuh); at the end
// (DecodeEnd, decode/end.cuh) the WARPS_N partial results of a row are merged in shared memory. With one
// split the CTA writes the output; with several it writes fp32 partial outputs and their LSE, and the
// `_merge` entry combines them (or, in a cluster, the CTAs of a row do). The unfused variant
// (decode/unfused.cuh) runs QK^T + per-row max/sum (`unfused_qk`, K only) and then P V (`unfused_pv`, V and
// the stored scores) as two kernels with the same grid.
namespace attngen {

template <class S>
struct Decode {
  using T = typename S::T;
  using Cta = typename S::Cta;
  using Lane = typename S::Lane;
  using Load = DecodeProducer<S>;
  using Math = DecodeConsumer<S>;
  static constexpr int M_TILES = S::M_TILES, D_TILES = S::D_TILES, KW_TILES = S::KW_TILES;
  static constexpr int BLOCK_N = S::BLOCK_N, NUM_STAGES = S::NUM_STAGES, TILE_ELEMS = S::TILE_ELEMS, Q_ELEMS = S::Q_ELEMS;

  // S, softmax and P V per tile.
  static __device__ __forceinline__ void fused(const DecodeParams<T>& p) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sK = sQ + Q_ELEMS;
    T* sV = sK + NUM_STAGES * TILE_ELEMS;
    const Cta c = S::cta_of(p);
    if constexpr (S::VARLEN) {
      if (c.rows_valid == 0) return;  // a request with no token or more than the rows take: nothing written
    }
    const Lane l = S::lane_of();

    typename Load::Pages pg;
    Load::lookup(pg, p, c, c.tile_begin, l.tid);
    Load::load_q(sQ, p, c, l.tid);
    Load::zero_pads(sQ, sK, l.tid);
    const auto load = [&](int tile, int slot) {
      Load::template load_rows<true, true>(sK + slot * TILE_ELEMS, sV + slot * TILE_ELEMS, p, c, pg, tile, l.tid);
      Load::lookup(pg, p, c, tile + 1, l.tid);
    };
    Load::ring_fill(c, load);
    float acc_o[M_TILES][D_TILES][4];
    float row_max[M_TILES][2], row_sum[M_TILES][2];
    Math::zero(acc_o);
    Math::start_rows(row_max, row_sum);
    int lim[M_TILES][2];
    Math::row_limits(lim, p, c, l);
    typename Math::TreeWords tw;
    Math::tree_words(tw, p, c, l);
    typename Math::QFrag q_frag;

    Load::ring(
        c, load,
        [&](int tile, int it, int slot) {
          const int n0 = tile * BLOCK_N;
          float acc_s[M_TILES][KW_TILES][4];
          Math::tile_scores(acc_s, q_frag, sQ, sK + slot * TILE_ELEMS, lim, it, n0, p, c, l, &tw);
          float corr[M_TILES][2];
          Math::softmax_step(acc_s, row_max, row_sum, corr, p.scale_log2);
          scale_rows(acc_o, corr);
          Math::accumulate_pv(acc_o, acc_s, sV + slot * TILE_ELEMS, l);
        });
    DecodeEnd<S>::epilogue(p, c, smem_raw, acc_o, row_max, row_sum, l);
  }
};

}  // namespace attngen
