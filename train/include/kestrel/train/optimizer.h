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
//
// The compact modes (issue 21: a 9B model inside 24 GiB):
// - master_weights None: bf16/f16 parameters are updated in place, the f32 arithmetic on their
//   widened values rounded back stochastically (Philox, a per-step, per-parameter seed), so no f32
//   master exists (device state only; the host offload keeps its f32 master, which costs no device
//   memory). Bytes per parameter: 2 (weights) + moments.
// - state_dtype U8 ("q8"): the moments as 8-bit block-wise codes (kestrel/ops/adamw_q8.h), 2 bytes +
//   0.4% per parameter instead of 8, on the device or on the host, requantised stochastically.
// - step_in_backward: each parameter is updated from a grad-ready hook as soon as its gradient is
//   complete, and the gradient is dropped at once, so no full set of gradients ever exists. This
//   rules out accumulating gradients across micro-batches and global-norm clipping (both need every
//   gradient before any update) and skipping a step on a non-finite gradient norm; the trainer
//   refuses such configs naming the keys. Usage: begin_step(lr); backward(...); end_step().
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kestrel/models/parameters.h"
#include "kestrel/ops/optim.h"

namespace kestrel::train {

enum class OptimizerOffload { None, Host };
// "none" | "host"; anything else is an error naming the valid values.
OptimizerOffload parse_optimizer_offload(const std::string& s);
// optimizer.state_dtype: "f32" | "bf16" | "q8" (DType::U8 stands for the 8-bit block-wise codes);
// anything else is an error naming the valid values.
DType parse_optimizer_state_dtype(const std::string& s);
const char* optimizer_state_dtype_name(DType d);
const char* optimizer_offload_name(OptimizerOffload o);

enum class MasterWeights { F32, None };
// optimizer.master_weights: "f32" | "none".
MasterWeights parse_master_weights(const std::string& s);
const char* master_weights_name(MasterWeights w);

// Bytes per parameter of the optimizer's state under a placement, split by where it lives, for a
// parameter stored as `param_dtype` (the planner and the error messages use this one rule).
struct OptimizerStateBytes {
  double device = 0, host = 0;  // per parameter
};

struct OptimizerPlacement {
  OptimizerOffload offload = OptimizerOffload::None;
  // The moments' storage (host offload only): f32 (exact) or bf16 (8 instead of 12 bytes per parameter
  // on the host; the update is the same f32 arithmetic on the stored moments, each rounded once: not
  // bit-identical to f32 AdamW). The f32 master stays f32.
  DType state_dtype = DType::F32;
  // Host offload: bytes of one pinned staging slot (per direction) and the number of slots in the ring.
  int64_t staging_slot_bytes = int64_t{64} << 20;
  int staging_slots = 4;
  // optimizer.master_weights: F32 keeps an f32 master for 16-bit parameters; None updates them in
  // place with stochastic rounding (device state only).
  MasterWeights master_weights = MasterWeights::F32;
  // optimizer.step_in_backward: update each parameter from its grad-ready hook (see the top).
  bool step_in_backward = false;
  // Seeds the Philox streams of stochastic rounding (parameters without a master, q8 moments).
  uint64_t seed = 0x6b657374726c;
};

// The placement a trainer config asks for (its "optimizer" section, train.seed), checked against
// the rest of the config: step_in_backward with train.grad_accum > 1, train.grad_clip > 0 or
// train.nonfinite "skip", and master_weights "none" with the host offload of a CUDA run, are refused
// with a message naming the keys. The trainer and the planner both read the config through this.
OptimizerPlacement optimizer_placement_from_config(const nlohmann::json& cfg, Device device);

OptimizerStateBytes optimizer_state_bytes_per_param(const OptimizerPlacement& placement, DType param_dtype,
                                                    bool on_cuda);

// Per-parameter settings (issue 24, train/src/param_groups.h): the parameter's weight decay and its
// learning rate as a multiple of the step's.
struct ParameterGroup {
  double weight_decay = 0.0;
  double lr_scale = 1.0;
};
// Gives each trainable parameter its group; none: every parameter takes AdamWOptions::weight_decay, scale 1.
using ParameterGroupFn = std::function<ParameterGroup(const std::string& name, const Tensor& param)>;

// What one offloaded step did (all zero for offload None).
struct OptimizerStepStats {
  double host_ms = 0;        // wall time of the step on the host
  double update_ms = 0;      // time in the CPU update itself
  double copy_wait_ms = 0;   // host time waiting for gradient chunks to arrive
  double fence_wait_ms = 0;  // step_async: the caller's time in wait_parameter (the next forward blocked)
  int64_t d2h_bytes = 0, h2d_bytes = 0;
};

class AdamW {
 public:
  // Parameters that do not require grad (frozen: train.trainable) get no slot: no state, no update.
  AdamW(const models::ParameterList& params, AdamWOptions options, OptimizerPlacement placement = {},
        const ParameterGroupFn& groups = {});
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One step with learning rate `lr` on every parameter that has a gradient.
  // Refused with step_in_backward (use begin_step / end_step around the backward).
  // `grad_scale`: undefined, or grad_clip_factor_device's factor ([] f64 on the parameters' device),
  // applied to each gradient inside the update (adamw_step's grad_scale): the step equals clipping
  // the gradients in place first, bit for bit, one pass over them fewer. Only where
  // applies_grad_scale() (on-device f32 moments); otherwise refused.
  void step(double lr, const Tensor& grad_scale = Tensor());
  bool applies_grad_scale() const;
  // step_in_backward: opens a step (its number and learning rate) before the backward whose hooks
  // update the parameters; end_step closes it after the backward. Parameters whose gradient never
  // became ready in that backward are not updated (as step() skips parameters without a gradient).
  // grad_norm() is the L2 norm of the gradients the step saw (a [] f32 tensor on the device).
  void begin_step(double lr);
  void end_step();
  // The offloaded update without waiting for it (host offload; otherwise the same as step()): the
  // step's gradients are taken now, and the host update runs on a worker thread in parameter order
  // while the caller goes on, typically into the next forward. Before a parameter is read,
  // wait_parameter() blocks until its update has left the host and orders the compute stream after
  // its copy to the device; finish_step() waits for all of it (and rethrows the worker's error).
  // step(), step_async(), begin_step() and load_state() finish a pending step first; state() refuses
  // to run while one is pending. The gradients handed over must stay valid until finish_step():
  // host-resident ones (optimizer.gradients "host"), whose buffers the caller does not refill before.
  void step_async(double lr);
  void wait_parameter(const Tensor* param);
  void finish_step();
  bool step_pending() const { return async_ != nullptr; }
  // Parameters updated by the pending step that no wait_parameter() call has covered (a model that
  // reads one of them in its forward without waiting would race with the update).
  std::vector<std::string> unwaited_parameters() const;
  Tensor grad_norm() const { return grad_sq_sum_.defined() ? sqrt_of(grad_sq_sum_) : Tensor(); }
  int64_t steps() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  const OptimizerPlacement& placement() const { return placement_; }
  int64_t state_bytes() const;         // wherever the state lives
  int64_t device_state_bytes() const;  // on the parameters' device (0 when offloaded)
  int64_t host_state_bytes() const;    // in host memory (the whole state when offloaded)
  // The last finished step's figures (with step_async: the previous step's until finish_step()).
  const OptimizerStepStats& last_step_stats() const { return stats_; }
  // Device time (ms) the compute stream stood idle in the last offloaded step, from the end of
  // backward to the return of the last parameter chunk; -1 when not measured. Valid after the device
  // synchronised.
  double last_step_gpu_idle_ms() const;

  // State as named tensors ("exp_avg.<name>", "exp_avg_sq.<name>", "master.<name>") for checkpoints.
  // Offloaded state comes back as CPU tensors. "master.<name>" exists for bf16/f16 parameters only.
  std::vector<std::pair<std::string, Tensor>> state() const;
  void load_state(const std::map<std::string, Tensor>& tensors, int64_t step);

  // Host memory the offloaded state of `params` takes (what the constructor checks against the host;
  // trainable parameters only).
  static int64_t host_state_bytes_for(const models::ParameterList& params, DType state_dtype = DType::F32);

  // Private: the offload pipeline (train/src/host_staging.h).
  class Staging;

 private:
  struct Slot {
    std::string name;
    Tensor* param;
    Tensor master;  // f32 copy when the parameter is not f32 (always, on the host, when offloaded)
    Tensor m, v;  // f32, or bf16 (OptimizerPlacement::state_dtype) when offloaded; undefined for q8
    Q8Moments q8;  // state_dtype U8: the 8-bit codes and block scales
    ParameterGroup group;  // weight decay and lr multiplier
  };
  struct OffloadWork;  // the chunks of one offloaded update (optimizer.cpp)
  struct AsyncStep;    // step_async's worker and per-parameter readiness
  void step_offloaded(double lr);
  void update_slot(size_t k, const Tensor& grad, const AdamWOptions& o,
                   const Tensor& grad_scale = Tensor());  // on the device
  void update_slots_offloaded(const std::vector<size_t>& slots, const AdamWOptions& o);  // o: the step's
  std::unique_ptr<OffloadWork> plan_offloaded(const std::vector<size_t>& slots, const AdamWOptions& o) const;
  // Runs `w` through the staging; after_slot(k) once slot k's last chunk is on its way to the device.
  void run_offloaded(const OffloadWork& w, const std::function<void(size_t)>& after_slot, OptimizerStepStats& st);
  AdamWOptions slot_options(size_t k, const AdamWOptions& step) const;  // the step's options with the slot's group
  uint64_t stream_seed(size_t slot, uint64_t salt) const;
  static Tensor sqrt_of(const Tensor& t);

  std::vector<Slot> slots_;
  AdamWOptions options_;
  OptimizerPlacement placement_;
  int64_t step_ = 0;
  bool in_step_ = false;  // step_in_backward: between begin_step and end_step
  double lr_ = 0;
  Tensor grad_sq_sum_;    // step_in_backward: sum of the gradients' squares seen by the step
  // The grad-ready hooks outlive this object on the parameters: they hold a weak reference to this
  // token and do nothing once it is gone.
  std::shared_ptr<int> alive_ = std::make_shared<int>(0);
  std::unique_ptr<Staging> staging_;
  OptimizerStepStats stats_;
  std::map<const Tensor*, size_t> slot_of_;  // parameter -> slot
  std::unique_ptr<AsyncStep> async_;        // the pending step_async, if any
};

}  // namespace kestrel::train
