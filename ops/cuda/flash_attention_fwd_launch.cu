// Entry point of the flash attention forward: validates the parameters once, picks the
// head-dim instantiation (64 and 128 exact; other sizes zero-padded to 64/128/256, announced
// once on stderr as the slower path) and the kernel, and launches on the caller's stream.
// Kernels (KESTREL_FA_FWD, read on every call so one benchmark process can A/B them), for padded
// head dims 64 and 128: "tma_pp" (default when the parameters carry total_q/total_k), "tma_s2" and
// "tma": the wgmma kernel fed by the copy engine (flash_attention_fwd_tma_kernel.cuh) with 2-deep
// K/V rings and the two warpgroups' GEMM issue alternating (head dim 128; at 64 it is "tma_s2"),
// 2-deep and 3-deep rings without alternation (TMA: +13% at D 128, +27% at D 64 over "wgmma";
// alternation: +4% bidirectional, +0.3% causal at D 128; H200, 8k); "wgmma" (the default without
// token counts) and "wgmma_s2" the same GEMM/softmax loop fed by cp.async
// (flash_attention_fwd_wgmma_kernel.cuh); "mma" the mma.sync kernel (flash_attention_fwd_kernel.cuh),
// which also runs head dim 256.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_attention.h"
#include "cuda/flash_attention_launch.cuh"
#include "cuda/flash_attention_tma.cuh"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/log.h"

namespace kestrel::cuda {
namespace fa {

// Validates what both directions share; throws kestrel::Error naming flash_attention.
void check_params(const FlashAttentionParams& p) {
  KESTREL_CHECK(p.q && p.k && p.v && p.out && p.lse, "flash_attention", "q, k, v, out and lse must be non-null");
  KESTREL_CHECK(p.cu_seqlens_q && p.cu_seqlens_k, "flash_attention", "cu_seqlens_q/k must be non-null");
  KESTREL_CHECK(p.num_docs >= 0 && p.num_docs <= 65535, "flash_attention", "num_docs must be in [0, 65535], got ",
                p.num_docs);
  KESTREL_CHECK(p.max_seqlen_q >= 0 && p.max_seqlen_k >= 0, "flash_attention", "max_seqlen must be >= 0");
  KESTREL_CHECK(p.num_heads_q > 0 && p.num_heads_kv > 0 && p.num_heads_q % p.num_heads_kv == 0, "flash_attention",
                "num_heads_q (", p.num_heads_q, ") must be a positive multiple of num_heads_kv (", p.num_heads_kv,
                ")");
  KESTREL_CHECK(p.head_dim > 0 && p.head_dim <= 256 && p.head_dim % 8 == 0, "flash_attention",
                "head_dim must be a multiple of 8 in [8, 256], got ", p.head_dim);
  KESTREL_CHECK(p.window >= 0, "flash_attention", "window must be >= 0 (0 = none), got ", p.window);
  KESTREL_CHECK(p.window == 0 || p.causal, "flash_attention",
                "a sliding window is implemented for causal attention only (window ", p.window, ", causal false)");
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  KESTREL_CHECK(aligned(p.q) && aligned(p.k) && aligned(p.v) && aligned(p.out), "flash_attention",
                "q, k, v and out must be 16-byte aligned");
}

// Kernel head dim for a runtime head_dim; prints the slower-path notice the first time.
int padded_head_dim(int head_dim) {
  if (head_dim == 64 || head_dim == 128) return head_dim;
  const int padded = head_dim < 64 ? 64 : head_dim < 128 ? 128 : 256;
  static std::atomic<bool> announced{false};
  if (!announced.exchange(true))
    log_to(LogLevel::Info, "flash_attention", "head_dim ", head_dim, " runs the zero-padded head_dim-", padded,
           " kernels (slower path; 64 and 128 are the fast path)");
  return padded;
}

enum class FwdKernel { Mma, Wgmma, WgmmaTwoStage, Tma, TmaTwoStage, TmaPingPong };
FwdKernel fwd_kernel_choice() {
  const char* e = std::getenv("KESTREL_FA_FWD");
  if (!e || !*e) return FwdKernel::TmaPingPong;
  if (std::strcmp(e, "wgmma") == 0) return FwdKernel::Wgmma;
  if (std::strcmp(e, "mma") == 0) return FwdKernel::Mma;
  if (std::strcmp(e, "wgmma_s2") == 0) return FwdKernel::WgmmaTwoStage;
  if (std::strcmp(e, "tma") == 0) return FwdKernel::Tma;
  if (std::strcmp(e, "tma_s2") == 0) return FwdKernel::TmaTwoStage;
  if (std::strcmp(e, "tma_pp") == 0) return FwdKernel::TmaPingPong;
  KESTREL_CHECK(false, "flash_attention", "KESTREL_FA_FWD must be mma, wgmma, wgmma_s2, tma, tma_s2 or tma_pp, got '",
                e, "'");
  return FwdKernel::Wgmma;
}

}  // namespace fa

void flash_attention_forward(const FlashAttentionParams& p, cudaStream_t stream) {
  fa::check_params(p);
  KESTREL_CHECK(p.max_seqlen_q / 64 < 65535, "flash_attention", "max_seqlen_q too large: ", p.max_seqlen_q);
  if (p.num_docs == 0 || p.max_seqlen_q == 0) return;
  const int d = fa::padded_head_dim(p.head_dim);
  const bool bf = p.dtype == AttnDType::BF16;
  fa::FwdKernel kind = fa::fwd_kernel_choice();
  const bool tma =
      kind == fa::FwdKernel::Tma || kind == fa::FwdKernel::TmaTwoStage || kind == fa::FwdKernel::TmaPingPong;
  if (tma && (p.total_q <= 0 || p.total_k <= 0)) kind = fa::FwdKernel::Wgmma;  // no bounds for the maps
  else if (tma && (d == 64 || d == 128)) {
    const int stages = kind == fa::FwdKernel::Tma ? 3 : 2;
    const bool pp = kind == fa::FwdKernel::TmaPingPong;
    if (d == 64)
      bf ? fa::launch_fwd_tma<__nv_bfloat16, 64>(p, stages, pp, stream)
         : fa::launch_fwd_tma<__half, 64>(p, stages, pp, stream);
    else
      bf ? fa::launch_fwd_tma<__nv_bfloat16, 128>(p, stages, pp, stream)
         : fa::launch_fwd_tma<__half, 128>(p, stages, pp, stream);
    return;
  }
  if ((d == 64 || d == 128) && kind != fa::FwdKernel::Mma) {
    const int stages = kind == fa::FwdKernel::WgmmaTwoStage ? 2 : 3;
    if (d == 64)
      bf ? fa::launch_fwd_wgmma<__nv_bfloat16, 64>(p, stages, stream) : fa::launch_fwd_wgmma<__half, 64>(p, stages, stream);
    else
      bf ? fa::launch_fwd_wgmma<__nv_bfloat16, 128>(p, stages, stream)
         : fa::launch_fwd_wgmma<__half, 128>(p, stages, stream);
    return;
  }
  switch (d) {
    case 64: bf ? fa::launch_fwd<__nv_bfloat16, 64>(p, stream) : fa::launch_fwd<__half, 64>(p, stream); break;
    case 128: bf ? fa::launch_fwd<__nv_bfloat16, 128>(p, stream) : fa::launch_fwd<__half, 128>(p, stream); break;
    default: bf ? fa::launch_fwd<__nv_bfloat16, 256>(p, stream) : fa::launch_fwd<__half, 256>(p, stream); break;
  }
}

}  // namespace kestrel::cuda
