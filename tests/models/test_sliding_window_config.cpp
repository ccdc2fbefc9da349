// Sliding-window fields of text configs resolved as transformers 5 does (MistralConfig,
// Qwen2Config/Qwen3Config __post_init__), refused where transformers would fail or Kestrel does not
// compute them, written back by to_json; and a Mistral decoder's KV-cache path (windowed) equal to
// re-running the whole prefix.
#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>

#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/runtime/error.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
using nlohmann::json;

void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a kestrel::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

std::vector<int64_t> windows(const TextConfig& t) {
  std::vector<int64_t> w;
  for (int64_t l = 0; l < t.num_hidden_layers; ++l) w.push_back(t.attention_window(l));
  return w;
}

// Mistral-7B-v0.1's config.json, as published.
json mistral_7b() {
  return json::parse(R"({
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
    "transformers_version": "4.34.0.dev0", "use_cache": true, "vocab_size": 32000})");
}

TEST(SlidingWindowConfig, MistralSlidesEveryLayer) {
  TextConfig t = TextConfig::from_json(mistral_7b(), "mistral.json");
  EXPECT_EQ(t.model_type, "mistral");
  EXPECT_EQ(windows(t), std::vector<int64_t>(32, 4096));
  EXPECT_FALSE(t.qkv_bias());
  EXPECT_FALSE(t.o_proj_bias());
  EXPECT_FALSE(t.qk_norm());
  const json out = t.to_json();
  EXPECT_EQ(out["architectures"][0], "MistralForCausalLM");
  EXPECT_EQ(out["sliding_window"], 4096);
  EXPECT_FALSE(out.contains("use_sliding_window"));
  EXPECT_EQ(out["transformers_version"], "4.34.0.dev0");
  EXPECT_EQ(TextConfig::from_json(out).to_json(), out);
  // MistralConfig's defaults: window 4096 when the key is absent, 8 KV heads; null = no window.
  TextConfig d = TextConfig::from_json(json{{"model_type", "mistral"}});
  EXPECT_EQ(d.attention_window(0), 4096);
  EXPECT_EQ(d.num_key_value_heads, 8);
  EXPECT_EQ(d.intermediate_size, 14336);
  EXPECT_EQ(d.max_position_embeddings, 131072);
  json n = mistral_7b();
  n["sliding_window"] = nullptr;
  TextConfig none = TextConfig::from_json(n);
  EXPECT_EQ(windows(none), std::vector<int64_t>(32, 0));
  EXPECT_TRUE(none.to_json()["sliding_window"].is_null());
  EXPECT_EQ(TextConfig::from_json(none.to_json()).attention_window(0), 0);
  // attention_bias is not a Mistral field: kept verbatim, never read.
  json b = mistral_7b();
  b["attention_bias"] = true;
  TextConfig tb = TextConfig::from_json(b);
  EXPECT_FALSE(tb.qkv_bias());
  EXPECT_EQ(tb.to_json()["attention_bias"], true);
}

TEST(SlidingWindowConfig, MistralRefusesWhatMistralModelWouldNotCompute) {
  json j = mistral_7b();
  j["num_hidden_layers"] = 2;
  j["layer_types"] = {"sliding_attention", "full_attention"};
  expect_error([&] { TextConfig::from_json(j, "m.json"); }, {"m.json", "'layer_types' [1]", "Ministral"});
  j["layer_types"] = {"sliding_attention", "sliding_attention"};
  EXPECT_EQ(windows(TextConfig::from_json(j)), (std::vector<int64_t>{4096, 4096}));
  j["sliding_window"] = 0;
  expect_error([&] { TextConfig::from_json(j, "m.json"); }, {"'sliding_window' must be positive"});
  j["sliding_window"] = "4096";
  expect_error([&] { TextConfig::from_json(j, "m.json"); }, {"'sliding_window' must be an integer or null"});
}

json qwen2_small() {
  return json{{"model_type", "qwen2"},      {"hidden_size", 64},        {"num_attention_heads", 4},
              {"num_key_value_heads", 2},   {"num_hidden_layers", 4},   {"intermediate_size", 96},
              {"vocab_size", 100},          {"use_sliding_window", true}, {"sliding_window", 20},
              {"max_window_layers", 1}};
}

TEST(SlidingWindowConfig, Qwen2MaxWindowLayersAndLayerTypes) {
  TextConfig t = TextConfig::from_json(qwen2_small());
  EXPECT_EQ(windows(t), (std::vector<int64_t>{0, 20, 20, 20}));
  json out = t.to_json();
  EXPECT_EQ(out["use_sliding_window"], true);
  EXPECT_EQ(out["sliding_window"], 20);
  EXPECT_EQ(out["max_window_layers"], 1);
  EXPECT_EQ(windows(TextConfig::from_json(out)), windows(t));
  EXPECT_EQ(TextConfig::from_json(out).to_json(), out);
  // use_sliding_window false: no window anywhere (transformers sets sliding_window to None).
  json off = qwen2_small();
  off["use_sliding_window"] = false;
  EXPECT_EQ(windows(TextConfig::from_json(off)), (std::vector<int64_t>{0, 0, 0, 0}));
  // layer_types (as transformers 5 saves it) wins over max_window_layers.
  json lt = qwen2_small();
  lt["layer_types"] = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
  TextConfig tl = TextConfig::from_json(lt);
  EXPECT_EQ(windows(tl), (std::vector<int64_t>{20, 0, 20, 0}));
  EXPECT_EQ(tl.to_json()["layer_types"], lt["layer_types"]);
  EXPECT_EQ(TextConfig::from_json(tl.to_json()).to_json(), tl.to_json());
  // A sliding layer without a window: transformers' mask builder raises; so do we, naming the layer.
  off["layer_types"] = {"full_attention", "sliding_attention", "full_attention", "full_attention"};
  expect_error([&] { TextConfig::from_json(off, "q.json"); },
               {"q.json", "'layer_types' [1]", "use_sliding_window is false"});
  lt["layer_types"] = {"sliding_attention", "chunked_attention", "full_attention", "full_attention"};
  expect_error([&] { TextConfig::from_json(lt, "q.json"); }, {"'layer_types' [1] = 'chunked_attention'",
                                                              "full_attention and sliding_attention"});
  lt["layer_types"] = {"sliding_attention"};
  expect_error([&] { TextConfig::from_json(lt, "q.json"); }, {"'layer_types' has 1 entries for 4 layers"});
}

TEST(SlidingWindowConfig, Qwen3LayerTypesAndNesting) {
  json j = qwen2_small();
  j["model_type"] = "qwen3";
  j["head_dim"] = 16;
  j["layer_types"] = {"full_attention", "full_attention", "sliding_attention", "sliding_attention"};
  TextConfig t = TextConfig::from_json(j);
  EXPECT_EQ(windows(t), (std::vector<int64_t>{0, 0, 20, 20}));
  EXPECT_TRUE(t.qk_norm());
  // Inside a VLM the error names the nesting.
  json bad = j;
  bad["layer_types"] = {"full_attention"};
  json vlm = {{"model_type", "kestrel_vlm"}, {"vision_config", json::object()}, {"image_token_id", 1},
              {"text_config", bad}};
  expect_error([&] { VlmConfig::from_json(vlm, "vlm.json"); }, {"vlm.json", "'text_config.layer_types'"});
}

TEST(SlidingWindowConfig, LlamaHasNoWindow) {
  // LlamaModel ignores these keys: kept verbatim, no window; sliding layer_types refused (audit).
  json j = {{"model_type", "llama"}, {"hidden_size", 64}, {"num_attention_heads", 4}, {"num_hidden_layers", 2},
            {"sliding_window", 16}, {"use_sliding_window", true}};
  TextConfig t = TextConfig::from_json(j);
  EXPECT_EQ(windows(t), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(t.to_json()["sliding_window"], 16);
  EXPECT_EQ(TextConfig::from_json(t.to_json()).to_json(), t.to_json());
}

// The KV-cache path honours the window: a Mistral (window 3) fed its prefix then one token at a time
// gives the logits of one full forward over the same tokens.
TEST(SlidingWindowConfig, MistralKvCacheMatchesFullForward) {
  TextConfig c = TextConfig::defaults_for("mistral");
  c.vocab_size = 40;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.sliding_window = 3;
  Decoder m(c, DType::F32, Device::cpu(), 7);
  const std::vector<int64_t> ids = {5, 9, 1, 30, 2, 17, 8, 11, 3};
  const int64_t T = static_cast<int64_t>(ids.size());
  const PackedBatch batch = PackedBatch::from_lengths({T}, Device::cpu());
  Tensor full = m.logits(m.forward(m.embed(Tensor::from_vector(ids, {T})), batch));
  KvCache cache;
  const int64_t prefix = 4;
  std::vector<Tensor> rows;
  Tensor h = m.forward_cached(m.embed(Tensor::from_vector(std::vector<int64_t>(ids.begin(), ids.begin() + prefix),
                                                          {prefix})),
                              {prefix}, cache);
  rows.push_back(m.logits(h));
  for (int64_t t = prefix; t < T; ++t)
    rows.push_back(
        m.logits(m.forward_cached(m.embed(Tensor::from_vector(std::vector<int64_t>{ids[t]}, {1})), {1}, cache)));
  EXPECT_LT(testing::rel_l2(concat(rows, 0), full), 1e-5);
  // And the window matters here: without it the logits differ.
  c.sliding_window.reset();
  Decoder nowin(c, DType::F32, Device::cpu(), 7);
  Tensor full_nowin = nowin.logits(nowin.forward(nowin.embed(Tensor::from_vector(ids, {T})), batch));
  EXPECT_GT(testing::rel_l2(full_nowin, full), 1e-3);
}

// The attention FLOPs MFU counts: 12 x heads x head_dim per visible (query, key) pair and layer, the
// visible pairs counted by brute force over each document (causal, within the layer's window), for a
// config whose layers mix full and sliding attention and documents shorter and longer than the window.
TEST(SlidingWindowConfig, AttentionTrainingFlopsCountVisiblePairs) {
  json j = qwen2_small();
  j["num_hidden_layers"] = 3;
  j["sliding_window"] = 5;
  j["max_window_layers"] = 1;  // layer 0 full, layers 1-2 sliding
  const TextConfig t = TextConfig::from_json(j);
  const std::vector<int64_t> lengths = {1, 4, 5, 6, 17};
  double expected = 0;
  for (int64_t l = 0; l < t.num_hidden_layers; ++l) {
    const int64_t w = t.attention_window(l);
    int64_t pairs = 0;
    for (int64_t T : lengths)
      for (int64_t i = 0; i < T; ++i)
        for (int64_t k = 0; k <= i; ++k) pairs += (w <= 0 || k > i - w) ? 1 : 0;
    expected += 12.0 * static_cast<double>(t.num_attention_heads * t.head_dim * pairs);
  }
  ASSERT_EQ(windows(t), (std::vector<int64_t>{0, 5, 5}));
  EXPECT_DOUBLE_EQ(t.attention_training_flops(lengths), expected);
  EXPECT_EQ(t.attention_training_flops({}), 0.0);
}

}  // namespace
}  // namespace kestrel::models
