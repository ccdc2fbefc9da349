// Selective recompute regions (RecomputeOptions::keep_outputs_of): a cooperating op's outputs are
// kept from the forward and handed back in the re-run, so its kernel runs once per step; gradients
// are bit-identical to the plain tape and to full recompute (the same kernels on the same values,
// in the same order); kept outputs are offloaded with the inputs under Offload; a re-run that does
// not make the forward's calls is an error naming the region.
#include <gtest/gtest.h>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/recompute.h"
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

int g_costly_runs = 0;  // kernel runs of costly()

// y = tanh(x), written as an op that cooperates with selective regions (as attention does): it asks
// for kept outputs before running its "kernel" and offers them after.
Tensor costly(const Tensor& x) {
  Tensor y;
  if (auto kept = ag::reuse_kept_outputs("costly")) {
    y = (*kept)[0];
  } else {
    ag::NoGradGuard no_grad;
    ++g_costly_runs;
    y = tanh(x.detach());
    ag::keep_outputs("costly", {y});
  }
  if (!ag::should_record({x})) return y;
  Tensor ys = y.detach();
  ag::record("costly", {x}, y, [ys](const std::vector<Tensor>& g) {
    return std::vector<Tensor>{mul(g[0], add_scalar(neg(square(ys)), 1.0))};
  });
  return y;
}

struct SelectiveStack {
  std::vector<Tensor> weights;
  explicit SelectiveStack(int layers, int width) {
    for (int i = 0; i < layers; ++i)
      weights.push_back(randn({width, width}, DType::F32, Device::cpu(), 0.3).set_requires_grad(true));
  }
  Tensor run(Tensor h, ag::RecomputePolicy policy, bool selective) {
    for (auto& w : weights) {
      ag::RecomputeOptions ro{policy, "block"};
      if (selective) ro.keep_outputs_of = {"costly"};
      h = ag::recompute(
          [&w](const std::vector<Tensor>& in) {
            Tensor a = costly(matmul(in[0], w));
            return std::vector<Tensor>{add(tanh(matmul(a, w)), in[0])};
          },
          {h}, ro)[0];
    }
    return h;
  }
};

struct Result {
  std::vector<std::vector<float>> grads;
  std::vector<float> input_grad;
  int runs = 0;
  int64_t activation_after_forward = 0;  // Activation bytes held when backward starts
};

Result run(SelectiveStack& s, const Tensor& x0, ag::RecomputePolicy policy, bool selective) {
  for (auto& w : s.weights) w.zero_grad();
  g_costly_runs = 0;
  Tensor x = x0.clone().set_requires_grad(true);
  MemoryTrace& tr = memory_trace(Device::cpu());
  const int64_t base = tr.snapshot().tags[static_cast<int>(MemoryTag::Activation)].current;
  Tensor loss;
  Result r;
  {
    TagScope act(MemoryTag::Activation);
    loss = sum(square(s.run(x, policy, selective)));
  }
  r.activation_after_forward = tr.snapshot().tags[static_cast<int>(MemoryTag::Activation)].current - base;
  {
    TagScope grads(MemoryTag::Gradient);
    ag::backward(loss);
  }
  for (auto& w : s.weights) r.grads.push_back(w.grad().to_float_vector());
  r.input_grad = x.grad().to_float_vector();
  r.runs = g_costly_runs;
  return r;
}

TEST(SelectiveRecompute, SameGradientsAndTheKeptOpRunsOnce) {
  const int layers = 6, width = 40, rows = 24;
  SelectiveStack s(layers, width);
  Tensor x = randn({rows, width});
  Result plain = run(s, x, ag::RecomputePolicy::None, false);
  Result full = run(s, x, ag::RecomputePolicy::Keep, false);
  Result sel = run(s, x, ag::RecomputePolicy::Keep, true);
  Result sel_off = run(s, x, ag::RecomputePolicy::Offload, true);  // CPU: no offloader, the API path
  EXPECT_EQ(plain.runs, layers);
  EXPECT_EQ(full.runs, 2 * layers);
  EXPECT_EQ(sel.runs, layers);
  EXPECT_EQ(sel_off.runs, layers);
  for (const Result* r : {&full, &sel, &sel_off}) {
    EXPECT_EQ(r->grads, plain.grads);  // same kernels on the same values in the same order: bit-identical
    EXPECT_EQ(r->input_grad, plain.input_grad);
  }
  // What the forward leaves for backward: selective holds one kept [rows, width] f32 output per
  // layer more than full recompute, exactly.
  EXPECT_EQ(sel.activation_after_forward - full.activation_after_forward, int64_t{layers} * rows * width * 4);
}

TEST(SelectiveRecompute, MatchesFiniteDifferences) {
  Tensor w = randn({5, 5}, DType::F64);
  EXPECT_TRUE(testing::gradcheck(
      [](const std::vector<Tensor>& in) {
        ag::RecomputeOptions ro{ag::RecomputePolicy::Keep, "r"};
        ro.keep_outputs_of = {"costly"};
        auto out = ag::recompute(
            [&](const std::vector<Tensor>& r) { return std::vector<Tensor>{mul(costly(matmul(r[0], in[1])), r[0])}; },
            {in[0]}, ro);
        return sum(mul(out[0], out[0]));
      },
      {randn({3, 5}, DType::F64), w}));
}

struct PrefetchCountingHandle final : ag::OffloadHandle {
  Tensor t;
  int* prefetched;
  PrefetchCountingHandle(Tensor x, int* p) : t(std::move(x)), prefetched(p) {}
  void prefetch() override { ++*prefetched; }
  Tensor get() override { return t; }
};

TEST(SelectiveRecompute, KeptOutputsAreOffloadedWithTheInputs) {
  std::vector<int64_t> offloaded;  // numel of each offloaded tensor
  int prefetched = 0;
  ag::set_offloader(Device::cpu(), [&](const Tensor& t) -> std::unique_ptr<ag::OffloadHandle> {
    offloaded.push_back(t.numel());
    return std::make_unique<PrefetchCountingHandle>(t, &prefetched);
  });
  SelectiveStack s(3, 8);
  Tensor x = randn({5, 8});
  Result sel = run(s, x, ag::RecomputePolicy::Offload, true);
  ag::set_offloader(Device::cpu(), nullptr);
  // Per region the kept costly() output [5, 8] and the input [5, 8], but not layer 0's input: a leaf
  // that requires grad stays, as parameters do.
  EXPECT_EQ(offloaded, std::vector<int64_t>(5, 40));
  EXPECT_EQ(prefetched, 5);
  Result plain = run(s, x, ag::RecomputePolicy::None, false);
  EXPECT_EQ(sel.grads, plain.grads);
}

TEST(SelectiveRecompute, ARerunThatDiffersIsAnError) {
  Tensor w = randn({4, 4}).set_requires_grad(true);
  int calls = 0;
  ag::RecomputeOptions ro{ag::RecomputePolicy::Keep, "odd"};
  ro.keep_outputs_of = {"costly"};
  // The forward calls costly() twice, the re-run once.
  Tensor y = ag::recompute(
      [&](const std::vector<Tensor>& in) {
        Tensor a = costly(matmul(in[0], w));
        if (calls++ == 0) a = costly(a);
        return std::vector<Tensor>{a};
      },
      {randn({2, 4})}, ro)[0];
  try {
    ag::backward(sum(y));
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("region 'odd' kept the outputs of 2 op calls"), std::string::npos)
        << e.what();
  }
  ag::clear_tape();
}

TEST(SelectiveRecompute, NothingIsKeptOutsideARegion) {
  // No region (or no grad): the op's outputs go nowhere and nothing is handed back.
  g_costly_runs = 0;
  Tensor x = randn({3, 3}).set_requires_grad(true);
  Tensor y = costly(x);
  EXPECT_FALSE(ag::reuse_kept_outputs("costly").has_value());
  ag::backward(sum(y));
  EXPECT_EQ(g_costly_runs, 1);
  {
    ag::NoGradGuard no_grad;
    ag::RecomputeOptions ro{ag::RecomputePolicy::Keep, "eval"};
    ro.keep_outputs_of = {"costly"};
    Tensor z = ag::recompute([](const std::vector<Tensor>& in) { return std::vector<Tensor>{costly(in[0])}; },
                             {x}, ro)[0];
    EXPECT_EQ(z.to_float_vector(), y.to_float_vector());
  }
  EXPECT_EQ(g_costly_runs, 2);
}

}  // namespace
}  // namespace kestrel
