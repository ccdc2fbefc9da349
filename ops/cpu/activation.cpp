// CPU activation kernels (reference): flat loops over contiguous data, computed in f32 (f64 for f64).
// GELU tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), as torch's approximate="tanh",
// evaluated as x sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3)) (the same function, no cancellation).
#include <cmath>

#include "kernels/activation.h"
#include "kestrel/runtime/dtype_dispatch.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel::cpu {
namespace {
using kernels::Activation;

template <typename C>
C sigmoid(C x) {
  return C(1) / (C(1) + std::exp(-x));
}

template <typename C>
C act(Activation k, C x) {
  switch (k) {
    case Activation::Silu: return x * sigmoid(x);
    // Phi(x) = erfc(-x / sqrt 2) / 2: no cancellation in the negative tail (1 + erf loses all
    // digits of f32 there; x = -3.7 already costs 5e-4 relative).
    case Activation::GeluErf: return C(0.5) * x * std::erfc(-x * C(M_SQRT1_2));
    case Activation::GeluTanh: {
      // (1 + tanh u) / 2 = sigmoid(2u): the same function without the cancellation of 1 + tanh u in
      // the negative tail (x = -3 costs 1e-2 relative in f32 written the other way).
      const C c = C(0.7978845608028654);  // sqrt(2/pi)
      return x * sigmoid(C(2) * c * (x + C(0.044715) * x * x * x));
    }
    case Activation::Relu: return x > C(0) ? x : C(0);
  }
  return x;
}

template <typename C>
C act_grad(Activation k, C x) {
  switch (k) {
    case Activation::Silu: {
      C s = sigmoid(x);
      return s * (C(1) + x * (C(1) - s));
    }
    case Activation::GeluErf: {
      const C inv_sqrt_2pi = C(0.3989422804014327);
      return C(0.5) * std::erfc(-x * C(M_SQRT1_2)) + x * inv_sqrt_2pi * std::exp(C(-0.5) * x * x);
    }
    case Activation::GeluTanh: {
      // With s = sigmoid(2u) = (1 + tanh u) / 2 and 1 - tanh^2 u = 4 s (1 - s): no cancellation.
      const C c = C(0.7978845608028654);
      const C s = sigmoid(C(2) * c * (x + C(0.044715) * x * x * x));
      return s + C(2) * x * s * (C(1) - s) * c * (C(1) + C(3 * 0.044715) * x * x);
    }
    case Activation::Relu: return x > C(0) ? C(1) : C(0);
  }
  return C(1);
}

template <typename F>
void flat(int64_t n, F&& fn) {
  parallel_for(0, n, 16384, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) fn(i);
  });
}

void activation_cpu(Activation kind, const Tensor& out, const Tensor& x) {
  dispatch_floating(x.dtype(), "activation", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* po = out.data<T>();
    flat(x.numel(), [&](int64_t i) { po[i] = from_compute<T>(act(kind, to_compute(px[i]))); });
  });
}

void activation_backward_cpu(Activation kind, const Tensor& dx, const Tensor& x, const Tensor& dy) {
  dispatch_floating(x.dtype(), "activation", [&](auto tag) {
    using T = decltype(tag);
    const T *px = x.data<T>(), *pg = dy.data<T>();
    T* pd = dx.data<T>();
    flat(x.numel(), [&](int64_t i) { pd[i] = from_compute<T>(to_compute(pg[i]) * act_grad(kind, to_compute(px[i]))); });
  });
}

void swiglu_cpu(const Tensor& out, const Tensor& gate, const Tensor& up) {
  dispatch_floating(gate.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    const T *pg = gate.data<T>(), *pu = up.data<T>();
    T* po = out.data<T>();
    flat(gate.numel(), [&](int64_t i) {
      po[i] = from_compute<T>(act(Activation::Silu, to_compute(pg[i])) * to_compute(pu[i]));
    });
  });
}

void swiglu_backward_cpu(const Tensor& dgate, const Tensor& dup, const Tensor& gate, const Tensor& up, const Tensor& dy) {
  dispatch_floating(gate.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    const T *pg = gate.data<T>(), *pu = up.data<T>(), *pdy = dy.data<T>();
    T *pdg = dgate.data<T>(), *pdu = dup.data<T>();
    flat(gate.numel(), [&](int64_t i) {
      auto g = to_compute(pg[i]), d = to_compute(pdy[i]);
      pdg[i] = from_compute<T>(d * to_compute(pu[i]) * act_grad(Activation::Silu, g));
      pdu[i] = from_compute<T>(d * act(Activation::Silu, g));
    });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(activation_forward, cpu, activation_cpu);
KESTREL_REGISTER_KERNEL(activation_backward, cpu, activation_backward_cpu);
KESTREL_REGISTER_KERNEL(swiglu_forward, cpu, swiglu_cpu);
KESTREL_REGISTER_KERNEL(swiglu_backward, cpu, swiglu_backward_cpu);

}  // namespace kestrel::cpu
