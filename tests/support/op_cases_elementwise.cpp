// Op-table cases for elementwise ops: binary ops with broadcasting, unary ops, maximum/minimum, where.
#include <cmath>

#include "kestrel/ops/elementwise.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

std::string shape_name(const Shape& s) {
  std::string n;
  for (size_t i = 0; i < s.size(); ++i) n += (i ? "x" : "") + std::to_string(s[i]);
  return s.empty() ? "scalar" : n;
}

// Elementwise reference with numpy broadcasting of two inputs.
Tensor broadcast_reference(const Tensor& a, const Tensor& b, const std::function<double(double, double)>& f) {
  Shape out = broadcast_shapes(a.shape(), b.shape(), "reference");
  std::vector<double> av = host_values(a), bv = host_values(b), ov(static_cast<size_t>(numel(out)));
  auto src = [&](const std::vector<int64_t>& oi, const Shape& s) {
    std::vector<int64_t> ii(s.size());
    size_t lead = out.size() - s.size();
    for (size_t d = 0; d < s.size(); ++d) ii[d] = s[d] == 1 ? 0 : oi[d + lead];
    return ravel(ii, s);
  };
  for (int64_t i = 0; i < numel(out); ++i) {
    auto oi = unravel(i, out);
    ov[i] = f(av[src(oi, a.shape())], bv[src(oi, b.shape())]);
  }
  return f64_tensor(ov, out);
}

struct Binary {
  const char* name;
  Tensor (*op)(const Tensor&, const Tensor&);
  double (*ref)(double, double);
  bool positive_b;  // keep the right operand away from 0 (div)
};

struct Unary {
  const char* name;
  std::function<Tensor(const Tensor&)> op;
  std::function<double(double)> ref;
  double lo, hi;  // input range (uniform); lo == hi means normal(0, 1)
};

}  // namespace

void add_elementwise_cases(std::vector<OpCase>& cases) {
  const Binary binaries[] = {
      {"add", add, [](double a, double b) { return a + b; }, false},
      {"sub", sub, [](double a, double b) { return a - b; }, false},
      {"mul", mul, [](double a, double b) { return a * b; }, false},
      {"div", div, [](double a, double b) { return a / b; }, true},
      {"maximum", maximum, [](double a, double b) { return a > b ? a : b; }, false},
      {"minimum", minimum, [](double a, double b) { return a < b ? a : b; }, false},
  };
  // {a shape, b shape, gradcheck}
  const std::vector<std::tuple<Shape, Shape, bool>> pairs = {
      {{1}, {1}, true},           {{7, 13}, {7, 13}, true},      {{7, 13}, {13}, true},
      {{3, 1, 5}, {1, 4, 5}, true}, {{1}, {7, 5}, true},         {{127, 1000}, {1000}, false},
      {{127, 1}, {1, 1000}, false},
  };
  for (const Binary& op : binaries) {
    for (const auto& [sa, sb, grad] : pairs) {
      OpCase c;
      c.name = op.name;
      c.shape_class = shape_name(sa) + "_by_" + shape_name(sb);
      bool pos = op.positive_b;
      c.make_inputs = [sa = sa, sb = sb, pos](DType dt, Device dev) -> OpInputs {
        Tensor b = pos ? randu(sb, 0.5, 2.0, dt, dev) : randn(sb, dt, dev);
        return {randn(sa, dt, dev), b};
      };
      c.op = [f = op.op](const OpInputs& in) -> std::vector<Tensor> { return {f(in[0], in[1])}; };
      c.reference = [r = op.ref](const OpInputs& in) -> std::vector<Tensor> {
        return {broadcast_reference(in[0], in[1], r)};
      };
      c.gradcheck = grad;
      cases.push_back(c);
    }
  }

  const Unary unaries[] = {
      {"neg", [](const Tensor& x) { return neg(x); }, [](double x) { return -x; }, 0, 0},
      {"exp", [](const Tensor& x) { return exp(x); }, [](double x) { return std::exp(x); }, 0, 0},
      {"log", [](const Tensor& x) { return log(x); }, [](double x) { return std::log(x); }, 0.2, 5},
      {"sqrt", [](const Tensor& x) { return sqrt(x); }, [](double x) { return std::sqrt(x); }, 0.2, 5},
      {"rsqrt", [](const Tensor& x) { return rsqrt(x); }, [](double x) { return 1 / std::sqrt(x); }, 0.2, 5},
      {"tanh", [](const Tensor& x) { return tanh(x); }, [](double x) { return std::tanh(x); }, 0, 0},
      {"abs", [](const Tensor& x) { return abs(x); }, [](double x) { return std::abs(x); }, 0, 0},
      {"sigmoid", [](const Tensor& x) { return sigmoid(x); }, [](double x) { return 1 / (1 + std::exp(-x)); }, 0, 0},
      {"square", [](const Tensor& x) { return square(x); }, [](double x) { return x * x; }, 0, 0},
      {"scale", [](const Tensor& x) { return scale(x, -1.7); }, [](double x) { return -1.7 * x; }, 0, 0},
      {"add_scalar", [](const Tensor& x) { return add_scalar(x, 0.3); }, [](double x) { return x + 0.3; }, 0, 0},
      {"pow", [](const Tensor& x) { return pow_scalar(x, 1.5); }, [](double x) { return std::pow(x, 1.5); }, 0.2, 3},
  };
  const std::vector<std::pair<Shape, bool>> shapes = {{{1}, true}, {{7}, true}, {{3, 5}, true}, {{127, 9}, false}, {{1000}, false}};
  for (const Unary& u : unaries) {
    for (const auto& [s, grad] : shapes) {
      OpCase c;
      c.name = u.name;
      c.shape_class = shape_name(s);
      c.make_inputs = [s = s, lo = u.lo, hi = u.hi](DType dt, Device dev) -> OpInputs {
        return {lo == hi ? randn(s, dt, dev) : randu(s, lo, hi, dt, dev)};
      };
      c.op = [f = u.op](const OpInputs& in) -> std::vector<Tensor> { return {f(in[0])}; };
      c.reference = [r = u.ref](const OpInputs& in) -> std::vector<Tensor> {
        std::vector<double> v = host_values(in[0]);
        for (double& x : v) x = r(x);
        return {f64_tensor(v, in[0].shape())};
      };
      c.gradcheck = grad;
      cases.push_back(c);
    }
  }

  // where(cond, a, b) with a broadcast condition.
  for (const auto& [sc, sa, grad] : std::vector<std::tuple<Shape, Shape, bool>>{{{7, 1}, {7, 13}, true}, {{127, 1000}, {1000}, false}}) {
    OpCase c;
    c.name = "where";
    c.shape_class = "cond" + shape_name(sc) + "_x" + shape_name(sa);
    c.make_inputs = [sc = sc, sa = sa](DType dt, Device dev) -> OpInputs {
      std::vector<int64_t> bits;
      for (double v : host_values(randn(sc))) bits.push_back(v > 0 ? 1 : 0);  // about half true
      Tensor mask = index_tensor(bits, sc, DType::U8, dev);
      return {mask, randn(sa, dt, dev), randn(sc, dt, dev)};
    };
    c.op = [](const OpInputs& in) -> std::vector<Tensor> { return {where(in[0], in[1], in[2])}; };
    c.reference = [](const OpInputs& in) -> std::vector<Tensor> {
      Shape out = broadcast_shapes(broadcast_shapes(in[0].shape(), in[1].shape(), "ref"), in[2].shape(), "ref");
      std::vector<double> m = host_values(in[0]), a = host_values(in[1]), b = host_values(in[2]);
      std::vector<double> o(static_cast<size_t>(numel(out)));
      auto at = [&](const std::vector<double>& v, const Shape& s, const std::vector<int64_t>& oi) {
        std::vector<int64_t> ii(s.size());
        size_t lead = out.size() - s.size();
        for (size_t d = 0; d < s.size(); ++d) ii[d] = s[d] == 1 ? 0 : oi[d + lead];
        return v[ravel(ii, s)];
      };
      for (int64_t i = 0; i < numel(out); ++i) {
        auto oi = unravel(i, out);
        o[i] = at(m, in[0].shape(), oi) != 0 ? at(a, in[1].shape(), oi) : at(b, in[2].shape(), oi);
      }
      return {f64_tensor(o, out)};
    };
    c.gradcheck = grad;
    cases.push_back(c);
  }
}

}  // namespace kestrel::testing
