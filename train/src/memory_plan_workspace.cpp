// CUDA workspace sizes for the memory planner. The sizing rules are the kernels' own
// (kestrel/ops/workspace_sizes.h, called by the CUDA launchers too); this file only adds what the
// planner assumes about the call (which gradients, which dtypes), the SM count and the allocator's
// rounding.
#include "memory_plan_workspace.h"

#include <algorithm>

#include "kestrel/ops/workspace_sizes.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train::plan_detail {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
// The SMs of the planned device (H100/H200 SXM). Only the norm backward's bound depends on it.
constexpr int64_t kPlannedSmCount = 132;

}  // namespace

int64_t cuda_context_workspace_bytes() { return 32 * kMiB; }

int64_t cuda_block_bytes(int64_t bytes) { return bytes <= 0 ? 0 : (bytes + 511) / 512 * 512; }

int64_t cuda_cross_entropy_workspace_bytes(int64_t tokens, int64_t vocab, DType dtype, bool gradients) {
  // The op's forward asks for the loss and lse only (gradients = false); with gradients, the one-pass
  // launcher's kept row. The hidden size does not enter the forward's workspace.
  workspace::FusedCrossEntropyShape s;
  s.dtype = dtype;
  s.tokens = tokens;
  s.hidden = 1;
  s.vocab = vocab;
  s.d_hidden = gradients;
  try {
    return cuda_block_bytes(static_cast<int64_t>(workspace::resolved_fused_cross_entropy_layout(s).total));
  } catch (const Error&) {
    return 0;  // no chunking fits the bound: the op would refuse the shape
  }
}

int64_t cuda_cross_entropy_backward_workspace_bytes(int64_t tokens, int64_t vocab, int64_t hidden, DType dtype) {
  // As ops/cuda/cross_entropy.cu calls it: both gradients, d_weight in the weight's dtype.
  workspace::FusedCrossEntropyShape s;
  s.dtype = dtype;
  s.tokens = tokens;
  s.hidden = hidden;
  s.vocab = vocab;
  s.d_hidden = true;
  s.d_weight = true;
  s.d_weight_f32 = dtype == DType::F32;
  return cuda_block_bytes(static_cast<int64_t>(workspace::fused_cross_entropy_backward_layout(s).total));
}

int64_t cuda_attention_backward_workspace_bytes(int64_t tokens, int64_t heads, int64_t head_dim) {
  return cuda_block_bytes(static_cast<int64_t>(workspace::attention_backward_layout(tokens, heads, head_dim).total));
}

// ops/cuda/norm_backward.cu: G partial rows [G, C] f32 per weight-like gradient (rms_norm: dw;
// layer_norm: dw, db), G <= workspace::norm_backward_max_partial_rows, then ops/cuda/column_sum.cu
// reduces them with a [slabs, C] f32 partial (slabs <= G / 32) while they are alive. An upper bound:
// the kernel's residency is a property of its register use, not of the shape.
int64_t cuda_norm_backward_workspace_bytes(int64_t rows, int64_t channels, int vectors) {
  constexpr int64_t kColumnSumRowsPerSlab = 8 * 4;
  const int64_t g = workspace::norm_backward_max_partial_rows(rows, kPlannedSmCount);
  const int64_t slabs = g / kColumnSumRowsPerSlab;
  return vectors * cuda_block_bytes(g * channels * 4) + (slabs > 1 ? cuda_block_bytes(slabs * channels * 4) : 0);
}

}  // namespace kestrel::train::plan_detail
