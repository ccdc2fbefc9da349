// Long-context settings leave the maths alone: the decoder with its MLP over token tiles, under every
// recompute policy (offload included), gives the loss and every gradient of the untiled decoder
// without recompute, on packed documents longer than the tile (f32 on the CPU): bit for bit, except
// the MLP's weight gradients under tiling, which are summed tile by tile (f32 rounding).
#include <gtest/gtest.h>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace ag = autograd;

TEST(DecoderLongContext, TiledMlpAndRecomputePoliciesKeepLossAndGradients) {
  TextConfig c = TextConfig::defaults_for("llama");
  c.vocab_size = 41;
  c.hidden_size = 24;
  c.intermediate_size = 40;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.max_position_embeddings = 256;
  Decoder m(c, DType::F32, Device::cpu(), 5);
  const std::vector<int64_t> lengths = {150, 1, 47};
  const int64_t T = 198;
  std::vector<int64_t> ids(T), labels(T);
  Tensor r = testing::randu({T}, 0, 41);
  std::vector<float> rv = r.to_float_vector();
  for (int64_t i = 0; i < T; ++i) ids[i] = static_cast<int64_t>(rv[i]) % 41;
  for (int64_t i = 0; i < T; ++i) labels[i] = i + 1 < T ? ids[i + 1] : -100;
  Tensor tid = Tensor::from_vector(ids, {T}), tlab = Tensor::from_vector(labels, {T});
  PackedBatch layout = PackedBatch::from_lengths(lengths, Device::cpu());

  auto run = [&](int64_t tile, ag::RecomputePolicy policy) {
    m.set_mlp_tile_tokens(tile);
    m.parameters().zero_grad();
    Tensor loss = m.loss(m.forward(m.embed(tid), layout, policy), tlab);
    ag::backward(loss);
    std::vector<Tensor> out{loss.detach().clone()};
    for (auto& [name, t] : m.parameters().items()) out.push_back(t->grad().clone());
    return out;
  };
  const std::vector<Tensor> ref = run(0, ag::RecomputePolicy::None);
  for (int64_t tile : {0, 16, 64, 1000}) {
    for (auto policy : {ag::RecomputePolicy::None, ag::RecomputePolicy::Keep, ag::RecomputePolicy::Offload}) {
      SCOPED_TRACE(::testing::Message() << "tile " << tile << ", " << ag::policy_name(policy));
      const std::vector<Tensor> got = run(tile, policy);
      ASSERT_EQ(got.size(), ref.size());
      EXPECT_LT(testing::rel_l2(got[0], ref[0]), 1e-6) << "loss";
      size_t i = 1;
      for (auto& [name, t] : m.parameters().items()) {
        // The same ops in the same order give the same bits; the tiled MLP's weight gradients are
        // sums over the tiles (another order of the same f32 additions), everything else is exact.
        if (tile > 0 && name.find(".mlp.") != std::string::npos)
          EXPECT_LT(testing::rel_l2(got[i], ref[i]), 1e-6) << name;
        else
          EXPECT_EQ(testing::max_abs_diff(got[i], ref[i]), 0.0) << name;
        ++i;
      }
    }
  }
  EXPECT_THROW(m.set_mlp_tile_tokens(-1), Error);
}

}  // namespace
}  // namespace kestrel::models
