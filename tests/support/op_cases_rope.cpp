// Op-table cases for rope: full and partial rotary dims, packed positions restarting at 0, i32/i64,
// and scaled tables (non-uniform inverse frequencies and an attention scaling, as llama3/yarn give).
#include <algorithm>
#include <cmath>

#include "kestrel/ops/rope.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

Tensor rope_reference(const Tensor& x, const Tensor& positions, double theta, int64_t rd) {
  int64_t T = x.shape()[0], H = x.shape()[1], D = x.shape()[2], half = rd / 2;
  std::vector<double> xv = host_values(x), pos = host_values(positions), y = xv;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        double a = pos[t] * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(rd));
        int64_t base = (t * H + h) * D;
        double x1 = xv[base + i], x2 = xv[base + i + half];
        y[base + i] = x1 * std::cos(a) - x2 * std::sin(a);
        y[base + i + half] = x2 * std::cos(a) + x1 * std::sin(a);
      }
  return f64_tensor(y, x.shape());
}

Tensor rope_table_reference(const Tensor& x, const Tensor& positions, const RopeFrequencies& f) {
  int64_t T = x.shape()[0], H = x.shape()[1], D = x.shape()[2], half = f.rotary_dim() / 2;
  std::vector<double> xv = host_values(x), pos = host_values(positions), y = xv;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        double a = pos[t] * f.inv_freq[i], c = f.attention_scaling * std::cos(a), s = f.attention_scaling * std::sin(a);
        int64_t base = (t * H + h) * D;
        double x1 = xv[base + i], x2 = xv[base + i + half];
        y[base + i] = x1 * c - x2 * s;
        y[base + i + half] = x2 * c + x1 * s;
      }
  return f64_tensor(y, x.shape());
}

// A yarn-like table: the low frequencies divided by `factor`, a ramp between, and a scaling.
RopeFrequencies scaled_table(int64_t rotary_dim, double factor, double scaling) {
  RopeFrequencies f = RopeFrequencies::standard(10000.0, rotary_dim);
  const double n = static_cast<double>(f.inv_freq.size());
  for (size_t i = 0; i < f.inv_freq.size(); ++i) {
    double ramp = std::min(1.0, std::max(0.0, (static_cast<double>(i) - 0.25 * n) / (0.5 * n)));
    f.inv_freq[i] = f.inv_freq[i] / factor * ramp + f.inv_freq[i] * (1 - ramp);
  }
  f.attention_scaling = scaling;
  return f;
}

}  // namespace

void add_rope_cases(std::vector<OpCase>& cases) {
  struct Spec {
    const char* cls;
    int64_t T, H, D, rd;
    std::vector<int64_t> doc_lengths;  // positions restart at 0 at each document
    DType pos_dtype;
    bool grad;
  };
  const Spec specs[] = {
      {"t1_h1_d2", 1, 1, 2, -1, {1}, DType::I64, true},
      {"t7_h3_d16_docs4_3", 7, 3, 16, -1, {4, 3}, DType::I64, true},
      {"t5_h2_d24_rd16_i32", 5, 2, 24, 16, {5}, DType::I32, true},
      {"t127_h4_d64_docs", 127, 4, 64, -1, {1, 60, 66}, DType::I64, false},
      {"t1000_h2_d128_rd64", 1000, 2, 128, 64, {1000}, DType::I32, false},
  };
  for (const Spec& sp : specs) {
    OpCase c;
    c.name = "rope";
    c.shape_class = sp.cls;
    double theta = 10000.0;
    c.make_inputs = [sp](DType dt, Device dev) -> OpInputs {
      std::vector<int64_t> pos;
      for (int64_t len : sp.doc_lengths)
        for (int64_t p = 0; p < len; ++p) pos.push_back(p);
      return {randn({sp.T, sp.H, sp.D}, dt, dev), index_tensor(pos, {sp.T}, sp.pos_dtype, dev)};
    };
    c.op = [theta, rd = sp.rd](const OpInputs& in) -> std::vector<Tensor> { return {rope(in[0], in[1], theta, rd)}; };
    c.reference = [theta, rd = sp.rd](const OpInputs& in) -> std::vector<Tensor> {
      return {rope_reference(in[0], in[1], theta, rd < 0 ? in[0].shape()[2] : rd)};
    };
    c.gradcheck = sp.grad;
    cases.push_back(c);
  }
  struct ScaledSpec {
    const char* cls;
    int64_t T, H, D, rd, first_position;
    bool grad;
  };
  const ScaledSpec scaled[] = {
      {"scaled_t6_h2_d16", 6, 2, 16, 16, 40, true},
      {"scaled_t300_h3_d128_rd96_far", 300, 3, 128, 96, 200000, false},
      {"scaled_t65_h5_d256", 65, 5, 256, 256, 7000, false},
  };
  for (const ScaledSpec& sp : scaled) {
    OpCase c;
    c.name = "rope";
    c.shape_class = sp.cls;
    RopeFrequencies f = scaled_table(sp.rd, 8.0, 1.2079);
    c.make_inputs = [sp](DType dt, Device dev) -> OpInputs {
      std::vector<int64_t> pos;
      for (int64_t p = 0; p < sp.T; ++p) pos.push_back(sp.first_position + 3 * p);
      return {randn({sp.T, sp.H, sp.D}, dt, dev), index_tensor(pos, {sp.T}, DType::I64, dev)};
    };
    c.op = [f](const OpInputs& in) -> std::vector<Tensor> { return {rope(in[0], in[1], f)}; };
    c.reference = [f](const OpInputs& in) -> std::vector<Tensor> { return {rope_table_reference(in[0], in[1], f)}; };
    c.gradcheck = sp.grad;
    cases.push_back(c);
  }
}

}  // namespace kestrel::testing
