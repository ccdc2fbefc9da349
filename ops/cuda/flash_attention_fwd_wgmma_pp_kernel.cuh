// Staggered ("ping-pong") variant of the Hopper wgmma flash attention forward: the same tiles and
// math as flash_attention_fwd_wgmma_kernel.cuh (2 warpgroups x 64 query rows, 128-key tiles,
// S(i) and P(i-1) V(i-1) issued back to back, softmax under the P V GEMM), but without the
// block-wide barrier per key tile, so the two warpgroups can run half an iteration apart:
//  - named barriers make them take turns issuing GEMMs (FA3's scheduling barriers): warpgroup 0's
//    softmax and O rescale run while warpgroup 1's GEMMs occupy the tensor cores, and vice versa;
//  - warpgroup 1 (the one behind) is the only loader: load group g (g = 0: Q and K(0); g >= 1:
//    K(g) and V(g-1)) goes into 3-deep rings, is issued in iteration g - 2 and published in
//    iteration g - 1 (cp.async wait, proxy fence, arrive on full[g % 3]); iteration it waits for
//    group it (the epilogue's P V is "iteration n_blocks");
//  - iteration it releases the K and V stages it read on empty[it % 3] (every consumer thread);
//    the loader waits on it before refilling them (warpgroup 0 is ahead, so this rarely waits).
#pragma once

#include <cmath>

#include "cuda/flash_attention_common.cuh"
#include "cuda/flash_attention_launch.cuh"
#include "cuda/flash_attention_wgmma.cuh"
#include "kestrel/runtime/cuda_check.h"

namespace kestrel::cuda::fa {

template <typename T, int kD, int kBc>
__global__ void __launch_bounds__(256, 1) flash_fwd_wgmma_pp_kernel(const FlashAttentionParams p) {
  constexpr int kWG = 2, kBr = 128, kStages = 3;
  constexpr int kNs = kBc / 2;  // S accumulator floats per thread
  constexpr int kNo = kD / 2;   // O accumulator floats per thread
  constexpr int kKs = kBc / 16; // k-steps of P V (A fragments of P)
  constexpr uint32_t kQBytes = kBr * kD * 2, kKVBytes = kBc * kD * 2;
  static_assert(kD % 64 == 0 && kBc % 64 == 0, "64-column swizzle slabs");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;  // [kD/64][kBr][64]
  const uint32_t sK = sQ + kQBytes;                            // 3 x [kD/64][kBc][64]
  const uint32_t sV = sK + kStages * kKVBytes;                 // 3 x [kD/64][kBc][64]
  const uint32_t bars = sV + kStages * kKVBytes;               // full[3], empty[3]: 8 bytes each
  auto full_bar = [&](int g) { return bars + 8 * (g % 3); };
  auto empty_bar = [&](int it) { return bars + 24 + 8 * (it % 3); };

  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, wwarp = (tid % 128) / 32;
  const int g = lane / 4, c = lane % 4;
  const int h = blockIdx.x;
  const int doc = blockIdx.z;
  const int m_block = gridDim.y - 1 - blockIdx.y;  // heaviest (causal) tiles launch first
  const int q_start = p.cu_seqlens_q[doc], len_q = p.cu_seqlens_q[doc + 1] - q_start;
  const int k_start = p.cu_seqlens_k[doc], len_k = p.cu_seqlens_k[doc + 1] - k_start;
  const int m0 = m_block * kBr;
  if (m0 >= len_q) return;
  const int hk = h / (p.num_heads_q / p.num_heads_kv);
  const int D = p.head_dim;
  const int off = len_k - len_q;  // key j visible to query i iff j <= i + off (causal)
  const int n_end = p.causal ? min(len_k, m0 + kBr + off) : len_k;
  const int n_blocks = n_end > 0 ? (n_end + kBc - 1) / kBc : 0;
  if (n_blocks == 0) {  // no visible key anywhere in this tile: out = 0, lse = -inf
    T* out = static_cast<T*>(p.out);
    for (int idx = tid; idx < kBr * D; idx += 256) {
      const int row = m0 + idx / D;
      if (row < len_q) out[(static_cast<int64_t>(q_start + row) * p.num_heads_q + h) * D + idx % D] = from_float<T>(0.f);
    }
    for (int row = m0 + tid; row < min(len_q, m0 + kBr); row += 256)
      p.lse[static_cast<int64_t>(q_start + row) * p.num_heads_q + h] = -INFINITY;
    return;
  }
  const int wg_row0 = m0 + wg * 64;                   // first query row of this warpgroup
  const int row_base = wg_row0 + wwarp * 16 + g;      // rows row_base and row_base + 8 of this thread

  if (tid == 0) {
    for (int i = 0; i < 3; ++i) {
      mbar_init(bars + 8 * i, 128);         // full: the loader warpgroup's threads
      mbar_init(bars + 24 + 8 * i, 256);    // empty: every consumer thread
    }
  }
  __syncthreads();

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const int64_t kv_stride = static_cast<int64_t>(p.num_heads_kv) * D;
  const T* k_head = k + (static_cast<int64_t>(k_start) * p.num_heads_kv + hk) * D;
  const T* v_head = v + (static_cast<int64_t>(k_start) * p.num_heads_kv + hk) * D;
  const int ltid = tid - 128;  // loader thread index (warpgroup 1)
  // Copies rows [0, kRows) of a tile (valid_rows of them from gmem, the rest zero) into a
  // swizzled [kD/64][kRows][64] stage; rolled loop, few registers.
  auto copy_tile = [&](uint32_t dst, const T* src, int64_t stride, int rows, int valid_rows) {
#pragma unroll 1
    for (int idx = ltid; idx < rows * (kD / 8); idx += 128) {
      const int row = idx / (kD / 8), ch = idx % (kD / 8);
      const bool pred = row < valid_rows && ch * 8 < D;
      cp_async_16(dst + (ch / 8) * (rows * 128) + row * 128 + (((ch % 8) ^ (row % 8)) << 4),
                  pred ? src + row * stride + ch * 8 : src, pred);
    }
  };
  // Load group gi: gi == 0 is Q and K(0); gi >= 1 is K(gi) and V(gi - 1) (tiles past the end skipped).
  auto issue_group = [&](int gi) {
    if (gi == 0) {
      copy_tile(sQ, q + (static_cast<int64_t>(q_start + m0) * p.num_heads_q + h) * D,
                static_cast<int64_t>(p.num_heads_q) * D, kBr, len_q - m0);
    }
    if (gi < n_blocks) {
      const int n0 = (n_blocks - 1 - gi) * kBc;
      copy_tile(sK + (gi % kStages) * kKVBytes, k_head + n0 * kv_stride, kv_stride, kBc, len_k - n0);
    }
    const int jv = gi - 1;
    if (jv >= 0 && jv < n_blocks) {
      const int n0 = (n_blocks - 1 - jv) * kBc;
      copy_tile(sV + (jv % kStages) * kKVBytes, v_head + n0 * kv_stride, kv_stride, kBc, len_k - n0);
    }
    cp_async_commit();
  };
  // Publishes the oldest outstanding group (every other one has landed before).
  auto publish = [&](int gi) {
    cp_async_wait<0>();
    fence_proxy_async();
    mbar_arrive(full_bar(gi));
  };

  float o[kNo];
#pragma unroll
  for (int i = 0; i < kNo; ++i) o[i] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
  const float sl2 = p.softmax_scale * 1.4426950408889634f;
  float s[kNs];
  uint32_t pa[kKs][4];

  // S = Q K^T for this warpgroup's 64 rows against the K tile in `stage`.
  auto issue_qk = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t a_addr = sQ + (kk / 4) * (kBr * 128) + wg * (64 * 128) + (kk % 4) * 32;
      const uint32_t b_addr = sK + stage * kKVBytes + (kk / 4) * (kBc * 128) + (kk % 4) * 32;
      WgmmaSS<T, kBc>::run(s, wgmma_desc(a_addr, 16, 1024), wgmma_desc(b_addr, 16, 1024), kk > 0);
    }
    wgmma_commit();
  };
  // O += P V against the V tile in `stage`.
  auto issue_pv = [&](int stage) {
#pragma unroll
    for (int kk = 0; kk < kKs; ++kk) {
      const uint32_t b_addr = sV + stage * kKVBytes + kk * (16 * 128);
      WgmmaRS<T, kD>::run(o, pa[kk], wgmma_desc(b_addr, kBc * 128, 1024));
    }
    wgmma_commit();
  };
  // Masks S of key block nb where needed, updates m/l, turns S into unnormalised P (f32) and
  // returns the O rescale factors.
  auto softmax = [&](int nb, float (&alpha)[2]) {
    const int n0 = nb * kBc;
    const bool need_mask = (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > wg_row0 + off);
    if (need_mask) {
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = row_base + (e >= 2 ? 8 : 0);
          const int col = n0 + j * 8 + 2 * c + (e & 1);
          if (col >= len_k || (p.causal && col > i + off)) s[4 * j + e] = -INFINITY;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // Four independent partial maxima / sums: short dependency chains (2 warps per scheduler).
      float pm[4] = {m_i[r], m_i[r], m_i[r], m_i[r]};
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) pm[j % 4] = fmaxf(pm[j % 4], fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      float mx = quad_max(fmaxf(fmaxf(pm[0], pm[1]), fmaxf(pm[2], pm[3])));
      alpha[r] = (m_i[r] == -INFINITY) ? 0.f : fast_exp2((m_i[r] - mx) * sl2);
      const float ms = (mx == -INFINITY) ? 0.f : mx * sl2;
      float ps[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < kBc / 8; ++j) {
        s[4 * j + 2 * r] = fast_exp2(fmaf(s[4 * j + 2 * r], sl2, -ms));
        s[4 * j + 2 * r + 1] = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl2, -ms));
        ps[j % 4] += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
      }
      l_i[r] = l_i[r] * alpha[r] + ((ps[0] + ps[1]) + (ps[2] + ps[3]));
      m_i[r] = mx;
    }
  };
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < kKs; ++kk) {
      pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };

  // Scheduling barriers: warpgroup 0 issues on barrier 1, warpgroup 1 on barrier 2.
  auto turn_begin = [&] { named_bar_sync(1 + wg, 256); };
  auto turn_end = [&](bool last) {
    if (!(last && wg == 1)) named_bar_arrive(2 - wg, 256);
  };

  const bool loader = wg == 1;
  if (loader) {
    issue_group(0);
    issue_group(1);
    cp_async_wait<1>();
    fence_proxy_async();
    mbar_arrive(full_bar(0));
    named_bar_arrive(1, 256);  // warpgroup 0 issues first
  }
  float alpha[2];
  // iteration 0: S(0) only
  mbar_wait(full_bar(0), 0);
  wgmma_fence();
  turn_begin();
  issue_qk(0);
  turn_end(false);
  if (loader) {
    publish(1);
    issue_group(2);
  }
  wgmma_wait<0>();
  fence_regs(s);
  mbar_arrive(empty_bar(0));
  softmax(n_blocks - 1, alpha);
  pack_p();

  for (int it = 1; it < n_blocks; ++it) {
    const int nb = n_blocks - 1 - it;  // key block of S in this iteration
    mbar_wait(full_bar(it), (it / 3) & 1);  // K(it), V(it - 1)
    wgmma_fence();
    turn_begin();
    issue_qk(it % kStages);
    issue_pv((it - 1) % kStages);
    turn_end(false);
    if (loader) {
      publish(it + 1);
      mbar_wait(empty_bar(it - 1), ((it - 1) / 3) & 1);  // stages of K(it-1), V(it-2) free
      issue_group(it + 2);
    }
    wgmma_wait<1>();  // S(it) ready; P(it-1) V(it-1) may still run
    fence_regs(s);
    softmax(nb, alpha);
    wgmma_wait<0>();
    fence_regs(o);
    fence_regs(pa);
    mbar_arrive(empty_bar(it));
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      o[4 * j + 0] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }
    pack_p();
  }

  mbar_wait(full_bar(n_blocks), (n_blocks / 3) & 1);  // V(n_blocks - 1)
  wgmma_fence();
  turn_begin();
  issue_pv((n_blocks - 1) % kStages);
  turn_end(true);
  wgmma_wait<0>();
  fence_regs(o);

  // Epilogue: O / l, lse = m * scale + ln(l); rows without a visible key give 0 and -inf.
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_i[r]);
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
    if (c == 0) p.lse[tok * p.num_heads_q + h] = l > 0.f ? m_i[r] * p.softmax_scale + logf(l) : -INFINITY;
  }
}

template <typename T, int kD>
void launch_fwd_wgmma_pp(const FlashAttentionParams& p, cudaStream_t stream) {
  constexpr int kBc = 128, kBr = 128;
  constexpr size_t smem = static_cast<size_t>(kBr + 6 * kBc) * kD * 2 + 1024 + 64;  // + alignment, mbarriers
  auto kernel = flash_fwd_wgmma_pp_kernel<T, kD, kBc>;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid(p.num_heads_q, (p.max_seqlen_q + kBr - 1) / kBr, p.num_docs);
  kernel<<<grid, 256, smem, stream>>>(p);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::fa
