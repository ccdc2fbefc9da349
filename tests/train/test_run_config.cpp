// RunConfig::resolve (run_config.h): the one reading of device / precision / recompute /
// memory_budget that kestrel-train, kestrel-mem, the Trainer and the planner share.
#include <gtest/gtest.h>

#include "kestrel/runtime/error.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/train_config.h"

namespace kestrel {
namespace {
using nlohmann::json;
using train::RunConfig;

json with(std::initializer_list<std::pair<const char*, const char*>> keys) {
  json c = train::default_train_config();
  for (const auto& [k, v] : keys) c[k] = v;
  return c;
}

std::string error_of(const json& c) {
  try {
    RunConfig::resolve(c);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(RunConfig, AutoFollowsTheDevice) {
  const RunConfig a = RunConfig::resolve(with({{"device", "auto"}, {"precision", "auto"}}));
  EXPECT_EQ(a.device, cuda_available() ? Device::cuda(0) : Device::cpu());
  EXPECT_EQ(a.dtype, a.device.is_cuda() ? DType::BF16 : DType::F32);
  EXPECT_EQ(RunConfig::resolve_device(with({{"device", "auto"}})), a.device);
  EXPECT_EQ(RunConfig::resolve(with({{"device", "cpu"}, {"precision", "auto"}})).dtype, DType::F32);
  // An explicit GPU resolves without one (the planner plans for it); "gpu" is cuda:0 as parse_device says.
  for (const char* d : {"cuda", "gpu", "cuda:0"}) {
    const RunConfig g = RunConfig::resolve(with({{"device", d}, {"precision", "auto"}}));
    EXPECT_EQ(g.device, Device::cuda(0)) << d;
    EXPECT_EQ(g.dtype, DType::BF16) << d;
  }
  EXPECT_EQ(RunConfig::resolve(with({{"device", "cuda:1"}})).device, Device::cuda(1));
}

TEST(RunConfig, ExplicitValuesAndTheBudget) {
  const RunConfig r = RunConfig::resolve(
      with({{"device", "cpu"}, {"precision", "bf16"}, {"recompute", "recompute"}, {"memory_budget", "40GiB"}}));
  EXPECT_EQ(r.dtype, DType::BF16);
  EXPECT_EQ(r.recompute, autograd::RecomputePolicy::Keep);
  EXPECT_EQ(r.memory_budget_bytes, int64_t{40} << 30);
  EXPECT_TRUE(r.has_budget());
  EXPECT_FALSE(r.budget_applies());  // enforced on CUDA devices only
  EXPECT_TRUE(RunConfig::resolve(with({{"device", "cuda"}, {"memory_budget", "1GiB"}})).budget_applies());
  const RunConfig none = RunConfig::resolve(with({{"device", "cpu"}}));
  EXPECT_FALSE(none.has_budget());
  EXPECT_EQ(none.memory_budget_bytes, 0);
}

TEST(RunConfig, ErrorsNameTheKey) {
  for (const char* p : {"i32", "fp8", ""}) {
    const std::string m = error_of(with({{"precision", p}}));
    EXPECT_NE(m.find("precision must be auto, f32, bf16 or f16"), std::string::npos) << m;
  }
  EXPECT_NE(error_of(with({{"device", "tpu"}})).find("cannot parse device 'tpu'"), std::string::npos);
  EXPECT_NE(error_of(with({{"recompute", "sometimes"}})).find("recompute"), std::string::npos);
  for (const char* b : {"abc", "-1GiB"}) {
    const std::string m = error_of(with({{"memory_budget", b}}));
    EXPECT_NE(m.find("memory_budget"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace kestrel
