// The attention core, flash-style: q k^T -> rows -> p v per batch element and block of queries,
// in each thread's cache-sized tiles.
#pragma once

#include "gemm.h"

namespace dcvit {

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

  // Row (b, t) backward: recompute it from its scores a, write the composed weights to out,
  // back-propagate g (the weights' gradient) through compose2, softmax and compose1 into da (which
  // may be g itself: g is read before da is written), the query-wise matrix gradients into
  // dmq*r and the key-wise ones added to the packed accumulators g1/g2 (each null: not wanted).
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

}  // namespace dcvit
