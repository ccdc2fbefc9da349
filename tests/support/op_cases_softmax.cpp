// Op-table cases for softmax, log_softmax, logsumexp and amax along first, middle and last dims.
#include <cmath>
#include <limits>

#include "kestrel/ops/softmax.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

enum class Kind { Softmax, LogSoftmax, Logsumexp, Amax };

// Reference along dim d, in f64: the max, then sums of exp(x - max).
Tensor softmax_reference(const Tensor& x, int64_t dim, Kind kind, bool keepdim) {
  Shape s = x.shape();
  int d = normalize_dim(dim, x.dim(), "ref");
  int64_t n = s[d];
  Shape red = s;
  red[d] = 1;
  std::vector<double> xv = host_values(x), full(xv.size()), lane_out(static_cast<size_t>(numel(red)));
  for (int64_t l = 0; l < numel(red); ++l) {
    auto idx = unravel(l, red);
    auto at = [&](int64_t j) {
      idx[d] = j;
      return ravel(idx, s);
    };
    double mx = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, xv[at(j)]);
    for (int64_t j = 0; j < n; ++j) sum += std::exp(xv[at(j)] - mx);
    lane_out[l] = kind == Kind::Amax ? mx : mx + std::log(sum);
    for (int64_t j = 0; j < n; ++j)
      full[at(j)] = kind == Kind::Softmax ? std::exp(xv[at(j)] - mx) / sum : xv[at(j)] - mx - std::log(sum);
  }
  if (kind == Kind::Softmax || kind == Kind::LogSoftmax) return f64_tensor(full, s);
  if (!keepdim) red.erase(red.begin() + d);
  return f64_tensor(lane_out, red);
}

}  // namespace

void add_softmax_cases(std::vector<OpCase>& cases) {
  struct Spec {
    const char* cls;
    Shape shape;
    int64_t dim;
    bool keepdim, grad;
  };
  const Spec specs[] = {
      {"n1", {1}, 0, false, true},
      {"7x13_last", {7, 13}, -1, false, true},
      {"7x13_first_keep", {7, 13}, 0, true, true},
      {"3x7x5_mid", {3, 7, 5}, 1, false, true},
      {"127x1_last", {127, 1}, -1, true, false},
      {"127x1000_last", {127, 1000}, -1, false, false},
      {"1000x7_first", {1000, 7}, 0, false, false},
  };
  const std::pair<const char*, Kind> kinds[] = {
      {"softmax", Kind::Softmax}, {"log_softmax", Kind::LogSoftmax}, {"logsumexp", Kind::Logsumexp}, {"amax", Kind::Amax}};
  for (auto [name, kind] : kinds) {
    for (const Spec& sp : specs) {
      OpCase c;
      c.name = name;
      c.shape_class = sp.cls;
      // Scale 3 spreads the logits so the max subtraction matters.
      c.make_inputs = [s = sp.shape](DType dt, Device dev) -> OpInputs { return {randn(s, dt, dev, 3.0)}; };
      c.op = [kind = kind, dim = sp.dim, k = sp.keepdim](const OpInputs& in) -> std::vector<Tensor> {
        switch (kind) {
          case Kind::Softmax: return {softmax(in[0], dim)};
          case Kind::LogSoftmax: return {log_softmax(in[0], dim)};
          case Kind::Logsumexp: return {logsumexp(in[0], dim, k)};
          case Kind::Amax: return {amax(in[0], dim, k)};
        }
        return {};
      };
      c.reference = [kind = kind, dim = sp.dim, k = sp.keepdim](const OpInputs& in) -> std::vector<Tensor> {
        return {softmax_reference(in[0], dim, kind, k)};
      };
      if (kind == Kind::Amax) c.tol = OpTolerance{0, 0, 0, 0};  // a selection: exact
      c.gradcheck = sp.grad;
      cases.push_back(c);
    }
  }
}

}  // namespace kestrel::testing
