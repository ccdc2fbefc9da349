// Kestrel against transformers on stored fixtures: small Llama/Qwen2/Qwen3/Mistral models with rope
// scaling (llama3, yarn, linear, dynamic) run past original_max_position_embeddings, or with
// sliding-window attention (mistral, qwen2 use_sliding_window, qwen3 layer_types), written by
// tests/models/fixtures/make_rope_fixtures.py as <name>/{config.json, model.safetensors,
// expected.safetensors}. expected.safetensors holds input_ids [T] (i64), loss [1] and grad.<HF name>
// for every parameter, from transformers in f32 (labels = input_ids, shifted inside the model).
// Here: the same loss and every gradient in f32 on the CPU within 1e-4 relative. A fixture folder
// that is absent skips its test (generate them with the script, transformers installed); a folder
// that no test names fails EveryFixtureFolderHasATest. For the sliding-window cases the same model
// without its windows must miss the stored gradients (so the windows are exercised).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/config.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/safetensors.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace fs = std::filesystem;

// The fixtures folder: $KESTREL_FIXTURES_DIR, else tests/models/fixtures from the working directory
// (the repository root) or from a build folder's tests/ directory, else next to this source file.
fs::path fixtures_dir() {
  if (const char* env = std::getenv("KESTREL_FIXTURES_DIR")) return env;
  for (fs::path p : {fs::path("tests/models/fixtures"), fs::path("../tests/models/fixtures"),
                     fs::path("../../tests/models/fixtures"), fs::path(__FILE__).parent_path() / "fixtures"})
    if (fs::is_directory(p)) return p;
  return "tests/models/fixtures";
}

template <typename T>
std::vector<T> entry_values(const SafetensorsEntry& e) {
  std::vector<T> v(static_cast<size_t>(e.numel()));
  EXPECT_EQ(e.bytes.size(), v.size() * sizeof(T)) << e.name;
  std::memcpy(v.data(), e.bytes.data(), std::min(e.bytes.size(), v.size() * sizeof(T)));
  return v;
}

struct FixtureRun {
  double loss = 0, max_grad_err = 0;
};

// Loss and the largest relative gradient error of `cfg` on the fixture; expect_match checks each.
FixtureRun run_fixture(const fs::path& dir, const std::string& name, const TextConfig& cfg, bool expect_match) {
  FixtureRun run;
  Decoder model(cfg, DType::F32, Device::cpu());
  load_safetensors(model.parameters(), (dir / "model.safetensors").string(), /*strict=*/true);
  SafetensorsFile expected = SafetensorsFile::open((dir / "expected.safetensors").string());
  const SafetensorsEntry& ids_e = expected.get("input_ids");
  EXPECT_EQ(ids_e.dtype, DType::I64);
  if (ids_e.dtype != DType::I64) return run;
  std::vector<int64_t> ids = entry_values<int64_t>(ids_e);
  const int64_t T = static_cast<int64_t>(ids.size());
  std::vector<int64_t> labels(ids.size(), -100);
  for (int64_t i = 0; i + 1 < T; ++i) labels[i] = ids[i + 1];
  Tensor id_t = Tensor::from_vector(ids, {T});
  Tensor lab_t = Tensor::from_vector(labels, {T});
  Tensor loss = model.loss(model.forward(model.embed(id_t), PackedBatch::from_lengths({T}, Device::cpu())), lab_t);
  autograd::backward(loss);
  const double want_loss = entry_values<float>(expected.get("loss"))[0];
  run.loss = loss.item();
  if (expect_match) {
    EXPECT_NEAR(loss.item(), want_loss, 1e-4 * std::abs(want_loss)) << name;
  }
  int compared = 0;
  for (auto& [pname, p] : model.parameters().items()) {
    const SafetensorsEntry& g = expected.get("grad." + pname);
    EXPECT_EQ(g.dtype, DType::F32) << pname;
    Tensor want = Tensor::from_vector(entry_values<float>(g), Shape(g.shape.begin(), g.shape.end()));
    EXPECT_TRUE(p->grad().defined()) << pname;
    if (!p->grad().defined()) continue;
    const double err = testing::rel_l2(p->grad(), want);
    run.max_grad_err = std::max(run.max_grad_err, err);
    if (expect_match) {
      EXPECT_LT(err, 1e-4) << name << ": grad." << pname;
    }
    ++compared;
  }
  EXPECT_EQ(compared + 2, static_cast<int>(expected.entries().size())) << "every stored gradient compared";
  return run;
}

// `windows`: the expected attention window of each layer (empty: not a sliding-window case).
void check_fixture(const std::string& name, const std::vector<int64_t>& windows = {}) {
  const fs::path dir = fixtures_dir() / name;
  if (!fs::exists(dir / "expected.safetensors"))
    GTEST_SKIP() << "fixture " << dir << " absent (run tests/models/fixtures/make_rope_fixtures.py)";
  TextConfig cfg = TextConfig::from_file((dir / "config.json").string());
  const FixtureRun run = run_fixture(dir, name, cfg, /*expect_match=*/true);
  std::printf("[hf fixture] %-18s max grad rel err %.2e\n", name.c_str(), run.max_grad_err);
  if (windows.empty()) return;
  ASSERT_EQ(static_cast<int64_t>(windows.size()), cfg.num_hidden_layers) << name;
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) EXPECT_EQ(cfg.attention_window(l), windows[l]) << "layer " << l;
  // The same weights with full causal attention everywhere must not reproduce transformers.
  TextConfig full = cfg;
  full.sliding_window.reset();
  full.use_sliding_window = false;
  full.layer_types.clear();
  for (int64_t l = 0; l < full.num_hidden_layers; ++l) ASSERT_EQ(full.attention_window(l), 0);
  const double err_full = run_fixture(dir, name, full, /*expect_match=*/false).max_grad_err;
  std::printf("[hf fixture] %-18s without its windows: max grad rel err %.2e\n", name.c_str(), err_full);
  EXPECT_GT(err_full, 1e-3) << name;
}

TEST(HfFixtures, LlamaLlama3PastOriginalPositions) { check_fixture("llama_llama3"); }
TEST(HfFixtures, LlamaLinear) { check_fixture("llama_linear"); }
TEST(HfFixtures, LlamaDynamicWithinMaxPositions) { check_fixture("llama_dynamic"); }
TEST(HfFixtures, Qwen2YarnPastOriginalPositions) { check_fixture("qwen2_yarn"); }
TEST(HfFixtures, Qwen2YarnMscaleNoTruncateRopeParameters) { check_fixture("qwen2_yarn_mscale"); }
TEST(HfFixtures, Qwen3QkNormYarn) { check_fixture("qwen3_yarn"); }
TEST(HfFixtures, MistralSlidingWindowEveryLayer) { check_fixture("mistral_swa", {24, 24}); }
TEST(HfFixtures, Qwen2UseSlidingWindowFromMaxWindowLayers) { check_fixture("qwen2_swa", {0, 20, 20}); }
TEST(HfFixtures, Qwen3LayerTypesSlidingThenFull) { check_fixture("qwen3_layer_types", {16, 0}); }

// A fixture folder written by the script but named by no test above would silently go unchecked.
TEST(HfFixtures, EveryFixtureFolderHasATest) {
  const std::vector<std::string> named = {"llama_llama3", "llama_linear", "llama_dynamic", "qwen2_yarn",
                                          "qwen2_yarn_mscale", "qwen3_yarn", "mistral_swa", "qwen2_swa",
                                          "qwen3_layer_types"};
  if (!fs::is_directory(fixtures_dir())) GTEST_SKIP() << "no fixtures folder";
  for (const auto& e : fs::directory_iterator(fixtures_dir()))
    if (e.is_directory()) {
      EXPECT_NE(std::find(named.begin(), named.end(), e.path().filename().string()), named.end())
          << "fixture folder " << e.path() << " has no test in test_hf_fixtures.cpp";
    }
}

}  // namespace
}  // namespace kestrel::models
