// FP8 on the GPU (kestrel/ops/fp8.h): the CUDA cast (tile and scalar paths, plain and transposed) equal
// bit for bit to the CPU's, with the same amax and scales; the cuBLASLt FP8 GEMM against the exact
// float64 value of the same codes, within an accumulation bound, its cached plan reading each call's
// scale pointers and refusing a misaligned one; linear_fp8 forward, dgrad and wgrad
// against the CPU emulation on the same inputs at decoder shapes, before and after a roll (the
// scales equal bit for bit on both devices, so only the GEMMs' summation order differs).
//
// Tolerances. The CPU sums the exact products in f64 and rounds once; the GPU's output is within half
// a bf16 ulp (2^-8 relative) of its own f32 result, so agreeing results differ by at most 2^-8 |r|
// plus the GPU's accumulation error. That error is bounded per element by the sum of |products| S
// times: K * 2^-24 (f32 sums of the promoted partials) plus 2^-12 for the tensor cores' own partial
// sums between promotions (about 14 bits kept: DeepSeek-V3's measurement on Hopper), and 2^-9 with
// FAST_ACCUM, which never promotes. S ~ sqrt(K) |r| for random signs, so these bounds still catch any
// wrong scale, transposition or format (errors of order |r|).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "../fp8_check.h"
#include "kestrel/autograd/tape.h"
#include "support/gpu.h"
#include "support/numerics.h"

namespace kestrel::testing {
namespace {

const Device kGpu = Device::cuda(0);

// Normal values spread over many binades, some past the format's range after scaling (saturation)
// and some in its subnormal range.
Tensor wide_values(int64_t R, int64_t C, DType dt) {
  std::mt19937 rng(static_cast<uint32_t>(R * 131 + C));
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-14, 8);
  std::vector<float> v(static_cast<size_t>(R * C));
  for (float& x : v) x = n(rng) * std::ldexp(1.0f, e(rng));
  return Tensor::from_vector(v, {R, C}, dt);
}

std::vector<uint8_t> codes(const Tensor& t) {
  Tensor h = t.to(Device::cpu());
  return std::vector<uint8_t>(h.data<uint8_t>(), h.data<uint8_t>() + h.numel());
}

TEST(Fp8CastCuda, EqualsTheCpuCastBitForBit) {
  KESTREL_REQUIRE_GPU();
  struct Case {
    int64_t R, C;
  };
  // Tile path (multiples of 8, ragged tiles), scalar path (odd sizes), decoder sizes.
  for (Case c : {Case{64, 64}, Case{40, 24}, Case{37, 21}, Case{1, 5}, Case{520, 2056}, Case{4096, 2048},
                 Case{2048, 8192}})
    for (DType dt : {DType::BF16, DType::F32})
      for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2})
        for (float s : {1.0f, 37.25f}) {
          Tensor x = wide_values(c.R, c.C, dt);
          Tensor scale = Tensor::full({1}, s, DType::F32);
          Tensor amax_c = Tensor::full({1}, 0.5, DType::F32), amax_g = amax_c.to(kGpu);
          Fp8CastResult cpu = fp8_cast(x, scale, f, true, true, amax_c);
          Fp8CastResult gpu = fp8_cast(x.to(kGpu), scale.to(kGpu), f, true, true, amax_g);
          const std::string what = std::to_string(c.R) + "x" + std::to_string(c.C) + " " + std::string(dtype_name(dt)) + " " +
                                   fp8_format_name(f) + " scale " + std::to_string(s);
          ASSERT_EQ(codes(gpu.plain.data), codes(cpu.plain.data)) << what;
          ASSERT_EQ(codes(gpu.transposed.data), codes(cpu.transposed.data)) << what;
          EXPECT_EQ(amax_g.item(), amax_c.item()) << what;
          EXPECT_EQ(gpu.plain.scales.to_float_vector(), cpu.plain.scales.to_float_vector()) << what;
          // Only one of the copies, and no amax.
          Fp8CastResult t_only = fp8_cast(x.to(kGpu), scale.to(kGpu), f, false, true);
          ASSERT_EQ(codes(t_only.transposed.data), codes(cpu.transposed.data)) << what;
        }
}

TEST(Fp8CastCuda, SaturatesInfinitiesAndKeepsNan) {
  KESTREL_REQUIRE_GPU();
  const float inf = INFINITY;
  std::vector<float> v = {inf, -inf, 1e30f, -1e30f, NAN, 0.0f, -0.0f, 1e-30f};
  v.resize(64, 1.0f);
  Tensor x = Tensor::from_vector(v, {8, 8});
  for (Fp8Format f : {Fp8Format::E4M3, Fp8Format::E5M2}) {
    Tensor one = Tensor::full({1}, 1.0, DType::F32);
    std::vector<uint8_t> g = codes(fp8_cast(x.to(kGpu), one.to(kGpu), f, true, false).plain.data);
    std::vector<uint8_t> c = codes(fp8_cast(x, one, f, true, false).plain.data);
    for (size_t i = 0; i < v.size(); ++i) {
      if (std::isnan(v[i]))
        EXPECT_TRUE(std::isnan(fp8_to_float(g[i], f))) << fp8_format_name(f) << " NaN -> code " << int(g[i]);
      else
        EXPECT_EQ(g[i], c[i]) << fp8_format_name(f) << " value " << v[i];
    }
  }
}

// GPU GEMM vs the exact value of the same codes on sampled elements; prints the errors seen.
void expect_gemm_matches(int64_t M, int64_t N, int64_t K, Fp8Format fa, Fp8Format fb, bool fast) {
  Tensor a = randn({M, K}, DType::BF16, kGpu), b = randn({N, K}, DType::BF16, kGpu, 0.02);
  auto scale_for = [](const Tensor& t, Fp8Format f) {
    Tensor amax = Tensor::zeros({1}, DType::F32, kGpu);
    fp8_amax_into(t, amax);
    return Tensor::full({1}, ref_scale(static_cast<float>(amax.item()), f, 0), DType::F32, kGpu);
  };
  Fp8Tensor qa = fp8_cast(a, scale_for(a, fa), fa, true, false).plain;
  Fp8Tensor qb = fp8_cast(b, scale_for(b, fb), fb, true, false).plain;
  const std::vector<float> out = fp8_gemm(qa, qb, DType::BF16, fast).to_float_vector();
  const std::vector<uint8_t> ca = codes(qa.data), cb = codes(qb.data);
  const double inv = static_cast<double>(qa.scales.to_float_vector()[0]) * qb.scales.to_float_vector()[0];
  std::mt19937 rng(static_cast<uint32_t>(M + N + K));
  double worst = 0.0, err2 = 0.0, ref2 = 0.0;
  const double acc_bound = fast ? std::ldexp(1.0, -9) : std::ldexp(1.0, -12) + static_cast<double>(K) * std::ldexp(1.0, -24);
  for (int s = 0; s < 3000; ++s) {
    const int64_t m = static_cast<int64_t>(rng() % M), n = static_cast<int64_t>(rng() % N);
    double r = 0.0, S = 0.0;
    for (int64_t k = 0; k < K; ++k) {
      const double p = static_cast<double>(fp8_to_float(ca[m * K + k], fa)) * fp8_to_float(cb[n * K + k], fb);
      r += p;
      S += std::fabs(p);
    }
    r *= inv;
    S *= inv;
    const double g = out[m * N + n], d = std::fabs(g - r);
    worst = std::max(worst, d / (std::ldexp(std::fabs(r), -8) + acc_bound * S + 1e-30));
    err2 += d * d;
    ref2 += r * r;
    ASSERT_LE(d, std::ldexp(std::fabs(r), -8) + acc_bound * S)
        << M << "x" << N << "x" << K << " " << fp8_format_name(fa) << "." << fp8_format_name(fb)
        << (fast ? " fast" : "") << " element (" << m << ", " << n << "): gpu " << g << " exact " << r << " S " << S;
  }
  const double rel = std::sqrt(err2 / ref2);
  std::printf("fp8_gemm %lldx%lldx%lld %s.%s%s: rel L2 %.2e, worst error / bound %.3f\n", static_cast<long long>(M),
              static_cast<long long>(N), static_cast<long long>(K), fp8_format_name(fa), fp8_format_name(fb),
              fast ? " fast_accum" : "", rel, worst);
  // bf16 output rounding alone is ~2^-9 rms; FAST_ACCUM adds up to ~1% (DeepSeek-V3 saw ~2% at most at K 4096).
  EXPECT_LT(rel, fast ? 2e-2 : 4e-3);
}

TEST(Fp8GemmCuda, MatchesTheExactValueOfTheCodes) {
  KESTREL_REQUIRE_GPU();
  // The 1.5B decoder's GEMMs (tokens 512..4096; 2048 hidden, 512 kv, 8192 MLP) and the backward's
  // operand formats.
  expect_gemm_matches(512, 2048, 2048, Fp8Format::E4M3, Fp8Format::E4M3, true);
  expect_gemm_matches(4096, 512, 2048, Fp8Format::E4M3, Fp8Format::E4M3, true);
  expect_gemm_matches(1024, 8192, 2048, Fp8Format::E4M3, Fp8Format::E4M3, true);
  expect_gemm_matches(2048, 2048, 8192, Fp8Format::E4M3, Fp8Format::E4M3, true);
  expect_gemm_matches(2048, 2048, 8192, Fp8Format::E4M3, Fp8Format::E4M3, false);
  expect_gemm_matches(4096, 2048, 512, Fp8Format::E5M2, Fp8Format::E4M3, false);  // dgrad
  expect_gemm_matches(2048, 8192, 4096, Fp8Format::E5M2, Fp8Format::E4M3, false);  // wgrad (K = tokens)
  expect_gemm_matches(512, 2048, 2048, Fp8Format::E4M3, Fp8Format::E5M2, false);
  expect_gemm_matches(16, 16, 16, Fp8Format::E4M3, Fp8Format::E4M3, false);
}

// The plan (descriptor, layouts, algorithm) is cached per shape and format, and each call sets its own
// scale pointers: the same codes with the dequantisation factors doubled and quadrupled (powers of two:
// exact in the f32 result and its bf16 rounding) give exactly 2 and 4 times the first product. A plan
// that kept the first call's pointers would give the first product again.
TEST(Fp8GemmCuda, CachedPlanReadsEachCallsScales) {
  KESTREL_REQUIRE_GPU();
  const int64_t M = 64, N = 32, K = 48;
  Tensor one = Tensor::full({1}, 1.0, DType::F32, kGpu);
  Fp8Tensor qa = fp8_cast(randn({M, K}, DType::BF16, kGpu), one, Fp8Format::E4M3, true, false).plain;
  Fp8Tensor qb = fp8_cast(randn({N, K}, DType::BF16, kGpu), one, Fp8Format::E4M3, true, false).plain;
  const std::vector<float> base = fp8_gemm(qa, qb, DType::BF16, false).to_float_vector();
  for (float f : {2.0f, 4.0f}) {
    // {1 / scale, scale}: the dequantisation factor first (fresh allocations: 16-byte aligned).
    Fp8Tensor qa2{qa.data, Tensor::from_vector(std::vector<float>{f, 1.0f / f}, {2}).to(kGpu), qa.format};
    const std::vector<float> got = fp8_gemm(qa2, qb, DType::BF16, false).to_float_vector();
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], f * base[i]) << "factor " << f << " element " << i;
  }
  double norm = 0.0;
  for (float v : base) norm += std::fabs(v);
  EXPECT_GT(norm, 0.0);  // a product of random codes, not zeros
}

// cuBLASLt needs 16-byte-aligned scale pointers; a view whose dequantisation factor is 4 bytes into its
// allocation is refused by name instead of failing inside cuBLASLt.
TEST(Fp8GemmCuda, RefusesAMisalignedScalePointer) {
  KESTREL_REQUIRE_GPU();
  Tensor one = Tensor::full({1}, 1.0, DType::F32, kGpu);
  Fp8Tensor q = fp8_cast(randn({16, 16}, DType::BF16, kGpu), one, Fp8Format::E4M3, true, false).plain;
  Fp8Tensor shifted{q.data, Tensor::full({3}, 1.0, DType::F32, kGpu).narrow_view(0, 1, 2), q.format};
  try {
    (void)fp8_gemm(q, shifted, DType::BF16, false);
    FAIL() << "a misaligned scale pointer was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
  }
}

// linear_fp8 fwd + bwd on CUDA and on the CPU (the emulation) with the same bf16 inputs and fresh
// states; then a roll and a second step with new inputs (delayed scales).
void expect_linear_matches(int64_t T, int64_t K, int64_t N, Fp8Format grad_format) {
  Fp8Recipe recipe;
  recipe.grad_format = grad_format;
  recipe.amax_history = 4;
  Fp8State sc(2, recipe, Device::cpu()), sg(2, recipe, kGpu);
  Tensor w = randn({N, K}, DType::BF16, Device::cpu(), 0.02);
  for (int step = 0; step < 2; ++step) {
    Tensor x = randn({T, K}, DType::BF16, Device::cpu(), step == 0 ? 1.0 : 1.5),
           dy = randn({T, N}, DType::BF16, Device::cpu(), 1e-3);
    std::vector<Tensor> out[2];
    for (int dev = 0; dev < 2; ++dev) {
      const Device d = dev == 0 ? Device::cpu() : kGpu;
      Tensor xl = (dev == 0 ? x.clone() : x.to(d)).set_requires_grad(true);
      Tensor wl = (dev == 0 ? w.clone() : w.to(d)).set_requires_grad(true);
      Tensor y = linear_fp8(xl, wl, Tensor(), dev == 0 ? sc : sg, 1);
      autograd::backward({y}, {dy.to(d)});
      out[dev] = {y.detach(), xl.grad(), wl.grad()};
    }
    const char* names[] = {"y", "dx", "dw"};
    for (int i = 0; i < 3; ++i) {
      const double e = rel_l2(out[1][i], out[0][i]);
      std::printf("linear_fp8 T %lld K %lld N %lld %s step %d %s: rel L2 %.2e\n", static_cast<long long>(T),
                  static_cast<long long>(K), static_cast<long long>(N), fp8_format_name(grad_format), step + 1,
                  names[i], e);
      // y uses FAST_ACCUM; dgrad and wgrad accumulate with promotion.
      EXPECT_LT(e, i == 0 ? 1.5e-2 : 5e-3) << names[i] << " step " << step + 1;
      EXPECT_TRUE(all_finite(out[1][i]));
    }
    EXPECT_EQ(sg.amax().to_float_vector(), sc.amax().to_float_vector()) << "step " << step + 1;
    sc.roll();
    sg.roll();
    EXPECT_EQ(sg.scale().to_float_vector(), sc.scale().to_float_vector()) << "step " << step + 1;
    EXPECT_EQ(sg.history().to_float_vector(), sc.history().to_float_vector()) << "step " << step + 1;
  }
}

TEST(LinearFp8Cuda, MatchesTheCpuEmulation) {
  KESTREL_REQUIRE_GPU();
  expect_linear_matches(512, 2048, 512, Fp8Format::E5M2);
  expect_linear_matches(1000, 1024, 256, Fp8Format::E5M2);  // ragged token count: padded to 1008
  expect_linear_matches(256, 512, 2048, Fp8Format::E4M3);
}

}  // namespace
}  // namespace kestrel::testing
