// DCMHA's CPU kernels as torch operators (namespace dcvit_cpu), float32 and float64.
//
// Each op takes tensors and scalars and allocates its outputs; `dcvit.fused` calls them from
// the CPU kernels of its custom ops dcvit::composed_attention(_backward) and
// dcvit::slot_matrices(_backward), which own the autograd and fake-tensor rules. A Compose
// stage's matrices: mq (B|1, T|1, H, H) with the identity, static and query-wise terms, mk
// (B, S, H, H) with the key-wise ones; an absent stage or side is None. Masks are additive
// and broadcast to (B, H, T, S). At most kMaxHeads heads (rows.h; the caller checks too).
#include <array>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "attention.h"
#include "slots.h"

namespace dcvit {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

void check_dtype(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "dcvit_cpu: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble,
              "dcvit_cpu: ", name, " must be float32 or float64, got ", t.scalar_type());
}

void check_heads(int64_t H) {
  TORCH_CHECK(H <= kMaxHeads, "dcvit_cpu: at most ", kMaxHeads, " heads, got ", H);
}

// A (B, H, N, D) operand with unit last stride (copied only where it is not).
Tensor unit_rows(const Tensor& t, const Tensor& like) {
  TORCH_CHECK(t.dim() == 4 && t.scalar_type() == like.scalar_type(),
              "dcvit_cpu: q, k, v and grad must be (B, H, N, D) of one dtype");
  return t.stride(3) == 1 ? t : t.contiguous();
}

// Query-wise matrices expanded to (B, T, H, H), key-wise ones (B, S, H, H), contiguous, in
// the compute dtype; undefined for an absent side.
Tensor query_matrix(const OptTensor& m, int64_t B, int64_t T, int64_t H, at::ScalarType dt) {
  if (!m.has_value()) return Tensor();
  return m->to(dt).expand({B, T, H, H}).contiguous();
}
Tensor key_matrix(const OptTensor& m, at::ScalarType dt) {
  if (!m.has_value()) return Tensor();
  return m->to(dt).contiguous();
}

template <typename T>
T* ptr(const Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// A (B, H, N, D) operand with unit last stride as the kernels' strided view.
template <typename T>
Strided<const T> strided(const Tensor& t) {
  return {ptr<T>(t), t.stride(0), t.stride(1), t.stride(2)};
}

struct Matrices {
  Tensor mq1, mk1, mq2, mk2;
  Matrices(const OptTensor& q1, const OptTensor& k1, const OptTensor& q2, const OptTensor& k2,
           int64_t B, int64_t T, int64_t H, at::ScalarType dt)
      : mq1(query_matrix(q1, B, T, H, dt)), mk1(key_matrix(k1, dt)),
        mq2(query_matrix(q2, B, T, H, dt)), mk2(key_matrix(k2, dt)) {}
};

// The mask as a (B, H, T, S)-broadcast view (strides may be 0) in dtype dt.
struct MaskView {
  Tensor t;
  MaskView(const OptTensor& m, int64_t B, int64_t H, int64_t T, int64_t S, at::ScalarType dt)
      : t(m.has_value() ? m->to(dt).expand({B, H, T, S}) : Tensor()) {}
  template <typename S_>
  Mask get() const {
    if (!t.defined()) return Mask{nullptr, 0, 0, 0, 0};
    return Mask{t.data_ptr<S_>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
  }
};

// An empty tensor stands for an absent gradient in the ops' Tensor[] results.
Tensor or_empty(const Tensor& t, const Tensor& like) {
  return t.defined() ? t : at::empty({0}, like.options());
}

template <typename F>
void dispatch(at::ScalarType dt, F fn) {
  if (dt == at::kDouble) fn(double{});
  else fn(float{});
}

// compose2(softmax(compose1(scale q k^T) + mask)) @ v: q, k, v (B, H, N, D) on any strides
// with unit last stride; returns (B, T, H, D).
Tensor attention_forward(const Tensor& q_, const Tensor& k_, const Tensor& v_, const OptTensor& mask,
                         const OptTensor& mq1, const OptTensor& mk1, const OptTensor& mq2,
                         const OptTensor& mk2, double scale) {
  check_dtype(q_, "q");
  const Tensor q = unit_rows(q_, q_), k = unit_rows(k_, q_), v = unit_rows(v_, q_);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
  TORCH_CHECK(v.size(3) == D, "dcvit_cpu: v's head dim must equal q's");
  check_heads(H);
  const auto dt = q.scalar_type();
  const Matrices m(mq1, mk1, mq2, mk2, B, T, H, dt);
  const MaskView mv(mask, B, H, T, S, dt);
  Tensor out = at::empty({B, T, H, D}, q.options());
  dispatch(dt, [&](auto zero) {
    using S_ = decltype(zero);
    const Dims n = dims<S_>(B, H, T, S);
    const Operands<S_> o{strided<S_>(q), strided<S_>(k), strided<S_>(v), D, static_cast<S_>(scale)};
    const Strided<S_> view{ptr<S_>(out), T * H * D, D, H * D};          // (B, H, T, D) view
    with_heads<S_>(H, [&](auto rows) {
      rows.attention_forward(o, view, mv.get<S_>(), ptr<S_>(m.mq1), ptr<S_>(m.mk1),
                             ptr<S_>(m.mq2), ptr<S_>(m.mk2), n, at::get_num_threads());
    });
  });
  return out;
}

// Gradients of attention_forward for grad (B, H, T, D) (any strides): [dq, dk, dv (B, H, N, D)
// contiguous, dmq1 (B, T, H, H), dmk1 (B, S, H, H), dmq2, dmk2]; want says which of the four
// matrix gradients to compute: one not wanted, like an absent side's, is not computed and
// comes back empty.
std::vector<Tensor> attention_backward(const Tensor& grad_, const Tensor& q_, const Tensor& k_,
                                       const Tensor& v_, const OptTensor& mask, const OptTensor& mq1,
                                       const OptTensor& mk1, const OptTensor& mq2,
                                       const OptTensor& mk2, double scale, std::array<bool, 4> want) {
  check_dtype(q_, "q");
  const Tensor q = unit_rows(q_, q_), k = unit_rows(k_, q_), v = unit_rows(v_, q_);
  const Tensor grad = unit_rows(grad_, q_);
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), S = k.size(2);
  check_heads(H);
  const auto dt = q.scalar_type();
  const Matrices m(mq1, mk1, mq2, mk2, B, T, H, dt);
  const MaskView mv(mask, B, H, T, S, dt);
  Tensor dq = at::empty({B, H, T, D}, q.options()), dk = at::empty({B, H, S, D}, q.options());
  Tensor dv = at::empty({B, H, S, D}, q.options());
  auto grad_of = [&](const Tensor& t, bool wanted) {
    return t.defined() && wanted ? at::empty(t.sizes(), t.options()) : Tensor();
  };
  Tensor dmq1 = grad_of(m.mq1, want[0]), dmk1 = grad_of(m.mk1, want[1]);
  Tensor dmq2 = grad_of(m.mq2, want[2]), dmk2 = grad_of(m.mk2, want[3]);
  dispatch(dt, [&](auto zero) {
    using S_ = decltype(zero);
    const Dims n = dims<S_>(B, H, T, S);
    const Operands<S_> o{strided<S_>(q), strided<S_>(k), strided<S_>(v), D, static_cast<S_>(scale)};
    const int64_t gs[3] = {grad.stride(0), grad.stride(1), grad.stride(2)};
    with_heads<S_>(H, [&](auto rows) {
      rows.attention_backward(o, ptr<S_>(grad), gs, ptr<S_>(dq), ptr<S_>(dk), ptr<S_>(dv),
                              mv.get<S_>(), ptr<S_>(m.mq1), ptr<S_>(m.mk1), ptr<S_>(m.mq2),
                              ptr<S_>(m.mk2), ptr<S_>(dmq1), ptr<S_>(dmk1), ptr<S_>(dmq2),
                              ptr<S_>(dmk2), n, at::get_num_threads());
    });
  });
  return {dq, dk, dv, or_empty(dmq1, q), or_empty(dmk1, q), or_empty(dmq2, q), or_empty(dmk2, q)};
}

// Every slot's Compose matrix from the raw projections w (B, N, G, 2R, H) and gates dd
// (B, N, G, H) or None, plus the identity on the slots listed in identity_slots: (B, N, G, H, H).
Tensor slot_matrices(const Tensor& w_, const OptTensor& dd, at::IntArrayRef identity_slots,
                     double eps) {
  check_dtype(w_, "w");
  const Tensor w = w_.contiguous();
  const int64_t B = w.size(0), N = w.size(1), G = w.size(2), R = w.size(3) / 2, H = w.size(4);
  const Tensor d = dd.has_value() ? dd->to(w.scalar_type()).contiguous() : Tensor();
  std::vector<int64_t> ident(G, 0);
  for (int64_t g : identity_slots) {
    TORCH_CHECK(g >= 0 && g < G, "dcvit_cpu: identity slot ", g, " out of range for ", G, " slots");
    ident[g] = 1;
  }
  Tensor m = at::empty({B, N, G, H, H}, w.options());
  dispatch(w.scalar_type(), [&](auto zero) {
    using S_ = decltype(zero);
    slots_forward<S_>(ptr<S_>(w), ptr<S_>(d), ident.data(), ptr<S_>(m), B * N, G, R, H,
                      static_cast<S_>(eps), at::get_num_threads());
  });
  return m;
}

// Gradients of slot_matrices: [dw (B, N, G, 2R, H), ddd (B, N, G, H) or empty without gates].
std::vector<Tensor> slot_matrices_backward(const Tensor& w_, const Tensor& dm_, bool with_gate,
                                           double eps) {
  check_dtype(w_, "w");
  const Tensor w = w_.contiguous(), dm = dm_.to(w_.scalar_type()).contiguous();
  const int64_t B = w.size(0), N = w.size(1), G = w.size(2), R = w.size(3) / 2, H = w.size(4);
  Tensor dw = at::empty_like(w);
  Tensor ddd = with_gate ? at::empty({B, N, G, H}, w.options()) : Tensor();
  dispatch(w.scalar_type(), [&](auto zero) {
    using S_ = decltype(zero);
    slots_backward<S_>(ptr<S_>(w), ptr<S_>(dm), ptr<S_>(dw), ptr<S_>(ddd), B * N, G, R, H,
                       static_cast<S_>(eps), at::get_num_threads());
  });
  return {dw, or_empty(ddd, w)};
}

}  // namespace
}  // namespace dcvit

TORCH_LIBRARY(dcvit_cpu, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? mq1, Tensor? mk1, "
        "Tensor? mq2, Tensor? mk2, float scale) -> Tensor");
  m.def("attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? mq1, "
        "Tensor? mk1, Tensor? mq2, Tensor? mk2, float scale, bool[4] want) -> Tensor[]");
  m.def("slot_matrices(Tensor w, Tensor? dd, int[] identity_slots, float eps) -> Tensor");
  m.def("slot_matrices_backward(Tensor w, Tensor dm, bool with_gate, float eps) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(dcvit_cpu, CPU, m) {
  m.impl("attention_forward", &dcvit::attention_forward);
  m.impl("attention_backward", &dcvit::attention_backward);
  m.impl("slot_matrices", &dcvit::slot_matrices);
  m.impl("slot_matrices_backward", &dcvit::slot_matrices_backward);
}
