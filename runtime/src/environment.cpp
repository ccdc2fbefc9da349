// The one place Kestrel reads the environment: its KESTREL_* tunables (memory_config.h lists them),
// parsed once, at first use, into the defaults that configure_memory, the trainer's config keys and
// the CPU pool start from; and the launcher's conventions (torchrun / Slurm: rendezvous.h), read at
// start-up, and the environment a launcher hands its children (local_launch.h). Nothing else calls
// getenv, so no hot path does.
// A malformed value is an error naming the variable ("KESTREL_PINNED_LIMIT: ..."), never ignored.
#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>  // environ

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/local_launch.h"
#include "kestrel/runtime/memory_config.h"
#include "kestrel/runtime/parse_number.h"
#include "kestrel/runtime/rendezvous.h"

namespace kestrel {

MemoryConfig memory_config_from_environment(const std::function<const char*(const char*)>& getenv) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  MemoryConfig c;
  if (const char* v = getenv("KESTREL_MEMORY_BUDGET"); v && *v)
    c.budget = parse_size(v, "KESTREL_MEMORY_BUDGET", 0, kMax, "memory");
  if (const char* v = getenv("KESTREL_PINNED_LIMIT"); v && *v)
    c.pinned_limit = parse_size(v, "KESTREL_PINNED_LIMIT", 1, kMax, "memory");
  if (const char* v = getenv("KESTREL_OFFLOAD_INFLIGHT_MB"); v && *v)
    c.offload_inflight = parse_integer(v, "KESTREL_OFFLOAD_INFLIGHT_MB", 1, int64_t{1} << 30, "memory") << 20;
  if (const char* v = getenv("KESTREL_CUDA_ALLOCATOR"); v && *v)
    c.allocator = parse_allocator_backend(v, "KESTREL_CUDA_ALLOCATOR");
  if (const char* v = getenv("KESTREL_MATMUL_TF32"); v && *v)
    c.matmul_tf32 = parse_integer(v, "KESTREL_MATMUL_TF32 (0 or 1)", 0, 1, "memory") == 1;
  return c;
}

int cpu_threads_from_environment(const std::function<const char*(const char*)>& getenv) {
  if (const char* v = getenv("KESTREL_NUM_THREADS"); v && *v)
    return static_cast<int>(parse_integer(v, "KESTREL_NUM_THREADS", 1, 4096, "parallel"));
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

const MemoryConfig& default_memory_config() {
  static const MemoryConfig c = memory_config_from_environment([](const char* name) { return std::getenv(name); });
  return c;
}

int default_cpu_threads() {
  static const int n = cpu_threads_from_environment([](const char* name) { return std::getenv(name); });
  return n;
}

std::vector<std::string> process_environment() {
  std::vector<std::string> out;
  for (char** e = environ; e && *e; ++e) out.emplace_back(*e);
  return out;
}

LaunchEnv launch_env_from_process() {
  std::map<std::string, std::string> vars;
  for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                           "SLURM_NTASKS", "SLURM_LOCALID"})
    if (const char* v = std::getenv(name)) vars[name] = v;
  return parse_launch_env(vars);
}

}  // namespace kestrel
