// Op-table cases for attention over packed documents: documents of length 1, one document, many
// documents, query/key lengths that differ (rows with no visible key), GQA ratios 1, 4, 8, causal and
// bidirectional, head_dim 8, 64, 72, 88, 96, 112 (multiples of 8, as the CUDA kernels need; 72-112
// run the narrow Hopper kernels on sm_90). The output and the log-sum-exp are separate cases (lse is
// f32 whatever the input dtype, so its case casts it to the input dtype, skips f64 and clamps the
// -inf of key-less rows to -1000 on both sides).
#include <cmath>
#include <limits>

#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/shape.h"
#include "support/op_table.h"

namespace kestrel::testing {
namespace {

// Rows with no visible key have lse = -inf; both sides clamp it to this value so rel_l2 stays finite.
constexpr double kNoKey = -1000.0;

struct AttnSpec {
  const char* cls;
  std::vector<int64_t> lq, lk;
  int64_t Hq, Hkv, D;
  bool causal, grad;
};

std::vector<int64_t> offsets(const std::vector<int64_t>& lens) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lens) cu.push_back(cu.back() + l);
  return cu;
}
int64_t longest(const std::vector<int64_t>& lens) {
  int64_t m = 0;
  for (int64_t l : lens) m = std::max(m, l);
  return m;
}

// f64 reference: each document's full masked score matrix, row softmax, P V. Returns {out, lse}.
std::vector<Tensor> attention_reference(const OpInputs& in, const AttnSpec& sp) {
  std::vector<double> Q = host_values(in[0]), K = host_values(in[1]), V = host_values(in[2]);
  const int64_t Hq = sp.Hq, Hkv = sp.Hkv, D = sp.D, G = Hq / Hkv, TQ = in[0].shape()[0];
  const double scale = 1.0 / std::sqrt(static_cast<double>(D)), ninf = -std::numeric_limits<double>::infinity();
  std::vector<double> out(TQ * Hq * D, 0.0), lse(TQ * Hq, ninf);
  std::vector<int64_t> cq = offsets(sp.lq), ck = offsets(sp.lk);
  for (size_t d = 0; d < sp.lq.size(); ++d) {
    int64_t lq = sp.lq[d], lk = sp.lk[d];
    for (int64_t h = 0; h < Hq; ++h) {
      std::vector<double> S(lq * lk, ninf);  // [len_q, len_k]
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          if (sp.causal && j > i + lk - lq) continue;
          double s = 0;
          for (int64_t c = 0; c < D; ++c)
            s += Q[((cq[d] + i) * Hq + h) * D + c] * K[((ck[d] + j) * Hkv + h / G) * D + c];
          S[i * lk + j] = s * scale;
        }
      for (int64_t i = 0; i < lq; ++i) {
        double m = ninf, z = 0;
        for (int64_t j = 0; j < lk; ++j) m = std::max(m, S[i * lk + j]);
        if (m == ninf) continue;
        for (int64_t j = 0; j < lk; ++j) z += std::exp(S[i * lk + j] - m);
        lse[(cq[d] + i) * Hq + h] = m + std::log(z);
        for (int64_t j = 0; j < lk; ++j)
          for (int64_t c = 0; c < D; ++c)
            out[((cq[d] + i) * Hq + h) * D + c] +=
                std::exp(S[i * lk + j] - m) / z * V[((ck[d] + j) * Hkv + h / G) * D + c];
      }
    }
  }
  return {f64_tensor(out, in[0].shape()), f64_tensor(lse, {TQ, Hq})};
}

}  // namespace

void add_attention_cases(std::vector<OpCase>& cases) {
  const AttnSpec specs[] = {
      {"docs_len1_x3_hq2_hkv2_d8_causal", {1, 1, 1}, {1, 1, 1}, 2, 2, 8, true, true},
      {"docs_1_3_2_gqa2_d8_causal", {1, 3, 2}, {1, 3, 2}, 2, 1, 8, true, true},
      {"docs_1_3_2_gqa4_d8_bidir", {1, 3, 2}, {1, 3, 2}, 4, 1, 8, false, true},
      {"q_2_3_k_4_2_gqa2_d8_causal", {2, 3}, {4, 2}, 4, 2, 8, true, true},
      {"doc37_gqa4_d64_causal", {37}, {37}, 4, 1, 64, true, false},
      {"doc37_gqa1_d64_bidir", {37}, {37}, 3, 3, 64, false, false},
      {"docs_5_1_17_3_9_gqa8_d72_causal", {5, 1, 17, 3, 9}, {5, 1, 17, 3, 9}, 8, 1, 72, true, false},
      {"docs_5_1_17_3_9_gqa4_d72_bidir", {5, 1, 17, 3, 9}, {5, 1, 17, 3, 9}, 8, 2, 72, false, false},
      {"q_3_6_k_10_4_gqa2_d64_causal", {3, 6}, {10, 4}, 4, 2, 64, true, false},
      // Head dims of the narrow CUDA kernels (80, 96, 112 on sm_90) past the 72 above.
      {"docs_9_1_20_gqa2_d96_causal", {9, 1, 20}, {9, 1, 20}, 4, 2, 96, true, false},
      {"q_7_3_k_12_3_gqa4_d112_bidir", {7, 3}, {12, 3}, 4, 1, 112, false, false},
      {"docs_20_5_gqa1_d88_causal", {20, 5}, {20, 5}, 2, 2, 88, true, false},
  };
  for (const AttnSpec& sp : specs) {
    auto make = [sp](DType dt, Device dev) -> OpInputs {
      int64_t tq = offsets(sp.lq).back(), tk = offsets(sp.lk).back();
      return {randn({tq, sp.Hq, sp.D}, dt, dev), randn({tk, sp.Hkv, sp.D}, dt, dev), randn({tk, sp.Hkv, sp.D}, dt, dev),
              index_tensor(offsets(sp.lq), {static_cast<int64_t>(sp.lq.size()) + 1}, DType::I32, dev),
              index_tensor(offsets(sp.lk), {static_cast<int64_t>(sp.lk.size()) + 1}, DType::I32, dev)};
    };
    auto run = [sp](const OpInputs& in) {
      AttentionOptions o;
      o.causal = sp.causal;
      return attention(in[0], in[1], in[2], in[3], in[4], longest(sp.lq), longest(sp.lk), o);
    };
    OpCase c;
    c.name = "attention";
    c.shape_class = sp.cls;
    c.make_inputs = make;
    c.op = [run](const OpInputs& in) -> std::vector<Tensor> { return {run(in).out}; };
    c.reference = [sp](const OpInputs& in) -> std::vector<Tensor> { return {attention_reference(in, sp)[0]}; };
    c.tol = OpTolerance{1e-12, 2e-5, 4e-3, 1.6e-2};
    c.gradcheck = sp.grad;
    cases.push_back(c);

    OpCase l;
    l.name = "attention_lse";
    l.shape_class = sp.cls;
    l.make_inputs = make;
    l.op = [run](const OpInputs& in) -> std::vector<Tensor> {
      Tensor lse = run(in).lse;
      lse = lse.dtype() == in[0].dtype() ? lse : cast(lse, in[0].dtype());
      return {maximum(lse, Tensor::full({}, kNoKey, lse.dtype(), lse.device()))};
    };
    l.reference = [sp](const OpInputs& in) -> std::vector<Tensor> {
      Tensor lse = attention_reference(in, sp)[1];
      return {maximum(lse, Tensor::full({}, kNoKey, DType::F64))};
    };
    l.dtypes = {DType::F32, DType::BF16};  // lse is stored in f32
    cases.push_back(l);
  }
}

}  // namespace kestrel::testing
