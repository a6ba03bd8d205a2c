// The one-pass builder of the per-token Compose matrices, and its backward.
#pragma once

#include "simd.h"

namespace dcvit {

// The dynamic Compose matrices of every (token, slot) from the raw low-rank projections:
// w (BN, G, 2R, H) holds w1 = w[:, :, :R] and w2 = w[:, :, R:], dd (BN, G, H) the gates (or
// null), ident (G) 1 on the slots that carry the skip connection:
//   m[n, g] = w1n^T w2 + diag(dd + ident),   w1n = w1 * rsqrt(mean_h w1^2 + eps)   (H, H)
template <typename T>
void slots_forward(const T* w, const T* dd, const int64_t* ident, T* m, int64_t BN, int64_t G,
                   int64_t R, int64_t H, T eps, int nthreads) {
  parallel_rows(BN * G, nthreads, [&](int64_t begin, int64_t end, int64_t) {
    std::vector<T> w1n(R * H);
    for (int64_t ng = begin; ng < end; ++ng) {
      const T* w1 = w + ng * 2 * R * H;
      const T* w2 = w1 + R * H;
      for (int64_t r = 0; r < R; ++r) {
        T ss = T(0);
        for (int64_t h = 0; h < H; ++h) ss += w1[r * H + h] * w1[r * H + h];
        const T s = T(1) / std::sqrt(ss / T(H) + eps);
        for (int64_t h = 0; h < H; ++h) w1n[r * H + h] = w1[r * H + h] * s;
      }
      T* mg = m + ng * H * H;
      for (int64_t i = 0; i < H; ++i)
        for (int64_t j = 0; j < H; ++j) {
          T acc = T(0);
          for (int64_t r = 0; r < R; ++r) acc += w1n[r * H + i] * w2[r * H + j];
          mg[i * H + j] = acc;
        }
      const T id = static_cast<T>(ident[ng % G]);
      for (int64_t i = 0; i < H; ++i) mg[i * H + i] += id + (dd != nullptr ? dd[ng * H + i] : T(0));
    }
  });
}

// Gradients of slots_forward: dm (BN, G, H, H) -> dw (BN, G, 2R, H) and ddd (BN, G, H) (or null).
template <typename T>
void slots_backward(const T* w, const T* dm, T* dw, T* ddd, int64_t BN, int64_t G, int64_t R,
                    int64_t H, T eps, int nthreads) {
  parallel_rows(BN * G, nthreads, [&](int64_t begin, int64_t end, int64_t) {
    std::vector<T> w1n(R * H), dw1n(R * H), scale(R);
    for (int64_t ng = begin; ng < end; ++ng) {
      const T* w1 = w + ng * 2 * R * H;
      const T* w2 = w1 + R * H;
      const T* d = dm + ng * H * H;
      T* dw1 = dw + ng * 2 * R * H;
      T* dw2 = dw1 + R * H;
      for (int64_t r = 0; r < R; ++r) {
        T ss = T(0);
        for (int64_t h = 0; h < H; ++h) ss += w1[r * H + h] * w1[r * H + h];
        scale[r] = T(1) / std::sqrt(ss / T(H) + eps);
        for (int64_t h = 0; h < H; ++h) w1n[r * H + h] = w1[r * H + h] * scale[r];
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t h = 0; h < H; ++h) {
          T a = T(0), b = T(0);
          for (int64_t k = 0; k < H; ++k) {
            a += w1n[r * H + k] * d[k * H + h];          // d w2[r, h]
            b += d[h * H + k] * w2[r * H + k];           // d w1n[r, h]
          }
          dw2[r * H + h] = a;
          dw1n[r * H + h] = b;
        }
      for (int64_t r = 0; r < R; ++r) {                  // through the RMS norm
        const T s = scale[r];
        T dot = T(0);
        for (int64_t h = 0; h < H; ++h) dot += dw1n[r * H + h] * w1[r * H + h];
        for (int64_t h = 0; h < H; ++h)
          dw1[r * H + h] = s * dw1n[r * H + h] - s * s * s / T(H) * w1[r * H + h] * dot;
      }
      if (ddd != nullptr)
        for (int64_t i = 0; i < H; ++i) ddd[ng * H + i] = d[i * H + i];
    }
  });
}

}  // namespace dcvit
