// Private: the AdamW update of host-resident optimizer state (optimizer.offload = "host").
//
// The arithmetic is ops/cpu/optim.cpp's reference (and the CUDA kernel's) operation by operation:
// f32 throughout, no FMA contraction (this file is compiled with -ffp-contract=off), IEEE sqrt and
// division, round-to-nearest-even 16-bit copies with the runtime's NaN rule, so a step on host state
// is bit-identical to a step of the on-device AdamW. Loops are written to vectorise and are cloned for
// AVX-512 / AVX2 / baseline x86-64, selected at run time.
#pragma once

#include <cstdint>

#include "kestrel/ops/optim.h"
#include "kestrel/runtime/dtype.h"

namespace kestrel::train {

// The step's f32 constants, computed as the reference computes them (double, then rounded).
struct HostAdamWConstants {
  float decay, b1, b2, one_minus_b1, one_minus_b2, step_size, bc2_sqrt, eps;
  static HostAdamWConstants make(const AdamWOptions& o, int64_t step);
};

// Updates master/m/v[0, n) in place from grad[0, n) (f32, bf16 or f16) and writes the new values to
// out[0, n) as `out_dtype` (bf16, f16 or f32; nullptr: no copy). The moments m and v are stored as
// `state_dtype`: f32 (exact: bit-identical to the device AdamW), or bf16 (optimizer.state_dtype "bf16":
// the same f32 arithmetic on the stored values, each new moment rounded to nearest even once; not
// exact, 8 instead of 12 bytes per parameter). Single-threaded: callers split the range across threads.
void host_adamw_update(float* master, void* m, void* v, DType state_dtype, const void* grad, DType grad_dtype,
                       void* out, DType out_dtype, int64_t n, const HostAdamWConstants& c);

// 8-bit block-wise moments (optimizer.state_dtype "q8", kestrel/ops/adamw_q8.h) of a range that
// starts on a quantisation block: codes and scales from there, `index0` the range's first element
// in the whole tensor (the Philox draw of element i is word index0 + i), `moment_seed` as
// adamw_step_q8's.
struct HostQ8State {
  uint8_t* m_codes;
  uint8_t* v_codes;
  float* m_scale;
  float* v_scale;
  uint64_t index0, moment_seed;
};

// AdamW with q8 moments on the host: master[0, n) and the codes/scales of the blocks covering it,
// bit-identical to adamw_step_q8 on the CPU or CUDA (the same element arithmetic, the same code).
// Per block: dequantise + update into a local buffer (a loop without branches), then the block's
// absmax and the codes. Single-threaded: callers split the range along blocks.
void host_adamw_q8_update(float* master, const HostQ8State& q, const void* grad, DType grad_dtype, void* out,
                          DType out_dtype, int64_t n, const HostAdamWConstants& c);

}  // namespace kestrel::train
