// fused_linear_cross_entropy: loss against a float64 loop reference and against cross_entropy() on
// materialised logits, every option, gradients by finite differences and against the composed op,
// and the memory bound (no [N, V] buffer: Loss/Temporary/Activation/Workspace peaks stay far below N*V*4).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/cross_entropy.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/random.h"
#include "support/numerics.h"
#include "fused_ce_accumulate_check.h"

namespace kestrel {
namespace {
using testing::host_f64;
using testing::randn;

double item_f64(const Tensor& t) { return host_f64(t)[0]; }

// Float64 loop reference of the formula in cross_entropy.h.
double reference_loss(const Tensor& hidden, const Tensor& weight, const std::vector<int64_t>& y,
                      const std::vector<double>& w, const CrossEntropyOptions& o) {
  std::vector<double> X = host_f64(hidden), W = host_f64(weight);
  int64_t N = hidden.shape()[0], H = hidden.shape()[1], V = weight.shape()[0];
  double total = 0, denom = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (y[i] == o.ignore_index) continue;
    std::vector<double> z(V);
    double m = -1e300, zsum = 0;
    for (int64_t j = 0; j < V; ++j) {
      double s = 0;
      for (int64_t c = 0; c < H; ++c) s += X[i * H + c] * W[j * H + c];
      z[j] = s;
      m = std::max(m, s);
      zsum += s;
    }
    double se = 0;
    for (int64_t j = 0; j < V; ++j) se += std::exp(z[j] - m);
    double lse = m + std::log(se), eps = o.label_smoothing;
    double wi = w.empty() ? 1.0 : w[i];
    total += wi * ((1 - eps) * (lse - z[y[i]]) + eps * (lse - zsum / V) + o.z_loss * lse * lse);
    denom += wi;
  }
  if (o.reduction == Reduction::Sum) return total;
  return denom != 0 ? total / denom : 0.0;
}

struct Case {
  int64_t N, H, V;
  int ignored_every = 0;  // every k-th label is ignore_index (0: none; 1: all)
  bool weights = false;
  CrossEntropyOptions o;
};

std::vector<int64_t> make_labels(const Case& c) {
  std::vector<int64_t> y = randint({c.N}, c.V).to_int_vector();
  for (int64_t i = 0; i < c.N; ++i)
    if (c.ignored_every > 0 && i % c.ignored_every == 0) y[i] = c.o.ignore_index;
  return y;
}

void check_case(const Case& c, DType dt) {
  SCOPED_TRACE(::testing::Message() << "N=" << c.N << " H=" << c.H << " V=" << c.V << " ignored_every="
                                    << c.ignored_every << " weights=" << c.weights << " z=" << c.o.z_loss
                                    << " eps=" << c.o.label_smoothing << " sum=" << (c.o.reduction == Reduction::Sum)
                                    << " chunks=" << c.o.chunk_tokens << "x" << c.o.chunk_vocab
                                    << " dtype=" << dtype_name(dt));
  Tensor hidden = randn({c.N, c.H}, dt), weight = randn({c.V, c.H}, dt, Device::cpu(), 0.5);
  std::vector<int64_t> y = make_labels(c);
  Tensor labels = Tensor::from_vector(y, {c.N});
  Tensor tw = c.weights ? testing::randu({c.N}, 0.1, 2.0) : Tensor();
  std::vector<double> wv = c.weights ? host_f64(tw) : std::vector<double>();

  // Loss vs the float64 loop.
  hidden.set_requires_grad(true);
  weight.set_requires_grad(true);
  Tensor loss = fused_linear_cross_entropy(hidden, weight, labels, tw, c.o);
  ASSERT_EQ(loss.dim(), 0);
  double ref = reference_loss(hidden, weight, y, wv, c.o);
  double tol = dt == DType::F64 ? 1e-12 : 1e-5;
  EXPECT_NEAR(item_f64(loss), ref, tol * (1 + std::abs(ref)));
  autograd::backward(loss);
  Tensor dh = hidden.grad(), dw = weight.grad();
  ASSERT_TRUE(dh.defined() && dw.defined());
  EXPECT_TRUE(testing::all_finite(dh) && testing::all_finite(dw));

  // Gradients vs the composed op on materialised logits.
  Tensor h2 = hidden.detach().clone().set_requires_grad(true), w2 = weight.detach().clone().set_requires_grad(true);
  Tensor loss2 = cross_entropy(matmul(h2, w2, false, true), labels, tw, c.o);
  EXPECT_NEAR(item_f64(loss2), ref, tol * (1 + std::abs(ref)));
  autograd::backward(loss2);
  double gtol = dt == DType::F64 ? 1e-12 : 1e-5;
  if (c.ignored_every == 1) {
    for (double v : host_f64(dh)) EXPECT_EQ(v, 0.0);
    for (double v : host_f64(dw)) EXPECT_EQ(v, 0.0);
    EXPECT_EQ(item_f64(loss), 0.0);
  } else {
    EXPECT_LT(testing::rel_l2(dh, h2.grad()), gtol);
    EXPECT_LT(testing::rel_l2(dw, w2.grad()), gtol);
  }
}

TEST(FusedLinearCrossEntropy, OptionsAgainstReferences) {
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(c); };
  Case base{13, 7, 37, 0, false, {}};
  base.o.chunk_tokens = 4;
  base.o.chunk_vocab = 8;  // V not a multiple of the chunk, N not either
  add(base);
  Case n1 = base;
  n1.N = 1;
  add(n1);
  Case all_ignored = base;
  all_ignored.ignored_every = 1;
  add(all_ignored);
  Case mixed = base;
  mixed.ignored_every = 3;
  add(mixed);
  Case weighted = mixed;
  weighted.weights = true;
  add(weighted);
  Case z = base;
  z.o.z_loss = 1e-2;
  add(z);
  Case smooth = mixed;
  smooth.o.label_smoothing = 0.1;
  add(smooth);
  Case summed = weighted;
  summed.o.reduction = Reduction::Sum;
  summed.o.z_loss = 3e-3;
  summed.o.label_smoothing = 0.2;
  add(summed);
  Case all_ignored_sum = all_ignored;
  all_ignored_sum.o.reduction = Reduction::Sum;
  add(all_ignored_sum);
  Case auto_chunks{127, 16, 1000, 5, true, {}};
  auto_chunks.o.z_loss = 1e-4;
  add(auto_chunks);
  Case one_chunk = base;
  one_chunk.o.chunk_tokens = 1000;
  one_chunk.o.chunk_vocab = 1000;
  add(one_chunk);
  for (const Case& c : cases) {
    check_case(c, DType::F64);
    check_case(c, DType::F32);
  }
}

TEST(FusedLinearCrossEntropy, Bf16InputsMatchF32Reference) {
  Tensor hidden = randn({33, 24}, DType::BF16), weight = randn({301, 24}, DType::BF16, Device::cpu(), 0.3);
  std::vector<int64_t> y = randint({33}, 301).to_int_vector();
  CrossEntropyOptions o;
  o.chunk_vocab = 64;
  o.chunk_tokens = 8;
  hidden.set_requires_grad(true);
  weight.set_requires_grad(true);
  Tensor loss = fused_linear_cross_entropy(hidden, weight, Tensor::from_vector(y, {33}), Tensor(), o);
  EXPECT_EQ(loss.dtype(), DType::F32);
  EXPECT_NEAR(item_f64(loss), reference_loss(hidden, weight, y, {}, o), 1e-4);
  autograd::backward(loss);
  EXPECT_EQ(hidden.grad().dtype(), DType::BF16);
  EXPECT_EQ(weight.grad().dtype(), DType::BF16);
  Tensor h2 = hidden.detach().to(DType::F32).set_requires_grad(true);
  Tensor w2 = weight.detach().to(DType::F32).set_requires_grad(true);
  autograd::backward(fused_linear_cross_entropy(h2, w2, Tensor::from_vector(y, {33}), Tensor(), o));
  EXPECT_LT(testing::rel_l2(hidden.grad(), h2.grad()), 1e-2);
  EXPECT_LT(testing::rel_l2(weight.grad(), w2.grad()), 1e-2);
}

TEST(FusedLinearCrossEntropy, GradcheckF64) {
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    CrossEntropyOptions o;
    o.chunk_tokens = 3;
    o.chunk_vocab = 4;
    o.z_loss = variant >= 1 ? 0.05 : 0.0;
    o.label_smoothing = variant >= 1 ? 0.15 : 0.0;
    o.reduction = variant == 2 ? Reduction::Sum : Reduction::Mean;
    std::vector<int64_t> y = {3, -100, 0, 10, 5, 7, 9};
    Tensor labels = Tensor::from_vector(y, {7});
    Tensor tw = variant == 2 ? testing::randu({7}, 0.5, 1.5) : Tensor();
    EXPECT_TRUE(testing::gradcheck(
        [&](const std::vector<Tensor>& in) { return fused_linear_cross_entropy(in[0], in[1], labels, tw, o); },
        {randn({7, 5}, DType::F64), randn({11, 5}, DType::F64)}));
    EXPECT_TRUE(testing::gradcheck(
        [&](const std::vector<Tensor>& in) { return cross_entropy(in[0], labels, tw, o); },
        {randn({7, 11}, DType::F64)}));
  }
}

TEST(FusedLinearCrossEntropy, UpstreamGradientScales) {
  Tensor hidden = randn({9, 6}, DType::F64).set_requires_grad(true);
  Tensor weight = randn({20, 6}, DType::F64).set_requires_grad(true);
  Tensor labels = randint({9}, 20);
  Tensor loss = fused_linear_cross_entropy(hidden, weight, labels);
  autograd::backward({loss}, {Tensor::full({}, 1.0, DType::F64)});
  Tensor g1 = hidden.grad().clone();
  hidden.zero_grad();
  loss = fused_linear_cross_entropy(hidden, weight, labels);
  autograd::backward({loss}, {Tensor::full({}, -2.5, DType::F64)});
  std::vector<double> a = host_f64(g1), b = host_f64(hidden.grad());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], -2.5 * a[i], 1e-12);
}

TEST(FusedLinearCrossEntropy, Errors) {
  Tensor h = randn({4, 8}), w = randn({10, 8});
  auto msg = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  Tensor bad = Tensor::from_vector(std::vector<int64_t>{1, 2, 10, 3}, {4});
  EXPECT_NE(msg([&] { fused_linear_cross_entropy(h, w, bad); }).find("label 10 at position 2 is outside [0, 10)"),
            std::string::npos);
  Tensor neg = Tensor::from_vector(std::vector<int64_t>{1, -1, 0, 3}, {4});
  EXPECT_NE(msg([&] { fused_linear_cross_entropy(h, w, neg); }).find("at position 1"), std::string::npos);
  EXPECT_NE(msg([&] { cross_entropy(randn({4, 10}), bad); }).find("[cross_entropy] label 10 at position 2"),
            std::string::npos);
  Tensor ok = randint({4}, 10);
  EXPECT_NE(msg([&] { fused_linear_cross_entropy(h, randn({10, 7}), ok); }).find("weight must be [V, 8]"),
            std::string::npos);
  EXPECT_NE(msg([&] { fused_linear_cross_entropy(h, w, randint({5}, 10)); }).find("labels must be [4]"),
            std::string::npos);
  EXPECT_NE(msg([&] { fused_linear_cross_entropy(h, w.to(DType::BF16), ok); }).find("share a floating dtype"),
            std::string::npos);
  EXPECT_NE(msg([&] { fused_linear_cross_entropy(h, w, ok, randn({3})); }).find("token_weights must be [4]"),
            std::string::npos);
  CrossEntropyOptions o;
  o.label_smoothing = 1.5;
  EXPECT_NE(msg([&] { fused_linear_cross_entropy(h, w, ok, Tensor(), o); }).find("label_smoothing"),
            std::string::npos);
  // i32 labels are accepted.
  EXPECT_NO_THROW(fused_linear_cross_entropy(h, w, ok.to(DType::I32)));
}

TEST(FusedLinearCrossEntropy, NeverHoldsTokensByVocabBuffer) {
  // N x V x 4 bytes = 102 MB; the op's extra peak must stay far below that.
  const int64_t N = 512, H = 32, V = 50000;
  const int64_t full_logits = N * V * 4;
  Tensor hidden, weight, labels;
  {
    TagScope tag(MemoryTag::Parameter);
    hidden = randn({N, H}).set_requires_grad(true);
    weight = randn({V, H}, DType::F32, Device::cpu(), 0.1).set_requires_grad(true);
    labels = randint({N}, V);
  }
  MemoryTrace& tr = memory_trace(Device::cpu());
  MemorySnapshot before = tr.snapshot();
  tr.reset_peaks();
  const MemoryTag tags[] = {MemoryTag::Loss, MemoryTag::Temporary, MemoryTag::Activation, MemoryTag::Workspace};
  Tensor loss;
  {
    TagScope tag(MemoryTag::Loss);
    loss = fused_linear_cross_entropy(hidden, weight, labels);
  }
  {
    TagScope tag(MemoryTag::Gradient);
    autograd::backward(loss);
  }
  MemorySnapshot after = tr.snapshot();
  int64_t extra = 0;
  for (MemoryTag t : tags) {
    int i = static_cast<int>(t);
    int64_t e = after.tags[i].peak - before.tags[i].current;
    extra += e;
    std::printf("  %-10s extra peak %8.2f MB\n", std::string(tag_name(t)).c_str(), e / 1e6);
  }
  // Gradients: d_hidden [N, H] + d_weight [V, H] themselves, plus whatever else lived in the scope.
  int64_t grad_extra = after.tags[static_cast<int>(MemoryTag::Gradient)].peak -
                       before.tags[static_cast<int>(MemoryTag::Gradient)].current;
  std::printf("  gradient   extra peak %8.2f MB (d_hidden + d_weight = %.2f MB); N*V*4 = %.1f MB\n", grad_extra / 1e6,
              (N + V) * H * 4 / 1e6, full_logits / 1e6);
  EXPECT_LT(extra, full_logits / 8);
  EXPECT_LT(grad_extra, (N + V) * H * 4 + full_logits / 8);
  EXPECT_TRUE(std::isfinite(item_f64(loss)));
}

}  // namespace
}  // namespace kestrel

namespace kestrel {
namespace {
// Gradient accumulation: the second micro-batch's weight gradient is added in place (CPU kernels).
TEST(FusedLinearCrossEntropy, AccumulatesIntoTheHeldWeightGradient) {
  testing::expect_fused_ce_accumulates_in_place(Device::cpu(), DType::F32, 37, 24, 53, 1e-5);
  testing::expect_fused_ce_accumulates_in_place(Device::cpu(), DType::BF16, 19, 16, 29, 1e-2);
}
// Gradients computed in the forward for a known upstream gradient (CPU: the forward then the backward
// kernel inside the forward call) equal the backward path's and the f64 reference.
TEST(FusedLinearCrossEntropy, KnownGradComputesTheGradientsInTheForward) {
  testing::expect_known_grad_matches_backward(Device::cpu(), DType::F32, 23, 16, 41, 1e-5);
  testing::expect_known_grad_matches_backward(Device::cpu(), DType::BF16, 17, 16, 29, 1e-2);
}
TEST(Embedding, AccumulatesIntoTheHeldWeightGradient) {
  testing::expect_embedding_accumulates_in_place(Device::cpu(), DType::F32, 50, 12, 17, 1e-6);
  testing::expect_embedding_accumulates_in_place(Device::cpu(), DType::BF16, 50, 12, 17, 1e-2);
}
}  // namespace
}  // namespace kestrel
