// The forward mainloop pieces of the Hopper kernel (fwd_tma_kernel.cuh): the
// two GEMM issues (S = Q K^T, O += P V) on the swizzled shared tiles, the online softmax on an
// m64n{kBc} S accumulator, the packing of P into wgmma's register-A fragments, the O rescale and
// the epilogue. A thread holds two query rows of its warpgroup's 64:
// row_base and row_base + 8 (lane = 4g + c: row 16 * warp + g); accumulator element i of column
// block j sits at column 8j + 2c + (i & 1) of row row_base + 8 * (i >= 2).
#pragma once

#include <cmath>

#include "cuda/flash_attention/device_primitives.cuh"
#include "cuda/flash_attention/wgmma.cuh"

namespace kestrel::cuda::fa {

// S[64, kBc] = Q K^T for warpgroup wg's 64 rows of the [kDs/64][kBr][64] Q tile at sQ against the
// [kDs/64][kBc][64] K tile at sK (kDs = kernel_smem_dim(kD)), over their first kD columns (kD/16
// k-steps; the columns past the head dim are zero); committed as one wgmma group.
template <typename T, int kD, int kBr, int kBc>
__device__ __forceinline__ void wgmma_issue_qk(float (&s)[kBc / 2], uint32_t sQ, uint32_t sK, int wg) {
#pragma unroll
  for (int kk = 0; kk < kD / 16; ++kk) {
    const uint32_t a_addr = sQ + (kk / 4) * (kBr * 128) + wg * (64 * 128) + (kk % 4) * 32;
    const uint32_t b_addr = sK + (kk / 4) * (kBc * 128) + (kk % 4) * 32;
    WgmmaSS<T, kBc>::run(s, wgmma_desc(a_addr, 16, 1024), wgmma_desc(b_addr, 16, 1024), kk > 0);
  }
  wgmma_commit();
}

// O[64, kD] += P V with P in register-A fragments and the first kD columns of the [kDs/64][kBc][64]
// V tile at sV read MN-major (N = kD spans the 64-column slabs through the leading byte offset);
// committed as one wgmma group.
template <typename T, int kD, int kBc>
__device__ __forceinline__ void wgmma_issue_pv(float (&o)[kD / 2], const uint32_t (&pa)[kBc / 16][4], uint32_t sV) {
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk)
    WgmmaRS<T, kD>::run(o, pa[kk], wgmma_desc(sV + kk * (16 * 128), kBc * 128, 1024));
  wgmma_commit();
}

// The K/V rings' mbarriers, 8 bytes each from `base`: per slot a "full" one (armed by the loading
// thread with the tile's bytes) and an "empty" one (one arrival per consumer warp once its wgmma
// reading the slot completed), for K and for V.
template <int kStages>
struct KvRingBarriers {
  uint32_t base;
  __device__ __forceinline__ uint32_t full_k(int s) const { return base + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return base + 8 * (kStages + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return base + 8 * (2 * kStages + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return base + 8 * (3 * kStages + s); }
  __device__ __forceinline__ void init(uint32_t consumer_warps) const {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), 1);
      mbar_init(full_v(s), 1);
      mbar_init(empty_k(s), consumer_warps);
      mbar_init(empty_v(s), consumer_warps);
    }
  }
};

template <int kBc>
struct WgmmaSoftmaxRows {
  float m[2] = {-INFINITY, -INFINITY};  // running row maxima of the raw scores
  float l[2] = {0.f, 0.f};              // running row sums of exp2((s - m) * sl2), per thread's columns

  // Masks S of the key block starting at n0 where need_mask holds (keys past len_k, causal:
  // key > row + off, with kPrefix key > max(row + off, prefix - 1) where the prefix-LM length of
  // document doc is read only here, so it holds no register outside masked tiles; a
  // window > 0: key <= row + off - window), updates m/l, turns S into
  // unnormalised P (f32) and returns in alpha the factors that rescale O. (The prefix test is written
  // out rather than tile_scheduler.h's causal_last_key: including that header here changed ptxas's
  // allocation of the TMA forward D128 without a prefix, 247 -> 225 registers.)
  template <bool kPrefix>
  __device__ __forceinline__ void step(float (&s)[kBc / 2], int n0, bool need_mask, int len_k, bool causal,
                                       int window, const int32_t* prefix_len, int doc, int row_base, int off,
                                       int c, float sl2, float (&alpha)[2]) {
    if (need_mask) {
      const int prefix = kPrefix && prefix_len ? prefix_len[doc] : 0;
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row_base + (e >= 2 ? 8 : 0);
          const int col = n0 + j * 8 + 2 * c + (e & 1);
          if (col >= len_k || (causal && col > (kPrefix ? max(i + off, prefix - 1) : i + off)) || (window > 0 && col <= i + off - window))
            s[4 * j + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // Four independent partial maxima / sums: short dependency chains (2 warps per scheduler).
      float pm[4] = {m[r], m[r], m[r], m[r]};
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) pm[j % 4] = fmaxf(pm[j % 4], fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      const float mx = quad_max(fmaxf(fmaxf(pm[0], pm[1]), fmaxf(pm[2], pm[3])));
      alpha[r] = (m[r] == -INFINITY) ? 0.f : fast_exp2((m[r] - mx) * sl2);
      const float ms = (mx == -INFINITY) ? 0.f : mx * sl2;
      float ps[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
        s[4 * j + 2 * r] = fast_exp2(fmaf(s[4 * j + 2 * r], sl2, -ms));
        s[4 * j + 2 * r + 1] = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl2, -ms));
        ps[j % 4] += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
      }
      l[r] = l[r] * alpha[r] + ((ps[0] + ps[1]) + (ps[2] + ps[3]));
      m[r] = mx;
    }
  }
};

// P (f32, accumulator layout of m64n{kBc}) -> kBc/16 register-A fragments of m64k16.
template <typename T, int kBc>
__device__ __forceinline__ void wgmma_pack_p(const float (&s)[kBc / 2], uint32_t (&pa)[kBc / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kBc / 16; ++kk) {
    pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
    pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
    pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
    pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
  }
}

template <int kD>
__device__ __forceinline__ void wgmma_rescale_o(float (&o)[kD / 2], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < kD / 8; ++j) {
    o[4 * j + 0] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// out = O / l, lse = m * scale + ln(l); rows without a visible key give 0 and -inf. Rows at or past
// len_q (the tile's padding) are not written.
template <typename T, int kD, int kBc>
__device__ __forceinline__ void wgmma_fwd_epilogue(const FlashAttentionParams& p, const float (&o)[kD / 2],
                                                   const WgmmaSoftmaxRows<kBc>& sm, int row_base, int len_q,
                                                   int q_start, int h, int c) {
  T* out = static_cast<T*>(p.out);
  const int D = p.head_dim;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(sm.l[r]);
    const int row = row_base + r * 8;
    if (row >= len_q) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int64_t tok = q_start + row;
    T* orow = out + (tok * p.num_heads_q + h) * D;
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      const int col = j * 8 + 2 * c;
      if (col < D) *reinterpret_cast<uint32_t*>(orow + col) = pack2<T>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
    if (c == 0) p.lse[tok * p.num_heads_q + h] = l > 0.f ? sm.m[r] * p.softmax_scale + logf(l) : -INFINITY;
  }
}

}  // namespace kestrel::cuda::fa
