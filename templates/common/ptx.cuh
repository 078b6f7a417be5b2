// Thin wrappers over the PTX instructions the kernels are built from: cp.async (16-byte, with
// zero fill for rows past the end of a sequence), ldmatrix, mma.sync m16n8k16 and ex2.
namespace attngen {

// NVRTC has no <math.h> macros; this is +inf as a float (bit pattern 0x7f800000).
#define ATTNGEN_INF __int_as_float(0x7f800000)

// Programmatic dependent launch (sm_90 and newer; nothing on older archs). A kernel the host
// launches with the programmatic-serialization attribute may start while the kernel before it
// on the stream is still finishing: it waits here, before its first global read, until that
// kernel has completed and its writes are visible, then lets the kernel after it start
// launching in turn (that one waits the same way before it reads anything this one writes).
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// The PDL trigger alone (sm_90 and newer): the kernel after this one on the stream, where it is launched with the
// programmatic-serialization attribute, may start launching once every CTA of this one has passed here; it still
// waits in its own pdl_enter until this one has completed.
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Thread-block clusters (sm_90 and newer; nothing on older archs, where no kernel calls them): a
// barrier across the cluster's CTAs that orders their shared-memory writes before each other's
// reads, the CTA's rank in the cluster, and 16-byte writes to another CTA's shared memory that
// its mbarrier counts.
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n"
               "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
  return r;
}

// The address of shared-memory address `addr` (this CTA's) in CTA `rank` of the cluster.
__device__ __forceinline__ unsigned cluster_map(unsigned addr, unsigned rank) {
  unsigned out = addr;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(addr), "r"(rank));
#endif
  return out;
}

// 16 bytes into another CTA's shared memory at `addr`, counted (16 bytes of its expected transfer)
// on that CTA's mbarrier at `bar` (both cluster addresses, from cluster_map).
__device__ __forceinline__ void cluster_store_async_f4(unsigned addr, float4 v, unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
               :: "r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(bar) : "memory");
#endif
}

// Writes into another CTA's shared memory at a cluster address (from cluster_map), visible to it
// after a cluster barrier (cluster_sync).
__device__ __forceinline__ void cluster_store_f2(unsigned addr, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};\n" :: "r"(addr), "f"(v.x), "f"(v.y) : "memory");
#endif
}

__device__ __forceinline__ void cluster_store_f32(unsigned addr, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" :: "r"(addr), "f"(v) : "memory");
#endif
}

// Reads of another CTA's shared memory at a cluster address (from cluster_map).
__device__ __forceinline__ float cluster_load_f32(unsigned addr) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
#endif
  return v;
}

__device__ __forceinline__ float4 cluster_load_f4(unsigned addr) {
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
#endif
  return v;
}

// Until the phase of this parity of this CTA's mbarrier `bar` has completed, acquiring at cluster
// scope what other CTAs of the cluster wrote before completing it.
__device__ __forceinline__ void cluster_mbar_wait(unsigned bar, unsigned parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // (the loop in PTX, its labels local to the braces' scope)
  asm volatile(
      "{\n.reg .pred p;\nWAIT:\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity)
      : "memory");
#endif
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// src_bytes = 0 writes 16 zero bytes and reads nothing: out-of-range rows become zeros, so
// a garbage V row can never turn 0 * NaN into NaN.
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Every cp.async this thread issued, committed to a group or not (wait_group skips uncommitted
// ones): before shared memory a copy may still target is reused.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// D = A * B + D for one 16x8x16 tile; A row-major (4 regs), B column-major (2 regs), fp32 accumulators.
template <bool BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (BF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// D = A * B + D for one 16x8x32 tile of e4m3 (sm_89+; fp8 prefill's mma.sync form): A row-major (4 regs of 4),
// B column-major (2 regs of 4), fp32 accumulators.
__device__ __forceinline__ void mma_16832_e4m3(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// tanh through the SFU (sm_75+): absolute error about 2^-11, ample for logit capping.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Two floats -> one register of two 16-bit values, the lower column in the low half.
template <bool BF16>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
  }
}

// Two 16-bit values times two (one register each), rounded to nearest.
template <bool BF16>
__device__ __forceinline__ unsigned mul2(unsigned a, unsigned b) {
  unsigned d;
  if constexpr (BF16)
    asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  else
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// The A fragment of P for k-step kk of O += P V (mma.sync and wgmma take the same one): the fp32
// S accumulators of 8-column tiles 2kk and 2kk+1, packed to 16 bits.
template <bool BF16, int N_TILES>
__device__ __forceinline__ void p_fragment(const float (&s)[N_TILES][4], int kk, unsigned (&a)[4]) {
  a[0] = pack2<BF16>(s[2 * kk][0], s[2 * kk][1]);
  a[1] = pack2<BF16>(s[2 * kk][2], s[2 * kk][3]);
  a[2] = pack2<BF16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
  a[3] = pack2<BF16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
}

// The e4m3 A fragment of P for 32-key step kk of O += P V on fp8 wgmma: the S accumulators of 8-column tiles
// 4kk..4kk+3 rounded to e4m3, four a register. fp8's A fragment holds keys 4t..4t+3 (and 16 + those) of a row where
// S holds keys 2t, 2t+1 of each 8-column tile, so register c takes this thread's pairs of tiles 4kk + 2(c/2) and
// 4kk + 2(c/2) + 1: the keys it holds in a step's slots 4t + j are 2t + (j & 1) + 8 (j >> 1), +16 for the upper
// slots. V's rows are laid out in that order (prefill/fp8_vt.cuh), so P V sums the same products.
template <int N_TILES>
__device__ __forceinline__ unsigned p_fragment8_reg(const float (&s)[N_TILES][4], int tile, int r) {
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(s[tile][2 * r + 1]), "f"(s[tile][2 * r]));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(s[tile + 1][2 * r + 1]), "f"(s[tile + 1][2 * r]));
  return (unsigned)lo | ((unsigned)hi << 16);
}
template <int N_TILES>
__device__ __forceinline__ void p_fragment8(const float (&s)[N_TILES][4], int kk, unsigned (&a)[4]) {
  a[0] = p_fragment8_reg(s, 4 * kk, 0);
  a[1] = p_fragment8_reg(s, 4 * kk, 1);
  a[2] = p_fragment8_reg(s, 4 * kk + 2, 0);
  a[3] = p_fragment8_reg(s, 4 * kk + 2, 1);
}

// Shared memory from `raw` rounded up to an ALIGN-byte boundary (wgmma's swizzle atoms: 1024); the
// spec's smem_bytes() reserves ALIGN bytes of slack for what this skips.
template <int ALIGN>
__device__ __forceinline__ unsigned char* aligned_smem(unsigned char* raw) {
  return raw + ((ALIGN - (smem_addr(raw) & (ALIGN - 1))) & (ALIGN - 1));
}

}  // namespace attngen
