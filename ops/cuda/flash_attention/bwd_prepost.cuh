// Backward pre- and post-processing around the main kernels (bwd_wgmma_kernel.cuh, bwd_mma_kernel.cuh):
// the workspace carved from kestrel/ops/workspace_sizes.h's layout (which the memory planner sizes
// too); the preprocess (delta = rowsum(dO * O), lse in log2 units transposed to [Hq, total_q], the
// f32 dq accumulator and the deterministic mode's counters zeroed) and the dq conversion
// (f32 accumulator * scale -> bf16/f16). Both are grid-stride loops (tile_scheduler.h).
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/flash_attention/device_primitives.cuh"
#include "cuda/flash_attention/flash_attention.h"
#include "kestrel/ops/workspace_sizes.h"

namespace kestrel::cuda::fa {

struct Workspace {
  float* dq_accum;  // [total_q, Hq, D]; the warp-specialised backward permutes each 8-column group
  float* lse2;      // [Hq, total_q]
  float* delta;     // [Hq, total_q]
  int* dq_order;    // [Hq, total_q] i32, deterministic mode only (else null)
};

inline size_t workspace_layout(const FlashAttentionParams& p, void* base, Workspace* ws) {
  const workspace::AttentionBackwardLayout l =
      workspace::attention_backward_layout(p.total_q, p.num_heads_q, p.head_dim, p.deterministic);
  if (ws) {
    char* b = static_cast<char*>(base);
    ws->dq_accum = reinterpret_cast<float*>(b + l.dq_accum);
    ws->lse2 = reinterpret_cast<float*>(b + l.lse2);
    ws->delta = reinterpret_cast<float*>(b + l.delta);
    ws->dq_order = p.deterministic ? reinterpret_cast<int*>(b + l.dq_order) : nullptr;
  }
  return l.total;
}

// One warp per (token, head) row; lane l covers columns [8l, 8l + 8).
template <typename T>
__global__ void bwd_preprocess_kernel(const T* __restrict__ out, const T* __restrict__ dout,
                                      const float* __restrict__ lse, Workspace ws, int total_q, int heads, int D) {
  const int64_t rows = static_cast<int64_t>(total_q) * heads;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const int col = lane * 8;
    float dot = 0.f;
    if (col < D) {
      const uint4 o = *reinterpret_cast<const uint4*>(out + row * D + col);
      const uint4 d = *reinterpret_cast<const uint4*>(dout + row * D + col);
      const T* oe = reinterpret_cast<const T*>(&o);
      const T* de = reinterpret_cast<const T*>(&d);
#pragma unroll
      for (int i = 0; i < 8; ++i) dot += to_float<T>(oe[i]) * to_float<T>(de[i]);
      float4* acc = reinterpret_cast<float4*>(ws.dq_accum + row * D + col);
      acc[0] = make_float4(0.f, 0.f, 0.f, 0.f);
      acc[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    if (lane == 0) {
      const int64_t tok = row / heads;
      const int h = static_cast<int>(row % heads);
      const float l = lse[row];
      ws.delta[h * static_cast<int64_t>(total_q) + tok] = dot;
      ws.lse2[h * static_cast<int64_t>(total_q) + tok] = l == -INFINITY ? INFINITY : l * 1.4426950408889634f;
      if (ws.dq_order) ws.dq_order[h * static_cast<int64_t>(total_q) + tok] = 0;
    }
  }
}

// dq = scale * dq_accum, 8 elements per thread. kPermuted: each 8-column group of the accumulator
// holds columns 0 2 4 6 1 3 5 7 (the warp-specialised backward's stmatrix order, bwd_wgmma_kernel.cuh).
template <typename T, bool kPermuted>
__global__ void bwd_convert_dq_kernel(const float* __restrict__ acc, T* __restrict__ dq, int64_t n8, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float4 a = reinterpret_cast<const float4*>(acc)[2 * i];
    float4 b = reinterpret_cast<const float4*>(acc)[2 * i + 1];
    if constexpr (kPermuted) {
      const float4 even = a, odd = b;
      a = make_float4(even.x, odd.x, even.y, odd.y);
      b = make_float4(even.z, odd.z, even.w, odd.w);
    }
    uint4 r;
    r.x = pack2<T>(a.x * scale, a.y * scale);
    r.y = pack2<T>(a.z * scale, a.w * scale);
    r.z = pack2<T>(b.x * scale, b.y * scale);
    r.w = pack2<T>(b.z * scale, b.w * scale);
    reinterpret_cast<uint4*>(dq)[i] = r;
  }
}

}  // namespace kestrel::cuda::fa
