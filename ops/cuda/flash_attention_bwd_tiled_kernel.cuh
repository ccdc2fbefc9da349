// Flash attention backward kernel with 2-D warp tiles (FA2's layout), mma.sync; KESTREL_FA_BWD=tiled
// at head dim 128 (the Hopper wgmma kernel, flash_attention_bwd_wgmma_kernel.cuh, is the default).
// Instantiated with kBr = 64; the template also runs kD = 64 / kBr = 128 correctly but measured
// slower there than flash_attention_bwd_kernel.cuh, see bench/notes/flash_attention.md.
//
// One block of 8 warps owns kBc = 128 keys of one KV head and walks kBr-row query tiles of every
// query head of its GQA group (Q, dO, lse, delta double-buffered with cp.async). Per query tile:
//   1. S^T = K Q^T and dP^T = V dO^T as 32-key x kBr/2-query warp tiles (4 x 2 warps); each K/V
//      fragment feeds kBr/16 mma and each Q/dO fragment 4, instead of 1-2 in the 16-key-row kernel.
//      P^T and dS^T = P^T (dP^T - delta) go to shared memory as [key][query] 16-bit tiles.
//   2. dV += P^T dO; 4. dK += dS^T Q: each warp keeps a 32-key x kD/2-column tile of dK and dV in
//      f32 registers for the whole kernel (4 x 2 warps), so the GQA reduction is deterministic.
//   3. dQ[kBr, kD] += dS K: 32 x 32 warp tiles, predicated f32 vector reductions into the
//      workspace, which ptxas overlaps with phase 4 (FA2's order; +1% over dQ before dV/dK).
// The shared-memory reads per mma drop by ~20% against flash_attention_bwd_kernel.cuh; measured
// +3-4% on the whole backward at D 128 (H200), not the +20% a purely ldmatrix-bound loop would give.
#pragma once

#include <cmath>
#include <type_traits>

#include "cuda/flash_attention_common.cuh"
#include "cuda/flash_attention_launch.cuh"
#include "kestrel/cuda/check.h"

namespace kestrel::cuda::fa {

template <typename T, int kD, int kBr, bool kExact>
__global__ void __launch_bounds__(256, 1) flash_bwd_tiled_kernel(const BwdArgs a) {
  constexpr int kBc = 128;
  constexpr int kThreads = 256;
  constexpr int kNt1 = kBr / 16;       // phase 1: 8-query n-tiles per warp (kBr/2 queries)
  constexpr int kDt = kD / 16;         // phases 2, 4: 8-column n-tiles per warp (kD/2 columns)
  constexpr int kRG = kBr / 32;        // phase 3: dQ row groups of 32 queries
  constexpr int kCG = 8 / kRG;         // ... and column groups
  constexpr int kQC = kD / kCG;        // dQ columns per warp
  static_assert(kQC % 16 == 0 && kD % 32 == 0, "warp tiles");
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sK = smem_u32(smem);             // [kBc][kD]
  const uint32_t sV = sK + kBc * kD * 2;          // [kBc][kD]
  const uint32_t sQ0 = sV + kBc * kD * 2;         // [2][kBr][kD]
  const uint32_t sdO0 = sQ0 + 2 * kBr * kD * 2;   // [2][kBr][kD]
  const uint32_t sP = sdO0 + 2 * kBr * kD * 2;    // [kBc][kBr] P^T
  const uint32_t sdS = sP + kBc * kBr * 2;        // [kBc][kBr] dS^T
  float* sLse = reinterpret_cast<float*>(smem + (2 * kBc * kD + 4 * kBr * kD + 2 * kBc * kBr) * 2);  // [2][kBr]
  float* sDelta = sLse + 2 * kBr;                                                                    // [2][kBr]

  const FlashAttentionParams& p = a.p;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int hk = blockIdx.x;
  const int n_block = blockIdx.y;
  const int doc = blockIdx.z;
  const auto [q_start, len_q, k_start, len_k, n0, group, off, m_begin, tiles_per_head, n_iter] =
      bwd_tile<kBc, kBr>(p, n_block, doc);
  if (n0 >= len_k) return;
  const int D = kExact ? kD : p.head_dim;  // kExact: the head dim is the tile's (no column checks)

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(a.dout);
  const int64_t q_stride = static_cast<int64_t>(p.num_heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_heads_kv) * D;
  const int64_t kv_off = (static_cast<int64_t>(k_start + n0) * p.num_heads_kv + hk) * D;

  load_tile_async<kBc, kD, kThreads>(sK, k + kv_off, kv_stride, len_k - n0, D, tid);
  load_tile_async<kBc, kD, kThreads>(sV, v + kv_off, kv_stride, len_k - n0, D, tid);

  auto prefetch = [&](int it) {
    const int h = hk * group + it / tiles_per_head;
    const int m0 = (m_begin + it % tiles_per_head) * kBr;
    const int buf = it & 1;
    const int64_t qo = (static_cast<int64_t>(q_start + m0) * p.num_heads_q + h) * D;
    load_tile_async<kBr, kD, kThreads>(sQ0 + buf * kBr * kD * 2, q + qo, q_stride, len_q - m0, D, tid);
    load_tile_async<kBr, kD, kThreads>(sdO0 + buf * kBr * kD * 2, dout + qo, q_stride, len_q - m0, D, tid);
    if (tid < 2 * kBr) {
      const int r = tid % kBr;
      const bool ok = m0 + r < len_q;
      const int64_t idx = static_cast<int64_t>(h) * a.total_q + q_start + m0 + (ok ? r : 0);
      const float* src = tid < kBr ? a.lse2 + idx : a.delta + idx;
      float* dst = (tid < kBr ? sLse : sDelta) + buf * kBr + r;
      cp_async_4(smem_u32(dst), src, ok);
    }
  };

  if (n_iter > 0) prefetch(0);
  cp_async_commit();

  // Warp roles. Phases 1, 2, 4: wk = 32-key group; phase 1: wh = query half; phases 2, 4: wh = column half.
  const int wk = warp / 2, wh = warp % 2;
  const int wr = warp % kRG, wc2 = warp / kRG;  // phase 3 (dQ) tile: rows wr*32, columns wc2*kQC

  float dv[2][kDt][4], dk[2][kDt][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int i = 0; i < kDt; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) dv[mt][i][e] = dk[mt][i][e] = 0.f;
  const float sl2 = p.softmax_scale * 1.4426950408889634f;

  // ldmatrix lane bases (see swz_at): A operands (16 rows x 16 k, row-major), B operands (.col, from
  // [n][k] rows) and transposed B operands (from [k][n] rows).
  const uint32_t base_kv = swz<kD>(wk * 32 + (lane % 16), lane / 16);                                 // K/V as A
  const uint32_t base_qo = swz<kD>(wh * (kBr / 2) + (lane / 16) * 8 + (lane % 8), (lane / 8) & 1);     // Q/dO as B
  const uint32_t base_p = swz<kBr>(wk * 32 + (lane % 16), lane / 16);                                 // P^T/dS^T as A
  const uint32_t base_t = swz<kD>(((lane / 8) & 1) * 8 + (lane % 8), (lane / 16) ^ (wh * kD / 16));  // dO/Q .trans
  const uint32_t base_ds = swz<kBr>((lane / 16) * 8 + (lane % 8), ((lane / 8) & 1) ^ (wr * 4));        // dS .trans A
  const uint32_t base_kq = swz<kD>(((lane / 8) & 1) * 8 + (lane % 8), (lane / 16) ^ (wc2 * kQC / 8));  // K .trans B
  // P^T/dS^T stores: key row wk*32 + g, query chunk wh*kBr/16 (+ nt), 4-byte column pair c.
  const uint32_t base_st = swz<kBr>(wk * 32 + g, wh * (kBr / 16)) + c * 4;

  for (int it = 0; it < n_iter; ++it) {
    const int h = hk * group + it / tiles_per_head;
    const int m0 = (m_begin + it % tiles_per_head) * kBr;
    const int buf = it & 1;
    const uint32_t sQ = sQ0 + buf * kBr * kD * 2;
    const uint32_t sdO = sdO0 + buf * kBr * kD * 2;
    const float* lse = sLse + buf * kBr;
    const float* dlt = sDelta + buf * kBr;
    cp_async_wait<0>();
    __syncthreads();  // tile visible; every warp done with the other buffer, sP and sdS
    if (it + 1 < n_iter) prefetch(it + 1);
    cp_async_commit();

    // ---- phase 1: S^T, dP^T [32 keys, kBr/2 queries] per warp ----
    {
      float s[2][kNt1][4], dp[2][kNt1][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < kNt1; ++i)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][i][e] = dp[mt][i][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t ak[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldsm_x4(ak[mt], sK + swz_at<kD>(base_kv, mt * 16, kk * 2));
#pragma unroll
        for (int nt2 = 0; nt2 < kNt1 / 2; ++nt2) {
          uint32_t b[4];
          ldsm_x4(b, sQ + swz_at<kD>(base_qo, nt2 * 16, kk * 2));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma16816<T>(s[mt][2 * nt2], ak[mt], b[0], b[1]);
            mma16816<T>(s[mt][2 * nt2 + 1], ak[mt], b[2], b[3]);
          }
        }
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldsm_x4(ak[mt], sV + swz_at<kD>(base_kv, mt * 16, kk * 2));
#pragma unroll
        for (int nt2 = 0; nt2 < kNt1 / 2; ++nt2) {
          uint32_t b[4];
          ldsm_x4(b, sdO + swz_at<kD>(base_qo, nt2 * 16, kk * 2));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma16816<T>(dp[mt][2 * nt2], ak[mt], b[0], b[1]);
            mma16816<T>(dp[mt][2 * nt2 + 1], ak[mt], b[2], b[3]);
          }
        }
      }

      // P^T and dS^T, masked where the key is invisible or the row/key is padding; to shared memory.
      // The mask test is hoisted out of the element loops (two straight-line copies of the loop):
      // a per-element branch would serialise the exp2s and cost two instructions per element.
      const bool need_mask =
          (m0 + kBr > len_q) || (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > m0 + off) ||
          tile_crosses_window(p, m0 + kBr - 1, n0, off);
      uint8_t* sbase = smem + (sP - sK);
      auto softmax_to_smem = [&](auto masked) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const int kr = wk * 32 + mt * 16 + g;  // local key row of e = 0, 1 (e = 2, 3: kr + 8)
#pragma unroll
          for (int nt = 0; nt < kNt1; ++nt) {
            const int ql = wh * (kBr / 2) + nt * 8 + 2 * c;  // local query of e = 0 (e = 1: ql + 1)
            float pv[4], ds[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int qi = ql + (e & 1);
              float x = fast_exp2(s[mt][nt][e] * sl2 - lse[qi]);
              if constexpr (decltype(masked)::value) {
                const int j = n0 + kr + (e >= 2 ? 8 : 0);
                const int i = m0 + qi;
                x = (i >= len_q || j >= len_k || (p.causal && j > i + off) || before_window(p, i, j, off)) ? 0.f : x;
              }
              pv[e] = x;
              ds[e] = x * (dp[mt][nt][e] - dlt[qi]);
            }
            const uint32_t o0 = swz_at<kBr>(base_st, mt * 16, nt);
            const uint32_t o1 = swz_at<kBr>(base_st, mt * 16 + 8, nt);
            *reinterpret_cast<uint32_t*>(sbase + o0) = pack2<T>(pv[0], pv[1]);
            *reinterpret_cast<uint32_t*>(sbase + o1) = pack2<T>(pv[2], pv[3]);
            *reinterpret_cast<uint32_t*>(sbase + kBc * kBr * 2 + o0) = pack2<T>(ds[0], ds[1]);
            *reinterpret_cast<uint32_t*>(sbase + kBc * kBr * 2 + o1) = pack2<T>(ds[2], ds[3]);
          }
        }
      };
      if (need_mask)
        softmax_to_smem(std::true_type{});
      else
        softmax_to_smem(std::false_type{});
    }
    __syncthreads();  // P^T, dS^T complete

    // ---- phase 2: dV += P^T dO; warp tile 32 keys x kD/2 columns ----
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      uint32_t ap[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) ldsm_x4(ap[mt], sP + swz_at<kBr>(base_p, mt * 16, kk * 2));
#pragma unroll
      for (int dt2 = 0; dt2 < kDt / 2; ++dt2) {
        uint32_t b[4];
        ldsm_x4_t(b, sdO + swz_at<kD>(base_t, kk * 16, dt2 * 2));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma16816<T>(dv[mt][2 * dt2], ap[mt], b[0], b[1]);
          mma16816<T>(dv[mt][2 * dt2 + 1], ap[mt], b[2], b[3]);
        }
      }
    }

    // ---- phase 3: dQ[kBr, kD] += dS [kBr, kBc] K [kBc, kD]; warp tile 32 rows x kQC columns. Its
    // predicated reductions (no branches) overlap the dK GEMM that follows (FA2's order). ----
    {
      float dq[2][kQC / 8][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int i = 0; i < kQC / 8; ++i) dq[mt][i][0] = dq[mt][i][1] = dq[mt][i][2] = dq[mt][i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        uint32_t ad[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldsm_x4_t(ad[mt], sdS + swz_at<kBr>(base_ds, kk * 16, mt * 2));
#pragma unroll
        for (int dt2 = 0; dt2 < kQC / 16; ++dt2) {
          uint32_t b[4];
          ldsm_x4_t(b, sK + swz_at<kD>(base_kq, kk * 16, dt2 * 2));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma16816<T>(dq[mt][2 * dt2], ad[mt], b[0], b[1]);
            mma16816<T>(dq[mt][2 * dt2 + 1], ad[mt], b[2], b[3]);
          }
        }
      }
      // One row pointer per (mt, r), computed once; the column offsets are compile-time.
      const int row0 = m0 + wr * 32 + g;
      float* dst0 = a.dq_accum + (static_cast<int64_t>(q_start + row0) * p.num_heads_q + h) * D + wc2 * kQC + 2 * c;
      const int64_t row_step = static_cast<int64_t>(p.num_heads_q) * D * 8;  // 8 rows
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const bool row_ok = row0 + mt * 16 + r * 8 < len_q;
          float* dst = dst0 + (2 * mt + r) * row_step;
#pragma unroll
          for (int dt = 0; dt < kQC / 8; ++dt)
            red_add_f32x2(dst + dt * 8, dq[mt][dt][2 * r], dq[mt][dt][2 * r + 1],
                          row_ok && (kExact || wc2 * kQC + dt * 8 + 2 * c < D));
        }
    }

    // ---- phase 4: dK += dS^T Q; warp tile 32 keys x kD/2 columns ----
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      uint32_t ap[2][4];
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) ldsm_x4(ap[mt], sdS + swz_at<kBr>(base_p, mt * 16, kk * 2));
#pragma unroll
      for (int dt2 = 0; dt2 < kDt / 2; ++dt2) {
        uint32_t b[4];
        ldsm_x4_t(b, sQ + swz_at<kD>(base_t, kk * 16, dt2 * 2));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          mma16816<T>(dk[mt][2 * dt2], ap[mt], b[0], b[1]);
          mma16816<T>(dk[mt][2 * dt2 + 1], ap[mt], b[2], b[3]);
        }
      }
    }
  }

  cp_async_wait<0>();  // nothing may still be landing in shared memory when the block exits

  T* dkp = static_cast<T*>(a.dk);
  T* dvp = static_cast<T*>(a.dv);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int key = n0 + wk * 32 + mt * 16 + g + r * 8;
      if (key >= len_k) continue;
      const int64_t base = (static_cast<int64_t>(k_start + key) * p.num_heads_kv + hk) * D;
#pragma unroll
      for (int dt = 0; dt < kDt; ++dt) {
        const int col = wh * (kD / 2) + dt * 8 + 2 * c;
        if (col < D) {
          *reinterpret_cast<uint32_t*>(dkp + base + col) =
              pack2<T>(dk[mt][dt][2 * r] * p.softmax_scale, dk[mt][dt][2 * r + 1] * p.softmax_scale);
          *reinterpret_cast<uint32_t*>(dvp + base + col) = pack2<T>(dv[mt][dt][2 * r], dv[mt][dt][2 * r + 1]);
        }
      }
    }
}

template <typename T, int kD>
void launch_bwd_tiled(const BwdArgs& a, cudaStream_t stream) {
  constexpr int kBc = 128, kBr = 64;
  constexpr size_t smem =
      static_cast<size_t>(2 * kBc * kD + 4 * kBr * kD + 2 * kBc * kBr) * 2 + 4 * kBr * sizeof(float);
  auto kernel = a.p.head_dim == kD ? flash_bwd_tiled_kernel<T, kD, kBr, true> : flash_bwd_tiled_kernel<T, kD, kBr, false>;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid(a.p.num_heads_kv, (a.p.max_seqlen_k + kBc - 1) / kBc, a.p.num_docs);
  kernel<<<grid, 256, smem, stream>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::fa
