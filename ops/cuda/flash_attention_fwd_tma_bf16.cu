// Explicit instantiations: TMA-fed Hopper flash attention forwards, bf16, head dims 64 / 128.
#include "cuda/flash_attention_fwd_tma_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_fwd_tma<__nv_bfloat16, 64>(const FlashAttentionParams&, int, bool, cudaStream_t);
template void launch_fwd_tma<__nv_bfloat16, 128>(const FlashAttentionParams&, int, bool, cudaStream_t);
}  // namespace kestrel::cuda::fa
