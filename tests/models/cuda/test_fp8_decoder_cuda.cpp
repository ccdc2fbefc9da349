// The decoder with FP8 projections on the GPU (issue 23): one step's loss and gradients on CUDA (bf16)
// against the same model with the same parameter values on the CPU (f32, FP8 emulated), within
// FP8 + bf16 tolerance; against the GPU's own bf16 model within FP8's error; and the recompute
// policies leave the FP8 gradients unchanged (a re-run forward records the same amax and casts with
// the same scales), over two optimizer-step rolls.
#include <gtest/gtest.h>

#include <cstdio>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/decoder.h"
#include "models/cuda/fp8_test_model.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel::models {
namespace {
namespace ag = autograd;

using testing_fp8::fp8_text;

void copy_params(ParameterList& dst, ParameterList& src) {
  for (auto& [name, t] : dst.items()) t->copy_(src.get(name));
}

std::vector<Tensor> take_grads(ParameterList& p) {
  std::vector<Tensor> g;
  for (auto& [name, t] : p.items()) {
    EXPECT_TRUE(t->grad().defined()) << name;
    g.push_back(t->grad().to(DType::F32).to(Device::cpu()));
  }
  p.zero_grad();
  return g;
}

struct Step {
  double loss;
  std::vector<Tensor> grads;
};

Step run_step(Decoder& m, const Tensor& ids, const Tensor& labels, const std::vector<int64_t>& lens,
              ag::RecomputePolicy policy = ag::RecomputePolicy::None) {
  const Device d = m.device();
  PackedBatch b = PackedBatch::from_lengths(lens, d);
  Tensor loss = m.loss(m.forward(m.embed(ids.to(d)), b, policy), labels.to(d));
  ag::backward(loss);
  return {loss.item(), take_grads(m.parameters())};
}

TEST(Fp8DecoderCuda, MatchesTheCpuEmulationAndTheBf16Model) {
  KESTREL_REQUIRE_GPU();
  Decoder gpu(fp8_text(), DType::BF16, Device::cuda(0), 3);
  Decoder bf16(fp8_text(), DType::BF16, Device::cuda(0), 3);
  Decoder cpu(fp8_text(), DType::F32, Device::cpu(), 99);
  copy_params(cpu.parameters(), gpu.parameters());
  copy_params(bf16.parameters(), gpu.parameters());
  gpu.enable_fp8(Fp8Recipe{});
  cpu.enable_fp8(Fp8Recipe{});
  const std::vector<int64_t> lens = {200, 57, 255};  // 512 tokens
  for (int step = 0; step < 2; ++step) {
    Tensor ids = randint({512}, 512), labels = randint({512}, 512);
    Step g = run_step(gpu, ids, labels, lens), c = run_step(cpu, ids, labels, lens), r = run_step(bf16, ids, labels, lens);
    EXPECT_NEAR(g.loss, c.loss, 2e-2 * std::abs(c.loss)) << "step " << step + 1;
    EXPECT_NEAR(g.loss, r.loss, 3e-2 * std::abs(r.loss)) << "step " << step + 1;
    size_t i = 0;
    for (auto& [name, t] : gpu.parameters().items()) {
      const double ec = testing::rel_l2(g.grads[i], c.grads[i]), er = testing::rel_l2(g.grads[i], r.grads[i]);
      std::printf("step %d %-45s rel L2 vs cpu fp8 %.2e, vs gpu bf16 %.2e\n", step + 1, name.c_str(), ec, er);
      // The op-level check is tight (LinearFp8Cuda: 6e-4 to 2e-3 against the emulation on the same inputs).
      // Through a decoder the GPU quantises bf16 activations and the CPU f32 ones, so the FP8 rounding noise
      // of the two is no longer shared: measured on the H200 (2026-12-01) 4.5e-2 to 1.45e-1, the same size
      // as the distance to the GPU's own bf16 model (7e-2 to 1.5e-1). A bound of 0.2 still fails a missing
      // scale (a factor of 2 or more) or a wrong operand (errors of order 1), and the losses must agree to 2e-2.
      EXPECT_LT(ec, 0.2) << name << " step " << step + 1;
      EXPECT_LT(er, 0.2) << name << " step " << step + 1;  // one linear alone: ~4% (y), ~6% (dx, dw)
      EXPECT_TRUE(testing::all_finite(g.grads[i])) << name;
      ++i;
    }
    gpu.fp8_state()->roll();
    cpu.fp8_state()->roll();
  }
}

TEST(Fp8DecoderCuda, RecomputePoliciesKeepTheGradients) {
  KESTREL_REQUIRE_GPU();
  Decoder m(fp8_text(), DType::BF16, Device::cuda(0), 5);
  m.set_deterministic(true);  // fixed-order attention dq and embedding backward: only FP8 may differ
  m.enable_fp8(Fp8Recipe{});
  const std::vector<int64_t> lens = {300, 212};
  Tensor ids = randint({512}, 512), labels = randint({512}, 512);
  for (int step = 0; step < 2; ++step) {
    std::vector<Tensor> ref;
    for (LayerRecompute lr : {LayerRecompute::Full, LayerRecompute::Selective})
      for (auto policy : {ag::RecomputePolicy::None, ag::RecomputePolicy::Keep}) {
        m.set_layer_recompute(lr);
        Step s = run_step(m, ids, labels, lens, policy);
        if (ref.empty()) {
          ref = s.grads;
          continue;
        }
        // Same kernels on the same values: equal up to a cuBLASLt algorithm choice (keyed on buffer
        // alignment); a re-run forward that recorded a different amax would rescale every cast
        // (errors ~2^-4 per element, ~3e-2 in relative L2).
        for (size_t i = 0; i < ref.size(); ++i)
          EXPECT_LT(testing::rel_l2(s.grads[i], ref[i]), 1e-3)
              << layer_recompute_name(lr) << " " << ag::policy_name(policy) << " " << m.parameters().items()[i].first;
      }
    m.fp8_state()->roll();
  }
}

}  // namespace
}  // namespace kestrel::models
