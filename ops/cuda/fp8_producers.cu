// CUDA FP8 producers (kernels/activation.h swiglu_fp8_forward / swiglu_fp8_backward). The forward:
// SwiGLU writing, in the same pass as its bf16 output y, its FP8 copy for linear_fp8: X8 [Rp, C] and
// X8T [C, Rp] (kernels/fp8.h Fp8CastTarget), the codes of the stored (bf16-rounded) y, the amax folded
// as the standalone cast would. The bits are those of the plain kernel followed by the cast:
// fp8_codes.cuh's 128 x 128 tile kernel with a source that computes y from gate and up
// (activation_math.cuh's formula, as activation.cu) and stores it. The backward: dgate and dup
// computed from gate, up and dy and cast for the gate and up projections' backward GEMMs (the
// two-output tile kernel), without storing them in bf16 (swiglu_gate_up_fp8, kestrel/ops/fp8_producers.h). (The norms' fused kernels measured slower than the plain kernel and
// the standalone cast and were removed: kestrel/ops/fp8_producers.h.)
#include <initializer_list>

#include "cuda/activation_math.cuh"
#include "cuda/fp8_codes.cuh"
#include "kernels/activation.h"

namespace kestrel::cuda_ops {
namespace {

bool aligned_all(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined() && !aligned16(t->data_ptr())) return false;
  return true;
}

// y = swiglu(gate, up) [R, C] bf16 as the tile kernel's source: y stored, its values cast.
struct SwigluSource {
  static constexpr int kBatch = 2;  // 32 bytes of loads per unit: a quarter of the units in flight at once
  struct Raw {
    Vec<bf16_t> g, u;
  };
  const bf16_t* __restrict__ gate;
  const bf16_t* __restrict__ up;
  bf16_t* __restrict__ y;
  int64_t C;
  __device__ __forceinline__ Raw fetch(int64_t r, int64_t c) const {
    return {load_vec(gate + r * C + c), load_vec(up + r * C + c)};
  }
  __device__ __forceinline__ void finish(const Raw& w, int64_t r, int64_t c, float (&v)[8]) const {
    Vec<bf16_t> o;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      o.v[j] = from_f32<bf16_t>(swiglu_f32(to_f32(w.g.v[j]), to_f32(w.u.v[j])));
      v[j] = to_f32(o.v[j]);
    }
    store_vec(y + r * C + c, o);
  }
};

bool swiglu_fp8_cuda(const Tensor& out, const Tensor& gate, const Tensor& up, const kernels::Fp8CastTarget& e) {
  const int64_t R = out.shape()[0], C = out.shape()[1];
  if (out.dtype() != DType::BF16 || !e.out.defined() || e.padded_rows() < R) return false;
  const fp8::CastArgs a = fp8::cast_args(e, e.padded_rows());
  if (!fp8::tile_path_fits(a, C) || !aligned_all({&out, &gate, &up})) return false;
  fp8::launch_cast_tile(SwigluSource{ptr<const bf16_t>(gate), ptr<const bf16_t>(up), ptr<bf16_t>(out), C}, a, R, C);
  return true;
}

// SwiGLU's backward as the two-output tile kernel's source: dgate and dup from gate, up and dy,
// rounded to bf16 as swiglu_backward stores them (activation_math.cuh's formula, as activation.cu),
// and cast; nothing stored in bf16.
struct SwigluGradSource {
  static constexpr int kBatch = 2;
  struct Raw {
    Vec<bf16_t> g, u, dy;
  };
  const bf16_t* __restrict__ gate;
  const bf16_t* __restrict__ up;
  const bf16_t* __restrict__ dy;
  int64_t C;
  __device__ __forceinline__ Raw fetch(int64_t r, int64_t c) const {
    return {load_vec(gate + r * C + c), load_vec(up + r * C + c), load_vec(dy + r * C + c)};
  }
  __device__ __forceinline__ void finish(const Raw& w, int64_t, int64_t, float (&dg)[8], float (&du)[8]) const {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float a, b;
      swiglu_grad_f32(to_f32(w.g.v[j]), to_f32(w.u.v[j]), to_f32(w.dy.v[j]), a, b);
      dg[j] = to_f32(from_f32<bf16_t>(a));
      du[j] = to_f32(from_f32<bf16_t>(b));
    }
  }
};

bool swiglu_fp8_backward_cuda(const kernels::Fp8CastTarget& eg, const kernels::Fp8CastTarget& eu, const Tensor& gate,
                              const Tensor& up, const Tensor& dy) {
  const int64_t R = gate.shape()[0], C = gate.shape()[1];
  if (gate.dtype() != DType::BF16 || up.dtype() != DType::BF16 || dy.dtype() != DType::BF16) return false;
  const int64_t Rp = eg.padded_rows();
  if (Rp < R || eu.padded_rows() != Rp || eg.out.defined() != eu.out.defined() ||
      eg.out_t.defined() != eu.out_t.defined() || (!eg.out.defined() && !eg.out_t.defined()))
    return false;
  const fp8::CastArgs ag = fp8::cast_args(eg, Rp), au = fp8::cast_args(eu, Rp);
  if (!fp8::tile_path_fits(ag, C) || !fp8::tile_path_fits(au, C) || !aligned_all({&gate, &up, &dy})) return false;
  fp8::launch_cast_tile2(SwigluGradSource{ptr<const bf16_t>(gate), ptr<const bf16_t>(up), ptr<const bf16_t>(dy), C}, ag,
                         au, R, C);
  return true;
}

}  // namespace

KESTREL_REGISTER_KERNEL(swiglu_fp8_forward, cuda, swiglu_fp8_cuda);
KESTREL_REGISTER_KERNEL(swiglu_fp8_backward, cuda, swiglu_fp8_backward_cuda);

}  // namespace kestrel::cuda_ops
