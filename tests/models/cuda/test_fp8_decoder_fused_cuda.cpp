// The FP8 decoder on the GPU with its producer-fused input casts (Decoder::set_fp8_fused_casts;
// ops/cuda/fp8_producers.cu) on and off: over three optimizer-step rolls (step 1 unseeded, the
// producers falling back), with and without selective recompute, the losses, every parameter's
// gradient and the FP8 state's running amax are bit for bit the same (deterministic attention and
// embedding backward; every GEMM operand is a fresh allocation either way, so cuBLASLt picks the same
// algorithms), and once seeded each forward dispatches 1 cast per layer fewer (down's input, cast by
// the fused SwiGLU kernel; the norms' casts for q/k/v and gate/up are a second pass either way) and
// each backward 2 per layer fewer (the gate and up gradients' casts, written by swiglu_gate_up_fp8's
// backward kernel), none fewer at step 1.
#include <gtest/gtest.h>

#include <cstdio>

#include "kestrel/autograd/recompute.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "kestrel/runtime/op_profile.h"
#include "kestrel/runtime/random.h"
#include "models/cuda/fp8_test_model.h"
#include "ops/fp8_producer_check.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace ag = autograd;

using testing::host_bits;
using testing_fp8::fp8_text;

struct Step {
  std::vector<uint32_t> loss, amax;
  std::vector<Tensor> grads;
  int64_t casts = 0;  // fp8_cast dispatches, forward and backward
};

Step run_step(Decoder& m, const Tensor& ids, const Tensor& labels, const std::vector<int64_t>& lens,
              ag::RecomputePolicy policy) {
  const Device d = m.device();
  PackedBatch b = PackedBatch::from_lengths(lens, d);
  OpProfile prof;
  prof.start();
  Tensor loss = m.loss(m.forward(m.embed(ids.to(d)), b, policy), labels.to(d));
  ag::backward(loss);
  prof.stop();
  Step s;
  for (const OpTime& t : prof.ops())
    if (t.op == "fp8_cast") s.casts = t.calls;
  s.loss = host_bits(loss);
  for (auto& [name, t] : m.parameters().items()) s.grads.push_back(t->grad().to(DType::F32).to(Device::cpu()));
  m.parameters().zero_grad();
  s.amax = host_bits(m.fp8_state()->amax());
  return s;
}

TEST(Fp8DecoderCuda, FusedInputCastsEqualTheUnfusedOnesBitForBit) {
  KESTREL_REQUIRE_GPU();
  const std::vector<int64_t> lens = {200, 57, 250};  // 507 tokens: padded to 512 for the GEMMs
  const int64_t L = 2;
  for (auto mode : {LayerRecompute::Full, LayerRecompute::Selective})
    for (auto policy : {ag::RecomputePolicy::None, ag::RecomputePolicy::Keep}) {
      if (mode == LayerRecompute::Selective && policy == ag::RecomputePolicy::None) continue;  // same as Full/None
      SCOPED_TRACE(std::string(layer_recompute_name(mode)) + " " + ag::policy_name(policy));
      Decoder fused(fp8_text(), DType::BF16, Device::cuda(0), 3), plain(fp8_text(), DType::BF16, Device::cuda(0), 3);
      for (auto& [name, t] : plain.parameters().items()) t->copy_(fused.parameters().get(name));
      for (Decoder* m : {&fused, &plain}) {
        m->set_deterministic(true);  // fixed-order attention dq and embedding backward
        m->set_layer_recompute(mode);
        m->enable_fp8(Fp8Recipe{});
      }
      plain.set_fp8_fused_casts(false);
      const int64_t forwards = policy == ag::RecomputePolicy::None ? 1 : 2;
      for (int step = 0; step < 3; ++step) {
        Tensor ids = randint({507}, 512), labels = randint({507}, 512);
        Step a = run_step(fused, ids, labels, lens, policy), b = run_step(plain, ids, labels, lens, policy);
        EXPECT_EQ(a.loss, b.loss) << "step " << step + 1;
        EXPECT_EQ(a.amax, b.amax) << "step " << step + 1;
        size_t i = 0;
        for (auto& [name, t] : fused.parameters().items()) {
          const bool same = host_bits(a.grads[i]) == host_bits(b.grads[i]);
          EXPECT_TRUE(same) << name << " step " << step + 1 << ": rel L2 "
                            << testing::rel_l2(a.grads[i], b.grads[i]);
          ++i;
        }
        EXPECT_EQ(b.casts - a.casts, step == 0 ? 0 : L * (forwards + 2)) << "step " << step + 1;
        std::printf("step %d: fp8_cast dispatches fused %lld, unfused %lld\n", step + 1,
                    static_cast<long long>(a.casts), static_cast<long long>(b.casts));
        fused.fp8_state()->roll();
        plain.fp8_state()->roll();
      }
    }
}

}  // namespace
}  // namespace kestrel::models
