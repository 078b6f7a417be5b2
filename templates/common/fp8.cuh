// fp8 caches read by 16-bit MMAs (decode/fp8.cuh, mla_decode/fp8.cuh, mla_decode/fp8_wgmma.cuh): fp8 values widened to
// fp16 in registers (or into q's dtype, for a tile widened in shared memory), the 16-byte chunk order their ldmatrix
// fragments give, and a bf16 q carried into fp16 by a power of two.
//
// ldmatrix reads an fp8 row as 16-bit elements: one 8x8 matrix is 8 keys x 16 head dims (one 16-byte chunk).
//  - K (QK^T's B): thread t gets key t/4, dims 4c..4c+3 (c = t % 4) of the chunk; bytes (4c, 4c+1) are its b0 and
//    (4c+2, 4c+3) its b1, a fixed order of the head dim inside each chunk that Q's fragments share (Q's chunks are
//    stored in it: fp8_chunk_order). A chunk is one k16 step.
//  - V (P V's B), ldmatrix.trans: thread t gets keys (2c, 2c+1) x dims (2n, 2n+1), n = t / 4: the (key 2c, key
//    2c+1) pairs of dim 2n and of dim 2n+1 are the B fragments of two n8 tiles of one chunk, its even and its odd
//    dims. O's accumulator tile 2j + e then holds chunk j's dims of parity e; fp8_dims_in_order puts them back.
// The widening is exact: every e4m3 and e5m2 value is an fp16 value.
namespace attngen {

__device__ __forceinline__ void ldmatrix_x2(unsigned& r0, unsigned& r1, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned& r0, unsigned& r1, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

// Two e4m3 values (the low 16 bits of x, the first in the low byte) -> fp16x2 (the first in the low half), by bits,
// for archs without cvt's fp8 forms (sm_80, sm_86). Each byte's exponent and mantissa move into fp16's places
// (an exponent 8 short of fp16's bias), and a multiply by 2^8 restores the bias: exact, and it normalises e4m3's
// subnormals (fp16 arithmetic keeps subnormal inputs). e4m3 has no infinities; its NaN (magnitude 0x7f) would
// come out as 480 and is set back to a NaN.
__device__ __forceinline__ unsigned e4m3x2_to_f16x2_bits(unsigned x) {
  const unsigned h = __byte_perm(x, 0u, 0x1404);  // each byte at the top of its 16-bit half
  const unsigned mag = (h >> 1) & 0x3f803f80u;
  unsigned r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(mag | (h & 0x80008000u)), "r"(0x5c005c00u));
  return r | ((mag & 0xffffu) == 0x3f80u ? 0x7e00u : 0u) | ((mag >> 16) == 0x3f80u ? 0x7e000000u : 0u);
}

// Two fp8 values of format FMT (1: e4m3, 2: e5m2) in the low 16 bits of x -> fp16x2, the first in the low half.
template <int FMT>
__device__ __forceinline__ unsigned fp8x2_to_f16x2(unsigned x) {
  if constexpr (FMT == 2) {
    // e5m2 is the top byte of an fp16 (sign, 5-bit exponent of bias 15, the mantissa's first 2 bits): one byte
    // permute on every arch, cheaper than cvt.
    return __byte_perm(x, 0u, 0x1404);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)x));
    return r;
#else
    return e4m3x2_to_f16x2_bits(x);
#endif
  }
}

// The four fp8 values of one ldmatrix register (an 8x8 matrix of 16-bit elements read from fp8 rows: bytes 0-3 are
// one key's 4 consecutive head dims) -> fp16x2 of bytes (0, 1) and (2, 3): K's b0 and b1.
template <int FMT>
__device__ __forceinline__ void fp8x4_to_f16x2(unsigned x, unsigned& lo, unsigned& hi) {
  if constexpr (FMT == 2) {
    lo = __byte_perm(x, 0u, 0x1404);
    hi = __byte_perm(x, 0u, 0x3424);
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // the high pair straight from the register's upper half (a shift first would cost an instruction)
    asm("{.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, u;\n}"
        : "=r"(lo), "=r"(hi) : "r"(x));
#else
    lo = e4m3x2_to_f16x2_bits(x);
    hi = e4m3x2_to_f16x2_bits(x >> 16);
#endif
  }
}

// Sixteen fp8 values of format FMT (x: bytes in order) widened into 16-bit elements of q's dtype (fp16, or bf16 with
// BF16), in order: lo holds the first eight, hi the last. Exact either way: every e4m3 and e5m2 value is an fp16
// value, and a bf16 one (fp16 -> fp32 -> bf16 keeps it).
template <int FMT, bool BF16>
__device__ __forceinline__ void fp8x16_widen(const uint4& x, uint4& lo, uint4& hi) {
  fp8x4_to_f16x2<FMT>(x.x, lo.x, lo.y);
  fp8x4_to_f16x2<FMT>(x.y, lo.z, lo.w);
  fp8x4_to_f16x2<FMT>(x.z, hi.x, hi.y);
  fp8x4_to_f16x2<FMT>(x.w, hi.z, hi.w);
  if constexpr (BF16) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      unsigned& w = i < 4 ? (&lo.x)[i] : (&hi.x)[i - 4];
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w));
      w = pack2<true>(f.x, f.y);
    }
  }
}

// One warp widens a unit of a 16-bit tile in WgmmaLayout (32 rows of one 64-column block: 4,096 bytes, rows of 128
// swizzled bytes) in place: its fp8 values (32 rows of 64 bytes, unswizzled, as an fp8 TMA box lands them) lie in the
// unit's second half. Lane l reads 16 fp8 columns (chunk l % 4) of rows l / 4, 8 + l / 4, 16 + l / 4 and 24 + l / 4,
// and once every lane has read (the __syncwarp) writes each as two 16-byte chunks of its swizzled row, so a unit needs
// no barrier but the warp's own. The unit's first row is row key0 of its tile, whose rows at or past `valid` (past the
// sequence: a box read them from the cache, or none did) are written as zeros.
template <int FMT, bool BF16>
__device__ __forceinline__ void fp8_widen_unit(unsigned char* unit, int key0, int valid, int lane) {
  const int c = lane % 4;
  uint4 x[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = 8 * m + lane / 4;
    x[m] = make_uint4(0u, 0u, 0u, 0u);
    if (key0 + r < valid) x[m] = *reinterpret_cast<const uint4*>(unit + 2048 + 64 * r + 16 * c);
  }
  __syncwarp();
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const int r = 8 * m + lane / 4;
    uint4 lo, hi;
    fp8x16_widen<FMT, BF16>(x[m], lo, hi);
    *reinterpret_cast<uint4*>(unit + 128 * r + 16 * ((2 * c) ^ (r % 8))) = lo;
    *reinterpret_cast<uint4*>(unit + 128 * r + 16 * ((2 * c + 1) ^ (r % 8))) = hi;
  }
}

// The four fp8 values of one ldmatrix.trans register (bytes 0, 1: key 2c's head dims 2n, 2n + 1; bytes 2, 3: key
// 2c + 1's) -> fp16x2 of bytes (0, 2) and (1, 3): the (key 2c, key 2c + 1) pairs of head dims 2n and 2n + 1, V's B
// fragments of an even-dim and an odd-dim n8 tile.
template <int FMT>
__device__ __forceinline__ void fp8x4_split_f16(unsigned x, unsigned& even, unsigned& odd) {
  if constexpr (FMT == 2) {
    even = __byte_perm(x, 0u, 0x2404);  // each byte at the top of its 16-bit half (fp8x2_to_f16x2<2>)
    odd = __byte_perm(x, 0u, 0x3414);
  } else {
    // one permute puts the even pair in the low half and the odd pair in the high one: fp8x4_to_f16x2 reads both
    fp8x4_to_f16x2<FMT>(__byte_perm(x, 0u, 0x3120), even, odd);
  }
}

// --- a bf16 q in fp16: q * 2^k, k a power of two chosen from the largest finite |q| a CTA reads ------------------

// m and the largest finite magnitude of the two bf16 values of v, as bits (bf16 magnitudes order as integers).
__device__ __forceinline__ unsigned bf16x2_finite_max(unsigned v, unsigned m) {
  const unsigned lo = v & 0x7fffu, hi = (v >> 16) & 0x7fffu;
  return max(m, max(lo < 0x7f80u ? lo : 0u, hi < 0x7f80u ? hi : 0u));
}

// m and the largest finite magnitude of a 16-byte chunk's eight bf16 values, as bits.
__device__ __forceinline__ unsigned bf16x8_finite_max(const uint4& x, unsigned m) {
  return bf16x2_finite_max(x.w, bf16x2_finite_max(x.z, bf16x2_finite_max(x.y, bf16x2_finite_max(x.x, m))));
}

// The power of two k that puts the largest finite |q| (m, as bits) in [2^14, 2^15) (0 where every q is 0 or not
// finite): q * 2^k is an fp16 value wherever |q| >= 2^-28 of the largest (bf16's 8 significant bits fit fp16's 11),
// and below it is rounded at 2^-39 of it, far below the fp32 accumulation's own rounding.
__device__ __forceinline__ int fp16_shift_from(unsigned m) {
  // |q| < 2^(e - 126) for a bf16 exponent field e: the largest times 2^(141 - e) lies in [2^14, 2^15); at most
  // 2^126 (a subnormal largest |q| stays under 2^15), so that 2^-k is a normal float too
  return m == 0u ? 0 : min(141 - (int)(m >> 7), 126);
}

// fp16_shift_from of the CTA's largest of every thread's m (THREADS threads, one word a warp of `scratch`, free until
// the caller stores there again).
template <int THREADS>
__device__ __forceinline__ int fp16_shift_of(unsigned m, unsigned* scratch, int tid) {
  m = __reduce_max_sync(0xffffffffu, m);
  if (tid % 32 == 0) scratch[tid / 32] = m;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) m = max(m, scratch[w]);
  __syncthreads();  // every warp has read the maxima before the scratch is written again
  return fp16_shift_from(m);
}

// Two bf16 values times f (2^k) as fp16x2.
__device__ __forceinline__ unsigned bf16x2_to_f16x2_scaled(unsigned v, float f) {
  return pack2<false>(__uint_as_float(v << 16) * f, __uint_as_float(v & 0xffff0000u) * f);
}

// A bf16 tile in shared memory (CHUNKS 16-byte chunks) times 2^k into fp16 in place (k from fp16_shift_from, in
// [-113, 126]), this thread taking chunks first, first + STRIDE, ...: element by element, so a swizzled layout is no
// matter.
template <int CHUNKS, int STRIDE>
__device__ __forceinline__ void bf16_tile_to_f16_scaled(void* tile, int k, int first) {
  const float f = __int_as_float((127 + k) << 23);
  uint4* q = reinterpret_cast<uint4*>(tile);
#pragma unroll 1
  for (int i = first; i < CHUNKS; i += STRIDE) {
    uint4 x = q[i];
    x.x = bf16x2_to_f16x2_scaled(x.x, f);
    x.y = bf16x2_to_f16x2_scaled(x.y, f);
    x.z = bf16x2_to_f16x2_scaled(x.z, f);
    x.w = bf16x2_to_f16x2_scaled(x.w, f);
    q[i] = x;
  }
}

// A 16-column chunk of Q (x: its 32-bit words, column pairs, w0..w7) in the order the fp8 K fragments read the head
// dim: w0 w2 w4 w6 (lo, columns 0-7 of the stored chunk) w1 w3 w5 w7 (hi, columns 8-15), so ldmatrix gives a thread
// columns (4t, 4t + 1) as a0 and (4t + 2, 4t + 3) as a2, the dims its K register holds.
__device__ __forceinline__ void fp8_chunk_order(const uint4 (&x)[2], uint4& lo, uint4& hi) {
  lo = make_uint4(x[0].x, x[0].z, x[1].x, x[1].z);
  hi = make_uint4(x[0].y, x[0].w, x[1].y, x[1].w);
}

// One 16-row tile of O's accumulator, CHUNKS 16-column chunks as P V over ldmatrix.trans fragments of fp8 rows left
// them (tile 2j + e: chunk j's dims of parity e), back in the 16-bit kernels' layout (tile d: columns 8d + 2t,
// 8d + 2t + 1), times `scale`. Thread t of a quad holds chunk j's dims 4t..4t+3 (tile 2j: 4t, 4t + 2; tile 2j + 1:
// 4t + 1, 4t + 3); columns 2t + e and 8 + 2t + e are held by quad threads t / 2 and 2 + t / 2, as their element
// of tile 2j + e for row half t % 2 (t = lane % 4). Shuffles within the quad.
template <int CHUNKS>
__device__ __forceinline__ void fp8_dims_in_order(float (&acc)[2 * CHUNKS][4], float scale, int lane, int t) {
  const int src = (lane & ~3) + t / 2;
  const bool odd = t & 1;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float out[2][2];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float x0 = __shfl_sync(0xffffffffu, acc[2 * j + e][2 * r], src + 2 * h);
          const float x1 = __shfl_sync(0xffffffffu, acc[2 * j + e][2 * r + 1], src + 2 * h);
          out[h][e] = odd ? x1 : x0;
        }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) acc[2 * j + h][2 * r + e] = out[h][e] * scale;
    }
}

}  // namespace attngen
