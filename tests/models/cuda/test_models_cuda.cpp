// Models on the GPU: the same tiny decoder and VLM (same parameter values) give the same loss and
// gradients on CUDA in bf16 as on the CPU in f32, within bf16 tolerance; the recompute policies
// (including offload to pinned host memory) leave the GPU gradients unchanged.
#include <gtest/gtest.h>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/vlm.h"
#include "support/gpu.h"
#include "support/numerics.h"
#if KESTREL_WITH_CUDA
#include "kestrel/cuda/memory.h"
#endif

namespace kestrel::models {
namespace {
namespace ag = autograd;

TextConfig tiny_text() {
  TextConfig c = TextConfig::defaults_for("qwen2");
  c.vocab_size = 97;
  c.hidden_size = 64;
  c.intermediate_size = 96;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.tie_word_embeddings = false;
  return c;
}

// Copies every parameter of `src` into `dst` (converting dtype and device).
void copy_params(ParameterList& dst, ParameterList& src) {
  for (auto& [name, t] : dst.items()) t->copy_(src.get(name));
}

std::vector<Tensor> grads_of(ParameterList& p) {
  std::vector<Tensor> g;
  for (auto& [name, t] : p.items()) {
    EXPECT_TRUE(t->grad().defined()) << name;
    g.push_back(t->grad());
  }
  return g;
}

TEST(ModelsCuda, DecoderMatchesCpu) {
  KESTREL_REQUIRE_GPU();
  Decoder gpu(tiny_text(), DType::BF16, Device::cuda(0), 3);
  Decoder cpu(tiny_text(), DType::F32, Device::cpu(), 99);
  copy_params(cpu.parameters(), gpu.parameters());  // identical (bf16-representable) values
  std::vector<int64_t> lens = {33, 1, 60, 7};
  int64_t T = 101;
  Tensor ids = randint({T}, 97);
  Tensor labels = randint({T}, 97);
  auto run = [&](Decoder& m, Device d) {
    PackedBatch b = PackedBatch::from_lengths(lens, d);
    Tensor loss = m.loss(m.forward(m.embed(ids.to(d)), b), labels.to(d));
    ag::backward(loss);
    return loss.item();
  };
  double lg = run(gpu, Device::cuda(0)), lc = run(cpu, Device::cpu());
  EXPECT_NEAR(lg, lc, 2e-2 * std::abs(lc));
  auto gg = grads_of(gpu.parameters()), gc = grads_of(cpu.parameters());
  size_t i = 0;
  for (auto& [name, t] : cpu.parameters().items()) {
    double e = testing::rel_l2(gg[i], gc[i]);
    EXPECT_LT(e, 5e-2) << name;
    EXPECT_TRUE(testing::all_finite(gg[i])) << name;
    ++i;
  }
}

TEST(ModelsCuda, VlmPoliciesKeepGradients) {
  KESTREL_REQUIRE_GPU();
  VlmConfig v;
  v.text_config = tiny_text();
  v.text_config.tie_word_embeddings = true;
  v.vision_config.hidden_size = 32;
  v.vision_config.intermediate_size = 48;
  v.vision_config.num_hidden_layers = 2;
  v.vision_config.num_attention_heads = 2;
  v.vision_config.image_size = 16;
  v.vision_config.patch_size = 4;
  v.pixel_shuffle_factor = 2;
  v.projector_hidden_size = 48;
  v.image_token_id = 96;
  Device d = Device::cuda(0);
  Vlm m(v, DType::BF16, d, 5);
#if KESTREL_WITH_CUDA
  cuda::install_offloader(0);
#endif
  const int64_t ti = v.image_tokens_per_image();
  std::vector<int64_t> ids, labels, pos;
  for (int doc = 0; doc < 3; ++doc) {
    for (int64_t i = 0; i < ti; ++i) pos.push_back(static_cast<int64_t>(ids.size())), ids.push_back(96), labels.push_back(-100);
    for (int64_t t = 0; t < 9; ++t) ids.push_back(t + doc), labels.push_back(t + doc + 1);
  }
  VlmBatch b;
  b.input_ids = Tensor::from_vector(ids, {static_cast<int64_t>(ids.size())}, DType::I64, d);
  b.labels = Tensor::from_vector(labels, {static_cast<int64_t>(labels.size())}, DType::I64, d);
  b.image_positions = Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())}, DType::I64, d);
  b.pixel_values = testing::randn({3, 3, 16, 16}, DType::BF16, d);
  b.layout = PackedBatch::from_lengths({ti + 9, ti + 9, ti + 9}, d);
  // Same kernels in the same order; only atomics (flash-attention dq, embedding scatter-add) may
  // reorder f32 additions, so the bound is a fraction of one bf16 ulp in relative L2.
  std::vector<Tensor> ref;
  for (auto policy : {ag::RecomputePolicy::None, ag::RecomputePolicy::Keep, ag::RecomputePolicy::Offload}) {
    m.parameters().zero_grad();
    ag::backward(m.loss(b, policy));
    std::vector<Tensor> g;
    for (auto& t : grads_of(m.parameters())) g.push_back(t.clone());
    if (ref.empty()) {
      ref = g;
      continue;
    }
    for (size_t i = 0; i < g.size(); ++i)
      EXPECT_LT(testing::rel_l2(g[i], ref[i]), 4e-3) << ag::policy_name(policy) << " " << m.parameters().items()[i].first;
  }
}

}  // namespace
}  // namespace kestrel::models
