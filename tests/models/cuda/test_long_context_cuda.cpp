// Long-context settings on the GPU: a small decoder at 6000 tokens (one document, so attention spans
// the whole sequence) in bf16 with the MLP over 1024-token tiles and its region inputs offloaded to
// pinned host memory gives the loss and gradients of the plain bf16 run within the bf16 bound: its
// error against the f32 CPU reference stays within that of the plain GPU run (plus a fraction of a
// bf16 ulp for the other summation order).
#include <gtest/gtest.h>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "support/gpu.h"
#include "support/numerics.h"
#if KESTREL_WITH_CUDA
#include "kestrel/cuda/memory.h"
#endif

namespace kestrel::models {
namespace {
namespace ag = autograd;

TEST(LongContextCuda, TiledMlpAndOffloadKeepTheBf16Gradients) {
  KESTREL_REQUIRE_GPU();
  TextConfig c = TextConfig::defaults_for("llama");
  c.vocab_size = 211;
  c.hidden_size = 128;
  c.intermediate_size = 344;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 8192;
  c.tie_word_embeddings = false;
  const Device d = Device::cuda(0);
#if KESTREL_WITH_CUDA
  cuda::install_offloader(0);
#endif
  Decoder gpu(c, DType::BF16, d, 7);
  Decoder cpu(c, DType::F32, Device::cpu(), 8);
  for (auto& [name, t] : cpu.parameters().items()) t->copy_(gpu.parameters().get(name));
  const int64_t T = 6000;
  Tensor ids = randint({T}, c.vocab_size), labels = randint({T}, c.vocab_size);
  auto run = [&](Decoder& m, Device dev, int64_t tile, ag::RecomputePolicy policy) {
    m.set_mlp_tile_tokens(tile);
    m.parameters().zero_grad();
    Tensor loss = m.loss(m.forward(m.embed(ids.to(dev)), PackedBatch::from_lengths({T}, dev), policy), labels.to(dev));
    ag::backward(loss);
    std::vector<Tensor> g{loss.detach().to(Device::cpu()).to(DType::F32)};
    for (auto& [name, t] : m.parameters().items()) g.push_back(t->grad().to(Device::cpu()).to(DType::F32));
    return g;
  };
  const std::vector<Tensor> ref = run(cpu, Device::cpu(), 0, ag::RecomputePolicy::None);
  const std::vector<Tensor> plain = run(gpu, d, 0, ag::RecomputePolicy::None);
  const std::vector<Tensor> lc = run(gpu, d, 1024, ag::RecomputePolicy::Offload);
  EXPECT_NEAR(lc[0].item(), ref[0].item(), 1e-2 * std::abs(ref[0].item()));
  size_t i = 1;
  for (auto& [name, t] : gpu.parameters().items()) {
    const double e_plain = testing::rel_l2(plain[i], ref[i]), e_lc = testing::rel_l2(lc[i], ref[i]);
    EXPECT_LT(e_lc, 1.5 * e_plain + 4e-3) << name << ": tiled+offload " << e_lc << ", plain " << e_plain;
    EXPECT_LT(testing::rel_l2(lc[i], plain[i]), 2e-2) << name;
    EXPECT_TRUE(testing::all_finite(lc[i])) << name;
    ++i;
  }
}

}  // namespace
}  // namespace kestrel::models
