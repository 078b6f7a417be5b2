// The prefill kernel's work lists, built on the GPU with no host sync (included by custom-mask
// and varlen kernels only; the tile sizes and mask mode are the kernel's own, so a plan always
// fits the kernel it was built by).
//
// Custom mask, three launches:
//   mask_tiles  reads the mask once: writes it as bits (one uint32 per 32 keys, padded to whole
//               KV tiles) and, per (unit, query tile, KV tile), a state: 0 no row sees a key
//               (custom mask and causal/window together), 1 live, 2 live and the custom mask
//               keeps the whole tile (the kernel then reads no bits for it), plus 4 when the CTA
//               that wrote it read an additive value other than 0 and -inf;
//   mask_lists  compacts each (unit, query tile)'s states into its list of live KV tiles;
//   order_work  sorts the (unit, query tile) items by their number of live tiles, heaviest first.
// No buffer needs zeroing first: the odd-value flag travels through the states and a word per
// item (mask_lists) to flags[0] (order_work), each written whole.
// Varlen, one launch: order_work enumerates every sequence's query tiles and sorts them by the
// number of KV tiles each sees. The serving step's plan (seqlens set) also writes the paged
// kernel's cu_k from the key counts and, into decode_order, the decode kernel's request order.
namespace attngen {

constexpr int PLAN_THREADS = 256;
constexpr int ORDER_THREADS = 1024;
constexpr int ORDER_BUCKETS = 2048;  // work keys past this share the last bucket
constexpr int ORDER_SORT_MAX = 4096;  // the most sequences a decode order is sorted for (in shared memory)

struct PlanParams {
  const void* mask;          // [.., seqlen_q, seqlen_k] with unit key stride
  unsigned* bits;            // [units, seqlen_q, bits_words]
  unsigned char* states;     // [units, num_q_tiles, num_kv_tiles]
  int* tiles;                // [units, num_q_tiles, num_kv_tiles]: live tiles first
  int* counts;               // [units, num_q_tiles]
  int2* work;                // slot -> (unit or sequence, query tile)
  int* work_count;
  unsigned* flags;           // [0]: an additive mask held a value other than 0 and -inf;
                             // [1 + item]: the same for that (unit, query tile)
  const int* cu_q;           // VARLEN
  const int* cu_k;
  int* scratch;              // VARLEN: [batch + 1] running count of query tiles
  long long m_sb, m_sh, m_sq;  // mask strides in elements (a broadcast dim's is unused)
  long long bits_su;
  int mask_kind;             // 0: bool / uint8 (nonzero keeps), 1 fp16, 2 bf16, 3 fp32 (additive: -inf masks)
  int seqlen_q, seqlen_k, units_b, units_h, num_q_tiles, num_kv_tiles, bits_words;
  int win_left, win_right;   // as the kernel's
  int batch, total_q, total_k;  // VARLEN; total_k: the paged capacity when paged
  int paged;
  // VARLEN, the serving step's plan (after every other field, so that the mask plans' offsets stay
  // where they were):
  const int* seqlens;        // paged, or null: [batch] key counts; cu_k is then written, not read
  int* cu_k_out;             // with seqlens: [batch + 1] their running sums (the kernel reads differences)
  int* decode_order;         // or null: [batch] the decode requests longest first, then the others
  int max_decode_q_len;      // sequences of at most this many queries are left out of the work list
};

// Bits [lo, hi) of a word, both clamped to [0, 32].
__device__ __forceinline__ unsigned bit_range(int lo, int hi) {
  lo = max(lo, 0);
  hi = min(hi, 32);
  if (hi <= lo) return 0u;
  const unsigned upto = hi == 32 ? ~0u : (1u << hi) - 1u;
  return upto & ~((1u << lo) - 1u);
}

// A mask element's raw bits: keep (bool: nonzero; additive: not -inf) and odd (additive: neither
// 0, -0 nor -inf; such values are read as 0 and reported through p.flags). An additive type is
// its raw word, the bits of -inf and the mask that clears the sign.
template <class Raw, Raw NEG_INF, Raw NO_SIGN>
struct AdditiveBits {
  using raw = Raw;
  __device__ static bool keep(raw v, bool& odd) {
    odd |= (v & NO_SIGN) != 0 && v != NEG_INF;
    return v != NEG_INF;
  }
};
template <class M>
struct MaskBits;
template <>
struct MaskBits<unsigned char> {
  using raw = unsigned char;
  __device__ static bool keep(raw v, bool&) { return v != 0; }
};
template <>
struct MaskBits<__half> : AdditiveBits<unsigned short, 0xfc00u, 0x7fffu> {};
template <>
struct MaskBits<__nv_bfloat16> : AdditiveBits<unsigned short, 0xff80u, 0x7fffu> {};
template <>
struct MaskBits<float> : AdditiveBits<unsigned, 0xff800000u, 0x7fffffffu> {};

// grid (ceil(bits_words / 32), num_q_tiles, units), PLAN_THREADS threads: one query tile x 1024
// keys. Each lane reads KPL consecutive keys of a row with one 16-byte load (or key by key at the
// row's end or when rows are not 16-byte aligned), turns them into KPL bits, and the LPW lanes of
// a 32-key word OR theirs together; the group's first lane owns that word (stores it and folds it
// into the tile states).
template <class M, int BLOCK_M, int BLOCK_N, int MASK>
__device__ __forceinline__ void mask_tiles_of(const PlanParams& p) {
  using B = MaskBits<M>;
  using R = typename B::raw;
  constexpr int WARPS = PLAN_THREADS / 32;
  constexpr int KPL = 16 / sizeof(R);         // keys per lane and load
  constexpr int LPW = 32 / KPL;               // lanes per 32-key word
  constexpr int STEPS = 1024 / (32 * KPL);    // loads per row of this CTA's 1024 keys
  constexpr int WPS = 32 / LPW;               // words per step
  __shared__ unsigned s_live[32], s_all[32];
  __shared__ int s_odd;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (threadIdx.x < 32) {
    s_live[lane] = 0u;
    s_all[lane] = ~0u;
  }
  if (threadIdx.x == 0) s_odd = 0;
  __syncthreads();
  const int unit = blockIdx.z, qt = blockIdx.y;
  const int key0 = blockIdx.x * 1024;
  const KeyRange keys = key_range<MASK>(p.seqlen_q, p.seqlen_k, p);
  const R* m = static_cast<const R*>(p.mask) + (p.units_b > 1 ? unit / p.units_h : 0) * p.m_sb +
               (p.units_h > 1 ? unit % p.units_h : 0) * p.m_sh;
  const bool vec = (reinterpret_cast<unsigned long long>(m) & 15) == 0 && (p.m_sq * sizeof(R)) % 16 == 0;
  const bool owner = lane % LPW == 0;
  unsigned live[STEPS], all[STEPS];
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    live[st] = 0u;
    all[st] = ~0u;
  }
  bool odd = false;
  // RB rows at a time: their 16-byte loads are all issued before the first is used (8 per lane
  // in flight), since the stores of bits between rows would otherwise hold the next row's loads.
  constexpr int RB = STEPS >= 8 ? 1 : 8 / STEPS;
  for (int r0 = warp; r0 < BLOCK_M; r0 += WARPS * RB) {
    uint4 raw[RB][STEPS];
#pragma unroll
    for (int b = 0; b < RB; ++b) {
      const int r = r0 + b * WARPS, i = qt * BLOCK_M + r;
#pragma unroll
      for (int st = 0; st < STEPS; ++st) {
        const int key = key0 + st * 32 * KPL + lane * KPL;
        if (vec && r < BLOCK_M && i < p.seqlen_q && key + KPL <= p.seqlen_k)
          raw[b][st] = __ldg(reinterpret_cast<const uint4*>(m + i * p.m_sq + key));
      }
    }
#pragma unroll
    for (int b = 0; b < RB; ++b) {
      const int r = r0 + b * WARPS, i = qt * BLOCK_M + r;
      if (r >= BLOCK_M || i >= p.seqlen_q) break;
      const R* row = m + i * p.m_sq;
      const int lo = keys.lo(i), hi = keys.hi(i);
#pragma unroll
      for (int st = 0; st < STEPS; ++st) {
        const int key = key0 + st * 32 * KPL + lane * KPL;
        unsigned bits = 0u;
        if (vec && key + KPL <= p.seqlen_k) {
          union { uint4 v; R e[KPL]; } u;
          u.v = raw[b][st];
#pragma unroll
          for (int e = 0; e < KPL; ++e) bits |= unsigned(B::keep(u.e[e], odd)) << e;
        } else {
#pragma unroll
          for (int e = 0; e < KPL; ++e)
            if (key + e < p.seqlen_k) bits |= unsigned(B::keep(row[key + e], odd)) << e;
        }
        bits <<= (lane % LPW) * KPL;
#pragma unroll
        for (int o = 1; o < LPW; o *= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, o);
        const int word = blockIdx.x * 32 + st * WPS + lane / LPW;
        if (owner) {
          if (word < p.bits_words) p.bits[unit * p.bits_su + (long long)i * p.bits_words + word] = bits;
          live[st] |= bits & bit_range(lo - word * 32, hi - word * 32);
          all[st] &= bits | ~bit_range(0, p.seqlen_k - word * 32);
        }
      }
    }
  }
  if (owner) {
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      atomicOr(&s_live[st * WPS + lane / LPW], live[st]);
      atomicAnd(&s_all[st * WPS + lane / LPW], all[st]);
    }
  }
  if (odd) s_odd = 4;
  __syncthreads();
  constexpr int WPT = BLOCK_N / 32, TILES = 1024 / BLOCK_N;
  if (threadIdx.x < TILES) {
    const int kt = blockIdx.x * TILES + threadIdx.x;
    if (kt < p.num_kv_tiles) {
      unsigned l = 0u, a = ~0u;
#pragma unroll
      for (int q = 0; q < WPT; ++q) {
        l |= s_live[threadIdx.x * WPT + q];
        a &= s_all[threadIdx.x * WPT + q];
      }
      p.states[((long long)unit * p.num_q_tiles + qt) * p.num_kv_tiles + kt] = (l ? (a == ~0u ? 2 : 1) : 0) | s_odd;
    }
  }
}

template <int BLOCK_M, int BLOCK_N, int MASK>
__device__ __forceinline__ void mask_tiles(const PlanParams& p) {
  switch (p.mask_kind) {
    case 0: mask_tiles_of<unsigned char, BLOCK_M, BLOCK_N, MASK>(p); break;
    case 1: mask_tiles_of<__half, BLOCK_M, BLOCK_N, MASK>(p); break;
    case 2: mask_tiles_of<__nv_bfloat16, BLOCK_M, BLOCK_N, MASK>(p); break;
    default: mask_tiles_of<float, BLOCK_M, BLOCK_N, MASK>(p); break;
  }
}

// grid (num_q_tiles, units), PLAN_THREADS threads: the live KV tiles of one (unit, query tile) in
// order, bit 31 set on those the mask keeps whole, their count, and whether any was odd.
__device__ __forceinline__ void mask_lists(const PlanParams& p) {
  constexpr int WARPS = PLAN_THREADS / 32;
  __shared__ int s_warp[WARPS];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const long long at = (long long)blockIdx.y * p.num_q_tiles + blockIdx.x;
  const unsigned char* st = p.states + at * p.num_kv_tiles;
  int* out = p.tiles + at * p.num_kv_tiles;
  int total = 0, odd = 0;
  for (int c0 = 0; c0 < p.num_kv_tiles; c0 += PLAN_THREADS) {
    const int kt = c0 + threadIdx.x;
    const int raw = kt < p.num_kv_tiles ? st[kt] : 0;
    const int s = raw & 3;
    odd |= raw & 4;
    const unsigned b = __ballot_sync(0xffffffffu, s != 0);
    if (lane == 0) s_warp[warp] = __popc(b);
    __syncthreads();
    int before = 0, chunk = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      before += w < warp ? s_warp[w] : 0;
      chunk += s_warp[w];
    }
    if (s) out[total + before + __popc(b & ((1u << lane) - 1u))] = kt | (s == 2 ? int(0x80000000u) : 0);
    total += chunk;
    __syncthreads();
  }
  odd = __syncthreads_or(odd);
  if (threadIdx.x == 0) {
    p.counts[at] = total;
    p.flags[1 + at] = odd ? 1u : 0u;
  }
}

// Exclusive prefix sum over the block (ORDER_THREADS threads); *total gets the sum.
__device__ __forceinline__ int block_exclusive_sum(int v, int* s_warp, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) s_warp[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int w = s_warp[lane];
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    s_warp[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int before = (warp ? s_warp[warp - 1] : 0) + x - v;
  *total = s_warp[ORDER_THREADS / 32 - 1];
  __syncthreads();  // s_warp is reused by the next call
  return before;
}

// A sequence's clamped query and key counts (VARLEN), as the kernel takes them. With seqlens the
// key count is read there: cu_k is this launch's output, and its difference is that count.
__device__ __forceinline__ void varlen_lengths(const PlanParams& p, int s, int& sq, int& sk) {
  int q_lo, k_lo;
  if (p.seqlens) {
    varlen_q_rows(p.cu_q, p.total_q, s, q_lo, sq);
    sk = min(max(p.seqlens[s], 0), p.total_k);
  } else {
    varlen_rows(p.cu_q, p.cu_k, p.total_q, p.total_k, p.paged, s, q_lo, sq, k_lo, sk);
  }
}

// One stage of the bitonic network over a[0, n) through shared memory: the pairs (i, i + j) of runs of k,
// runs at i & k == 0 descending, the others ascending. A stride of at most 32 pairs keys of one warp's run of 64
// (pair t is always thread t % ORDER_THREADS's).
__device__ __forceinline__ void sort_stage(unsigned long long* a, int n, int k, int j) {
  for (int t = threadIdx.x; t < n / 2; t += ORDER_THREADS) {
    const int i = 2 * t - (t & (j - 1)), l = i + j;
    const unsigned long long u = a[i], v = a[l];
    if (((i & k) == 0) == (u < v)) {
      a[i] = v;
      a[l] = u;
    }
  }
}

// Sorts a[0, n) descending (n a power of two, at most ORDER_SORT_MAX; the keys distinct), by the
// whole block: a bitonic network. Up to ORDER_THREADS keys, thread t holds key t in a register: a
// stride under 32 pairs keys of one warp, exchanged by shuffles (only the warps that hold keys), and
// a[] is read and written around each run of them; a stride of 32 or more pairs keys of two warps and
// goes through a[] (sort_stage). More keys (a step of more than ORDER_THREADS requests) go through a[]
// at every stride, only the longer strides waiting for the whole block.
__device__ __forceinline__ void sort_descending(unsigned long long* a, int n) {
  __syncthreads();
  if (n > ORDER_THREADS) {
    for (int k = 2; k <= n; k *= 2) {
      for (int j = k / 2; j > 0; j /= 2) {
        sort_stage(a, n, k, j);
        if (j >= 64 || j == 1) {
          __syncthreads();
        } else {
          __syncwarp();
        }
      }
    }
    return;
  }
  const int e = threadIdx.x;
  const bool holds = (e & ~31) < n;  // the same for the whole warp
  unsigned long long x = e < n ? a[e] : 0ull;
  for (int k = 2; k <= n; k *= 2) {
    int j = k / 2;
    if (j >= 32) {
      if (e < n) a[e] = x;
      __syncthreads();
      for (; j >= 32; j /= 2) {
        sort_stage(a, n, k, j);
        __syncthreads();
      }
      x = e < n ? a[e] : 0ull;
    }
    if (holds) {
      for (; j > 0; j /= 2) {
        const unsigned long long y = __shfl_xor_sync(0xffffffffu, x, j);
        // the larger key goes to the lower index of a descending run and to the upper of an ascending one
        const bool larger = ((e & k) == 0) == ((e & j) == 0);
        x = larger == (x < y) ? y : x;
      }
    }
  }
  if (e < n) a[e] = x;
  __syncthreads();
}

// Sequence s's key in the decode order: the decode requests (1 to max_decode_q_len queries, as the
// decode kernel counts them) first, by key count, longest first (cache_seqlens' order, negatives
// included); then the others; ties by index. The low 31 bits give the index back; 0 is below every key.
__device__ __forceinline__ unsigned long long decode_key(const PlanParams& p, int s) {
  const int n = p.cu_q[s + 1] - p.cu_q[s];
  const int keys = p.seqlens ? p.seqlens[s] : p.cu_k[s + 1] - p.cu_k[s];
  const bool decode = n > 0 && n <= p.max_decode_q_len;
  return (decode ? 1ull << 63 : 0ull) | (decode ? (unsigned long long)(unsigned(keys) ^ 0x80000000u) << 31 : 0ull) |
         (unsigned long long)(0x7fffffff - s);
}

// One CTA of ORDER_THREADS threads: every item (unit, query tile) with its work (live KV tiles),
// then a counting sort by work, heaviest first, into p.work. Equal works keep no particular order;
// each item writes its own output, so the result does not depend on it.
template <int BLOCK_M, int BLOCK_N, int MASK, bool VARLEN>
__device__ __forceinline__ void order_work(const PlanParams& p) {
  __shared__ int s_hist[ORDER_BUCKETS];
  __shared__ int s_warp[32];
  int n;
  const int* first = p.scratch;  // VARLEN: [batch + 1] each sequence's first item
  if constexpr (VARLEN) {
    __shared__ unsigned long long s_sort[ORDER_SORT_MAX];
    const bool sorting = p.decode_order && p.batch <= ORDER_SORT_MAX;
    // scratch[s] = query tiles of the sequences before s; with seqlens, cu_k_out[s + 1] = keys up to s
    // (int32 wraps as cumsum does: the kernel reads only differences)
    int carry = 0, mine = 0;  // mine: this thread's sequence's first item (the first ORDER_THREADS sequences)
    unsigned carry_k = 0u;
    for (int c0 = 0; c0 < p.batch; c0 += ORDER_THREADS) {
      const int s = c0 + threadIdx.x;
      int tiles = 0, keys = 0;
      if (s < p.batch) {
        int sq, sk;
        varlen_lengths(p, s, sq, sk);
        // Sequences of at most max_decode_q_len queries are left to another kernel (the serving step's decode rows).
        tiles = sq > p.max_decode_q_len ? (sq + BLOCK_M - 1) / BLOCK_M : 0;
        if (p.seqlens) keys = p.seqlens[s];
        if (sorting) s_sort[s] = decode_key(p, s);
      }
      int chunk;
      const int before = block_exclusive_sum(tiles, s_warp, &chunk);
      if (s < p.batch) p.scratch[s] = carry + before;
      if (c0 == 0) mine = before;
      carry += chunk;
      if (p.seqlens) {
        const int before_k = block_exclusive_sum(keys, s_warp, &chunk);
        if (s < p.batch) p.cu_k_out[s + 1] = int(carry_k + unsigned(before_k) + unsigned(keys));
        carry_k += unsigned(chunk);
      }
    }
    if (threadIdx.x == 0) {
      p.scratch[p.batch] = carry;
      *p.work_count = carry;
      if (p.seqlens) p.cu_k_out[0] = 0;
    }
    n = carry;
    if (sorting) {
      int n2 = 1;
      while (n2 < p.batch) n2 *= 2;
      for (int s = p.batch + threadIdx.x; s < n2; s += ORDER_THREADS) s_sort[s] = 0ull;
      sort_descending(s_sort, n2);
      for (int r = threadIdx.x; r < p.batch; r += ORDER_THREADS)
        p.decode_order[r] = 0x7fffffff - int(s_sort[r] & 0x7fffffffu);
    }
    __syncthreads();
    // The sequences' first items, which every item's search reads, in s_sort's space (free once the decode
    // order is written) where they fit; the first ORDER_THREADS from registers.
    if (n > 0 && p.batch < 2 * ORDER_SORT_MAX) {
      int* copy = reinterpret_cast<int*>(s_sort);
      for (int s = threadIdx.x; s <= p.batch; s += ORDER_THREADS)
        copy[s] = s == p.batch ? n : s < ORDER_THREADS ? mine : p.scratch[s];
      first = copy;
      __syncthreads();
    }
  } else {
    n = p.units_b * p.units_h * p.num_q_tiles;
  }
  // item i -> (unit, query tile) and its work
  auto item = [&](int i, int& work) {
    if constexpr (VARLEN) {
      int lo = 0, hi = p.batch - 1;  // the last sequence whose first tile is at or before i
      while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (first[mid] <= i) lo = mid; else hi = mid - 1;
      }
      const int qt = i - first[lo];
      int sq, sk;
      varlen_lengths(p, lo, sq, sk);
      const KeyRange keys = key_range<MASK>(sq, sk, p);
      const int m0 = qt * BLOCK_M;
      work = keys.tiles<BLOCK_N>(m0, min(m0 + BLOCK_M, sq) - 1).count;
      return make_int2(lo, qt);
    } else {
      work = p.counts[i];
      return make_int2(i / p.num_q_tiles, i % p.num_q_tiles);
    }
  };
  for (int b = threadIdx.x; b < ORDER_BUCKETS; b += ORDER_THREADS) s_hist[b] = 0;
  __syncthreads();
  unsigned odd = 0u;
  // Each thread's first item is kept for the second pass, which then recomputes only the items past the first
  // ORDER_THREADS.
  int2 it0 = make_int2(0, 0);
  int work0 = 0;
  for (int i = threadIdx.x; i < n; i += ORDER_THREADS) {
    int work;
    const int2 it = item(i, work);
    if (i == threadIdx.x) {
      it0 = it;
      work0 = work;
    }
    atomicAdd(&s_hist[min(work, ORDER_BUCKETS - 1)], 1);
    if constexpr (!VARLEN) odd |= p.flags[1 + i];
  }
  odd = __syncthreads_or(odd);
  if constexpr (!VARLEN) {
    if (threadIdx.x == 0) p.flags[0] = odd ? 1u : 0u;
  }
  // Heaviest bucket first: thread t owns buckets B-1-t*K .. B-K-t*K (K = B / threads).
  constexpr int K = ORDER_BUCKETS / ORDER_THREADS;
  int own[K], sum = 0;
#pragma unroll
  for (int j = 0; j < K; ++j) {
    own[j] = s_hist[ORDER_BUCKETS - 1 - (threadIdx.x * K + j)];
    sum += own[j];
  }
  int total;
  int at = block_exclusive_sum(sum, s_warp, &total);
#pragma unroll
  for (int j = 0; j < K; ++j) {
    s_hist[ORDER_BUCKETS - 1 - (threadIdx.x * K + j)] = at;  // now each bucket's next free slot
    at += own[j];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += ORDER_THREADS) {
    int work = work0;
    const int2 it = i == threadIdx.x ? it0 : item(i, work);
    p.work[atomicAdd(&s_hist[min(work, ORDER_BUCKETS - 1)], 1)] = it;
  }
}

}  // namespace attngen
