// Op-table cases for fused_linear_cross_entropy (and cross_entropy on materialised logits): V not a
// multiple of the vocabulary chunk, N = 1, ignored labels (some, all), token weights, z-loss, label
// smoothing, mean and sum. The loss is cast to the input dtype (it is f32 for 16-bit inputs).
// Inputs: hidden [N, H], weight [V, H], labels [N] i64, token_weights [N] (or undefined); the token
// weights are not differentiated.
#include <cmath>

#include "kestrel/ops/cross_entropy.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/shape.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

struct CeSpec {
  const char* cls;
  int64_t N, H, V;
  int ignored_every;  // 0: none, 1: all, k: every k-th token
  bool weights;
  CrossEntropyOptions o;
  bool grad;
};

std::vector<int64_t> labels_for(const CeSpec& sp) {
  std::vector<int64_t> y;
  for (int64_t i = 0; i < sp.N; ++i) {
    bool ignored = sp.ignored_every > 0 && i % sp.ignored_every == 0;
    y.push_back(ignored ? sp.o.ignore_index : (i * 37 + 11) % sp.V);
  }
  return y;
}

// Plain f64 loops over the formula in cross_entropy.h, one full logits row at a time.
Tensor ce_reference(const OpInputs& in, const CeSpec& sp) {
  std::vector<double> X = host_values(in[0]), W = host_values(in[1]);
  std::vector<int64_t> y = in[2].to_int_vector();
  std::vector<double> w = in[3].defined() ? host_values(in[3]) : std::vector<double>(sp.N, 1.0);
  const double eps = sp.o.label_smoothing;
  double total = 0, denom = 0;
  for (int64_t i = 0; i < sp.N; ++i) {
    if (y[i] == sp.o.ignore_index) continue;
    std::vector<double> z(sp.V);
    double m = -INFINITY, zsum = 0, se = 0;
    for (int64_t j = 0; j < sp.V; ++j) {
      double s = 0;
      for (int64_t c = 0; c < sp.H; ++c) s += X[i * sp.H + c] * W[j * sp.H + c];
      z[j] = s;
      m = std::max(m, s);
      zsum += s;
    }
    for (int64_t j = 0; j < sp.V; ++j) se += std::exp(z[j] - m);
    double lse = m + std::log(se);
    total += w[i] * ((1 - eps) * (lse - z[y[i]]) + eps * (lse - zsum / sp.V) + sp.o.z_loss * lse * lse);
    denom += w[i];
  }
  double loss = sp.o.reduction == Reduction::Sum ? total : (denom != 0 ? total / denom : 0.0);
  return f64_tensor({loss}, {});
}

CrossEntropyOptions opts(int64_t ct, int64_t cv, double z, double eps, Reduction r) {
  CrossEntropyOptions o;
  o.chunk_tokens = ct;
  o.chunk_vocab = cv;
  o.z_loss = z;
  o.label_smoothing = eps;
  o.reduction = r;
  return o;
}

}  // namespace

void add_cross_entropy_cases(std::vector<OpCase>& cases) {
  const Reduction mean = Reduction::Mean, sum = Reduction::Sum;
  const CeSpec specs[] = {
      {"n13_h7_v37_c4x8", 13, 7, 37, 0, false, opts(4, 8, 0, 0, mean), true},
      {"n1_h8_v37", 1, 8, 37, 0, false, opts(0, 8, 0, 0, mean), true},
      {"n7_h5_v11_mixed_ignored_weights_z_smooth", 7, 5, 11, 3, true, opts(3, 4, 0.05, 0.1, mean), true},
      {"n7_h5_v11_weights_z_smooth_sum", 7, 5, 11, 2, true, opts(2, 3, 0.02, 0.2, sum), true},
      {"n9_h4_v13_all_ignored", 9, 4, 13, 1, false, opts(4, 4, 0, 0, mean), true},
      {"n127_h16_v1000_mixed_ignored_weights", 127, 16, 1000, 5, true, opts(0, 0, 1e-4, 0, mean), false},
      {"n127_h33_v1000_smooth_sum", 127, 33, 1000, 0, false, opts(32, 96, 0, 0.1, sum), false},
  };
  for (const CeSpec& sp : specs) {
    auto make = [sp](DType dt, Device dev) -> OpInputs {
      return {randn({sp.N, sp.H}, dt, dev), randn({sp.V, sp.H}, dt, dev, 0.5),
              index_tensor(labels_for(sp), {sp.N}, DType::I64, dev),
              sp.weights ? randu({sp.N}, 0.2, 2.0, DType::F32, dev) : Tensor()};
    };
    auto as_input_dtype = [](const Tensor& loss, DType dt) { return loss.dtype() == dt ? loss : cast(loss, dt); };
    OpCase c;
    c.name = "fused_linear_cross_entropy";
    c.shape_class = sp.cls;
    c.make_inputs = make;
    c.op = [sp, as_input_dtype](const OpInputs& in) -> std::vector<Tensor> {
      return {as_input_dtype(fused_linear_cross_entropy(in[0], in[1], in[2], in[3], sp.o), in[0].dtype())};
    };
    c.reference = [sp](const OpInputs& in) -> std::vector<Tensor> { return {ce_reference(in, sp)}; };
    c.tol = OpTolerance{1e-12, 2e-5, 4e-3, 1.6e-2};
    c.gradcheck = sp.grad;
    c.grad_opts.skip_inputs = {3};
    cases.push_back(c);

    OpCase m = c;
    m.name = "cross_entropy";
    m.op = [sp, as_input_dtype](const OpInputs& in) -> std::vector<Tensor> {
      return {as_input_dtype(cross_entropy(matmul(in[0], in[1], false, true), in[2], in[3], sp.o), in[0].dtype())};
    };
    cases.push_back(m);
  }
}

}  // namespace kestrel::testing
