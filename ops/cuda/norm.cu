// CUDA normalisation kernels (RMSNorm, fused residual add + RMSNorm, LayerNorm; forward and backward)
// for the slots in kernels/norm.h. x [rows, C] contiguous, statistics [rows] f32.
//
// One block per row (grid-stride over rows): pass 1 reduces the row's statistics (block reduction),
// pass 2 re-reads the row (from L1/L2) and writes the output, 16-byte vectors when C is a multiple of
// the vector width and every pointer is aligned. add_rms_norm rounds h = x + res to storage first and
// normalises that rounded h, as the CPU reference does.
//
// Weight/bias gradients are deterministic: a fixed grid of G blocks (G depends only on rows), block b
// owning rows b, b+G, ...; each thread adds its columns' terms into the block's own f32 partial row
// [G, C] in global memory (no races), and a second kernel sums the G partials per column in order.
#include <algorithm>

#include "cuda/common.cuh"
#include "kernels/norm.h"

namespace kestrel::cuda_ops {
namespace {

constexpr int kBlock = 256;

int partial_blocks(int64_t rows) { return static_cast<int>(std::min<int64_t>(rows, 132 * 4)); }

// ---- forward ----
// mode 0: rms_norm; 1: add_rms_norm (x + res -> h); LN handled separately.
template <typename T, int V, bool ADD>
__global__ void rms_forward_kernel(T* __restrict__ y, T* __restrict__ h, float* __restrict__ rstd,
                                   const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,
                                   int64_t rows, int64_t C, float eps) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * C;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float v[V];
      load_chunk<T, V>(xr + c, v);
      if constexpr (ADD) {
        float rv[V];
        load_chunk<T, V>(res + r * C + c, rv);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = to_f32(from_f32<T>(v[j] + rv[j]));
        store_chunk<T, V>(h + r * C + c, v);
      }
#pragma unroll
      for (int j = 0; j < V; ++j) ss += v[j] * v[j];
    }
    float rs = rsqrtf(block_sum(ss, scratch) / static_cast<float>(C) + eps);
    if (threadIdx.x == 0) rstd[r] = rs;
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float v[V], wv[V];
      load_chunk<T, V>(xr + c, v);
      if constexpr (ADD) {
        float rv[V];
        load_chunk<T, V>(res + r * C + c, rv);
#pragma unroll
        for (int j = 0; j < V; ++j) v[j] = to_f32(from_f32<T>(v[j] + rv[j]));
      }
      load_chunk<T, V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = v[j] * rs * wv[j];
      store_chunk<T, V>(y + r * C + c, v);
    }
  }
}

template <typename T, int V>
__global__ void layer_forward_kernel(T* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                                     const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ b,
                                     int64_t rows, int64_t C, float eps) {
  __shared__ float scratch[32];
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * C;
    float s = 0.0f;
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float v[V];
      load_chunk<T, V>(xr + c, v);
#pragma unroll
      for (int j = 0; j < V; ++j) s += v[j];
    }
    float mu = block_sum(s, scratch) / static_cast<float>(C);
    float var = 0.0f;  // two-pass variance: no cancellation for large means
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float v[V];
      load_chunk<T, V>(xr + c, v);
#pragma unroll
      for (int j = 0; j < V; ++j) var += (v[j] - mu) * (v[j] - mu);
    }
    float rs = rsqrtf(block_sum(var, scratch) / static_cast<float>(C) + eps);
    if (threadIdx.x == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float v[V], wv[V], bv[V];
      load_chunk<T, V>(xr + c, v);
      if (w) load_chunk<T, V>(w + c, wv);
      if (b) load_chunk<T, V>(b + c, bv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float o = (v[j] - mu) * rs;
        if (w) o *= wv[j];
        if (b) o += bv[j];
        v[j] = o;
      }
      store_chunk<T, V>(y + r * C + c, v);
    }
  }
}

// ---- backward ----
// rms: dx = rs * (g - xhat * mean(g * xhat)), g = dy*w; partial_w[b, c] += dy * xhat.
// layer: dx = rs * (g - mean(g) - xhat * mean(g * xhat)); partial_w += dy*xhat, partial_b += dy.
template <typename T, int V, bool LAYER>
__global__ void norm_backward_kernel(T* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb,
                                     const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                                     const float* __restrict__ mean, const float* __restrict__ rstd, int64_t rows,
                                     int64_t C) {
  __shared__ float scratch[32];
  float* my_pw = pw ? pw + blockIdx.x * C : nullptr;
  float* my_pb = pb ? pb + blockIdx.x * C : nullptr;
  bool first = true;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    float rs = rstd[r], mu = LAYER ? mean[r] : 0.0f;
    const T *xr = x + r * C, *gr = dy + r * C;
    float dot = 0.0f, gsum = 0.0f;
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float xv[V], gv[V], wv[V];
      load_chunk<T, V>(xr + c, xv);
      load_chunk<T, V>(gr + c, gv);
      if (w) load_chunk<T, V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float xhat = (xv[j] - mu) * rs, g = w ? gv[j] * wv[j] : gv[j];
        dot += g * xhat;
        gsum += g;
        if (my_pw) my_pw[c + j] = (first ? 0.0f : my_pw[c + j]) + gv[j] * xhat;
        if (my_pb) my_pb[c + j] = (first ? 0.0f : my_pb[c + j]) + gv[j];
      }
    }
    float mdot = block_sum(dot, scratch) / static_cast<float>(C);
    float mg = LAYER ? block_sum(gsum, scratch) / static_cast<float>(C) : 0.0f;
    for (int64_t c = threadIdx.x * V; c < C; c += blockDim.x * V) {
      float xv[V], gv[V], wv[V], o[V];
      load_chunk<T, V>(xr + c, xv);
      load_chunk<T, V>(gr + c, gv);
      if (w) load_chunk<T, V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float xhat = (xv[j] - mu) * rs, g = w ? gv[j] * wv[j] : gv[j];
        o[j] = rs * (g - mg - xhat * mdot);
      }
      store_chunk<T, V>(dx + r * C + c, o);
    }
    first = false;
  }
}

// out[c] = sum_b partial[b, c], b in order.
template <typename T>
__global__ void column_sum_kernel(T* __restrict__ out, const float* __restrict__ partial, int G, int64_t C) {
  int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int b = 0; b < G; ++b) s += partial[b * C + c];
  out[c] = from_f32<T>(s);
}

bool vec_ok(int64_t C, int n, std::initializer_list<const Tensor*> ts) {
  if (C % n != 0) return false;
  for (const Tensor* t : ts)
    if (t->defined() && !aligned16(t->data_ptr())) return false;
  return true;
}

// Calls f(T{}, std::integral_constant<int, V>{}) with V the vector width when usable, else 1.
template <typename F>
void dispatch_vec(DType dt, const char* op, int64_t C, std::initializer_list<const Tensor*> ts, F&& f) {
  dispatch_cuda_float(dt, op, [&](auto tag) {
    using T = decltype(tag);
    if (vec_ok(C, Vec<T>::N, ts))
      f(tag, std::integral_constant<int, Vec<T>::N>{});
    else
      f(tag, std::integral_constant<int, 1>{});
  });
}

unsigned row_grid(int64_t rows) { return static_cast<unsigned>(std::clamp<int64_t>(rows, 1, 132 * 16)); }

void rms_norm_cuda(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps) {
  int64_t rows = x.shape()[0], C = x.shape()[1];
  cudaStream_t s = cuda::current_stream();
  dispatch_vec(x.dtype(), "rms_norm", C, {&y, &x, &w}, [&](auto tag, auto v) {
    using T = decltype(tag);
    rms_forward_kernel<T, decltype(v)::value, false><<<row_grid(rows), kBlock, 0, s>>>(
        ptr<T>(y), nullptr, ptr<float>(rstd), ptr<const T>(x), nullptr, ptr<const T>(w), rows, C,
        static_cast<float>(eps));
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

void add_rms_norm_cuda(const Tensor& y, const Tensor& h, const Tensor& rstd, const Tensor& x, const Tensor& res,
                       const Tensor& w, double eps) {
  int64_t rows = x.shape()[0], C = x.shape()[1];
  cudaStream_t s = cuda::current_stream();
  dispatch_vec(x.dtype(), "add_rms_norm", C, {&y, &h, &x, &res, &w}, [&](auto tag, auto v) {
    using T = decltype(tag);
    rms_forward_kernel<T, decltype(v)::value, true><<<row_grid(rows), kBlock, 0, s>>>(
        ptr<T>(y), ptr<T>(h), ptr<float>(rstd), ptr<const T>(x), ptr<const T>(res), ptr<const T>(w), rows, C,
        static_cast<float>(eps));
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

void layer_norm_cuda(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                     const Tensor& b, double eps) {
  int64_t rows = x.shape()[0], C = x.shape()[1];
  cudaStream_t s = cuda::current_stream();
  dispatch_vec(x.dtype(), "layer_norm", C, {&y, &x, &w, &b}, [&](auto tag, auto v) {
    using T = decltype(tag);
    layer_forward_kernel<T, decltype(v)::value><<<row_grid(rows), kBlock, 0, s>>>(
        ptr<T>(y), ptr<float>(mean), ptr<float>(rstd), ptr<const T>(x), w.defined() ? ptr<const T>(w) : nullptr,
        b.defined() ? ptr<const T>(b) : nullptr, rows, C, static_cast<float>(eps));
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

template <bool LAYER>
void norm_backward(const char* op, const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy,
                   const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  int64_t rows = x.shape()[0], C = x.shape()[1];
  if (rows == 0 || C == 0) {
    if (dw.defined()) Tensor(dw).zero_();
    if (db.defined()) Tensor(db).zero_();
    return;
  }
  cudaStream_t s = cuda::current_stream();
  int G = partial_blocks(rows);
  Tensor pw, pb;  // [G, C] f32 partial column sums
  {
    TagScope ws(MemoryTag::Workspace);
    if (dw.defined()) pw = Tensor::empty({G, C}, DType::F32, x.device());
    if (db.defined()) pb = Tensor::empty({G, C}, DType::F32, x.device());
  }
  dispatch_vec(x.dtype(), op, C, {&dx, &dy, &x, &w}, [&](auto tag, auto v) {
    using T = decltype(tag);
    norm_backward_kernel<T, decltype(v)::value, LAYER><<<G, kBlock, 0, s>>>(
        ptr<T>(dx), pw.defined() ? ptr<float>(pw) : nullptr, pb.defined() ? ptr<float>(pb) : nullptr,
        ptr<const T>(dy), ptr<const T>(x), w.defined() ? ptr<const T>(w) : nullptr,
        LAYER ? ptr<const float>(mean) : nullptr, ptr<const float>(rstd), rows, C);
    KESTREL_CUDA_CHECK_LAUNCH();
    unsigned cg = static_cast<unsigned>(ceil_div(C, kBlock));
    if (dw.defined()) column_sum_kernel<T><<<cg, kBlock, 0, s>>>(ptr<T>(dw), ptr<const float>(pw), G, C);
    if (db.defined()) column_sum_kernel<T><<<cg, kBlock, 0, s>>>(ptr<T>(db), ptr<const float>(pb), G, C);
  });
  KESTREL_CUDA_CHECK_LAUNCH();
}

void rms_norm_backward_cuda(const Tensor& dx, const Tensor& dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                            const Tensor& rstd) {
  norm_backward<false>("rms_norm", dx, dw, Tensor(), dy, x, w, Tensor(), rstd);
}
void layer_norm_backward_cuda(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dy, const Tensor& x,
                              const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  norm_backward<true>("layer_norm", dx, dw, db, dy, x, w, mean, rstd);
}

}  // namespace

KESTREL_REGISTER_KERNEL(rms_norm_forward, cuda, rms_norm_cuda);
KESTREL_REGISTER_KERNEL(add_rms_norm_forward, cuda, add_rms_norm_cuda);
KESTREL_REGISTER_KERNEL(rms_norm_backward, cuda, rms_norm_backward_cuda);
KESTREL_REGISTER_KERNEL(layer_norm_forward, cuda, layer_norm_cuda);
KESTREL_REGISTER_KERNEL(layer_norm_backward, cuda, layer_norm_backward_cuda);

}  // namespace kestrel::cuda_ops
