// Private: attention kernel slots (forward and FA2-style backward), tensor-based so that the CUDA
// adapter over cuda/flash_attention.h can fill the same slots.
//
// The op layer (src/attention.cpp) hands kernels contiguous q/k/v/out/dout, freshly allocated
// contiguous outputs, and cu_seqlens as contiguous i32 [docs + 1] on q's device. Host-side facts the
// CUDA launcher needs (max lengths, the resolved softmax scale) travel in AttentionParams, so no
// kernel reads device memory on the host. The CUDA backward adapter allocates its own workspace
// (flash_attention_backward_workspace_bytes) with Tensor::empty under a Workspace TagScope.
#pragma once

#include <cstdint>

#include "kernels/registry.h"
#include "kestrel/ops/attention.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

struct AttentionParams {
  int64_t max_seqlen_q = 0;  // the longest query document
  int64_t max_seqlen_k = 0;  // the longest key document
  double softmax_scale = 0;  // resolved (never 0 here)
  bool causal = true;        // bottom-right aligned per document
  int64_t window = 0;        // sliding window in keys (causal only; 0 = none), see kestrel/ops/attention.h
  bool deterministic = false;  // backward: dq summed in a fixed order (bitwise reproducible)
  Tensor prefix_len;           // i32 [docs] on q's device, prefix-LM lengths (causal only); undefined = none
  BlockMask block_mask;        // block-sparse 2-D mask on q's device (causal = false, one document); undefined = none
  AttentionBackend backend = AttentionBackend::Auto;  // CUDA: Kestrel's kernels or cuDNN's (kestrel/ops/attention.h)
};

// out [total_q, Hq, D] (q's dtype), lse [total_q, Hq] f32 (-inf and out = 0 for a row with no key).
using AttentionForwardFn = void(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                const AttentionParams& p);
// dq [total_q, Hq, D], dk/dv [total_k, Hkv, D] (q's dtype; dk/dv summed over the query heads of each
// KV group), from dout and the forward's saved out and lse (delta = rowsum(dout * out), P recomputed).
using AttentionBackwardFn = void(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                 const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                 const Tensor& lse, const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                                 const AttentionParams& p);

inline KernelSlot<AttentionForwardFn> attention_forward;
inline KernelSlot<AttentionBackwardFn> attention_backward;

}  // namespace kestrel::kernels
