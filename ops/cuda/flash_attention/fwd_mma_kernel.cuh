// Flash attention forward, mma.sync (FA2), built at head dim 256 (MmaFwdTraits): the path of head
// dims above 128 and of non-Hopper devices. One block per (query tile, query head, document).
//
// Each warp owns 16*kMT query rows (its kMT m-tiles share every K/V fragment it loads).
// Key/value tiles stream through shared memory with cp.async: the V tile loads while Q K^T runs, the next K tile loads while P V runs. The softmax is online
// (running row max m, running row sum l, rescaled O accumulator in registers); P goes from the
// S accumulator registers straight into the A operand of the P V mma. Key tiles are walked from
// the last to the first, so the masked (diagonal / ragged) tiles come first and the mask test is
// one uniform branch per tile. Causal masking is bottom-right aligned per document.
#pragma once

#include <cmath>
#include <cstdio>

#include "cuda/flash_attention/device_primitives.cuh"
#include "cuda/flash_attention/tile_scheduler.h"
#include "cuda/flash_attention/traits.h"
#include "kestrel/cuda/check.h"

namespace kestrel::cuda::fa {

template <typename T, int kD, int kBr, int kBc, int kMT>
__global__ void __launch_bounds__(kBr / (16 * kMT) * 32, kMT == 2 ? 2 : 1) flash_fwd_kernel(const FlashAttentionParams p) {
  constexpr int kWarps = kBr / (16 * kMT);  // each warp owns kMT 16-row m-tiles
  constexpr int kThreads = kWarps * 32;
  constexpr int kNt = kBc / 8;  // S n-tiles per m-tile
  constexpr int kDt = kD / 8;   // O n-tiles per m-tile
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sQ = smem_u32(smem);          // [kBr][kD]
  const uint32_t sK = sQ + kBr * kD * 2;       // [kBc][kD]
  const uint32_t sV = sK + kBc * kD * 2;       // [kBc][kD]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const auto [h, hk, q_start, len_q, k_start, len_k, m0, off, n_blocks, n_first] = fwd_tile<kBr, kBc, true>(p);
  if (m0 >= len_q) return;
  const int D = p.head_dim;

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  const int64_t q_stride = static_cast<int64_t>(p.num_heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_heads_kv) * D;
  const T* q_tile = q + (static_cast<int64_t>(q_start + m0) * p.num_heads_q + h) * D;
  const T* k_head = k + (static_cast<int64_t>(k_start) * p.num_heads_kv + hk) * D;
  const T* v_head = v + (static_cast<int64_t>(k_start) * p.num_heads_kv + hk) * D;

  const int wrow = warp * 16 * kMT;  // first row of this warp inside the tile
  const uint32_t base_q = swz<kD>(wrow + (lane % 16), lane / 16);               // A operand rows
  const uint32_t base_k = swz<kD>((lane / 16) * 8 + (lane % 8), (lane / 8) & 1);  // B operand rows
  const uint32_t base_v = swz<kD>(((lane / 8) & 1) * 8 + (lane % 8), lane / 16);  // B operand, .trans
  float o[kMT][kDt][4];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int i = 0; i < kDt; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
  float m_i[kMT][2], l_i[kMT][2];
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt) m_i[mt][0] = m_i[mt][1] = -INFINITY, l_i[mt][0] = l_i[mt][1] = 0.f;
  const float sl2 = p.softmax_scale * 1.4426950408889634f;

  if (n_blocks > n_first) {
    load_tile_async<kBr, kD, kThreads>(sQ, q_tile, q_stride, len_q - m0, D, tid);
    {
      const int n0 = (n_blocks - 1) * kBc;
      load_tile_async<kBc, kD, kThreads>(sK, k_head + n0 * kv_stride, kv_stride, len_k - n0, D, tid);
    }
    cp_async_commit();
  }

  for (int nb = n_blocks - 1; nb >= n_first; --nb) {
    const int n0 = nb * kBc;
    cp_async_wait<0>();
    __syncthreads();  // K tile (and Q) visible; previous P V done with sV
    load_tile_async<kBc, kD, kThreads>(sV, v_head + n0 * kv_stride, kv_stride, len_k - n0, D, tid);
    cp_async_commit();

    // S = Q K^T for this warp's 16*kMT rows: [16*kMT, kBc]
    float s[kMT][kNt][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int i = 0; i < kNt; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) ldsm_x4(a[mt], sQ + swz_at<kD>(base_q, mt * 16, kk * 2));
#pragma unroll
      for (int nt2 = 0; nt2 < kBc / 16; ++nt2) {
        uint32_t b[4];
        ldsm_x4(b, sK + swz_at<kD>(base_k, nt2 * 16, kk * 2));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(s[mt][2 * nt2], a[mt], b[0], b[1]);
          mma16816<T>(s[mt][2 * nt2 + 1], a[mt], b[2], b[3]);
        }
      }
    }

    const bool need_mask = (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > m0 + off) ||
                           tile_crosses_window(p, m0 + kBr - 1, n0, off);
    if (need_mask) {
      const int prefix = doc_prefix<true>(p, blockIdx.z);  // prefix-LM keys every query sees (0 = none)
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = m0 + wrow + mt * 16 + g + (e >= 2 ? 8 : 0);
            const int j = n0 + nt * 8 + 2 * c + (e & 1);
            if (j >= len_k || (p.causal && j > max(i + off, prefix - 1)) || before_window(p, i, j, off)) s[mt][nt][e] = -INFINITY;
          }
    }

    // Online softmax: per m-tile rows r=0 (g) and r=1 (g+8); each quad shares a row.
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = m_i[mt][r];
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
        mx = quad_max(mx);
        const float alpha = (m_i[mt][r] == -INFINITY) ? 0.f : fast_exp2((m_i[mt][r] - mx) * sl2);
        const float ms = (mx == -INFINITY) ? 0.f : mx * sl2;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          s[mt][nt][2 * r] = fast_exp2(fmaf(s[mt][nt][2 * r], sl2, -ms));
          s[mt][nt][2 * r + 1] = fast_exp2(fmaf(s[mt][nt][2 * r + 1], sl2, -ms));
          sum += s[mt][nt][2 * r] + s[mt][nt][2 * r + 1];
        }
        l_i[mt][r] = l_i[mt][r] * alpha + sum;
        m_i[mt][r] = mx;
#pragma unroll
        for (int dt = 0; dt < kDt; ++dt) {
          o[mt][dt][2 * r] *= alpha;
          o[mt][dt][2 * r + 1] *= alpha;
        }
      }

    cp_async_wait<0>();
    __syncthreads();  // V tile visible; every warp is done reading sK
    if (nb > n_first) {
      const int n0n = (nb - 1) * kBc;
      load_tile_async<kBc, kD, kThreads>(sK, k_head + n0n * kv_stride, kv_stride, len_k - n0n, D, tid);
      cp_async_commit();
    }

    // O += P V: P [16*kMT, kBc] from registers, V [kBc, kD] via ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t a[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dt2 = 0; dt2 < kD / 16; ++dt2) {
        uint32_t b[4];
        ldsm_x4_t(b, sV + swz_at<kD>(base_v, kk * 16, dt2 * 2));
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          mma16816<T>(o[mt][2 * dt2], a[mt], b[0], b[1]);
          mma16816<T>(o[mt][2 * dt2 + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: O / l, lse = m * scale + ln(l); rows without a visible key give 0 and -inf.
#pragma unroll
  for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_i[mt][r]);
      const int row = m0 + wrow + mt * 16 + g + r * 8;
      if (row >= len_q) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int64_t tok = q_start + row;
      T* orow = out + (tok * p.num_heads_q + h) * D;
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
        const int col = dt * 8 + 2 * c;
        if (col < D)
          *reinterpret_cast<uint32_t*>(orow + col) =
              pack2<T>(o[mt][dt][2 * r] * inv, o[mt][dt][2 * r + 1] * inv);
      }
      if (c == 0)
        p.lse[tok * p.num_heads_q + h] = l > 0.f ? m_i[mt][r] * p.softmax_scale + logf(l) : -INFINITY;
    }
}

template <typename T>
void launch_fwd_mma(const FlashAttentionParams& p, cudaStream_t stream) {
  using Tr = MmaFwdTraits;
  constexpr int kThreads = Tr::kBr / (16 * Tr::kMT) * 32;
  constexpr size_t smem = static_cast<size_t>(Tr::kBr + 2 * Tr::kBc) * Tr::kD * 2;
  auto kernel = flash_fwd_kernel<T, Tr::kD, Tr::kBr, Tr::kBc, Tr::kMT>;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<fwd_grid(p, Tr::kBr), kThreads, smem, stream>>>(p);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::fa
