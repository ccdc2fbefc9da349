#include "support/numerics.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"

namespace kestrel::testing {

namespace {
Generator& test_generator() {
  static Generator g(0xC0FFEEull ^ static_cast<uint64_t>(::testing::UnitTest::GetInstance()->random_seed()));
  return g;
}
}  // namespace

Tensor randn(const Shape& shape, DType dtype, Device device, double std) {
  return normal(shape, 0.0, std, dtype, device, test_generator());
}

Tensor randu(const Shape& shape, double lo, double hi, DType dtype, Device device) {
  return uniform(shape, lo, hi, dtype, device, test_generator());
}

double rel_l2(const Tensor& a, const Tensor& b) { return rel_l2_floored(a, b, 0.0); }

double rel_l2_floored(const Tensor& a, const Tensor& b, double rms_floor) {
  EXPECT_EQ(a.shape(), b.shape());
  auto x = a.to(Device::cpu()).to(DType::F64).contiguous();
  auto y = b.to(Device::cpu()).to(DType::F64).contiguous();
  const double* px = x.data<double>();
  const double* py = y.data<double>();
  double num = 0, den = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (std::isnan(px[i]) != std::isnan(py[i])) return INFINITY;
    num += (px[i] - py[i]) * (px[i] - py[i]);
    den += py[i] * py[i];
  }
  const double floor = rms_floor * std::sqrt(static_cast<double>(std::max<int64_t>(y.numel(), 1)));
  return std::sqrt(num) / std::max({std::sqrt(den), floor, 1e-300});
}

std::vector<double> host_f64(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).to(DType::F64).contiguous();
  return std::vector<double>(h.data<double>(), h.data<double>() + h.numel());
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  auto x = a.to(Device::cpu()).to(DType::F64).contiguous();
  auto y = b.to(Device::cpu()).to(DType::F64).contiguous();
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    double d = std::abs(x.data<double>()[i] - y.data<double>()[i]);
    if (std::isnan(d)) return INFINITY;
    m = std::max(m, d);
  }
  return m;
}

bool all_finite(const Tensor& t) {
  auto x = t.to(Device::cpu()).to(DType::F64).contiguous();
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isfinite(x.data<double>()[i])) return false;
  return true;
}

double dtype_tolerance(DType dtype) {
  switch (dtype) {
    case DType::F64: return 1e-12;
    case DType::F32: return 1e-5;
    case DType::F16: return 2e-3;
    case DType::BF16: return 1.6e-2;
    default: return 0;
  }
}

::testing::AssertionResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                                     const std::vector<Tensor>& inputs_in, const GradcheckOptions& opts) {
  std::vector<Tensor> inputs;
  std::vector<bool> diff;
  for (size_t i = 0; i < inputs_in.size(); ++i) {
    const Tensor& t = inputs_in[i];
    bool skip = std::find(opts.skip_inputs.begin(), opts.skip_inputs.end(), static_cast<int>(i)) != opts.skip_inputs.end();
    if (!t.defined() || !is_floating(t.dtype()) || skip) {
      inputs.push_back(t);
      diff.push_back(false);
      continue;
    }
    Tensor x = t.to(Device::cpu()).to(DType::F64).clone();
    x.set_requires_grad(true);
    inputs.push_back(x);
    diff.push_back(true);
  }
  // Analytic.
  autograd::clear_tape();
  Tensor out = f(inputs);
  if (!out.requires_grad()) return ::testing::AssertionFailure() << "output does not require grad";
  Tensor upstream = normal(out.shape(), 0.0, 1.0, DType::F64, Device::cpu(), test_generator());
  autograd::backward({out}, {upstream});
  std::vector<Tensor> analytic;
  for (size_t i = 0; i < inputs.size(); ++i) analytic.push_back(diff[i] ? inputs[i].grad() : Tensor());

  // Numeric: d/dx <upstream, f(x)>.
  autograd::NoGradGuard no_grad;
  const double* up = upstream.contiguous().data<double>();
  auto objective = [&]() {
    Tensor y = f(inputs).to(DType::F64).contiguous();
    double s = 0;
    for (int64_t k = 0; k < y.numel(); ++k) s += up[k] * y.data<double>()[k];
    return s;
  };
  std::ostringstream err;
  bool ok = true;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!diff[i]) continue;
    Tensor& x = inputs[i];
    double* px = x.data<double>();
    Tensor g = analytic[i].defined() ? analytic[i].to(DType::F64).contiguous() : Tensor::zeros(x.shape(), DType::F64);
    for (int64_t k = 0; k < x.numel(); ++k) {
      double orig = px[k];
      px[k] = orig + opts.eps;
      double fp = objective();
      px[k] = orig - opts.eps;
      double fm = objective();
      px[k] = orig;
      double num = (fp - fm) / (2 * opts.eps);
      double ana = g.data<double>()[k];
      if (!(std::abs(num - ana) <= opts.atol + opts.rtol * std::abs(num))) {
        if (ok) err << "gradient mismatch: ";
        ok = false;
        err << "input " << i << " element " << k << ": analytic " << ana << " numeric " << num << "; ";
        if (err.tellp() > 2000) break;
      }
    }
  }
  if (!ok) return ::testing::AssertionFailure() << err.str();
  return ::testing::AssertionSuccess();
}

}  // namespace kestrel::testing
