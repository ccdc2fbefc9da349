// Private (ops/src): the pieces of linear_fp8's input cast that a producer fusing it needs
// (fp8_producers.cpp), and the producer op with an FP8 cast of its output (activation.cpp's swiglu).
#pragma once

#include "kernels/fp8.h"
#include "kestrel/ops/fp8.h"

namespace kestrel::detail {

// An input cast whose buffers are allocated but not yet written: `target` is where a kernel writes
// it (the producer's epilogue, or the cast after the plain op), `cast` what linear_fp8 is then given.
struct PendingInputCast {
  kernels::Fp8CastTarget target;
  Fp8InputCast cast;
};
// The input cast of linear `index` for x of T rows and K columns with the state's current scale
// (the state must be seeded) and, while observing, its running amax: linear_fp8's own cast exactly.
PendingInputCast pending_input_cast(Fp8State& state, int64_t index, int64_t T, int64_t K, bool transposed);

// swiglu (validation, kernels and tape entry: the public op is this with fp8 null) writing, when
// `fp8` is given, the FP8 copy of its output y [rows, C] into it: in the same pass where the device
// has a fused kernel for the shape (CUDA), else by the cast after the plain kernel (the CPU, unusual
// shapes on CUDA). Either way the bits are the cast of the stored y.
Tensor swiglu(const Tensor& gate, const Tensor& up, const kernels::Fp8CastTarget* fp8);

}  // namespace kestrel::detail
