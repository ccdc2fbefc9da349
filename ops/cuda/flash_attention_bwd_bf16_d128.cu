// Explicit instantiations: flash attention backward, bf16, head dim 128 (own file: the largest kernels).
#include "cuda/flash_attention_bwd_kernel.cuh"
#include "cuda/flash_attention_bwd_tiled_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_bwd_tiled<__nv_bfloat16, 128>(const BwdArgs&, cudaStream_t);
template void launch_bwd_v2<__nv_bfloat16, 128>(const BwdArgs&, cudaStream_t);
}  // namespace kestrel::cuda::fa
