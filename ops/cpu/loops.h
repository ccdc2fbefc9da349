// Private: strided loops for CPU kernels. The callback receives, per innermost row, the element
// offsets of each operand and their innermost strides; rows run in parallel.
#pragma once

#include <array>
#include <cstdint>

#include "kestrel/runtime/parallel.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::cpu {

// All tensors have `shape` (inputs already broadcast with expand_view). fn(offsets, steps, n).
template <size_t N, typename F>
void for_each_row(const Shape& shape, const std::array<const Tensor*, N>& ts, F&& fn) {
  int rank = static_cast<int>(shape.size());
  std::array<int64_t, N> base{}, inner_step{};
  for (size_t k = 0; k < N; ++k) base[k] = ts[k]->offset();
  if (rank == 0) {
    fn(base, inner_step, int64_t{1});
    return;
  }
  int64_t inner = shape[rank - 1];
  if (inner == 0) return;
  for (size_t k = 0; k < N; ++k) inner_step[k] = ts[k]->strides()[rank - 1];
  int64_t rows = numel(shape) / inner;
  parallel_for(0, rows, std::max<int64_t>(1, 32768 / inner), [&](int64_t rb, int64_t re) {
    for (int64_t r = rb; r < re; ++r) {
      std::array<int64_t, N> off = base;
      int64_t rem = r;
      for (int d = rank - 2; d >= 0; --d) {
        int64_t idx = rem % shape[d];
        rem /= shape[d];
        for (size_t k = 0; k < N; ++k) off[k] += idx * ts[k]->strides()[d];
      }
      fn(off, inner_step, inner);
    }
  });
}

}  // namespace kestrel::cpu
