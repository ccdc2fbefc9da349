// AdamW over a ParameterList with mixed precision: when a parameter is stored in bf16/f16, the
// optimizer keeps an f32 master copy and writes the rounded result back after each step; the
// moments are f32.
//
// Where the state lives (OptimizerPlacement):
// - offload None: master and moments on the parameters' device (tag OptimizerState there).
// - offload Host: master, m and v in host memory (tag OptimizerState in the CPU device's trace), the
//   device keeps only the parameters and their gradients. A step streams the (already clipped)
//   gradients to the host in chunks through a ring of pinned staging slots on the D2H stream, updates
//   each chunk on all CPU threads (host_adamw.h: bit-identical to the device AdamW), and sends the
//   rounded parameters back on the H2D stream; the compute stream waits for the last copy on the
//   device, never the host. Gradient accumulation and clipping keep their meaning (the update runs on
//   the accumulated, clipped gradients, as on the device).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kestrel/models/parameters.h"
#include "kestrel/ops/optim.h"

namespace kestrel::train {

enum class OptimizerOffload { None, Host };
// "none" | "host"; anything else is an error naming the valid values.
OptimizerOffload parse_optimizer_offload(const std::string& s);
// optimizer.state_dtype: "f32" | "bf16"; anything else is an error naming the valid values.
DType parse_optimizer_state_dtype(const std::string& s);
const char* optimizer_offload_name(OptimizerOffload o);

struct OptimizerPlacement {
  OptimizerOffload offload = OptimizerOffload::None;
  // The moments' storage (host offload only): f32 (exact) or bf16 (8 instead of 12 bytes per parameter
  // on the host; the update is the same f32 arithmetic on the stored moments, each rounded once: not
  // bit-identical to f32 AdamW). The f32 master stays f32.
  DType state_dtype = DType::F32;
  // Host offload: bytes of one pinned staging slot (per direction) and the number of slots in the ring.
  int64_t staging_slot_bytes = int64_t{64} << 20;
  int staging_slots = 4;
};

// What one offloaded step did (all zero for offload None).
struct OptimizerStepStats {
  double host_ms = 0;        // wall time of the step on the host
  double update_ms = 0;      // time in the CPU update itself
  double copy_wait_ms = 0;   // host time waiting for gradient chunks to arrive
  int64_t d2h_bytes = 0, h2d_bytes = 0;
};

class AdamW {
 public:
  AdamW(const models::ParameterList& params, AdamWOptions options, OptimizerPlacement placement = {});
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One step with learning rate `lr` on every parameter that has a gradient.
  void step(double lr);
  int64_t steps() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  const OptimizerPlacement& placement() const { return placement_; }
  int64_t state_bytes() const;         // wherever the state lives
  int64_t device_state_bytes() const;  // on the parameters' device (0 when offloaded)
  int64_t host_state_bytes() const;    // in host memory (the whole state when offloaded)
  const OptimizerStepStats& last_step_stats() const { return stats_; }
  // Device time (ms) the compute stream stood idle in the last offloaded step, from the end of
  // backward to the return of the last parameter chunk; -1 when not measured. Valid after the device
  // synchronised.
  double last_step_gpu_idle_ms() const;

  // State as named tensors ("exp_avg.<name>", "exp_avg_sq.<name>", "master.<name>") for checkpoints.
  // Offloaded state comes back as CPU tensors. "master.<name>" exists for bf16/f16 parameters only.
  std::vector<std::pair<std::string, Tensor>> state() const;
  void load_state(const std::map<std::string, Tensor>& tensors, int64_t step);

  // Host memory the offloaded state of `params` takes (what the constructor checks against the host).
  static int64_t host_state_bytes_for(const models::ParameterList& params, DType state_dtype = DType::F32);

  // Private: the offload pipeline (train/src/host_staging.h).
  class Staging;

 private:
  struct Slot {
    std::string name;
    Tensor* param;
    Tensor master;  // f32 copy when the parameter is not f32 (always, on the host, when offloaded)
    Tensor m, v;  // f32, or bf16 (OptimizerPlacement::state_dtype) when offloaded
  };
  void step_offloaded(double lr);

  std::vector<Slot> slots_;
  AdamWOptions options_;
  OptimizerPlacement placement_;
  int64_t step_ = 0;
  std::unique_ptr<Staging> staging_;
  OptimizerStepStats stats_;
};

}  // namespace kestrel::train
