// attention with a prefix-LM / per-image-bidirectional mask (AttentionOptions::prefix_len): forward
// and backward against an independent float64 implementation that builds each document's full
// [len_q, len_k] score matrix with the mask written from its definition (key j visible to query i
// iff j <= i + off or j < prefix), gradients also by finite differences in f64; packed documents,
// prefixes of 0, 1, inside and equal to the document, GQA, cross lengths, dtypes; argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
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

// The prefix-LM mask from its definition: causal (bottom-right aligned), plus every key of the
// document's prefix for every query (the prefix sees itself bidirectionally).
bool prefix_visible(int64_t i, int64_t j, int64_t len_q, int64_t len_k, int64_t prefix) {
  const int64_t qi = i + len_k - len_q;  // the query's position in key coordinates
  return j <= qi || j < prefix;
}

using Ref = testing::AttentionRef;

// The shared f64 reference (masked_attention_reference.h) under this mask.
Ref reference(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, const std::vector<int64_t>& lq,
              const std::vector<int64_t>& lk, const std::vector<int64_t>& prefix) {
  return testing::masked_attention_reference(q, k, v, dout, lq, lk, [&](size_t d, int64_t i, int64_t j, int64_t nq, int64_t nk) {
    return prefix_visible(i, j, nq, nk, prefix[d]);
  });
}

Tensor prefix_tensor(const std::vector<int64_t>& prefix) {
  return Tensor::from_vector(prefix, {static_cast<int64_t>(prefix.size())}, DType::I32);
}

void check(const std::vector<int64_t>& lq, const std::vector<int64_t>& lk, int64_t Hq, int64_t Hkv, int64_t D,
           const std::vector<int64_t>& prefix, DType dt) {
  SCOPED_TRACE(::testing::Message() << "prefix[0]=" << prefix[0] << " Hq=" << Hq << " Hkv=" << Hkv << " D=" << D
                                    << " docs=" << lq.size() << " dtype=" << dtype_name(dt));
  Tensor q = randn({sum_of(lq), Hq, D}, dt).set_requires_grad(true);
  Tensor k = randn({sum_of(lk), Hkv, D}, dt).set_requires_grad(true);
  Tensor v = randn({sum_of(lk), Hkv, D}, dt).set_requires_grad(true);
  Tensor dout = randn({sum_of(lq), Hq, D}, dt);
  AttentionOptions o;
  o.prefix_len = prefix_tensor(prefix);
  AttentionOutput r = attention(q, k, v, cu_from(lq), cu_from(lk), max_of(lq), max_of(lk), o);
  autograd::backward(sum(mul(r.out, dout)));
  Ref ref = reference(q, k, v, dout, lq, lk, prefix);
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

TEST(AttentionPrefix, PackedDocumentsAgainstFullMatrixReference) {
  const std::vector<int64_t> lens{37, 1, 64, 5, 100};
  check(lens, lens, 4, 2, 16, {0, 0, 0, 0, 0}, DType::F64);    // plain causal
  check(lens, lens, 4, 2, 16, {1, 1, 1, 1, 1}, DType::F64);    // a one-token prefix is plain causal too
  check(lens, lens, 4, 2, 16, {10, 0, 63, 5, 57}, DType::F64);  // inside, none, whole document
  check(lens, lens, 4, 2, 16, {37, 1, 64, 5, 100}, DType::F64);  // all bidirectional
}

TEST(AttentionPrefix, GqaAndDtypes) {
  const std::vector<int64_t> lens{29, 70, 3};
  for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{3, 1}, {6, 2}, {4, 4}}) {
    check(lens, lens, hq, hkv, 8, {7, 33, 2}, DType::F64);
    check(lens, lens, hq, hkv, 32, {20, 1, 3}, DType::F32);
  }
  check(lens, lens, 4, 2, 64, {12, 50, 0}, DType::BF16);
  check(lens, lens, 4, 1, 64, {29, 9, 1}, DType::F16);
}

TEST(AttentionPrefix, CrossLengthsBottomRight) {
  // len_k > len_q (prefix keys seen by every query) and len_q > len_k (rows with no causal key still
  // see the prefix).
  check({3, 6, 10}, {40, 4, 10}, 4, 2, 8, {30, 2, 4}, DType::F64);
  check({12}, {5}, 2, 1, 8, {3}, DType::F64);
}

TEST(AttentionPrefix, GradcheckF64) {
  std::vector<std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>> cases{
      {{6}, {6}, {3}}, {{1, 5, 9}, {1, 5, 9}, {1, 2, 6}}, {{3, 4}, {7, 2}, {5, 0}}};
  for (const auto& [lq, lk, pre] : cases) {
    SCOPED_TRACE(::testing::Message() << "docs=" << lq.size());
    Tensor cq = cu_from(lq), ck = cu_from(lk);
    AttentionOptions o;
    o.prefix_len = prefix_tensor(pre);
    EXPECT_TRUE(testing::gradcheck(
        [&](const std::vector<Tensor>& in) {
          return attention(in[0], in[1], in[2], cq, ck, max_of(lq), max_of(lk), o).out;
        },
        {randn({sum_of(lq), 4, 3}, DType::F64), randn({sum_of(lk), 2, 3}, DType::F64),
         randn({sum_of(lk), 2, 3}, DType::F64)}));
  }
}

TEST(AttentionPrefix, WholeDocumentPrefixIsBidirectional) {
  Tensor q = randn({30, 4, 16}), k = randn({30, 2, 16}), v = randn({30, 2, 16});
  Tensor cu = cu_from({12, 18});
  AttentionOptions pre;
  pre.prefix_len = prefix_tensor({12, 18});
  AttentionOptions bidir;
  bidir.causal = false;
  EXPECT_EQ(testing::rel_l2(attention(q, k, v, cu, 18, pre), attention(q, k, v, cu, 18, bidir)), 0.0);
}

TEST(AttentionPrefix, Errors) {
  Tensor q = randn({6, 4, 8}), k = randn({6, 2, 8}), v = randn({6, 2, 8});
  auto expect_error = [&](const AttentionOptions& o, const std::string& what) {
    try {
      attention(q, k, v, cu_from({2, 4}), 4, o);
      ADD_FAILURE() << "no error for " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  AttentionOptions o;
  o.prefix_len = prefix_tensor({1, 2});
  o.causal = false;
  expect_error(o, "prefix_len (a prefix-LM mask) needs causal = true");
  o.causal = true;
  o.window = 2;
  expect_error(o, "prefix_len and a sliding window");
  o.window = 0;
  o.prefix_len = prefix_tensor({1});
  expect_error(o, "prefix_len must be i32 [docs]");
  o.prefix_len = prefix_tensor({3, 2});
  expect_error(o, "prefix_len[0] = 3 must be in [0, len_k = 2]");
  o.prefix_len = prefix_tensor({2, 4});
  EXPECT_NO_THROW(attention(q, k, v, cu_from({2, 4}), 4, o));
}

}  // namespace
}  // namespace kestrel
