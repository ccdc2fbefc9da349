// The Workspace-tag sizes of the CUDA kernels, for the memory planner (memory_plan.cpp). Each
// function mirrors the host code that sizes the buffer, so the planner needs no CUDA build:
//   - the CUDA context's cuBLASLt workspace (runtime/cuda/context.cpp: 32 MiB, live for the process);
//   - the fused linear + cross-entropy workspace (ops/cuda/cross_entropy.cu bound 1 GiB and the
//     chunk picker + layout of ops/cuda/fused_linear_cross_entropy.cu);
//   - the flash attention backward workspace (ops/cuda/flash_attention_bwd_launch.cu: f32 dq
//     accumulator + two f32 rows per (token, head));
//   - the norm backward's f32 partial column sums (ops/cuda/norm.cu: [min(rows, 528), C] per
//     weight or bias).
// When one of those files changes how it sizes its buffer, change the matching function here; the
// GPU plan-vs-profile test (tests/train/cuda/test_memory_profile_cuda.cpp) says so.
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
