// PackedBatch: the token-level layout of one micro-batch — documents packed back to back into one
// row of `tokens`, with per-token positions (restarting at 0 in each document) and cumulative
// document offsets for attention. A plain [B, T] batch is B equal-length documents.
#pragma once

#include <cstdint>
#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel::models {

struct PackedBatch {
  Tensor positions;   // [T] i64
  Tensor cu_seqlens;  // [docs + 1] i32
  int64_t max_seqlen = 0;
  int64_t tokens() const { return positions.numel(); }

  // Builds the layout from document lengths, on `device`.
  static PackedBatch from_lengths(const std::vector<int64_t>& lengths, Device device);
};

}  // namespace kestrel::models
