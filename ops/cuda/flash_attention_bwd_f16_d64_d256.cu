// Explicit instantiations: flash attention backward, f16, head dims 64 and 256 (padded path).
#include "cuda/flash_attention_bwd_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_bwd_v2<__half, 64>(const BwdArgs&, cudaStream_t);
template void launch_bwd_v2<__half, 256>(const BwdArgs&, cudaStream_t);
}  // namespace kestrel::cuda::fa
