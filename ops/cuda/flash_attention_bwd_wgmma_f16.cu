// Explicit instantiations: Hopper wgmma flash attention backward, f16, head dims 64 / 128.
#include "cuda/flash_attention_bwd_wgmma_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_bwd_wgmma<__half, 64>(const BwdArgs&, cudaStream_t);
template void launch_bwd_wgmma<__half, 128>(const BwdArgs&, cudaStream_t);
}  // namespace kestrel::cuda::fa
