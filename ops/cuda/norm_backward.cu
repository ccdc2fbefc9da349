// CUDA backward of RMSNorm (and of add_rms_norm, which reuses it on h) and LayerNorm, for the slots in
// kernels/norm.h. x, dy, dx [rows, C] contiguous; rstd (mean) [rows] f32 saved by the forward.
//
// rms:   dx = rs * (g - xhat * mean(g * xhat)),           g = dy * w, xhat = x * rs
// layer: dx = rs * (g - mean(g) - xhat * mean(g * xhat)),  xhat = (x - mu) * rs
// dw = sum_rows(dy * xhat), db = sum_rows(dy).
//
// A fixed grid of G blocks (one resident wave; G depends only on the shape and the device) walks the
// rows b, b + G, ...; each thread holds its chunks of x and dy in registers (row_tile.cuh), so x and
// dy are read once. The block's dw (db) partial row lives in shared memory ([CH][threads][V] f32,
// 16-byte accesses, swizzled to be bank-conflict free): with it out of registers a thread needs ~64
// registers instead of ~96, so 4 blocks of 256 run per SM instead of 2, twice the bytes in flight
// (measured 0.150 -> 0.123 ms rms, 0.178 -> 0.145 ms layer at 16384 x 4096 bf16). Per row: one pass
// for the two row sums (one barrier), then dx and the partial updates. At the end the blocks of a
// thread-block cluster (2 blocks, distributed shared memory) add their partial rows in rank order,
// and each cluster writes one row of a [G / 2, C] f32 workspace; the column reduction (column_sum.h,
// dw and db in one batched call) adds those rows in a fixed order. Deterministic, no atomics.
// Rows too long for registers use a streaming kernel that accumulates the partial row in global
// memory (each block owns its row of the workspace, so still no races).
#include <cooperative_groups.h>

#include "cuda/column_sum.h"
#include "cuda/row_tile.cuh"
#include "kernels/norm.h"
#include "kestrel/ops/workspace_sizes.h"
#include "kestrel/runtime/memory.h"

namespace kestrel::cuda_ops {
namespace {

// Shared-memory partial sums [CH][nt][V] f32: thread t's V slots of chunk k are contiguous, accessed
// as 16-byte vectors when V is a multiple of 4 (a few address registers, not one per slot). For V = 8
// the two halves are swapped on every other group of 4 threads, so a warp's 16-byte accesses hit all
// 32 banks once per 8 threads (conflict-free).
template <int V>
__device__ __forceinline__ float* partial_slot(float* base, int k, int nt, int t, int h) {
  const int hs = V == 8 ? (h ^ ((t >> 2) & 1)) : h;
  return base + (k * nt + t) * V + 4 * hs;
}
template <int V>
__device__ __forceinline__ void add_partial(float* base, int k, int nt, int t, const float (&v)[V]) {
  if constexpr (V % 4 == 0) {
#pragma unroll
    for (int h = 0; h < V / 4; ++h) {
      float4* p = reinterpret_cast<float4*>(partial_slot<V>(base, k, nt, t, h));
      float4 a = *p;
      a.x += v[4 * h];
      a.y += v[4 * h + 1];
      a.z += v[4 * h + 2];
      a.w += v[4 * h + 3];
      *p = a;
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) base[(k * nt + t) * V + j] += v[j];
  }
}

// Rows in registers (CH chunks), dw (db) partials in shared memory (dynamic, [LAYER ? 2 : 1][CH][nt][V]
// f32). HAS_W: a weight (g = dy * w; else g = dy). CLUSTER: blocks per cluster (the launch's cluster
// dimension) that combine their partial rows before writing (partial row blockIdx.x / CLUSTER).
// For CH <= 2, __launch_bounds__ (512, 2) caps registers at 64: more rows in flight per SM (above
// that the compiler spends registers on overlapping the two chunks, which halves the resident
// blocks); CH = 4 would spill at 64 and is left uncapped.
template <typename T, int V, int CH, bool LAYER, bool HAS_W, int CLUSTER>
__global__ __launch_bounds__(kRowMaxThreads, CH <= 2 ? 2 : 1) void norm_backward_kernel(
    T* __restrict__ dx, float* __restrict__ pw, float* __restrict__ pb, const T* __restrict__ dy,
    const T* __restrict__ x, const T* __restrict__ w, const float* __restrict__ mean, const float* __restrict__ rstd,
    int64_t rows, int64_t C) {
  extern __shared__ float4 part_raw[];
  float* part = reinterpret_cast<float*>(part_raw);
  __shared__ BlockSum::Buffer red_buf;
  BlockSum red(red_buf);
  const int nt = blockDim.x, t = threadIdx.x;
  float* sw = part;                // [CH][nt][V] dw partial
  float* sb = part + CH * V * nt;  // [CH][nt][V] db partial (LAYER)
#pragma unroll
  for (int i = 0; i < CH * V; ++i) {  // thread t's slots, whatever the swizzle
    sw[(i / V * nt + t) * V + i % V] = 0.0f;
    if (LAYER) sb[(i / V * nt + t) * V + i % V] = 0.0f;
  }
  const float inv_c = 1.0f / static_cast<float>(C);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float rs = rstd[r], mu = LAYER ? mean[r] : 0.0f;
    Pack<T, V> xv[CH], gv[CH];
    load_row(xv, x + r * C, C);
    load_row(gv, dy + r * C, C);
    float sums[LAYER ? 2 : 1] = {};  // sum(g * xhat) [, sum(g)]
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      int64_t c = chunk_col<V>(k);
      if (c >= C) continue;
      float wv[V];
      if (HAS_W) load_chunk<T, V>(w + c, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float d = to_f32(gv[k].v[j]), xhat = (to_f32(xv[k].v[j]) - mu) * rs, g = HAS_W ? d * wv[j] : d;
        sums[0] += g * xhat;
        if constexpr (LAYER) sums[1] += g;
      }
    }
    red.sum(sums);
    const float mdot = sums[0] * inv_c;
    const float mg = LAYER ? sums[LAYER ? 1 : 0] * inv_c : 0.0f;
    forget_values(xv);
    forget_values(gv);
    // dx, and this row's terms of the block's partials (after the barrier, so the registers they
    // need are not live across the reduction).
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      int64_t c = chunk_col<V>(k);
      if (c >= C) continue;
      Pack<T, V> wp;
      if (HAS_W) wp = load_pack<T, V>(w + c);
      float o[V], tw[V];
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float d = to_f32(gv[k].v[j]), xhat = (to_f32(xv[k].v[j]) - mu) * rs, g = HAS_W ? d * to_f32(wp.v[j]) : d;
        o[j] = rs * (g - mg - xhat * mdot);
        tw[j] = d * xhat;
      }
      add_partial<V>(sw, k, nt, t, tw);
      if constexpr (LAYER) {
#pragma unroll
        for (int j = 0; j < V; ++j) tw[j] = to_f32(gv[k].v[j]);
        add_partial<V>(sb, k, nt, t, tw);
      }
      store_chunk<T, V>(dx + r * C + c, o);
    }
  }
  // The cluster's blocks add their partial rows in rank order through distributed shared memory;
  // block q of the cluster combines and writes every CLUSTER-th group of U floats.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  constexpr int U = V % 4 == 0 ? 4 : 1, G4 = V / U;  // U floats per group, G4 groups per chunk
  const int q = static_cast<int>(cluster.block_rank());
  const int64_t prow = blockIdx.x / CLUSTER;
  const float* remote[CLUSTER];
#pragma unroll
  for (int i = 0; i < CLUSTER; ++i) remote[i] = cluster.map_shared_rank(part, i);
  const int groups = CH * nt * G4;  // per partial tensor
  for (int i = q * nt + t; i < (LAYER ? 2 : 1) * groups; i += CLUSTER * nt) {
    const int tensor = i / groups, gi = i % groups;
    const int k = gi / (nt * G4), rem = gi % (nt * G4), tt = rem / G4, hs = rem % G4;
    const int h = V == 8 ? (hs ^ ((tt >> 2) & 1)) : hs;  // undo partial_slot's swizzle
    const int64_t c = (static_cast<int64_t>(k) * nt + tt) * V + U * h;
    float* out = tensor == 0 ? pw : pb;
    if (c >= C || out == nullptr) continue;
    const int64_t off = static_cast<int64_t>(i) * U;
    float acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = remote[0][off + u];
#pragma unroll
    for (int b = 1; b < CLUSTER; ++b)
#pragma unroll
      for (int u = 0; u < U; ++u) acc[u] += remote[b][off + u];
#pragma unroll
    for (int u = 0; u < U; ++u) out[prow * C + c + u] = acc[u];
  }
  cluster.sync();  // keep this block's shared memory alive until the others have read it
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

// Blocks per cluster that add their partial rows before writing them. Measured at 16384 x 4096 bf16
// (one run, same card): 1: rms 0.124 / layer 0.148 ms, 2: 0.122 / 0.141, 4: 0.124 / 0.147 (the
// partial rows halve at 2; at 4 the cluster placement seems to cost resident blocks).
constexpr int kNormClusterBlocks = 2;

// Launches the register/shared-memory kernel: grid = CLUSTER x the clusters that fit at once (at most
// 8 blocks per SM and about one per row), partial rows G / CLUSTER. Returns the partial row count
// (count_only: computes it without launching).
template <typename T, int V, int CH, bool LAYER, bool HAS_W>
int64_t launch_norm_backward(int threads, float* pw, float* pb, const Tensor& dx, const Tensor& dy, const Tensor& x,
                             const Tensor& w, const Tensor& mean, const Tensor& rstd, int64_t rows, int64_t C,
                             cudaStream_t s, bool count_only) {
  constexpr int CLUSTER = kNormClusterBlocks;
  auto* k = norm_backward_kernel<T, V, CH, LAYER, HAS_W, CLUSTER>;
  const size_t smem = (LAYER ? 2 : 1) * CH * V * static_cast<size_t>(threads) * sizeof(float);
  static const bool attr = [&] {
    const int max_smem = (LAYER ? 2 : 1) * CH * V * kRowMaxThreads * sizeof(float);
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem));
    return true;
  }();
  (void)attr;
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute la[1];
  la[0].id = cudaLaunchAttributeClusterDimension;
  la[0].val.clusterDim.x = CLUSTER;
  la[0].val.clusterDim.y = 1;
  la[0].val.clusterDim.z = 1;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cfg.attrs = la;
  cfg.numAttrs = 1;
  int64_t grid;
  {
    thread_local std::map<std::pair<const void*, int64_t>, int> cache;  // clusters resident at once
    int dev = 0;
    KESTREL_CUDA_CHECK(cudaGetDevice(&dev));
    auto key = std::make_pair(reinterpret_cast<const void*>(k), static_cast<int64_t>(threads) * 64 + dev);
    auto it = cache.find(key);
    if (it == cache.end()) {
      int n = 0;
      cfg.gridDim = dim3(CLUSTER);
      KESTREL_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, k, &cfg));
      it = cache.emplace(key, std::max(n, 1)).first;
    }
    // Bounds the workspace (kestrel/ops/workspace_sizes.h: the memory planner's bound too).
    const int64_t cap = workspace::kNormBackwardMaxBlocksPerSm * sm_count() / CLUSTER;
    grid = CLUSTER * std::clamp<int64_t>(ceil_div(rows, CLUSTER), 1, std::min<int64_t>(it->second, cap));
  }
  if (!count_only) {
    cfg.gridDim = dim3(static_cast<unsigned>(grid));
    KESTREL_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, ptr<T>(dx), pw, pb, ptr<const T>(dy), ptr<const T>(x),
                                          HAS_W ? ptr<const T>(w) : nullptr,
                                          LAYER ? ptr<const float>(mean) : nullptr, ptr<const float>(rstd), rows, C));
  }
  return grid / CLUSTER;
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
  dispatch_rows(x.dtype(), op, C, {dx.data_ptr(), dy.data_ptr(), x.data_ptr(), opt_ptr(w)},
                [&](auto tag, auto v, auto ch, RowLaunch L) {
                  using T = decltype(tag);
                  constexpr int V = decltype(v)::value, CH = decltype(ch)::value;
                  const int n = (dw.defined() ? 1 : 0) + (db.defined() ? 1 : 0);
                  // [n, G, C] f32 partial column sums (dw's, then db's): the kernel's partial rows.
                  auto with_partials = [&](int64_t G, auto&& launch) {
                    Tensor part;
                    if (n > 0) {
                      TagScope ws(MemoryTag::Workspace);
                      part = Tensor::empty({n, G, C}, DType::F32, x.device());
                    }
                    float* ppw = dw.defined() ? ptr<float>(part) : nullptr;
                    float* ppb = db.defined() ? ptr<float>(part) + (n - 1) * G * C : nullptr;
                    launch(ppw, ppb);
                    KESTREL_CUDA_CHECK_LAUNCH();
                    if (n == 2 && dw.dtype() == db.dtype()) {  // both in one pair of launches
                      void* outs[2] = {dw.data_ptr(), db.data_ptr()};
                      column_sum_batched(outs, 2, dw.dtype(), ppw, G * C, DType::F32, G, C, C, x.device(), s);
                    } else {
                      if (dw.defined()) column_sum(dw.data_ptr(), dw.dtype(), ppw, DType::F32, G, C, C, x.device(), s);
                      if (db.defined()) column_sum(db.data_ptr(), db.dtype(), ppb, DType::F32, G, C, C, x.device(), s);
                    }
                  };
                  if constexpr (CH > 0) {
                    auto go = [&](auto has_w) {
                      constexpr bool HW = decltype(has_w)::value;
                      const int64_t G = launch_norm_backward<T, V, CH, LAYER, HW>(L.threads, nullptr, nullptr, dx, dy,
                                                                                  x, w, mean, rstd, rows, C, s, true);
                      with_partials(G, [&](float* ppw, float* ppb) {
                        launch_norm_backward<T, V, CH, LAYER, HW>(L.threads, ppw, ppb, dx, dy, x, w, mean, rstd, rows,
                                                                  C, s, false);
                      });
                    };
                    if (w.defined())
                      go(std::true_type{});
                    else
                      go(std::false_type{});
                  } else {
                    auto* k = norm_backward_stream_kernel<T, V, LAYER>;
                    // Bounds the [G, C] workspace (kestrel/ops/workspace_sizes.h: the planner's bound too).
                    const int64_t G = std::min<int64_t>(resident_grid(k, L.threads, rows),
                                                        workspace::kNormBackwardMaxBlocksPerSm * sm_count());
                    with_partials(G, [&](float* ppw, float* ppb) {
                      k<<<static_cast<unsigned>(G), L.threads, 0, s>>>(
                          ptr<T>(dx), ppw, ppb, ptr<const T>(dy), ptr<const T>(x),
                          w.defined() ? ptr<const T>(w) : nullptr, LAYER ? ptr<const float>(mean) : nullptr,
                          ptr<const float>(rstd), rows, C);
                    });
                  }
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
