// Flash attention forward for Hopper (sm_90a) with warpgroup MMA: one block of kWG consumer
// warpgroups x 64 query rows per (query tile, query head, document), FA3's ideas in our code.
//
// Per key tile (kBc keys, walked from the last to the first so the masked tiles come first):
//   S = Q K^T     wgmma m64n{kBc}k16, Q and K K-major from 128-byte-swizzled shared tiles;
//   online softmax on the S accumulator registers (row max m, row sum l, O rescale);
//   O += P V      wgmma m64n{kD}k16, P from registers (the S accumulator layout packs straight
//                 into the A fragment), V [key][d] read MN-major through the transpose bit.
// Pipelining inside a warpgroup: iteration i issues S(i) and then P(i-1) V(i-1) back to back,
// waits for S(i) only, runs the softmax of tile i while the P V GEMM is still on the tensor cores,
// then waits for it, rescales O and packs P(i). The two (three) warpgroups of a block interleave
// their GEMMs and softmaxes on their own. Tiles arrive by cp.async (zero-fill past the document /
// head_dim) into kStages-deep rings for K and V, issued kStages - 1 iterations ahead: one
// __syncthreads per key tile. Causal masking is bottom-right aligned per document; rows with no visible key give out = 0
// and lse = -inf (same outputs as the mma.sync kernel in flash_attention_fwd_kernel.cuh).
#pragma once

#include <cmath>

#include "cuda/flash_attention_common.cuh"
#include "cuda/flash_attention_launch.cuh"
#include "cuda/flash_attention_fwd_wgmma_common.cuh"
#include "cuda/flash_attention_wgmma.cuh"
#include "kestrel/cuda/check.h"

namespace kestrel::cuda::fa {

template <typename T, int kD, int kWG, int kBc, int kStages>
__global__ void __launch_bounds__(kWG * 128, 1) flash_fwd_wgmma_kernel(const FlashAttentionParams p) {
  constexpr int kBr = kWG * 64;
  constexpr int kThreads = kWG * 128;
  constexpr int kNs = kBc / 2;  // S accumulator floats per thread
  constexpr int kNo = kD / 2;   // O accumulator floats per thread
  constexpr int kKs = kBc / 16; // k-steps of P V (A fragments of P)
  constexpr uint32_t kQBytes = kBr * kD * 2, kKVBytes = kBc * kD * 2;
  static_assert(kD % 64 == 0 && kBc % 64 == 0, "64-column swizzle slabs");
  static_assert(kStages == 2 || kStages == 3, "K/V ring depth");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;  // [kD/64][kBr][64]
  const uint32_t sK = sQ + kQBytes;                            // kStages x [kD/64][kBc][64]
  const uint32_t sV = sK + kStages * kKVBytes;                 // kStages x [kD/64][kBc][64]

  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, wwarp = (tid % 128) / 32;
  const int g = lane / 4, c = lane % 4;
  const auto [h, hk, q_start, len_q, k_start, len_k, m0, off, n_blocks, n_first] = fwd_tile<kBr, kBc>(p);
  const int n_tiles = n_blocks - n_first;  // key tiles visited: blocks n_blocks - 1 down to n_first
  if (m0 >= len_q) return;
  const int D = p.head_dim;
  const int wg_row0 = m0 + wg * 64;                   // first query row of this warpgroup
  const int row_base = wg_row0 + wwarp * 16 + g;      // rows row_base and row_base + 8 of this thread

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int64_t q_stride = static_cast<int64_t>(p.num_heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_heads_kv) * D;
  const T* k_head = k + (static_cast<int64_t>(k_start) * p.num_heads_kv + hk) * D;
  const T* v_head = v + (static_cast<int64_t>(k_start) * p.num_heads_kv + hk) * D;
  // Tile j (processing order) is key block n_blocks - 1 - j and sits in stage j % kStages. Load
  // group i (issued in iteration i) holds K(i + kStages - 1) and V(i + kStages - 2); iteration it
  // needs K(it) and V(it - 1), i.e. group it - kStages + 1.
  auto issue_group = [&](int i) {
    const int jk = i + kStages - 1, jv = i + kStages - 2;
    if (jk < n_tiles) {
      const int n0 = (n_blocks - 1 - jk) * kBc;
      load_tile_sw128<kBc, kD, kThreads>(sK + (jk % kStages) * kKVBytes, k_head + n0 * kv_stride, kv_stride,
                                         len_k - n0, D, tid);
    }
    if (jv >= 0 && jv < n_tiles) {
      const int n0 = (n_blocks - 1 - jv) * kBc;
      load_tile_sw128<kBc, kD, kThreads>(sV + (jv % kStages) * kKVBytes, v_head + n0 * kv_stride, kv_stride,
                                         len_k - n0, D, tid);
    }
    cp_async_commit();
  };

  float o[kNo];
#pragma unroll
  for (int i = 0; i < kNo; ++i) o[i] = 0.f;
  WgmmaSoftmaxRows<kBc> sm;
  const float sl2 = p.softmax_scale * 1.4426950408889634f;
  float s[kNs];
  uint32_t pa[kKs][4];

  auto issue_qk = [&](int stage) { wgmma_issue_qk<T, kD, kBr, kBc>(s, sQ, sK + stage * kKVBytes, wg); };
  auto issue_pv = [&](int stage) { wgmma_issue_pv<T, kD, kBc>(o, pa, sV + stage * kKVBytes); };
  auto softmax = [&](int nb, float (&alpha)[2]) {
    const int n0 = nb * kBc;
    const bool need_mask = (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > wg_row0 + off) ||
                           tile_crosses_window(p, wg_row0 + 63, n0, off);
    sm.step(s, n0, need_mask, len_k, p.causal, p.window, row_base, off, c, sl2, alpha);
  };
  auto pack_p = [&] { wgmma_pack_p<T, kBc>(s, pa); };

  if (n_tiles > 0) {
    // Prologue: Q and K(0), groups -(kStages-2)..-1, then group 0 in flight during S(0).
    const T* q_tile = q + (static_cast<int64_t>(q_start + m0) * p.num_heads_q + h) * D;
    load_tile_sw128<kBr, kD, kThreads>(sQ, q_tile, q_stride, len_q - m0, D, tid);
    load_tile_sw128<kBc, kD, kThreads>(sK, k_head + (n_blocks - 1) * kBc * kv_stride, kv_stride,
                                       len_k - (n_blocks - 1) * kBc, D, tid);
    cp_async_commit();
#pragma unroll
    for (int i = 2 - kStages; i < 0; ++i) issue_group(i);
    cp_async_wait<kStages - 2>();
    fence_proxy_async();
    __syncthreads();
    issue_group(0);
    wgmma_fence();
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs(s);
    float alpha[2];
    softmax(n_blocks - 1, alpha);
    pack_p();

    for (int it = 1; it < n_tiles; ++it) {
      const int nb = n_blocks - 1 - it;  // key block of S in this iteration
      cp_async_wait<kStages - 2>();  // K(it) and V(it - 1) of this thread landed
      fence_proxy_async();
      __syncthreads();               // ... of every thread; iteration it - 1's GEMMs are done
      wgmma_fence();
      issue_qk(it % kStages);
      issue_pv((it - 1) % kStages);
      issue_group(it);  // the copies' address arithmetic runs while the tensor cores work
      wgmma_wait<1>();  // S(it) ready; P(it-1) V(it-1) may still run
      fence_regs(s);
      softmax(nb, alpha);
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pa);
      wgmma_rescale_o<kD>(o, alpha);
      pack_p();
    }

    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    issue_pv((n_tiles - 1) % kStages);
    wgmma_wait<0>();
    fence_regs(o);
  }

  wgmma_fwd_epilogue<T, kD, kBc>(p, o, sm, row_base, len_q, q_start, h, c);
}

template <typename T, int kD, int kStages>
void launch_fwd_wgmma_cfg(const FlashAttentionParams& p, cudaStream_t stream) {
  constexpr int kWG = WgmmaFwdTraits<kD>::kWG, kBc = WgmmaFwdTraits<kD>::kBc;
  constexpr int kBr = kWG * 64;
  constexpr size_t smem = static_cast<size_t>(kBr + 2 * kStages * kBc) * kD * 2 + 1024;  // + 1 KiB alignment
  auto kernel = flash_fwd_wgmma_kernel<T, kD, kWG, kBc, kStages>;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid(p.num_heads_q, (p.max_seqlen_q + kBr - 1) / kBr, p.num_docs);
  kernel<<<grid, kWG * 128, smem, stream>>>(p);
  KESTREL_CUDA_CHECK_LAUNCH();
}

template <typename T, int kD>
void launch_fwd_wgmma(const FlashAttentionParams& p, int stages, cudaStream_t stream) {
  if (stages == 2) launch_fwd_wgmma_cfg<T, kD, 2>(p, stream);
  else launch_fwd_wgmma_cfg<T, kD, 3>(p, stream);
}

}  // namespace kestrel::cuda::fa
