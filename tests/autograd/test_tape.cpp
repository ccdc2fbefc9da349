// The tape: gradient routing, accumulation across backward calls, hooks, requires_grad rules,
// and memory falling during backward as entries release their saved tensors.
#include <gtest/gtest.h>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/memory_trace.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
namespace ag = autograd;
using testing::randn;
using testing::rel_l2;

TEST(Tape, ChainRuleThroughSharedValue) {
  // y = sum(tanh(x @ w) * (x @ w)): the product x@w is used twice.
  Tensor x = randn({4, 3}, DType::F64).set_requires_grad(true);
  Tensor w = randn({3, 5}, DType::F64).set_requires_grad(true);
  EXPECT_TRUE(testing::gradcheck(
      [](const std::vector<Tensor>& in) {
        Tensor h = matmul(in[0], in[1]);
        return sum(mul(tanh(h), h));
      },
      {x, w}));
}

TEST(Tape, GradientAccumulatesAcrossBackwardCalls) {
  Tensor w = randn({6}, DType::F64).set_requires_grad(true);
  Tensor a = randn({6}, DType::F64), b = randn({6}, DType::F64);
  ag::backward(sum(mul(w, a)));
  ag::backward(sum(mul(w, b)));
  Tensor expected = add(a, b);
  EXPECT_LT(rel_l2(w.grad(), expected), 1e-14);
  w.zero_grad();
  EXPECT_FALSE(w.grad().defined());
}

TEST(Tape, NoGradientForTensorsThatDoNotRequireIt) {
  Tensor w = randn({3, 3}).set_requires_grad(true);
  Tensor c = randn({3, 3});
  Tensor loss = sum(matmul(c, w));
  ag::backward(loss);
  EXPECT_TRUE(w.grad().defined());
  EXPECT_FALSE(c.grad().defined());
  {
    ag::NoGradGuard ng;
    Tensor y = matmul(c, w);
    EXPECT_FALSE(y.requires_grad());
  }
  EXPECT_EQ(ag::current_tape().size(), 0u);
  EXPECT_THROW(ag::backward(sum(c)), Error);
}

TEST(Tape, HooksFireOnceWhenGradientIsFinalInReverseUseOrder) {
  Tensor w1 = randn({4, 4}).set_requires_grad(true).set_name("w1");
  Tensor w2 = randn({4, 4}).set_requires_grad(true).set_name("w2");
  std::vector<std::string> order;
  std::vector<double> grad_norms;
  auto hook = [&](Tensor& p, Tensor& g) {
    order.push_back(p.name());
    // The gradient is final: compare against what .grad holds after backward below.
    grad_norms.push_back(sum(mul(g, g)).item());
  };
  ag::add_grad_ready_hook(w1, hook);
  ag::add_grad_ready_hook(w2, hook);
  Tensor x = randn({2, 4});
  // w1 is used twice (first and last), so it is final only at the very end of backward.
  Tensor h = matmul(matmul(matmul(x, w1), w2), w1);
  ag::backward(sum(h));
  ASSERT_EQ(order, (std::vector<std::string>{"w2", "w1"}));
  EXPECT_NEAR(grad_norms[1], sum(mul(w1.grad(), w1.grad())).item(), 1e-3 * grad_norms[1]);
}

TEST(Tape, SavedTensorsAreReleasedDuringBackward) {
  MemoryTrace& tr = memory_trace(Device::cpu());
  Tensor w = randn({256, 256}).set_requires_grad(true);
  int64_t before = tr.snapshot().tags[static_cast<int>(MemoryTag::Activation)].current;
  Tensor loss;
  {
    TagScope act(MemoryTag::Activation);
    Tensor h = randn({64, 256});
    for (int i = 0; i < 8; ++i) h = tanh(matmul(h, w));
    loss = sum(h);
  }
  int64_t after_forward = tr.snapshot().tags[static_cast<int>(MemoryTag::Activation)].current;
  EXPECT_GT(after_forward - before, 8 * 64 * 256 * 4);  // the saved tanh outputs are alive
  {
    TagScope g(MemoryTag::Gradient);
    ag::backward(loss);
  }
  loss = Tensor();
  int64_t after_backward = tr.snapshot().tags[static_cast<int>(MemoryTag::Activation)].current;
  EXPECT_EQ(after_backward, before);
}

}  // namespace
}  // namespace kestrel

namespace kestrel {
namespace {

// An op whose backward throws (as a kernel refusing its inputs would) part-way through a backward:
// the error reaches the caller, the tape is left empty rather than holding consumed (null) entries,
// and the next forward and backward run normally with exact gradients. (Before, the next backward
// walked the consumed slots and crashed.)
TEST(Tape, ThrowingBackwardLeavesAUsableTape) {
  Tensor w = randn({5}, DType::F64).set_requires_grad(true);
  Tensor a = randn({5}, DType::F64), b = randn({5}, DType::F64);
  {
    Tensor h = mul(w, a);  // recorded before the throwing entry: never reached by the walk
    Tensor y = h.detach().clone();
    ag::record("refusing_op", {h}, y, [](const std::vector<Tensor>&) -> std::vector<Tensor> {
      throw Error("[refusing_op] refused in backward");
    });
    Tensor loss = sum(y);
    EXPECT_GT(ag::current_tape().size(), 2u);
    try {
      ag::backward(loss);
      ADD_FAILURE() << "the backward did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("refused in backward"), std::string::npos) << e.what();
    }
    EXPECT_EQ(ag::current_tape().size(), 0u);
  }
  EXPECT_FALSE(w.grad().defined());  // the throw came before any gradient reached w
  ag::backward(sum(mul(w, b)));
  EXPECT_LT(rel_l2(w.grad(), b), 1e-15);
}

}  // namespace
}  // namespace kestrel
