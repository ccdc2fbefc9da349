// CUDA optimizer slots (kernels/optim.h): multi-tensor AdamW, sum of squares and in-place scaling.
//
// Multi-tensor: up to kMaxTensors tensors per launch travel in the kernel's parameter struct; each
// tensor gets ceil(n / kChunk) blocks and a block finds its tensor in a prefix table. A 16-bit
// parameter without an f32 master is read widened and written back rounded like a copy. AdamW follows
// cpu/optim.cpp operation by operation with explicitly rounded f32 intrinsics (no FMA contraction), so
// the f32 master weights, moments and the stochastically rounded bf16/f16 copy (Philox word i of
// seed, offset 0) match the CPU bit for bit. sum_squares and scaling use 16-byte vectors on whole
// aligned chunks. sum_squares: per-block f64 partials, then one block adds
// them in a fixed order (deterministic); the slot returns a host double, so that read is the one
// synchronisation point. clip_by_global_norm keeps the norm and the clip factor on the device (the
// scale kernel reads the factor, or AdamW does: AdamWList::gscale), so clip_grad_norm_device and
// grad_clip_factor_device never synchronise.
#include <cstdint>
#include <vector>

#include "cuda/common.cuh"
#include "cuda/optim_rounding.cuh"
#include "kernels/optim.h"
#include "kestrel/runtime/memory.h"
#include "kestrel/runtime/philox.h"

namespace kestrel::cuda_ops {
namespace {

constexpr int kMaxTensors = 24;
constexpr int64_t kChunk = 8192;
constexpr int kBlock = 256;

struct AdamWList {
  int count;
  int block_start[kMaxTensors + 1];
  void* p[kMaxTensors];  // f32 master, or a bf16/f16 parameter without one (pt)
  float* m[kMaxTensors];
  float* v[kMaxTensors];
  const void* g[kMaxTensors];
  void* copy[kMaxTensors];
  int64_t n[kMaxTensors];
  uint64_t seed[kMaxTensors];
  const double* gscale[kMaxTensors];  // the clip factor the gradient is scaled by first, or null
  DType gt[kMaxTensors], ct[kMaxTensors], pt[kMaxTensors];
};

// The gradient value AdamW uses: g, or, with a clip factor s != 1, g * s rounded to the gradient's
// dtype as scale_kernel rounds it in place (double product, then f32, then the dtype), so a step with
// the factor equals clip_grad_norm_device's scaling followed by the step, bit for bit.
template <typename T>
__device__ __forceinline__ float scaled_grad(float g, double s) {
  return s == 1.0 ? g : to_f32(from_f32<T>(static_cast<float>(static_cast<double>(g) * s)));
}
__device__ __forceinline__ float scaled_grad(float g, double s, DType gt) {
  switch (gt) {
    case DType::BF16: return scaled_grad<bf16_t>(g, s);
    case DType::F16: return scaled_grad<f16_t>(g, s);
    default: return scaled_grad<float>(g, s);
  }
}


// One element of AdamW, operation by operation as cpu/optim.cpp computes it (explicitly rounded f32
// intrinsics: no FMA contraction), on the f32 value of the parameter.
__device__ __forceinline__ void adamw_update(float& p, float& m, float& v, float g, const AdamWConst& c) {
  p = __fmul_rn(p, c.decay);
  m = __fadd_rn(__fmul_rn(c.b1, m), __fmul_rn(c.one_minus_b1, g));
  v = __fadd_rn(__fmul_rn(c.b2, v), __fmul_rn(__fmul_rn(c.one_minus_b2, g), g));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bc2_sqrt), c.eps);
  p = __fsub_rn(p, __fdiv_rn(__fmul_rn(c.step_size, m), denom));
}

// Any dtypes: one element per thread and iteration.
__global__ void adamw_kernel(AdamWList L, AdamWConst c) {
  int t = find_tensor(L.block_start, L.count);
  int64_t n = L.n[t], base = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  float *m = L.m[t], *v = L.v[t];
  void* p = L.p[t];
  const DType pt = L.pt[t];
  const double gs = L.gscale[t] ? *L.gscale[t] : 1.0;
  for (int64_t i = base + threadIdx.x; i < n && i < base + kChunk; i += blockDim.x) {
    float pi = load_as_f32(p, i, pt), mi = m[i], vi = v[i];
    adamw_update(pi, mi, vi, scaled_grad(load_as_f32(L.g[t], i, L.gt[t]), gs, L.gt[t]), c);
    m[i] = mi;
    v[i] = vi;
    // Without a master the 16-bit parameter itself is the rounded copy.
    if (pt == DType::F32) {
      static_cast<float*>(p)[i] = pi;
      if (L.copy[t] != nullptr) store_rounded(L.copy[t], L.ct[t], i, pi, L.seed[t]);
    } else {
      store_rounded(p, pt, i, pi, L.seed[t]);
    }
  }
}

// The training case: an f32 master, a bf16 (kGradBf16) or f32 gradient, and a bf16 copy rounded to
// nearest (kCopy) or none. Four elements per thread and iteration through 16-byte loads and stores of
// the master and moments (the op profile had the one-element kernel at ~55% of the H200's bandwidth);
// the arithmetic is adamw_update's, so the results are the same bits. Pointers are 16-byte aligned
// (checked at launch); a chunk's last partial vector goes element by element.
template <bool kGradBf16, bool kCopy>
__global__ void adamw_f32_vec4_kernel(AdamWList L, AdamWConst c) {
  const int t = find_tensor(L.block_start, L.count);
  const int64_t base = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  const int64_t end = L.n[t] < base + kChunk ? L.n[t] : base + kChunk;
  float* p = static_cast<float*>(L.p[t]);
  float *m = L.m[t], *v = L.v[t];
  const uint16_t* g16 = static_cast<const uint16_t*>(L.g[t]);
  const float* g32 = static_cast<const float*>(L.g[t]);
  uint16_t* copy = static_cast<uint16_t*>(L.copy[t]);
  using G = std::conditional_t<kGradBf16, bf16_t, float>;
  const double gs = L.gscale[t] ? *L.gscale[t] : 1.0;
  auto grad = [&](int64_t i) {
    return scaled_grad<G>(kGradBf16 ? __bfloat162float(__ushort_as_bfloat16(g16[i])) : g32[i], gs);
  };
  auto bf16_bits = [](float x) { return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(x))); };
  for (int64_t i = base + 4 * static_cast<int64_t>(threadIdx.x); i < end; i += 4 * static_cast<int64_t>(blockDim.x)) {
    if (i + 4 > end) {
      for (int64_t j = i; j < end; ++j) {
        float pj = p[j], mj = m[j], vj = v[j];
        adamw_update(pj, mj, vj, grad(j), c);
        p[j] = pj;
        m[j] = mj;
        v[j] = vj;
        if constexpr (kCopy) copy[j] = static_cast<uint16_t>(bf16_bits(pj));
      }
      break;
    }
    float4 p4 = *reinterpret_cast<const float4*>(p + i), m4 = *reinterpret_cast<const float4*>(m + i),
           v4 = *reinterpret_cast<const float4*>(v + i);
    float g[4];
    if constexpr (kGradBf16) {
      const uint2 raw = *reinterpret_cast<const uint2*>(g16 + i);
      g[0] = __uint_as_float(raw.x << 16);
      g[1] = __uint_as_float(raw.x & 0xffff0000u);
      g[2] = __uint_as_float(raw.y << 16);
      g[3] = __uint_as_float(raw.y & 0xffff0000u);
    } else {
      const float4 g4 = *reinterpret_cast<const float4*>(g32 + i);
      g[0] = g4.x;
      g[1] = g4.y;
      g[2] = g4.z;
      g[3] = g4.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) g[j] = scaled_grad<G>(g[j], gs);
    adamw_update(p4.x, m4.x, v4.x, g[0], c);
    adamw_update(p4.y, m4.y, v4.y, g[1], c);
    adamw_update(p4.z, m4.z, v4.z, g[2], c);
    adamw_update(p4.w, m4.w, v4.w, g[3], c);
    *reinterpret_cast<float4*>(p + i) = p4;
    *reinterpret_cast<float4*>(m + i) = m4;
    *reinterpret_cast<float4*>(v + i) = v4;
    if constexpr (kCopy)
      *reinterpret_cast<uint2*>(copy + i) =
          make_uint2(bf16_bits(p4.x) | bf16_bits(p4.y) << 16, bf16_bits(p4.z) | bf16_bits(p4.w) << 16);
  }
}

// Which kernel a tensor takes: 0 the generic one, else 1 + (bf16 gradient) + 2 * (bf16 copy).
int adamw_kernel_class(const kernels::AdamWTensors& t) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const DType gt = t.grad.dtype();
  const bool copy = t.param_copy.defined();
  if (t.param.dtype() != DType::F32 || (gt != DType::BF16 && gt != DType::F32)) return 0;
  if (copy && (t.param_copy.dtype() != DType::BF16 || t.stochastic_rounding_seed != 0 || !aligned(t.param_copy.data_ptr())))
    return 0;
  if (!aligned(t.param.data_ptr()) || !aligned(t.m.data_ptr()) || !aligned(t.v.data_ptr()) || !aligned(t.grad.data_ptr()))
    return 0;
  return 1 + (gt == DType::BF16 ? 1 : 0) + (copy ? 2 : 0);
}

void launch_adamw(int cls, int blocks, const AdamWList& L, const AdamWConst& c, cudaStream_t s) {
  switch (cls) {
    case 1: adamw_f32_vec4_kernel<false, false><<<blocks, kBlock, 0, s>>>(L, c); break;
    case 2: adamw_f32_vec4_kernel<true, false><<<blocks, kBlock, 0, s>>>(L, c); break;
    case 3: adamw_f32_vec4_kernel<false, true><<<blocks, kBlock, 0, s>>>(L, c); break;
    case 4: adamw_f32_vec4_kernel<true, true><<<blocks, kBlock, 0, s>>>(L, c); break;
    default: adamw_kernel<<<blocks, kBlock, 0, s>>>(L, c); break;
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

void adamw_cuda(const std::vector<kernels::AdamWTensors>& tensors, const kernels::AdamWHyper& h) {
  const AdamWConst c = adamw_constants(h);
  cudaStream_t s = cuda::current_stream();
  size_t i = 0;
  while (i < tensors.size()) {
    // One launch per run of consecutive tensors of the same kernel class, at most kMaxTensors.
    AdamWList L{};
    int blocks = 0, cls = -1;
    for (; i < tensors.size() && L.count < kMaxTensors; ++i) {
      const auto& t = tensors[i];
      KESTREL_CHECK(t.m.dtype() == DType::F32 && t.v.dtype() == DType::F32, "adamw_step",
                    "CUDA AdamW needs f32 moments, got ", t.m.str());
      check_cuda_dtype(t.param.dtype(), "adamw_step");
      check_cuda_dtype(t.grad.dtype(), "adamw_step");
      if (t.param_copy.defined()) check_cuda_dtype(t.param_copy.dtype(), "adamw_step");
      int64_t n = t.param.numel();
      if (n == 0) continue;
      const int tc = adamw_kernel_class(t);
      if (cls >= 0 && tc != cls) break;
      cls = tc;
      int k = L.count++;
      L.block_start[k] = blocks;
      blocks += static_cast<int>(ceil_div(n, kChunk));
      L.p[k] = t.param.data_ptr();
      L.pt[k] = t.param.dtype();
      L.m[k] = ptr<float>(t.m);
      L.v[k] = ptr<float>(t.v);
      L.g[k] = t.grad.data_ptr();
      L.gt[k] = t.grad.dtype();
      L.n[k] = n;
      L.copy[k] = t.param_copy.defined() ? t.param_copy.data_ptr() : nullptr;
      L.ct[k] = t.param_copy.defined() ? t.param_copy.dtype() : DType::F32;
      L.seed[k] = t.stochastic_rounding_seed;
      L.gscale[k] = t.grad_scale.defined() ? static_cast<const double*>(t.grad_scale.data_ptr()) : nullptr;
    }
    if (L.count == 0) continue;
    L.block_start[L.count] = blocks;
    launch_adamw(cls, blocks, L, c, s);
  }
}

// ---- sum of squares / scale ----
struct PlainList {
  int count;
  int block_start[kMaxTensors + 1];
  void* x[kMaxTensors];
  int64_t n[kMaxTensors];
  DType t[kMaxTensors];
};

// Calls f(T*) with the tensor's element type (f32, bf16, f16; the op layer rejects others).
template <typename F>
__device__ __forceinline__ void with_type(void* p, DType t, F&& f) {
  switch (t) {
    case DType::BF16: f(static_cast<bf16_t*>(p)); break;
    case DType::F16: f(static_cast<f16_t*>(p)); break;
    default: f(static_cast<float*>(p)); break;
  }
}

// Walks [base, end) of x: fv(i) for each 16-byte vector [i, i + N) when the chunk is whole and x
// aligned (every chunk then starts aligned: kChunk is a multiple of N), else fs(i) per element.
template <typename T, typename FV, typename FS>
__device__ __forceinline__ void for_chunk(T* x, int64_t base, int64_t end, FV&& fv, FS&& fs) {
  constexpr int N = Vec<T>::N;
  if (end - base == kChunk && (reinterpret_cast<uintptr_t>(x) & 15u) == 0) {
    for (int64_t i = base + threadIdx.x * N; i < end; i += static_cast<int64_t>(blockDim.x) * N) fv(i);
  } else {
    for (int64_t i = base + threadIdx.x; i < end; i += blockDim.x) fs(i);
  }
}

// partial[out_base + blockIdx.x] = sum over the block's chunk of x^2 (f64 accumulation).
__global__ void sum_squares_kernel(PlainList L, double* partial) {
  __shared__ double sm[kBlock / 32];
  int t = find_tensor(L.block_start, L.count);
  int64_t base = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  int64_t end = base + kChunk < L.n[t] ? base + kChunk : L.n[t];
  double acc = 0;
  with_type(L.x[t], L.t[t], [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
    for_chunk(
        x, base, end,
        [&](int64_t i) {
          Vec<T> v = load_vec(x + i);
#pragma unroll
          for (int j = 0; j < Vec<T>::N; ++j) {
            double xi = to_f32(v.v[j]);
            acc += xi * xi;
          }
        },
        [&](int64_t i) {
          double xi = to_f32(x[i]);
          acc += xi * xi;
        });
  });
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) sm[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0;
    for (int w = 0; w < kBlock / 32; ++w) s += sm[w];
    partial[blockIdx.x] = s;
  }
}

constexpr int kSumThreads = 1024;

// Sum of partial[0..n) in a fixed order (thread t adds a contiguous segment, then a fixed tree):
// the same bits on every run. Writes the sum to sum_out, or, when norm_out is set, the norm as f32
// and the clip factor min(1, max_norm / (norm + 1e-6)) (1 when max_norm <= 0 or the norm is not
// finite) to coef_out, both computed exactly as the host path computes them.
__global__ __launch_bounds__(kSumThreads) void ordered_sum_kernel(const double* partial, int64_t n, double* sum_out,
                                                                  float* norm_out, double* coef_out,
                                                                  double max_norm) {
  __shared__ double sm[kSumThreads];
  int64_t seg = (n + kSumThreads - 1) / kSumThreads, lo = threadIdx.x * seg;
  double s = 0;
  for (int64_t i = lo; i < n && i < lo + seg; ++i) s += partial[i];
  sm[threadIdx.x] = s;
  __syncthreads();
  for (int h = kSumThreads / 2; h > 0; h >>= 1) {
    if (static_cast<int>(threadIdx.x) < h) sm[threadIdx.x] += sm[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x != 0) return;
  if (sum_out) *sum_out = sm[0];
  if (norm_out) {
    double norm = sqrt(sm[0]), c = 1.0;
    if (max_norm > 0 && isfinite(norm)) {
      double k = max_norm / (norm + 1e-6);
      if (k < 1.0) c = k;
    }
    *norm_out = static_cast<float>(norm);
    *coef_out = c;
  }
}

// x *= s, with s from the host (coef == nullptr) or read from the device (skipped when it is 1).
__global__ void scale_kernel(PlainList L, double s, const double* coef) {
  if (coef) s = *coef;
  if (s == 1.0) return;
  int t = find_tensor(L.block_start, L.count);
  int64_t base = static_cast<int64_t>(blockIdx.x - L.block_start[t]) * kChunk;
  int64_t end = base + kChunk < L.n[t] ? base + kChunk : L.n[t];
  with_type(L.x[t], L.t[t], [&](auto* x) {
    using T = std::remove_pointer_t<decltype(x)>;
    auto scaled = [s](T v) { return from_f32<T>(static_cast<float>(static_cast<double>(to_f32(v)) * s)); };
    for_chunk(
        x, base, end,
        [&](int64_t i) {
          Vec<T> v = load_vec(x + i);
#pragma unroll
          for (int j = 0; j < Vec<T>::N; ++j) v.v[j] = scaled(v.v[j]);
          store_vec(x + i, v);
        },
        [&](int64_t i) { x[i] = scaled(x[i]); });
  });
}

// Calls f(list, blocks) for batches of the tensors.
template <typename F>
void for_batches(const std::vector<Tensor>& tensors, const char* op, F&& f) {
  size_t i = 0;
  while (i < tensors.size()) {
    PlainList L{};
    int blocks = 0;
    for (; i < tensors.size() && L.count < kMaxTensors; ++i) {
      check_cuda_dtype(tensors[i].dtype(), op);
      int64_t n = tensors[i].numel();
      if (n == 0) continue;
      int k = L.count++;
      L.block_start[k] = blocks;
      blocks += static_cast<int>(ceil_div(n, kChunk));
      L.x[k] = tensors[i].data_ptr();
      L.n[k] = n;
      L.t[k] = tensors[i].dtype();
    }
    if (L.count == 0) continue;
    L.block_start[L.count] = blocks;
    f(L, blocks);
  }
}

// Enqueues the f64 sum of squares of every tensor into result[0] (result[1] a spare f64 slot for
// the clip factor), or, with norm_out, the norm and the clip factor (into coef_out when given, else
// result[1]). Returns false when there is nothing to sum (with norm_out: norm 0 and factor 1 written).
bool enqueue_sum_squares(const std::vector<Tensor>& tensors, double* result, float* norm_out, double max_norm,
                         Tensor& partial, double* coef_out = nullptr) {
  int64_t total_blocks = 0;
  for (const Tensor& t : tensors) total_blocks += ceil_div(t.numel(), kChunk);
  cudaStream_t s = cuda::current_stream();
  if (total_blocks == 0) {
    // Nothing to sum: with a norm wanted, the empty sum's norm 0 and factor 1 (the ordered sum of none).
    if (norm_out) {
      ordered_sum_kernel<<<1, kSumThreads, 0, s>>>(nullptr, 0, nullptr, norm_out, coef_out ? coef_out : result + 1,
                                                   max_norm);
      KESTREL_CUDA_CHECK_LAUNCH();
    }
    return false;
  }
  {
    TagScope tag(MemoryTag::Workspace);
    partial = Tensor::empty({total_blocks}, DType::I64, tensors.front().device());  // f64 partials (8-byte slots)
  }
  double* pp = static_cast<double*>(partial.data_ptr());
  int64_t offset = 0;
  for_batches(tensors, "global_grad_norm", [&](const PlainList& L, int blocks) {
    sum_squares_kernel<<<blocks, kBlock, 0, s>>>(L, pp + offset);
    KESTREL_CUDA_CHECK_LAUNCH();
    offset += blocks;
  });
  ordered_sum_kernel<<<1, kSumThreads, 0, s>>>(pp, offset, norm_out ? nullptr : result, norm_out,
                                               norm_out ? (coef_out ? coef_out : result + 1) : nullptr, max_norm);
  KESTREL_CUDA_CHECK_LAUNCH();
  return true;
}

Tensor device_scalars(Device dev) {
  TagScope tag(MemoryTag::Workspace);
  return Tensor::empty({2}, DType::I64, dev);  // two f64 slots
}

double sum_squares_cuda(const std::vector<Tensor>& tensors) {
  if (tensors.empty()) return 0.0;
  Tensor out = device_scalars(tensors.front().device()), partial;
  double* po = static_cast<double*>(out.data_ptr());
  if (!enqueue_sum_squares(tensors, po, nullptr, 0.0, partial)) return 0.0;
  cudaStream_t s = cuda::current_stream();
  double host = 0;
  KESTREL_CUDA_CHECK(cudaMemcpyAsync(&host, po, sizeof(double), cudaMemcpyDeviceToHost, s));
  KESTREL_CUDA_CHECK(cudaStreamSynchronize(s));
  return host;
}

void scale_in_place_cuda(const std::vector<Tensor>& tensors, double sc) {
  cudaStream_t s = cuda::current_stream();
  for_batches(tensors, "clip_grad_norm", [&](const PlainList& L, int blocks) {
    scale_kernel<<<blocks, kBlock, 0, s>>>(L, sc, nullptr);
    KESTREL_CUDA_CHECK_LAUNCH();
  });
}

// Norm into `norm` ([] f32) and the clip factor into a device slot read by the scale kernel, or into
// `factor` (then nothing is scaled: the optimizer applies it). No sync.
void clip_by_global_norm_cuda(const std::vector<Tensor>& tensors, const Tensor& norm, double max_norm,
                              const Tensor& factor) {
  KESTREL_CHECK(norm.dtype() == DType::F32 && norm.numel() == 1, "clip_grad_norm_device", "norm must be one f32");
  KESTREL_CHECK(!factor.defined() || (factor.dtype() == DType::I64 && factor.numel() == 1), "clip_grad_norm_device",
                "the factor must be one 8-byte (i64) slot");
  cudaStream_t s = cuda::current_stream();
  Tensor scalars = device_scalars(norm.device()), partial;
  double* ps = static_cast<double*>(scalars.data_ptr());
  double* pf = factor.defined() ? static_cast<double*>(factor.data_ptr()) : nullptr;
  if (!enqueue_sum_squares(tensors, ps, ptr<float>(norm), max_norm, partial, pf) || pf) return;
  if (max_norm <= 0) return;
  for_batches(tensors, "clip_grad_norm_device", [&](const PlainList& L, int blocks) {
    scale_kernel<<<blocks, kBlock, 0, s>>>(L, 1.0, ps + 1);
    KESTREL_CUDA_CHECK_LAUNCH();
  });
}

}  // namespace

KESTREL_REGISTER_KERNEL(adamw, cuda, adamw_cuda);
KESTREL_REGISTER_KERNEL(sum_squares, cuda, sum_squares_cuda);
KESTREL_REGISTER_KERNEL(scale_in_place, cuda, scale_in_place_cuda);
KESTREL_REGISTER_KERNEL(clip_by_global_norm, cuda, clip_by_global_norm_cuda);

}  // namespace kestrel::cuda_ops
