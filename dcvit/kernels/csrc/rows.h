// Rows of the attention: one query's (H, S) block of every head, composed, masked and
// soft-maxed in vectors (simd.h: 32 or 64 bytes), and the per-thread buffers around them.
#pragma once

#include <limits>
#include <type_traits>

#include "simd.h"

namespace dcvit {

// Heads are a template argument (HC > 0) for the usual head counts, so that a block of keys
// keeps every head's accumulator in registers; HC == 0 reads the count at run time, with
// accumulators for at most kMaxHeads heads. Its one source is the Python side's MAX_HEADS
// (dcvit.kernels.compose_cpu), which builds with -DDCVIT_MAX_HEADS and checks the head count.
#ifndef DCVIT_MAX_HEADS
#error "DCVIT_MAX_HEADS is undefined: build through dcvit.kernels.compose_cpu, which defines it"
#endif
constexpr int64_t kMaxHeads = DCVIT_MAX_HEADS;
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

// dm[g, h] = sum_s a[g, s] d[h, s] (QUERY);  dmk[blk, g, h, :] += a[g, blk] * d[h, blk] (KEYS).
template <typename T, int HC, bool QUERY, bool KEYS>
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
        if (QUERY) acc[i] += p;
        if (KEYS) vstore(kb + i * L, vload(kb + i * L) + p);
      }
    };
    int64_t blk = 0;
    for (; blk < full; ++blk) block(blk, std::false_type{});
    for (; blk < nb; ++blk) block(blk, std::true_type{});
    if (QUERY)
      for (int64_t i = 0; i < H; ++i) dm[g * H + i] = vsum<T>(acc[i]);
  }
}

// The gradients of one Compose map's query-wise (dm) and key-wise (dmk) matrices; a null
// pointer is a gradient not wanted, and not computed.
template <typename T, int HC>
void mix_grad(const Row<T> a, const Row<T> d, T* dm, T* dmk, int64_t h, int64_t nb) {
  if (dm != nullptr && dmk != nullptr) mix_grad_blocks<T, HC, true, true>(a, d, dm, dmk, h, nb);
  else if (dm != nullptr) mix_grad_blocks<T, HC, true, false>(a, d, dm, dmk, h, nb);
  else if (dmk != nullptr) mix_grad_blocks<T, HC, false, true>(a, d, dm, dmk, h, nb);
}

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

}  // namespace dcvit
