"""C++ kernels for DCMHA on CPU, each with its backward: the whole attention core (q k^T ->
rows -> p v per batch element and block of queries in each thread's cache-sized tiles, the
products by the kernel's own register-tiled GEMM on q, k, v's strides); the rows alone (for
the Python-tiled path); and the one-pass builder of the per-token Compose matrices.

Plain C++ (no torch headers) compiled on first use with the system's ``g++`` (about 20 s,
once per machine and source) into ``$DCVIT_KERNEL_CACHE`` (default ``~/.cache/dcvit``) and
called through ``ctypes`` on tensor data pointers. Built with ``-fopenmp`` when torch runs
on GNU OpenMP, so that ``libgomp.so.1`` resolves to torch's own copy and the kernels run on
torch's worker threads; with plain threads otherwise. When it cannot be built or loaded,
`load` warns once and returns None, and `dcvit.fused` uses its pure-PyTorch path. Set
``DCVIT_NO_CPP_KERNEL=1`` to skip it.

One "row" is (b, t): the scores of every head of one query against all S keys, an (H, S)
block that is composed, soft-maxed and composed again in 32-byte vectors, one block of keys
at a time with every head's accumulator in registers. Each Compose stage applies, per key
s, the H×H map::

    out[h, s] = sum_g in[g, s] * (mq[b, t, g, h] + mk[b, s, g, h])

where ``mq`` (B, T, H, H) holds the identity, the static matrix and the query-wise terms,
and ``mk`` (B, S, H, H), repacked per batch element so that a block of keys is contiguous,
the key-wise terms; a null pointer marks an absent stage or side.
"""
import ctypes
import hashlib
import os
import subprocess
import sys
import tempfile
import warnings
from typing import Any, Dict, List, Optional

import torch

__all__ = ["load", "available", "function", "ptr", "SOURCE"]

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>
#include <thread>
#include <type_traits>
#ifdef _OPENMP
#include <omp.h>
#endif

namespace {

// 32-byte vectors through GCC/Clang vector extensions (AVX2 registers where the CPU has them;
// the compiler splits them elsewhere). L lanes of T.
template <typename T> struct VecOf { typedef T type __attribute__((vector_size(32))); };
template <typename T> using Vec = typename VecOf<T>::type;
template <typename T> constexpr int64_t lanes() { return 32 / sizeof(T); }
template <typename T> inline Vec<T> vload(const T* p) { Vec<T> v; std::memcpy(&v, p, sizeof v); return v; }
template <typename T> inline void vstore(T* p, Vec<T> v) { std::memcpy(p, &v, sizeof v); }
template <typename T> inline Vec<T> vsplat(T x) { return x - Vec<T>{}; }   // x - 0 == x, folds to a broadcast
template <typename T> inline T vsum(Vec<T> v) {
  T s = T(0);
  for (int64_t l = 0; l < lanes<T>(); ++l) s += v[l];
  return s;
}

// Heads are a template argument (HC > 0) for the usual head counts, so that a block of keys
// keeps every head's accumulator in registers; HC == 0 reads the count at run time.
constexpr int64_t kMaxHeads = 64;
template <int HC> inline int64_t heads(int64_t h) { return HC > 0 ? HC : h; }
template <int HC> constexpr int64_t acc_size() { return HC > 0 ? HC : kMaxHeads; }

// A row holds one query's scores against all S keys for every head: (H, S) at head stride hs.
// Rows of the caller's tensors have len == S; the kernel's own row buffers are padded with
// zeros to SP = nb * L keys (len == SP) so that every block of L keys is a full vector.
template <typename T>
struct Row {
  T* ptr;
  int64_t hs, len;
  int64_t full_blocks() const { return len / lanes<T>(); }
  // TAIL: the block may run past len (the last, partial block of a tensor row).
  template <bool TAIL = true>
  Vec<T> load(int64_t h, int64_t blk) const {
    const int64_t s = blk * lanes<T>();
    const T* p = ptr + h * hs + s;
    if (!TAIL || s + lanes<T>() <= len) return vload(p);
    Vec<T> v{};
    std::memcpy(&v, p, sizeof(T) * (len - s));
    return v;
  }
  template <bool TAIL = true>
  void store(int64_t h, int64_t blk, Vec<T> v) const {
    const int64_t s = blk * lanes<T>();
    T* p = ptr + h * hs + s;
    if (!TAIL || s + lanes<T>() <= len) vstore(p, v);
    else std::memcpy(p, &v, sizeof(T) * (len - s));
  }
};

// Key-wise matrices are repacked per batch element as (nb, H, H, L): one key block's H×H
// coefficients are contiguous.
//
// out[i, :] = sum_j in[j, :] * (m[j, i] + mk[blk, j, i, :])   (TR: m[i, j], mk[blk, i, j, :])
template <typename T, int HC, bool TR, bool KEYS>
void mix_blocks(const Row<T> in, const Row<T> out, const T* __restrict__ m, const T* __restrict__ mk,
                int64_t h, int64_t nb) {
  constexpr int64_t L = lanes<T>();
  const int64_t H = heads<HC>(h);
  auto block = [&](int64_t blk, auto tail) __attribute__((always_inline)) {
    constexpr bool TAIL = decltype(tail)::value;
    Vec<T> acc[acc_size<HC>()];
    for (int64_t i = 0; i < H; ++i) acc[i] = Vec<T>{};
    const T* __restrict__ kb = KEYS ? mk + blk * H * H * L : nullptr;
    for (int64_t j = 0; j < H; ++j) {
      const Vec<T> x = in.template load<TAIL>(j, blk);
      for (int64_t i = 0; i < H; ++i) {
        const int64_t idx = TR ? i * H + j : j * H + i;
        Vec<T> c = vsplat(m[idx]);
        if (KEYS) c += vload(kb + idx * L);
        acc[i] += x * c;
      }
    }
    for (int64_t i = 0; i < H; ++i) out.template store<TAIL>(i, blk, acc[i]);
  };
  const int64_t full = std::min({in.full_blocks(), out.full_blocks(), nb});
  int64_t blk = 0;
  for (; blk < full; ++blk) block(blk, std::false_type{});
  for (; blk < nb; ++blk) block(blk, std::true_type{});
}

template <typename T, int HC, bool TR>
void mix(const Row<T> in, const Row<T> out, const T* m, const T* mk, int64_t h, int64_t nb) {
  if (mk != nullptr) mix_blocks<T, HC, TR, true>(in, out, m, mk, h, nb);
  else mix_blocks<T, HC, TR, false>(in, out, m, mk, h, nb);
}

// dm[g, h] = sum_s a[g, s] d[h, s];  dmk[blk, g, h, :] += a[g, blk] * d[h, blk]  (dmk may be null).
template <typename T, int HC, bool KEYS>
void mix_grad_blocks(const Row<T> a, const Row<T> d, T* __restrict__ dm, T* __restrict__ dmk,
                     int64_t h, int64_t nb) {
  constexpr int64_t L = lanes<T>();
  const int64_t H = heads<HC>(h);
  const int64_t full = std::min({a.full_blocks(), d.full_blocks(), nb});
  for (int64_t g = 0; g < H; ++g) {
    Vec<T> acc[acc_size<HC>()];
    for (int64_t i = 0; i < H; ++i) acc[i] = Vec<T>{};
    auto block = [&](int64_t blk, auto tail) __attribute__((always_inline)) {
      constexpr bool TAIL = decltype(tail)::value;
      const Vec<T> x = a.template load<TAIL>(g, blk);
      T* __restrict__ kb = KEYS ? dmk + (blk * H + g) * H * L : nullptr;
      for (int64_t i = 0; i < H; ++i) {
        const Vec<T> p = x * d.template load<TAIL>(i, blk);
        acc[i] += p;
        if (KEYS) vstore(kb + i * L, vload(kb + i * L) + p);
      }
    };
    int64_t blk = 0;
    for (; blk < full; ++blk) block(blk, std::false_type{});
    for (; blk < nb; ++blk) block(blk, std::true_type{});
    for (int64_t i = 0; i < H; ++i) dm[g * H + i] = vsum<T>(acc[i]);
  }
}

template <typename T, int HC>
void mix_grad(const Row<T> a, const Row<T> d, T* dm, T* dmk, int64_t h, int64_t nb) {
  if (dmk != nullptr) mix_grad_blocks<T, HC, true>(a, d, dm, dmk, h, nb);
  else mix_grad_blocks<T, HC, false>(a, d, dm, dmk, h, nb);
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

// x (H, SP) += mask row, softmax over the first S keys of each head; padding set to 0.
template <typename T>
void mask_softmax(T* __restrict__ x, const T* mask, int64_t msh, int64_t mss, int64_t H, int64_t S,
                  int64_t SP) {
  for (int64_t h = 0; h < H; ++h) {
    T* __restrict__ r = x + h * SP;
    if (mask != nullptr) {
      const T* mr = mask + h * msh;
      for (int64_t s = 0; s < S; ++s) r[s] += mr[s * mss];
    }
    for (int64_t s = S; s < SP; ++s) r[s] = -std::numeric_limits<T>::infinity();
    T mx = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t s = 0; s < SP; ++s) mx = r[s] > mx ? r[s] : mx;
    T sum = T(0);
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < SP; ++s) {
      const T e = vexp(r[s] - mx);
      r[s] = e;
      sum += e;
    }
    const T inv = T(1) / sum;
#pragma omp simd
    for (int64_t s = 0; s < SP; ++s) r[s] *= inv;
  }
}

// d = p * (d - sum_s p d), per head (the softmax backward, in place).
template <typename T>
void softmax_grad(const T* __restrict__ p, T* __restrict__ d, int64_t H, int64_t SP) {
  for (int64_t h = 0; h < H; ++h) {
    const T* __restrict__ pr = p + h * SP;
    T* __restrict__ dr = d + h * SP;
    T dot = T(0);
#pragma omp simd reduction(+ : dot)
    for (int64_t s = 0; s < SP; ++s) dot += pr[s] * dr[s];
#pragma omp simd
    for (int64_t s = 0; s < SP; ++s) dr[s] = pr[s] * (dr[s] - dot);
  }
}

// Copy a row into another (a padded buffer's padding is zero-filled).
template <typename T>
void copy_row(const Row<T> src, const Row<T> dst, int64_t H) {
  const int64_t n = std::min(src.len, dst.len);
  for (int64_t h = 0; h < H; ++h) {
    std::memcpy(dst.ptr + h * dst.hs, src.ptr + h * src.hs, sizeof(T) * n);
    std::fill(dst.ptr + h * dst.hs + n, dst.ptr + h * dst.hs + dst.len, T(0));
  }
}

// (S, H, H) key-wise matrices of one batch element -> (nb, H, H, L), zero-padded; and back.
template <typename T>
void pack_keys(const T* src, T* dst, int64_t H, int64_t S, int64_t nb) {
  constexpr int64_t L = lanes<T>();
  for (int64_t blk = 0; blk < nb; ++blk)
    for (int64_t idx = 0; idx < H * H; ++idx)
      for (int64_t l = 0; l < L; ++l) {
        const int64_t s = blk * L + l;
        dst[(blk * H * H + idx) * L + l] = s < S ? src[s * H * H + idx] : T(0);
      }
}
template <typename T>
void unpack_keys(const T* src, T* dst, int64_t H, int64_t S, int64_t nb) {
  constexpr int64_t L = lanes<T>();
  for (int64_t blk = 0; blk < nb; ++blk)
    for (int64_t idx = 0; idx < H * H; ++idx)
      for (int64_t l = 0; l < L && blk * L + l < S; ++l)
        dst[(blk * L + l) * H * H + idx] = src[(blk * H * H + idx) * L + l];
}

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

struct Mask {
  const void* ptr;
  int64_t sb, sh, st, ss;
};

struct Dims {
  int64_t B, H, T, S, nb, SP;
};

template <typename T>
Dims dims(int64_t B, int64_t H, int64_t T_, int64_t S) {
  const int64_t nb = (S + lanes<T>() - 1) / lanes<T>();
  return Dims{B, H, T_, S, nb, nb * lanes<T>()};
}

// One thread's buffers: two padded rows and the packed key-wise matrices of its current
// batch element.
template <typename T>
struct Scratch {
  std::vector<T> p, d, mk1, mk2;
  int64_t b = -1;
  explicit Scratch(const Dims& n) : p(n.H * n.SP), d(n.H * n.SP),
                                    mk1(n.nb * n.H * n.H * lanes<T>()),
                                    mk2(n.nb * n.H * n.H * lanes<T>()) {}
  void enter(int64_t bb, const Dims& n, const T* k1, const T* k2) {
    if (bb == b) return;
    b = bb;
    const int64_t hhs = n.H * n.H * n.S;
    if (k1 != nullptr) pack_keys<T>(k1 + bb * hhs, mk1.data(), n.H, n.S, n.nb);
    if (k2 != nullptr) pack_keys<T>(k2 + bb * hhs, mk2.data(), n.H, n.S, n.nb);
  }
  Row<T> buf(std::vector<T>& v, const Dims& n) { return Row<T>{v.data(), n.SP, n.SP}; }
};

// The key-wise matrix gradients of one batch element, summed in the packed (nb, H, H, L) layout.
template <typename T>
struct KeyGrads {
  std::vector<T> p1, p2;
  KeyGrads(const Dims& n, bool one, bool two)
      : p1(one ? n.nb * n.H * n.H * lanes<T>() : 0), p2(two ? n.nb * n.H * n.H * lanes<T>() : 0) {}
  T* g1() { return p1.empty() ? nullptr : p1.data(); }
  T* g2() { return p2.empty() ? nullptr : p2.data(); }
  // Write batch element b's sums to dst*[b] (dst*: (B, S, H, H)) and restart from zero.
  void flush(int64_t b, const Dims& n, T* dst1, T* dst2) {
    if (b < 0) return;
    const int64_t hhs = n.H * n.H * n.S;
    if (!p1.empty()) unpack_keys<T>(p1.data(), dst1 + b * hhs, n.H, n.S, n.nb);
    if (!p2.empty()) unpack_keys<T>(p2.data(), dst2 + b * hhs, n.H, n.S, n.nb);
    std::fill(p1.begin(), p1.end(), T(0));
    std::fill(p2.begin(), p2.end(), T(0));
  }
};

// ---- GEMM for the attention core's small products (head dim x keys x queries, in cache).
// C (m, n) = alpha A B (+ C when acc), with A(i, k) = A[i ai + k] (ROWS) or A[i + k ak] (the
// transposed operand), read as broadcasts; B(k, j) = B[k bk + j bj] packed NR = 2 L columns
// at a time into a (K, NR) panel; C(i, j) = C[i ldc + j]. A 6 x NR register tile: 12
// accumulators, 2 panel loads and 6 broadcasts per k.
constexpr int64_t kMR = 6;

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
    const T* a = A + i * ai;
    T* c = C + i * ldc + j0;
    switch (m - i) {
      case 5: gemm_tile<T, 5, ROWS>(a, as, panel, K, c, ldc, nc, alpha, acc); break;
      case 4: gemm_tile<T, 4, ROWS>(a, as, panel, K, c, ldc, nc, alpha, acc); break;
      case 3: gemm_tile<T, 3, ROWS>(a, as, panel, K, c, ldc, nc, alpha, acc); break;
      case 2: gemm_tile<T, 2, ROWS>(a, as, panel, K, c, ldc, nc, alpha, acc); break;
      case 1: gemm_tile<T, 1, ROWS>(a, as, panel, K, c, ldc, nc, alpha, acc); break;
      default: break;
    }
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

template <typename T, int HC>
struct Rows {
  // p = softmax(compose1(a) + mask) for row (b, t) into the padded buffer p.
  static void probs(const Row<T> a, const Row<T> p, const Dims& n, const Mask& mask, const T* mq1,
                    const T* mk1, int64_t b, int64_t t) {
    if (mq1 != nullptr) mix<T, HC, false>(a, p, mq1, mk1, n.H, n.nb);
    else copy_row<T>(a, p, n.H);
    const T* m_row = mask.ptr == nullptr ? nullptr
        : static_cast<const T*>(mask.ptr) + b * mask.sb + t * mask.st;
    mask_softmax<T>(p.ptr, m_row, mask.sh, mask.ss, n.H, n.S, n.SP);
  }

  static void forward(const T* s0, T* p2, Mask mask, const T* mq1, const T* mk1, const T* mq2,
                      const T* mk2, const Dims n, int nthreads) {
    const int64_t hs = n.T * n.S, HH = n.H * n.H;
    parallel_rows(n.B * n.T, nthreads, [&](int64_t begin, int64_t end, int64_t) {
      Scratch<T> w(n);
      const Row<T> p = w.buf(w.p, n);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / n.T, t = row % n.T, off = (b * n.H * n.T + t) * n.S;
        w.enter(b, n, mk1, mk2);
        const Row<T> a{const_cast<T*>(s0) + off, hs, n.S}, out{p2 + off, hs, n.S};
        probs(a, p, n, mask, mq1 ? mq1 + row * HH : nullptr, mk1 ? w.mk1.data() : nullptr, b, t);
        if (mq2 != nullptr)
          mix<T, HC, false>(p, out, mq2 + row * HH, mk2 ? w.mk2.data() : nullptr, n.H, n.nb);
        else
          copy_row<T>(p, out, n.H);
      }
    });
  }

  // Row (b, t) backward: recompute it from its scores a, write the composed weights to out,
  // back-propagate g (the weights' gradient) through compose2, softmax and compose1 into da (which
  // may be g itself: g is read before da is written), the query-wise matrix gradients into
  // dmq*r and the key-wise ones added to the packed accumulators g1/g2 (null: not wanted).
  static void backward_row(const Row<T> a, const Row<T> g, const Row<T> out, const Row<T> da,
                           Scratch<T>& w, const Dims& n, const Mask& mask, const T* mq1r,
                           const T* k1, const T* mq2r, const T* k2, T* dmq1r, T* g1, T* dmq2r,
                           T* g2, int64_t b, int64_t t) {
    const Row<T> p = w.buf(w.p, n), d = w.buf(w.d, n);
    probs(a, p, n, mask, mq1r, k1, b, t);
    if (mq2r != nullptr) {
      mix<T, HC, false>(p, out, mq2r, k2, n.H, n.nb);
      mix<T, HC, true>(g, d, mq2r, k2, n.H, n.nb);
      mix_grad<T, HC>(p, g, dmq2r, g2, n.H, n.nb);
    } else {
      copy_row<T>(p, out, n.H);
      copy_row<T>(g, d, n.H);
    }
    softmax_grad<T>(p.ptr, d.ptr, n.H, n.SP);
    if (mq1r != nullptr) {
      mix<T, HC, true>(d, da, mq1r, k1, n.H, n.nb);
      mix_grad<T, HC>(a, d, dmq1r, g1, n.H, n.nb);
    } else {
      copy_row<T>(d, da, n.H);
    }
  }

  // Backward of `forward` over rows of (B, H, T, S) tensors.
  // dmk*_acc: (nthreads, B, S, H, H), zero-filled by the caller; each thread writes the
  // key-wise gradients of the batch elements it covers into its own slice.
  static void backward(const T* s0, const T* dp2, T* p2, T* ds0, Mask mask, const T* mq1,
                       const T* mk1, const T* mq2, const T* mk2, T* dmq1, T* dmk1_acc, T* dmq2,
                       T* dmk2_acc, const Dims n, int nthreads) {
    const int64_t hs = n.T * n.S, HH = n.H * n.H, hhs = HH * n.S;
    parallel_rows(n.B * n.T, nthreads, [&](int64_t begin, int64_t end, int64_t tid) {
      Scratch<T> w(n);
      KeyGrads<T> kg(n, dmk1_acc != nullptr, dmk2_acc != nullptr);
      T* acc1 = dmk1_acc ? dmk1_acc + tid * n.B * hhs : nullptr;
      T* acc2 = dmk2_acc ? dmk2_acc + tid * n.B * hhs : nullptr;
      for (int64_t row = begin; row < end; ++row) {
        const int64_t b = row / n.T, t = row % n.T, off = (b * n.H * n.T + t) * n.S;
        if (b != w.b) kg.flush(w.b, n, acc1, acc2);
        w.enter(b, n, mk1, mk2);
        const Row<T> a{const_cast<T*>(s0) + off, hs, n.S}, g{const_cast<T*>(dp2) + off, hs, n.S};
        const Row<T> out{p2 + off, hs, n.S}, da{ds0 + off, hs, n.S};
        backward_row(a, g, out, da, w, n, mask, mq1 ? mq1 + row * HH : nullptr,
                     mk1 ? w.mk1.data() : nullptr, mq2 ? mq2 + row * HH : nullptr,
                     mk2 ? w.mk2.data() : nullptr, dmq1 ? dmq1 + row * HH : nullptr, kg.g1(),
                     dmq2 ? dmq2 + row * HH : nullptr, kg.g2(), b, t);
      }
      kg.flush(w.b, n, acc1, acc2);
    });
  }

  // The whole attention core of one layer, flash-style: for each batch element and block of
  // queries, q k^T -> rows -> p v in the thread's own cache-sized tiles (GEMMs by `gemm`), the
  // output written on its strides. The tile's rows live at row stride SP, head stride TB * SP.
  static void attention_forward(const Operands<T>& o, const Strided<T> out, Mask mask, const T* mq1,
                                const T* mk1, const T* mq2, const T* mk2, const Dims n,
                                int nthreads) {
    const int64_t TB = query_block(n, nthreads), nq = (n.T + TB - 1) / TB, HH = n.H * n.H;
    parallel_items(n.B * nq, nthreads, [&](auto next) {
      Scratch<T> w(n);
      std::vector<T> st(n.H * TB * n.SP), pt(n.H * TB * n.SP);
      KeyPanels<T> kp(n, o.D, false);
      for (int64_t item; (item = next()) >= 0;) {
        const int64_t b = item / nq, t0 = (item % nq) * TB, tb = std::min(TB, n.T - t0);
        w.enter(b, n, mk1, mk2);
        kp.enter(o, b, n);
        kp.scores(o, st.data(), t0, tb, TB * n.SP, n);
        for (int64_t r = 0; r < tb; ++r) {
          const int64_t row = b * n.T + t0 + r;
          const Row<T> a{st.data() + r * n.SP, TB * n.SP, n.S}, p = w.buf(w.p, n);
          const Row<T> p2{pt.data() + r * n.SP, TB * n.SP, n.S};
          probs(a, p, n, mask, mq1 ? mq1 + row * HH : nullptr, mk1 ? w.mk1.data() : nullptr, b, t0 + r);
          if (mq2 != nullptr)
            mix<T, HC, false>(p, p2, mq2 + row * HH, mk2 ? w.mk2.data() : nullptr, n.H, n.nb);
          else
            copy_row<T>(p, p2, n.H);
        }
        for (int64_t h = 0; h < n.H; ++h)                      // out[b, h, t0:] = p2 v
          gemm<T>(tb, o.D, n.S, T(1), pt.data() + h * TB * n.SP, n.SP, 1,
                  kp.vd.data() + h * kp.per_d, out.at(b, h, t0), out.st, false);
      }
    });
  }

  // Backward of `attention_forward`, one batch element per work item (so that the key-side
  // gradients dk, dv and dmk* of b are summed by one thread, in place). Work items are handed
  // out one at a time in both directions.
  static void attention_backward(const Operands<T>& o, const T* grad, const int64_t* gs, T* dq,
                                 T* dk, T* dv, Mask mask, const T* mq1, const T* mk1, const T* mq2,
                                 const T* mk2, T* dmq1, T* dmk1, T* dmq2, T* dmk2, const Dims n,
                                 int nthreads) {
    const int64_t TB = query_block(n, 1), HH = n.H * n.H, D = o.D;
    const Strided<const T> g{grad, gs[0], gs[1], gs[2]};
    parallel_items(n.B, nthreads, [&](auto next) {
      Scratch<T> w(n);
      KeyGrads<T> kg(n, dmk1 != nullptr, dmk2 != nullptr);
      std::vector<T> st(n.H * TB * n.SP), pt(n.H * TB * n.SP), gt(n.H * TB * n.SP);
      std::vector<T> panel(panels_size<T>(TB, D));     // a block of g or q rows
      KeyPanels<T> kp(n, D, true);
      const int64_t hs = TB * n.SP;
      for (int64_t b; (b = next()) >= 0;) {
        w.enter(b, n, mk1, mk2);
        kp.enter(o, b, n);
        for (int64_t t0 = 0; t0 < n.T; t0 += TB) {
          const int64_t tb = std::min(TB, n.T - t0);
          const bool acc = t0 > 0;
          kp.scores(o, st.data(), t0, tb, hs, n);
          for (int64_t h = 0; h < n.H; ++h)                    // dp2 = g v^T
            gemm<T>(tb, n.S, D, T(1), g.at(b, h, t0), g.st, 1, kp.vt.data() + h * kp.per_t,
                    gt.data() + h * hs, n.SP, false);
          for (int64_t r = 0; r < tb; ++r) {
            const int64_t row = b * n.T + t0 + r;
            const Row<T> a{st.data() + r * n.SP, hs, n.S}, gr{gt.data() + r * n.SP, hs, n.S};
            const Row<T> p2{pt.data() + r * n.SP, hs, n.S};
            backward_row(a, gr, p2, gr, w, n, mask, mq1 ? mq1 + row * HH : nullptr,
                         mk1 ? w.mk1.data() : nullptr, mq2 ? mq2 + row * HH : nullptr,
                         mk2 ? w.mk2.data() : nullptr, dmq1 ? dmq1 + row * HH : nullptr, kg.g1(),
                         dmq2 ? dmq2 + row * HH : nullptr, kg.g2(), b, t0 + r);
          }
          for (int64_t h = 0; h < n.H; ++h) {                  // gt now holds ds = d(scores)
            T* dvh = dv + (b * n.H + h) * n.S * D;
            T* dkh = dk + (b * n.H + h) * n.S * D;
            pack_panels<T>(tb, D, g.at(b, h, t0), g.st, 1, panel.data());
            gemm<T>(n.S, D, tb, T(1), pt.data() + h * hs, 1, n.SP, panel.data(), dvh, D,
                    acc);                                     // dv += p2^T g
            gemm<T>(tb, D, n.S, o.scale, gt.data() + h * hs, n.SP, 1, kp.kd.data() + h * kp.per_d,
                    dq + ((b * n.H + h) * n.T + t0) * D, D, false);   // dq = ds k
            pack_panels<T>(tb, D, o.q.at(b, h, t0), o.q.st, 1, panel.data());
            gemm<T>(n.S, D, tb, o.scale, gt.data() + h * hs, 1, n.SP, panel.data(), dkh, D,
                    acc);                                     // dk += ds^T q
          }
        }
        kg.flush(b, n, dmk1, dmk2);
      }
    });
  }
};

// Dispatch on the head count: float32 rows are compiled with the usual counts fixed (ViT-Ti
// to ViT-L); float64 (used to check the maths) and other counts read it at run time.
template <typename T, typename F>
void with_heads(int64_t H, F fn) {
  if constexpr (std::is_same<T, float>::value) {
    switch (H) {
      case 3: return fn(Rows<T, 3>{});
      case 4: return fn(Rows<T, 4>{});
      case 6: return fn(Rows<T, 6>{});
      case 8: return fn(Rows<T, 8>{});
      case 12: return fn(Rows<T, 12>{});
      case 16: return fn(Rows<T, 16>{});
      default: break;
    }
  }
  fn(Rows<T, 0>{});
}

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

}  // namespace

#define DCVIT_EXPORT(T, SUFFIX)                                                                   \
  extern "C" int dcvit_rows_forward_##SUFFIX(                                                     \
      const T* s0, T* p2, const T* mask, int64_t msb, int64_t msh, int64_t mst, int64_t mss,      \
      const T* mq1, const T* mk1, const T* mq2, const T* mk2,                                     \
      int64_t B, int64_t H, int64_t T_, int64_t S, int nthreads) {                                \
    if (H > kMaxHeads) return 1;                                                                  \
    const Dims n = dims<T>(B, H, T_, S);                                                          \
    with_heads<T>(H, [&](auto rows) {                                                             \
      rows.forward(s0, p2, Mask{mask, msb, msh, mst, mss}, mq1, mk1, mq2, mk2, n, nthreads);     \
    });                                                                                           \
    return 0;                                                                                     \
  }                                                                                               \
  extern "C" int dcvit_rows_backward_##SUFFIX(                                                    \
      const T* s0, const T* dp2, T* p2, T* ds0, const T* mask, int64_t msb, int64_t msh,         \
      int64_t mst, int64_t mss, const T* mq1, const T* mk1, const T* mq2, const T* mk2,           \
      T* dmq1, T* dmk1_acc, T* dmq2, T* dmk2_acc, int64_t B, int64_t H, int64_t T_, int64_t S,    \
      int nthreads) {                                                                             \
    if (H > kMaxHeads) return 1;                                                                  \
    const Dims n = dims<T>(B, H, T_, S);                                                          \
    with_heads<T>(H, [&](auto rows) {                                                             \
      rows.backward(s0, dp2, p2, ds0, Mask{mask, msb, msh, mst, mss}, mq1, mk1, mq2, mk2,        \
                    dmq1, dmk1_acc, dmq2, dmk2_acc, n, nthreads);                                 \
    });                                                                                           \
    return 0;                                                                                     \
  }

DCVIT_EXPORT(float, f32)
DCVIT_EXPORT(double, f64)

// q, k, v (B, H, N, D) on their strides (st: q, k, v, out/grad as (sb, sh, st) triples); out on
// its strides; dq, dk, dv contiguous; dmq* (B, T, H, H), dmk* (B, S, H, H) written in full.
#define DCVIT_EXPORT_ATTENTION(T, SUFFIX)                                                         \
  extern "C" int dcvit_attention_forward_##SUFFIX(                                                \
      const T* q, const T* k, const T* v, T* out, const int64_t* st, const T* mask, int64_t msb,  \
      int64_t msh, int64_t mst, int64_t mss, const T* mq1, const T* mk1, const T* mq2,            \
      const T* mk2, int64_t B, int64_t H, int64_t T_, int64_t S, int64_t D, double scale,         \
      int nthreads) {                                                                             \
    if (H > kMaxHeads) return 1;                                                                  \
    const Dims n = dims<T>(B, H, T_, S);                                                          \
    const Operands<T> o{{q, st[0], st[1], st[2]}, {k, st[3], st[4], st[5]},                       \
                        {v, st[6], st[7], st[8]}, D, static_cast<T>(scale)};                      \
    with_heads<T>(H, [&](auto rows) {                                                             \
      rows.attention_forward(o, Strided<T>{out, st[9], st[10], st[11]},                           \
                             Mask{mask, msb, msh, mst, mss}, mq1, mk1, mq2, mk2, n, nthreads);    \
    });                                                                                           \
    return 0;                                                                                     \
  }                                                                                               \
  extern "C" int dcvit_attention_backward_##SUFFIX(                                               \
      const T* q, const T* k, const T* v, const T* grad, const int64_t* st, T* dq, T* dk, T* dv,  \
      const T* mask, int64_t msb, int64_t msh, int64_t mst, int64_t mss, const T* mq1,            \
      const T* mk1, const T* mq2, const T* mk2, T* dmq1, T* dmk1, T* dmq2, T* dmk2, int64_t B,    \
      int64_t H, int64_t T_, int64_t S, int64_t D, double scale, int nthreads) {                  \
    if (H > kMaxHeads) return 1;                                                                  \
    const Dims n = dims<T>(B, H, T_, S);                                                          \
    const Operands<T> o{{q, st[0], st[1], st[2]}, {k, st[3], st[4], st[5]},                       \
                        {v, st[6], st[7], st[8]}, D, static_cast<T>(scale)};                      \
    with_heads<T>(H, [&](auto rows) {                                                             \
      rows.attention_backward(o, grad, st + 9, dq, dk, dv, Mask{mask, msb, msh, mst, mss}, mq1,   \
                              mk1, mq2, mk2, dmq1, dmk1, dmq2, dmk2, n, nthreads);                \
    });                                                                                           \
    return 0;                                                                                     \
  }

DCVIT_EXPORT_ATTENTION(float, f32)
DCVIT_EXPORT_ATTENTION(double, f64)

#define DCVIT_EXPORT_SLOTS(T, SUFFIX)                                                             \
  extern "C" void dcvit_slots_forward_##SUFFIX(const T* w, const T* dd, const int64_t* ident,     \
                                               T* m, int64_t BN, int64_t G, int64_t R, int64_t H, \
                                               double eps, int nthreads) {                        \
    slots_forward<T>(w, dd, ident, m, BN, G, R, H, static_cast<T>(eps), nthreads);                \
  }                                                                                               \
  extern "C" void dcvit_slots_backward_##SUFFIX(const T* w, const T* dm, T* dw, T* ddd,           \
                                                int64_t BN, int64_t G, int64_t R, int64_t H,      \
                                                double eps, int nthreads) {                       \
    slots_backward<T>(w, dm, dw, ddd, BN, G, R, H, static_cast<T>(eps), nthreads);                \
  }

DCVIT_EXPORT_SLOTS(float, f32)
DCVIT_EXPORT_SLOTS(double, f64)
"""

_state: Dict[str, Any] = {}


def _cpu_flags() -> List[str]:
    """Vector flags the build machine supports (each flag set is built and cached apart)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return ["-mavx2", "-mfma"] if "avx2" in flags and "fma" in flags else []


def _shares_torch_openmp() -> bool:
    """Whether torch runs on GNU OpenMP (libgomp.so.1 is loaded): a kernel built with -fopenmp
    then resolves libgomp.so.1 to that same copy and shares torch's thread pool."""
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


def _build(cache_dir: str, openmp: bool) -> str:
    """Compile SOURCE into cache_dir (atomically) unless already there; return the .so path."""
    cxx = os.environ.get("CXX", "g++")
    flags = ["-O3", "-fno-trapping-math", "-fopenmp" if openmp else "-fopenmp-simd", "-pthread",
             "-shared", "-fPIC", "-std=c++17"] + _cpu_flags()
    tag = hashlib.sha1((SOURCE + cxx + " ".join(flags)).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, f"dcvit_compose_cpu_{tag}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src, out = os.path.join(tmp, "compose_cpu.cpp"), os.path.join(tmp, "out.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        sys.stderr.write(f"dcvit: building the C++ attention kernel into {cache_dir} "
                         "(once per machine, about 20 s)\n")
        proc = subprocess.run([cxx, *flags, src, "-o", out], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[:300]}")
        os.replace(out, path)
    return path


def load() -> Optional[ctypes.CDLL]:
    """The compiled library (``dcvit_{rows,slots}_{forward,backward}_{f32,f64}``), or None."""
    if "lib" in _state:
        return _state["lib"]
    lib = None
    if os.environ.get("DCVIT_NO_CPP_KERNEL", "") in ("", "0"):
        cache_dir = os.environ.get("DCVIT_KERNEL_CACHE",
                                   os.path.join(os.path.expanduser("~"), ".cache", "dcvit"))
        reason = ""
        for openmp in ([True, False] if _shares_torch_openmp() else [False]):
            try:
                lib = ctypes.CDLL(_build(cache_dir, openmp))
                for name in ("dcvit_rows_forward_f32", "dcvit_rows_forward_f64",
                             "dcvit_rows_backward_f32", "dcvit_rows_backward_f64",
                             "dcvit_attention_forward_f32", "dcvit_attention_forward_f64",
                             "dcvit_attention_backward_f32", "dcvit_attention_backward_f64"):
                    getattr(lib, name).restype = ctypes.c_int
                for name in ("dcvit_slots_forward_f32", "dcvit_slots_forward_f64",
                             "dcvit_slots_backward_f32", "dcvit_slots_backward_f64"):
                    getattr(lib, name).restype = None
                break
            except Exception as e:  # no compiler, read-only cache, no OpenMP, ...
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                lib = None
        if lib is None:
            warnings.warn(f"dcvit: the C++ attention kernel could not be built ({reason}); "
                          "using the pure-PyTorch fast path instead", RuntimeWarning, stacklevel=2)
    _state["lib"] = lib
    return lib


@torch._dynamo.assume_constant_result
def available() -> bool:
    """Whether the library loads (inside torch.compile: evaluated once, while tracing)."""
    return load() is not None


def function(name: str, dtype: torch.dtype):
    """The library's C function ``dcvit_{name}_f64`` for float64 data, else ``_f32``."""
    return getattr(load(), f"dcvit_{name}_{'f64' if dtype == torch.float64 else 'f32'}")


def ptr(t: Optional["torch.Tensor"]) -> ctypes.c_void_p:
    """A tensor's data pointer for the C functions (null for None)."""
    return ctypes.c_void_p(t.data_ptr() if t is not None else 0)
