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
// The keys are staged in shared memory as v's rows, 16-byte chunk ch of row `key` at chunk ch ^ (key / 16) % CH, so
// that the eight lanes reading one 4-byte word of each 16-key group find it in eight different banks. A thread then
// turns one word of 16 rows (4 columns of 16 keys) into the copy's 4 x 16 bytes by byte permutes (a 4 x 4 byte
// transpose per 4 keys), and 8 lanes store a column's 128 keys as one 128-byte line.
template <int DV, int BLOCK_N, bool VARLEN>
__device__ __forceinline__ void transpose_v(const VtParams& p) {
  constexpr int CH = DV / 16;        // 16-byte chunks of a row of v
  constexpr int KG = VT_KEYS / 16;   // 16-key groups of the CTA's keys
  __shared__ __align__(16) unsigned char tile[VT_KEYS][DV];
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
  for (int i = threadIdx.x; i < VT_KEYS * CH; i += VT_THREADS) {
    const int key = i / CH, ch = i % CH;
    uint4 x = make_uint4(0u, 0u, 0u, 0u);
    if (c0 + key < len) x = __ldg(reinterpret_cast<const uint4*>(src + (long long)(c0 + key) * p.v_ss + ch * 16));
    *reinterpret_cast<uint4*>(&tile[key][(ch ^ (key / 16) % CH) * 16]) = x;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < (DV / 4) * KG; i += VT_THREADS) {
    const int kg = i % KG, dw = i / KG;  // the thread's 16-key group and 4-byte word (columns 4 dw .. 4 dw + 3)
    const int at = ((dw / 4) ^ kg % CH) * 16 + (dw % 4) * 4;
    unsigned r[16];  // slot u's key's word
#pragma unroll
    for (int u = 0; u < 16; ++u)
      r[u] = *reinterpret_cast<const unsigned*>(&tile[kg * 16 + 2 * (u / 4) + (u & 1) + 8 * ((u & 3) >> 1)][at]);
    unsigned col[4][4];  // column 4 dw + c's slots 4 q .. 4 q + 3 in col[c][q]
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const unsigned* a = r + 4 * q;
      const unsigned lo01 = __byte_perm(a[0], a[1], 0x5140), lo23 = __byte_perm(a[2], a[3], 0x5140);
      const unsigned hi01 = __byte_perm(a[0], a[1], 0x7362), hi23 = __byte_perm(a[2], a[3], 0x7362);
      col[0][q] = __byte_perm(lo01, lo23, 0x5410);
      col[1][q] = __byte_perm(lo01, lo23, 0x7632);
      col[2][q] = __byte_perm(hi01, hi23, 0x5410);
      col[3][q] = __byte_perm(hi01, hi23, 0x7632);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c)
      *reinterpret_cast<uint4*>(dst + (4 * dw + c) * p.vt_sd + kg * 16) =
          make_uint4(col[c][0], col[c][1], col[c][2], col[c][3]);
  }
}

}  // namespace attngen
