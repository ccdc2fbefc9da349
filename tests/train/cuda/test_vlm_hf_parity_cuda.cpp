// The whole VLM on the GPU in bf16 against transformers' f32 loss and gradients stored in
// tests/train/fixtures/llava_qwen2 (make_llava_fixture.py; the CPU f32 comparison is
// tests/train/test_vlm_hf_parity.cpp). bf16 weights, activations and gradients: the bounds are those of the
// models layer's CUDA-vs-CPU test (tests/models/cuda/test_models_cuda.cpp: loss within 2e-2 relative, each
// gradient within 5e-2 relative L2); bench/vlm_parity_gpu.py ties them to transformers' own bf16 error.
// Skips without a GPU or without the fixture folder (run from the repository root).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/train/llava_folder.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;

fs::path fixture_dir() {
  for (fs::path p : {fs::path("tests/train/fixtures"), fs::path("../tests/train/fixtures"),
                     fs::path("../../tests/train/fixtures"), fs::path(__FILE__).parent_path().parent_path() / "fixtures"})
    if (fs::exists(p / "llava_qwen2" / "expected.safetensors")) return p / "llava_qwen2";
  return {};
}

Tensor read_tensor(const models::SafetensorsFile& f, const std::string& name) {
  const models::SafetensorsEntry& e = f.get(name);
  return Tensor::from_blob(const_cast<std::byte*>(e.bytes.data()), Shape(e.shape.begin(), e.shape.end()), e.dtype,
                           Device::cpu())
      .clone();
}

double l2_diff(const Tensor& a, const Tensor& b) {
  const std::vector<double> x = a.to_double_vector(), y = b.to_double_vector();
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += (x[i] - y[i]) * (x[i] - y[i]);
  return std::sqrt(s);
}

TEST(VlmHfParityCuda, LlavaQwen2Bf16LossAndGradientsNearTransformersF32) {
  KESTREL_REQUIRE_GPU();
  const fs::path dir = fixture_dir();
  if (dir.empty()) GTEST_SKIP() << "fixture tests/train/fixtures/llava_qwen2 absent (make_llava_fixture.py)";
  const Device d = Device::cuda(0);
  LlavaFolder f = load_llava_folder(dir.string(), DType::BF16, d);
  const models::SafetensorsFile expected = models::SafetensorsFile::open((dir / "expected.safetensors").string());
  const models::VlmBatch batch =
      vlm_batch_from_llava_inputs(read_tensor(expected, "input_ids"), read_tensor(expected, "labels"),
                                  read_tensor(expected, "pixel_values"), f.vlm->config().image_token_id, DType::BF16, d);
  Tensor loss = f.vlm->loss(batch);
  autograd::backward(loss);
  const double want = read_tensor(expected, "loss").item();
  EXPECT_NEAR(loss.item(), want, 2e-2 * std::abs(want));
  double worst = 0;
  for (const auto& [llava, name] : f.names) {
    const Tensor want_g = read_tensor(expected, "grad." + llava);
    const Tensor got = f.vlm->parameters().get(name).grad();
    if (!got.defined()) {  // unreached: transformers' stored gradient is zeros then
      EXPECT_EQ(testing::max_abs_diff(want_g, Tensor::zeros(want_g.shape())), 0.0) << llava;
      continue;
    }
    const Tensor g = got.to(Device::cpu()).to(DType::F32);
    EXPECT_TRUE(testing::all_finite(g)) << llava;
    if (llava.find("vision_tower.") != std::string::npos && llava.ends_with("self_attn.k_proj.bias")) {
      // Zero in exact arithmetic (softmax ignores a key bias without rotary positions; see the CPU test):
      // bf16 rounding noise, judged against the same layer's query-bias gradient.
      const std::string q = llava.substr(0, llava.size() - 11) + "q_proj.bias";
      const Tensor unit = read_tensor(expected, "grad." + q);
      const double e = l2_diff(g, want_g) / l2_diff(unit, Tensor::zeros(unit.shape()));
      EXPECT_LT(e, 5e-2) << llava << " (in units of the query bias's gradient)";
      continue;
    }
    const double e = testing::rel_l2(g, want_g);
    EXPECT_LT(e, 5e-2) << llava;
    worst = std::max(worst, e);
  }
  std::printf("[llava fixture, CUDA bf16] loss %.6f (transformers f32 %.6f), worst gradient rel L2 %.2e\n",
              loss.item(), want, worst);
}

}  // namespace
}  // namespace kestrel::train
