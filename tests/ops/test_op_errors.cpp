// Argument errors of the softmax/norm/rope/activation/embedding/patch families: each names the op
// and what was wrong (the op table covers the numerics).
#include <gtest/gtest.h>

#include "kestrel/ops/activation.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/norm.h"
#include "kestrel/ops/patch.h"
#include "kestrel/ops/rope.h"
#include "kestrel/ops/softmax.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::randn;

// Runs f, expecting a kestrel::Error whose message contains every fragment.
template <typename F>
void expect_error(F&& f, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const char* frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << msg << " lacks '" << frag << "'";
  }
}

TEST(OpErrors, NormShapesAndDtypes) {
  expect_error([] { rms_norm(randn({3, 8}), randn({7}), 1e-5); }, {"[rms_norm]", "weight must be [8]"});
  expect_error([] { rms_norm(randn({3, 8}), randn({8}, DType::BF16), 1e-5); }, {"[rms_norm]", "dtype"});
  expect_error([] { add_rms_norm(randn({3, 8}), randn({3, 7}), randn({8}), 1e-5); }, {"[add_rms_norm]", "residual"});
  expect_error([] { layer_norm(randn({3, 8}), randn({8}), randn({2}), 1e-5); }, {"[layer_norm]", "bias must be [8]"});
}

TEST(OpErrors, SoftmaxDimAndDtype) {
  expect_error([] { softmax(randn({3, 4}), 2); }, {"[softmax]", "out of range"});
  expect_error([] { logsumexp(Tensor::zeros({3}, DType::I64)); }, {"[logsumexp]", "floating"});
}

TEST(OpErrors, RopeArguments) {
  Tensor pos = Tensor::arange(5);
  expect_error([&] { rope(randn({5, 2, 8}), Tensor::arange(4), 1e4); }, {"[rope]", "positions must be [5]"});
  expect_error([&] { rope(randn({5, 2, 8}), pos, 1e4, 5); }, {"[rope]", "rotary_dim must be even"});
  expect_error([&] { rope(randn({5, 8}), pos, 1e4); }, {"[rope]", "[tokens, heads, D]"});
  expect_error([&] { rope(randn({5, 2, 8}), randn({5}), 1e4); }, {"[rope]", "i32 or i64"});
}

TEST(OpErrors, EmbeddingNamesTheFirstBadId) {
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 2, 9, -1}, {4});
  expect_error([&] { embedding(randn({5, 3}), ids); }, {"[embedding]", "position 2", "is 9", "[0, 5)"});
  expect_error([&] { index_select_rows(randn({5, 3}), ids); }, {"[index_select_rows]", "position 2"});
  Tensor dup = Tensor::from_vector(std::vector<int64_t>{1, 3, 1}, {3});
  expect_error([&] { splice_rows(randn({5, 3}), dup, randn({3, 3})); }, {"[splice_rows]", "repeats row 1"});
  expect_error([&] { splice_rows(randn({5, 3}), dup, randn({2, 3})); }, {"[splice_rows]", "src must be [3, 3]"});
}

TEST(OpErrors, ConcatSplitActivationPatch) {
  expect_error([] { concat({randn({2, 3}), randn({3, 3})}, 1); }, {"[concat]", "does not match"});
  expect_error([] { split(randn({2, 7}), {3, 3}, 1); }, {"[split]", "sum to 6"});
  expect_error([] { swiglu(randn({2, 3}), randn({3, 2})); }, {"[swiglu]", "one shape"});
  expect_error([] { patch_embed(randn({1, 3, 8, 8}), randn({4, 2, 4, 4}), Tensor(), 4); },
               {"[patch_embed]", "weight must be [E, 3, 4, 4]"});
  expect_error([] { patch_embed(randn({1, 3, 3, 8}), randn({4, 3, 4, 4}), Tensor(), 4); },
               {"[patch_embed]", "smaller than one"});
}

}  // namespace
}  // namespace kestrel
