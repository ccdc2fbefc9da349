// The FP8 producers on the GPU (kestrel/ops/fp8_producers.h; ops/cuda/fp8_producers.cu): RMSNorm and
// residual add + RMSNorm (the plain kernel, then the standalone cast) and the fused SwiGLU kernel
// against the unfused GPU path (the plain kernel, then linear_fp8's input cast) bit for bit: y (and
// h), X8 and X8T codes, scales and the state's running amax, at decoder shapes ([8192, 2048],
// [8192, 8192]), ragged token counts (1000, 8200, 37), long rows (12288, and 16400: streamed by the
// plain norm kernel), observing or not, with and without X8T; on the shapes that fit the host check
// too (the codes are float_to_fp8 of the GPU's y times the scale, padding rows zero, X8T the
// transpose). Which path ran is read from the op profile: SwiGLU's fused call dispatches no cast, a
// norm producer one (its second pass).
// The padded standalone cast (fp8_input_cast of a ragged x) equals the CPU's bit for bit.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "../fp8_check.h"
#include "../fp8_producer_check.h"
#include "kestrel/runtime/op_profile.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel::testing {
namespace {

const Device kGpu = Device::cuda(0);
constexpr float kScale = 200.0f;  // e4m3's 448 at |y| = 2.24: the largest outputs saturate

ProducerInputs gpu_inputs(Producer kind, int64_t T, int64_t C) {
  const DType bf = DType::BF16;
  switch (kind) {
    case Producer::RmsNorm: return {randn({T, C}, bf, kGpu, 2.0), Tensor(), randu({C}, 0.5, 1.5, bf, kGpu)};
    case Producer::AddRmsNorm: return {randn({T, C}, bf, kGpu, 2.0), randn({T, C}, bf, kGpu), randu({C}, 0.5, 1.5, bf, kGpu)};
    case Producer::Swiglu: return {randn({T, C}, bf, kGpu, 2.0), randn({T, C}, bf, kGpu), Tensor()};
  }
  return {};
}

// Runs fn under an op profile; returns how many times the "fp8_cast" kernel was dispatched.
int64_t cast_dispatches(const std::function<void()>& fn) {
  OpProfile prof;
  prof.start();
  fn();
  prof.stop();
  for (const OpTime& t : prof.ops())
    if (t.op == "fp8_cast") return t.calls;
  return 0;
}

TEST(Fp8ProducersCuda, EqualTheUnfusedGpuPathBitForBit) {
  KESTREL_REQUIRE_GPU();
  struct Case {
    int64_t T, C;
    bool host_check;
  };
  const Case cases[] = {{8192, 2048, false}, {8192, 8192, false}, {1000, 2048, true}, {8200, 1536, true},
                        {37, 64, true},      {520, 12288, false}, {64, 16400, true}};
  for (Producer kind : {Producer::RmsNorm, Producer::AddRmsNorm, Producer::Swiglu})
    for (const Case& c : cases) {
      const std::string what = std::string(producer_name(kind)) + " [" + std::to_string(c.T) + ", " +
                               std::to_string(c.C) + "]";
      ProducerInputs in = gpu_inputs(kind, c.T, c.C);
      Fp8State fa = producer_state(2, kGpu, true, kScale, 0.5f, true);
      Fp8State fb = producer_state(2, kGpu, true, kScale, 0.5f, true);
      ProducerOut fused, plain;
      const int64_t casts = cast_dispatches([&] { fused = run_producer(kind, true, in, fa, 1, true); });
      plain = run_producer(kind, false, in, fb, 1, true);
      expect_same_producer_output(fused, plain, fa, fb, what);
      // The norms cast in a second pass (fused norm kernels measured slower); SwiGLU's cast is fused.
      EXPECT_EQ(casts, kind == Producer::Swiglu ? 0 : 1) << what;
      if (c.host_check) expect_codes_cast_y(fused, producer_input_scale(kScale, 1), what);
      const std::vector<float> y = fused.y.to(Device::cpu()).to_float_vector();
      EXPECT_EQ(fa.amax().to(Device::cpu()).to_float_vector()[1], std::max(0.5f, ref_amax(y))) << what;
    }
}

TEST(Fp8ProducersCuda, WithoutTransposedCopyOrObservingOrSeeding) {
  KESTREL_REQUIRE_GPU();
  for (Producer kind : {Producer::RmsNorm, Producer::AddRmsNorm, Producer::Swiglu})
    for (int variant = 0; variant < 3; ++variant) {
      const bool transposed = variant != 0, observing = variant != 1, seeded = variant != 2;
      const std::string what = std::string(producer_name(kind)) + " variant " + std::to_string(variant);
      ProducerInputs in = gpu_inputs(kind, 1000, 2048);
      Fp8State fa = producer_state(2, kGpu, seeded, kScale, 0.5f, observing);
      Fp8State fb = producer_state(2, kGpu, seeded, kScale, 0.5f, observing);
      ProducerOut fused = run_producer(kind, true, in, fa, 0, transposed);
      ProducerOut plain = run_producer(kind, false, in, fb, 0, transposed);
      expect_same_producer_output(fused, plain, fa, fb, what);
      EXPECT_EQ(fused.x8.x8.transposed.data.defined(), transposed) << what;
      const std::vector<float> y = fused.y.to(Device::cpu()).to_float_vector();
      expect_codes_cast_y(fused, seeded ? producer_input_scale(kScale, 0) : ref_scale(ref_amax(y), Fp8Format::E4M3, 0),
                          what);
      EXPECT_EQ(fa.amax().to(Device::cpu()).to_float_vector()[0], observing ? std::max(0.5f, ref_amax(y)) : 0.5f)
          << what;
    }
}

TEST(Fp8CastCuda, PaddedInputCastEqualsTheCpuBitForBit) {
  KESTREL_REQUIRE_GPU();
  // Ragged token counts: the cast writes the zero rows up to a multiple of 16 itself (16-byte and
  // 8-byte transposed segments, the tile kernel's ragged last tile); an odd K-less shape takes the
  // element-wise kernel (K is a multiple of 16 for linear_fp8, so only through T here).
  for (int64_t T : {1, 37, 1000, 8200})
    for (int64_t K : {64, 1536, 2048}) {
      Tensor x = randn({T, K}, DType::BF16, Device::cpu(), 3.0);
      Fp8State gs = producer_state(1, kGpu, true, 37.25f, 0.0f, true);
      Fp8State cs = producer_state(1, Device::cpu(), true, 37.25f, 0.0f, true);
      Fp8InputCast g = fp8_input_cast(x.to(kGpu), gs, 0, true), c = fp8_input_cast(x, cs, 0, true);
      const std::string what = "[" + std::to_string(T) + ", " + std::to_string(K) + "]";
      EXPECT_TRUE(host_codes(g.x8.plain.data) == host_codes(c.x8.plain.data)) << what;
      EXPECT_TRUE(host_codes(g.x8.transposed.data) == host_codes(c.x8.transposed.data)) << what;
      EXPECT_EQ(host_bits(g.x8.plain.scales), host_bits(c.x8.plain.scales)) << what;
      EXPECT_EQ(host_bits(gs.amax()), host_bits(cs.amax())) << what;
    }
}

// swiglu_gate_up_fp8 on the GPU against linear_fp8 over {gate, up} then swiglu_fp8 (then down in
// both), bit for bit: the output, dx, the three weight gradients and the running amax, at the 1.5B
// decoder's MLP shape and ragged token counts, seeded (the fused backward kernel: two standalone casts
// fewer per step, read from the op profile) and not (its fallback, the same casts as the separate
// entries).
TEST(Fp8ProducersCuda, SwigluGateUpEqualsTheSeparateEntriesBitForBit) {
  KESTREL_REQUIRE_GPU();
  struct Case {
    int64_t T, C, I;
  };
  const Case cases[] = {{8192, 2048, 8192}, {1000, 256, 640}, {37, 64, 128}};
  for (const Case& c : cases)
    for (bool seeded : {true, false}) {
      const std::string what = "T=" + std::to_string(c.T) + " C=" + std::to_string(c.C) + " I=" +
                               std::to_string(c.I) + (seeded ? " seeded" : " unseeded");
      const DType bf = DType::BF16;
      Tensor x = randn({c.T, c.C}, bf, kGpu, 1.5), wg = randn({c.I, c.C}, bf, kGpu, 0.05),
             wu = randn({c.I, c.C}, bf, kGpu, 0.05), wd = randn({c.C, c.I}, bf, kGpu, 0.03),
             dm = randn({c.T, c.C}, bf, kGpu);
      Fp8State fa = producer_state(3, kGpu, seeded, kScale, 0.25f, true);
      Fp8State fb = producer_state(3, kGpu, seeded, kScale, 0.25f, true);
      std::vector<Tensor> a, b;
      const int64_t casts_a = cast_dispatches([&] { a = gated_mlp_fp8_step(true, x, wg, wu, wd, dm, fa); });
      const int64_t casts_b = cast_dispatches([&] { b = gated_mlp_fp8_step(false, x, wg, wu, wd, dm, fb); });
      expect_same_step(a, b, what);
      EXPECT_EQ(casts_b - casts_a, seeded ? 2 : 0) << what;
    }
}

}  // namespace
}  // namespace kestrel::testing
