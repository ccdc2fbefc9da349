// FP8 on the CPU (kestrel/ops/fp8.h): the conversions over every code and at every rounding boundary
// (against a brute-force nearest-value search and a pow()-based decoding), the cast and its amax,
// delayed scaling (roll, scale formula, margin, seeding, zero and non-finite amax), linear_fp8's
// forward and both gradients against an independent float64 model of the same quantised maths, its
// distance from the bf16 linear, ragged token counts, and the refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>

#include "fp8_check.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/error.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/shape.h"
#include "support/errors.h"
#include "support/numerics.h"

namespace kestrel::testing {
namespace {

constexpr Fp8Format kFormats[] = {Fp8Format::E4M3, Fp8Format::E5M2};

bool is_nan_code(uint8_t c, Fp8Format f) { return std::isnan(fp8_value_from_bits(c, f)); }

TEST(Fp8Conversion, EveryCodeDecodesAsItsBitFieldsSay) {
  for (Fp8Format f : kFormats)
    for (int c = 0; c < 256; ++c) {
      const double want = fp8_value_from_bits(static_cast<uint8_t>(c), f);
      const float got = fp8_to_float(static_cast<uint8_t>(c), f);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << fp8_format_name(f) << " code " << c;
      } else {
        EXPECT_EQ(static_cast<double>(got), want) << fp8_format_name(f) << " code " << c;
        EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << fp8_format_name(f) << " code " << c;
      }
    }
  // Landmarks of the two formats.
  EXPECT_EQ(fp8_to_float(0x7e, Fp8Format::E4M3), 448.0f);
  EXPECT_EQ(fp8_to_float(0x08, Fp8Format::E4M3), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::E4M3), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_to_float(0x7b, Fp8Format::E5M2), 57344.0f);
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::E5M2), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isinf(fp8_to_float(0x7c, Fp8Format::E5M2)));
  EXPECT_TRUE(std::isnan(fp8_to_float(0x7f, Fp8Format::E4M3)));
}

TEST(Fp8Conversion, EveryFiniteCodeRoundTrips) {
  for (Fp8Format f : kFormats)
    for (int c = 0; c < 256; ++c) {
      const uint8_t code = static_cast<uint8_t>(c);
      const float v = fp8_to_float(code, f);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(float_to_fp8(v, f), code) << fp8_format_name(f) << " code " << c << " value " << v;
    }
}

// The nearest finite value by exhaustive search; on a tie, the code whose mantissa is even.
uint8_t brute_force_round(float x, Fp8Format f) {
  const double max = fp8_max(f);
  double a = std::min(std::fabs(static_cast<double>(x)), max);
  int best = -1;
  double best_d = 0.0;
  for (int c = 0; c < 128; ++c) {
    const double v = fp8_value_from_bits(static_cast<uint8_t>(c), f);
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(v - a);
    if (best < 0 || d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best | (std::signbit(x) ? 0x80 : 0));
}

TEST(Fp8Conversion, RoundsToNearestEvenAtEveryMidpoint) {
  for (Fp8Format f : kFormats) {
    // Midpoints between adjacent positive values (exact in float), and one float either side.
    std::vector<double> values;
    for (int c = 0; c < 128; ++c) {
      const double v = fp8_value_from_bits(static_cast<uint8_t>(c), f);
      if (std::isfinite(v)) values.push_back(v);
    }
    std::sort(values.begin(), values.end());
    for (size_t i = 0; i + 1 < values.size(); ++i) {
      const float mid = static_cast<float>((values[i] + values[i + 1]) / 2);
      for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)})
        for (float s : {1.0f, -1.0f}) {
          const uint8_t want = brute_force_round(s * x, f), got = float_to_fp8(s * x, f);
          ASSERT_EQ(got, want) << fp8_format_name(f) << " x " << s * x;
        }
      // The tie itself goes to the even mantissa (the lower or the upper neighbour, by parity).
      const uint8_t lo = float_to_fp8(static_cast<float>(values[i]), f);
      const uint8_t tie = float_to_fp8(mid, f);
      EXPECT_EQ(tie & 1, 0) << fp8_format_name(f) << " tie at " << mid;
      EXPECT_TRUE(tie == lo || tie == lo + 1) << fp8_format_name(f) << " tie at " << mid;
    }
  }
}

TEST(Fp8Conversion, MatchesBruteForceOnRandomFloats) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> log2mag(-24.0, 18.0);
  for (Fp8Format f : kFormats)
    for (int i = 0; i < 20000; ++i) {
      const float x = static_cast<float>((rng() & 1 ? -1.0 : 1.0) * std::exp2(log2mag(rng)));
      ASSERT_EQ(float_to_fp8(x, f), brute_force_round(x, f)) << fp8_format_name(f) << " x " << x;
    }
}

TEST(Fp8Conversion, SaturatesAndKeepsNan) {
  for (Fp8Format f : kFormats) {
    const uint8_t max_code = f == Fp8Format::E4M3 ? 0x7e : 0x7b;
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_EQ(float_to_fp8(inf, f), max_code);
    EXPECT_EQ(float_to_fp8(-inf, f), max_code | 0x80);
    EXPECT_EQ(float_to_fp8(1e30f, f), max_code);
    EXPECT_EQ(float_to_fp8(static_cast<float>(fp8_max(f)) * 1.05f, f), max_code);
    EXPECT_EQ(float_to_fp8(-static_cast<float>(fp8_max(f)) * 1.05f, f), max_code | 0x80);
    EXPECT_TRUE(is_nan_code(float_to_fp8(std::nanf(""), f), f));
    EXPECT_EQ(float_to_fp8(-0.0f, f), 0x80);
    EXPECT_EQ(float_to_fp8(1e-30f, f), 0x00);  // underflow to zero
  }
}

TEST(Fp8Cast, WritesPlainAndTransposedCopiesAndTheAmax) {
  for (DType dt : {DType::F32, DType::BF16})
    for (Fp8Format f : kFormats) {
      const int64_t R = 37, C = 21;
      Tensor x = randn({R, C}, dt, Device::cpu(), 3.0);
      const std::vector<float> xv = x.to_float_vector();
      const float s = 11.5f;
      Tensor amax = Tensor::full({1}, 0.25, DType::F32);
      Fp8CastResult r = fp8_cast(x, Tensor::full({1}, s, DType::F32), f, true, true, amax);
      const uint8_t* p = r.plain.data.data<uint8_t>();
      const uint8_t* t = r.transposed.data.data<uint8_t>();
      for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < C; ++j) {
          ASSERT_EQ(p[i * C + j], float_to_fp8(xv[i * C + j] * s, f));
          ASSERT_EQ(t[j * R + i], p[i * C + j]);
        }
      EXPECT_EQ(amax.item(), std::max(0.25f, ref_amax(xv)));
      const std::vector<float> sc = r.plain.scales.to_float_vector();
      EXPECT_EQ(sc[0], 1.0f / s);
      EXPECT_EQ(sc[1], s);
      // Dequantised values are within half a quantum (relative 2^-4 for e4m3, 2^-3 for e5m2) of x.
      const std::vector<float> dq = fp8_dequantize(r.plain).to_float_vector();
      const double rel = f == Fp8Format::E4M3 ? 1.0 / 16 : 1.0 / 8;
      for (size_t i = 0; i < xv.size(); ++i)
        EXPECT_LE(std::fabs(dq[i] - xv[i]), rel * std::fabs(xv[i]) + std::ldexp(1.0, f == Fp8Format::E4M3 ? -10 : -17) / s)
            << i;
      // A larger running amax stays.
      fp8_amax_into(x, amax);
      Tensor big = Tensor::full({1}, 1e6, DType::F32);
      fp8_amax_into(x, big);
      EXPECT_EQ(big.item(), 1e6);
    }
}

TEST(Fp8Scaling, RollShiftsHistoriesAndRecomputesScales) {
  Fp8Recipe recipe;
  recipe.amax_history = 3;
  recipe.margin = 1;
  Fp8State st(2, recipe, Device::cpu());
  EXPECT_FALSE(st.seeded());
  for (float v : st.scale().to_float_vector()) EXPECT_EQ(v, 1.0f);
  // Step 1: rows are {x0, x1, w0, w1, dy0, dy1}; x1 stays zero, dy1 is not finite.
  auto set_amax = [&](const std::vector<float>& values) {
    Tensor amax = st.amax();
    amax.copy_(Tensor::from_vector(values, {6}));
  };
  set_amax({2.0f, 0.0f, 4.0f, 0.5f, 100.0f, NAN});
  st.roll();
  EXPECT_TRUE(st.seeded());
  std::vector<float> h = st.history().to_float_vector(), s = st.scale().to_float_vector();
  const std::vector<float> want_h1 = {2, 0, 0, 0, 0, 0, 4, 0, 0, 0.5f, 0, 0, 100, 0, 0, 0, 0, 0};
  EXPECT_EQ(h, want_h1);
  for (float a : st.amax().to_float_vector()) EXPECT_EQ(a, 0.0f);
  EXPECT_EQ(s[0], ref_scale(2.0f, Fp8Format::E4M3, 1));
  EXPECT_EQ(s[0], 448.0f / 4.0f);
  EXPECT_EQ(s[1], 1.0f);  // zero amax: the scale stays
  EXPECT_EQ(s[2], ref_scale(4.0f, Fp8Format::E4M3, 1));
  EXPECT_EQ(s[4], ref_scale(100.0f, Fp8Format::E5M2, 1));  // the gradient rows use e5m2 (the default)
  EXPECT_EQ(s[5], 1.0f);                                    // NaN amax: recorded as 0, scale stays
  // Steps 2-4: the history's max rules, and an amax leaves after H rolls.
  set_amax({1.0f, 3.0f, 1.0f, 1.0f, 1.0f, 1.0f});
  st.roll();
  s = st.scale().to_float_vector();
  EXPECT_EQ(s[0], ref_scale(2.0f, Fp8Format::E4M3, 1));  // max(1, 2)
  EXPECT_EQ(s[1], ref_scale(3.0f, Fp8Format::E4M3, 1));
  set_amax({1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f});
  st.roll();
  EXPECT_EQ(st.scale().to_float_vector()[0], ref_scale(2.0f, Fp8Format::E4M3, 1));  // 2 still in [1, 1, 2]
  set_amax({1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f});
  st.roll();
  EXPECT_EQ(st.scale().to_float_vector()[0], ref_scale(1.0f, Fp8Format::E4M3, 1));  // 2 rolled out
  EXPECT_EQ(st.rolls(), 4);
  st.reset();
  EXPECT_FALSE(st.seeded());
  for (float v : st.history().to_float_vector()) EXPECT_EQ(v, 0.0f);
}

TEST(Fp8Scaling, RecipeAndStateRefuseBadSettings) {
  Fp8Recipe r;
  r.amax_history = 0;
  EXPECT_THROW(Fp8State(1, r, Device::cpu()), Error);
  r.amax_history = 4;
  r.margin = -1;
  EXPECT_THROW(Fp8State(1, r, Device::cpu()), Error);
  EXPECT_THROW(Fp8State(0, Fp8Recipe{}, Device::cpu()), Error);
  Fp8State st(2, Fp8Recipe{}, Device::cpu());
  EXPECT_THROW(st.row(2, Fp8Role::Input), Error);
  EXPECT_THROW(parse_fp8_format("e3m4", "fp8.grad_format"), Error);
}

struct LinearCase {
  int64_t T, K, N;
  Fp8Format grad_format;
};

// Runs linear_fp8 forward + backward with upstream gradient dy; returns y, dx, dw (f32 tensors).
std::vector<Tensor> run_linear(const Tensor& x, const Tensor& w, const Tensor& dy, Fp8State& st, int64_t index) {
  Tensor xl = x.detach().clone().set_requires_grad(true), wl = w.detach().clone().set_requires_grad(true);
  Tensor y = linear_fp8(xl, wl, Tensor(), st, index);
  autograd::backward({y}, {dy});
  return {y.detach(), xl.grad(), wl.grad()};
}

void expect_close_to(const Tensor& got, const std::vector<double>& want, double rel, const char* what) {
  const std::vector<double> g = got.to_double_vector();
  ASSERT_EQ(g.size(), want.size()) << what;
  double scale = 0.0;
  for (double v : want) scale = std::max(scale, std::fabs(v));
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_LE(std::fabs(g[i] - want[i]), rel * std::fabs(want[i]) + 1e-12 * scale) << what << " element " << i;
}

TEST(LinearFp8, MatchesTheFloat64ModelOfTheQuantisedMaths) {
  for (LinearCase c : {LinearCase{32, 48, 16, Fp8Format::E5M2}, LinearCase{48, 32, 64, Fp8Format::E4M3},
                       LinearCase{37, 16, 32, Fp8Format::E5M2}}) {
    Fp8Recipe recipe;
    recipe.grad_format = c.grad_format;
    Fp8State st(3, recipe, Device::cpu());
    Tensor x = randn({c.T, c.K}, DType::F32, Device::cpu(), 2.0), w = randn({c.N, c.K}, DType::F32, Device::cpu(), 0.05),
           dy = randn({c.T, c.N}, DType::F32, Device::cpu(), 1e-3);
    const std::vector<float> xv = x.to_float_vector(), wv = w.to_float_vector(), gv = dy.to_float_vector();
    // Step 1 (unseeded): every scale from its own tensor's amax.
    const float sx = ref_scale(ref_amax(xv), Fp8Format::E4M3, 0), sw = ref_scale(ref_amax(wv), Fp8Format::E4M3, 0),
                sg = ref_scale(ref_amax(gv), c.grad_format, 0);
    std::vector<Tensor> got = run_linear(x, w, dy, st, 1);
    Fp8LinearReference ref = ref_linear_fp8(xv, wv, gv, c.T, c.K, c.N, c.grad_format, sx, sw, sg);
    // f32 outputs: the f64 sums agree; only the final rounding to f32 differs.
    expect_close_to(got[0], ref.y, 1e-6, "y");
    expect_close_to(got[1], ref.dx, 1e-6, "dx");
    expect_close_to(got[2], ref.dw, 1e-6, "dw");
    // The step's amax of linear 1's three roles is recorded; linear 0's and 2's are not touched.
    std::vector<float> a = st.amax().to_float_vector();
    EXPECT_EQ(a[0 * 3 + 1], ref_amax(xv));
    EXPECT_EQ(a[1 * 3 + 1], ref_amax(wv));
    EXPECT_EQ(a[2 * 3 + 1], ref_amax(gv));
    EXPECT_EQ(a[0], 0.0f);
    EXPECT_EQ(a[2], 0.0f);

    // Step 2 (seeded): new inputs, scales from step 1's amax (delayed), not from the new tensors.
    st.roll();
    Tensor x2 = randn({c.T, c.K}, DType::F32, Device::cpu(), 1.0), dy2 = randn({c.T, c.N}, DType::F32, Device::cpu(), 3e-3);
    const std::vector<float> x2v = x2.to_float_vector(), g2v = dy2.to_float_vector();
    got = run_linear(x2, w, dy2, st, 1);
    ref = ref_linear_fp8(x2v, wv, g2v, c.T, c.K, c.N, c.grad_format, sx, sw, sg);
    expect_close_to(got[0], ref.y, 1e-6, "y (seeded)");
    expect_close_to(got[1], ref.dx, 1e-6, "dx (seeded)");
    expect_close_to(got[2], ref.dw, 1e-6, "dw (seeded)");
    // dy2 is 3x dy's size: saturated at e5m2's max where it left the range, yet recorded as is.
    EXPECT_EQ(st.amax().to_float_vector()[2 * 3 + 1], ref_amax(g2v));
  }
}

TEST(LinearFp8, Bf16OutputsAreTheModelRoundedToBf16) {
  Fp8State st(1, Fp8Recipe{}, Device::cpu());
  const int64_t T = 32, K = 64, N = 48;
  Tensor x = randn({T, K}, DType::BF16), w = randn({N, K}, DType::BF16, Device::cpu(), 0.1),
         dy = randn({T, N}, DType::BF16, Device::cpu(), 0.01);
  const std::vector<float> xv = x.to_float_vector(), wv = w.to_float_vector(), gv = dy.to_float_vector();
  std::vector<Tensor> got = run_linear(x, w, dy, st, 0);
  Fp8LinearReference ref = ref_linear_fp8(xv, wv, gv, T, K, N, Fp8Format::E5M2,
                                          ref_scale(ref_amax(xv), Fp8Format::E4M3, 0),
                                          ref_scale(ref_amax(wv), Fp8Format::E4M3, 0),
                                          ref_scale(ref_amax(gv), Fp8Format::E5M2, 0));
  expect_close_to(got[0], ref.y, 1.0 / 256, "y");  // f64 -> f32 -> bf16: about half a bf16 ulp, 2^-9 relative
  expect_close_to(got[1], ref.dx, 1.0 / 256, "dx");
  expect_close_to(got[2], ref.dw, 1.0 / 256, "dw");
  EXPECT_EQ(got[0].dtype(), DType::BF16);
}

TEST(LinearFp8, StaysWithinFp8ErrorOfTheBf16Linear) {
  const int64_t T = 64, K = 128, N = 96;
  Fp8State st(1, Fp8Recipe{}, Device::cpu());
  Tensor x = randn({T, K}), w = randn({N, K}, DType::F32, Device::cpu(), 0.05), dy = randn({T, N});
  std::vector<Tensor> got = run_linear(x, w, dy, st, 0);
  Tensor xl = x.clone().set_requires_grad(true), wl = w.clone().set_requires_grad(true);
  Tensor y = linear(xl, wl);
  autograd::backward({y}, {dy});
  // e4m3 keeps 3 mantissa bits (rounding error ~2^-4/sqrt(3) rms per operand), e5m2 2 bits.
  const double ey = rel_l2(got[0], y), edx = rel_l2(got[1], xl.grad()), edw = rel_l2(got[2], wl.grad());
  std::printf("linear_fp8 vs f32 linear, rel L2: y %.3g, dx %.3g, dw %.3g\n", ey, edx, edw);
  EXPECT_LT(ey, 0.06);
  EXPECT_LT(edx, 0.10);
  EXPECT_LT(edw, 0.10);
  // ... and it is quantised (not a bf16/f32 pass-through).
  EXPECT_GT(ey, 1e-3);
  EXPECT_GT(edx, 1e-3);
}

TEST(LinearFp8, RaggedTokenCountEqualsTheZeroPaddedOne) {
  const int64_t T = 37, K = 32, N = 16;
  Tensor x = randn({T, K}), w = randn({N, K}, DType::F32, Device::cpu(), 0.1), dy = randn({T, N});
  Tensor xp = Tensor::zeros({48, K}), dyp = Tensor::zeros({48, N});
  xp.narrow_view(0, 0, T).copy_(x);
  dyp.narrow_view(0, 0, T).copy_(dy);
  Fp8State a(1, Fp8Recipe{}, Device::cpu()), b(1, Fp8Recipe{}, Device::cpu());
  std::vector<Tensor> ragged = run_linear(x, w, dy, a, 0), padded = run_linear(xp, w, dyp, b, 0);
  EXPECT_EQ(max_abs_diff(ragged[0], padded[0].narrow_view(0, 0, T)), 0.0);
  EXPECT_EQ(max_abs_diff(ragged[1], padded[1].narrow_view(0, 0, T)), 0.0);
  EXPECT_EQ(max_abs_diff(ragged[2], padded[2]), 0.0);
  EXPECT_EQ(a.amax().to_float_vector(), b.amax().to_float_vector());
}

TEST(LinearFp8, SharedInputEqualsSeparateLinears) {
  // q/k/v-style: one cast of x for three weights (one with a bias) equals three linear_fp8 calls
  // whose input scale is the same (unseeded: each from x's own amax), outputs and gradients bit for bit.
  const int64_t T = 40, K = 32;
  Tensor x = randn({T, K}), dy[3] = {randn({T, 32}), randn({T, 16}), randn({T, 16})};
  Tensor ws[3] = {randn({32, K}, DType::F32, Device::cpu(), 0.1), randn({16, K}, DType::F32, Device::cpu(), 0.1),
                  randn({16, K}, DType::F32, Device::cpu(), 0.1)};
  Tensor b = randn({16});
  auto leaves = [&] {
    std::vector<Tensor> l = {x.clone().set_requires_grad(true)};
    for (const Tensor& w : ws) l.push_back(w.clone().set_requires_grad(true));
    l.push_back(b.clone().set_requires_grad(true));
    return l;
  };
  Fp8State s1(3, Fp8Recipe{}, Device::cpu()), s2(3, Fp8Recipe{}, Device::cpu());
  std::vector<Tensor> a = leaves(), c = leaves();
  std::vector<Tensor> ya = linear_fp8(a[0], {a[1], a[2], a[3]}, {Tensor(), a[4], Tensor()}, s1, {0, 1, 2});
  autograd::backward(ya, {dy[0], dy[1], dy[2]});  // consumes the tape: one run at a time
  std::vector<Tensor> yc = {linear_fp8(c[0], c[1], Tensor(), s2, 0), linear_fp8(c[0], c[2], c[4], s2, 1),
                            linear_fp8(c[0], c[3], Tensor(), s2, 2)};
  autograd::backward(yc, {dy[0], dy[1], dy[2]});
  for (int i = 0; i < 3; ++i) EXPECT_EQ(max_abs_diff(ya[i], yc[i]), 0.0) << i;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(max_abs_diff(a[i].grad(), c[i].grad()), 0.0) << "leaf " << i;
  // One input cast: only linear 0's input row saw x; every weight and gradient row is recorded.
  const std::vector<float> m1 = s1.amax().to_float_vector(), m2 = s2.amax().to_float_vector();
  EXPECT_EQ(m1[0], m2[0]);
  EXPECT_EQ(m1[1], 0.0f);
  EXPECT_EQ(m1[2], 0.0f);
  for (int r = 3; r < 9; ++r) EXPECT_EQ(m1[r], m2[r]) << r;
  expect_has(error_of([&] { linear_fp8(x, {ws[0], ws[1]}, {}, s1, {0}); }), {"one index per weight"});
}

TEST(LinearFp8, RepeatedForwardRecordsTheAmaxOnce) {
  // A recompute region runs the forward again in backward: the step's amax is a max, not a sum.
  Fp8State st(1, Fp8Recipe{}, Device::cpu());
  Tensor x = randn({16, 32}), w = randn({16, 32});
  linear_fp8(x, w, Tensor(), st, 0);
  const std::vector<float> once = st.amax().to_float_vector();
  linear_fp8(x, w, Tensor(), st, 0);
  EXPECT_EQ(st.amax().to_float_vector(), once);
  // A second micro-batch with a larger input raises it.
  linear_fp8(kestrel::scale(x, 2.0), w, Tensor(), st, 0);
  EXPECT_EQ(st.amax().to_float_vector()[0], 2.0f * once[0]);
}

TEST(LinearFp8, ZeroInputGivesZeroOutputAndKeepsScales) {
  Fp8State st(1, Fp8Recipe{}, Device::cpu());
  Tensor x = Tensor::zeros({16, 32}), w = randn({16, 32});
  Tensor y = linear_fp8(x, w, Tensor(), st, 0);
  EXPECT_EQ(max_abs_diff(y, Tensor::zeros({16, 16})), 0.0);
  st.roll();
  EXPECT_EQ(st.scale().to_float_vector()[0], 1.0f);  // zero amax: the input's scale stays 1
  y = linear_fp8(x, w, Tensor(), st, 0);
  EXPECT_TRUE(all_finite(y));
}

TEST(LinearFp8, BiasAndLeadingDimsFollowTheLinear) {
  Fp8State st(1, Fp8Recipe{}, Device::cpu());
  Tensor x = randn({2, 8, 32}), w = randn({16, 32}, DType::F32, Device::cpu(), 0.1), b = randn({16});
  Tensor y = linear_fp8(x, w, b, st, 0);
  ASSERT_EQ(y.shape(), (Shape{2, 8, 16}));
  Fp8State st2(1, Fp8Recipe{}, Device::cpu());
  Tensor y0 = linear_fp8(x, w, Tensor(), st2, 0);
  std::vector<float> yv = y.to_float_vector(), y0v = y0.to_float_vector(), bv = b.to_float_vector();
  for (size_t i = 0; i < yv.size(); ++i) EXPECT_EQ(yv[i], y0v[i] + bv[i % 16]);
  // The bias gradient is the column sum of dy.
  Tensor bl = b.clone().set_requires_grad(true);
  Tensor dy = randn({2, 8, 16});
  autograd::backward({linear_fp8(x, w, bl, st, 0)}, {dy});
  EXPECT_LT(rel_l2(bl.grad(), sum(reshape(dy, {16, 16}), {0})), 1e-6);
}

TEST(LinearFp8, RefusesShapesCublasLtCannotTake) {
  Fp8State st(1, Fp8Recipe{}, Device::cpu());
  expect_has(error_of([&] { linear_fp8(randn({16, 24}), randn({16, 24}), Tensor(), st, 0); }), {"multiples of 16"});
  expect_has(error_of([&] { linear_fp8(randn({16, 32}), randn({40, 32}), Tensor(), st, 0); }), {"multiples of 16"});
  expect_has(error_of([&] { linear_fp8(randn({16, 32}), randn({16, 32}, DType::F64), Tensor(), st, 0); }), {"bf16"});
  expect_has(error_of([&] { linear_fp8(randn({16, 32}), randn({16, 32}), Tensor(), st, 1); }), {"out of range"});
  Fp8CastResult a = fp8_cast(randn({16, 32}), Tensor::full({1}, 1.0, DType::F32), Fp8Format::E5M2, true, false);
  expect_has(error_of([&] { fp8_gemm(a.plain, a.plain, DType::BF16, false); }), {"both be e5m2"});
  Fp8CastResult odd = fp8_cast(randn({16, 24}), Tensor::full({1}, 1.0, DType::F32), Fp8Format::E4M3, true, false);
  expect_has(error_of([&] { fp8_gemm(odd.plain, odd.plain, DType::BF16, false); }), {"multiples of 16"});
}

// Sets a state's running amax (as a step's casts would).
void put_amax(Fp8State& s, const std::vector<float>& v) {
  Tensor a = s.amax();
  a.copy_(Tensor::from_vector(v, {static_cast<int64_t>(v.size())}));
}

TEST(LinearFp8, NotObservingCastsWithTheScalesButLeavesTheAmax) {
  // Evaluation and sampling forwards run with observing off: the same outputs and gradients as an
  // observing call with the same scales, and the running amax (so the next roll) stays as it was.
  for (bool seeded : {false, true}) {
    Fp8State on(2, Fp8Recipe{}, Device::cpu()), off(2, Fp8Recipe{}, Device::cpu());
    if (seeded) {
      for (Fp8State* s : {&on, &off}) {
        put_amax(*s, {1.5f, 2.0f, 0.25f, 0.5f, 1e-3f, 2e-3f});
        s->roll();
      }
    }
    Tensor x = randn({20, 32}, DType::F32, Device::cpu(), 2.0), w = randn({16, 32}, DType::F32, Device::cpu(), 0.1),
           dy = randn({20, 16}, DType::F32, Device::cpu(), 1e-2);
    const std::vector<Tensor> want = run_linear(x, w, dy, on, 1);
    EXPECT_TRUE(off.observing());
    {
      Fp8ObserveOff guard(&off);
      EXPECT_FALSE(off.observing());
      const std::vector<Tensor> got = run_linear(x, w, dy, off, 1);
      for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(max_abs_diff(got[i], want[i]), 0.0) << i;
      for (float a : off.amax().to_float_vector()) EXPECT_EQ(a, 0.0f);
    }
    EXPECT_TRUE(off.observing());  // the guard restores it
    EXPECT_GT(on.amax().to_float_vector()[1], 0.0f);
    Fp8ObserveOff none(nullptr);  // no state: nothing to do
  }
}

TEST(Fp8Scaling, DiscardDropsTheStepsAmaxAndLoadRestoresAState) {
  Fp8Recipe recipe;
  recipe.amax_history = 2;
  Fp8State st(1, recipe, Device::cpu());
  put_amax(st, {2.0f, 4.0f, 8.0f});
  st.roll();
  const std::vector<float> h = st.history().to_float_vector(), s = st.scale().to_float_vector();
  // A skipped step: its amax goes, the histories, scales and roll count stay.
  put_amax(st, {100.0f, 100.0f, 100.0f});
  st.discard();
  for (float a : st.amax().to_float_vector()) EXPECT_EQ(a, 0.0f);
  EXPECT_EQ(st.history().to_float_vector(), h);
  EXPECT_EQ(st.scale().to_float_vector(), s);
  EXPECT_EQ(st.rolls(), 1);
  // load: another state takes this one's tensors and roll count, and rolls on the same way.
  Fp8State copy(1, recipe, Device::cpu());
  put_amax(copy, {9.0f, 9.0f, 9.0f});
  copy.load(st.history().clone(), st.scale().clone(), st.rolls());
  EXPECT_TRUE(copy.seeded());
  EXPECT_EQ(copy.rolls(), 1);
  for (float a : copy.amax().to_float_vector()) EXPECT_EQ(a, 0.0f);
  for (Fp8State* x : {&st, &copy}) {
    put_amax(*x, {1.0f, 16.0f, 0.5f});
    x->roll();
  }
  EXPECT_EQ(copy.history().to_float_vector(), st.history().to_float_vector());
  EXPECT_EQ(copy.scale().to_float_vector(), st.scale().to_float_vector());
  EXPECT_EQ(copy.scale().to_float_vector()[1], 448.0f / 16.0f);
  // A state of another shape (linears or history length) is refused, naming what it expects.
  Fp8State two(2, recipe, Device::cpu());
  expect_has(error_of([&] { two.load(st.history(), st.scale(), 1); }), {"amax history", "2 linears"});
  recipe.amax_history = 4;
  Fp8State longer(1, recipe, Device::cpu());
  expect_has(error_of([&] { longer.load(st.history(), st.scale(), 1); }), {"history 4"});
  expect_has(error_of([&] { copy.load(st.history(), st.scale(), -1); }), {"roll count"});
}

}  // namespace
}  // namespace kestrel::testing
