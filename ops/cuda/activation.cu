// CUDA activation kernels (SiLU, GELU erf/tanh, ReLU, SwiGLU; forward and backward) for the slots in
// kernels/activation.h. Contiguous operands of one dtype: 16-byte vector loads/stores when every
// pointer is 16-byte aligned, scalar otherwise, f32 math (the same formulas as cpu/activation.cpp).
#include "cuda/activation_math.cuh"
#include "cuda/common.cuh"
#include "kernels/activation.h"

namespace kestrel::cuda_ops {
namespace {
using kernels::Activation;

__device__ __forceinline__ float sigmoidf_(float x) { return sigmoid_f32(x); }

__device__ __forceinline__ float act(Activation k, float x) {
  switch (k) {
    case Activation::Silu: return x * sigmoidf_(x);
    // erfc form: 0.5 (1 + erf(x / sqrt2)) cancels for x < -3.5, erfc(-x / sqrt2) does not.
    case Activation::GeluErf: return 0.5f * x * erfcf(-x * 0.70710678118654752f);
    // (1 + tanh u) / 2 = sigmoid(2u), as the CPU kernel: no cancellation of 1 + tanh u in the
    // negative tail (x = -3 costs 1e-2 relative in f32 the other way).
    case Activation::GeluTanh: return x * sigmoidf_(1.5957691216057308f * (x + 0.044715f * x * x * x));
    case Activation::Relu: return x > 0.0f ? x : 0.0f;
  }
  return x;
}

__device__ __forceinline__ float act_grad(Activation k, float x) {
  switch (k) {
    case Activation::Silu: {
      float s = sigmoidf_(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::GeluErf:
      return 0.5f * erfcf(-x * 0.70710678118654752f) + x * 0.3989422804014327f * __expf(-0.5f * x * x);
    case Activation::GeluTanh: {
      // s = sigmoid(2u) = (1 + tanh u) / 2 and 1 - tanh^2 u = 4 s (1 - s): no cancellation.
      const float c = 0.7978845608028654f;
      const float s = sigmoidf_(2.0f * c * (x + 0.044715f * x * x * x));
      return s + 2.0f * x * s * (1.0f - s) * c * (1.0f + 3.0f * 0.044715f * x * x);
    }
    case Activation::Relu: return x > 0.0f ? 1.0f : 0.0f;
  }
  return 1.0f;
}

template <typename T, int NI, int NO>
struct Ptrs {
  const T* in[NI];
  T* out[NO];
};

// y[0..NO) = f(x[0..NI)) elementwise over n contiguous elements.
template <typename T, int NI, int NO, bool VEC, typename F>
__global__ void map_kernel(Ptrs<T, NI, NO> p, int64_t n, F f) {
  constexpr int N = VEC ? Vec<T>::N : 1;
  int64_t nchunk = n / N;
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < nchunk; c += stride) {
    float x[NI][N], y[NO][N];
#pragma unroll
    for (int i = 0; i < NI; ++i) load_chunk<T, N>(p.in[i] + c * N, x[i]);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float xi[NI], yo[NO];
#pragma unroll
      for (int i = 0; i < NI; ++i) xi[i] = x[i][j];
      f(xi, yo);
#pragma unroll
      for (int o = 0; o < NO; ++o) y[o][j] = yo[o];
    }
#pragma unroll
    for (int o = 0; o < NO; ++o) store_chunk<T, N>(p.out[o] + c * N, y[o]);
  }
  for (int64_t i = nchunk * N + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    float xi[NI], yo[NO];
#pragma unroll
    for (int k = 0; k < NI; ++k) xi[k] = to_f32(p.in[k][i]);
    f(xi, yo);
#pragma unroll
    for (int o = 0; o < NO; ++o) p.out[o][i] = from_f32<T>(yo[o]);
  }
}

template <int NI, int NO, typename F>
void launch_map(const char* op, DType dt, const std::array<const Tensor*, NI>& in,
                const std::array<const Tensor*, NO>& out, F f) {
  int64_t n = out[0]->numel();
  bool aligned = true;
  for (auto* t : in) {
    KESTREL_CHECK(t->is_contiguous() && t->dtype() == dt, op, "expected contiguous ", dtype_name(dt), " operands");
    aligned = aligned && aligned16(t->data_ptr());
  }
  for (auto* t : out) aligned = aligned && aligned16(t->data_ptr());
  cudaStream_t s = cuda::current_stream();
  dispatch_cuda_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    Ptrs<T, NI, NO> p;
    for (int i = 0; i < NI; ++i) p.in[i] = ptr<const T>(*in[i]);
    for (int o = 0; o < NO; ++o) p.out[o] = ptr<T>(*out[o]);
    constexpr int kBlock = 256;
    if (aligned)
      map_kernel<T, NI, NO, true><<<grid_for(n / Vec<T>::N + 1, kBlock), kBlock, 0, s>>>(p, n, f);
    else
      map_kernel<T, NI, NO, false><<<grid_for(n, kBlock), kBlock, 0, s>>>(p, n, f);
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

struct ActFwd {
  Activation k;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const { y[0] = act(k, x[0]); }
};
struct ActBwd {
  Activation k;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = x[1] * act_grad(k, x[0]); }
};
struct SwigluFwd {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = swiglu_f32(x[0], x[1]); }
};
struct SwigluBwd {  // x = {gate, up, dy}; y = {dgate, dup}
  __device__ void operator()(const float (&x)[3], float (&y)[2]) const { swiglu_grad_f32(x[0], x[1], x[2], y[0], y[1]); }
};

void activation_forward_cuda(Activation kind, const Tensor& out, const Tensor& x) {
  launch_map<1, 1>("activation", x.dtype(), {&x}, {&out}, ActFwd{kind});
}
void activation_backward_cuda(Activation kind, const Tensor& dx, const Tensor& x, const Tensor& dy) {
  launch_map<2, 1>("activation", x.dtype(), {&x, &dy}, {&dx}, ActBwd{kind});
}
void swiglu_forward_cuda(const Tensor& out, const Tensor& gate, const Tensor& up) {
  launch_map<2, 1>("swiglu", gate.dtype(), {&gate, &up}, {&out}, SwigluFwd{});
}
void swiglu_backward_cuda(const Tensor& dgate, const Tensor& dup, const Tensor& gate, const Tensor& up,
                          const Tensor& dy) {
  launch_map<3, 2>("swiglu", gate.dtype(), {&gate, &up, &dy}, {&dgate, &dup}, SwigluBwd{});
}

}  // namespace

KESTREL_REGISTER_KERNEL(activation_forward, cuda, activation_forward_cuda);
KESTREL_REGISTER_KERNEL(activation_backward, cuda, activation_backward_cuda);
KESTREL_REGISTER_KERNEL(swiglu_forward, cuda, swiglu_forward_cuda);
KESTREL_REGISTER_KERNEL(swiglu_backward, cuda, swiglu_backward_cuda);

}  // namespace kestrel::cuda_ops
