// The Workspace-tag sizes of the CUDA kernels, for the memory planner (memory_plan.cpp), in CPU-only
// builds too:
//   - the CUDA context's cuBLASLt workspace (runtime/cuda/context.cpp: 32 MiB, live for the process);
//   - the fused linear + cross-entropy forward and backward, the flash attention backward and the
//     norm backward: the kernels' own sizing rules (kestrel/ops/workspace_sizes.h), called with the
//     arguments the ops pass, rounded as the caching allocator rounds a block.
// The GPU plan-vs-profile test (tests/train/cuda/test_memory_profile_cuda.cpp) checks the whole plan.
#pragma once

#include <cstdint>

#include "kestrel/runtime/dtype.h"

namespace kestrel::train::plan_detail {

int64_t cuda_context_workspace_bytes();
// The caching allocator's block for a request (rounded to 512 B).
int64_t cuda_block_bytes(int64_t bytes);
// Bytes of the fused linear + cross-entropy workspace: forward (gradients = false) or backward.
int64_t cuda_cross_entropy_workspace_bytes(int64_t tokens, int64_t vocab, DType dtype, bool gradients);
// The backward's workspace (the lse-based pass of ops/cuda/fused_linear_cross_entropy_backward.cu).
int64_t cuda_cross_entropy_backward_workspace_bytes(int64_t tokens, int64_t vocab, int64_t hidden, DType dtype);
int64_t cuda_attention_backward_workspace_bytes(int64_t tokens, int64_t heads, int64_t head_dim);
// `vectors`: 1 for rms_norm (weight), 2 for layer_norm (weight and bias); one block each.
int64_t cuda_norm_backward_workspace_bytes(int64_t rows, int64_t channels, int vectors);

}  // namespace kestrel::train::plan_detail
