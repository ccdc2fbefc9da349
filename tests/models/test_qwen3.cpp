// Qwen3 as a text model type: the published config.json, HF parameter names (q_norm/k_norm per head,
// biases only with attention_bias), the per-head RMSNorm of q and k before rope against a composed
// reference, and gradients through q_norm/k_norm against finite differences in float64.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/rope.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
using nlohmann::json;

// Qwen3-0.6B's config.json, as published.
json qwen3_06b() {
  return json::parse(R"({
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

TextConfig tiny_qwen3() {
  TextConfig c = TextConfig::defaults_for("qwen3");
  c.vocab_size = 29;
  c.hidden_size = 12;
  c.intermediate_size = 20;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 3;
  c.num_key_value_heads = 1;
  c.head_dim = 6;  // != hidden / heads, as in every Qwen3 checkpoint
  c.tie_word_embeddings = true;
  return c;
}

TEST(Qwen3, PublishedConfig) {
  TextConfig t = TextConfig::from_json(qwen3_06b(), "qwen3.json");
  EXPECT_EQ(t.model_type, "qwen3");
  EXPECT_EQ(t.head_dim, 128);  // explicit, != 1024 / 16
  EXPECT_TRUE(t.qk_norm());
  EXPECT_FALSE(t.qkv_bias());
  EXPECT_FALSE(t.o_proj_bias());
  EXPECT_DOUBLE_EQ(t.rope_theta, 1e6);
  json out = t.to_json();
  EXPECT_EQ(out["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(out["head_dim"], 128);
  EXPECT_EQ(TextConfig::from_json(out).to_json(), out);
  // Defaults: head_dim 128 whatever hidden / heads is; attention_bias gives q/k/v/o biases.
  TextConfig d = TextConfig::from_json(json{{"model_type", "qwen3"}, {"hidden_size", 256}, {"num_attention_heads", 4},
                                            {"attention_bias", true}});
  EXPECT_EQ(d.head_dim, 128);
  EXPECT_TRUE(d.qkv_bias());
  EXPECT_TRUE(d.o_proj_bias());
  // Layers >= max_window_layers slide when use_sliding_window is on and sliding_window is set; with
  // sliding_window null (as Qwen3-0.6B ships) transformers slides no layer.
  json s = qwen3_06b();
  s["use_sliding_window"] = true;
  s["max_window_layers"] = 20;
  TextConfig none = TextConfig::from_json(s);
  for (int64_t l = 0; l < none.num_hidden_layers; ++l) EXPECT_EQ(none.attention_window(l), 0) << l;
  s["sliding_window"] = 4096;
  TextConfig some = TextConfig::from_json(s);
  EXPECT_EQ(some.attention_window(19), 0);
  EXPECT_EQ(some.attention_window(20), 4096);
  EXPECT_EQ(TextConfig::from_json(some.to_json()).to_json(), some.to_json());
}

TEST(Qwen3, HfNames) {
  Decoder m(tiny_qwen3(), DType::F32, Device::cpu(), 1);
  EXPECT_EQ(m.parameters().get("model.layers.1.self_attn.q_norm.weight").shape(), (Shape{6}));
  EXPECT_EQ(m.parameters().get("model.layers.0.self_attn.k_norm.weight").shape(), (Shape{6}));
  EXPECT_EQ(m.parameters().get("model.layers.0.self_attn.q_proj.weight").shape(), (Shape{18, 12}));
  EXPECT_EQ(m.parameters().get("model.layers.0.self_attn.o_proj.weight").shape(), (Shape{12, 18}));
  EXPECT_EQ(m.parameters().find("model.layers.0.self_attn.q_proj.bias"), nullptr);
  EXPECT_EQ(m.parameters().find("lm_head.weight"), nullptr);
}

// The layer's rope input is RMSNorm(q_head) * q_norm: scaling q_proj and k_proj must leave the first
// layer's output unchanged (the per-head normalisation undoes it), scaling q_norm must not.
TEST(Qwen3, QkNormMakesAttentionInvariantToQkScale) {
  autograd::NoGradGuard no_grad;
  TextConfig c = tiny_qwen3();
  c.rms_norm_eps = 1e-14;  // so the scale below cancels to rounding
  Decoder m(c, DType::F64, Device::cpu(), 2);
  PackedBatch batch = PackedBatch::from_lengths({5, 4}, Device::cpu());
  Tensor h = testing::randn({9, 12}, DType::F64);
  Tensor before = m.layer_forward(0, h, batch);
  // Scaling q_proj and k_proj rows changes nothing after a per-head RMSNorm (eps aside).
  for (const char* n : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}) {
    Tensor& w = m.parameters().get(n);
    w.copy_(scale(w, 7.0));
  }
  EXPECT_LT(testing::rel_l2(m.layer_forward(0, h, batch), before), 1e-9);
  // ...while the norm weights do matter.
  Tensor& qn = m.parameters().get("model.layers.0.self_attn.q_norm.weight");
  qn.copy_(scale(qn, 1.5));
  EXPECT_GT(testing::rel_l2(m.layer_forward(0, h, batch), before), 1e-5);  // small: the residual dominates
}

TEST(Qwen3, GradientsMatchFiniteDifferences) {
  Decoder m(tiny_qwen3(), DType::F64, Device::cpu(), 5);
  PackedBatch batch = PackedBatch::from_lengths({5, 3}, Device::cpu());
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, 5, 9, 2, 28, 7, 7, 11}, {8});
  Tensor labels = Tensor::from_vector(std::vector<int64_t>{5, 9, 2, 28, -100, 7, 11, -100}, {8});
  Generator g(9);
  for (auto& [name, t] : m.parameters().items())
    t->copy_(add(t->detach(), normal(t->shape(), 0, 0.1, DType::F64, Device::cpu(), g)));
  std::vector<std::string> names = {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                                    "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.q_proj.weight"};
  std::vector<Tensor> inputs;
  for (auto& n : names) inputs.push_back(m.parameters().get(n).detach());
  EXPECT_TRUE(testing::gradcheck(
      [&](const std::vector<Tensor>& in) {
        for (size_t i = 0; i < names.size(); ++i) m.parameters().get(names[i]) = in[i];
        return m.loss(m.forward(m.embed(ids), batch), labels);
      },
      inputs, {.eps = 1e-6, .atol = 1e-8, .rtol = 1e-5}));
}

}  // namespace
}  // namespace kestrel::models
