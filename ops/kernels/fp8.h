// Private: FP8 kernel slots (kestrel/ops/fp8.h states the maths). Scalars live on the device as f32
// tensors; no slot reads them on the host.
#pragma once

#include "kernels/registry.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::kernels {

// Where a cast of x [R, C] writes, and with what scale: the standalone cast below, or the epilogue of
// a kernel that produces x (the FP8 producer activation.h's swiglu_fp8_forward). out [Rp, C] and/or
// out_t [C, Rp] u8 contiguous (either may be undefined), Rp >= R: rows R..Rp-1 are the zero rows an
// FP8 GEMM operand is padded with (code 0, x not read there); codes fp8(x * scale[0]) in `format`, x
// as stored (a producer casts its output rounded to the output's dtype). scales_out f32 [2] =
// {1 / scale[0], scale[0]}. amax (f32 [1]) or undefined: amax = max(amax, max|x|). scale is read on
// the device (no host sync).
struct Fp8CastTarget {
  Tensor out, out_t, scale, scales_out, amax;
  Fp8Format format = Fp8Format::E4M3;
  // Rp: the rows of out (or the columns of out_t); 0 when neither is asked for.
  int64_t padded_rows() const { return out.defined() ? out.shape()[0] : out_t.defined() ? out_t.shape()[1] : 0; }
};

// x [R, C] contiguous (f32 or bf16) cast into `into` (above).
using Fp8CastFn = void(const Tensor& x, const Fp8CastTarget& into);
// amax (f32 [1]) = max(amax, max|x|); x [R, C] contiguous.
using Fp8AmaxFn = void(const Tensor& x, const Tensor& amax);
// For each row r of history [R, H] (contiguous f32): m = max_h history[r, h]; when m is finite and
// > 0, scale[r] = fmax / (m * 2^margin) (FLT_MAX when that overflows); otherwise scale[r] stays.
using Fp8ScaleFn = void(const Tensor& history, const Tensor& scale, double fmax, int64_t margin);
// history [R, H]: each row shifts right by one and history[r, 0] = amax[r] when finite, else 0;
// amax[r] = 0.
using Fp8RollFn = void(const Tensor& history, const Tensor& amax);
// out [M, N] (bf16; f32 too on the CPU) = (a [M, K] . b [N, K]^T) * a_scales[0] * b_scales[0].
using Fp8GemmFn = void(const Tensor& out, const Tensor& a, Fp8Format fa, const Tensor& a_scales, const Tensor& b,
                       Fp8Format fb, const Tensor& b_scales, bool fast_accum);

inline KernelSlot<Fp8CastFn> fp8_cast;
inline KernelSlot<Fp8AmaxFn> fp8_amax;
inline KernelSlot<Fp8ScaleFn> fp8_scale;
inline KernelSlot<Fp8RollFn> fp8_roll;
inline KernelSlot<Fp8GemmFn> fp8_gemm;

}  // namespace kestrel::kernels
