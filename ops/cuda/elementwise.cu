// CUDA elementwise kernels (binary, unary, where) for the slots in kernels/elementwise.h.
//
// Fast path: every operand contiguous, one dtype, 16-byte aligned -> 16-byte vector loads and
// stores (8 bf16/f16 or 4 f32 each, 4 vectors per thread) with a scalar tail, op chosen by a
// uniform switch.
// Anything else (broadcast operands, permuted views, mixed dtypes) runs the generic kernel: a
// coalesced strided indexer and runtime-typed loads. Math in f32; f64 is rejected on CUDA.
#include <algorithm>

#include "cuda/common.cuh"
#include "kernels/elementwise.h"

namespace kestrel::cuda_ops {
namespace {
using kernels::BinaryOp;
using kernels::UnaryOp;

__device__ __forceinline__ float apply_binary(BinaryOp op, float a, float b) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::Maximum: return (a > b || isnan(a)) ? a : b;
    case BinaryOp::Minimum: return (a < b || isnan(a)) ? a : b;
  }
  return a;
}

__device__ __forceinline__ float apply_unary(UnaryOp op, float x, float s) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return expf(x);
    case UnaryOp::Log: return logf(x);
    case UnaryOp::Sqrt: return sqrtf(x);
    case UnaryOp::Rsqrt: return 1.0f / sqrtf(x);
    case UnaryOp::Tanh: return tanhf(x);
    case UnaryOp::Abs: return fabsf(x);
    case UnaryOp::Sigmoid: return 1.0f / (1.0f + expf(-x));
    case UnaryOp::Square: return x * x;
    case UnaryOp::Scale: return x * s;
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::PowScalar: return powf(x, s);
    case UnaryOp::Sign: return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f);
  }
  return x;
}

// ---- contiguous, vectorised ----
// One pass, no grid-stride loop: a block covers kPacks x kBlock consecutive 16-byte vectors
// (coalesced per pack), each thread issues all its loads before any arithmetic (kPacks x 16 bytes
// per operand in flight, which copy bandwidth needs and a one-vector grid-stride loop did not give;
// bench/notes/cuda_ops.md has the A/B). The last n % N elements are done by the first threads of
// block 0.
constexpr int kBlock = 256, kPacks = 4;

template <typename T>
unsigned vec_grid(int64_t n) {
  const int64_t per_block = static_cast<int64_t>(kBlock) * kPacks;
  return static_cast<unsigned>(std::max<int64_t>(1, (n / Vec<T>::N + per_block - 1) / per_block));
}

template <typename T>
__global__ __launch_bounds__(kBlock) void binary_vec_kernel(BinaryOp op, T* __restrict__ out,
                                                            const T* __restrict__ a, const T* __restrict__ b,
                                                            int64_t n) {
  constexpr int N = Vec<T>::N;
  const int64_t nvec = n / N;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kBlock * kPacks + threadIdx.x;
  Vec<T> va[kPacks], vb[kPacks];
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
    const int64_t i = base + static_cast<int64_t>(u) * kBlock;
    if (i < nvec) va[u] = load_vec(a + i * N), vb[u] = load_vec(b + i * N);
  }
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
    const int64_t i = base + static_cast<int64_t>(u) * kBlock;
    if (i < nvec) {
#pragma unroll
      for (int j = 0; j < N; ++j) va[u].v[j] = from_f32<T>(apply_binary(op, to_f32(va[u].v[j]), to_f32(vb[u].v[j])));
      store_vec(out + i * N, va[u]);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < n - nvec * N) {
    const int64_t i = nvec * N + threadIdx.x;
    out[i] = from_f32<T>(apply_binary(op, to_f32(a[i]), to_f32(b[i])));
  }
}

template <typename T>
__global__ __launch_bounds__(kBlock) void unary_vec_kernel(UnaryOp op, T* __restrict__ out,
                                                           const T* __restrict__ x, float s, int64_t n) {
  constexpr int N = Vec<T>::N;
  const int64_t nvec = n / N;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kBlock * kPacks + threadIdx.x;
  Vec<T> vx[kPacks];
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
    const int64_t i = base + static_cast<int64_t>(u) * kBlock;
    if (i < nvec) vx[u] = load_vec(x + i * N);
  }
#pragma unroll
  for (int u = 0; u < kPacks; ++u) {
    const int64_t i = base + static_cast<int64_t>(u) * kBlock;
    if (i < nvec) {
#pragma unroll
      for (int j = 0; j < N; ++j) vx[u].v[j] = from_f32<T>(apply_unary(op, to_f32(vx[u].v[j]), s));
      store_vec(out + i * N, vx[u]);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x < n - nvec * N) {
    const int64_t i = nvec * N + threadIdx.x;
    out[i] = from_f32<T>(apply_unary(op, to_f32(x[i]), s));
  }
}

// ---- generic: strided, runtime dtypes ----
struct Operand {
  const void* p;
  DType t;
};

__global__ void binary_generic_kernel(BinaryOp op, Indexer<3> ix, void* out, DType ot, Operand a, Operand b,
                                      int64_t n) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    int64_t off[3];
    ix.offsets(i, off);
    float r = apply_binary(op, load_as_f32(a.p, off[1], a.t), load_as_f32(b.p, off[2], b.t));
    store_f32_as(out, off[0], ot, r);
  }
}

__global__ void unary_generic_kernel(UnaryOp op, Indexer<2> ix, void* out, DType ot, Operand x, float s, int64_t n) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    int64_t off[2];
    ix.offsets(i, off);
    store_f32_as(out, off[0], ot, apply_unary(op, load_as_f32(x.p, off[1], x.t), s));
  }
}

// Copies the selected operand's element bits (no rounding through f32).
__global__ void where_kernel(Indexer<4> ix, void* out, int elem_bytes, Operand cond, const void* a, const void* b,
                             int64_t n) {
  int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    int64_t off[4];
    ix.offsets(i, off);
    bool c;
    switch (cond.t) {
      case DType::I64: c = static_cast<const int64_t*>(cond.p)[off[1]] != 0; break;
      case DType::I32: c = static_cast<const int32_t*>(cond.p)[off[1]] != 0; break;
      case DType::U8:
      case DType::Bool: c = static_cast<const uint8_t*>(cond.p)[off[1]] != 0; break;
      default: c = load_as_f32(cond.p, off[1], cond.t) != 0.0f; break;
    }
    if (elem_bytes == 4)
      static_cast<uint32_t*>(out)[off[0]] = static_cast<const uint32_t*>(c ? a : b)[c ? off[2] : off[3]];
    else
      static_cast<uint16_t*>(out)[off[0]] = static_cast<const uint16_t*>(c ? a : b)[c ? off[2] : off[3]];
  }
}

void binary_cuda(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  check_cuda_dtype(out.dtype(), "binary");
  check_cuda_dtype(a.dtype(), "binary");
  check_cuda_dtype(b.dtype(), "binary");
  cudaStream_t s = cuda::current_stream();
  int64_t n = out.numel();
  bool fast = a.dtype() == out.dtype() && b.dtype() == out.dtype() && out.is_contiguous() && a.is_contiguous() &&
              b.is_contiguous() && aligned16(out.data_ptr()) && aligned16(a.data_ptr()) && aligned16(b.data_ptr());
  if (fast) {
    dispatch_cuda_float(out.dtype(), "binary", [&](auto tag) {
      using T = decltype(tag);
      binary_vec_kernel<T><<<vec_grid<T>(n), kBlock, 0, s>>>(op, ptr<T>(out), ptr<const T>(a),
                                                                                 ptr<const T>(b), n);
    });
  } else {
    auto ix = make_indexer<3>(out.shape(), {&out, &a, &b}, "binary");
    binary_generic_kernel<<<grid_for(n, kBlock), kBlock, 0, s>>>(op, ix, out.data_ptr(), out.dtype(),
                                                                 Operand{a.data_ptr(), a.dtype()},
                                                                 Operand{b.data_ptr(), b.dtype()}, n);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void unary_cuda(UnaryOp op, const Tensor& out, const Tensor& x, double sc) {
  check_cuda_dtype(out.dtype(), "unary");
  check_cuda_dtype(x.dtype(), "unary");
  cudaStream_t s = cuda::current_stream();
  int64_t n = out.numel();
  float sf = static_cast<float>(sc);
  if (x.dtype() == out.dtype() && out.is_contiguous() && x.is_contiguous() && aligned16(out.data_ptr()) &&
      aligned16(x.data_ptr())) {
    dispatch_cuda_float(out.dtype(), "unary", [&](auto tag) {
      using T = decltype(tag);
      unary_vec_kernel<T><<<vec_grid<T>(n), kBlock, 0, s>>>(op, ptr<T>(out), ptr<const T>(x), sf,
                                                                                n);
    });
  } else {
    auto ix = make_indexer<2>(out.shape(), {&out, &x}, "unary");
    unary_generic_kernel<<<grid_for(n, kBlock), kBlock, 0, s>>>(op, ix, out.data_ptr(), out.dtype(),
                                                                Operand{x.data_ptr(), x.dtype()}, sf, n);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void where_cuda(const Tensor& out, const Tensor& cond, const Tensor& a, const Tensor& b) {
  check_cuda_dtype(out.dtype(), "where");
  KESTREL_CHECK(cond.dtype() != DType::F64, "where", "f64 tensors are not supported on CUDA");
  KESTREL_CHECK(a.dtype() == out.dtype() && b.dtype() == out.dtype(), "where", "operand dtypes differ from ",
                dtype_name(out.dtype()));
  int64_t n = out.numel();
  auto ix = make_indexer<4>(out.shape(), {&out, &cond, &a, &b}, "where");
  where_kernel<<<grid_for(n, kBlock), kBlock, 0, cuda::current_stream()>>>(
      ix, out.data_ptr(), static_cast<int>(dtype_size(out.dtype())), Operand{cond.data_ptr(), cond.dtype()},
      a.data_ptr(), b.data_ptr(), n);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace

KESTREL_REGISTER_KERNEL(binary, cuda, binary_cuda);
KESTREL_REGISTER_KERNEL(unary, cuda, unary_cuda);
KESTREL_REGISTER_KERNEL(where, cuda, where_cuda);

}  // namespace kestrel::cuda_ops
