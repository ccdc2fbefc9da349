// Op-table cases for silu, gelu (erf and tanh forms), relu and swiglu.
#include <cmath>

#include "kestrel/ops/activation.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

double silu_ref(double x) { return x / (1 + std::exp(-x)); }
// The references avoid the cancellation of 1 + erf and 1 + tanh in the negative tail (it costs
// float64 itself 1e-8 relative by x = -6): erfc, and (1 + tanh u) / 2 = 1 / (1 + exp(-2u)).
double gelu_erf_ref(double x) { return 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }
double gelu_tanh_ref(double x) {
  return x / (1 + std::exp(-2 * std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
}

std::string shape_name(const Shape& s) {
  std::string n;
  for (size_t i = 0; i < s.size(); ++i) n += (i ? "x" : "") + std::to_string(s[i]);
  return n;
}

}  // namespace

void add_activation_cases(std::vector<OpCase>& cases) {
  struct Act {
    const char* name;
    Tensor (*op)(const Tensor&);
    double (*ref)(double);
  };
  const Act acts[] = {
      {"silu", [](const Tensor& x) { return silu(x); }, silu_ref},
      {"gelu_erf", [](const Tensor& x) { return gelu(x, false); }, gelu_erf_ref},
      {"gelu_tanh", [](const Tensor& x) { return gelu(x, true); }, gelu_tanh_ref},
      {"relu", [](const Tensor& x) { return relu(x); }, [](double x) { return x > 0 ? x : 0.0; }},
  };
  const std::vector<std::pair<Shape, bool>> shapes = {{{1}, true}, {{7}, true}, {{3, 13}, true}, {{127, 33}, false}, {{1000}, false}};
  for (const Act& a : acts) {
    for (const auto& [s, grad] : shapes) {
      OpCase c;
      c.name = a.name;
      c.shape_class = shape_name(s);
      c.make_inputs = [s = s](DType dt, Device dev) -> OpInputs { return {randn(s, dt, dev, 2.0)}; };
      c.op = [f = a.op](const OpInputs& in) -> std::vector<Tensor> { return {f(in[0])}; };
      c.reference = [r = a.ref](const OpInputs& in) -> std::vector<Tensor> {
        std::vector<double> v = host_values(in[0]);
        for (double& x : v) x = r(x);
        return {f64_tensor(v, in[0].shape())};
      };
      c.gradcheck = grad;
      cases.push_back(c);
    }
  }
  for (const auto& [s, grad] : shapes) {
    OpCase c;
    c.name = "swiglu";
    c.shape_class = shape_name(s);
    c.make_inputs = [s = s](DType dt, Device dev) -> OpInputs { return {randn(s, dt, dev, 2.0), randn(s, dt, dev)}; };
    c.op = [](const OpInputs& in) -> std::vector<Tensor> { return {swiglu(in[0], in[1])}; };
    c.reference = [](const OpInputs& in) -> std::vector<Tensor> {
      std::vector<double> g = host_values(in[0]), u = host_values(in[1]);
      for (size_t i = 0; i < g.size(); ++i) g[i] = silu_ref(g[i]) * u[i];
      return {f64_tensor(g, in[0].shape())};
    };
    c.gradcheck = grad;
    cases.push_back(c);
  }
}

}  // namespace kestrel::testing
