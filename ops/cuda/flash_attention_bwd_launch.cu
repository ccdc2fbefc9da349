// Entry point of the flash attention backward: carves the workspace, runs the preprocess kernel
// (delta = rowsum(dO * O), lse in log2 units transposed to [Hq, total_q], zeroed f32 dq
// accumulator), the main per-key-tile kernel, and the dq f32 -> bf16/f16 conversion.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_attention.h"
#include "cuda/flash_attention_common.cuh"
#include "cuda/flash_attention_launch.cuh"
#include "kestrel/ops/workspace_sizes.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda {
namespace fa {
namespace {

struct Workspace {
  float* dq_accum;  // [total_q, Hq, D]
  float* lse2;      // [Hq, total_q]
  float* delta;     // [Hq, total_q]
};

// The layout is kestrel/ops/workspace_sizes.h's, which the memory planner sizes too.
size_t workspace_layout(const FlashAttentionParams& p, int total_q, void* base, Workspace* ws) {
  const workspace::AttentionBackwardLayout l = workspace::attention_backward_layout(total_q, p.num_heads_q, p.head_dim);
  if (ws) {
    char* b = static_cast<char*>(base);
    ws->dq_accum = reinterpret_cast<float*>(b + l.dq_accum);
    ws->lse2 = reinterpret_cast<float*>(b + l.lse2);
    ws->delta = reinterpret_cast<float*>(b + l.delta);
  }
  return l.total;
}

// Kernel choice, KESTREL_FA_BWD (read on every call, for A/B runs and tests): "wgmma" (Hopper
// wgmma kernel, head dims 64/128; the default), "tiled" (2-D-tiled mma.sync kernel at 128, the
// 16-keys-per-warp one at 64), "v2" (16-keys-per-warp at every head dim). Head dim 256 always
// runs the 16-keys-per-warp kernel.
enum class BwdKernel { kWgmma, kTiled, kV2 };
constexpr BwdKernel kDefaultBwd = BwdKernel::kWgmma;
BwdKernel bwd_kernel_choice() {
  const char* e = std::getenv("KESTREL_FA_BWD");
  if (!e || !*e) return kDefaultBwd;
  if (std::strcmp(e, "wgmma") == 0) return BwdKernel::kWgmma;
  if (std::strcmp(e, "tiled") == 0) return BwdKernel::kTiled;
  if (std::strcmp(e, "v2") == 0) return BwdKernel::kV2;
  KESTREL_CHECK(false, "flash_attention", "KESTREL_FA_BWD must be wgmma, tiled or v2, got '", e, "'");
  return kDefaultBwd;
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
    }
  }
}

// dq = scale * dq_accum, 8 elements per thread.
template <typename T>
__global__ void bwd_convert_dq_kernel(const float* __restrict__ acc, T* __restrict__ dq, int64_t n8, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n8;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 a = reinterpret_cast<const float4*>(acc)[2 * i];
    const float4 b = reinterpret_cast<const float4*>(acc)[2 * i + 1];
    uint4 r;
    r.x = pack2<T>(a.x * scale, a.y * scale);
    r.y = pack2<T>(a.z * scale, a.w * scale);
    r.z = pack2<T>(b.x * scale, b.y * scale);
    r.w = pack2<T>(b.z * scale, b.w * scale);
    reinterpret_cast<uint4*>(dq)[i] = r;
  }
}

template <typename T>
void run_backward(const FlashAttentionBackwardParams& bp, const Workspace& ws, int total_q, cudaStream_t stream) {
  const FlashAttentionParams& p = bp.fwd;
  const int64_t rows = static_cast<int64_t>(total_q) * p.num_heads_q;
  if (rows > 0) {
    const int blocks = static_cast<int>(std::min<int64_t>((rows + 7) / 8, int64_t{16} * sm_count()));
    bwd_preprocess_kernel<T><<<blocks, 256, 0, stream>>>(static_cast<const T*>(p.out),
                                                         static_cast<const T*>(bp.dout), p.lse, ws, total_q,
                                                         p.num_heads_q, p.head_dim);
    KESTREL_CUDA_CHECK_LAUNCH();
  }
  BwdArgs a{p, bp.dout, bp.dk, bp.dv, ws.dq_accum, ws.lse2, ws.delta, total_q};
  if (p.num_docs > 0 && p.max_seqlen_k > 0) {
    const BwdKernel kind = bwd_kernel_choice();
    const bool wgmma = kind != BwdKernel::kTiled && kind != BwdKernel::kV2;
    switch (padded_head_dim(p.head_dim)) {
      case 64:
        if (wgmma) launch_bwd_wgmma<T, 64>(a, stream);
        else launch_bwd_v2<T, 64>(a, stream);
        break;
      case 128:
        if (wgmma) launch_bwd_wgmma<T, 128>(a, stream);
        else if (kind == BwdKernel::kV2) launch_bwd_v2<T, 128>(a, stream);
        else launch_bwd_tiled<T, 128>(a, stream);
        break;
      default: launch_bwd_v2<T, 256>(a, stream); break;
    }
  }
  const int64_t n8 = rows * p.head_dim / 8;
  if (n8 > 0) {
    const int blocks = static_cast<int>(std::min<int64_t>((n8 + 255) / 256, int64_t{16} * sm_count()));
    bwd_convert_dq_kernel<T><<<blocks, 256, 0, stream>>>(ws.dq_accum, static_cast<T*>(bp.dq), n8, p.softmax_scale);
    KESTREL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace
}  // namespace fa

size_t flash_attention_backward_workspace_bytes(const FlashAttentionParams& p, int total_q) {
  KESTREL_CHECK(total_q >= 0, "flash_attention", "total_q must be >= 0");
  return fa::workspace_layout(p, total_q, nullptr, nullptr);
}

void flash_attention_backward(const FlashAttentionBackwardParams& bp, int total_q, cudaStream_t stream) {
  const FlashAttentionParams& p = bp.fwd;
  fa::check_params(p);
  KESTREL_CHECK(bp.dout && bp.dq && bp.dk && bp.dv, "flash_attention", "dout, dq, dk and dv must be non-null");
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  KESTREL_CHECK(aligned(bp.dout) && aligned(bp.dq) && aligned(bp.dk) && aligned(bp.dv), "flash_attention",
                "dout, dq, dk and dv must be 16-byte aligned");
  KESTREL_CHECK(total_q >= 0, "flash_attention", "total_q must be >= 0");
  const size_t need = flash_attention_backward_workspace_bytes(p, total_q);
  KESTREL_CHECK(bp.workspace_bytes >= need && (need == 0 || bp.workspace), "flash_attention", "workspace needs ",
                need, " bytes, got ", bp.workspace_bytes);
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(bp.workspace) % 256 == 0, "flash_attention",
                "workspace must be 256-byte aligned");
  KESTREL_CHECK(p.max_seqlen_k / 64 < 65535, "flash_attention", "max_seqlen_k too large: ", p.max_seqlen_k);
  fa::Workspace ws{};
  fa::workspace_layout(p, total_q, bp.workspace, &ws);
  if (p.dtype == AttnDType::BF16)
    fa::run_backward<__nv_bfloat16>(bp, ws, total_q, stream);
  else
    fa::run_backward<__half>(bp, ws, total_q, stream);
}

}  // namespace kestrel::cuda
