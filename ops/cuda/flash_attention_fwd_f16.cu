// Explicit instantiations: flash attention forward, f16, head dims 64 / 128 / 256.
#include "cuda/flash_attention_fwd_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_fwd<__half, 64>(const FlashAttentionParams&, cudaStream_t);
template void launch_fwd<__half, 128>(const FlashAttentionParams&, cudaStream_t);
template void launch_fwd<__half, 256>(const FlashAttentionParams&, cudaStream_t);
}  // namespace kestrel::cuda::fa
