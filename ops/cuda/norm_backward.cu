// CUDA backward of RMSNorm (and of add_rms_norm, which reuses it on h) and LayerNorm, for the slots in
// kernels/norm.h. x, dy, dx [rows, C] contiguous; rstd (mean) [rows] f32 saved by the forward.
//
// rms:   dx = rs * (g - xhat * mean(g * xhat)),           g = dy * w, xhat = x * rs
// layer: dx = rs * (g - mean(g) - xhat * mean(g * xhat)),  xhat = (x - mu) * rs
// dw = sum_rows(dy * xhat), db = sum_rows(dy).
//
// A fixed grid of G blocks (one resident wave; G depends only on the shape and the device) walks the
// rows b, b + G, ...; each thread holds its chunks of x and dy in registers (row_tile.cuh), so x and
// dy are read once, and keeps its columns' dw (db) terms in f32 registers across all of its block's
// rows. At the end each block writes its partial row into a [G, C] f32 workspace, and the column
// reduction (column_sum.h) adds the G partials in a fixed order: deterministic, no atomics, and the
// weight gradient costs one small extra pass instead of a read-modify-write per element.
// Rows too long for registers use a streaming kernel that accumulates the partial row in global
// memory (each block owns its row of the workspace, so still no races).
#include "cuda/column_sum.h"
#include "cuda/row_tile.cuh"
#include "kernels/norm.h"
#include "kestrel/runtime/memory.h"

namespace kestrel::cuda_ops {
namespace {

template <typename T, int V, int CH, bool LAYER>
__global__ __launch_bounds__(kRowMaxThreads) void norm_backward_kernel(T* __restrict__ dx, float* __restrict__ pw,
                                                                      float* __restrict__ pb,
                                                                      const T* __restrict__ dy,
                                                                      const T* __restrict__ x,
                                                                      const T* __restrict__ w,
                                                                      const float* __restrict__ mean,
                                                                      const float* __restrict__ rstd, int64_t rows,
                                                                      int64_t C) {
  __shared__ float scratch[32];
  const float inv_c = 1.0f / static_cast<float>(C);
  float aw[CH][V], ab[CH][V];  // this thread's columns of the block's dw / db partials
#pragma unroll
  for (int k = 0; k < CH; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) aw[k][j] = ab[k][j] = 0.0f;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float rs = rstd[r], mu = LAYER ? mean[r] : 0.0f;
    Pack<T, V> xv[CH], gv[CH];
    load_row(xv, x + r * C, C);
    load_row(gv, dy + r * C, C);
    float dot = 0.0f, gsum = 0.0f;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      int64_t c = chunk_col<V>(k);
      if (c >= C) continue;
      float wv[V];
      if (w) load_chunk<T, V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float d = to_f32(gv[k].v[j]), xhat = (to_f32(xv[k].v[j]) - mu) * rs, g = w ? d * wv[j] : d;
        dot += g * xhat;
        gsum += g;
        aw[k][j] += d * xhat;
        ab[k][j] += d;
      }
    }
    const float mdot = block_sum(dot, scratch) * inv_c;
    const float mg = LAYER ? block_sum(gsum, scratch) * inv_c : 0.0f;
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      int64_t c = chunk_col<V>(k);
      if (c >= C) continue;
      float wv[V], o[V];
      if (w) load_chunk<T, V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float d = to_f32(gv[k].v[j]), xhat = (to_f32(xv[k].v[j]) - mu) * rs, g = w ? d * wv[j] : d;
        o[j] = rs * (g - mg - xhat * mdot);
      }
      store_chunk<T, V>(dx + r * C + c, o);
    }
  }
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    int64_t c = chunk_col<V>(k);
    if (c >= C) continue;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (pw) pw[blockIdx.x * C + c + j] = aw[k][j];
      if (pb) pb[blockIdx.x * C + c + j] = ab[k][j];
    }
  }
}

// Streaming fallback for long rows: two passes over the row (the second from L1/L2); the block's
// partial row lives in the workspace and is updated in place.
template <typename T, int V, bool LAYER>
__global__ void norm_backward_stream_kernel(T* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb,
                                            const T* __restrict__ dy, const T* __restrict__ x,
                                            const T* __restrict__ w, const float* __restrict__ mean,
                                            const float* __restrict__ rstd, int64_t rows, int64_t C) {
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

const void* opt_ptr(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

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
  dispatch_rows(x.dtype(), op, C, {dx.data_ptr(), dy.data_ptr(), x.data_ptr(), opt_ptr(w)},
                [&](auto tag, auto v, auto ch, RowLaunch L) {
                  using T = decltype(tag);
                  constexpr int V = decltype(v)::value, CH = decltype(ch)::value;
                  auto* k = [] {
                    if constexpr (CH > 0)
                      return norm_backward_kernel<T, V, CH, LAYER>;
                    else
                      return norm_backward_stream_kernel<T, V, LAYER>;
                  }();
                  // At most 8 blocks per SM: bounds the [G, C] workspace (memory planner: G <= 8 x SMs).
                  const unsigned grid = std::min<unsigned>(resident_grid(k, L.threads, rows), sm_count() * 8);
                  const int64_t G = grid;
                  Tensor pw, pb;  // [G, C] f32 partial column sums, one row per block
                  {
                    TagScope ws(MemoryTag::Workspace);
                    if (dw.defined()) pw = Tensor::empty({G, C}, DType::F32, x.device());
                    if (db.defined()) pb = Tensor::empty({G, C}, DType::F32, x.device());
                  }
                  float* ppw = pw.defined() ? ptr<float>(pw) : nullptr;
                  float* ppb = pb.defined() ? ptr<float>(pb) : nullptr;
                  k<<<grid, L.threads, 0, s>>>(ptr<T>(dx), ppw, ppb, ptr<const T>(dy), ptr<const T>(x),
                                               w.defined() ? ptr<const T>(w) : nullptr,
                                               LAYER ? ptr<const float>(mean) : nullptr, ptr<const float>(rstd), rows, C);
                  KESTREL_CUDA_CHECK_LAUNCH();
                  if (dw.defined()) column_sum(dw.data_ptr(), dw.dtype(), ppw, DType::F32, G, C, C, x.device(), s);
                  if (db.defined()) column_sum(db.data_ptr(), db.dtype(), ppb, DType::F32, G, C, C, x.device(), s);
                });
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

KESTREL_REGISTER_KERNEL(rms_norm_backward, cuda, rms_norm_backward_cuda);
KESTREL_REGISTER_KERNEL(layer_norm_backward, cuda, layer_norm_backward_cuda);

}  // namespace kestrel::cuda_ops
