// Explicit instantiations: Hopper wgmma flash attention backward, bf16, head dims 64 / 128.
#include "cuda/flash_attention_bwd_wgmma_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_bwd_wgmma<__nv_bfloat16, 64>(const BwdArgs&, cudaStream_t);
template void launch_bwd_wgmma<__nv_bfloat16, 128>(const BwdArgs&, cudaStream_t);
}  // namespace kestrel::cuda::fa
