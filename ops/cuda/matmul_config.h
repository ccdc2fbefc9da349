// Private: switches of the CUDA matmul (ops/cuda/matmul.cu).
#pragma once

namespace kestrel::cuda_ops {

// f32 GEMMs run exact f32 (CUBLAS_COMPUTE_32F) by default. With TF32 on they use the tensor cores'
// TF32 inputs (CUBLAS_COMPUTE_32F_FAST_TF32: ~10-bit mantissa, much faster). The environment
// variable KESTREL_MATMUL_TF32=1 sets the initial value. Process-wide; bf16/f16 are unaffected.
void set_matmul_allow_tf32(bool on);
bool matmul_allow_tf32();

}  // namespace kestrel::cuda_ops
