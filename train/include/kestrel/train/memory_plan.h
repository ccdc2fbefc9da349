// Memory planning: predict the peak bytes per tag of a training configuration without running it.
//
// The planner replays, block by block, the allocations our code makes for one optimizer step:
// parameters, AdamW state (f32 moments, f32 masters for bf16/f16 parameters), the batch, each
// op's outputs and what its tape entry saves (read from ops/src/*: e.g. a linear saves its input,
// attention saves q, k, v, out and the f32 log-sum-exp, a norm saves its input and f32 row
// statistics), the transients freed within a module, the recompute policy (a region keeps only its
// input; its backward re-runs it under the Activation tag), the kernels' scratch (Workspace: on
// the CPU the cross-entropy chunks; on CUDA the context's 32 MiB cuBLASLt workspace, the fused
// cross-entropy workspace with its f32 d_weight, the flash attention backward and norm backward
// buffers, sized as ops/cuda sizes them: src/memory_plan_workspace.h), and the backward walk
// (input gradients, out-of-place accumulation of non-leaf gradients, parameter gradients that live
// until the optimizer's zero_grad; the image branch before the token embedding), and the batch as
// the prefetcher holds it (CUDA: device copies tagged Activation, two with prefetch on; CPU: views
// of host memory, not counted). The result is the peak per tag and the peak of the sum (bytes
// in use), which a profile measures exactly.
// Offload regions (CUDA): each region input leaves the device once its copy to pinned memory lands
// (the offloader's in-flight rule), and comes back one region ahead in backward (tag Checkpoint).
// The decoder MLP runs untiled or over token tiles (mlp_tile_tokens; kestrel/ops/mlp.h).
// Not modelled: allocator rounding (512 B) and caching (reserved > in use on CUDA), External
// (context and library memory: pass `external_bytes`; the default is the H200 / CUDA 13 figure),
// and allocations smaller than one row of the batch.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kestrel/runtime/memory.h"

namespace kestrel::train {

struct MemoryPlan {
  std::array<int64_t, kNumMemoryTags> tag_peak{};  // peak of each tag
  int64_t peak = 0;           // peak bytes in use (all tags, External excluded)
  std::string peak_where;     // the step of the replay where it happens
  int64_t external = 0;       // assumed External bytes (CUDA context etc.)
  int64_t budget = 0;         // 0 = none
  bool fits = true;           // peak + external <= budget
  int64_t headroom = 0;       // budget - (peak + external)
  int64_t tokens = 0;         // tokens in the largest micro-batch planned
  int64_t parameters = 0;     // parameter count
  int64_t trainable_parameters = 0;  // train.trainable: the ones with gradients and optimizer state
  int64_t mlp_tile_tokens = 0;  // the decoder MLP's token tile planned (0: untiled)
  int64_t world_size = 1;       // data-parallel ranks (the figures are one rank's, i.e. per GPU)
  int zero = 0;                 // distributed.zero planned (0 at world size 1)
  std::string precision, recompute, device;  // recompute as the config names it, "(auto)" when chosen
  // What one decoder layer keeps for its backward, per token: everything its ops save (none), its
  // input (full), its input + attention output + lse (selective); on the host when offloaded.
  int64_t layer_bytes_per_token = 0;
  // offload regions: region inputs held in pinned host memory at the end of the forward
  int64_t host_activations = 0;
  // optimizer.gradients "host": the pinned copies of the parameter gradients
  int64_t host_gradients = 0;
  // optimizer.offload "host": what the host holds instead (bytes); the device budget excludes it.
  std::string optimizer_offload = "none";
  int64_t host_optimizer_state = 0;  // f32 master + exp_avg + exp_avg_sq
  int64_t host_pinned = 0;           // the staging ring
  // The optimizer's storage (optimizer.master_weights / state_dtype / step_in_backward) and the
  // bytes per parameter it implies: weights, gradients at their peak (0 with step_in_backward: only
  // one layer's exist at a time, which the replay counts), state on the device and on the host.
  std::string master_weights = "f32", state_dtype = "f32";
  bool step_in_backward = false;
  double bytes_per_param_weights = 0, bytes_per_param_grads = 0, bytes_per_param_device_state = 0,
         bytes_per_param_host_state = 0;
  nlohmann::json to_json() const;
  std::string table() const;  // a terminal table per tag
};

struct PlanOptions {
  int64_t steps = 0;           // micro-batches to size the token count from (0 = train.steps, at most 64)
  int64_t external_bytes = -1; // -1: 0 on the CPU, 560 MiB on CUDA (measured 530 MiB on an H200)
  // Data parallelism: the plan is one rank's of `world_size` (kestrel-mem plan --world-size): its
  // batch_size / W rows of each micro-batch, the buckets' flat gradient copies, and with
  // distributed.zero the optimizer state (1, 2) and the kept gradients (2) divided by W.
  int64_t world_size = 1;
};

// `config` is a resolved trainer config (resolve_train_config); the device, precision, recompute
// policy and budget are read as the Trainer reads them (RunConfig::resolve, run_config.h).
MemoryPlan plan_memory(const nlohmann::json& config, const PlanOptions& options = {});

// The decoder MLP's token tile for this run: mlp_tile_tokens when it is a number; for "auto", 0
// (untiled, the fastest) when there is no budget or the untiled plan fits it with 10% to spare (the
// allocator's cache over the bytes in use measured 5% at 256k tokens), else
// the largest of 16384, 8192, 4096, 2048 and 1024 tokens (below the micro-batch's) whose plan fits,
// else 1024.
int64_t choose_mlp_tile_tokens(const nlohmann::json& config, const PlanOptions& options = {});

// recompute "auto" (memory_plan_recompute.cpp): the fastest setting whose plan fits the budget with
// 10% to spare (the MLP tile's margin, for the allocator's cache), trying "none", "selective",
// "recompute" (full) and, on CUDA, "selective+offload" and "offload" in that order: each recomputes
// more in backward or moves more over the host link than the one before. Without a budget, "none";
// when nothing fits, the last one tried (the smallest footprint). An "auto" MLP tile is planned
// untiled while choosing: the recompute setting is chosen first, the tile for what remains.
std::string choose_recompute(const nlohmann::json& config, const PlanOptions& options = {});

// What each recompute setting costs and saves for one run (kestrel-mem plan prints the table).
struct RecomputeCost {
  std::string name;                   // the config value
  int64_t layer_bytes_per_token = 0;  // MemoryPlan::layer_bytes_per_token
  int64_t peak = 0;                   // the plan's peak in use
  int64_t host_activations = 0;       // pinned host bytes of offloaded regions
  int64_t headroom = 0;
  bool fits = true;
  bool recomputes_attention = false;  // backward runs attention's forward again
};
std::vector<RecomputeCost> recompute_costs(const nlohmann::json& config, const PlanOptions& options = {});
std::string recompute_costs_table(const std::vector<RecomputeCost>& costs, int64_t budget);

}  // namespace kestrel::train
