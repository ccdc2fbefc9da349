// Entry point of the flash attention forward: validates the parameters once, picks the kernel
// (heuristics.h: the TMA-fed Hopper kernel for head dims up to 128 on sm_90, at 64, a narrow width
// 80/96/112 or 128; the mma.sync kernel at head dim 256 otherwise; a block mask at 64 or 128 only)
// and launches it on the caller's stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/flash_attention/flash_attention.h"
#include "cuda/flash_attention/heuristics.h"
#include "cuda/flash_attention/static_switch.h"
#include "cuda/flash_attention/traits.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda {

void flash_attention_forward(const FlashAttentionParams& p, cudaStream_t stream) {
  fa::check_params(p);
  if (p.num_docs == 0 || p.max_seqlen_q == 0) return;
  const fa::KernelChoice choice = fa::choose_kernel(p, fa::current_device_props(), /*backward=*/false);
  fa::dtype_switch(p.dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (choice.kernel == FlashKernel::MmaSync) {
      fa::launch_fwd_mma<T>(p, stream);
      return;
    }
    fa::head_dim_switch(choice.kernel_head_dim, [&](auto d) {
      constexpr int kD = decltype(d)::value;
      if constexpr (fa::kernel_has_variants(kD)) {
        if (p.block_mask) {  // the block-mask instantiations (check_params: no prefix with it)
          fa::launch_fwd_tma<T, kD, false, true>(p, stream);
          return;
        }
        fa::bool_switch(p.prefix_len != nullptr, [&](auto prefix) {
          fa::launch_fwd_tma<T, kD, decltype(prefix)::value>(p, stream);
        });
      } else {  // narrow head dims are built without the mask variants (choose_kernel pads those)
        KESTREL_CHECK(!p.prefix_len && !p.block_mask, "flash_attention",
                      "no prefix-LM or block-mask forward at kernel head dim ", kD);
        fa::launch_fwd_tma<T, kD, false>(p, stream);
      }
    });
  });
}

}  // namespace kestrel::cuda
