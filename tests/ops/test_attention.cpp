// attention: forward against a float64 reference that builds each document's full score matrix,
// gradients by finite differences in f64, masking corner cases, GQA, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "ops/attention_case_util.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::host_f64;
using testing::randn;

using testing::cu_from;
using testing::max_of;
using testing::sum_of;


struct RefOut {
  std::vector<double> out, lse;  // [total_q, Hq, D], [total_q, Hq]
};

// Float64 reference: per document and head, the full [len_q, len_k] score matrix, masked, softmaxed.
RefOut reference(const Tensor& q, const Tensor& k, const Tensor& v, const std::vector<int64_t>& lq,
                 const std::vector<int64_t>& lk, bool causal, double scale) {
  std::vector<double> Q = host_f64(q), K = host_f64(k), V = host_f64(v);
  int64_t Hq = q.shape()[1], Hkv = k.shape()[1], D = q.shape()[2], G = Hq / Hkv;
  int64_t TQ = q.shape()[0];
  RefOut r;
  r.out.assign(TQ * Hq * D, 0.0);
  r.lse.assign(TQ * Hq, -std::numeric_limits<double>::infinity());
  int64_t q0 = 0, k0 = 0;
  for (size_t d = 0; d < lq.size(); ++d) {
    for (int64_t h = 0; h < Hq; ++h) {
      int64_t hk = h / G;
      std::vector<double> S(lq[d] * lk[d]);  // [len_q, len_k]
      for (int64_t i = 0; i < lq[d]; ++i)
        for (int64_t j = 0; j < lk[d]; ++j) {
          double s = 0;
          for (int64_t c = 0; c < D; ++c)
            s += Q[((q0 + i) * Hq + h) * D + c] * K[((k0 + j) * Hkv + hk) * D + c];
          bool masked = causal && j > i + lk[d] - lq[d];
          S[i * lk[d] + j] = masked ? -std::numeric_limits<double>::infinity() : s * scale;
        }
      for (int64_t i = 0; i < lq[d]; ++i) {
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < lk[d]; ++j) m = std::max(m, S[i * lk[d] + j]);
        if (std::isinf(m)) continue;  // no visible key: out 0, lse -inf
        double z = 0;
        for (int64_t j = 0; j < lk[d]; ++j) z += std::exp(S[i * lk[d] + j] - m);
        r.lse[(q0 + i) * Hq + h] = m + std::log(z);
        for (int64_t j = 0; j < lk[d]; ++j) {
          double p = std::exp(S[i * lk[d] + j] - m) / z;
          for (int64_t c = 0; c < D; ++c)
            r.out[((q0 + i) * Hq + h) * D + c] += p * V[((k0 + j) * Hkv + hk) * D + c];
        }
      }
    }
    q0 += lq[d];
    k0 += lk[d];
  }
  return r;
}

double rel_err_unfloored(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(b[i]) && a[i] == b[i]) continue;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-300);
}

void check_forward(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, int64_t Hq, int64_t Hkv, int64_t D,
                   bool causal, DType dt, double scale = 0.0) {
  SCOPED_TRACE(::testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " causal=" << causal
                                    << " docs=" << lq.size() << " dtype=" << dtype_name(dt));
  Tensor q = randn({sum_of(lq), Hq, D}, dt), k = randn({sum_of(lk), Hkv, D}, dt), v = randn({sum_of(lk), Hkv, D}, dt);
  AttentionOptions o;
  o.causal = causal;
  o.softmax_scale = scale;
  AttentionOutput r = attention(q, k, v, cu_from(lq), cu_from(lk), max_of(lq), max_of(lk), o);
  double s = scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(D));
  RefOut ref = reference(q, k, v, lq, lk, causal, s);
  ASSERT_EQ(r.out.shape(), q.shape());
  ASSERT_EQ(r.lse.shape(), (Shape{sum_of(lq), Hq}));
  ASSERT_EQ(r.lse.dtype(), DType::F32);
  EXPECT_TRUE(testing::all_finite(r.out));
  double tol = dt == DType::F64 ? 1e-12 : 2 * testing::dtype_tolerance(dt);
  EXPECT_LT(rel_err_unfloored(host_f64(r.out), ref.out), tol);
  std::vector<double> lse = host_f64(r.lse);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "row " << i;
    } else {
      EXPECT_NEAR(lse[i], ref.lse[i], 1e-5 * (1 + std::abs(ref.lse[i]))) << "row " << i;
    }
  }
}

TEST(Attention, ForwardManyShapesF32) {
  for (bool causal : {true, false}) {
    for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{2, 2}, {4, 1}, {8, 1}, {8, 2}}) {
      check_forward({1}, {1}, hq, hkv, 8, causal, DType::F32);                    // one token
      check_forward({1, 1, 1, 1}, {1, 1, 1, 1}, hq, hkv, 8, causal, DType::F32);  // documents of length 1
      check_forward({37}, {37}, hq, hkv, 64, causal, DType::F32);                 // one document
      check_forward({5, 1, 17, 3, 9}, {5, 1, 17, 3, 9}, hq, hkv, 72, causal, DType::F32);  // many documents
    }
  }
}

TEST(Attention, ForwardF64AndHalfTypes) {
  check_forward({7, 3, 12}, {7, 3, 12}, 4, 2, 8, true, DType::F64);
  check_forward({7, 3, 12}, {7, 3, 12}, 4, 2, 8, false, DType::F64, 0.3);
  check_forward({20, 11}, {20, 11}, 4, 1, 64, true, DType::BF16);
  check_forward({20, 11}, {20, 11}, 8, 8, 64, false, DType::F16);
}

TEST(Attention, CrossLengthsBottomRightCausal) {
  // len_k > len_q (decode-like) and len_q > len_k (rows with no visible key).
  check_forward({3, 6}, {10, 4}, 4, 2, 8, true, DType::F64);
  check_forward({3, 6}, {10, 4}, 4, 2, 8, false, DType::F64);
}

TEST(Attention, RowWithoutVisibleKeyGivesZeroAndMinusInf) {
  // len_q = 5 > len_k = 2, causal: local rows 0..2 see no key.
  Tensor q = randn({5, 2, 8}), k = randn({2, 1, 8}), v = randn({2, 1, 8});
  q.set_requires_grad(true);
  k.set_requires_grad(true);
  v.set_requires_grad(true);
  AttentionOutput r = attention(q, k, v, cu_from({5}), cu_from({2}), 5, 2);
  std::vector<float> out = r.out.to_float_vector(), lse = r.lse.to_float_vector();
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t h = 0; h < 2; ++h) {
      EXPECT_TRUE(std::isinf(lse[i * 2 + h]) && lse[i * 2 + h] < 0);
      for (int64_t c = 0; c < 8; ++c) EXPECT_EQ(out[(i * 2 + h) * 8 + c], 0.0f);
    }
  EXPECT_TRUE(std::isfinite(lse[3 * 2]));
  autograd::backward(sum(mul(r.out, randn({5, 2, 8}))));
  EXPECT_TRUE(testing::all_finite(q.grad()));
  EXPECT_TRUE(testing::all_finite(k.grad()));
  EXPECT_TRUE(testing::all_finite(v.grad()));
  std::vector<float> dq = q.grad().to_float_vector();
  for (int64_t e = 0; e < 3 * 2 * 8; ++e) EXPECT_EQ(dq[e], 0.0f);
}

void check_grad(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, int64_t Hq, int64_t Hkv, int64_t D,
                bool causal) {
  SCOPED_TRACE(::testing::Message() << "Hq=" << Hq << " Hkv=" << Hkv << " D=" << D << " causal=" << causal);
  Tensor cq = cu_from(lq), ck = cu_from(lk);
  int64_t mq = max_of(lq), mk = max_of(lk);
  AttentionOptions o;
  o.causal = causal;
  EXPECT_TRUE(testing::gradcheck(
      [&](const std::vector<Tensor>& in) { return attention(in[0], in[1], in[2], cq, ck, mq, mk, o).out; },
      {randn({sum_of(lq), Hq, D}, DType::F64), randn({sum_of(lk), Hkv, D}, DType::F64),
       randn({sum_of(lk), Hkv, D}, DType::F64)}));
}

TEST(Attention, GradcheckF64) {
  for (bool causal : {true, false}) {
    check_grad({1}, {1}, 2, 2, 3, causal);
    check_grad({4}, {4}, 2, 2, 3, causal);
    check_grad({1, 3, 2}, {1, 3, 2}, 4, 1, 4, causal);
    check_grad({2, 3}, {4, 2}, 8, 1, 2, causal);  // len_q != len_k, including rows with no key
  }
}

TEST(Attention, GqaEqualsRepeatedKvHeads) {
  // GQA ratio 4 must equal plain multi-head attention with each KV head repeated 4 times,
  // for values and gradients (dk/dv summed over the group).
  std::vector<int64_t> lens{6, 9};
  Tensor q = randn({15, 8, 16}, DType::F64), k = randn({15, 2, 16}, DType::F64), v = randn({15, 2, 16}, DType::F64);
  Tensor dout = randn({15, 8, 16}, DType::F64);
  std::vector<double> K = host_f64(k), V = host_f64(v);
  Tensor k_rep = Tensor::empty({15, 8, 16}, DType::F64), v_rep = Tensor::empty({15, 8, 16}, DType::F64);
  for (int64_t t = 0; t < 15; ++t)
    for (int64_t h = 0; h < 8; ++h)
      for (int64_t c = 0; c < 16; ++c) {
        k_rep.data<double>()[(t * 8 + h) * 16 + c] = K[(t * 2 + h / 4) * 16 + c];
        v_rep.data<double>()[(t * 8 + h) * 16 + c] = V[(t * 2 + h / 4) * 16 + c];
      }
  Tensor kg = k.clone().set_requires_grad(true), vg = v.clone().set_requires_grad(true);
  Tensor krg = k_rep.clone().set_requires_grad(true), vrg = v_rep.clone().set_requires_grad(true);
  // backward consumes the whole tape, so each product is recorded just before its backward.
  Tensor o1 = attention(q, kg, vg, cu_from(lens), 9);
  autograd::backward(sum(mul(o1, dout)));
  Tensor o2 = attention(q, krg, vrg, cu_from(lens), 9);
  autograd::backward(sum(mul(o2, dout)));
  EXPECT_LT(testing::rel_l2(o1, o2), 1e-13);
  // Sum the repeated heads' gradients back into groups.
  std::vector<double> dkr = host_f64(krg.grad()), dk = host_f64(kg.grad());
  double num = 0, den = 0;
  for (int64_t t = 0; t < 15; ++t)
    for (int64_t hk = 0; hk < 2; ++hk)
      for (int64_t c = 0; c < 16; ++c) {
        double s = 0;
        for (int64_t h = hk * 4; h < hk * 4 + 4; ++h) s += dkr[(t * 8 + h) * 16 + c];
        double a = dk[(t * 2 + hk) * 16 + c];
        num += (a - s) * (a - s);
        den += s * s;
      }
  EXPECT_LT(std::sqrt(num / den), 1e-12);
}

TEST(Attention, BadArguments) {
  Tensor q = randn({6, 4, 8}), k = randn({6, 2, 8}), v = randn({6, 2, 8});
  Tensor cu = cu_from({2, 4});
  auto msg = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg([&] { attention(q, randn({6, 3, 8}), randn({6, 3, 8}), cu, 4); }).find("[attention] query heads (4)"),
            std::string::npos);
  EXPECT_NE(msg([&] { attention(q, k, randn({6, 2, 7}), cu, 4); }).find("[attention] v must match k"),
            std::string::npos);
  EXPECT_NE(msg([&] { attention(q, k, v, cu_from({2, 3}), 4); }).find("ends at 5 but there are 6 tokens"),
            std::string::npos);
  EXPECT_NE(msg([&] { attention(q, k, v, cu, 3); }).find("> max_seqlen 3"), std::string::npos);
  EXPECT_NE(msg([&] { attention(q, k, v, cu.to(DType::I64), 4); }).find("must be i32"), std::string::npos);
  EXPECT_NE(msg([&] { attention(q, k.to(DType::BF16), v, cu, 4); }).find("share a dtype"), std::string::npos);
  EXPECT_NE(msg([&] { attention(randn({6, 4}), k, v, cu, 4); }).find("q must be [total_q, Hq, D]"),
            std::string::npos);
}

}  // namespace
}  // namespace kestrel
