// Explicit instantiation: flash attention backward, bf16, head dim 128 (own file: the largest kernel).
#include "cuda/flash_attention_bwd_kernel.cuh"

namespace kestrel::cuda::fa {
template void launch_bwd<__nv_bfloat16, 128>(const BwdArgs&, cudaStream_t);
}  // namespace kestrel::cuda::fa
