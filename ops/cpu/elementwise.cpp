// CPU elementwise kernels (reference): strided, broadcast-aware, computed in f32 (f64 for f64).
#include <cmath>

#include "cpu/loops.h"
#include "kernels/elementwise.h"
#include "kestrel/runtime/dtype_dispatch.h"

namespace kestrel::cpu {
namespace {
using kernels::BinaryOp;
using kernels::UnaryOp;

template <typename C>
C apply_binary(BinaryOp op, C a, C b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::Maximum: return a > b || std::isnan(a) ? a : b;
    case BinaryOp::Minimum: return a < b || std::isnan(a) ? a : b;
  }
  return a;
}

template <typename C>
C apply_unary(UnaryOp op, C x, C s) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return std::exp(x);
    case UnaryOp::Log: return std::log(x);
    case UnaryOp::Sqrt: return std::sqrt(x);
    case UnaryOp::Rsqrt: return C(1) / std::sqrt(x);
    case UnaryOp::Tanh: return std::tanh(x);
    case UnaryOp::Abs: return std::abs(x);
    case UnaryOp::Sigmoid: return C(1) / (C(1) + std::exp(-x));
    case UnaryOp::Square: return x * x;
    case UnaryOp::Scale: return x * s;
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::PowScalar: return std::pow(x, s);
    case UnaryOp::Sign: return x > 0 ? C(1) : (x < 0 ? C(-1) : C(0));
  }
  return x;
}

void binary_cpu(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  dispatch_floating(out.dtype(), "binary", [&](auto otag) {
    using T = decltype(otag);
    using C = compute_t<T>;
    dispatch_floating(a.dtype(), "binary", [&](auto atag) {
      using A = decltype(atag);
      dispatch_floating(b.dtype(), "binary", [&](auto btag) {
        using B = decltype(btag);
        T* o = static_cast<T*>(out.storage()->data());
        const A* pa = static_cast<const A*>(a.storage()->data());
        const B* pb = static_cast<const B*>(b.storage()->data());
        for_each_row<3>(out.shape(), {&out, &a, &b}, [&](auto off, auto st, int64_t n) {
          for (int64_t i = 0; i < n; ++i) {
            C x = static_cast<C>(to_compute(pa[off[1] + i * st[1]]));
            C y = static_cast<C>(to_compute(pb[off[2] + i * st[2]]));
            o[off[0] + i * st[0]] = from_compute<T>(static_cast<compute_t<T>>(apply_binary<C>(op, x, y)));
          }
        });
      });
    });
  });
}

void unary_cpu(UnaryOp op, const Tensor& out, const Tensor& x, double s) {
  dispatch_floating(out.dtype(), "unary", [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    dispatch_floating(x.dtype(), "unary", [&](auto xtag) {
      using X = decltype(xtag);
      T* o = static_cast<T*>(out.storage()->data());
      const X* px = static_cast<const X*>(x.storage()->data());
      for_each_row<2>(out.shape(), {&out, &x}, [&](auto off, auto st, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
          o[off[0] + i * st[0]] =
              from_compute<T>(apply_unary<C>(op, static_cast<C>(to_compute(px[off[1] + i * st[1]])), static_cast<C>(s)));
      });
    });
  });
}

void where_cpu(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  dispatch_floating(out.dtype(), "where", [&](auto tag) {
    using T = decltype(tag);
    dispatch_dtype(cond.dtype(), [&](auto ctag) {
      using M = decltype(ctag);
      T* o = static_cast<T*>(out.storage()->data());
      const M* pc = static_cast<const M*>(cond.storage()->data());
      const T* pa = static_cast<const T*>(a.storage()->data());
      const T* pb = static_cast<const T*>(b.storage()->data());
      for_each_row<4>(out.shape(), {&out, &cond, &a, &b}, [&](auto off, auto st, int64_t n) {
        for (int64_t i = 0; i < n; ++i)
          o[off[0] + i * st[0]] = elem_to_double(pc[off[1] + i * st[1]]) != 0.0 ? pa[off[2] + i * st[2]]
                                                                               : pb[off[3] + i * st[3]];
      });
    });
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(binary, cpu, binary_cpu);
KESTREL_REGISTER_KERNEL(unary, cpu, unary_cpu);
KESTREL_REGISTER_KERNEL(where, cpu, where_cpu);

}  // namespace kestrel::cpu
