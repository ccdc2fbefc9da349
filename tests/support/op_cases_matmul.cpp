// Op-table cases for matmul (all transposes, batched, shared 2-D weight) and linear (with/without bias).
#include "kestrel/ops/matmul.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

// C = op(A) op(B) with batch dims [...] on A (B may be 2-D); plain loops in f64.
Tensor matmul_reference(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  int64_t ad = a.dim(), bd = b.dim();
  int64_t M = a.shape()[ad - (ta ? 1 : 2)], K = a.shape()[ad - (ta ? 2 : 1)];
  int64_t N = b.shape()[bd - (tb ? 2 : 1)];
  int64_t batch = a.numel() / (M * K);
  std::vector<double> av = host_values(a), bv = host_values(b), o(static_cast<size_t>(batch * M * N), 0.0);
  bool shared = bd == 2;
  for (int64_t p = 0; p < batch; ++p) {
    const double* A = av.data() + p * M * K;
    const double* B = bv.data() + (shared ? 0 : p * K * N);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        double s = 0;
        for (int64_t k = 0; k < K; ++k) s += (ta ? A[k * M + i] : A[i * K + k]) * (tb ? B[j * K + k] : B[k * N + j]);
        o[(p * M + i) * N + j] = s;
      }
  }
  Shape out(a.shape().begin(), a.shape().end() - 2);
  out.push_back(M);
  out.push_back(N);
  return f64_tensor(o, out);
}

}  // namespace

void add_matmul_cases(std::vector<OpCase>& cases) {
  struct Spec {
    const char* cls;
    Shape batch;  // batch dims of a (and b unless shared)
    int64_t M, K, N;
    bool shared_b, grad;
  };
  const Spec specs[] = {
      {"1x1x1", {}, 1, 1, 1, false, true},
      {"7x13x5", {}, 7, 13, 5, false, true},
      {"b3_7x13x5", {3}, 7, 13, 5, false, true},
      {"b2x3_5x7x4_shared_b", {2, 3}, 5, 7, 4, true, true},
      {"127x1000x33", {}, 127, 1000, 33, false, false},
      {"b4_127x65x127", {4}, 127, 65, 127, false, false},
      {"b3_33x127x1000_shared_b", {3}, 33, 127, 1000, true, false},
  };
  for (const Spec& sp : specs) {
    for (int t = 0; t < 4; ++t) {
      bool ta = t & 1, tb = t & 2;
      OpCase c;
      c.name = "matmul";
      c.shape_class = std::string(sp.cls) + (ta ? "_ta" : "") + (tb ? "_tb" : "");
      c.make_inputs = [sp, ta, tb](DType dt, Device dev) -> OpInputs {
        Shape sa = sp.batch, sb = sp.shared_b ? Shape{} : sp.batch;
        sa.push_back(ta ? sp.K : sp.M);
        sa.push_back(ta ? sp.M : sp.K);
        sb.push_back(tb ? sp.N : sp.K);
        sb.push_back(tb ? sp.K : sp.N);
        return {randn(sa, dt, dev), randn(sb, dt, dev)};
      };
      c.op = [ta, tb](const OpInputs& in) -> std::vector<Tensor> { return {matmul(in[0], in[1], ta, tb)}; };
      c.reference = [ta, tb](const OpInputs& in) -> std::vector<Tensor> {
        return {matmul_reference(in[0], in[1], ta, tb)};
      };
      c.gradcheck = sp.grad;
      cases.push_back(c);
    }
  }
  // linear: x [..., in] @ W^T + b.
  struct LSpec {
    const char* cls;
    Shape x;
    int64_t out;
    bool bias, grad;
  };
  const LSpec lspecs[] = {
      {"1x1_to1_bias", {1, 1}, 1, true, true},
      {"7x13_to5", {7, 13}, 5, false, true},
      {"2x3x13_to5_bias", {2, 3, 13}, 5, true, true},
      {"127x1000_to33_bias", {127, 1000}, 33, true, false},
  };
  for (const LSpec& sp : lspecs) {
    OpCase c;
    c.name = "linear";
    c.shape_class = sp.cls;
    c.make_inputs = [sp](DType dt, Device dev) -> OpInputs {
      OpInputs in{randn(sp.x, dt, dev), randn({sp.out, sp.x.back()}, dt, dev)};
      if (sp.bias) in.push_back(randn({sp.out}, dt, dev));
      return in;
    };
    c.op = [](const OpInputs& in) -> std::vector<Tensor> {
      return {linear(in[0], in[1], in.size() > 2 ? in[2] : Tensor())};
    };
    c.reference = [](const OpInputs& in) -> std::vector<Tensor> {
      Tensor y = matmul_reference(in[0], in[1], false, true);
      if (in.size() > 2) {
        std::vector<double> v = host_values(y), b = host_values(in[2]);
        for (size_t i = 0; i < v.size(); ++i) v[i] += b[i % b.size()];
        y = f64_tensor(v, y.shape());
      }
      return {y};
    };
    c.gradcheck = sp.grad;
    cases.push_back(c);
  }
}

}  // namespace kestrel::testing
