// Which attention implementation runs a CUDA call (AttentionBackend, kestrel/ops/attention.h):
// Kestrel's flash kernels (ops/cuda/flash_attention/) or cuDNN's fused flash attention
// (ops/cuda/cudnn_attention/). One place for what cuDNN can run, for the Auto rule, and for the
// cuDNN entry points the CUDA attention slots (attention.cu) call. Compiled in every CUDA build; the
// cuDNN entry points exist only where KESTREL_WITH_CUDNN is 1 (CMake found cuDNN 9).
#pragma once

#include <cstdint>
#include <string>

#include "kernels/attention.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::cuda_ops {

// Whether this library was built with the cuDNN backend.
bool cudnn_attention_built();

// Empty when cuDNN's backend can run this call on the current device, else why not ("head_dim 256
// (cuDNN backend: multiples of 8 up to 128)"). `backward`: the backward graph. Not checked (it would
// need the lengths on the host): a bidirectional document with queries but no keys, whose rows
// Kestrel's kernels define (out 0, lse -inf) and cuDNN's softmax does not.
std::string cudnn_attention_unsupported(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k,
                                        const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, bool backward);

// The choice for one call: true = cuDNN. Kestrel -> false; Cudnn -> true or kestrel::Error "[attention]
// backend cudnn (attention.backend) cannot run this call: <why>"; Auto -> cudnn_attention_preferred
// where cuDNN can run the call, else false.
bool use_cudnn_attention(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k,
                         const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, bool backward);

// The Auto rule for a call cuDNN can run (a function of the shape and the device only).
bool cudnn_attention_preferred(const kernels::AttentionParams& p, const Tensor& q, const Tensor& k, bool backward);

// Device memory the cuDNN backend's handle and loaded kernels took on `device` (the rise of External
// measured around cudnnCreate and each new plan's first run; 0 before first use or without cuDNN).
int64_t cudnn_attention_external_bytes(int device);

#if KESTREL_WITH_CUDNN
// The cuDNN slots: same contracts as kernels::AttentionForwardFn / AttentionBackwardFn (contiguous
// tensors, cu_seqlens i32 on the device), for calls cudnn_attention_unsupported accepts.
void cudnn_attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k, const kernels::AttentionParams& p);
void cudnn_attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                              const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                              const Tensor& cu_seqlens_q, const Tensor& cu_seqlens_k,
                              const kernels::AttentionParams& p);
#endif

}  // namespace kestrel::cuda_ops
