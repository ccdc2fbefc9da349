// Private: the device side of FP8 casts, shared by the standalone cast (fp8.cu) and the kernels that
// write a cast as the epilogue of their own output (fp8_producers.cu): the conversion, the amax
// fold, the scales, the transposed write of a 16 x 4 block of codes, and the tile kernel that casts
// the values a source produces into both code layouts (kernels/fp8.h's Fp8CastTarget).
//
// Tile kernel: a block of 256 threads takes a 128 x 128 tile. Phase 1: each thread issues the loads
// of its 8 units (8 consecutive elements of one row: one 16-byte load of bf16; rows 16 apart, so a
// warp reads 2 rows x 256 bytes) before converting any, then writes each unit's 8 codes as one
// 8-byte store to X8 (a warp: 2 x 128 contiguous bytes) and into a shared 128 x 128 byte tile. Phase
// 2 (the transposed copy): each thread reads 16 rows x 4 columns of the tile (one word per row; a
// warp reads 32 consecutive words of one row, conflict-free), transposes the 4 x 4 byte blocks with
// byte_perm and writes 4 columns x 16 rows as four 16-byte stores (8-byte ones when Rp % 16 != 0).
// Rows R..Rp-1 are written as zero codes without loading anything (the GEMM operand's padding).
// The conversion is cuda_fp8.h's saturating one of v * scale (__fmul_rn: no contraction), which
// cpu/fp8.cpp models exactly; the amax folds |v|'s bits into the scalar with atomicMax
// (non-negative floats order as their bits; a NaN wins, as on the CPU).
#pragma once

#include <cuda_fp8.h>

#include "cuda/common.cuh"
#include "kernels/fp8.h"

namespace kestrel::cuda_ops::fp8 {

inline __nv_fp8_interpretation_t interpretation(Fp8Format f) { return f == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2; }

__device__ __forceinline__ uint8_t to_fp8(float v, float s, __nv_fp8_interpretation_t fmt) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fmul_rn(v, s), __NV_SATFINITE, fmt));
}

__device__ __forceinline__ uint32_t abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// Every lane of the warp calls this (it reduces across the warp first).
__device__ __forceinline__ void fold_amax(unsigned* amax, uint32_t m) {
  m = __reduce_max_sync(0xffffffffu, m);
  if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(amax, m);
}

__device__ __forceinline__ void write_scales(float* scales_out, float s) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    scales_out[0] = __fdiv_rn(1.0f, s);
    scales_out[1] = s;
  }
}

// The codes of 8 values (byte j: v[j]), two per conversion instruction (the same rounding as to_fp8:
// cuda_fp8.h converts a single float with the paired instruction too), and max(m, max_j |v[j]|'s bits).
__device__ __forceinline__ uint2 codes8(const float (&v)[8], float s, __nv_fp8_interpretation_t fmt, uint32_t& m) {
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m = max(m, max(abs_bits(v[2 * i]), abs_bits(v[2 * i + 1])));
    h[i] = __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(v[2 * i], s), __fmul_rn(v[2 * i + 1], s)), __NV_SATFINITE,
                                    fmt);
  }
  return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

// The device view of an Fp8CastTarget: out [Rp, C] and out_t [C, Rp] (either null).
struct CastArgs {
  uint8_t* out;
  uint8_t* out_t;
  const float* scale;
  float* scales_out;
  unsigned* amax;  // the f32 scalar's bits, or null
  int64_t Rp;
  __nv_fp8_interpretation_t fmt;
};

// Rp: the target's padded rows (R when it writes no codes, only the amax).
inline CastArgs cast_args(const kernels::Fp8CastTarget& t, int64_t Rp) {
  return {t.out.defined() ? static_cast<uint8_t*>(t.out.data_ptr()) : nullptr,
          t.out_t.defined() ? static_cast<uint8_t*>(t.out_t.data_ptr()) : nullptr,
          static_cast<const float*>(t.scale.data_ptr()),
          static_cast<float*>(t.scales_out.data_ptr()),
          t.amax.defined() ? static_cast<unsigned*>(t.amax.data_ptr()) : nullptr,
          Rp,
          interpretation(t.format)};
}

// Writes a block of 16 rows x 4 columns of codes into out_t [C, Rp]: w[i] holds row r + i's codes of
// columns c..c+3 (byte j: column c + j); column c + j gets rows r..r + rows - 1 (rows 16, or 8 at a
// ragged end of Rp). 16-byte stores when every column starts 16-byte aligned (Rp % 16 == 0), else 8.
__device__ __forceinline__ void store_transposed_4x16(uint8_t* out_t, int64_t Rp, int64_t c, int64_t r,
                                                      const uint32_t (&w)[16], int rows) {
  uint32_t col[4][4];  // col[j][q]: column c + j, rows r + 4q .. r + 4q + 3
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    // {a, b, c, d} = rows 4q..4q+3. t0 = a0 b0 a1 b1, t1 = a2 b2 a3 b3, t2 = c0 d0 c1 d1, t3 = c2 d2 c3 d3.
    const uint32_t t0 = __byte_perm(w[4 * q], w[4 * q + 1], 0x5140), t1 = __byte_perm(w[4 * q], w[4 * q + 1], 0x7362);
    const uint32_t t2 = __byte_perm(w[4 * q + 2], w[4 * q + 3], 0x5140),
                   t3 = __byte_perm(w[4 * q + 2], w[4 * q + 3], 0x7362);
    col[0][q] = __byte_perm(t0, t2, 0x5410);  // a0 b0 c0 d0
    col[1][q] = __byte_perm(t0, t2, 0x7632);  // a1 b1 c1 d1
    col[2][q] = __byte_perm(t1, t3, 0x5410);
    col[3][q] = __byte_perm(t1, t3, 0x7632);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint8_t* p = out_t + (c + j) * Rp + r;
    if (rows == 16 && Rp % 16 == 0) {
      *reinterpret_cast<uint4*>(p) = make_uint4(col[j][0], col[j][1], col[j][2], col[j][3]);
    } else {
      *reinterpret_cast<uint2*>(p) = make_uint2(col[j][0], col[j][1]);
      if (rows == 16) *reinterpret_cast<uint2*>(p + 8) = make_uint2(col[j][2], col[j][3]);
    }
  }
}

constexpr int kTileRows = 128, kTileCols = 128, kTileThreads = 256;
constexpr int kTileUnits = kTileRows * kTileCols / 8 / kTileThreads;  // 8 units of 8 elements per thread

// Phase 2 of the tile kernels: the shared tile's codes written transposed into a.out_t (each thread
// a 16-row x 4-column group, read one word per row, conflict-free across the warp).
__device__ __forceinline__ void store_tile_transposed(const uint8_t (*tile)[kTileCols], const CastArgs& a, int64_t r0,
                                                      int64_t c0, int64_t C) {
  const int cg = threadIdx.x % (kTileCols / 4), rg = threadIdx.x / (kTileCols / 4);  // 4-column, 16-row group
  const int64_t cc = c0 + 4 * cg, r = r0 + 16 * rg;
  if (cc < C && r < a.Rp) {
    uint32_t w[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) w[i] = *reinterpret_cast<const uint32_t*>(&tile[16 * rg + i][4 * cg]);
    store_transposed_4x16(a.out_t, a.Rp, cc, r, w, a.Rp - r >= 16 ? 16 : 8);
  }
}

// The tile kernel's source of values, for row r and columns c..c+7:
//   kBatch: how many units' loads a thread issues before converting them (a divisor of 8; fewer for
//     a source with more bytes per unit, to bound the registers);
//   Raw fetch(int64_t r, int64_t c) const: issues the loads;
//   void finish(const Raw&, int64_t r, int64_t c, float (&v)[8]) const: the 8 values as stored
//     (rounded to the output's dtype), writing the producer's output where it has one.
// grid (ceil(Rp / 128), ceil(C / 128)); C % 8 == 0, Rp % 8 == 0, the source's pointers 16-byte aligned,
// out and out_t 16-byte aligned.
template <class Src, bool kPlain, bool kTrans>
__global__ void __launch_bounds__(kTileThreads, 3) cast_tile_kernel(Src src, CastArgs a, int64_t R, int64_t C) {
  __shared__ __align__(16) uint8_t tile[kTileRows][kTileCols];
  const float s = *a.scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileRows, c0 = static_cast<int64_t>(blockIdx.y) * kTileCols;
  const int cu = threadIdx.x % (kTileCols / 8), rr = threadIdx.x / (kTileCols / 8);  // unit column, first row
  const int64_t c = c0 + cu * 8;
  uint32_t m = 0;
#pragma unroll
  for (int b = 0; b < kTileUnits; b += Src::kBatch) {  // the loads of kBatch units in flight at once
    typename Src::Raw raw[Src::kBatch];
#pragma unroll
    for (int k = 0; k < Src::kBatch; ++k) {
      const int64_t r = r0 + rr + 16 * (b + k);
      if (r < R && c < C) raw[k] = src.fetch(r, c);
    }
#pragma unroll
    for (int k = 0; k < Src::kBatch; ++k) {
      const int tr = rr + 16 * (b + k);
      const int64_t r = r0 + tr;
      if (c >= C || r >= a.Rp) continue;
      uint2 p = make_uint2(0u, 0u);  // a padding row: code 0
      if (r < R) {
        float v[8];
        src.finish(raw[k], r, c, v);
        p = codes8(v, s, a.fmt, m);
      }
      if constexpr (kPlain) *reinterpret_cast<uint2*>(a.out + r * C + c) = p;
      if constexpr (kTrans) *reinterpret_cast<uint2*>(&tile[tr][cu * 8]) = p;
    }
  }
  if constexpr (kTrans) {
    __syncthreads();
    store_tile_transposed(tile, a, r0, c0, C);
  }
  if (a.amax) fold_amax(a.amax, m);
  write_scales(a.scales_out, s);
}

// The tile kernel for a source with two outputs (SwiGLU's backward: dgate and dup), each cast with
// its own target (a[0], a[1]; the same layouts asked of both): finish(raw, r, c, v0, v1) gives the
// two outputs' 8 values. Two shared tiles (32 KiB); otherwise cast_tile_kernel's phases. Three blocks
// per SM (80 registers): 4.2 ms against 5.1 ms with two, for the 1.5B step's 16 layers at [8192, 8192];
// 4 units' loads in flight instead of 2 were slower either way (bench/RESULTS.md, ninth session).
template <class Src, bool kPlain, bool kTrans>
__global__ void __launch_bounds__(kTileThreads, 3) cast_tile2_kernel(Src src, CastArgs a0, CastArgs a1, int64_t R,
                                                                      int64_t C) {
  __shared__ __align__(16) uint8_t tile[2][kTileRows][kTileCols];
  const float s0 = *a0.scale, s1 = *a1.scale;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kTileRows, c0 = static_cast<int64_t>(blockIdx.y) * kTileCols;
  const int cu = threadIdx.x % (kTileCols / 8), rr = threadIdx.x / (kTileCols / 8);
  const int64_t c = c0 + cu * 8;
  uint32_t m0 = 0, m1 = 0;
#pragma unroll
  for (int b = 0; b < kTileUnits; b += Src::kBatch) {
    typename Src::Raw raw[Src::kBatch];
#pragma unroll
    for (int k = 0; k < Src::kBatch; ++k) {
      const int64_t r = r0 + rr + 16 * (b + k);
      if (r < R && c < C) raw[k] = src.fetch(r, c);
    }
#pragma unroll
    for (int k = 0; k < Src::kBatch; ++k) {
      const int tr = rr + 16 * (b + k);
      const int64_t r = r0 + tr;
      if (c >= C || r >= a0.Rp) continue;
      uint2 p0 = make_uint2(0u, 0u), p1 = make_uint2(0u, 0u);
      if (r < R) {
        float v0[8], v1[8];
        src.finish(raw[k], r, c, v0, v1);
        p0 = codes8(v0, s0, a0.fmt, m0);
        p1 = codes8(v1, s1, a1.fmt, m1);
      }
      if constexpr (kPlain) {
        *reinterpret_cast<uint2*>(a0.out + r * C + c) = p0;
        *reinterpret_cast<uint2*>(a1.out + r * C + c) = p1;
      }
      if constexpr (kTrans) {
        *reinterpret_cast<uint2*>(&tile[0][tr][cu * 8]) = p0;
        *reinterpret_cast<uint2*>(&tile[1][tr][cu * 8]) = p1;
      }
    }
  }
  if constexpr (kTrans) {
    __syncthreads();
    store_tile_transposed(tile[0], a0, r0, c0, C);
    store_tile_transposed(tile[1], a1, r0, c0, C);
  }
  if (a0.amax) fold_amax(a0.amax, m0);
  if (a1.amax) fold_amax(a1.amax, m1);
  write_scales(a0.scales_out, s0);
  write_scales(a1.scales_out, s1);
}

// Whether the tile kernel takes these sizes and pointers (the source's own pointers are checked by
// the caller): else the caller's element-wise path.
inline bool tile_path_fits(const CastArgs& a, int64_t C) {
  auto aligned = [](const void* p) { return p == nullptr || aligned16(p); };
  return C > 0 && C % 8 == 0 && a.Rp > 0 && a.Rp % 8 == 0 && ceil_div(C, kTileCols) <= 65535 &&
         ceil_div(a.Rp, kTileRows) <= 0x7fffffff && aligned(a.out) && aligned(a.out_t);
}

// Two targets with the same rows and layouts (the caller checks).
template <class Src>
void launch_cast_tile2(const Src& src, const CastArgs& a0, const CastArgs& a1, int64_t R, int64_t C) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a0.Rp, kTileRows)), static_cast<unsigned>(ceil_div(C, kTileCols)));
  cudaStream_t stream = cuda::current_stream();
  if (a0.out && a0.out_t)
    cast_tile2_kernel<Src, true, true><<<grid, kTileThreads, 0, stream>>>(src, a0, a1, R, C);
  else if (a0.out)
    cast_tile2_kernel<Src, true, false><<<grid, kTileThreads, 0, stream>>>(src, a0, a1, R, C);
  else if (a0.out_t)
    cast_tile2_kernel<Src, false, true><<<grid, kTileThreads, 0, stream>>>(src, a0, a1, R, C);
  else
    cast_tile2_kernel<Src, false, false><<<grid, kTileThreads, 0, stream>>>(src, a0, a1, R, C);
  KESTREL_CUDA_CHECK_LAUNCH();
}

template <class Src>
void launch_cast_tile(const Src& src, const CastArgs& a, int64_t R, int64_t C) {
  const dim3 grid(static_cast<unsigned>(ceil_div(a.Rp, kTileRows)), static_cast<unsigned>(ceil_div(C, kTileCols)));
  cudaStream_t stream = cuda::current_stream();
  if (a.out && a.out_t)
    cast_tile_kernel<Src, true, true><<<grid, kTileThreads, 0, stream>>>(src, a, R, C);
  else if (a.out)
    cast_tile_kernel<Src, true, false><<<grid, kTileThreads, 0, stream>>>(src, a, R, C);
  else if (a.out_t)
    cast_tile_kernel<Src, false, true><<<grid, kTileThreads, 0, stream>>>(src, a, R, C);
  else
    cast_tile_kernel<Src, false, false><<<grid, kTileThreads, 0, stream>>>(src, a, R, C);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda_ops::fp8
