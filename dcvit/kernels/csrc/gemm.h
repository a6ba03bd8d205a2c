// The attention core's small products (q k^T, p v and their gradients) on q, k, v's strides.
#pragma once

#include "rows.h"

namespace dcvit {

// ---- GEMM for the attention core's small products (head dim x keys x queries, in cache).
// C (m, n) = alpha A B (+ C when acc), with A(i, k) = A[i ai + k] (ROWS) or A[i + k ak] (the
// transposed operand), read as broadcasts; B(k, j) = B[k bk + j bj] packed NR = 2 L columns
// at a time into a (K, NR) panel; C(i, j) = C[i ldc + j]. A kMR x NR register tile: 2 kMR
// accumulators, 2 panel loads and kMR broadcasts per k; kMR = 6 fills AVX2's 16 registers,
// 12 AVX-512's 32.
constexpr int64_t kMR = kVecBytes == 64 ? 12 : 6;

template <typename T, int MR, bool ROWS>
inline void gemm_tile(const T* __restrict a, int64_t as, const T* __restrict bp, int64_t K,
                      T* __restrict c, int64_t ldc, int64_t nc, T alpha, bool acc) {
  constexpr int64_t L = lanes<T>();
  auto at = [&](int i, int64_t k) __attribute__((always_inline)) {
    return vsplat(ROWS ? a[i * as + k] : a[i + k * as]);
  };
  Vec<T> c0[MR], c1[MR];
  {                                                   // k = 0 initialises (K >= 1)
    const Vec<T> b0 = vload(bp), b1 = vload(bp + L);
    for (int i = 0; i < MR; ++i) {
      const Vec<T> x = at(i, 0);
      c0[i] = x * b0;
      c1[i] = x * b1;
    }
  }
  for (int64_t k = 1; k < K; ++k) {
    const Vec<T> b0 = vload(bp + k * 2 * L), b1 = vload(bp + k * 2 * L + L);
    for (int i = 0; i < MR; ++i) {
      const Vec<T> x = at(i, k);
      c0[i] += x * b0;
      c1[i] += x * b1;
    }
  }
  const Vec<T> al = vsplat(alpha);
  for (int i = 0; i < MR; ++i) {
    T* ci = c + i * ldc;
    Vec<T> r0 = c0[i] * al, r1 = c1[i] * al;
    if (nc == 2 * L) {
      if (acc) { r0 += vload(ci); r1 += vload(ci + L); }
      vstore(ci, r0);
      vstore(ci + L, r1);
    } else {
      T tmp[2 * L];
      vstore(tmp, r0);
      vstore(tmp + L, r1);
      for (int64_t j = 0; j < nc; ++j) ci[j] = acc ? ci[j] + tmp[j] : tmp[j];
    }
  }
}

// B (K, n) as B(k, j) = B[k bk + j bj] -> panels (ceil(n / NR), K, NR), zero-padded columns.
template <typename T>
void pack_panels(int64_t K, int64_t n, const T* B, int64_t bk, int64_t bj, T* dst) {
  constexpr int64_t NR = 2 * lanes<T>();
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    T* panel = dst + j0 * K;
    const int64_t nc = std::min(NR, n - j0);
    if (bk == 1) {                                    // B^T rows are contiguous: read them whole
      for (int64_t j = 0; j < NR; ++j) {
        const T* src = B + (j0 + j) * bj;
        if (j < nc)
          for (int64_t k = 0; k < K; ++k) panel[k * NR + j] = src[k];
        else
          for (int64_t k = 0; k < K; ++k) panel[k * NR + j] = T(0);
      }
    } else {
      for (int64_t k = 0; k < K; ++k) {
        T* pk = panel + k * NR;
        const T* src = B + k * bk + j0 * bj;
        if (bj == 1 && nc == NR) {
          std::memcpy(pk, src, sizeof(T) * NR);
        } else {
          for (int64_t j = 0; j < nc; ++j) pk[j] = src[j * bj];
          for (int64_t j = nc; j < NR; ++j) pk[j] = T(0);
        }
      }
    }
  }
}

// Elements of `pack_panels`'s output for K x n.
template <typename T>
int64_t panels_size(int64_t K, int64_t n) {
  constexpr int64_t NR = 2 * lanes<T>();
  return (n + NR - 1) / NR * NR * K;
}

// The last rows < kMR rows of C: a tile of exactly `rows` (1 <= rows <= MR) rows.
template <typename T, int MR, bool ROWS>
inline void gemm_rest(int64_t rows, const T* a, int64_t as, const T* bp, int64_t K, T* c,
                      int64_t ldc, int64_t nc, T alpha, bool acc) {
  if constexpr (MR >= 1) {
    if (rows == MR) gemm_tile<T, MR, ROWS>(a, as, bp, K, c, ldc, nc, alpha, acc);
    else gemm_rest<T, MR - 1, ROWS>(rows, a, as, bp, K, c, ldc, nc, alpha, acc);
  }
}

template <typename T, bool ROWS>
void gemm_panels(int64_t m, int64_t n, int64_t K, T alpha, const T* A, int64_t as,
                 const T* panels, T* C, int64_t ldc, bool acc) {
  constexpr int64_t NR = 2 * lanes<T>();
  const int64_t ai = ROWS ? as : 1;                   // step of A between rows of C
  for (int64_t j0 = 0; j0 < n; j0 += NR) {
    const int64_t nc = std::min(NR, n - j0);
    const T* panel = panels + j0 * K;
    int64_t i = 0;
    for (; i + kMR <= m; i += kMR)
      gemm_tile<T, kMR, ROWS>(A + i * ai, as, panel, K, C + i * ldc + j0, ldc, nc, alpha, acc);
    if (i < m) gemm_rest<T, kMR - 1, ROWS>(m - i, A + i * ai, as, panel, K, C + i * ldc + j0, ldc, nc, alpha, acc);
  }
}

// A given as A(i, k) = A[i ai + k ak] with ak == 1 (rows) or ai == 1 (columns); B as
// `pack_panels` left it.
template <typename T>
void gemm(int64_t m, int64_t n, int64_t K, T alpha, const T* A, int64_t ai, int64_t ak,
          const T* packed, T* C, int64_t ldc, bool acc) {
  if (K < 1) return;                                  // never: K is D, S or a block of queries
  if (ak == 1)
    gemm_panels<T, true>(m, n, K, alpha, A, ai, packed, C, ldc, acc);
  else
    gemm_panels<T, false>(m, n, K, alpha, A, ak, packed, C, ldc, acc);
}

// A (B, H, N, D) tensor on its strides (the last one 1).
template <typename P>
struct Strided {
  P* ptr;
  int64_t sb, sh, st;
  P* at(int64_t b, int64_t h, int64_t t) const { return ptr + b * sb + h * sh + t * st; }
};

template <typename T>
struct Operands {
  Strided<const T> q, k, v;
  int64_t D;
  T scale;
};

// One batch element's k and v packed once for the products that read them whole, every head:
// k^T and v^T (D x S panels, for q k^T and g v^T), k and v (S x D panels, for ds k and p v).
template <typename T>
struct KeyPanels {
  int64_t per_t, per_d;
  std::vector<T> kt, vt, kd, vd;
  int64_t b = -1;
  KeyPanels(const Dims& n, int64_t D, bool backward)
      : per_t(panels_size<T>(D, n.S)), per_d(panels_size<T>(n.S, D)),
        kt(n.H * per_t), vt(backward ? n.H * per_t : 0), kd(backward ? n.H * per_d : 0),
        vd(n.H * per_d) {}
  void enter(const Operands<T>& o, int64_t bb, const Dims& n) {
    if (bb == b) return;
    b = bb;
    for (int64_t h = 0; h < n.H; ++h) {
      pack_panels<T>(o.D, n.S, o.k.at(b, h, 0), 1, o.k.st, kt.data() + h * per_t);
      pack_panels<T>(n.S, o.D, o.v.at(b, h, 0), o.v.st, 1, vd.data() + h * per_d);
      if (!vt.empty()) pack_panels<T>(o.D, n.S, o.v.at(b, h, 0), 1, o.v.st, vt.data() + h * per_t);
      if (!kd.empty()) pack_panels<T>(n.S, o.D, o.k.at(b, h, 0), o.k.st, 1, kd.data() + h * per_d);
    }
  }
  // tile[h] (tb, S) at head stride hs, row stride SP = scale q[b, h, t0:t0+tb] k[b, h]^T for
  // the entered batch element b.
  void scores(const Operands<T>& o, T* tile, int64_t t0, int64_t tb, int64_t hs,
              const Dims& n) const {
    for (int64_t h = 0; h < n.H; ++h)
      gemm<T>(tb, n.S, o.D, o.scale, o.q.at(b, h, t0), o.q.st, 1, kt.data() + h * per_t,
              tile + h * hs, n.SP, false);
  }
};

// Queries per tile: all of a batch element's, unless the tile (H, TB, SP) would pass ~512 KiB
// of float32 (so that a thread's tiles stay in its core's cache) or there are fewer batch
// elements than threads.
inline int64_t query_block(const Dims& n, int nthreads) {
  int64_t tb = n.T;
  if (n.B < nthreads) tb = (n.T * n.B + nthreads - 1) / nthreads;
  const int64_t budget = (int64_t{1} << 17) / (n.H * n.SP);
  if (tb > budget) tb = budget;
  tb = (tb + kMR - 1) / kMR * kMR;
  return std::max<int64_t>(kMR, std::min(tb, n.T));
}

}  // namespace dcvit
