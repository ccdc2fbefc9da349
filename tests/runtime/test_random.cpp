// Philox: known-answer vectors from the Random123 reference, reproducibility, and the moments
// of the uniform and normal streams.
#include <gtest/gtest.h>

#include <cmath>

#include "kestrel/runtime/philox.h"
#include "kestrel/runtime/random.h"

namespace kestrel {
namespace {

TEST(Philox, KnownAnswers) {
  Philox4 r = philox4x32_10(Philox4{{0, 0, 0, 0}}, 0, 0);
  EXPECT_EQ(r.v[0], 0x6627e8d5u);
  EXPECT_EQ(r.v[1], 0xe169c58du);
  EXPECT_EQ(r.v[2], 0xbc57ac4cu);
  EXPECT_EQ(r.v[3], 0x9b00dbd8u);
  Philox4 s = philox4x32_10(Philox4{{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(s.v[0], 0xd16cfe09u);
  EXPECT_EQ(s.v[1], 0x94fdccebu);
  EXPECT_EQ(s.v[2], 0x5001e420u);
  EXPECT_EQ(s.v[3], 0x24126ea1u);
}

TEST(Philox, SameSeedSameStream) {
  Generator a(42), b(42);
  auto x = uniform({1000}, 0, 1, DType::F32, Device::cpu(), a).to_float_vector();
  auto y = uniform({1000}, 0, 1, DType::F32, Device::cpu(), b).to_float_vector();
  EXPECT_EQ(x, y);
  auto z = uniform({1000}, 0, 1, DType::F32, Device::cpu(), a).to_float_vector();
  EXPECT_NE(x, z);  // the offset advanced
}

TEST(Philox, Moments) {
  Generator g(7);
  const int n = 200000;
  auto u = uniform({n}, -1, 3, DType::F32, Device::cpu(), g).to_double_vector();
  auto z = normal({n}, 2.0, 0.5, DType::F32, Device::cpu(), g).to_double_vector();
  double mu = 0, mz = 0, vz = 0, lo = 1e9, hi = -1e9;
  for (double v : u) mu += v, lo = std::min(lo, v), hi = std::max(hi, v);
  for (double v : z) mz += v;
  mu /= n, mz /= n;
  for (double v : z) vz += (v - mz) * (v - mz);
  vz /= n;
  EXPECT_NEAR(mu, 1.0, 0.02);
  EXPECT_GE(lo, -1.0);
  EXPECT_LT(hi, 3.0);
  EXPECT_NEAR(mz, 2.0, 0.01);
  EXPECT_NEAR(std::sqrt(vz), 0.5, 0.01);
  auto r = randint({n}, 10, DType::I64, Device::cpu(), g).to_int_vector();
  std::vector<int> hist(10, 0);
  for (auto v : r) {
    ASSERT_GE(v, 0);
    ASSERT_LT(v, 10);
    hist[v]++;
  }
  for (int c : hist) EXPECT_NEAR(c, n / 10, n / 100);
}

}  // namespace
}  // namespace kestrel
