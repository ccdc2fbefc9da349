// Private: the deterministic column reduction ("sum over rows") shared by sum(x, {0}), the norm
// weight/bias gradients and anything else that reduces [rows, C] to [C] on the device.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kestrel/runtime/tensor.h"

namespace kestrel::cuda_ops {

// out[c] = sum over r < rows of x[r * ld + c], c < C (ld >= C, in elements). x and out are f32, bf16
// or f16 (independently); accumulation in f32 in a fixed order (bitwise reproducible for a given
// shape on a given device: no atomics). `device` owns the f32 partials workspace (tag Workspace).
// Enqueued on `stream`; rows == 0 writes zeros.
void column_sum(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t rows, int64_t C, int64_t ld,
                Device device, cudaStream_t stream);

// `count` (<= kMaxColumnSumBatch) such reductions in the same launches: input b is x + b *
// x_batch_stride elements (same rows, C, ld, dtype), its sum goes to outs[b].
constexpr int kMaxColumnSumBatch = 4;
void column_sum_batched(void* const* outs, int count, DType out_dtype, const void* x, int64_t x_batch_stride,
                        DType x_dtype, int64_t rows, int64_t C, int64_t ld, Device device, cudaStream_t stream);

}  // namespace kestrel::cuda_ops
