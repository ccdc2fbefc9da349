// Sliding-window decoders on the GPU: a Mistral (window on every layer), a Qwen2 with
// use_sliding_window + max_window_layers and a Qwen3 with layer_types, over packed documents longer
// than their windows, give the CPU f32 loss and gradients in bf16 on CUDA within the bounds of
// ModelsCuda.DecoderMatchesCpu; the same weights without the windows miss those gradients (so the
// windows are exercised); and a windowed Mistral's KV-cache decoding on the GPU matches its full
// forward.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/shape.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace ag = autograd;

TextConfig base(const std::string& type) {
  TextConfig c = TextConfig::defaults_for(type);
  c.vocab_size = 89;
  c.hidden_size = 64;
  c.intermediate_size = 80;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 512;
  c.tie_word_embeddings = type != "mistral";
  return c;
}

const std::vector<int64_t> kLens = {300, 17, 190};  // longer and shorter than the windows

// Loss and gradients of `cfg` with `m`'s weights on device d (labels/ids shared).
struct Run {
  double loss;
  std::vector<Tensor> grads;  // CPU f32, in parameter order
};
Run run(const TextConfig& cfg, DType dt, Device d, Decoder& weights, const Tensor& ids, const Tensor& labels) {
  Decoder m(cfg, dt, d, 1);
  for (auto& [name, t] : m.parameters().items()) t->copy_(weights.parameters().get(name));
  PackedBatch b = PackedBatch::from_lengths(kLens, d);
  Tensor loss = m.loss(m.forward(m.embed(ids.to(d)), b), labels.to(d));
  ag::backward(loss);
  Run r{loss.item(), {}};
  for (auto& [name, t] : m.parameters().items()) {
    EXPECT_TRUE(t->grad().defined()) << name;
    r.grads.push_back(t->grad().to(Device::cpu()).to(DType::F32));
  }
  return r;
}

void expect_gpu_matches_cpu(const TextConfig& cfg) {
  Decoder weights(cfg, DType::BF16, Device::cpu(), 3);  // bf16-representable values for both runs
  int64_t T = 0;
  for (int64_t l : kLens) T += l;
  Tensor ids = randint({T}, cfg.vocab_size), labels = randint({T}, cfg.vocab_size);
  const Run gpu = run(cfg, DType::BF16, Device::cuda(0), weights, ids, labels);
  const Run cpu = run(cfg, DType::F32, Device::cpu(), weights, ids, labels);
  TextConfig full = cfg;
  full.sliding_window.reset();
  full.layer_types.clear();
  const Run cpu_full = run(full, DType::F32, Device::cpu(), weights, ids, labels);
  EXPECT_NEAR(gpu.loss, cpu.loss, 2e-2 * std::abs(cpu.loss));
  double worst = 0, worst_full = 0;
  for (size_t i = 0; i < cpu.grads.size(); ++i) {
    EXPECT_TRUE(testing::all_finite(gpu.grads[i]));
    const double e = testing::rel_l2(gpu.grads[i], cpu.grads[i]);
    EXPECT_LT(e, 5e-2) << "parameter " << i;
    worst = std::max(worst, e);
    worst_full = std::max(worst_full, testing::rel_l2(cpu_full.grads[i], cpu.grads[i]));
  }
  std::printf("[sliding window cuda] %s: bf16 GPU vs f32 CPU worst grad %.2e; without the windows %.2e\n",
              cfg.model_type.c_str(), worst, worst_full);
  EXPECT_GT(worst_full, 0.1) << "the windows do not change the gradients: the test would not see them";
}

TEST(SlidingWindowCuda, MistralDecoderMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("mistral");
  c.sliding_window = 40;
  expect_gpu_matches_cpu(c);
}

TEST(SlidingWindowCuda, Qwen2MaxWindowLayersMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("qwen2");
  c.use_sliding_window = true;
  c.sliding_window = 50;
  c.max_window_layers = 1;  // layer 1 slides
  ASSERT_EQ(c.attention_window(0), 0);
  ASSERT_EQ(c.attention_window(1), 50);
  expect_gpu_matches_cpu(c);
}

TEST(SlidingWindowCuda, Qwen3LayerTypesMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("qwen3");
  c.use_sliding_window = true;
  c.sliding_window = 33;
  c.layer_types = {"sliding_attention", "full_attention"};
  expect_gpu_matches_cpu(c);
}

TEST(SlidingWindowCuda, MistralKvCacheMatchesFullForward) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("mistral");
  c.sliding_window = 5;
  const Device d = Device::cuda(0);
  Decoder m(c, DType::BF16, d, 7);
  const int64_t T = 40, prefix = 23;
  Tensor ids = randint({T}, c.vocab_size);
  Tensor full = m.logits(m.forward(m.embed(ids.to(d)), PackedBatch::from_lengths({T}, d)));
  KvCache cache;
  std::vector<Tensor> rows = {m.logits(m.forward_cached(m.embed(narrow(ids, 0, 0, prefix).to(d)), {prefix}, cache))};
  for (int64_t t = prefix; t < T; ++t)
    rows.push_back(m.logits(m.forward_cached(m.embed(narrow(ids, 0, t, 1).to(d)), {1}, cache)));
  EXPECT_LT(testing::rel_l2(concat(rows, 0).to(DType::F32), full.to(DType::F32)), 2e-2);
}

}  // namespace
}  // namespace kestrel::models
