// attention with a sliding window (AttentionOptions::window): forward and backward against an
// independent float64 implementation that builds each document's full [len_q, len_k] score matrix
// with transformers' mask (key j visible to query i iff i + off - W < j <= i + off), gradients also
// by finite differences in f64; packed documents of different lengths, GQA, cross lengths, windows
// of 1, smaller and larger than the documents; argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "masked_attention_reference.h"
#include "ops/attention_case_util.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::randn;

using testing::cu_from;
using testing::max_of;
using testing::sum_of;
using testing::host_f64;
using testing::rel_err;

// transformers' sliding-window causal mask, written out from its definition (masking_utils:
// kv_idx <= q_idx and kv_idx > q_idx - sliding_window), with bottom-right alignment.
bool window_visible(int64_t i, int64_t j, int64_t len_q, int64_t len_k, int64_t window) {
  const int64_t qi = i + len_k - len_q;  // the query's position in key coordinates
  return j <= qi && (window <= 0 || j > qi - window);
}

using Ref = testing::AttentionRef;

// The shared f64 reference (masked_attention_reference.h) under this mask.
Ref reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const std::vector<int64_t>& lq,
              const std::vector<int64_t>& lk, int64_t window) {
  return testing::masked_attention_reference(q, k, v, dout, lq, lk, [&](size_t, int64_t i, int64_t j, int64_t nq, int64_t nk) {
    return window_visible(i, j, nq, nk, window);
  });
}

void check(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, int64_t Hq, int64_t Hkv, int64_t D,
           int64_t window, DType dt) {
  SCOPED_TRACE(::testing::Message() << "window=" << window << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D
                                    << " docs=" << lq.size() << " dtype=" << dtype_name(dt));
  Tensor q = randn({sum_of(lq), Hq, D}, dt).set_requires_grad(true);
  Tensor k = randn({sum_of(lk), Hkv, D}, dt).set_requires_grad(true);
  Tensor v = randn({sum_of(lk), Hkv, D}, dt).set_requires_grad(true);
  Tensor dout = randn({sum_of(lq), Hq, D}, dt);
  AttentionOptions o;
  o.window = window;
  AttentionOutput r = attention(q, k, v, cu_from(lq), cu_from(lk), max_of(lq), max_of(lk), o);
  autograd::backward(sum(mul(r.out, dout)));
  Ref ref = reference(q, k, v, dout, lq, lk, window);
  // f64: the output to rounding; the gradients recompute P from the saved lse, which is f32 (as on
  // the GPU), so they carry its ~1e-7 relative rounding.
  const double tol = dt == DType::F64 ? 1e-11 : 2 * testing::dtype_tolerance(dt);
  const double gtol = dt == DType::F64 ? 1e-6 : 2 * testing::dtype_tolerance(dt);
  EXPECT_LT(rel_err(host_f64(r.out), ref.out), tol);
  EXPECT_LT(rel_err(host_f64(q.grad()), ref.dq), gtol);
  EXPECT_LT(rel_err(host_f64(k.grad()), ref.dk), gtol);
  EXPECT_LT(rel_err(host_f64(v.grad()), ref.dv), gtol);
  std::vector<double> lse = host_f64(r.lse);
  for (size_t i = 0; i < lse.size(); ++i) {
    if (std::isinf(ref.lse[i])) {
      EXPECT_TRUE(std::isinf(lse[i]) && lse[i] < 0) << "row " << i;
    } else {
      EXPECT_NEAR(lse[i], ref.lse[i], 1e-5 * (1 + std::abs(ref.lse[i]))) << "row " << i;
    }
  }
}

TEST(AttentionWindow, PackedDocumentsAgainstFullMatrixReference) {
  const std::vector<int64_t> lens{37, 1, 64, 5, 100};  // windows below, inside and past each length
  for (int64_t w : {1, 2, 7, 16, 63, 64, 99, 100, 500}) check(lens, lens, 4, 2, 16, w, DType::F64);
}

TEST(AttentionWindow, GqaAndDtypes) {
  const std::vector<int64_t> lens{29, 70, 3};
  for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{3, 1}, {6, 2}, {4, 4}}) {
    check(lens, lens, hq, hkv, 8, 5, DType::F64);
    check(lens, lens, hq, hkv, 32, 24, DType::F32);
  }
  check(lens, lens, 4, 2, 64, 17, DType::BF16);
  check(lens, lens, 4, 1, 64, 9, DType::F16);
}

TEST(AttentionWindow, CrossLengthsBottomRight) {
  // len_k > len_q (keys before the window of every query: whole key blocks get no gradient) and
  // len_q > len_k (rows with no visible key).
  check({3, 6, 10}, {40, 4, 10}, 4, 2, 8, 5, DType::F64);
  check({3, 6, 10}, {40, 4, 10}, 4, 2, 8, 1, DType::F64);
  check({12}, {30}, 2, 1, 8, 100, DType::F64);
}

TEST(AttentionWindow, GradcheckF64) {
  std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>> cases{
      {{6}, {6}}, {{1, 5, 9}, {1, 5, 9}}, {{3, 4}, {7, 2}}};
  for (const auto& [lq, lk] : cases)
    for (int64_t w : {1, 2, 4}) {
      SCOPED_TRACE(::testing::Message() << "window=" << w << " docs=" << lq.size());
      Tensor cq = cu_from(lq), ck = cu_from(lk);
      AttentionOptions o;
      o.window = w;
      EXPECT_TRUE(testing::gradcheck(
          [&](const std::vector<Tensor>& in) {
            return attention(in[0], in[1], in[2], cq, ck, max_of(lq), max_of(lk), o).out;
          },
          {randn({sum_of(lq), 4, 3}, DType::F64), randn({sum_of(lk), 2, 3}, DType::F64),
           randn({sum_of(lk), 2, 3}, DType::F64)}));
    }
}

TEST(AttentionWindow, WindowOneCopiesTheDiagonalValue) {
  Tensor q = randn({9, 2, 8}), k = randn({9, 1, 8}), v = randn({9, 1, 8});
  AttentionOptions o;
  o.window = 1;
  Tensor out = attention(q, k, v, cu_from({4, 5}), 5, o);
  std::vector<float> ov = out.to_float_vector(), vv = v.to_float_vector();
  for (int64_t t = 0; t < 9; ++t)
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t c = 0; c < 8; ++c) EXPECT_FLOAT_EQ(ov[(t * 2 + h) * 8 + c], vv[t * 8 + c]);
}

TEST(AttentionWindow, WindowCoveringTheDocumentIsPlainCausal) {
  Tensor q = randn({30, 4, 16}), k = randn({30, 2, 16}), v = randn({30, 2, 16});
  Tensor cu = cu_from({12, 18});
  AttentionOptions w;
  w.window = 18;
  EXPECT_EQ(testing::rel_l2(attention(q, k, v, cu, 18, w), attention(q, k, v, cu, 18)), 0.0);
  w.window = 17;  // one key less for the last row of the longer document
  EXPECT_GT(testing::rel_l2(attention(q, k, v, cu, 18, w), attention(q, k, v, cu, 18)), 0.0);
}

TEST(AttentionWindow, Errors) {
  Tensor q = randn({6, 4, 8}), k = randn({6, 2, 8}), v = randn({6, 2, 8});
  AttentionOptions o;
  o.causal = false;
  o.window = 3;
  try {
    attention(q, k, v, cu_from({6}), 6, o);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[attention] a sliding window (3) is implemented for causal attention only"),
              std::string::npos)
        << e.what();
  }
  o.window = 0;  // bidirectional without a window still runs; a window <= 0 is none
  EXPECT_NO_THROW(attention(q, k, v, cu_from({6}), 6, o));
  o.causal = true;
  o.window = -4;
  EXPECT_EQ(testing::rel_l2(attention(q, k, v, cu_from({6}), 6, o), attention(q, k, v, cu_from({6}), 6)), 0.0);
}

}  // namespace
}  // namespace kestrel
