// Exhaustive checks of the bf16/f16 conversions against an independent reference rounding
// computed in double: every 16-bit pattern decodes exactly, and every one of the 2^32 float bit
// patterns encodes to the nearest representable value with ties to even (NaN stays NaN).
#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>

#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/parallel.h"

namespace kestrel {
namespace {

// Reference decode: sign * mantissa * 2^exp from the bit fields, in double.
double ref_decode(uint16_t h, int exp_bits, int man_bits) {
  int bias = (1 << (exp_bits - 1)) - 1;
  int e = (h >> man_bits) & ((1 << exp_bits) - 1);
  int m = h & ((1 << man_bits) - 1);
  double sign = (h >> 15) ? -1.0 : 1.0;
  if (e == (1 << exp_bits) - 1) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - man_bits);
  return sign * std::ldexp(m + (1 << man_bits), e - bias - man_bits);
}

// 2^k as a double, from its exponent field (|k| < 1000 here), without a libm call: the exhaustive
// sweeps below evaluate it 2^32 times.
double pow2(int k) { return std::bit_cast<double>(static_cast<uint64_t>(k + 1023) << 52); }

// Reference encode, independent of the bit tricks under test: the format's ulp at x's binade
// (clamped to the subnormal ulp) from the float's exponent field, |x| / ulp rounded to nearest
// even with the 2^52 magic-number trick in double, times ulp; overflow past the top rounding
// boundary (maxv, the format's largest finite value) gives infinity.
double ref_round(float xf, int exp_bits, int man_bits, double maxv) {
  double x = xf;
  if (std::isinf(xf) || x == 0) return x;
  int bias = (1 << (exp_bits - 1)) - 1;
  int e = static_cast<int>((float_bits(xf) >> 23) & 0xff) - 127;  // f32 subnormals: e = -127
  int emin = 1 - bias;
  double ulp = pow2(std::max(e, emin) - man_bits);
  double q = std::fabs(x) / ulp;  // exact: ulp is a power of two
  volatile double t = q + 4503599627370496.0;  // 2^52: rounds q to an integer, ties to even
  double r = (t - 4503599627370496.0) * ulp;
  if (r > maxv) r = INFINITY;
  return std::copysign(r, x);
}

void check_all_floats(uint16_t (*encode)(float), float (*decode)(uint16_t), int exp_bits, int man_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const double maxv = std::ldexp(2.0 - std::ldexp(1.0, -man_bits), (1 << exp_bits) - 2 - bias);
  ASSERT_EQ(pow2(-30), std::ldexp(1.0, -30));
  ASSERT_EQ(pow2(20), std::ldexp(1.0, 20));
  std::atomic<int64_t> bad{0};
  std::atomic<uint64_t> first_bad{0};
  parallel_for(0, int64_t{1} << 32, int64_t{1} << 24, [&](int64_t b, int64_t e) {
    int64_t local = 0;
    for (int64_t i = b; i < e; ++i) {
      float f = bits_float(static_cast<uint32_t>(i));
      uint16_t h = encode(f);
      float back = decode(h);
      bool ok;
      if (std::isnan(f)) {
        ok = std::isnan(back);
      } else {
        double want = ref_round(f, exp_bits, man_bits, maxv);
        ok = static_cast<double>(back) == want && std::signbit(back) == std::signbit(f);
      }
      if (!ok && local++ == 0) first_bad = static_cast<uint64_t>(i);
    }
    bad += local;
  });
  EXPECT_EQ(bad.load(), 0) << "first failing float bits 0x" << std::hex << first_bad.load();
}

TEST(DType, Bf16DecodeAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    double want = ref_decode(static_cast<uint16_t>(h), 8, 7);
    float got = bf16_bits_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(got)) << h;
    else EXPECT_EQ(static_cast<double>(got), want) << h;
  }
}

TEST(DType, F16DecodeAllPatterns) {
  for (uint32_t h = 0; h < 65536; ++h) {
    double want = ref_decode(static_cast<uint16_t>(h), 5, 10);
    float got = f16_bits_to_float(static_cast<uint16_t>(h));
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(got)) << h;
    else EXPECT_EQ(static_cast<double>(got), want) << h;
  }
}

TEST(DType, Bf16EncodeEveryFloat) { check_all_floats(float_to_bf16_bits, bf16_bits_to_float, 8, 7); }
TEST(DType, F16EncodeEveryFloat) { check_all_floats(float_to_f16_bits, f16_bits_to_float, 5, 10); }

TEST(DType, SpecialValues) {
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7c00);  // tie at the top rounds to infinity
  EXPECT_EQ(float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_bf16_bits(-INFINITY), 0xff80);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::BF16);
  EXPECT_THROW(parse_dtype("float8"), Error);
}

}  // namespace
}  // namespace kestrel
