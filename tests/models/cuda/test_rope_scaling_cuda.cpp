// Scaled rotary tables and Qwen3 on the GPU: decoders with llama3, yarn (attention factor != 1) and
// linear scaling, and a Qwen3 (q/k norm per head, head_dim != hidden / heads), run over documents
// longer than original_max_position_embeddings in bf16 on CUDA, give the CPU f32 loss and gradients
// within the bf16 bounds of ModelsCuda.DecoderMatchesCpu.
#include <gtest/gtest.h>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
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
  c.tie_word_embeddings = type != "llama";
  return c;
}

void expect_gpu_matches_cpu(const TextConfig& cfg) {
  Decoder gpu(cfg, DType::BF16, Device::cuda(0), 3);
  Decoder cpu(cfg, DType::F32, Device::cpu(), 99);
  for (auto& [name, t] : cpu.parameters().items()) t->copy_(gpu.parameters().get(name));
  std::vector<int64_t> lens = {300, 17, 190};  // past original_max_position_embeddings = 64
  int64_t T = 507;
  Tensor ids = randint({T}, cfg.vocab_size);
  Tensor labels = randint({T}, cfg.vocab_size);
  auto run = [&](Decoder& m, Device d) {
    PackedBatch b = PackedBatch::from_lengths(lens, d);
    Tensor loss = m.loss(m.forward(m.embed(ids.to(d)), b), labels.to(d));
    ag::backward(loss);
    return loss.item();
  };
  double lg = run(gpu, Device::cuda(0)), lc = run(cpu, Device::cpu());
  EXPECT_NEAR(lg, lc, 2e-2 * std::abs(lc));
  for (auto& [name, t] : cpu.parameters().items()) {
    Tensor gg = gpu.parameters().get(name).grad();
    ASSERT_TRUE(gg.defined()) << name;
    EXPECT_TRUE(testing::all_finite(gg)) << name;
    EXPECT_LT(testing::rel_l2(gg, t->grad()), 5e-2) << name;
  }
}

TEST(RopeScalingCuda, Llama3DecoderMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("llama");
  c.rope_theta = 500000.0;
  c.rope_scaling.rope_type = "llama3";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.low_freq_factor = 1.0;
  c.rope_scaling.high_freq_factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 64;
  expect_gpu_matches_cpu(c);
}

TEST(RopeScalingCuda, YarnDecoderMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("qwen2");
  c.rope_scaling.rope_type = "yarn";
  c.rope_scaling.factor = 8.0;
  c.rope_scaling.original_max_position_embeddings = 64;
  ASSERT_GT(c.rope_frequencies().attention_scaling, 1.2);
  expect_gpu_matches_cpu(c);
}

TEST(RopeScalingCuda, LinearDecoderMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("llama");
  c.rope_scaling.rope_type = "linear";
  c.rope_scaling.factor = 4.0;
  expect_gpu_matches_cpu(c);
}

TEST(RopeScalingCuda, Qwen3DecoderMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = base("qwen3");
  c.head_dim = 16;  // 6 x 16 != 64: explicit head_dim, as in Qwen3 checkpoints
  c.rope_scaling.rope_type = "yarn";
  c.rope_scaling.factor = 4.0;
  c.rope_scaling.original_max_position_embeddings = 128;
  expect_gpu_matches_cpu(c);
}

}  // namespace
}  // namespace kestrel::models
