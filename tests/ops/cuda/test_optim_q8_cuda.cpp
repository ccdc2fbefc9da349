// CUDA against the CPU reference, bit for bit: AdamW on bf16 parameters without a master
// (stochastic rounding in place) and AdamW on 8-bit block-wise moments (codes, scales, the f32
// master or the bf16 parameter, the bf16 copy), over several steps, odd sizes and multi-tensor
// launches, with nearest and stochastic rounding.
#include <gtest/gtest.h>

#include <vector>

#include "kestrel/ops/optim.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel {
namespace {

std::vector<uint8_t> bits(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).contiguous();
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

AdamWOptions options() {
  AdamWOptions o;
  o.lr = 3e-3;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  return o;
}

TEST(CudaParity, AdamWNoMasterMatchesCpuBitForBit) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  for (uint64_t seed : {uint64_t{0}, uint64_t{987654321}}) {
    for (int64_t n : {1, 1001, 70001}) {
      Tensor pc = testing::randn({n}).to(DType::BF16), mc = Tensor::zeros({n}), vc = Tensor::zeros({n});
      Tensor pg = pc.to(gpu), mg = mc.to(gpu), vg = vc.to(gpu);
      for (int64_t step = 1; step <= 3; ++step) {
        Tensor g = testing::randn({n}).to(DType::BF16);
        adamw_step(pc, g, mc, vc, step, options(), Tensor(), seed ? seed + step : 0);
        adamw_step(pg, g.to(gpu), mg, vg, step, options(), Tensor(), seed ? seed + step : 0);
      }
      EXPECT_EQ(bits(pg), bits(pc)) << "bf16 param n=" << n << " seed=" << seed;
      EXPECT_EQ(bits(mg), bits(mc)) << "m n=" << n;
      EXPECT_EQ(bits(vg), bits(vc)) << "v n=" << n;
    }
  }
}

// Sizes: one element, a block minus one, exactly two blocks, many blocks with a short tail.
TEST(CudaParity, AdamWQ8MatchesCpuBitForBit) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  for (bool master : {true, false}) {
    for (uint64_t seed : {uint64_t{0}, uint64_t{1234567}}) {
      for (int64_t n : {1, 2047, 4096, 100003}) {
        SCOPED_TRACE(::testing::Message() << "master " << master << " seed " << seed << " n " << n);
        Tensor p0 = testing::randn({n});
        Tensor pc = master ? p0.clone() : p0.to(DType::BF16), pg = pc.to(gpu);
        Q8Moments sc = Q8Moments::zeros(n, Device::cpu()), sg = Q8Moments::zeros(n, gpu);
        Tensor copy_c = master ? Tensor::empty({n}, DType::BF16) : Tensor();
        Tensor copy_g = master ? Tensor::empty({n}, DType::BF16, gpu) : Tensor();
        for (int64_t step = 1; step <= 4; ++step) {
          // Gradients whose scale varies along the tensor, so blocks get different scales.
          Tensor g = testing::randn({n}, DType::F32, Device::cpu(), step == 2 ? 1e-3 : 1.0).to(DType::BF16);
          const uint64_t s = seed ? seed + step : 0;
          adamw_step_q8(pc, g, sc, step, options(), copy_c, s, s * 7);
          adamw_step_q8(pg, g.to(gpu), sg, step, options(), copy_g, s, s * 7);
        }
        EXPECT_EQ(bits(pg), bits(pc)) << "param";
        EXPECT_EQ(bits(sg.m_codes), bits(sc.m_codes)) << "m codes";
        EXPECT_EQ(bits(sg.v_codes), bits(sc.v_codes)) << "v codes";
        EXPECT_EQ(bits(sg.m_scale), bits(sc.m_scale)) << "m scales";
        EXPECT_EQ(bits(sg.v_scale), bits(sc.v_scale)) << "v scales";
        if (master) EXPECT_EQ(bits(copy_g), bits(copy_c)) << "bf16 copy";
      }
    }
  }
}

}  // namespace
}  // namespace kestrel
