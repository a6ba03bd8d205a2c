// Vectors, exp and threads for the CPU kernels (no torch headers).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace dcvit {

// Vectors through GCC/Clang vector extensions, as wide as the build's registers: 64 bytes
// when built for AVX-512 (zmm, 32 of them), else 32 bytes (AVX2's ymm, 16 of them; the
// compiler splits them where the build has neither). L lanes of T.
#if defined(__AVX512F__)
#define DCVIT_VEC_BYTES 64
#else
#define DCVIT_VEC_BYTES 32
#endif
constexpr int64_t kVecBytes = DCVIT_VEC_BYTES;
template <typename T> struct VecOf { typedef T type __attribute__((vector_size(DCVIT_VEC_BYTES))); };
template <typename T> using Vec = typename VecOf<T>::type;
template <typename T> constexpr int64_t lanes() { return kVecBytes / sizeof(T); }
template <typename T> inline Vec<T> vload(const T* p) { Vec<T> v; std::memcpy(&v, p, sizeof v); return v; }
template <typename T> inline void vstore(T* p, Vec<T> v) { std::memcpy(p, &v, sizeof v); }
template <typename T> inline Vec<T> vsplat(T x) { return x - Vec<T>{}; }   // x - 0 == x, folds to a broadcast
template <typename T> inline T vsum(Vec<T> v) {
  T s = T(0);
  for (int64_t l = 0; l < lanes<T>(); ++l) s += v[l];
  return s;
}

// exp with a vectorisable body (Cephes polynomial, about 1 ulp): exp(-inf) = 0, NaN stays NaN.
#pragma omp declare simd
inline float vexp(float x) {
  const float xc = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  const float n = __builtin_floorf(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.3f ? 0.0f : y * scale;         // a NaN x stays NaN through y
}
inline double vexp(double x) { return std::exp(x); }

// Run fn(begin, end, tid) over [0, rows) split in nthreads contiguous ranges. With OpenMP the
// library links libgomp.so.1, which resolves to the copy torch has already loaded: the rows run
// on torch's own (already awake) worker threads instead of beside them.
template <typename F>
void parallel_rows(int64_t rows, int nthreads, F fn) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(nthreads, rows));
#ifdef _OPENMP
#pragma omp parallel num_threads(n)
  {
    const int64_t k = omp_get_thread_num(), m = omp_get_num_threads();
    fn(rows * k / m, rows * (k + 1) / m, k);
  }
#else
  std::vector<std::thread> pool;
  for (int64_t k = 1; k < n; ++k)
    pool.emplace_back(fn, rows * k / n, rows * (k + 1) / n, k);
  fn(0, rows / n, 0);
  for (auto& th : pool) th.join();
#endif
}

// Run fn(next) on min(nthreads, items) threads, next() handing out the items [0, items) one at
// a time, then -1: a thread slowed by a neighbour on a shared machine simply takes fewer.
template <typename F>
void parallel_items(int64_t items, int nthreads, F fn) {
  std::atomic<int64_t> counter{0};
  auto next = [&]() {
    const int64_t i = counter.fetch_add(1, std::memory_order_relaxed);
    return i < items ? i : int64_t{-1};
  };
  parallel_rows(items, nthreads, [&](int64_t, int64_t, int64_t) { fn(next); });
}

}  // namespace dcvit
