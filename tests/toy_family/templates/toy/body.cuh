// The toy family's device code: one element per thread.
namespace toy {

template <typename T>
struct Params {
  const T* x;
  T* y;
  int n;
  float scale;
};

template <int THREADS, typename T>
__device__ __forceinline__ void scale(const Params<T>& p) {
  const int i = blockIdx.x * THREADS + threadIdx.x;
  if (i < p.n) p.y[i] = T(static_cast<float>(p.x[i]) * p.scale);
}

}  // namespace toy
