"""C++ kernel (threads + OpenMP SIMD) for the fused compose -> mask -> softmax -> compose rows on CPU.

Plain C++ (no torch headers, so it builds in about a second) compiled on first use with
the system's ``g++`` into ``$DCVIT_KERNEL_CACHE`` (default ``~/.cache/dcvit``) and called
through ``ctypes`` on tensor data pointers. When it cannot be built or loaded, `load`
warns once and returns None, and `dcvit.fused` uses its pure-PyTorch path. Set
``DCVIT_NO_CPP_KERNEL=1`` to skip it.

One "row" is (b, t): the scores of every head of one query against all S keys, an (H, S)
block that stays in L1 while it is composed, soft-maxed and composed again. Each Compose
stage applies, per key s, the H×H map::

    out[h, s] = sum_g in[g, s] * (mq[b, t, g, h] + mk[b, g, h, s])

where ``mq`` holds the identity, the static matrix and the query-wise terms, and ``mk``
(stored (B, H, H, S) so the s-loop is contiguous) the key-wise terms; a null pointer
marks an absent stage or side.
"""
import ctypes
import hashlib
import os
import subprocess
import tempfile
import warnings
from typing import Any, Dict, List, Optional

__all__ = ["load", "SOURCE"]

SOURCE = r"""
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>
#include <thread>

namespace {

// out[i, s] = sum_j in[j, s] * (m[j, i] + mk[j, i, s]); transposed: m[i, j], mk[i, j, s].
// Blocks of CH keys: the accumulator of one output head stays in registers over all j.
constexpr int64_t CH = 16;
template <typename T>
void mix(const T* __restrict__ in, int64_t in_hs, T* __restrict__ out, const T* __restrict__ m,
         const T* __restrict__ mk, int64_t H, int64_t S, bool transpose) {
  const int64_t full = S - S % CH;
  for (int64_t i = 0; i < H; ++i) {
    T* __restrict__ o = out + i * S;
    for (int64_t s0 = 0; s0 < full; s0 += CH) {
      T acc[CH] = {};
      for (int64_t j = 0; j < H; ++j) {
        const int64_t idx = transpose ? i * H + j : j * H + i;
        const T* __restrict__ x = in + j * in_hs + s0;
        const T c = m[idx];
        if (mk != nullptr) {
          const T* __restrict__ kv = mk + idx * S + s0;
          for (int64_t s = 0; s < CH; ++s) acc[s] += x[s] * (c + kv[s]);
        } else {
          for (int64_t s = 0; s < CH; ++s) acc[s] += c * x[s];
        }
      }
      for (int64_t s = 0; s < CH; ++s) o[s0 + s] = acc[s];
    }
    for (int64_t s = full; s < S; ++s) {
      T acc = T(0);
      for (int64_t j = 0; j < H; ++j) {
        const int64_t idx = transpose ? i * H + j : j * H + i;
        acc += in[j * in_hs + s] * (m[idx] + (mk != nullptr ? mk[idx * S + s] : T(0)));
      }
      o[s] = acc;
    }
  }
}

// exp with a vectorisable body (Cephes polynomial, about 1 ulp): exp(-inf) = 0, NaN stays.
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
  const float res = x < -87.3f ? 0.0f : y * scale;
  return x != x ? x : res;
}
inline double vexp(double x) { return std::exp(x); }

// dm[g, h] = sum_s a[g, s] * d[h, s];  dmk[g, h, s] += a[g, s] * d[h, s].
template <typename T>
void mix_grad(const T* __restrict__ a, int64_t a_hs, const T* __restrict__ d, int64_t d_hs,
              T* __restrict__ dm, T* __restrict__ dmk, int64_t H, int64_t S) {
  for (int64_t g = 0; g < H; ++g) {
    const T* __restrict__ x = a + g * a_hs;
    for (int64_t h = 0; h < H; ++h) {
      const T* __restrict__ y = d + h * d_hs;
      T acc = T(0);
      if (dmk != nullptr) {
        T* __restrict__ k = dmk + (g * H + h) * S;
#pragma omp simd reduction(+ : acc)
        for (int64_t s = 0; s < S; ++s) {
          const T p = x[s] * y[s];
          acc += p;
          k[s] += p;
        }
      } else {
#pragma omp simd reduction(+ : acc)
        for (int64_t s = 0; s < S; ++s) acc += x[s] * y[s];
      }
      dm[g * H + h] = acc;
    }
  }
}

template <typename T>
void mask_softmax(T* __restrict__ x, const T* mask, int64_t msh, int64_t mss, int64_t H, int64_t S) {
  for (int64_t h = 0; h < H; ++h) {
    T* __restrict__ r = x + h * S;
    if (mask != nullptr) {
      const T* mr = mask + h * msh;
      for (int64_t s = 0; s < S; ++s) r[s] += mr[s * mss];
    }
    T mx = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mx)
    for (int64_t s = 0; s < S; ++s) mx = r[s] > mx ? r[s] : mx;
    T sum = T(0);
#pragma omp simd
    for (int64_t s = 0; s < S; ++s) r[s] = vexp(r[s] - mx);
#pragma omp simd reduction(+ : sum)
    for (int64_t s = 0; s < S; ++s) sum += r[s];
    const T inv = T(1) / sum;
    for (int64_t s = 0; s < S; ++s) r[s] *= inv;
  }
}

// Gather an (H, S) row with head stride hs into a contiguous buffer, or scatter it back.
template <typename T>
void gather(const T* src, int64_t hs, T* dst, int64_t H, int64_t S) {
  for (int64_t h = 0; h < H; ++h) std::memcpy(dst + h * S, src + h * hs, sizeof(T) * S);
}
template <typename T>
void scatter(const T* src, T* dst, int64_t hs, int64_t H, int64_t S) {
  for (int64_t h = 0; h < H; ++h) std::memcpy(dst + h * hs, src + h * S, sizeof(T) * S);
}

// Run fn(begin, end, tid) over [0, rows) split in nthreads contiguous ranges. Plain threads
// rather than OpenMP: a second OpenMP runtime beside torch's would keep spinning after each
// call and starve torch's own threads on the same cores.
template <typename F>
void parallel_rows(int64_t rows, int nthreads, F fn) {
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(nthreads, rows));
  std::vector<std::thread> pool;
  for (int64_t k = 1; k < n; ++k)
    pool.emplace_back(fn, rows * k / n, rows * (k + 1) / n, k);
  fn(0, rows / n, 0);
  for (auto& th : pool) th.join();
}

struct Mask {
  const void* ptr;
  int64_t sb, sh, st, ss;
};

// softmax(compose1(s0) + mask) for row (b, t) into p (H, S contiguous).
template <typename T>
void row_probs(const T* a_row, int64_t hs, const Mask& mask, const T* mq1, const T* mk1,
               int64_t b, int64_t t, int64_t H, int64_t S, T* p) {
  if (mq1 != nullptr) mix<T>(a_row, hs, p, mq1, mk1, H, S, false);
  else gather<T>(a_row, hs, p, H, S);
  const T* m_row = mask.ptr == nullptr ? nullptr
      : static_cast<const T*>(mask.ptr) + b * mask.sb + t * mask.st;
  mask_softmax<T>(p, m_row, mask.sh, mask.ss, H, S);
}

template <typename T>
void rows_forward(const T* s0, T* p2, Mask mask, const T* mq1, const T* mk1, const T* mq2,
                  const T* mk2, int64_t B, int64_t H, int64_t T_, int64_t S, int nthreads) {
  const int64_t hs = T_ * S, rows = B * T_;
  parallel_rows(rows, nthreads, [&](int64_t begin, int64_t end, int64_t) {
    std::vector<T> pbuf(H * S), qbuf(H * S);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / T_, t = row % T_, off = (b * H * T_ + t) * S;
      T* p = pbuf.data();
      row_probs<T>(s0 + off, hs, mask, mq1 ? mq1 + row * H * H : nullptr,
                   mk1 ? mk1 + b * H * H * S : nullptr, b, t, H, S, p);
      if (mq2 != nullptr) {
        mix<T>(p, S, qbuf.data(), mq2 + row * H * H, mk2 ? mk2 + b * H * H * S : nullptr, H, S, false);
        p = qbuf.data();
      }
      scatter<T>(p, p2 + off, hs, H, S);
    }
  });
}

template <typename T>
void rows_backward(const T* s0, const T* dp2, T* p2, T* ds0, Mask mask, const T* mq1, const T* mk1,
                   const T* mq2, const T* mk2, T* dmq1, T* dmk1_acc, T* dmq2, T* dmk2_acc,
                   int64_t B, int64_t H, int64_t T_, int64_t S, int nthreads) {
  const int64_t hs = T_ * S, rows = B * T_, hhs = H * H * S;
  parallel_rows(rows, nthreads, [&](int64_t begin, int64_t end, int64_t tid) {
    std::vector<T> pbuf(H * S), qbuf(H * S), dbuf(H * S);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / T_, t = row % T_, off = (b * H * T_ + t) * S;
      const T* mq1r = mq1 ? mq1 + row * H * H : nullptr;
      const T* mk1b = mk1 ? mk1 + b * hhs : nullptr;
      T* p = pbuf.data();
      T* dp = dbuf.data();
      row_probs<T>(s0 + off, hs, mask, mq1r, mk1b, b, t, H, S, p);
      if (mq2 != nullptr) {
        const T* mq = mq2 + row * H * H;
        const T* mk = mk2 ? mk2 + b * hhs : nullptr;
        mix<T>(p, S, qbuf.data(), mq, mk, H, S, false);
        scatter<T>(qbuf.data(), p2 + off, hs, H, S);
        mix<T>(dp2 + off, hs, dp, mq, mk, H, S, true);
        mix_grad<T>(p, S, dp2 + off, hs, dmq2 + row * H * H,
                    dmk2_acc ? dmk2_acc + (tid * B + b) * hhs : nullptr, H, S);
      } else {
        scatter<T>(p, p2 + off, hs, H, S);
        gather<T>(dp2 + off, hs, dp, H, S);
      }
      // softmax backward, in place: ds1 = p * (dp - sum_s p * dp).
      for (int64_t h = 0; h < H; ++h) {
        const T* __restrict__ pr = p + h * S;
        T* __restrict__ dr = dp + h * S;
        T dot = T(0);
#pragma omp simd reduction(+ : dot)
        for (int64_t s = 0; s < S; ++s) dot += pr[s] * dr[s];
        for (int64_t s = 0; s < S; ++s) dr[s] = pr[s] * (dr[s] - dot);
      }
      if (mq1r != nullptr) {
        mix<T>(dp, S, qbuf.data(), mq1r, mk1b, H, S, true);
        scatter<T>(qbuf.data(), ds0 + off, hs, H, S);
        mix_grad<T>(s0 + off, hs, dp, S, dmq1 + row * H * H,
                    dmk1_acc ? dmk1_acc + (tid * B + b) * hhs : nullptr, H, S);
      } else {
        scatter<T>(dp, ds0 + off, hs, H, S);
      }
    }
  });
}

}  // namespace

#define DCVIT_EXPORT(T, SUFFIX)                                                                   \
  extern "C" void dcvit_rows_forward_##SUFFIX(                                                    \
      const T* s0, T* p2, const T* mask, int64_t msb, int64_t msh, int64_t mst, int64_t mss,      \
      const T* mq1, const T* mk1, const T* mq2, const T* mk2,                                     \
      int64_t B, int64_t H, int64_t T_, int64_t S, int nthreads) {                                \
    rows_forward<T>(s0, p2, Mask{mask, msb, msh, mst, mss}, mq1, mk1, mq2, mk2, B, H, T_, S,     \
                    nthreads);                                                                    \
  }                                                                                               \
  extern "C" void dcvit_rows_backward_##SUFFIX(                                                   \
      const T* s0, const T* dp2, T* p2, T* ds0, const T* mask, int64_t msb, int64_t msh,         \
      int64_t mst, int64_t mss, const T* mq1, const T* mk1, const T* mq2, const T* mk2,           \
      T* dmq1, T* dmk1_acc, T* dmq2, T* dmk2_acc, int64_t B, int64_t H, int64_t T_, int64_t S,    \
      int nthreads) {                                                                             \
    rows_backward<T>(s0, dp2, p2, ds0, Mask{mask, msb, msh, mst, mss}, mq1, mk1, mq2, mk2,       \
                     dmq1, dmk1_acc, dmq2, dmk2_acc, B, H, T_, S, nthreads);                      \
  }

DCVIT_EXPORT(float, f32)
DCVIT_EXPORT(double, f64)
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


def _build(cache_dir: str) -> str:
    """Compile SOURCE into cache_dir (atomically) unless already there; return the .so path."""
    cxx = os.environ.get("CXX", "g++")
    flags = ["-O3", "-fno-trapping-math", "-fopenmp-simd", "-pthread", "-shared", "-fPIC", "-std=c++17"] + _cpu_flags()
    tag = hashlib.sha1((SOURCE + cxx + " ".join(flags)).encode()).hexdigest()[:12]
    path = os.path.join(cache_dir, f"dcvit_compose_cpu_{tag}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        src, out = os.path.join(tmp, "compose_cpu.cpp"), os.path.join(tmp, "out.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        proc = subprocess.run([cxx, *flags, src, "-o", out], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[:300]}")
        os.replace(out, path)
    return path


def load() -> Optional[ctypes.CDLL]:
    """The compiled library (``dcvit_rows_{forward,backward}_{f32,f64}``), or None."""
    if "lib" in _state:
        return _state["lib"]
    lib = None
    if os.environ.get("DCVIT_NO_CPP_KERNEL", "") in ("", "0"):
        cache_dir = os.environ.get("DCVIT_KERNEL_CACHE",
                                   os.path.join(os.path.expanduser("~"), ".cache", "dcvit"))
        try:
            lib = ctypes.CDLL(_build(cache_dir))
            for name in ("dcvit_rows_forward_f32", "dcvit_rows_forward_f64",
                         "dcvit_rows_backward_f32", "dcvit_rows_backward_f64"):
                getattr(lib, name).restype = None
        except Exception as e:  # no compiler, read-only cache, missing OpenMP, ...
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            warnings.warn(f"dcvit: the C++ attention kernel could not be built ({reason}); "
                          "using the pure-PyTorch fast path instead", RuntimeWarning, stacklevel=2)
            lib = None
    _state["lib"] = lib
    return lib
