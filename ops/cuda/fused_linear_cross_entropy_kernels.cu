// Kernels of the fused linear + cross-entropy (see fused_linear_cross_entropy.h for the algorithm):
// label check, per-chunk row statistics (two-level log-sum-exp), row finalisation, in-place
// softmax-minus-one-hot gradient, the fixed-order loss reduction, and scale_by_device_scalar.
// All are memory-bound; loads and stores are 16 bytes wide where the layout allows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "cuda/fused_linear_cross_entropy_internal.h"
#include "kestrel/cuda/check.h"
#include "kestrel/cuda/context.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda {
namespace fused_ce {
namespace {

constexpr float kNegInf = -INFINITY;

template <class T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <class T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// (max, sum of exp(x - max)) pairs; an empty side (max = -inf) contributes nothing.
struct MaxSum {
  float m;
  float s;
};
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  if (a.m == kNegInf) return b;
  if (b.m == kNegInf) return a;
  float m = fmaxf(a.m, b.m);
  return {m, a.s * __expf(a.m - m) + b.s * __expf(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
  for (int off = 16; off > 0; off >>= 1) {
    MaxSum o{__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)};
    v = combine(v, o);
  }
  return v;
}

// Block-wide reductions for blocks of kThreads (multiple of 32); result broadcast to every thread.
template <int kThreads>
__device__ MaxSum block_combine(MaxSum v) {
  __shared__ float sm[kThreads / 32], ss[kThreads / 32];
  v = warp_combine(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { sm[warp] = v.m; ss[warp] = v.s; }
  __syncthreads();
  v = lane < kThreads / 32 ? MaxSum{sm[lane], ss[lane]} : MaxSum{kNegInf, 0.0f};
  v = warp_combine(v);
  __syncthreads();
  return v;
}
template <int kThreads, class T>
__device__ T block_sum(T v) {
  __shared__ T sv[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) sv[warp] = v;
  __syncthreads();
  v = lane < kThreads / 32 ? sv[lane] : T(0);
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  __syncthreads();
  return v;
}

__device__ __forceinline__ bool label_valid(int64_t y, int64_t vocab) { return y >= 0 && y < vocab; }

// ---- prepare: one block ----
constexpr int kPrepareThreads = 1024;
__global__ void __launch_bounds__(kPrepareThreads)
prepare_kernel(const int64_t* __restrict__ labels, const float* __restrict__ weights, int64_t n, int64_t vocab,
               int64_t ignore_index, float* __restrict__ weight_sum, int* __restrict__ error_flag) {
  float sum = 0.0f;
  int bad = 0;
  for (int64_t i = threadIdx.x; i < n; i += kPrepareThreads) {
    const int64_t y = labels[i];
    if (y == ignore_index) continue;
    if (!label_valid(y, vocab)) { bad = 1; continue; }
    sum += weights ? weights[i] : 1.0f;
  }
  sum = block_sum<kPrepareThreads>(sum);
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) {
    *weight_sum = sum;
    if (bad && error_flag) atomicOr(error_flag, kLabelOutOfRange);
  }
}

// ---- chunk statistics: one block per row of the token chunk ----
constexpr int kStatsThreads = 256;

template <class StoreT>
__device__ __forceinline__ void store4(StoreT* p, float4 v, float shift) {
  Vec<StoreT, 4> o;
  o.v[0] = from_float<StoreT>(v.x - shift);
  o.v[1] = from_float<StoreT>(v.y - shift);
  o.v[2] = from_float<StoreT>(v.z - shift);
  o.v[3] = from_float<StoreT>(v.w - shift);
  *reinterpret_cast<Vec<StoreT, 4>*>(p) = o;
}

__device__ __forceinline__ void online_add(MaxSum& acc, float x) {
  if (x > acc.m) {
    acc.s = acc.s * __expf(acc.m - x) + 1.0f;  // acc.m == -inf gives 0 * 0 + 1
    acc.m = x;
  } else {
    acc.s += __expf(x - acc.m);
  }
}

// Vectorised path needs ld_logits % 4 == 0, v0 % 4 == 0, ld_store % 4 == 0 (the launcher guarantees it).
template <class StoreT>
__global__ void __launch_bounds__(kStatsThreads) chunk_stats_kernel(ChunkStatsArgs a) {
  const int64_t r = blockIdx.x;
  const float* __restrict__ x = a.logits + r * a.ld_logits;  // [vc]
  const int64_t vc4 = a.vc / 4;
  MaxSum acc{kNegInf, 0.0f};
  float lsum = 0.0f;
  for (int64_t j = threadIdx.x; j < vc4; j += kStatsThreads) {
    const float4 v = reinterpret_cast<const float4*>(x)[j];
    online_add(acc, v.x);
    online_add(acc, v.y);
    online_add(acc, v.z);
    online_add(acc, v.w);
    lsum += (v.x + v.y) + (v.z + v.w);
  }
  for (int64_t j = vc4 * 4 + threadIdx.x; j < a.vc; j += kStatsThreads) {
    const float v = x[j];
    online_add(acc, v);
    lsum += v;
  }
  const MaxSum row = block_combine<kStatsThreads>(acc);
  lsum = block_sum<kStatsThreads>(lsum);

  if (a.store != nullptr) {
    StoreT* __restrict__ out = static_cast<StoreT*>(a.store) + r * a.ld_store + a.v0;  // [vc]
    for (int64_t j = threadIdx.x; j < vc4; j += kStatsThreads)
      store4(out + 4 * j, reinterpret_cast<const float4*>(x)[j], row.m);
    for (int64_t j = vc4 * 4 + threadIdx.x; j < a.vc; j += kStatsThreads)
      out[j] = from_float<StoreT>(x[j] - row.m);
  }
  if (threadIdx.x == 0) {
    const int64_t idx = r * a.n_vchunks + a.chunk;
    a.pmax[idx] = row.m;
    a.psum[idx] = row.s;
    a.plsum[idx] = lsum;
    const int64_t y = a.labels[r];
    if (y != a.ignore_index && label_valid(y, a.vocab) && y >= a.v0 && y < a.v0 + a.vc)
      a.label_logit[r] = x[y - a.v0];
  }
}

// ---- row finalisation: one thread per row ----
constexpr int kRowThreads = 128;
__global__ void __launch_bounds__(kRowThreads) row_finalize_kernel(RowFinalizeArgs a) {
  const int64_t r = blockIdx.x * int64_t(kRowThreads) + threadIdx.x;
  if (r >= a.nc) return;
  const int64_t i = a.t0 + r;
  MaxSum acc{kNegInf, 0.0f};
  float lsum = 0.0f;
  for (int c = 0; c < a.n_vchunks; ++c) {
    const int64_t idx = r * a.n_vchunks + c;
    acc = combine(acc, MaxSum{a.pmax[idx], a.psum[idx]});
    lsum += a.plsum[idx];
  }
  const float lse = acc.m + logf(acc.s);
  if (a.lse_out) a.lse_out[i] = lse;

  const int64_t y = a.labels[i];
  const bool valid = y != a.ignore_index && label_valid(y, a.vocab);
  const float w = a.token_weights ? a.token_weights[i] : 1.0f;
  float c = 0.0f;
  if (valid) {
    const float eps = a.label_smoothing;
    const float nll = lse - a.label_logit[r];
    const float smooth = lse - lsum / float(a.vocab);
    const float loss = (1.0f - eps) * nll + eps * smooth + a.z_loss * lse * lse;
    a.token_loss[i] = w * loss;
    const float denom = *a.weight_sum;
    c = a.mean ? (denom != 0.0f ? w / denom : 0.0f) : w;
    if (a.upstream_grad) c *= *a.upstream_grad;
  } else {
    a.token_loss[i] = 0.0f;
  }
  a.row_coef[r] = c * (1.0f + 2.0f * a.z_loss * lse);                         // a: times p_j
  a.row_coef[a.nc + r] = c * (1.0f - a.label_smoothing);                      // b: at the label
  a.row_coef[2 * a.nc + r] = c * a.label_smoothing / float(a.vocab);          // e: every column
  a.row_coef[3 * a.nc + r] = valid ? lse : 0.0f;                              // lse (0 keeps ignored rows finite)
}

// ---- gradient: 8 columns per thread, in place ----
constexpr int kGradThreads = 256;
constexpr int kGradVec = 8;
template <class StoreT, class GradT>
__global__ void __launch_bounds__(kGradThreads) form_grad_kernel(FormGradArgs a) {
  static_assert(sizeof(StoreT) == sizeof(GradT), "in-place gradient needs equal element sizes");
  const int64_t r = blockIdx.y;
  const int64_t j0 = (blockIdx.x * int64_t(kGradThreads) + threadIdx.x) * kGradVec;
  if (j0 >= a.ld_store) return;
  const float coef_a = a.row_coef[r], coef_b = a.row_coef[a.nc + r], coef_e = a.row_coef[2 * a.nc + r];
  const float lse = a.row_coef[3 * a.nc + r];
  const int64_t y = a.labels[r];
  const int chunk = int(j0 / a.vocab_chunk);
  const float shift = chunk < a.n_vchunks ? a.pmax[r * a.n_vchunks + chunk] - lse : 0.0f;
  auto* p = reinterpret_cast<Vec<StoreT, kGradVec>*>(static_cast<StoreT*>(a.store) + r * a.ld_store + j0);
  const Vec<StoreT, kGradVec> s = *p;
  Vec<GradT, kGradVec> g;
#pragma unroll
  for (int t = 0; t < kGradVec; ++t) {
    const int64_t j = j0 + t;
    float v = 0.0f;
    if (j < a.vocab) {
      // coef_a == 0 (ignored row) must give 0 even if that row's logits overflowed.
      v = (coef_a == 0.0f ? 0.0f : coef_a * __expf(to_float(s.v[t]) + shift)) - coef_e;
      if (j == y) v -= coef_b;
    }
    g.v[t] = from_float<GradT>(v);
  }
  *reinterpret_cast<Vec<GradT, kGradVec>*>(p) = g;
}

// ---- loss: one block, fixed order ----
constexpr int kLossThreads = 1024;
__global__ void __launch_bounds__(kLossThreads)
final_loss_kernel(const float* __restrict__ token_loss, int64_t n, const float* __restrict__ weight_sum,
                  bool mean, float* __restrict__ loss) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kLossThreads) sum += token_loss[i];
  sum = block_sum<kLossThreads>(sum);
  if (threadIdx.x == 0) {
    const float denom = *weight_sum;
    *loss = mean ? (denom != 0.0f ? float(sum / double(denom)) : 0.0f) : float(sum);
  }
}

template <class T>
__global__ void scale_kernel(T* __restrict__ data, size_t n, const float* __restrict__ scalar) {
  const float s = *scalar;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    data[i] = from_float<T>(to_float(data[i]) * s);
}

// ---- backward from a saved lse (fused_linear_cross_entropy_backward.cu) ----
constexpr int kCoefThreads = 256;
__global__ void __launch_bounds__(kCoefThreads) row_coef_from_lse_kernel(LseCoefArgs a) {
  const int64_t i = blockIdx.x * int64_t(kCoefThreads) + threadIdx.x;
  if (i >= a.n) return;
  const int64_t y = a.labels[i];
  const bool valid = y != a.ignore_index && label_valid(y, a.vocab);
  const float lse = a.lse[i];
  float c = 0.0f;
  if (valid) {
    const float w = a.token_weights ? a.token_weights[i] : 1.0f;
    const float denom = *a.weight_sum;
    c = a.mean ? (denom != 0.0f ? w / denom : 0.0f) : w;
    if (a.upstream_grad) c *= *a.upstream_grad;
  }
  // The coefficients of row_finalize_kernel: dloss/dlogit_j = a p_j - e - [j == y] b.
  a.row_coef[i] = c * (1.0f + 2.0f * a.z_loss * lse);
  a.row_coef[a.n + i] = c * (1.0f - a.label_smoothing);
  a.row_coef[2 * a.n + i] = c * a.label_smoothing / float(a.vocab);
  a.row_coef[3 * a.n + i] = valid ? lse : 0.0f;
}

// 4 columns per thread: f32 logits in, the gradient in the input dtype out (both [nc, ld]).
constexpr int kLseGradThreads = 256;
template <class GradT>
__global__ void __launch_bounds__(kLseGradThreads) grad_from_lse_kernel(LseGradArgs a) {
  const int64_t j0 = (blockIdx.x * int64_t(kLseGradThreads) + threadIdx.x) * 4;
  if (j0 >= a.vc) return;
  for (int64_t r = blockIdx.y; r < a.nc; r += gridDim.y) {
    const int64_t i = a.t0 + r;
    const float ca = a.row_coef[i], cb = a.row_coef[a.n + i], ce = a.row_coef[2 * a.n + i];
    const float lse = a.row_coef[3 * a.n + i];
    const int64_t y = a.labels[i] - a.v0;
    const float4 x = *reinterpret_cast<const float4*>(a.logits + r * a.ld + j0);
    const float xs[4] = {x.x, x.y, x.z, x.w};
    Vec<GradT, 4> g;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      // ca == 0 (ignored row) gives 0 even where that row's logits overflow.
      float v = (ca == 0.0f ? 0.0f : ca * __expf(xs[t] - lse)) - ce;
      if (j0 + t == y) v -= cb;
      g.v[t] = from_float<GradT>(j0 + t < a.vc ? v : 0.0f);
    }
    *reinterpret_cast<Vec<GradT, 4>*>(static_cast<GradT*>(a.grad) + r * a.ld + j0) = g;
  }
}

template <class T>
__global__ void store_f32_kernel(T* __restrict__ dst, const float* __restrict__ src, int64_t n, bool add) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = from_float<T>(add ? src[i] + to_float(dst[i]) : src[i]);
}

}  // namespace

void launch_prepare(const int64_t* labels, const float* token_weights, int64_t n, int64_t vocab,
                    int64_t ignore_index, float* weight_sum, int* error_flag, cudaStream_t stream) {
  prepare_kernel<<<1, kPrepareThreads, 0, stream>>>(labels, token_weights, n, vocab, ignore_index, weight_sum,
                                                    error_flag);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void launch_chunk_stats(const ChunkStatsArgs& a, DType dtype, cudaStream_t stream) {
  KESTREL_ASSERT(a.ld_logits % 4 == 0 && a.v0 % 4 == 0 && (a.store == nullptr || a.ld_store % 4 == 0));
  if (a.nc == 0) return;
  if (dtype == DType::F32)
    chunk_stats_kernel<float><<<unsigned(a.nc), kStatsThreads, 0, stream>>>(a);
  else
    chunk_stats_kernel<__half><<<unsigned(a.nc), kStatsThreads, 0, stream>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void launch_row_finalize(const RowFinalizeArgs& a, cudaStream_t stream) {
  if (a.nc == 0) return;
  row_finalize_kernel<<<unsigned((a.nc + kRowThreads - 1) / kRowThreads), kRowThreads, 0, stream>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void launch_form_grad(const FormGradArgs& a, DType dtype, cudaStream_t stream) {
  KESTREL_ASSERT(a.ld_store % kGradVec == 0 && a.vocab_chunk % kGradVec == 0);
  KESTREL_CHECK(a.nc <= 65535, "fused_linear_cross_entropy", "token chunk ", a.nc, " exceeds 65535");
  if (a.nc == 0) return;
  const int64_t per_block = int64_t(kGradThreads) * kGradVec;
  const dim3 grid(unsigned((a.ld_store + per_block - 1) / per_block), unsigned(a.nc));
  switch (dtype) {
    case DType::BF16: form_grad_kernel<__half, __nv_bfloat16><<<grid, kGradThreads, 0, stream>>>(a); break;
    case DType::F16: form_grad_kernel<__half, __half><<<grid, kGradThreads, 0, stream>>>(a); break;
    case DType::F32: form_grad_kernel<float, float><<<grid, kGradThreads, 0, stream>>>(a); break;
    default: KESTREL_ASSERT(false);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void launch_final_loss(const float* token_loss, int64_t n, const float* weight_sum, bool mean, float* loss,
                       cudaStream_t stream) {
  final_loss_kernel<<<1, kLossThreads, 0, stream>>>(token_loss, n, weight_sum, mean, loss);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace fused_ce

void scale_by_device_scalar(void* data, DType dtype, size_t n, const float* scalar, cudaStream_t stream) {
  if (n == 0) return;
  const unsigned threads = 256;
  const unsigned blocks = unsigned(std::min<size_t>((n + threads - 1) / threads, size_t(16) * sm_count()));
  switch (dtype) {
    case DType::F32:
      fused_ce::scale_kernel<float><<<blocks, threads, 0, stream>>>(static_cast<float*>(data), n, scalar);
      break;
    case DType::BF16:
      fused_ce::scale_kernel<__nv_bfloat16>
          <<<blocks, threads, 0, stream>>>(static_cast<__nv_bfloat16*>(data), n, scalar);
      break;
    case DType::F16:
      fused_ce::scale_kernel<__half><<<blocks, threads, 0, stream>>>(static_cast<__half*>(data), n, scalar);
      break;
    default:
      throw make_error("scale_by_device_scalar", "dtype must be f32, bf16 or f16, got ", dtype_name(dtype));
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda

namespace kestrel::cuda::fused_ce {

void launch_row_coef_from_lse(const LseCoefArgs& a, cudaStream_t stream) {
  if (a.n == 0) return;
  row_coef_from_lse_kernel<<<unsigned((a.n + kCoefThreads - 1) / kCoefThreads), kCoefThreads, 0, stream>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
}

void launch_grad_from_lse(const LseGradArgs& a, DType dtype, cudaStream_t stream) {
  KESTREL_ASSERT(a.ld % 4 == 0);
  if (a.nc == 0 || a.vc == 0) return;
  const int64_t per_block = int64_t(kLseGradThreads) * 4;
  const dim3 grid(unsigned((a.vc + per_block - 1) / per_block), unsigned(std::min<int64_t>(a.nc, 65535)));
  switch (dtype) {
    case DType::BF16: grad_from_lse_kernel<__nv_bfloat16><<<grid, kLseGradThreads, 0, stream>>>(a); break;
    case DType::F16: grad_from_lse_kernel<__half><<<grid, kLseGradThreads, 0, stream>>>(a); break;
    case DType::F32: grad_from_lse_kernel<float><<<grid, kLseGradThreads, 0, stream>>>(a); break;
    default: KESTREL_ASSERT(false);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void launch_store_f32(void* dst, DType dtype, const float* src, int64_t n, bool add, cudaStream_t stream) {
  if (n == 0) return;
  const unsigned grid = unsigned(std::min<int64_t>((n + 255) / 256, int64_t{16} * sm_count()));
  switch (dtype) {
    case DType::BF16: store_f32_kernel<<<grid, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(dst), src, n, add); break;
    case DType::F16: store_f32_kernel<<<grid, 256, 0, stream>>>(static_cast<__half*>(dst), src, n, add); break;
    case DType::F32: store_f32_kernel<<<grid, 256, 0, stream>>>(static_cast<float*>(dst), src, n, add); break;
    default: KESTREL_ASSERT(false);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::fused_ce
