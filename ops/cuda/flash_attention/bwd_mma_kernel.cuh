// Flash attention backward, mma.sync (FA2, "v2" in bench/notes/flash_attention.md), built at head
// dim 256 (MmaBwdTraits): the path of head dims above 128 and of non-Hopper devices. One block per
// (key tile, KV head x column chunk, document).
//
// Each warp owns 16 keys of the tile and keeps their dK, dV rows (kDC columns) in f32 registers
// for the whole kernel. The block loops over every query head of its GQA group and every query
// tile that can see the key tile, so the group reduction of dK/dV happens in registers in a fixed
// order (deterministic). Per query tile (Q, dO, lse, delta double-buffered with cp.async):
//   S^T = K Q^T, P^T = exp2(S^T*scale*log2e - lse2)      [16 keys x kBr] per warp
//   dV += P^T dO,  dP^T = V dO^T,  dS^T = P^T (dP^T - delta),  dK += dS^T Q
//   dS^T -> shared memory, then dQ[tile] += dS K accumulated into an f32 workspace with atomics.
// A block owns 128 of the output columns (grid x covers both halves; the second half of a
// head dim <= 128 has nothing to write and returns at once) and
// recomputes S and dP, which keeps the accumulators within the register file.
#pragma once

#include <cmath>
#include <type_traits>

#include "cuda/flash_attention/device_primitives.cuh"
#include "cuda/flash_attention/tile_scheduler.h"
#include "cuda/flash_attention/traits.h"
#include "kestrel/cuda/check.h"

namespace kestrel::cuda::fa {

template <typename T, int kD, int kBc, int kBr, int kDC, bool kExact>
__global__ void __launch_bounds__(kBc / 16 * 32, 1) flash_bwd_kernel(const BwdArgs a) {
  constexpr int kWarps = kBc / 16;
  constexpr int kThreads = kWarps * 32;
  constexpr int kNt = kBr / 8;    // S^T n-tiles (queries) per warp
  constexpr int kDt = kDC / 8;    // dK/dV n-tiles per warp
  constexpr int kChunksD = kD / kDC;
  constexpr int kRowGroups = kBr / 16;            // dQ: warps split [kBr, kDC] into row groups
  constexpr int kColGroups = kWarps / kRowGroups;  // ... and column groups
  constexpr int kQCols = kDC / kColGroups;
  static_assert(kWarps % kRowGroups == 0 && kQCols % 16 == 0, "dQ warp split");
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t sK = smem_u32(smem);                 // [kBc][kD]
  const uint32_t sV = sK + kBc * kD * 2;              // [kBc][kD]
  const uint32_t sQ0 = sV + kBc * kD * 2;             // [2][kBr][kD]
  const uint32_t sdO0 = sQ0 + 2 * kBr * kD * 2;       // [2][kBr][kD]
  const uint32_t sdS = sdO0 + 2 * kBr * kD * 2;       // [kBc][kBr] dS^T
  float* sLse = reinterpret_cast<float*>(smem + (2 * kBc * kD + 4 * kBr * kD + kBc * kBr) * 2);  // [2][kBr]
  float* sDelta = sLse + 2 * kBr;                                                                // [2][kBr]

  const FlashAttentionParams& p = a.p;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int hk = blockIdx.x / kChunksD;
  const int dc0 = (blockIdx.x % kChunksD) * kDC;
  const int n_block = blockIdx.y;
  const int doc = blockIdx.z;
  const auto [q_start, len_q, k_start, len_k, n0, group, off, m_begin, tiles_per_head, n_iter] =
      bwd_tile<kBc, kBr, true>(p, n_block, doc);
  if (n0 >= len_k) return;
  const int D = kExact ? kD : p.head_dim;  // kExact: the head dim is the tile's (no column checks)
  if (dc0 >= D) return;                    // a padded head dim's empty column half

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(a.dout);
  const int64_t q_stride = static_cast<int64_t>(p.num_heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_heads_kv) * D;
  const int64_t kv_off = (static_cast<int64_t>(k_start + n0) * p.num_heads_kv + hk) * D;

  load_tile_async<kBc, kD, kThreads>(sK, k + kv_off, kv_stride, len_k - n0, D, tid);
  load_tile_async<kBc, kD, kThreads>(sV, v + kv_off, kv_stride, len_k - n0, D, tid);

  // Issues the loads of iteration `it` (query head, query tile) into buffer it & 1.
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

  float dv[kDt][4], dk[kDt][4];
#pragma unroll
  for (int i = 0; i < kDt; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dv[i][e] = dk[i][e] = 0.f;
  const float sl2 = p.softmax_scale * 1.4426950408889634f;
  const int key_lo = n0 + warp * 16 + g;  // this thread's keys: key_lo, key_lo + 8
  const uint32_t base_a = swz<kD>(warp * 16 + (lane % 16), lane / 16);                   // K/V as A
  const uint32_t base_b = swz<kD>((lane / 16) * 8 + (lane % 8), (lane / 8) & 1);           // Q/dO as B
  const uint32_t base_t = swz<kD>(((lane / 8) & 1) * 8 + (lane % 8), lane / 16 ^ (dc0 / 8));  // .trans B
  const int rg = warp % kRowGroups, cg = warp / kRowGroups;  // dQ warp tile
  const uint32_t base_kq = swz<kD>(((lane / 8) & 1) * 8 + (lane % 8), lane / 16 ^ ((dc0 + cg * kQCols) / 8));
  const uint32_t base_ds = swz<kBr>((lane / 16) * 8 + (lane % 8), ((lane / 8) & 1) ^ (rg * 2));
  const uint32_t base_st = swz<kBr>(warp * 16 + g, 0) + c * 4;  // dS^T stores: key row, column pair c

  for (int it = 0; it < n_iter; ++it) {
    const int h = hk * group + it / tiles_per_head;
    const int m0 = (m_begin + it % tiles_per_head) * kBr;
    const int buf = it & 1;
    const uint32_t sQ = sQ0 + buf * kBr * kD * 2;
    const uint32_t sdO = sdO0 + buf * kBr * kD * 2;
    const float* lse = sLse + buf * kBr;
    const float* dlt = sDelta + buf * kBr;
    cp_async_wait<0>();
    __syncthreads();  // this tile visible; every warp done with the other buffer and with sdS
    if (it + 1 < n_iter) prefetch(it + 1);
    cp_async_commit();

    // S^T = K Q^T and dP^T = V dO^T: [16 keys, kBr queries] per warp.
    float s[kNt][4], dp[kNt][4];
#pragma unroll
    for (int i = 0; i < kNt; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[i][e] = dp[i][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t ak[4], av[4];
      ldsm_x4(ak, sK + swz_at<kD>(base_a, 0, kk * 2));
      ldsm_x4(av, sV + swz_at<kD>(base_a, 0, kk * 2));
#pragma unroll
      for (int nt2 = 0; nt2 < kBr / 16; ++nt2) {
        const uint32_t off = swz_at<kD>(base_b, nt2 * 16, kk * 2);
        uint32_t b[4];
        ldsm_x4(b, sQ + off);
        mma16816<T>(s[2 * nt2], ak, b[0], b[1]);
        mma16816<T>(s[2 * nt2 + 1], ak, b[2], b[3]);
        ldsm_x4(b, sdO + off);
        mma16816<T>(dp[2 * nt2], av, b[0], b[1]);
        mma16816<T>(dp[2 * nt2 + 1], av, b[2], b[3]);
      }
    }

    // P^T and dS^T (f32), masked where the key is invisible or the row/key is padding. The mask
    // test is hoisted out of the element loops (two straight-line copies), as in the tiled kernel.
    const bool need_mask = (m0 + kBr > len_q) || (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > m0 + off) ||
                           tile_crosses_window(p, m0 + kBr - 1, n0, off);
    auto softmax = [&](auto masked) {
      // prefix-LM keys every query sees (0 = none); read in masked tiles only (no register elsewhere)
      const int prefix = decltype(masked)::value ? doc_prefix<true>(p, doc) : 0;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * 8 + 2 * c + (e & 1);
          float pv = fast_exp2(s[nt][e] * sl2 - lse[qi]);
          if constexpr (decltype(masked)::value) {
            const int j = key_lo + (e >= 2 ? 8 : 0);
            const int i = m0 + qi;
            pv = (i >= len_q || j >= len_k || (p.causal && j > max(i + off, prefix - 1)) || before_window(p, i, j, off)) ? 0.f : pv;
          }
          s[nt][e] = pv;
          dp[nt][e] = pv * (dp[nt][e] - dlt[qi]);
        }
      }
    };
    if (need_mask)
      softmax(std::true_type{});
    else
      softmax(std::false_type{});

    // dV += P^T dO and dK += dS^T Q over this block's output columns [dc0, dc0 + kDC).
#pragma unroll
    for (int kk = 0; kk < kBr / 16; ++kk) {
      uint32_t ap[4], ads[4];
      ap[0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      ap[1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      ap[2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      ap[3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      ads[0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      ads[1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      ads[2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      ads[3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
      // dS^T to shared memory ([key][query], swizzled) for the dQ product.
      {
        uint8_t* base = smem + (sdS - sK);
        *reinterpret_cast<uint32_t*>(base + swz_at<kBr>(base_st, 0, 2 * kk)) = ads[0];
        *reinterpret_cast<uint32_t*>(base + swz_at<kBr>(base_st, 8, 2 * kk)) = ads[1];
        *reinterpret_cast<uint32_t*>(base + swz_at<kBr>(base_st, 0, 2 * kk + 1)) = ads[2];
        *reinterpret_cast<uint32_t*>(base + swz_at<kBr>(base_st, 8, 2 * kk + 1)) = ads[3];
      }
#pragma unroll
      for (int dt2 = 0; dt2 < kDC / 16; ++dt2) {
        const uint32_t off = swz_at<kD>(base_t, kk * 16, dt2 * 2);
        uint32_t b[4];
        ldsm_x4_t(b, sdO + off);
        mma16816<T>(dv[2 * dt2], ap, b[0], b[1]);
        mma16816<T>(dv[2 * dt2 + 1], ap, b[2], b[3]);
        ldsm_x4_t(b, sQ + off);
        mma16816<T>(dk[2 * dt2], ads, b[0], b[1]);
        mma16816<T>(dk[2 * dt2 + 1], ads, b[2], b[3]);
      }
    }
    __syncthreads();  // dS^T complete

    // dQ[kBr, kDC] += dS [kBr, kBc] K [kBc, kDC]; warp (rg, cg) owns 16 rows x kQCols columns.
    {
      float dq[kQCols / 8][4];
#pragma unroll
      for (int i = 0; i < kQCols / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kBc / 16; ++kk) {
        uint32_t ad[4];
        ldsm_x4_t(ad, sdS + swz_at<kBr>(base_ds, kk * 16, 0));
#pragma unroll
        for (int dt2 = 0; dt2 < kQCols / 16; ++dt2) {
          uint32_t b[4];
          ldsm_x4_t(b, sK + swz_at<kD>(base_kq, kk * 16, dt2 * 2));
          mma16816<T>(dq[2 * dt2], ad, b[0], b[1]);
          mma16816<T>(dq[2 * dt2 + 1], ad, b[2], b[3]);
        }
      }
      // One row pointer, computed once; the column offsets are compile-time.
      const int row0 = m0 + rg * 16 + g;
      const int col0 = dc0 + cg * kQCols + 2 * c;
      float* dst0 = a.dq_accum + (static_cast<int64_t>(q_start + row0) * p.num_heads_q + h) * D + col0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (row0 + r * 8 >= len_q) continue;
        float* dst = dst0 + static_cast<int64_t>(r) * 8 * p.num_heads_q * D;
#pragma unroll
        for (int dt = 0; dt < kQCols / 8; ++dt) {
          if (kExact || col0 + dt * 8 < D)
            atomicAdd(reinterpret_cast<float2*>(dst + dt * 8), make_float2(dq[dt][2 * r], dq[dt][2 * r + 1]));
        }
      }
    }
  }

  cp_async_wait<0>();  // nothing may still be landing in shared memory when the block exits

  // dK = scale * sum dS^T Q, dV = sum P^T dO for this warp's keys and this block's columns.
  T* dkp = static_cast<T*>(a.dk);
  T* dvp = static_cast<T*>(a.dv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = key_lo + r * 8;
    if (key >= len_k) continue;
    const int64_t base = (static_cast<int64_t>(k_start + key) * p.num_heads_kv + hk) * D;
#pragma unroll
    for (int dt = 0; dt < kDt; ++dt) {
      const int col = dc0 + dt * 8 + 2 * c;
      if (col < D) {
        *reinterpret_cast<uint32_t*>(dkp + base + col) =
            pack2<T>(dk[dt][2 * r] * p.softmax_scale, dk[dt][2 * r + 1] * p.softmax_scale);
        *reinterpret_cast<uint32_t*>(dvp + base + col) = pack2<T>(dv[dt][2 * r], dv[dt][2 * r + 1]);
      }
    }
  }
}

template <typename T>
void launch_bwd_mma(const BwdArgs& a, cudaStream_t stream) {
  using Tr = MmaBwdTraits;
  constexpr int kD = Tr::kD, kBc = Tr::kBc, kBr = Tr::kBr, kDC = Tr::kDC;
  constexpr int kThreads = kBc / 16 * 32;
  constexpr size_t smem = static_cast<size_t>(2 * kBc * kD + 4 * kBr * kD + kBc * kBr) * 2 + 4 * kBr * sizeof(float);
  auto kernel = a.p.head_dim == kD ? flash_bwd_kernel<T, kD, kBc, kBr, kDC, true>
                                    : flash_bwd_kernel<T, kD, kBc, kBr, kDC, false>;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<bwd_grid(a.p, kBc, kD / kDC), kThreads, smem, stream>>>(a);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::fa
