// Op-table cases for the optimizer kernels: one AdamW step (step 3: bias correction, weight decay) on
// copies of param/m/v, and global-norm clipping of a list of gradients (scaled copies plus the norm).
// Not differentiable: forward checks only, f64 and f32 (AdamW's master parameter is f32).
#include <cmath>

#include "kestrel/ops/optim.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

AdamWOptions adamw_options() {
  AdamWOptions o;
  o.lr = 2e-3;
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  return o;
}
constexpr int64_t kStep = 3;

}  // namespace

void add_optim_cases(std::vector<OpCase>& cases) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{127 * 1000}}) {
    OpCase c;
    c.name = "adamw_step";
    c.shape_class = "n" + std::to_string(n);
    // param, grad, m, v (v > 0 as after earlier steps).
    c.make_inputs = [n](DType dt, Device dev) -> OpInputs {
      return {randn({n}, dt, dev), randn({n}, dt, dev), randn({n}, dt, dev, 0.1), randu({n}, 0.01, 1.0, dt, dev)};
    };
    c.op = [](const OpInputs& in) -> std::vector<Tensor> {
      Tensor p = in[0].detach().clone(), m = in[2].detach().clone(), v = in[3].detach().clone();
      adamw_step(p, in[1].detach(), m, v, kStep, adamw_options());
      return {p, m, v};
    };
    c.reference = [n](const OpInputs& in) -> std::vector<Tensor> {
      std::vector<double> p = host_values(in[0]), g = host_values(in[1]), m = host_values(in[2]), v = host_values(in[3]);
      AdamWOptions o = adamw_options();
      double bc1 = 1 - std::pow(o.beta1, kStep), bc2 = 1 - std::pow(o.beta2, kStep);
      for (int64_t i = 0; i < n; ++i) {
        p[i] *= 1 - o.lr * o.weight_decay;
        m[i] = o.beta1 * m[i] + (1 - o.beta1) * g[i];
        v[i] = o.beta2 * v[i] + (1 - o.beta2) * g[i] * g[i];
        p[i] -= o.lr / bc1 * m[i] / (std::sqrt(v[i] / bc2) + o.eps);
      }
      return {f64_tensor(p, {n}), f64_tensor(m, {n}), f64_tensor(v, {n})};
    };
    c.tol = OpTolerance{1e-12, 1e-6, 0, 0};
    // m' = b1 m + (1 - b1) g adds terms of ~0.1 that can cancel: a single element's rounding is
    // judged against that scale, not against a near-zero result.
    c.rms_floor = 0.1;
    c.dtypes = {DType::F64, DType::F32};
    cases.push_back(c);
  }

  struct ClipSpec {
    const char* cls;
    std::vector<Shape> shapes;
    double max_norm_fraction;  // of the true norm; > 1 leaves the gradients unchanged
  };
  const ClipSpec specs[] = {
      {"one_1_clipped", {{1}}, 0.5},
      {"three_7x13_1000_1_clipped", {{7, 13}, {1000}, {1}}, 0.25},
      {"two_127x1000_7_unclipped", {{127, 1000}, {7}}, 2.0},
  };
  for (const ClipSpec& sp : specs) {
    OpCase c;
    c.name = "clip_grad_norm";
    c.shape_class = sp.cls;
    c.make_inputs = [sp](DType dt, Device dev) -> OpInputs {
      OpInputs in;
      for (const Shape& s : sp.shapes) in.push_back(randn(s, dt, dev));
      return in;
    };
    // The norm of the inputs decides max_norm, so op and reference agree on whether to clip.
    auto true_norm = [](const OpInputs& in) {
      double ss = 0;
      for (const Tensor& t : in)
        for (double x : host_values(t)) ss += x * x;
      return std::sqrt(ss);
    };
    c.op = [sp, true_norm](const OpInputs& in) -> std::vector<Tensor> {
      std::vector<Tensor> g;
      for (const Tensor& t : in) g.push_back(t.detach().clone());
      double norm = clip_grad_norm(g, sp.max_norm_fraction * true_norm(in));
      g.push_back(Tensor::full({}, norm, in[0].dtype(), in[0].device()));
      return g;
    };
    c.reference = [sp, true_norm](const OpInputs& in) -> std::vector<Tensor> {
      double norm = true_norm(in), max_norm = sp.max_norm_fraction * norm;
      double coef = std::min(1.0, max_norm / (norm + 1e-6));
      std::vector<Tensor> out;
      for (const Tensor& t : in) {
        std::vector<double> v = host_values(t);
        for (double& x : v) x *= coef;
        out.push_back(f64_tensor(v, t.shape()));
      }
      out.push_back(f64_tensor({norm}, {}));
      return out;
    };
    c.tol = OpTolerance{1e-12, 2e-6, 4e-3, 8e-3};
    cases.push_back(c);
  }
}

}  // namespace kestrel::testing
