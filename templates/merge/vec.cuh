// 16-byte vectors of a row to fp32 and back: 8 __half or __nv_bfloat16, or 4 float.
namespace attngen {

template <class T, bool BF16, int VEC>
__device__ __forceinline__ void load_vec(const T* src, float (&x)[VEC]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  if constexpr (VEC == 4) {
    x[0] = __uint_as_float(raw.x);
    x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z);
    x[3] = __uint_as_float(raw.w);
  } else {
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 f;
      if constexpr (BF16) {
        f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      } else {
        f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      }
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  }
}

template <class T, bool BF16, int VEC>
__device__ __forceinline__ void store_vec(T* dst, const float (&x)[VEC]) {
  uint4 raw;
  if constexpr (VEC == 4) {
    raw = make_uint4(__float_as_uint(x[0]), __float_as_uint(x[1]), __float_as_uint(x[2]), __float_as_uint(x[3]));
  } else {
    raw = make_uint4(pack2<BF16>(x[0], x[1]), pack2<BF16>(x[2], x[3]), pack2<BF16>(x[4], x[5]),
                     pack2<BF16>(x[6], x[7]));
  }
  *reinterpret_cast<uint4*>(dst) = raw;
}

}  // namespace attngen
