// Private: one row of rms_norm / add_rms_norm held in registers by a team of threads, shared by
// norm.cu's forward kernel (the team is the whole block, reducing with BlockSum) and the FP8
// producer kernel (fp8_producers.cu: a block of several teams, each reducing with TeamSum over a
// named barrier) so that both compute the same bits: the same chunk layout (row_tile.cuh's, with
// the team in place of the block: chunk k of thread t of n at columns [(k * n + t) * V, + V)), the
// sum of squares in the same order, the same reduction tree (shuffles within each warp, then the
// team's warp sums in warp order), the same rounding of h and y.
#pragma once

#include "cuda/row_tile.cuh"

namespace kestrel::cuda_ops {

// First column of chunk k of thread t in a team of n.
template <int V>
__device__ __forceinline__ int64_t team_col(int k, int t, int n) {
  return (static_cast<int64_t>(k) * n + t) * V;
}

// The sum over a team of n threads (a multiple of 32; the team's warps consecutive in the block,
// starting at a multiple of n) with named barrier `id` (1..15; 0 is __syncthreads): BlockSum's tree
// and double buffering, for a team inside a block. buf: this team's [2][32] floats in shared memory.
struct TeamSum {
  float (*buf)[32];
  int id, n, t;
  int phase = 0;
  __device__ __forceinline__ TeamSum(float (*b)[32], int barrier_id, int threads, int tid)
      : buf(b), id(barrier_id), n(threads), t(tid) {}
  __device__ __forceinline__ float sum(float v) {
    const int lane = t & 31, warp = t >> 5, nw = n >> 5;
    v = warp_sum(v);
    if (lane == 0) buf[phase][warp] = v;
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
    v = warp_sum(lane < nw ? buf[phase][lane] : 0.0f);
    phase ^= 1;
    return v;
  }
};

// rstd = 1 / sqrt(mean(h^2) + eps) from the team's per-thread sums of squares (a team-wide call).
template <class Red>
__device__ __forceinline__ float rms_row_stat(float sum_sq, int64_t C, float eps, Red& red) {
  return rsqrtf(red.sum(sum_sq) / static_cast<float>(C) + eps);
}

// Row r (xr, rr: its x and residual rows): h = x (+ res, rounded to T and written to h when ADD),
// rstd[r] = 1 / sqrt(mean(h^2) + eps), y = h * rstd * w rounded to T and written. emit(c, yv) then
// sees each of this thread's chunks of y as stored (c its first column). Every thread of the team
// calls this (it reduces across the team).
template <typename T, int V, int CH, bool ADD, class Red, class Emit>
__device__ __forceinline__ void rms_row(T* __restrict__ y, T* __restrict__ h, float* __restrict__ rstd,
                                        const T* __restrict__ xr, const T* __restrict__ rr, const T* __restrict__ w,
                                        int64_t r, int64_t C, float eps, Red& red, int t, int n, Emit&& emit) {
  Pack<T, V> hv[CH];
#pragma unroll
  for (int k = 0; k < CH; ++k) {  // chunks past C are zero (so sums ignore them)
    const int64_t c = team_col<V>(k, t, n);
    if (c < C) {
      hv[k] = load_pack<T, V>(xr + c);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) hv[k].v[j] = from_f32<T>(0.0f);
    }
  }
  if constexpr (ADD) {
    Pack<T, V> rv[CH];  // every load issued before the first add; zero past C, as hv
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int64_t c = team_col<V>(k, t, n);
      if (c < C) {
        rv[k] = load_pack<T, V>(rr + c);
      } else {
#pragma unroll
        for (int j = 0; j < V; ++j) rv[k].v[j] = from_f32<T>(0.0f);
      }
    }
#pragma unroll
    for (int k = 0; k < CH; ++k) {
#pragma unroll
      for (int j = 0; j < V; ++j) hv[k].v[j] = from_f32<T>(to_f32(hv[k].v[j]) + to_f32(rv[k].v[j]));
      if (team_col<V>(k, t, n) < C) store_pack(h + r * C + team_col<V>(k, t, n), hv[k]);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < CH; ++k)
#pragma unroll
    for (int j = 0; j < V; ++j) ss += to_f32(hv[k].v[j]) * to_f32(hv[k].v[j]);
  const float rs = rms_row_stat(ss, C, eps, red);
  if (t == 0) rstd[r] = rs;
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    const int64_t c = team_col<V>(k, t, n);
    if (c >= C) continue;
    float wv[V];
    load_chunk<T, V>(w + c, wv);
    Pack<T, V> o;
#pragma unroll
    for (int j = 0; j < V; ++j) o.v[j] = from_f32<T>(to_f32(hv[k].v[j]) * rs * wv[j]);
    store_pack(y + r * C + c, o);
    emit(c, o);
  }
}

}  // namespace kestrel::cuda_ops
