// fp8 prefill (spec qkv_dtype: q, k and v in e4m3, output fp16/bf16; sm_90a): the descales, the kernel's
// parameter, and the pass that writes V transposed. fp8 wgmma reads both operands K-major, so for O += P V the
// keys of V must be contiguous: a launch of the `_vt` entry copies v into a scratch buffer of rows of keys, one
// row a (batch, KV head, column of V), before the main entry runs (attngen/families/prefill/fp8.py).
namespace attngen {

// Descales as the caller gives them: each an fp32 array indexed [batch, KV head] through its two strides (0 for
// a dimension it does not have), or null where the host took a number (q's and k's folded into the softmax's
// scale, v's in v_mul) or there is none (1).
struct Fp8Scales {
  const float* q;
  const float* k;
  const float* v;
  long long q_sb, q_sh, k_sb, k_sh, v_sb, v_sh;
  float v_mul;

  __device__ __forceinline__ static float at(const float* s, long long sb, long long sh, int b, int h) {
    return s == nullptr ? 1.f : __ldg(s + b * sb + h * sh);
  }
  __device__ __forceinline__ float q_at(int b, int h) const { return at(q, q_sb, q_sh, b, h); }
  __device__ __forceinline__ float k_at(int b, int h) const { return at(k, k_sb, k_sh, b, h); }
  __device__ __forceinline__ float v_at(int b, int h) const { return v_mul * at(v, v_sb, v_sh, b, h); }
};

// The fp8 TMA kernel's parameter: the maps of q and k (as rows of 16-bit pairs: the 16-bit kernel's boxes) and of
// V's transposed copy (bytes), the parameters every kernel takes, the descales.
template <class T>
struct PrefillFp8Params {
  TmaDesc maps[3];
  PrefillParams<T> p;
  Fp8Scales f8;
};

// The mma.sync form's (cp.async): q, k and V's copy as 16-bit pairs through PrefillParams' pointers and strides.
template <class T>
struct PrefillFp8SyncParams {
  PrefillParams<T> p;
  Fp8Scales f8;
};

constexpr int VT_KEYS = 128;     // keys a CTA of the `_vt` entry copies
constexpr int VT_THREADS = 256;

// The keys of a sequence's rows of the copy are padded to a multiple of this: whole key tiles, whole `_vt` CTAs.
template <int BLOCK_N>
constexpr int vt_pad() {
  return BLOCK_N > VT_KEYS ? BLOCK_N : VT_KEYS;
}

// The column of V's transposed copy where sequence `seq`'s keys start. Dense: 0 (a row a batch and KV head).
// VARLEN: one row a KV head for the packed batch, each sequence from its first key rounded down to 16 bytes
// (16-byte stores) plus seq (vt_pad + 16): room for its keys padded, all zero past its end.
template <bool VARLEN, int BLOCK_N>
__device__ __forceinline__ int fp8_vt_col(long long k_row0, int seq) {
  return VARLEN ? (int)(k_row0 & ~15ll) + seq * (vt_pad<BLOCK_N>() + 16) : 0;
}

// The `_vt` entry's parameters: v (bytes) [batch, seqlen_k, kv_heads, DV] or packed [total_k, kv_heads, DV],
// the copy's strides (batch, KV head, column of V; a key is one byte), the lengths.
struct VtParams {
  const unsigned char* v;
  unsigned char* vt;
  const int* cu_k;
  long long v_sb, v_ss, v_sh;
  long long vt_sb, vt_sh, vt_sd;
  int seqlen_k, total_k;
};

// One CTA: keys [c0, c0 + 128) of one (sequence, KV head), from v's rows into the copy's rows of keys (zeros past
// the sequence's end, up to its padded length, vt_pad). Within each 16 keys the copy holds them in the order
// p_fragment8 packs P (ptx.cuh): slot u holds key 2 (u / 4) + (u & 1) + 8 ((u & 3) >> 1).
template <int DV, int BLOCK_N, bool VARLEN>
__device__ __forceinline__ void transpose_v(const VtParams& p) {
  __shared__ __align__(16) unsigned char tile[VT_KEYS][DV + 16];
  const int seq = blockIdx.z, kvh = blockIdx.y, c0 = blockIdx.x * VT_KEYS;
  int len;
  long long k_lo = 0;
  if constexpr (VARLEN) {
    k_lo = min(max(p.cu_k[seq], 0), p.total_k);
    len = min(max(p.cu_k[seq + 1], (int)k_lo), p.total_k) - (int)k_lo;
  } else {
    len = p.seqlen_k;
  }
  if (c0 >= (len + vt_pad<BLOCK_N>() - 1) / vt_pad<BLOCK_N>() * vt_pad<BLOCK_N>()) return;
  const unsigned char* src = p.v + (VARLEN ? k_lo * p.v_ss : seq * p.v_sb) + kvh * p.v_sh;
  unsigned char* dst = p.vt + (VARLEN ? 0 : seq * p.vt_sb) + kvh * p.vt_sh + fp8_vt_col<VARLEN, BLOCK_N>(k_lo, seq) + c0;
  constexpr int CH = DV / 16;  // 16-byte chunks of a row of v
  for (int i = threadIdx.x; i < VT_KEYS * CH; i += VT_THREADS) {
    const int key = i / CH, ch = i % CH;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (c0 + key < len) x = __ldg(reinterpret_cast<const uint4*>(src + (long long)(c0 + key) * p.v_ss + ch * 16));
    *reinterpret_cast<uint4*>(&tile[key][ch * 16]) = x;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < DV * (VT_KEYS / 16); i += VT_THREADS) {
    const int d = i / (VT_KEYS / 16), k16 = (i % (VT_KEYS / 16)) * 16;
    unsigned w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      w[q] = 0u;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int u = 4 * q + j;
        const int key = k16 + 2 * (u / 4) + (u & 1) + 8 * ((u & 3) >> 1);
        w[q] |= (unsigned)tile[key][d] << (8 * j);
      }
    }
    *reinterpret_cast<uint4*>(dst + d * p.vt_sd + k16) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace attngen
