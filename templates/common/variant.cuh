// Attention variants: one mechanism for every effect on the scores (docs/variants.md). A variant is a struct of
// static device hooks that the kernels call at fixed points of a KV tile's step:
//   State                     what the variant computes per CTA (or per row) from the params: built once by
//                             state(p, b, h) for the CTA's (or row's) batch row b and query head h
//   logits(p, st, s, pair)    the logits transform: a score in units of q.k (the kernels fold sm_scale into the
//                             softmax) -> the new score, in the same units
//   keep(p, st, pair)         the logits mask: false drops the pair (its score becomes -inf before the row's max)
//   first_key / last_key      (masks whose visible keys are one run a query) the run's ends, which the walks use
//                             to skip the tiles no row sees and the per-element mask on tiles every row sees whole
// LOGITS and MASK say which hooks do something, so that a kernel with neither transform nor mask compiles to what
// it would without the mechanism. The hooks take the params (p) too: what a variant only reads from them
// (softcap's constants, the user's aux tensors) it reads there, where it runs, as the kernels always have (softcap's
// constants copied into a per-CTA state moved their loads to the CTA's start and changed a snippet kernel's machine
// code on sm_89); State holds what is computed once (ALiBi's slope over sm_scale). A kernel composes the library
// variants its spec turns on with Variants<...>, in the documented order (softcap, ALiBi, score_mod; then the
// masks), and calls the composition's hooks.
//
// The kernels' machine code is that of the hand-written transforms they replace; the places where the PTX's order
// decides it are noted (Pair::rel, Variants::logits). A pair is passed by reference: by value, mask_mod's rolled
// loop in prefill/step.cuh.jinja compiled to other machine code.
//
// Adding a library variant: a struct here (derived from VariantBase, with its State, state() and the hooks it
// needs), its spec switch, and its name where the family's spec lists its variants (variant_list in
// attngen/spec.py; the families' template_context).
namespace attngen {

// A (query, key) pair as the hooks see it: batch row, query head, the query's position aligned with the keys (the
// causal mask's q_idx: row i of seqlen_q against seqlen_k keys sits at i + seqlen_k - seqlen_q; a decode token at
// seqlen - q_len + its index) and the key's position. A hook reads only what it needs; the rest is never computed.
// rel = q - kv is taken where the pair is made, before any hook runs, as the kernels took ALiBi's distance: taken
// after the softcap, the PTX's order changed and with it the machine code of sm_90a's wgmma kernels.
struct Pair {
  int b, h, q, kv, rel;
  __device__ __forceinline__ Pair(int b_, int h_, int q_, int kv_) : b(b_), h(h_), q(q_), kv(kv_), rel(q_ - kv_) {}
};

// The hooks of a variant that has none of a kind: no state, the score unchanged, every pair kept.
struct VariantBase {
  static constexpr bool LOGITS = false;
  static constexpr bool MASK = false;
  struct State {};
  template <class P>
  static __device__ __forceinline__ State state(const P&, int, int) {
    return {};
  }
  template <class P>
  static __device__ __forceinline__ float logits(const P&, const State&, float s, const Pair&) {
    return s;
  }
  template <class P>
  static __device__ __forceinline__ bool keep(const P&, const State&, const Pair&) {
    return true;
  }
};

// Logit capping, cap * tanh(s * sm_scale / cap), kept in units of q.k: cap_u = cap / sm_scale and its inverse
// (params' softcap_u, inv_softcap_u, read where it runs).
struct Softcap : VariantBase {
  static constexpr bool LOGITS = true;
  template <class P>
  static __device__ __forceinline__ float logits(const P& p, const State&, float s, const Pair&) {
    return p.softcap_u * fast_tanh(s * p.inv_softcap_u);
  }
};

// ALiBi, -slope * |q - kv| with the query head's slope (params' fp32 alibi [batch, heads] or [heads] through
// alibi_sb), in units of q.k: slope_u = slope / sm_scale.
struct Alibi : VariantBase {
  static constexpr bool LOGITS = true;
  struct State {
    float slope_u;
  };
  template <class P>
  static __device__ __forceinline__ State state(const P& p, int b, int h) {
    return {p.alibi[b * p.alibi_sb + h] / p.sm_scale};
  }
  template <class P>
  static __device__ __forceinline__ float logits(const P&, const State& st, float s, const Pair& x) {
    return s - st.slope_u * fabsf(float(x.rel));
  }
};

// A sliding window: key kv is seen from q where q - left <= kv <= q + right; a side of -1 is unbounded (left, right
// in State; the families read them from their params). first_key / last_key are the window's edges about q before
// any clamp to the sequence, from which prefill/mask.cuh's KeyRange builds a row's keys and the tiles it walks.
struct Window : VariantBase {
  static constexpr bool MASK = true;
  struct State {
    int left, right;  // -1: unbounded
  };
  template <class P>
  static __device__ __forceinline__ State state(const P& p, int, int) {
    return {p.win_left, p.win_right};
  }
  static __device__ __forceinline__ int first_key(const State& st, int q) { return q - st.left; }
  static __device__ __forceinline__ int last_key(const State& st, int q) { return q + st.right; }
  template <class P>
  static __device__ __forceinline__ bool keep(const P&, const State& st, const Pair& x) {
    return (st.left < 0 || x.kv >= first_key(st, x.q)) && (st.right < 0 || x.kv <= last_key(st, x.q));
  }
};

// Causal: the window (-1, 0), each query sees the keys up to its own position. (The states of Causal and NoMask are
// built field by field: returned as the aggregate {-1, 0}, the constant struct's copy changed the PTX and the machine
// code of prefill's causal kernels on sm_120.)
struct Causal : Window {
  template <class P>
  static __device__ __forceinline__ State state(const P&, int, int) {
    State st;
    st.left = -1;
    st.right = 0;
    return st;
  }
};

// No mask: the window (-1, -1), which keeps every pair.
struct NoMask : Window {
  static constexpr bool MASK = false;
  template <class P>
  static __device__ __forceinline__ State state(const P&, int, int) {
    State st;
    st.left = -1;
    st.right = -1;
    return st;
  }
};

// Variants<V...>: the variants V... as one, their transforms applied in the order given (each sees the score the
// one before returned) and a pair kept where every mask keeps it. Its State holds each one's. Only the hooks that
// do something are called: a trailing call of the empty list's identity hooks reordered the PTX of the chunked
// kernel's softcap and changed its machine code on sm_80.
template <class... Vs>
struct Variants : VariantBase {};

template <class V, class... Vs>
struct Variants<V, Vs...> {
  using Rest = Variants<Vs...>;
  static constexpr bool LOGITS = V::LOGITS || Rest::LOGITS;
  static constexpr bool MASK = V::MASK || Rest::MASK;
  struct State {
    typename V::State first;
    typename Rest::State rest;
  };
  template <class P>
  static __device__ __forceinline__ State state(const P& p, int b, int h) {
    return {V::state(p, b, h), Rest::state(p, b, h)};
  }
  template <class P>
  static __device__ __forceinline__ float logits(const P& p, const State& st, float s, const Pair& x) {
    if constexpr (V::LOGITS) s = V::logits(p, st.first, s, x);
    if constexpr (Rest::LOGITS) s = Rest::logits(p, st.rest, s, x);
    return s;
  }
  template <class P>
  static __device__ __forceinline__ bool keep(const P& p, const State& st, const Pair& x) {
    if constexpr (!V::MASK) return Rest::keep(p, st.rest, x);
    else if constexpr (!Rest::MASK) return V::keep(p, st.first, x);
    else return V::keep(p, st.first, x) && Rest::keep(p, st.rest, x);
  }
};

#ifdef ATTNGEN_MODS
// The user's snippets (spec score_mod, mask_mod: attngen/families/snippets.py defines user_score_mod and
// user_mask_mod last in the unit) as one more variant: score_mod its transform, mask_mod its mask, both reading
// the params' aux tensors (mods). score_mod sees the logit (the score times sm_scale) and returns one, which
// State's 1 / sm_scale takes back to units of q.k (logits), or which stays a logit (logit). The kernels call these
// only on pairs that exist and at q >= 0 (docs/variants.md "The contract").
struct UserMods : VariantBase {
#ifdef ATTNGEN_SCORE_MOD
  static constexpr bool LOGITS = true;
#endif
#ifdef ATTNGEN_MASK_MOD
  static constexpr bool MASK = true;
#endif
  struct State {
    float inv_scale;
  };
  template <class P>
  static __device__ __forceinline__ State state(const P& p, int, int) {
    return {1.f / p.sm_scale};
  }
  template <class P>
  static __device__ __forceinline__ float logits(const P& p, const State& st, float s, const Pair& x) {
    return user_score_mod(p.mods, s * p.sm_scale, x.b, x.h, x.q, x.kv) * st.inv_scale;
  }
  // The transform in the logits' own units (a kernel whose softmax takes its scores as logits: prefill's step, where
  // the multiply back to units of q.k would cost one more FP32 op an element; under its q_scaled, the MMA's scores
  // are logits already, and no multiply is left at all).
  template <class P>
  static __device__ __forceinline__ float logit(const P& p, float value, const Pair& x) {
    return user_score_mod(p.mods, value, x.b, x.h, x.q, x.kv);
  }
  template <class P>
  static __device__ __forceinline__ bool keep(const P& p, const State&, const Pair& x) {
    return user_mask_mod(p.mods, x.b, x.h, x.q, x.kv);
  }
};

// LOG2E: exp2's scale of scores that are logits (a softmax after logit).
constexpr float LOG2E = 1.4426950408889634f;
#endif

}  // namespace attngen
