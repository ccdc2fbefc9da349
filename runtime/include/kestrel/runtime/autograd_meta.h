// The autograd identity a tensor carries. Plain data: the tape (autograd/) gives it meaning.
//
// Tape entries hold these small records rather than the tensors themselves, so recording an op
// does not keep its inputs' data alive; only tensors an op explicitly saves stay alive.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

struct AutogradMeta {
  uint64_t id = 0;             // unique per recorded value (gradient routing key)
  bool requires_grad = false;
  bool is_leaf = true;         // false for outputs of recorded ops
  Tensor grad;                 // accumulated gradient (leaves)
  std::string name;            // parameter name, for hooks, logs and memory reports
  // Called once per backward when this leaf's gradient is final (optimizer-in-backward, all-reduce).
  std::vector<std::function<void(Tensor& param, Tensor& grad)>> grad_ready_hooks;

  static uint64_t next_id();
};

}  // namespace kestrel
