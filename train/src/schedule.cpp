#include "kestrel/train/schedule.h"

#include <algorithm>
#include <cmath>

namespace kestrel::train {

double LrSchedule::at(int64_t step) const {
  if (warmup_steps > 0 && step <= warmup_steps) return lr * static_cast<double>(step) / static_cast<double>(warmup_steps);
  int64_t span = std::max<int64_t>(1, total_steps - warmup_steps);
  double progress = std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(span), 0.0, 1.0);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace kestrel::train
