// OpProfile (kestrel/runtime/op_profile.h) over real ops on the CPU: every dispatch is counted once
// under its op's name, nested brackets belong to the outermost op, the times add up to no more than
// the wall time, nothing is recorded outside start/stop, and only one profile records at a time.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <thread>

#include "kestrel/ops/matmul.h"
#include "kestrel/ops/norm.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/op_profile.h"
#include "support/numerics.h"

namespace kestrel {
namespace {

using testing::randn;

std::map<std::string, OpTime> by_name(const OpProfile& p) {
  std::map<std::string, OpTime> m;
  for (const OpTime& t : p.ops()) m[t.op] = t;
  return m;
}

TEST(OpProfile, CountsEachOpOnceUnderItsNameAndStaysWithinTheWallTime) {
  Tensor a = randn({96, 128}, DType::F32, Device::cpu(), 1.0), b = randn({128, 64}, DType::F32, Device::cpu(), 1.0);
  Tensor w = randn({64}, DType::F32, Device::cpu(), 1.0);
  (void)matmul(a, b);  // before start: not recorded
  OpProfile p;
  const auto t0 = std::chrono::steady_clock::now();
  p.start();
  Tensor c;
  for (int i = 0; i < 3; ++i) c = matmul(a, b);
  Tensor n = rms_norm(c, w, 1e-6);
  p.stop();
  const double wall = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  (void)matmul(a, b);  // after stop: not recorded
  auto m = by_name(p);
  ASSERT_TRUE(m.count("matmul")) << "matmul not recorded";
  ASSERT_TRUE(m.count("rms_norm")) << "rms_norm not recorded";
  EXPECT_EQ(m["matmul"].calls, 3);
  EXPECT_EQ(m["rms_norm"].calls, 1);
  EXPECT_GT(m["matmul"].ms, 0.0);
  EXPECT_LE(p.total_ms(), wall);
  for (size_t i = 1; i < p.ops().size(); ++i) EXPECT_GE(p.ops()[i - 1].ms, p.ops()[i].ms) << "not sorted by time";
}

TEST(OpProfile, NestedBracketsBelongToTheOutermostOp) {
  OpProfile p;
  p.start();
  {
    OpProfile::Bracket outer("outer_op", Device::cpu());
    for (int i = 0; i < 4; ++i) OpProfile::Bracket inner("inner_op", Device::cpu());
  }
  { OpProfile::Bracket again("inner_op", Device::cpu()); }
  p.stop();
  auto m = by_name(p);
  EXPECT_EQ(m["outer_op"].calls, 1);
  EXPECT_EQ(m["inner_op"].calls, 1) << "a bracket inside another op's was recorded";
}

TEST(OpProfile, OnlyTheStartingThreadIsRecorded) {
  OpProfile p;
  p.start();
  std::thread other([] {
    for (int i = 0; i < 3; ++i) OpProfile::Bracket b("other_thread_op", Device::cpu());
  });
  other.join();
  { OpProfile::Bracket mine("own_thread_op", Device::cpu()); }
  p.stop();
  auto m = by_name(p);
  EXPECT_EQ(m.count("other_thread_op"), 0u) << "an op on another thread was recorded";
  EXPECT_EQ(m["own_thread_op"].calls, 1);
}

TEST(OpProfile, OneRecordingProfileAtATime) {
  OpProfile a, b;
  a.start();
  EXPECT_THROW(b.start(), Error);
  EXPECT_EQ(OpProfile::recording(), &a);
  a.stop();
  EXPECT_EQ(OpProfile::recording(), nullptr);
  EXPECT_THROW(a.stop(), Error);
  EXPECT_THROW(a.start(), Error) << "a profile records once";
  b.start();
  {
    OpProfile c;  // destroyed without recording: b keeps recording
  }
  EXPECT_EQ(OpProfile::recording(), &b);
  b.stop();
}

}  // namespace
}  // namespace kestrel
