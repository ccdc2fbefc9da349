// AdamW over a ParameterList with mixed precision: when a parameter is stored in bf16/f16, the
// optimizer keeps an f32 master copy and writes the rounded result back after each step; the
// moments are f32. All state is tagged OptimizerState and lives on the parameters' device.
// (Offloading the state to the pinned host pool is the next step of the design.)
#pragma once

#include <map>
#include <string>
#include <vector>

#include "kestrel/models/parameters.h"
#include "kestrel/ops/optim.h"

namespace kestrel::train {

class AdamW {
 public:
  AdamW(const models::ParameterList& params, AdamWOptions options);

  // One step with learning rate `lr` on every parameter that has a gradient.
  void step(double lr);
  int64_t steps() const { return step_; }
  const AdamWOptions& options() const { return options_; }
  int64_t state_bytes() const;

  // State as named tensors ("exp_avg.<name>", "exp_avg_sq.<name>", "master.<name>") for checkpoints.
  std::vector<std::pair<std::string, Tensor>> state() const;
  void load_state(const std::map<std::string, Tensor>& tensors, int64_t step);

 private:
  struct Slot {
    std::string name;
    Tensor* param;
    Tensor master;  // f32 copy when the parameter is not f32
    Tensor m, v;
  };
  std::vector<Slot> slots_;
  AdamWOptions options_;
  int64_t step_ = 0;
};

}  // namespace kestrel::train
