// Private: the activation formulas in f32 that more than one kernel file evaluates (activation.cu's
// kernels; fp8_producers.cu's SwiGLU forward and backward with an FP8 epilogue), written once so that
// both round alike.
#pragma once

#include <cuda_runtime.h>

namespace kestrel::cuda_ops {

__device__ __forceinline__ float sigmoid_f32(float x) { return 1.0f / (1.0f + __expf(-x)); }

// silu(gate) * up, as (gate * sigmoid(gate)) * up.
__device__ __forceinline__ float swiglu_f32(float gate, float up) { return gate * sigmoid_f32(gate) * up; }

// SwiGLU's gradients for the output gradient dy: dgate = dy * up * silu'(gate), dup = dy * silu(gate).
__device__ __forceinline__ void swiglu_grad_f32(float gate, float up, float dy, float& dgate, float& dup) {
  const float s = sigmoid_f32(gate);
  dgate = dy * up * s * (1.0f + gate * (1.0f - s));
  dup = dy * gate * s;
}

}  // namespace kestrel::cuda_ops
