// Explicit instantiations: TMA-fed Hopper flash attention forwards, f16, head dims 64 / 128.
#include "cuda/flash_attention_fwd_tma_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_fwd_tma<__half, 64>(const FlashAttentionParams&, int, bool, cudaStream_t);
template void launch_fwd_tma<__half, 128>(const FlashAttentionParams&, int, bool, cudaStream_t);
}  // namespace kestrel::cuda::fa
