// The run's typed settings: device, precision, recompute policy, memory budget and determinism, read
// once from a config that resolve_train_config checked (train_config.h). kestrel-train, kestrel-mem, the
// Trainer and the memory planner all take them from here, so "auto" means one thing everywhere:
//   device "auto"    -> cuda:0 when a CUDA device is available, else the CPU;
//   precision "auto" -> bf16 on CUDA, f32 on the CPU (explicit: f32, bf16 or f16 and their aliases);
//   memory_budget    -> bytes as parse_size reads them ("" = none); it is enforced on CUDA devices
//                       only (the Trainer pushes it into the runtime), reported on the CPU;
//   memory.*         -> the rest of the device's MemoryConfig (kestrel/runtime/memory_config.h);
//                       the defaults are the environment's (KESTREL_*).
// Resolving never touches a device beyond asking whether one exists: an explicit "cuda:N" resolves
// on a machine without a GPU (the planner plans for it); the Trainer checks that it is there.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/autograd/recompute.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/runtime/device.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/runtime/memory_config.h"

namespace kestrel::train {

struct RunConfig {
  Device device = Device::cpu();                                           // "device"
  DType dtype = DType::F32;                                                // "precision"
  // "recompute": "none" (no regions), "recompute" or "full" (each layer a region keeping its input),
  // "offload" or "full+offload" (region inputs in pinned host memory), "selective" and
  // "selective+offload" (decoder layers also keep attention's output and log-sum-exp, so backward never
  // re-runs attention: models::LayerRecompute), or "auto": the planner's choice for the budget
  // (choose_recompute in memory_plan.h: the fastest of none, selective, full, selective+offload,
  // offload that fits). Until the Trainer resolves "auto", recompute_auto is set and the rest is "none".
  autograd::RecomputePolicy recompute = autograd::RecomputePolicy::None;
  bool recompute_selective = false;
  bool recompute_auto = false;
  // The setting's name as the config writes it ("none", "recompute", "selective+offload", ...).
  std::string recompute_name() const;
  std::string memory_budget;          // "memory_budget" as written ("" = none), for messages
  int64_t memory_budget_bytes = 0;    // its value; 0 when none
  // What the Trainer pushes into a CUDA device (configure_memory): the budget above and "memory":
  // pinned_limit, offload_inflight (sizes), allocator ("vmm" | "malloc"), matmul_tf32 (bool).
  MemoryConfig memory;
  // "mlp_tile_tokens": the decoder MLP's token tile (kestrel/ops/mlp.h), 0 = untiled; "auto" leaves
  // the choice to the planner (choose_mlp_tile_tokens in memory_plan.h: untiled unless the budget
  // needs it).
  bool mlp_tile_auto = true;
  int64_t mlp_tile_tokens = 0;
  // "train.deterministic": a bit-reproducible run on the GPU (the models' set_deterministic: the
  // embedding and attention backward sum in a fixed order instead of by atomics). Two runs of one
  // config on one GPU model and build give bitwise-equal losses and parameters, and a resume
  // equals the straight run; the CPU is deterministic either way.
  bool deterministic = false;
  // "train.loss_gradient": "forward" (default) | "backward". Forward: the step's loss head is given the
  // backward's seed up front and computes its gradients in the forward (CrossEntropyOptions::known_grad:
  // on CUDA one pass of three GEMMs; a bf16 lm_head gradient rounded once per token chunk of that pass).
  // Backward: the forward keeps the log-sum-exp and the backward recomputes the logits (four GEMMs).
  bool loss_gradient_forward = true;
  // "fp8": FP8 training of the decoder's linear projections (kestrel/ops/fp8.h), off by default:
  // {"enabled", "scaling" ("delayed": per tensor with an amax history; "tile" is refused, not yet
  // implemented), "amax_history", "margin", "grad_format" ("e5m2" | "e4m3"), "fast_accum_forward",
  // "fused_casts" (the producers write the input casts, Decoder::set_fp8_fused_casts: the same bits)}.
  bool fp8 = false;
  Fp8Recipe fp8_recipe;
  bool fp8_fused_casts = true;
  // "attention.backend": "auto" | "kestrel" | "cudnn" (AttentionBackend, kestrel/ops/attention.h),
  // the decoder's attention implementation; "cudnn" needs a CUDA device, bf16/f16 precision and
  // train.deterministic off (refused here, naming the keys).
  AttentionBackend attention_backend = AttentionBackend::Auto;

  bool on_cuda() const { return device.is_cuda(); }
  bool has_budget() const { return !memory_budget.empty(); }
  // Whether the budget is enforced: one was given and the run is on a CUDA device.
  bool budget_applies() const { return has_budget() && device.is_cuda(); }

  // Reads the keys above; errors name the key and the value.
  static RunConfig resolve(const nlohmann::json& cfg);
  // The device alone, for choosing the on_cpu / on_cuda overrides before the rest is final.
  static Device resolve_device(const nlohmann::json& cfg);
};

}  // namespace kestrel::train
