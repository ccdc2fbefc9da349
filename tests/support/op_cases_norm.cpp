// Op-table cases for rms_norm, add_rms_norm (two outputs) and layer_norm (with and without affine).
#include <cmath>

#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/norm.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

// Row-wise reference over the last dim: rms (layer == false) or layer norm; w/b may be undefined.
Tensor norm_reference(const Tensor& x, const Tensor& w, const Tensor& b, double eps, bool layer) {
  int64_t C = x.shape().back(), rows = x.numel() / C;
  std::vector<double> xv = host_values(x), wv = w.defined() ? host_values(w) : std::vector<double>(C, 1.0),
                      bv = b.defined() ? host_values(b) : std::vector<double>(C, 0.0), y(xv.size());
  for (int64_t r = 0; r < rows; ++r) {
    const double* xr = xv.data() + r * C;
    double mu = 0, ss = 0;
    if (layer) {
      for (int64_t c = 0; c < C; ++c) mu += xr[c];
      mu /= static_cast<double>(C);
    }
    for (int64_t c = 0; c < C; ++c) ss += (xr[c] - mu) * (xr[c] - mu);
    double rs = 1 / std::sqrt(ss / static_cast<double>(C) + eps);
    for (int64_t c = 0; c < C; ++c) y[r * C + c] = (xr[c] - mu) * rs * wv[c] + bv[c];
  }
  return f64_tensor(y, x.shape());
}

std::string shape_name(const Shape& s) {
  std::string n;
  for (size_t i = 0; i < s.size(); ++i) n += (i ? "x" : "") + std::to_string(s[i]);
  return n;
}

}  // namespace

void add_norm_cases(std::vector<OpCase>& cases) {
  const std::vector<std::pair<Shape, bool>> shapes = {
      {{1, 1}, true}, {{1, 7}, true}, {{5, 7}, true}, {{2, 3, 9}, true}, {{127, 1000}, false}, {{1000, 7}, false}};
  const double eps = 1e-5;
  for (const auto& [s, grad] : shapes) {
    int64_t C = s.back();
    // Weights near 1 with spread, as trained norm weights look.
    auto weight = [C](DType dt, Device dev) { return randu({C}, 0.5, 1.5, dt, dev); };
    {
      OpCase c;
      c.name = "rms_norm";
      c.shape_class = shape_name(s);
      c.make_inputs = [s = s, weight](DType dt, Device dev) -> OpInputs { return {randn(s, dt, dev), weight(dt, dev)}; };
      c.op = [eps](const OpInputs& in) -> std::vector<Tensor> { return {rms_norm(in[0], in[1], eps)}; };
      c.reference = [eps](const OpInputs& in) -> std::vector<Tensor> {
        return {norm_reference(in[0], in[1], Tensor(), eps, false)};
      };
      c.gradcheck = grad;
      // C == 1: dx = w * eps / (x^2 + eps)^1.5 is all cancellation (1 - xhat^2); f32 on two devices
      // agrees only to ~1e-2 there, so this degenerate class gets a looser f32 bound.
      if (C == 1) c.tol.f32 = 3e-2;
      cases.push_back(c);
    }
    {
      OpCase c;
      c.name = "add_rms_norm";
      c.shape_class = shape_name(s);
      c.make_inputs = [s = s, weight](DType dt, Device dev) -> OpInputs {
        return {randn(s, dt, dev), randn(s, dt, dev), weight(dt, dev)};
      };
      c.op = [eps](const OpInputs& in) -> std::vector<Tensor> {
        auto [y, h] = add_rms_norm(in[0], in[1], in[2], eps);
        return {y, h};
      };
      // The kernel rounds h to the storage dtype before normalising, as the returned h is;
      // the reference normalises the exact sum, so bf16 differs by one extra rounding.
      c.reference = [eps](const OpInputs& in) -> std::vector<Tensor> {
        std::vector<double> a = host_values(in[0]), b = host_values(in[1]);
        for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
        Tensor h = f64_tensor(a, in[0].shape());
        return {norm_reference(h, in[2], Tensor(), eps, false), h};
      };
      c.gradcheck = grad;
      cases.push_back(c);
    }
    // C == 1: layer norm's output is exactly 0 (x - mean), which a relative error cannot judge.
    for (int affine = 0; affine < 2 && C > 1; ++affine) {
      OpCase c;
      c.name = "layer_norm";
      c.shape_class = shape_name(s) + (affine ? "_affine" : "_plain");
      c.make_inputs = [s = s, weight, affine, C](DType dt, Device dev) -> OpInputs {
        // An offset mean checks that the mean is subtracted before squaring.
        Tensor x = randn(s, dt, dev);
        x.copy_(add_scalar(x, 1.5));
        OpInputs in{x};
        if (affine) {
          in.push_back(weight(dt, dev));
          in.push_back(randn({C}, dt, dev));
        }
        return in;
      };
      c.op = [eps](const OpInputs& in) -> std::vector<Tensor> {
        return {in.size() > 1 ? layer_norm(in[0], in[1], in[2], eps) : layer_norm(in[0], Tensor(), Tensor(), eps)};
      };
      c.reference = [eps](const OpInputs& in) -> std::vector<Tensor> {
        return {in.size() > 1 ? norm_reference(in[0], in[1], in[2], eps, true)
                              : norm_reference(in[0], Tensor(), Tensor(), eps, true)};
      };
      c.gradcheck = grad;
      cases.push_back(c);
    }
  }
}

}  // namespace kestrel::testing
