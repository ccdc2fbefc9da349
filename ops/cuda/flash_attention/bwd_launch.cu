// Entry point of the flash attention backward: validates once, carves the workspace, runs the
// preprocess, the main kernel (heuristics.h: the Hopper wgmma kernel for head dims up to 128 on
// sm_90, optionally deterministic; the mma.sync kernel at head dim 256 otherwise), and the dq
// conversion (bwd_prepost.cuh).
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_attention/bwd_prepost.cuh"
#include "cuda/flash_attention/flash_attention.h"
#include "cuda/flash_attention/heuristics.h"
#include "cuda/flash_attention/static_switch.h"
#include "cuda/flash_attention/tile_scheduler.h"
#include "cuda/flash_attention/traits.h"
#include "kestrel/cuda/check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda {
namespace fa {
namespace {

template <typename T>
void run_backward(const FlashAttentionBackwardParams& bp, const KernelChoice& choice, const Workspace& ws,
                  cudaStream_t stream) {
  const FlashAttentionParams& p = bp.fwd;
  const int64_t rows = static_cast<int64_t>(p.total_q) * p.num_heads_q;
  if (rows > 0) {
    bwd_preprocess_kernel<T><<<grid_stride_blocks(rows, 8), 256, 0, stream>>>(
        static_cast<const T*>(p.out), static_cast<const T*>(bp.dout), p.lse, ws, p.total_q, p.num_heads_q,
        p.head_dim);
    KESTREL_CUDA_CHECK_LAUNCH();
  }
  const BwdArgs a{p, bp.dout, bp.dk, bp.dv, ws.dq_accum, ws.lse2, ws.delta, ws.dq_order, p.total_q};
  if (p.num_docs > 0 && p.max_seqlen_k > 0) {
    if (choice.kernel == FlashKernel::MmaSync) {
      launch_bwd_mma<T>(a, stream);
    } else {
      head_dim_switch(choice.kernel_head_dim, [&](auto d) {
        constexpr int kD = decltype(d)::value;
        if constexpr (kernel_has_variants(kD)) {
          if (p.block_mask) {  // choose_kernel refused deterministic with it, check_params a prefix
            launch_bwd_wgmma<T, kD, false, false, true>(a, choice.bwd_specialised, stream);
            return;
          }
          bool_switch(p.deterministic, [&](auto det) {
            bool_switch(p.prefix_len != nullptr, [&](auto prefix) {
              launch_bwd_wgmma<T, kD, decltype(det)::value, decltype(prefix)::value>(a, choice.bwd_specialised, stream);
            });
          });
        } else {  // built without the deterministic / prefix-LM variants (choose_kernel pads those)
          KESTREL_CHECK(!p.deterministic && !p.prefix_len && !p.block_mask, "flash_attention",
                        "no deterministic, prefix-LM or block-mask backward at kernel head dim ", kD);
          launch_bwd_wgmma<T, kD, false, false>(a, choice.bwd_specialised, stream);
        }
      });
    }
  }
  const int64_t n8 = rows * p.head_dim / 8;
  if (n8 > 0) {
    // The warp-specialised backward (bwd_specialised implies the Hopper kernels) stores dQ by stmatrix,
    // in its permuted column order.
    bool_switch(choice.bwd_specialised, [&](auto perm) {
      bwd_convert_dq_kernel<T, decltype(perm)::value><<<grid_stride_blocks(n8, 256), 256, 0, stream>>>(
          ws.dq_accum, static_cast<T*>(bp.dq), n8, p.softmax_scale);
    });
    KESTREL_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace
}  // namespace fa

size_t flash_attention_backward_workspace_bytes(const FlashAttentionParams& p) {
  KESTREL_CHECK(p.total_q >= 0, "flash_attention", "total_q must be >= 0");
  return fa::workspace_layout(p, nullptr, nullptr);
}

void flash_attention_backward(const FlashAttentionBackwardParams& bp, cudaStream_t stream) {
  const FlashAttentionParams& p = bp.fwd;
  fa::check_params(p);
  KESTREL_CHECK(bp.dout && bp.dq && bp.dk && bp.dv, "flash_attention", "dout, dq, dk and dv must be non-null");
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  KESTREL_CHECK(aligned(bp.dout) && aligned(bp.dq) && aligned(bp.dk) && aligned(bp.dv), "flash_attention",
                "dout, dq, dk and dv must be 16-byte aligned");
  const size_t need = fa::workspace_layout(p, nullptr, nullptr);
  KESTREL_CHECK(bp.workspace_bytes >= need && (need == 0 || bp.workspace), "flash_attention", "workspace needs ",
                need, " bytes, got ", bp.workspace_bytes);
  KESTREL_CHECK(reinterpret_cast<uintptr_t>(bp.workspace) % 256 == 0, "flash_attention",
                "workspace must be 256-byte aligned");
  // Chosen before any launch, so a refused choice (e.g. deterministic on the mma.sync path) throws first.
  const fa::KernelChoice choice = fa::choose_kernel(p, fa::current_device_props(), /*backward=*/true);
  fa::Workspace ws{};
  fa::workspace_layout(p, bp.workspace, &ws);
  fa::dtype_switch(p.dtype, [&](auto tag) { fa::run_backward<typename decltype(tag)::type>(bp, choice, ws, stream); });
}

}  // namespace kestrel::cuda
