// MLA decode, the tile walk: the split's run of BLOCK_N-key tiles in order (every form but alternate tiles, whose
// loop is MlaAlternate::run), each acquired from the ring by the producer (mla_decode/producer.cuh; an fp8 cache on
// the wgmma kernel: waited for once its producer warpgroup has widened it, and handed back once read,
// mla_decode/fp8_wgmma.cuh) and consumed: S, the mask, the online softmax and O += P V (mla_decode/consumer.cuh; S and
// P V over fp8 tiles in registers: mla_decode/fp8.cuh).
namespace attngen {

template <class K>
struct MlaWalk {
  using T = typename K::Elem;
  using Tiles = MlaTiles<K>;
  using Producer = MlaProducer<K>;
  using Consumer = MlaConsumer<K>;
  static constexpr int BLOCK_N = K::BLOCK_N_, NUM_STAGES = K::NUM_STAGES_, TILE_ELEMS = K::TILE_ELEMS;
  static constexpr int SN = K::SN, ON = K::ON;
  // fp8 tiles read in registers (the mma.sync kernel); the wgmma kernel's are widened in shared memory first
  static constexpr bool REG_FP8 = K::FP8 && !K::PRODUCER_WG;

  // acc_s, acc_s2, mx and corr: a tile's scratch, run's arrays (see consumer.cuh); acc_o, row_max and row_sum
  // carried from tile to tile.
  template <class LoadTile>
  static __device__ __forceinline__ void tiles(const MlaParams<T>& p, const TmaDesc* maps, const T* sQ, T* sRing, T* sP,
                                               float* sRed, unsigned bar0, const int* table, int batch, int seqlen,
                                               int tile_begin, int n_tiles, int tid, int lane, int g, int t, int row0,
                                               int key0, int cg, const int (&lim)[2], LoadTile& load_tile,
                                               float (&acc_s)[SN / 8][4], float (&acc_s2)[SN / 8][4], float (&mx)[2],
                                               float (&corr)[2], float (&acc_o)[ON / 8][4], float (&row_max)[2],
                                               float (&row_sum)[2]) {
    // BOX_LANES: warp 0's table entries of the next refill's boxes (Producer::acquire)
    int next_entry = 0;
    if constexpr (K::BOX_LANES_) next_entry = Producer::first_entry(p, table, seqlen, tile_begin, tid);
    for (int it = 0; it < n_tiles; ++it) {
      const int tile = tile_begin + it;
      const int n0 = tile * BLOCK_N;
      const int slot = it % NUM_STAGES;
      if constexpr (K::PRODUCER_WG)
        K::ProducerWg::acquire(bar0, it, slot);
      else
        Producer::acquire(p, maps, sRing, bar0, table, batch, seqlen, n_tiles, tid, it, tile, n0, slot, load_tile,
                          next_entry);
      const T* sT = sRing + slot * TILE_ELEMS;

      // ---- S = Q K^T for this warp's 16 rows and SN keys ---------------------------------------------
      if constexpr (REG_FP8)
        K::Fp8::scores(sQ, sT, row0, key0, lane, acc_s, acc_s2);
      else
        Consumer::scores(sQ, sT, row0, key0, lane, acc_s, acc_s2);

      // ---- mask: keys past a row's token (and past the sequence) --------------------------------
      Tiles::template mask_keys<SN>(acc_s, n0, key0, seqlen, p.q_len, lim, t);

      // ---- online softmax ------------------------------------------------------------------------
      Consumer::softmax(p, sRed, row0, cg, g, t, acc_s, mx, corr, acc_o, row_max, row_sum);

      // ---- O += P V over the tile's keys and this warp's ON columns of ckv -------------------------
      if constexpr (REG_FP8)
        K::Fp8::pv(sP, sT, row0, key0, cg, g, t, lane, acc_s, acc_o);
      else
        Consumer::pv(sP, sT, row0, key0, cg, g, t, lane, acc_s, acc_o);
      if constexpr (K::PRODUCER_WG) K::ProducerWg::release(bar0, slot);  // pv waited for its wgmma: the slot is read
      // sRed and sP are written again only after the next tile's first barrier.
    }
  }
};

}  // namespace attngen
