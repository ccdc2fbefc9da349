// HF config.json parsing: defaults per model_type, both rope_theta spellings, bias rules,
// validation errors naming the file and field, and to_json round trips.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "kestrel/models/config.h"
#include "kestrel/runtime/error.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace kestrel;
using namespace kestrel::models;

namespace {
void expect_error(const std::function<void()>& fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a kestrel::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("[config]"), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

// Qwen2.5-0.5B's config.json, as published.
json qwen25_05b() {
  return json::parse(R"({
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
    "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": true,
    "use_sliding_window": false, "vocab_size": 151936})");
}

// Llama-3.2-1B's config.json (transformers 5 style rope_parameters instead of rope_theta).
json llama32_1b_v5() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                        "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192},
    "tie_word_embeddings": true, "dtype": "bfloat16", "vocab_size": 128256})");
}
}  // namespace

TEST(Config, LlamaDefaults) {
  TextConfig t = TextConfig::from_json(json{{"model_type", "llama"}});
  EXPECT_EQ(t.vocab_size, 32000);
  EXPECT_EQ(t.hidden_size, 4096);
  EXPECT_EQ(t.intermediate_size, 11008);
  EXPECT_EQ(t.num_hidden_layers, 32);
  EXPECT_EQ(t.num_attention_heads, 32);
  EXPECT_EQ(t.num_key_value_heads, 32);
  EXPECT_EQ(t.head_dim, 128);
  EXPECT_EQ(t.max_position_embeddings, 2048);
  EXPECT_DOUBLE_EQ(t.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(t.rope_theta, 10000.0);
  EXPECT_FALSE(t.tie_word_embeddings);
  EXPECT_EQ(t.bos_token_id, 1);
  EXPECT_EQ(t.eos_token_ids, std::vector<int64_t>{2});
  EXPECT_FALSE(t.pad_token_id.has_value());
  EXPECT_FALSE(t.qkv_bias());
  EXPECT_FALSE(t.o_proj_bias());
  // kv heads default to the head count, head_dim to hidden / heads.
  TextConfig g = TextConfig::from_json(json{{"model_type", "llama"}, {"hidden_size", 256}, {"num_attention_heads", 8}});
  EXPECT_EQ(g.num_key_value_heads, 8);
  EXPECT_EQ(g.head_dim, 32);
}

TEST(Config, Qwen2DefaultsAndBias) {
  TextConfig t = TextConfig::from_json(json{{"model_type", "qwen2"}});
  EXPECT_EQ(t.vocab_size, 151936);
  EXPECT_EQ(t.intermediate_size, 22016);
  EXPECT_EQ(t.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(t.rope_theta, 10000.0);
  EXPECT_FALSE(t.bos_token_id.has_value());
  EXPECT_TRUE(t.eos_token_ids.empty());
  EXPECT_TRUE(t.qkv_bias());
  EXPECT_FALSE(t.o_proj_bias());

  TextConfig q = TextConfig::from_json(qwen25_05b(), "qwen.json");
  EXPECT_EQ(q.hidden_size, 896);
  EXPECT_EQ(q.num_key_value_heads, 2);
  EXPECT_EQ(q.head_dim, 64);
  EXPECT_EQ(q.kv_groups(), 7);
  EXPECT_DOUBLE_EQ(q.rope_theta, 1e6);
  EXPECT_TRUE(q.tie_word_embeddings);
  EXPECT_EQ(q.bos_token_id, 151643);
  EXPECT_EQ(q.torch_dtype, "bfloat16");

  // llama: attention_bias puts a bias on q, k, v and o.
  TextConfig lb = TextConfig::from_json(json{{"model_type", "llama"}, {"attention_bias", true}});
  EXPECT_TRUE(lb.qkv_bias());
  EXPECT_TRUE(lb.o_proj_bias());
  // qwen2 ignores llama's key (its bias layout is fixed).
  TextConfig qb = TextConfig::from_json(json{{"model_type", "qwen2"}, {"attention_bias", true}});
  EXPECT_TRUE(qb.qkv_bias());
  EXPECT_FALSE(qb.o_proj_bias());
}

TEST(Config, BothRopeThetaSpellings) {
  TextConfig top = TextConfig::from_json(json{{"model_type", "llama"}, {"rope_theta", 500000.0}});
  EXPECT_DOUBLE_EQ(top.rope_theta, 500000.0);
  EXPECT_TRUE(top.rope_scaling_json.empty());
  TextConfig nested = TextConfig::from_json(
      json{{"model_type", "qwen2"}, {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e6}}}});
  EXPECT_DOUBLE_EQ(nested.rope_theta, 1e6);
  EXPECT_TRUE(nested.rope_scaling_json.empty());

  TextConfig l = TextConfig::from_json(llama32_1b_v5(), "llama.json");
  EXPECT_DOUBLE_EQ(l.rope_theta, 500000.0);
  EXPECT_EQ(l.head_dim, 64);
  EXPECT_EQ(l.eos_token_ids, (std::vector<int64_t>{128001, 128008, 128009}));
  EXPECT_EQ(l.torch_dtype, "bfloat16");
  ASSERT_FALSE(l.rope_scaling_json.empty());
  json rs = json::parse(l.rope_scaling_json);
  EXPECT_EQ(rs["rope_type"], "llama3");
  EXPECT_DOUBLE_EQ(rs["factor"].get<double>(), 32.0);
  EXPECT_FALSE(rs.contains("rope_theta"));
  // Written back the transformers-4 way: top-level rope_theta + rope_scaling.
  json out = l.to_json();
  EXPECT_DOUBLE_EQ(out["rope_theta"].get<double>(), 500000.0);
  EXPECT_EQ(out["rope_scaling"]["rope_type"], "llama3");
  EXPECT_EQ(out["eos_token_id"], json({128001, 128008, 128009}));
  EXPECT_EQ(TextConfig::from_json(out).to_json(), out);
}

TEST(Config, InvalidValuesNameFieldAndFile) {
  auto bad = [](json j) { return [j] { TextConfig::from_json(j, "bad/config.json"); }; };
  expect_error(bad({{"model_type", "llama"}, {"hidden_size", 0}}), {"bad/config.json", "'hidden_size'", "positive"});
  expect_error(bad({{"model_type", "llama"}, {"vocab_size", -5}}), {"'vocab_size'", "positive"});
  expect_error(bad({{"model_type", "llama"}, {"hidden_size", 100}, {"num_attention_heads", 8}}),
               {"bad/config.json", "'num_attention_heads'", "must divide hidden_size"});
  expect_error(bad({{"model_type", "llama"}, {"num_attention_heads", 32}, {"num_key_value_heads", 5}}),
               {"'num_key_value_heads'", "must divide num_attention_heads"});
  expect_error(bad({{"model_type", "gemma2"}}), {"bad/config.json", "'model_type'", "gemma2", "llama, mistral, qwen2"});
  expect_error(bad(json::object()), {"'model_type'", "missing"});
  expect_error(bad({{"model_type", "llama"}, {"hidden_size", "4096"}}), {"bad/config.json", "'hidden_size'", "integer", "string"});
  expect_error(bad({{"model_type", "llama"}, {"rms_norm_eps", "1e-5"}}), {"'rms_norm_eps'", "number"});
  expect_error(bad({{"model_type", "llama"}, {"tie_word_embeddings", 1}}), {"'tie_word_embeddings'", "true or false"});
  expect_error(bad({{"model_type", "llama"}, {"hidden_act", "gelu"}}), {"'hidden_act'", "silu"});
  expect_error(bad({{"model_type", "llama"}, {"eos_token_id", {1, "x"}}}), {"'eos_token_id'"});
  expect_error(bad({{"model_type", "llama"}, {"rope_parameters", {{"rope_theta", "big"}}}}),
               {"'rope_parameters.rope_theta'", "number"});
  expect_error(bad(json::array()), {"bad/config.json", "JSON object"});
}

TEST(Config, FileRoundTripAndTransformersShape) {
  std::random_device rd;
  fs::path dir = fs::temp_directory_path() / ("kestrel_cfg_" + std::to_string(rd()));
  fs::create_directories(dir);
  const std::string path = (dir / "config.json").string();
  TextConfig q = TextConfig::from_json(qwen25_05b());
  write_json_file(path, q.to_json());
  TextConfig back = TextConfig::from_file(path);
  EXPECT_EQ(back.to_json(), q.to_json());
  json j = q.to_json();
  EXPECT_EQ(j["architectures"][0], "Qwen2ForCausalLM");
  EXPECT_FALSE(j.contains("head_dim"));  // qwen2 derives it
  EXPECT_FALSE(j.contains("attention_bias"));
  EXPECT_EQ(j["num_key_value_heads"], 2);

  // Errors from files name the file; invalid JSON too.
  { std::ofstream(dir / "broken.json") << "{\"model_type\": \"llama\","; }
  expect_error([&] { TextConfig::from_file((dir / "broken.json").string()); }, {"broken.json", "not valid JSON"});
  expect_error([&] { TextConfig::from_file((dir / "absent.json").string()); }, {"absent.json", "cannot open"});
  { std::ofstream(dir / "empty.json"); }
  expect_error([&] { TextConfig::from_file((dir / "empty.json").string()); }, {"empty.json", "not valid JSON"});
  fs::remove_all(dir);
}

TEST(Config, SiglipVision) {
  VisionConfig d = VisionConfig::from_json(json{{"model_type", "siglip_vision_model"}});
  EXPECT_EQ(d.hidden_size, 768);
  EXPECT_EQ(d.intermediate_size, 3072);
  EXPECT_EQ(d.num_hidden_layers, 12);
  EXPECT_EQ(d.num_attention_heads, 12);
  EXPECT_EQ(d.num_channels, 3);
  EXPECT_EQ(d.image_size, 224);
  EXPECT_EQ(d.patch_size, 16);
  EXPECT_DOUBLE_EQ(d.layer_norm_eps, 1e-6);
  EXPECT_EQ(d.hidden_act, "gelu_pytorch_tanh");
  EXPECT_EQ(d.num_patches(), 196);
  // so400m-patch14-384 tower.
  VisionConfig s = VisionConfig::from_json(json{{"model_type", "siglip_vision_model"}, {"hidden_size", 1152},
                                                {"intermediate_size", 4304}, {"num_hidden_layers", 27},
                                                {"num_attention_heads", 16}, {"image_size", 384}, {"patch_size", 14}});
  EXPECT_EQ(s.head_dim(), 72);
  EXPECT_EQ(s.num_patches(), 27 * 27);  // 384 / 14 floors, as the stride-14 conv does
  expect_error([&] { VisionConfig::from_json(json{{"image_size", 8}, {"patch_size", 16}}, "v.json"); },
               {"v.json", "'patch_size'", "must not exceed image_size"});
  expect_error([&] { VisionConfig::from_json(json{{"hidden_size", 100}}, "v.json"); },
               {"v.json", "'num_attention_heads'", "must divide hidden_size"});
  expect_error([&] { VisionConfig::from_json(json{{"model_type", "clip_vision_model"}}, "v.json"); },
               {"'model_type'", "clip_vision_model"});
  EXPECT_EQ(VisionConfig::from_json(s.to_json()).to_json(), s.to_json());
}

TEST(Config, KestrelVlm) {
  json j = {{"model_type", "kestrel_vlm"},
            {"vision_config", {{"hidden_size", 64}, {"intermediate_size", 128}, {"num_hidden_layers", 2},
                               {"num_attention_heads", 4}, {"image_size", 32}, {"patch_size", 4}}},
            {"text_config", {{"model_type", "qwen2"}, {"vocab_size", 300}, {"hidden_size", 96},
                             {"intermediate_size", 192}, {"num_hidden_layers", 2}, {"num_attention_heads", 6},
                             {"num_key_value_heads", 2}}},
            {"pixel_shuffle_factor", 2},
            {"image_token_id", 299}};
  VlmConfig m = VlmConfig::from_json(j, "vlm.json");
  EXPECT_EQ(m.vision_config.num_patches(), 64);
  EXPECT_EQ(m.image_tokens_per_image(), 16);
  EXPECT_EQ(m.projector_hidden_size, 96);  // defaults to the text hidden size
  EXPECT_EQ(m.text_config.head_dim, 16);
  EXPECT_TRUE(m.text_config.qkv_bias());
  EXPECT_EQ(VlmConfig::from_json(m.to_json()).to_json(), m.to_json());

  json bad = j;
  bad["pixel_shuffle_factor"] = 3;
  expect_error([&] { VlmConfig::from_json(bad, "vlm.json"); }, {"vlm.json", "'pixel_shuffle_factor'", "patch grid"});
  bad = j;
  bad["image_token_id"] = 300;
  expect_error([&] { VlmConfig::from_json(bad, "vlm.json"); }, {"'image_token_id'", "vocab_size"});
  bad = j;
  bad.erase("image_token_id");
  expect_error([&] { VlmConfig::from_json(bad, "vlm.json"); }, {"'image_token_id'", "missing"});
  bad = j;
  bad["text_config"]["hidden_size"] = 100;
  expect_error([&] { VlmConfig::from_json(bad, "vlm.json"); }, {"vlm.json", "'text_config.num_attention_heads'"});
  bad = j;
  bad["vision_config"]["num_channels"] = 0;
  expect_error([&] { VlmConfig::from_json(bad, "vlm.json"); }, {"'vision_config.num_channels'", "positive"});
  bad = j;
  bad["model_type"] = "llava";
  expect_error([&] { VlmConfig::from_json(bad, "vlm.json"); }, {"'model_type'", "llava"});
}

// The audit: fields that change the maths and are not implemented are refused by name; the same
// fields with their neutral value pass.
TEST(Config, AuditRefusesWhatItCannotCompute) {
  auto cfg = [](json extra) {
    json j = {{"model_type", "llama"}, {"hidden_size", 64}, {"num_attention_heads", 4}};
    j.update(extra);
    return [j] { TextConfig::from_json(j, "audit.json"); };
  };
  auto qcfg = [](json extra) {
    json j = qwen25_05b();
    j.update(extra);
    return [j] { TextConfig::from_json(j, "audit.json"); };
  };
  // Sliding windows are computed (test_sliding_window_config.cpp); llama has none.
  EXPECT_NO_THROW(qcfg({{"use_sliding_window", true}, {"max_window_layers", 21}})());
  EXPECT_NO_THROW(qcfg({{"use_sliding_window", false}, {"sliding_window", 4096}})());
  expect_error(cfg({{"layer_types", {"full_attention", "sliding_attention"}}}), {"'layer_types'", "full_attention"});
  EXPECT_NO_THROW(cfg({{"layer_types", {"full_attention", "full_attention"}}})());
  expect_error(cfg({{"partial_rotary_factor", 0.5}}), {"'partial_rotary_factor'", "0.5", "not supported"});
  EXPECT_NO_THROW(cfg({{"partial_rotary_factor", 1.0}})());
  expect_error(cfg({{"mlp_bias", true}}), {"'mlp_bias'", "MLP biases"});
  expect_error(cfg({{"hidden_act", "gelu_pytorch_tanh"}}), {"'hidden_act'", "silu"});
  expect_error(cfg({{"qk_norm", true}}), {"'qk_norm'", "qwen3"});
  expect_error(cfg({{"attn_logit_softcapping", 50.0}}), {"'attn_logit_softcapping'", "soft-capping"});
  expect_error(cfg({{"final_logit_softcapping", 30.0}}), {"'final_logit_softcapping'", "soft-capping"});
  EXPECT_NO_THROW(cfg({{"final_logit_softcapping", nullptr}})());
  expect_error(cfg({{"attention_dropout", 0.1}}), {"'attention_dropout'", "dropout"});
  EXPECT_NO_THROW(cfg({{"attention_dropout", 0.0}})());
  expect_error(qcfg({{"attention_dropout", 0.1}}), {"'attention_dropout'"});
  expect_error(cfg({{"quantization_config", {{"quant_method", "gptq"}, {"bits", 4}}}}), {"'quantization_config'", "gptq"});
  // head_dim different from hidden / heads is computed (q_proj is [heads * head_dim, hidden]).
  TextConfig h = TextConfig::from_json(json{{"model_type", "llama"}, {"hidden_size", 40}, {"num_attention_heads", 3},
                                            {"head_dim", 16}});
  EXPECT_EQ(h.head_dim, 16);
  EXPECT_EQ(TextConfig::from_json(h.to_json()).head_dim, 16);
  // Nested text configs name the nesting.
  json vlm = {{"model_type", "kestrel_vlm"}, {"vision_config", json::object()}, {"image_token_id", 1},
              {"text_config", {{"model_type", "llama"}, {"mlp_bias", true}}}};
  expect_error([&] { VlmConfig::from_json(vlm, "vlm.json"); }, {"vlm.json", "'text_config.mlp_bias'"});
}

// Fields Kestrel does not read (and that do not change the maths) are written back unchanged.
TEST(Config, UnknownFieldsSurviveSaveAndLoad) {
  json q = qwen25_05b();
  q["my_tool_note"] = {{"run", 7}, {"tags", {"a", "b"}}};
  TextConfig t = TextConfig::from_json(q, "qwen.json");
  json out = t.to_json();
  for (const char* k : {"initializer_range", "max_window_layers", "sliding_window", "transformers_version", "use_cache",
                        "attention_dropout", "my_tool_note"})
    EXPECT_EQ(out[k], q[k]) << k;
  EXPECT_EQ(out["use_sliding_window"], false);
  EXPECT_EQ(TextConfig::from_json(out).to_json(), out);
  // Known fields are not duplicated into the extras ("dtype" is read as torch_dtype).
  TextConfig l = TextConfig::from_json(llama32_1b_v5());
  EXPECT_FALSE(l.to_json().contains("dtype"));
  EXPECT_FALSE(l.to_json().contains("rope_parameters"));
  EXPECT_EQ(l.to_json()["torch_dtype"], "bfloat16");
}
