// The consumer side of a decode CTA, per warp: S = Q K^T over its slice of a tile's keys (capped, biased and
// masked where the spec asks), the online softmax of S, and O += P V.
namespace attngen {

template <class S>
struct DecodeConsumer {
  using T = typename S::T;
  using L = typename S::L;
  using Cta = typename S::Cta;
  using Lane = typename S::Lane;
  using V = typename S::V;  // the logits transforms (common/variant.cuh)
  static constexpr bool BF16 = S::BF16, Q_IN_REGS = S::Q_IN_REGS;
  static constexpr bool LOCAL = S::LOCAL, TREE = S::TREE;
  static constexpr int M_TILES = S::M_TILES, KW = S::KW, KW_TILES = S::KW_TILES, K_STEPS = S::K_STEPS;
  static constexpr int D_TILES = S::D_TILES, D_OUT = S::D_OUT, D_PARTS = S::D_PARTS;
  // Q's MMA fragments, kept in registers across the tiles (Q_IN_REGS), else read from shared memory each tile.
  using QFrag = unsigned[Q_IN_REGS ? M_TILES : 1][Q_IN_REGS ? K_STEPS : 1][4];
  // TREE: the tree-mask word of each of this thread's rows' token, read once (tree_words).
  using TreeWords = unsigned long long[TREE ? M_TILES : 1][2];

  // Accumulators (a tile's S, a split's O) start at zero.
  template <int A, int B>
  static __device__ __forceinline__ void zero(float (&acc)[A][B][4]) {
#pragma unroll
    for (int i = 0; i < A; ++i)
#pragma unroll
      for (int j = 0; j < B; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
  }

  // Each row's running max and sum start at -inf and 0 (no key seen).
  static __device__ __forceinline__ void start_rows(float (&row_max)[M_TILES][2], float (&row_sum)[M_TILES][2]) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
      row_max[mt][0] = row_max[mt][1] = -ATTNGEN_INF;
      row_sum[mt][0] = row_sum[mt][1] = 0.f;
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
        const int row = l.row(mt, r);
        lim[mt][r] = row < c.rows_valid ? c.seqlen - S::q_len_of(p, c) + row / p.group : c.seqlen - 1;
      }
  }

  // TREE: each of this thread's rows' token's word of tree_mask (0 for rows past the packed ones).
  static __device__ __forceinline__ void tree_words(TreeWords& tw, const DecodeParams<T>& p, const Cta& c,
                                                    const Lane& l) {
    if constexpr (TREE) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = l.row(mt, r);
          tw[mt][r] = row < c.rows_valid ? (unsigned long long)p.tree_mask[S::q0_of(p, c) + row / p.group] : 0ull;
        }
    }
  }

  // Some key of this warp's slice of the tile lies past the first token's last key (LOCAL: or before
  // the last token's first).
  // TREE: some key lies in the draft block (a token may not see even its own).
  static __device__ __forceinline__ bool needs_mask(const DecodeParams<T>& p, const Cta& c, int n0, const Lane& l) {
    if constexpr (TREE) {
      return n0 + l.key0 + KW - 1 >= c.seqlen - S::q_len_of(p, c);
    } else if constexpr (LOCAL) {
      const int pos0 = c.seqlen - S::q_len_of(p, c);
      return n0 + l.key0 + KW - 1 > min(pos0 + p.window_right, c.seqlen - 1) ||
             n0 + l.key0 < max(c.pad, pos0 + S::q_len_of(p, c) - 1 - p.window_left);
    } else {
      return n0 + l.key0 + KW - 1 > c.seqlen - S::q_len_of(p, c);
    }
  }

  // LOCAL: the first and last key (relative to col0) the token at position `pos` sees.
  static __device__ __forceinline__ void key_bounds(int& lo, int& hi, int pos, int col0, const DecodeParams<T>& p,
                                                    const Cta& c) {
    lo = max(c.pad, pos - p.window_left) - col0;
    hi = min(pos + p.window_right, c.seqlen - 1) - col0;
  }

  // Q's fragment of 16-row tile mt over head-dim step kk (columns [16 kk, + 16)), from shared memory.
  static __device__ __forceinline__ void q_fragment(unsigned (&a)[4], const T* sQ, int mt, int kk, const Lane& l) {
    ldmatrix_x4(a[0], a[1], a[2], a[3],
                smem_addr(sQ + L::offset(l.row0 + mt * 16 + (l.lane % 16), kk * 16 + (l.lane / 16) * 8)));
  }

  static __device__ __forceinline__ void load_q_frags(QFrag& q_frag, const T* sQ, const Lane& l) {
    if constexpr (Q_IN_REGS) {
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int kk = 0; kk < K_STEPS; ++kk) q_fragment(q_frag[mt][kk], sQ, mt, kk, l);
    }
  }

  // S = Q K^T over this warp's KW keys of the tile in sKs, capped and ALiBi-biased where the spec
  // asks, masked to each row's limit.
  static __device__ __forceinline__ void scores(float (&acc_s)[M_TILES][KW_TILES][4],
                                                const QFrag& q_frag,
                                                const T* sQ, const T* sKs, const int (&lim)[M_TILES][2], bool mask,
                                                int n0, const DecodeParams<T>& p, const Cta& c, const Lane& l,
                                                const TreeWords* tw = nullptr) {
    zero(acc_s);
#pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
      unsigned a[M_TILES][4];
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt) {
        if constexpr (Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = q_frag[mt][kk][e];
        } else {
          q_fragment(a[mt], sQ, mt, kk, l);
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
    if constexpr (V::LOGITS) {
      const int col0 = n0 + l.key0 + 2 * l.t;
#pragma unroll
      for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          // The packed row's query head and position (lim: the last key it sees, its own); its state (ALiBi: the
          // head's slope).
          const int row = l.row(mt, r);
          const int head = c.kv_head * p.group + row % p.group;
          const typename V::State vstate = V::state(p, c.batch, head);
#pragma unroll
          for (int n = 0; n < KW_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e)
              acc_s[mt][n][2 * r + e] =
                  V::logits(p, vstate, acc_s[mt][n][2 * r + e], Pair(c.batch, head, lim[mt][r], col0 + n * 8 + e));
        }
    }
#ifdef ATTNGEN_MODS
    user_mods(acc_s, n0, p, c, l);
#endif
    if constexpr (TREE) {
      if (mask) mask_tree(acc_s, *tw, n0, p, c, l);
    } else {
      if (mask) mask_scores(acc_s, lim, n0, p, c, l);
    }
  }

  // TREE: a key before the draft block is seen by every token; a key of the block (draft token j) by the tokens
  // whose word has bit j; none past it. Over this warp's KW keys of the tile.
  static __device__ __forceinline__ void mask_tree(float (&acc_s)[M_TILES][KW_TILES][4], const TreeWords& tw, int n0,
                                                   const DecodeParams<T>& p, const Cta& c, const Lane& l) {
    const int q_len = S::q_len_of(p, c);
    const int rel0 = n0 + l.key0 + 2 * l.t - (c.seqlen - q_len);  // this thread's first key, from the block's start
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int n = 0; n < KW_TILES; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = rel0 + n * 8 + e;
            if (j >= 0 && (j >= q_len || !((tw[mt][r] >> j) & 1ull))) acc_s[mt][n][2 * r + e] = -ATTNGEN_INF;
          }
  }

  // Scores past each row's last key (LOCAL: outside its bounds) to -inf, over this warp's KW keys of the tile
  // (the fp8 kernel's consumer, decode/fp8_consumer.cuh, masks its scores here too).
  static __device__ __forceinline__ void mask_scores(float (&acc_s)[M_TILES][KW_TILES][4], const int (&lim)[M_TILES][2],
                                                     int n0, const DecodeParams<T>& p, const Cta& c, const Lane& l) {
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

#ifdef ATTNGEN_MODS
  // A user's mask_mod and score_mod (the UserMods variant: spec mask_mod, score_mod), after softcap and ALiBi and
  // before the key bounds: on the packed rows that exist, the keys before the row's length and positions >= 0 only,
  // so that a snippet's aux reads stay in bounds (a token placed before position 0, in a row shorter than q_len:
  // mask_mod drops its keys, score_mod leaves them). b is the batch row, h the query head, q_idx the token's position
  // (seqlen - q_len + its index), kv_idx the key's cache position; score_mod sees the logit (times sm_scale), the
  // scores stay in q.k units.
  static __device__ __forceinline__ void user_mods(float (&acc_s)[M_TILES][KW_TILES][4], int n0,
                                                   const DecodeParams<T>& p, const Cta& c, const Lane& l) {
    const int col0 = n0 + l.key0 + 2 * l.t;
    const UserMods::State mod_st = UserMods::state(p, c.batch, 0);
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = l.row(mt, r);
        if (row >= c.rows_valid) continue;
        const int head = c.kv_head * p.group + row % p.group;
        const int pos = c.seqlen - S::q_len_of(p, c) + row / p.group;
#pragma unroll
        for (int n = 0; n < KW_TILES; ++n)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int j = col0 + n * 8 + e;
            if (j >= c.seqlen) continue;
            float& s = acc_s[mt][n][2 * r + e];
#ifdef ATTNGEN_MASK_MOD
            if (pos < 0 || !UserMods::keep(p, mod_st, Pair(c.batch, head, pos, j))) {
              s = -ATTNGEN_INF;
              continue;
            }
#endif
#ifdef ATTNGEN_SCORE_MOD
            if (pos >= 0) s = UserMods::logits(p, mod_st, s, Pair(c.batch, head, pos, j));
#endif
          }
      }
  }
#endif

  // The scores of one K tile for fused and unfused_qk: Q's fragments come from shared memory on
  // the CTA's first tile (it == 0), masking only where some key of the warp's slice needs it.
  static __device__ __forceinline__ void tile_scores(float (&acc_s)[M_TILES][KW_TILES][4], QFrag& q_frag, const T* sQ,
                                                     const T* sKs, const int (&lim)[M_TILES][2], int it, int n0,
                                                     const DecodeParams<T>& p, const Cta& c, const Lane& l,
                                                     const TreeWords* tw = nullptr) {
    if (it == 0) load_q_frags(q_frag, sQ, l);
    scores(acc_s, q_frag, sQ, sKs, lim, needs_mask(p, c, n0, l), n0, p, c, l, tw);
  }

  // Online softmax of one tile's scores (softmax_row, common/online_softmax.cuh): updates max and sum, turns acc_s
  // into probabilities and returns through corr the factor older accumulations must be scaled by.
  static __device__ __forceinline__ void softmax_step(float (&acc_s)[M_TILES][KW_TILES][4],
                                                      float (&row_max)[M_TILES][2], float (&row_sum)[M_TILES][2],
                                                      float (&corr)[M_TILES][2], float scale_log2) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        softmax_row<KW>(acc_s[mt], r, row_max[mt][r], row_sum[mt][r], corr[mt][r], scale_log2);
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
};

}  // namespace attngen
