// MemoryConfig (kestrel/runtime/memory_config.h): the environment's defaults parsed in one place,
// strictly (a malformed variable is an error naming it, never a silent fallback as atoll/atoi
// made it), and the push into a device, which only a CUDA device takes. The CUDA side (the context
// holding the config, the allocator the budget) is tested in tests/runtime/cuda/test_cuda_runtime.cu.
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_config.h"

namespace kestrel {
namespace {

// A fake environment: only the variables in `vars` are set.
struct FakeEnv {
  std::map<std::string, std::string> vars;
  const char* operator()(const char* name) const {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  }
};

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    memory_config_from_environment(FakeEnv{vars});
    cpu_threads_from_environment(FakeEnv{vars});
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(MemoryConfig, DefaultsWithoutTheEnvironment) {
  const MemoryConfig c = memory_config_from_environment(FakeEnv{});
  EXPECT_EQ(c, MemoryConfig{});
  EXPECT_EQ(c.budget, 0);
  EXPECT_EQ(c.pinned_limit, int64_t{64} << 30);
  EXPECT_EQ(c.offload_inflight, int64_t{256} << 20);
  EXPECT_EQ(c.allocator, AllocatorBackend::Vmm);
  EXPECT_FALSE(c.matmul_tf32);
  EXPECT_GE(cpu_threads_from_environment(FakeEnv{}), 1);
}

TEST(MemoryConfig, EveryVariableIsRead) {
  const MemoryConfig c = memory_config_from_environment(FakeEnv{{{"KESTREL_MEMORY_BUDGET", "40GiB"},
                                                                 {"KESTREL_PINNED_LIMIT", "8GiB"},
                                                                 {"KESTREL_OFFLOAD_INFLIGHT_MB", "64"},
                                                                 {"KESTREL_CUDA_ALLOCATOR", "malloc"},
                                                                 {"KESTREL_MATMUL_TF32", "1"}}});
  EXPECT_EQ(c.budget, int64_t{40} << 30);
  EXPECT_EQ(c.pinned_limit, int64_t{8} << 30);
  EXPECT_EQ(c.offload_inflight, int64_t{64} << 20);
  EXPECT_EQ(c.allocator, AllocatorBackend::Malloc);
  EXPECT_TRUE(c.matmul_tf32);
  EXPECT_EQ(cpu_threads_from_environment(FakeEnv{{{"KESTREL_NUM_THREADS", "3"}}}), 3);
  // Empty means unset.
  EXPECT_EQ(memory_config_from_environment(FakeEnv{{{"KESTREL_PINNED_LIMIT", ""}}}).pinned_limit, int64_t{64} << 30);
}

// atoll/atoi used to turn "abc" or "-5" into the default (or 0) without a word.
TEST(MemoryConfig, MalformedVariablesAreRefusedNamingThem) {
  for (const auto& [name, value] : std::map<std::string, std::string>{{"KESTREL_MEMORY_BUDGET", "lots"},
                                                                       {"KESTREL_PINNED_LIMIT", "0"},
                                                                       {"KESTREL_OFFLOAD_INFLIGHT_MB", "-5"},
                                                                       {"KESTREL_CUDA_ALLOCATOR", "cudaMalloc"},
                                                                       {"KESTREL_MATMUL_TF32", "yes"},
                                                                       {"KESTREL_NUM_THREADS", "2.5"}}) {
    const std::string m = error_of({{name, value}});
    EXPECT_NE(m.find(name), std::string::npos) << name << "=" << value << ": " << m;
    EXPECT_NE(m.find(value), std::string::npos) << name << "=" << value << ": " << m;
  }
}

TEST(MemoryConfig, ValidateNamesTheField) {
  MemoryConfig c;
  c.offload_inflight = 0;
  try {
    c.validate("memory");
    ADD_FAILURE() << "offload_inflight 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("memory.offload_inflight"), std::string::npos) << e.what();
  }
  EXPECT_EQ(parse_allocator_backend("vmm", "x"), AllocatorBackend::Vmm);
  EXPECT_EQ(allocator_backend_name(AllocatorBackend::Malloc), "malloc");
}

// The CPU has no budget, pinned pool or offloader: pushing memory settings into it is an error (not
// a number stored where nothing reads it), and it reports no budget.
TEST(MemoryConfig, OnlyCudaDevicesTakeMemorySettings) {
  EXPECT_THROW(configure_memory(Device::cpu(), MemoryConfig{}), Error);
  EXPECT_THROW(set_memory_budget(Device::cpu(), int64_t{1} << 30), Error);
  EXPECT_EQ(memory_budget(Device::cpu()), 0);
  EXPECT_EQ(memory_config(Device::cpu()), default_memory_config());
  if (!cuda_available()) EXPECT_THROW(configure_memory(Device::cuda(0), MemoryConfig{}), Error);
}

}  // namespace
}  // namespace kestrel
