// The ops that produce a linear_fp8 input, fused with its FP8 input cast (issue 23): the decoder's
// RMSNorm before q/k/v, the residual add + RMSNorm before gate/up, and SwiGLU before down; and
// swiglu_gate_up_fp8 (at the end), the gate/up projections and SwiGLU as one entry whose backward
// writes the gate/up output gradients' casts in SwiGLU's backward pass.
//
// Each returns the op's output y (bf16; f32 too on the CPU), differentiable exactly as rms_norm /
// add_rms_norm / swiglu (the same tape entry: dX of the linear flows into y), together with the cast
// linear_fp8(y, ..., state, {index, ...}, &x8) takes instead of casting y itself: X8 [Tp, C] and, with
// `transposed`, X8T [C, Tp] (Tp = rows rounded up to 16, zero rows appended), codes of the stored
// (rounded) y times the input scale of linear `index`, y's amax folded into the state's running amax
// while it observes. Everything equals, bit for bit, the op followed by linear_fp8's own cast.
//
// SwiGLU on CUDA, once the state is seeded: one kernel computes y and writes both code layouts
// (fp8_codes.cuh's 128 x 128 tiles), so the cast's pass over y (a read of y, two writes of codes) is
// gone. Fallbacks, same results: before the first roll (the cast's scale then comes from y's own
// amax, which needs y complete first) the plain op then fp8_input_cast; on the CPU, or a shape or
// layout the fused kernel does not take, the plain kernel then the cast of its output into
// the same buffers.
//
// The norms' cast is a second pass: rms_norm / add_rms_norm, then fp8_input_cast (the standalone
// 128 x 128 tile cast). Fused norm kernels (a block of 512 threads in row teams staging X8T tiles in
// shared memory) measured slower than the two passes on the H200 at T = 8192 (rms_norm 0.082 vs
// 0.056 ms at C = 2048, 0.394 vs 0.177 ms at C = 8192; add_rms_norm 0.102 vs 0.074 and 0.506 vs
// 0.247 ms) and were removed (git history keeps them; bench/notes/step_profile.md, "FP8 casts").
// The API stays so that a faster fused kernel can return without touching the callers.
//
// `transposed`: fp8_input_needs_transposed(the consuming linear's weights). The last dim C must be
// a multiple of 16 (an FP8 GEMM's K).
#pragma once

#include "kestrel/ops/fp8.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel {

struct Fp8Produced {
  Tensor y;
  Fp8InputCast x8;
};

// y = rms_norm(x, weight, eps) with the input cast of linear `index` (kestrel/ops/norm.h).
Fp8Produced rms_norm_fp8(const Tensor& x, const Tensor& weight, double eps, Fp8State& state, int64_t index,
                         bool transposed);

struct Fp8ProducedResidual {
  Tensor y, h;  // add_rms_norm's {rms_norm(h), h = x + residual}; x8 is the cast of y
  Fp8InputCast x8;
};
Fp8ProducedResidual add_rms_norm_fp8(const Tensor& x, const Tensor& residual, const Tensor& weight, double eps,
                                     Fp8State& state, int64_t index, bool transposed);

// y = swiglu(gate, up) = silu(gate) * up with the input cast of linear `index` (kestrel/ops/activation.h).
Fp8Produced swiglu_fp8(const Tensor& gate, const Tensor& up, Fp8State& state, int64_t index, bool transposed);

// The MLP's gate and up projections and SwiGLU in FP8 as one tape entry: s = swiglu(x Wg^T, x Wu^T),
// returned with the down projection's input cast (as swiglu_fp8 makes it, for linear `down_index`).
// The forward is exactly linear_fp8(x, {gate_w, up_w}, {}, state, {gate_index, up_index}, x8) and then
// swiglu_fp8. The backward is the same arithmetic as those three entries' backwards, bit for bit,
// with one pass fewer over two [T, I] tensors each way: once the state is seeded, one kernel (CUDA)
// computes dgate and dup from the saved gate and up outputs and the incoming gradient and writes
// their FP8 casts (plain for dgrad, transposed for wgrad) directly, so the 16-bit dgate / dup are
// never stored and never read back; before the first roll, on the CPU, or for a layout the kernel
// does not take, SwiGLU's backward and then the two casts. dx is the up projection's part plus the
// gate projection's, as the tape adds them. x [..., C]; gate_w, up_w [I, C], no bias.
Fp8Produced swiglu_gate_up_fp8(const Tensor& x, const Tensor& gate_w, const Tensor& up_w, Fp8State& state,
                               int64_t gate_index, int64_t up_index, int64_t down_index, bool down_transposed,
                               const Fp8InputCast* x8 = nullptr);

}  // namespace kestrel
