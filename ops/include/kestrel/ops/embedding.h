// Embedding lookup and the row ops that splice image embeddings into a token sequence.
#pragma once

#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// weight [V, C], ids [...] (i32/i64) -> [..., C]. An id outside [0, V) is an error naming the first
// offending position. Backward scatter-adds into d_weight (deterministic on every device when
// `deterministic`; CUDA may otherwise use atomics).
Tensor embedding(const Tensor& weight, const Tensor& ids, bool deterministic = false);

// Rows of x [N, ...] at idx [M] (i32/i64) -> [M, ...]. Backward scatter-adds.
Tensor index_select_rows(const Tensor& x, const Tensor& idx);
// base [N, C] with rows idx [M] replaced by src [M, C] (idx unique). Gradient: to base except at
// idx, to src from those rows. The VLM writes image embeddings at image-token slots with this.
Tensor splice_rows(const Tensor& base, const Tensor& idx, const Tensor& src);

Tensor concat(const std::vector<Tensor>& xs, int64_t dim);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);

}  // namespace kestrel
