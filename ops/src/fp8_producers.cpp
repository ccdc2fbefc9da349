// The FP8 producers (kestrel/ops/fp8_producers.h): the norms and SwiGLU returning linear_fp8's input
// cast with their output. The norms: the plain op, then fp8_input_cast (a second pass; the fused norm
// kernels measured slower). SwiGLU, once the state is seeded: the cast's buffers allocated up front
// (pending_input_cast, linear_fp8's own) and the op's forward writes them (src/fp8_input.h: the fused
// kernel, or the plain kernel and the cast); before that, the plain op and fp8_input_cast.
#include "kestrel/ops/fp8_producers.h"

#include "kestrel/ops/activation.h"
#include "kestrel/ops/norm.h"
#include "src/fp8_input.h"

namespace kestrel {
namespace {

// Checks what the input cast needs of y's last dim and dtype (the op checks the rest); returns C.
int64_t check_producer(const Tensor& x, const Fp8State& state, const char* op) {
  KESTREL_CHECK(x.defined() && x.dim() >= 1, op, "undefined or 0-d input");
  KESTREL_CHECK(x.device() == state.device(), op, "input on ", x.device().str(), ", FP8 state on ",
                state.device().str());
  KESTREL_CHECK(x.dtype() == DType::BF16 || (x.dtype() == DType::F32 && !x.device().is_cuda()), op,
                "FP8 inputs are bf16 (or f32 on the CPU, emulated), got ", x.str());
  const int64_t C = x.shape().back();
  KESTREL_CHECK(C > 0 && C % 16 == 0, op, "the features (last dim) must be a positive multiple of 16 (an FP8 ",
                "GEMM's K), got ", x.str());
  return C;
}

int64_t rows_of(const Tensor& x, int64_t C) { return x.numel() / C; }

}  // namespace

Fp8Produced rms_norm_fp8(const Tensor& x, const Tensor& weight, double eps, Fp8State& state, int64_t index,
                         bool transposed) {
  check_producer(x, state, "rms_norm_fp8");
  Tensor y = rms_norm(x, weight, eps);
  return {y, fp8_input_cast(y, state, index, transposed)};
}

Fp8ProducedResidual add_rms_norm_fp8(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps,
                                     Fp8State& state, int64_t index, bool transposed) {
  check_producer(x, state, "add_rms_norm_fp8");
  auto [y, h] = add_rms_norm(x, residual, weight, eps);
  return {y, h, fp8_input_cast(y, state, index, transposed)};
}

Fp8Produced swiglu_fp8(const Tensor& gate, const Tensor& up, Fp8State& state, int64_t index, bool transposed) {
  const int64_t C = check_producer(gate, state, "swiglu_fp8");
  if (!state.seeded()) {
    Tensor y = swiglu(gate, up);
    return {y, fp8_input_cast(y, state, index, transposed)};
  }
  detail::PendingInputCast p = detail::pending_input_cast(state, index, rows_of(gate, C), C, transposed);
  Tensor y = detail::swiglu(gate, up, &p.target);
  return {y, p.cast};
}

}  // namespace kestrel
