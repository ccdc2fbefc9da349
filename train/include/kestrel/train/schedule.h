// Learning-rate schedule: linear warmup to `lr`, then cosine decay to `min_lr` at `total_steps`.
#pragma once

#include <cstdint>

namespace kestrel::train {

struct LrSchedule {
  double lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  // Learning rate for 1-based step `step`.
  double at(int64_t step) const;
};

}  // namespace kestrel::train
