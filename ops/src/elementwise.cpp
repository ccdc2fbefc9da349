// Elementwise ops: broadcasting, dtype promotion, tape recording. Kernels in cpu/ and cuda/.
#include "kestrel/ops/elementwise.h"

#include "kernels/elementwise.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/reduce.h"

namespace kestrel {
Tensor sign_raw_for_grad(const Tensor& x);
namespace {
using kernels::BinaryOp;
using kernels::UnaryOp;
namespace ag = autograd;

const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add: return "add";
    case BinaryOp::Sub: return "sub";
    case BinaryOp::Mul: return "mul";
    case BinaryOp::Div: return "div";
    case BinaryOp::Maximum: return "maximum";
    case BinaryOp::Minimum: return "minimum";
  }
  return "binary";
}

Tensor binary_raw(BinaryOp op, const Tensor& a, const Tensor& b) {
  const char* name = binary_name(op);
  KESTREL_CHECK(a.defined() && b.defined(), name, "undefined operand");
  KESTREL_CHECK(a.device() == b.device(), name, "operands on different devices: ", a.str(), " and ", b.str());
  Shape shape = broadcast_shapes(a.shape(), b.shape(), name);
  DType dt = promote_types(a.dtype(), b.dtype(), name);
  Tensor out = Tensor::empty(shape, dt, a.device());
  if (out.numel() == 0) return out;
  kernels::dispatch(kernels::binary, name, a.device(), op, out, a.expand_view(shape), b.expand_view(shape));
  return out;
}

Tensor unary_raw(UnaryOp op, const Tensor& x, double s, const char* name) {
  KESTREL_CHECK(x.defined(), name, "undefined operand");
  KESTREL_CHECK(is_floating(x.dtype()), name, "expected a floating tensor, got ", x.str());
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() == 0) return out;
  kernels::dispatch(kernels::unary, name, x.device(), op, out, x, s);
  return out;
}

// Gradient of a broadcast operand: summed to its shape, in its dtype.
Tensor reduce_grad(const Tensor& g, const Shape& shape, DType dtype) {
  Tensor r = g.shape() == shape ? g : sum_to(g, shape);
  return r.dtype() == dtype ? r : r.to(dtype);
}

Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(op, a, b);
  if (!ag::should_record({a, b})) return out;
  bool ga = a.requires_grad(), gb = b.requires_grad();
  Tensor ad = a.detach(), bd = b.detach(), od = out.detach();
  bool need_a = op == BinaryOp::Mul || op == BinaryOp::Div || op == BinaryOp::Maximum || op == BinaryOp::Minimum;
  bool need_b = need_a;
  Tensor sa = need_a && (gb || op != BinaryOp::Mul) ? ad : Tensor();
  Tensor sb = need_b ? bd : Tensor();
  Tensor so = op == BinaryOp::Div && gb ? od : Tensor();
  ag::record(binary_name(op), {a, b}, out, [op, ga, gb, sa, sb, so, as = a.shape(), bs = b.shape(),
                                            adt = a.dtype(), bdt = b.dtype()](
                                               const std::vector<Tensor>& g) -> std::vector<Tensor> {
    const Tensor& go = g[0];
    auto likeA = [&](const Tensor& t) { return reduce_grad(t, as, adt); };
    auto likeB = [&](const Tensor& t) { return reduce_grad(t, bs, bdt); };
    Tensor da, db;
    switch (op) {
      case BinaryOp::Add:
        if (ga) da = likeA(go);
        if (gb) db = likeB(go);
        break;
      case BinaryOp::Sub:
        if (ga) da = likeA(go);
        if (gb) db = likeB(neg(go));
        break;
      case BinaryOp::Mul:
        if (ga) da = likeA(mul(go, sb));
        if (gb) db = likeB(mul(go, sa));
        break;
      case BinaryOp::Div:
        if (ga) da = likeA(div(go, sb));
        if (gb) db = likeB(neg(div(mul(go, so), sb)));
        break;
      case BinaryOp::Maximum:
      case BinaryOp::Minimum: {
        // Ties split the gradient evenly.
        Tensor s = kestrel::sign_raw_for_grad(sub(sa, sb));
        if (op == BinaryOp::Minimum) s = neg(s);
        if (ga) da = likeA(mul(go, scale(add_scalar(s, 1.0), 0.5)));
        if (gb) db = likeB(mul(go, scale(add_scalar(neg(s), 1.0), 0.5)));
        break;
      }
    }
    return {da, db};
  });
  return out;
}

template <typename GradFn>
Tensor unary(UnaryOp op, const Tensor& x, double s, const char* name, bool save_x, bool save_out, GradFn grad_fn) {
  Tensor out = unary_raw(op, x, s, name);
  if (!ag::should_record({x})) return out;
  Tensor sx = save_x ? x.detach() : Tensor();
  Tensor so = save_out ? out.detach() : Tensor();
  ag::record(name, {x}, out, [sx, so, s, grad_fn](const std::vector<Tensor>& g) -> std::vector<Tensor> {
    return {grad_fn(g[0], sx, so, s)};
  });
  return out;
}

}  // namespace

Tensor sign_raw_for_grad(const Tensor& x) { return unary_raw(UnaryOp::Sign, x, 0.0, "sign"); }

DType promote_types(DType a, DType b, const char* op) {
  KESTREL_CHECK(is_floating(a) && is_floating(b), op, "expected floating operands, got ", dtype_name(a), " and ",
                dtype_name(b));
  if (a == b) return a;
  if (a == DType::F64 || b == DType::F64) return DType::F64;
  return DType::F32;
}

Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Add, a, b); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Sub, a, b); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Mul, a, b); }
Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Div, a, b); }
Tensor maximum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Minimum, a, b); }

Tensor neg(const Tensor& x) {
  return unary(UnaryOp::Neg, x, 0, "neg", false, false, [](const Tensor& g, auto&, auto&, double) { return neg(g); });
}
Tensor exp(const Tensor& x) {
  return unary(UnaryOp::Exp, x, 0, "exp", false, true,
               [](const Tensor& g, const Tensor&, const Tensor& o, double) { return mul(g, o); });
}
Tensor log(const Tensor& x) {
  return unary(UnaryOp::Log, x, 0, "log", true, false,
               [](const Tensor& g, const Tensor& x, const Tensor&, double) { return div(g, x); });
}
Tensor sqrt(const Tensor& x) {
  return unary(UnaryOp::Sqrt, x, 0, "sqrt", false, true,
               [](const Tensor& g, const Tensor&, const Tensor& o, double) { return scale(div(g, o), 0.5); });
}
Tensor rsqrt(const Tensor& x) {
  return unary(UnaryOp::Rsqrt, x, 0, "rsqrt", false, true, [](const Tensor& g, const Tensor&, const Tensor& o, double) {
    return mul(g, scale(pow_scalar(o, 3.0), -0.5));
  });
}
Tensor tanh(const Tensor& x) {
  return unary(UnaryOp::Tanh, x, 0, "tanh", false, true, [](const Tensor& g, const Tensor&, const Tensor& o, double) {
    return mul(g, add_scalar(neg(square(o)), 1.0));
  });
}
Tensor abs(const Tensor& x) {
  return unary(UnaryOp::Abs, x, 0, "abs", true, false,
               [](const Tensor& g, const Tensor& x, const Tensor&, double) { return mul(g, sign_raw_for_grad(x)); });
}
Tensor sigmoid(const Tensor& x) {
  return unary(UnaryOp::Sigmoid, x, 0, "sigmoid", false, true,
               [](const Tensor& g, const Tensor&, const Tensor& o, double) {
                 return mul(g, mul(o, add_scalar(neg(o), 1.0)));
               });
}
Tensor square(const Tensor& x) {
  return unary(UnaryOp::Square, x, 0, "square", true, false,
               [](const Tensor& g, const Tensor& x, const Tensor&, double) { return scale(mul(g, x), 2.0); });
}
Tensor scale(const Tensor& x, double s) {
  return unary(UnaryOp::Scale, x, s, "scale", false, false,
               [](const Tensor& g, const Tensor&, const Tensor&, double s) { return scale(g, s); });
}
Tensor add_scalar(const Tensor& x, double s) {
  return unary(UnaryOp::AddScalar, x, s, "add_scalar", false, false,
               [](const Tensor& g, const Tensor&, const Tensor&, double) { return g; });
}
Tensor pow_scalar(const Tensor& x, double p) {
  return unary(UnaryOp::PowScalar, x, p, "pow", true, false, [](const Tensor& g, const Tensor& x, const Tensor&, double p) {
    return mul(g, scale(pow_scalar(x, p - 1.0), p));
  });
}

Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b) {
  KESTREL_CHECK(cond.device() == a.device() && a.device() == b.device(), "where", "operands on different devices");
  Shape shape = broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  DType dt = promote_types(a.dtype(), b.dtype(), "where");
  Tensor ac = a.dtype() == dt ? a : a.to(dt), bc = b.dtype() == dt ? b : b.to(dt);
  Tensor out = Tensor::empty(shape, dt, a.device());
  if (out.numel() > 0)
    kernels::dispatch(kernels::where, "where", a.device(), out, cond.expand_view(shape), ac.expand_view(shape),
                      bc.expand_view(shape));
  if (!ag::should_record({a, b})) return out;
  Tensor c = cond.detach();
  ag::record("where", {a, b}, out, [c, as = a.shape(), bs = b.shape(), adt = a.dtype(), bdt = b.dtype(),
                                    ga = a.requires_grad(), gb = b.requires_grad()](
                                       const std::vector<Tensor>& g) -> std::vector<Tensor> {
    Tensor zero = Tensor::zeros({}, g[0].dtype(), g[0].device());
    Tensor da, db;
    if (ga) da = reduce_grad(where(c, g[0], zero), as, adt);
    if (gb) db = reduce_grad(where(c, zero, g[0]), bs, bdt);
    return {da, db};
  });
  return out;
}

}  // namespace kestrel
