// RunConfig::resolve (run_config.h): the one reading of device / precision / recompute /
// memory_budget that kestrel-train, kestrel-mem, the Trainer and the planner share.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_config.h"
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

// The memory settings: "memory.*" keys whose defaults are the environment's (memory_config.h), typed
// once here and pushed into the device by the Trainer; a malformed value is refused naming its key.
TEST(RunConfig, MemoryKeysDefaultToTheEnvironmentAndAreChecked) {
  const RunConfig d = RunConfig::resolve(train::default_train_config());
  EXPECT_EQ(d.memory, default_memory_config());
  json c = train::resolve_train_config(
      {{"memory_budget", "30GiB"},
       {"memory", {{"pinned_limit", "8GiB"}, {"offload_inflight", "64MiB"}, {"allocator", "malloc"}, {"matmul_tf32", true}}}},
      "test");
  const RunConfig r = RunConfig::resolve(c);
  EXPECT_EQ(r.memory.budget, int64_t{30} << 30);
  EXPECT_EQ(r.memory.pinned_limit, int64_t{8} << 30);
  EXPECT_EQ(r.memory.offload_inflight, int64_t{64} << 20);
  EXPECT_EQ(r.memory.allocator, AllocatorBackend::Malloc);
  EXPECT_TRUE(r.memory.matmul_tf32);
  for (const auto& [key, value] : std::vector<std::pair<std::string, json>>{{"pinned_limit", "lots"},
                                                                            {"pinned_limit", "0"},
                                                                            {"offload_inflight", "-1MiB"},
                                                                            {"allocator", "cudaMalloc"}}) {
    json bad = train::default_train_config();
    bad["memory"][key] = value;
    const std::string m = error_of(bad);
    EXPECT_NE(m.find("memory." + key), std::string::npos) << key << " = " << value << ": " << m;
  }
  // A wrong type is refused by the schema, naming the key.
  try {
    train::resolve_train_config({{"memory", {{"matmul_tf32", "yes"}}}}, "test");
    ADD_FAILURE() << "memory.matmul_tf32 \"yes\" was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory.matmul_tf32"), std::string::npos) << e.what();
  }
}

// attention.backend (issue 23): "auto" | "kestrel" | "cudnn" into RunConfig::attention_backend;
// anything else names the key and the allowed values; "cudnn" is refused where it cannot run (the
// CPU, f32, a deterministic run), naming the keys involved.
TEST(RunConfig, LossGradientKey) {
  EXPECT_TRUE(RunConfig::resolve(train::default_train_config()).loss_gradient_forward);
  json c = train::default_train_config();
  c["train"]["loss_gradient"] = "backward";
  EXPECT_FALSE(RunConfig::resolve(c).loss_gradient_forward);
  c["train"]["loss_gradient"] = "forward";
  EXPECT_TRUE(RunConfig::resolve(c).loss_gradient_forward);
  for (json bad : {json("eager"), json(true)}) {
    c["train"]["loss_gradient"] = bad;
    const std::string e = error_of(c);
    EXPECT_NE(e.find("train.loss_gradient"), std::string::npos) << e;
    EXPECT_NE(e.find(bad.dump()), std::string::npos) << e;
  }
}

TEST(RunConfig, AttentionBackendKey) {
  EXPECT_EQ(RunConfig::resolve(train::default_train_config()).attention_backend, AttentionBackend::Auto);
  auto backend = [](const char* value, const char* device, const char* precision) {
    json c = with({{"device", device}, {"precision", precision}});
    c["attention"]["backend"] = value;
    return c;
  };
  EXPECT_EQ(RunConfig::resolve(backend("kestrel", "cpu", "f32")).attention_backend, AttentionBackend::Kestrel);
  EXPECT_EQ(RunConfig::resolve(backend("auto", "cpu", "f32")).attention_backend, AttentionBackend::Auto);
  EXPECT_EQ(RunConfig::resolve(backend("cudnn", "cuda:0", "bf16")).attention_backend, AttentionBackend::Cudnn);
  EXPECT_EQ(RunConfig::resolve(backend("cudnn", "cuda:0", "f16")).attention_backend, AttentionBackend::Cudnn);
  const std::string bad = error_of(backend("flash", "cpu", "f32"));
  EXPECT_NE(bad.find("attention.backend"), std::string::npos) << bad;
  EXPECT_NE(bad.find("\"auto\", \"kestrel\" or \"cudnn\""), std::string::npos) << bad;
  EXPECT_NE(bad.find("'flash'"), std::string::npos) << bad;
  json num = train::default_train_config();
  num["attention"]["backend"] = 1;
  EXPECT_NE(error_of(num).find("attention.backend"), std::string::npos) << error_of(num);
  const std::string cpu = error_of(backend("cudnn", "cpu", "f32"));
  EXPECT_NE(cpu.find("needs a CUDA device"), std::string::npos) << cpu;
  const std::string f32 = error_of(backend("cudnn", "cuda:0", "f32"));
  EXPECT_NE(f32.find("precision bf16 or f16"), std::string::npos) << f32;
  json det = backend("cudnn", "cuda:0", "bf16");
  det["train"]["deterministic"] = true;
  const std::string d = error_of(det);
  EXPECT_NE(d.find("train.deterministic"), std::string::npos) << d;
  EXPECT_EQ(parse_attention_backend("cudnn"), AttentionBackend::Cudnn);
  EXPECT_STREQ(attention_backend_name(AttentionBackend::Kestrel), "kestrel");
}

}  // namespace
}  // namespace kestrel
