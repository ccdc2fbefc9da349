// Random tensors from the counter-based Philox stream (see philox.h). A Generator is a seed and
// an offset; each draw advances the offset, so the same seed reproduces the same tensors on CPU and
// GPU in the same order.
#pragma once

#include <cstdint>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

class Generator {
 public:
  explicit Generator(uint64_t seed = 0x5eed) : seed_(seed) {}
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) { seed_ = seed; offset_ = offset; }
  // Reserves blocks for n words and returns the starting block.
  uint64_t advance(uint64_t n_words) {
    uint64_t start = offset_;
    offset_ += (n_words + 3) / 4;
    return start;
  }

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;
};

Generator& default_generator();

// Fills in logical (row-major) order. Uniform in [lo, hi); normal N(mean, std^2).
Tensor uniform(const Shape& shape, double lo, double hi, DType dtype = DType::F32, Device device = Device::cpu(),
               Generator& gen = default_generator());
Tensor normal(const Shape& shape, double mean, double std, DType dtype = DType::F32, Device device = Device::cpu(),
              Generator& gen = default_generator());
// Uniform integers in [0, n).
Tensor randint(const Shape& shape, int64_t n, DType dtype = DType::I64, Device device = Device::cpu(),
               Generator& gen = default_generator());

}  // namespace kestrel
