// The FP8 decoder's producer-fused input casts (Decoder::set_fp8_fused_casts; kestrel/ops/fp8_producers.h)
// on the CPU: losses, every parameter's gradient and the FP8 state's running amax equal bit for bit
// with the fused producers on and off, over three optimizer-step rolls (step 1 unseeded: the
// producers fall back; then fused), f32 and bf16, without and with recompute (selective and full:
// the re-run forward casts again). SwiGLU's fused-kernel branch is taken through a CPU stand-in for
// the CUDA kernel, counting the forwards that ran through it: 1 per layer once seeded, none with the
// switch off (the norms' casts are a second pass either way).
#include <gtest/gtest.h>

#include <cstring>

#include "kestrel/autograd/recompute.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/runtime/random.h"
#include "ops/fp8_producer_check.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace ag = autograd;
using testing::FusedKernelStandIns;
using testing::host_bits;

TextConfig fp8_small_text() {
  TextConfig c = TextConfig::defaults_for("llama");
  c.vocab_size = 53;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.tie_word_embeddings = false;
  return c;
}

struct Step {
  std::vector<uint32_t> loss;
  std::vector<std::vector<uint32_t>> grads;
  std::vector<uint32_t> amax;
  int swiglu_calls = 0;
};

Step run_step(Decoder& m, const PackedBatch& batch, const Tensor& ids, const Tensor& labels, ag::RecomputePolicy policy) {
  FusedKernelStandIns standins;
  Tensor loss = m.loss(m.forward(m.embed(ids), batch, policy), labels);
  ag::backward(loss);
  Step s;
  s.loss = host_bits(loss);
  for (auto& [name, t] : m.parameters().items()) {
    EXPECT_TRUE(t->grad().defined()) << name;
    s.grads.push_back(host_bits(t->grad()));
  }
  m.parameters().zero_grad();
  s.amax = host_bits(m.fp8_state()->amax());
  s.swiglu_calls = FusedKernelStandIns::swiglu_calls;
  return s;
}

TEST(Fp8DecoderFusedCasts, LossesAndGradientsEqualTheUnfusedDecoderBitForBit) {
  const std::vector<int64_t> lengths = {13, 6, 21};  // 40 tokens: ragged (padded to 48 for the GEMMs)
  const int64_t T = 40, L = 2;
  struct Case {
    DType dtype;
    LayerRecompute mode;
    ag::RecomputePolicy policy;
  };
  for (Case c : {Case{DType::F32, LayerRecompute::Full, ag::RecomputePolicy::None},
                 Case{DType::BF16, LayerRecompute::Selective, ag::RecomputePolicy::Keep},
                 Case{DType::BF16, LayerRecompute::Full, ag::RecomputePolicy::Keep}}) {
    SCOPED_TRACE(std::string(dtype_name(c.dtype)) + " " + layer_recompute_name(c.mode) + " " +
                 ag::policy_name(c.policy));
    Decoder fused(fp8_small_text(), c.dtype, Device::cpu(), 17), plain(fp8_small_text(), c.dtype, Device::cpu(), 17);
    // Norm weights off their trivial init so the norms' gradients are generic.
    Generator g(3);
    for (auto& [name, t] : fused.parameters().items()) {
      t->copy_(normal(t->shape(), name.find("norm") != std::string::npos ? 1.0 : 0.0, 0.1, DType::F32, Device::cpu(), g)
                   .to(c.dtype));
      plain.parameters().get(name).copy_(*t);
    }
    for (Decoder* m : {&fused, &plain}) {
      m->enable_fp8(Fp8Recipe{});
      m->set_layer_recompute(c.mode);
    }
    plain.set_fp8_fused_casts(false);
    EXPECT_TRUE(fused.fp8_fused_casts());
    PackedBatch batch = PackedBatch::from_lengths(lengths, Device::cpu());
    const int reruns = c.policy == ag::RecomputePolicy::None ? 1 : 2;  // forwards per step that cast
    for (int step = 0; step < 3; ++step) {
      Tensor ids = randint({T}, 53), labels = randint({T}, 53);
      Step a = run_step(fused, batch, ids, labels, c.policy), b = run_step(plain, batch, ids, labels, c.policy);
      EXPECT_EQ(a.loss, b.loss) << "step " << step + 1;
      ASSERT_EQ(a.grads.size(), b.grads.size());
      for (size_t i = 0; i < a.grads.size(); ++i)
        EXPECT_TRUE(a.grads[i] == b.grads[i]) << "step " << step + 1 << " " << fused.parameters().items()[i].first;
      EXPECT_EQ(a.amax, b.amax) << "step " << step + 1;
      // Unseeded (step 1) the producers fall back to the op and linear_fp8's cast.
      const int fused_forwards = step == 0 ? 0 : reruns;
      EXPECT_EQ(a.swiglu_calls, L * fused_forwards) << "step " << step + 1;
      EXPECT_EQ(b.swiglu_calls, 0) << "step " << step + 1;
      fused.fp8_state()->roll();
      plain.fp8_state()->roll();
    }
  }
}

}  // namespace
}  // namespace kestrel::models
