// The whole VLM against transformers' LlavaForConditionalGeneration (issue 24), and LLaVA folders read back
// (kestrel/train/llava_folder.h).
//
// The fixture tests/train/fixtures/llava_qwen2/ (written by make_llava_fixture.py there, transformers f32 on the
// CPU, eager attention) holds a tiny random LLaVA (SigLIP 3 blocks + Qwen2 2 layers, tied, vision_feature_layer
// -2, strategy "full", erf-GELU projector), a batch of two sequences with three images, transformers' loss and
// the gradient of every parameter. Here: Kestrel's loss and every gradient in f32 on the CPU.
// Tolerances: both sides compute in f32 with different summation orders (attention, GEMM, the vocabulary
// reduction); Kestrel's f32 gradients of this model are within 1.3e-6 relative L2 of its f64 ones (the vision
// key biases aside, below), and transformers' f32 error is of the same kind, so 1e-5 relative (loss) and 1e-5
// relative L2 (each gradient) leaves about 4x headroom over their sum while any modelling slip misses by
// orders of magnitude (the test shows that the tanh GELU in the projector or the wrong feature layer miss the
// stored gradients by more than 10x the tolerance). The parameters the loss does not reach (the last vision block, post_layernorm)
// must get no gradient in either. A missing fixture folder skips the fixture test only.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <set>
#include <sstream>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/config.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/models/vlm.h"
#include "kestrel/train/llava_folder.h"
#include "kestrel/train/vlm_export.h"
#include "support/numerics.h"
#include "trainer_fixtures.h"
#include "support/errors.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kLossTol = 1e-5;  // relative, f32 (see the note at the top)
constexpr double kGradTol = 1e-5;  // relative L2 per parameter, f32

// A vision block's key bias cannot change the loss: without rotary positions q.(k + b) shifts all of a query's
// scores by the same q.b, which softmax ignores. Its gradient is 0 in exact arithmetic and rounding noise in both
// implementations (Kestrel f32 against f64 on this model: 1e8 relative), so it is judged in units of the same
// layer's query-bias gradient: both sides and their difference below kGradTol of that.
bool vision_key_bias(const std::string& llava_name) {
  return llava_name.find("vision_tower.") != std::string::npos && llava_name.ends_with("self_attn.k_proj.bias");
}
std::string query_bias_of(const std::string& key_bias) {
  return key_bias.substr(0, key_bias.size() - std::string("k_proj.bias").size()) + "q_proj.bias";
}
double l2(const Tensor& t) {
  double s = 0;
  for (double v : t.to_double_vector()) s += v * v;
  return std::sqrt(s);
}

fs::path fixture_dir(const std::string& name) {
  for (fs::path p : {fs::path(__FILE__).parent_path() / "fixtures", fs::path("tests/train/fixtures"),
                     fs::path("../tests/train/fixtures"), fs::path("../../tests/train/fixtures")})
    if (fs::is_directory(p / name)) return p / name;
  return fs::path(__FILE__).parent_path() / "fixtures" / name;
}

Tensor read_tensor(const models::SafetensorsFile& f, const std::string& name) {
  const models::SafetensorsEntry& e = f.get(name);
  return Tensor::from_blob(const_cast<std::byte*>(e.bytes.data()), Shape(e.shape.begin(), e.shape.end()), e.dtype,
                           Device::cpu())
      .clone();
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

using kestrel::testing::error_of;

std::set<std::string> split_names(const std::string& s) {
  std::set<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.insert(item);
  return out;
}

// The largest relative L2 error against the stored gradients of `vlm`'s weights under another config (same
// parameter names and shapes), over the parameters both give a gradient.
double grad_err_with(models::Vlm& vlm, const models::VlmConfig& cfg, const models::VlmBatch& batch,
                     const LlavaFolder& f, const models::SafetensorsFile& expected) {
  models::Vlm other(cfg, DType::F32, Device::cpu());
  for (auto& [name, t] : other.parameters().items()) t->copy_(vlm.parameters().get(name));
  autograd::backward(other.loss(batch));
  double worst = 0;
  for (const auto& [llava, name] : f.names) {
    const Tensor g = other.parameters().get(name).grad();
    const Tensor want = read_tensor(expected, "grad." + llava);
    if (g.defined() && !vision_key_bias(llava) && kestrel::testing::max_abs_diff(want, Tensor::zeros(want.shape())) > 0)
      worst = std::max(worst, kestrel::testing::rel_l2(g, want));
  }
  return worst;
}

TEST(VlmHfParity, LlavaQwen2LossAndEveryGradientMatchTransformersF32) {
  const fs::path dir = fixture_dir("llava_qwen2");
  if (!fs::exists(dir / "expected.safetensors"))
    GTEST_SKIP() << "fixture " << dir << " absent (run tests/train/fixtures/make_llava_fixture.py where "
                 << "transformers is installed and commit its llava_qwen2/ folder)";
  LlavaFolder f = load_llava_folder(dir.string(), DType::F32, Device::cpu());
  models::Vlm& vlm = *f.vlm;
  const models::SafetensorsFile expected = models::SafetensorsFile::open((dir / "expected.safetensors").string());
  const auto meta = expected.metadata();
  const std::set<std::string> no_grad = split_names(meta.count("no_grad") ? meta.at("no_grad") : "");
  std::printf("[llava fixture] transformers %s, torch %s, %zu parameters, no gradient: %zu\n",
              meta.count("transformers") ? meta.at("transformers").c_str() : "?",
              meta.count("torch") ? meta.at("torch").c_str() : "?", f.names.size(), no_grad.size());
  ASSERT_TRUE(vlm.config().vision_feature_layer.has_value());
  EXPECT_EQ(*vlm.config().vision_feature_layer, -2);
  EXPECT_EQ(vlm.config().projector_hidden_act, "gelu");
  EXPECT_TRUE(vlm.config().text_config.tie_word_embeddings);

  const models::VlmBatch batch =
      vlm_batch_from_llava_inputs(read_tensor(expected, "input_ids"), read_tensor(expected, "labels"),
                                  read_tensor(expected, "pixel_values"), vlm.config().image_token_id, DType::F32,
                                  Device::cpu());
  EXPECT_EQ(batch.image_positions.numel(), 3 * vlm.config().image_tokens_per_image());
  Tensor loss = vlm.loss(batch);
  autograd::backward(loss);
  const double want = read_tensor(expected, "loss").item();
  EXPECT_NEAR(loss.item(), want, kLossTol * std::abs(want));
  std::printf("[llava fixture] loss %.8f (transformers %.8f, rel err %.2e)\n", loss.item(), want,
              std::abs(loss.item() - want) / std::abs(want));

  double worst = 0;
  std::string worst_name;
  size_t compared = 0, unreached = 0, key_biases = 0;
  for (const auto& [llava, name] : f.names) {
    SCOPED_TRACE(llava);
    const Tensor want_g = read_tensor(expected, "grad." + llava);
    const Tensor got = vlm.parameters().get(name).grad();
    ++compared;
    if (no_grad.count(llava) || !got.defined()) {  // the loss does not reach it: no gradient on either side
      ++unreached;
      EXPECT_FALSE(got.defined()) << "Kestrel has a gradient where transformers has none";
      EXPECT_EQ(kestrel::testing::max_abs_diff(want_g, Tensor::zeros(want_g.shape())), 0.0)
          << "transformers has a gradient where Kestrel has none";
      continue;
    }
    if (vision_key_bias(llava)) {
      const double unit = l2(read_tensor(expected, "grad." + query_bias_of(llava)));
      ASSERT_GT(unit, 0.0);
      EXPECT_LT(l2(want_g) / unit, kGradTol) << "transformers' key-bias gradient is more than noise";
      EXPECT_LT(l2(got) / unit, kGradTol) << "Kestrel's key-bias gradient is more than noise";
      std::printf("[llava fixture] %s (zero in exact arithmetic): transformers %.1e, Kestrel %.1e of the query "
                  "bias's gradient\n", llava.c_str(), l2(want_g) / unit, l2(got) / unit);
      ++key_biases;
      continue;
    }
    const double err = kestrel::testing::rel_l2(got, want_g);
    EXPECT_LT(err, kGradTol) << name;
    if (err > worst) worst = err, worst_name = llava;
  }
  EXPECT_EQ(compared + 4, expected.entries().size()) << "every stored gradient compared";
  EXPECT_GT(unreached, 0u) << "vision_feature_layer -2 leaves the last block unused";
  EXPECT_EQ(key_biases, static_cast<size_t>(vlm.config().vision_blocks_used()));
  std::printf("[llava fixture] %zu gradients compared (%zu unreached in both), worst rel L2 %.2e (%s)\n", compared,
              unreached, worst, worst_name.c_str());

  // The comparison sees the choices that make the VLM LLaVA: other ones miss the stored gradients by far more
  // than the tolerance.
  models::VlmConfig tanh = vlm.config();
  tanh.projector_hidden_act = "gelu_pytorch_tanh";
  models::VlmConfig last = vlm.config();
  last.vision_feature_layer = -1;
  for (const auto& [what, cfg] : {std::pair{"tanh GELU", tanh}, {"vision_feature_layer -1", last}}) {
    const double e = grad_err_with(vlm, cfg, batch, f, expected);
    std::printf("[llava fixture] with %s instead: worst gradient rel L2 %.2e\n", what, e);
    EXPECT_GT(e, 10 * kGradTol) << what;
  }
}

// A VLM exported as LLaVA (kestrel/train/vlm_export.h) reads back bit for bit, tied head copy ignored.
TEST(VlmHfParity, ExportedLlavaFolderLoadsBackBitForBit) {
  const std::string dir = testing::fresh_temp_dir("kestrel_llava", "roundtrip");
  json cfg = testing::tiny_vlm_run(dir, json::object());
  json& m = cfg["model"]["config"];
  testing::use_llava_computation(m, 32, -2);
  m["vision_config"]["num_hidden_layers"] = 2;
  std::unique_ptr<models::Vlm> vlm = build_vlm_for_export(cfg, "");
  for (auto& [name, t] : vlm->parameters().items())  // off the trivial init, so norms and biases are checked
    t->copy_(kestrel::testing::randn(t->shape()));
  export_vlm(*vlm, dir + "/llava", "llava");
  LlavaFolder f = load_llava_folder(dir + "/llava", DType::F32, Device::cpu());
  EXPECT_EQ(f.vlm->config().to_json(), vlm->config().to_json());
  EXPECT_EQ(f.names.size(), vlm->parameters().size());
  EXPECT_TRUE(f.unused.empty());
  for (auto& [name, t] : vlm->parameters().items()) EXPECT_TRUE(same_bits(*t, f.vlm->parameters().get(name))) << name;
  fs::remove_all(dir);
}

TEST(VlmHfParity, LlavaNamesInEveryLayout) {
  const std::string k = "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight";
  EXPECT_EQ(vlm_name_from_llava("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", true), k);
  EXPECT_EQ(vlm_name_from_llava("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", true), k);
  EXPECT_EQ(vlm_name_from_llava("model.vision_tower.encoder.layers.0.mlp.fc1.weight", true), k);  // flat SigLIP
  EXPECT_EQ(vlm_name_from_llava("model.multi_modal_projector.linear_2.bias", true), "multi_modal_projector.linear_2.bias");
  EXPECT_EQ(vlm_name_from_llava("model.language_model.layers.1.self_attn.k_proj.bias", false),
            "language_model.model.layers.1.self_attn.k_proj.bias");
  EXPECT_EQ(vlm_name_from_llava("language_model.model.norm.weight", false), "language_model.model.norm.weight");
  EXPECT_EQ(vlm_name_from_llava("lm_head.weight", false), "language_model.lm_head.weight");
  EXPECT_EQ(vlm_name_from_llava("language_model.lm_head.weight", false), "language_model.lm_head.weight");
  EXPECT_EQ(vlm_name_from_llava("lm_head.weight", true), "");
  EXPECT_NE(error_of([] { vlm_name_from_llava("model.image_newline", false); }).find("image_newline"),
            std::string::npos);
}

TEST(VlmHfParity, LlavaConfigDefaultsAndRefusals) {
  const json vision = {{"model_type", "siglip_vision_model"}, {"hidden_size", 16}, {"intermediate_size", 32},
                       {"num_hidden_layers", 2}, {"num_attention_heads", 2}, {"image_size", 16}, {"patch_size", 4}};
  const json text = {{"model_type", "qwen2"}, {"vocab_size", 260}, {"hidden_size", 32}, {"intermediate_size", 64},
                     {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
                     {"tie_word_embeddings", true}};
  const json base = {{"model_type", "llava"}, {"vision_config", vision}, {"text_config", text},
                     {"image_token_index", 259}, {"vision_feature_select_strategy", "full"}};
  // LlavaConfig's defaults where fields are absent: erf GELU, hidden_states[-2].
  models::VlmConfig c = vlm_config_from_llava(base);
  EXPECT_EQ(c.image_token_id, 259);
  EXPECT_EQ(c.projector_hidden_act, "gelu");
  EXPECT_EQ(c.vision_feature_layer.value_or(0), -2);
  EXPECT_EQ(c.pixel_shuffle_factor, 1);
  EXPECT_EQ(c.projector_hidden_size, 32);
  auto refused = [&](json j, const std::string& field) {
    const std::string e = error_of([&] { vlm_config_from_llava(j, "cfg.json"); });
    EXPECT_NE(e.find(field), std::string::npos) << "expected a refusal naming " << field << ", got: " << e;
  };
  json j = base;
  j.erase("vision_feature_select_strategy");  // LlavaConfig's default "default" drops a patch
  refused(j, "vision_feature_select_strategy");
  j = base, j["vision_feature_layer"] = json::array({-2, -5});
  refused(j, "vision_feature_layer");
  j = base, j["multimodal_projector_bias"] = false;
  refused(j, "multimodal_projector_bias");
  j = base, j["projector_hidden_act"] = "relu";
  refused(j, "projector_hidden_act");
  j = base, j["model_type"] = "llava_next";
  refused(j, "model_type");
  j = base, j.erase("image_token_index");
  refused(j, "image_token_id");
  j = base, j["tie_word_embeddings"] = false;
  refused(j, "tie_word_embeddings");
  j = base, j["vision_config"]["hidden_act"] = "quick_gelu";
  refused(j, "hidden_act");
}

TEST(VlmHfParity, BatchFromLlavaInputsShiftsLabelsWithinEachRow) {
  const int64_t img = 9;
  Tensor ids = Tensor::from_vector(std::vector<int64_t>{1, img, img, 2, 3, 4, img, img}, {2, 4});
  Tensor labels = Tensor::from_vector(std::vector<int64_t>{-100, -100, -100, 2, 3, 4, -100, -100}, {2, 4});
  Tensor px = kestrel::testing::randn({2, 3, 4, 4});
  models::VlmBatch b = vlm_batch_from_llava_inputs(ids, labels, px, img, DType::F32, Device::cpu());
  EXPECT_EQ(b.labels.to_int_vector(), (std::vector<int64_t>{-100, -100, 2, -100, 4, -100, -100, -100}));
  EXPECT_EQ(b.image_positions.to_int_vector(), (std::vector<int64_t>{1, 2, 6, 7}));
  EXPECT_EQ(b.input_ids.shape(), (Shape{8}));
  EXPECT_EQ(b.layout.positions.to_int_vector(), (std::vector<int64_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_TRUE(same_bits(b.pixel_values, px));
  EXPECT_NE(error_of([&] { vlm_batch_from_llava_inputs(ids.view({8}), labels, px, img, DType::F32, Device::cpu()); })
                .find("[B, T]"),
            std::string::npos);
}

}  // namespace
}  // namespace kestrel::train
