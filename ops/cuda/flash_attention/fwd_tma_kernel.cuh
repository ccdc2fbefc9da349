// Flash attention forward for Hopper (sm_90a), fed by TMA: kWG warpgroups x 64 query rows, kBc-key
// tiles walked from the last, S = Q K^T and O += P V on wgmma (fwd_mainloop.cuh), the P V GEMM of
// tile i-1 overlapping the softmax of tile i, no block barrier per tile:
// - Q and the K/V tiles arrive by cp.async.bulk.tensor (one thread issues a whole tile; the
//   consumers execute no copy instructions and no proxy fence);
// - K and V live in kStages-deep rings with a "full" mbarrier per slot (armed with the tile's
//   bytes) and an "empty" one (one arrival per warp once its wgmma reading the slot completed);
// - the first thread of the last warpgroup refills a slot when every warp has released it, at the
//   end of its iteration, so the warpgroups are never stopped by a __syncthreads;
// - kPingPong (2 warpgroups): named barriers make the warpgroups take turns issuing their GEMMs
//   (FA3's scheduling), so one warpgroup's softmax overlaps the other's GEMMs.
// Boxes read past the tensor's end are zero-filled. A document's last tile can also hold keys of
// the next document: S masks them (P = 0), and before its first P V GEMM the block zeroes those V
// rows (once per block, one barrier), so that 0 * (a non-finite value of another document) never
// reaches the output: the same result as zero-filled rows.
// kBlockMask (TmaFwdMaskTraits: 128-row blocks = one query block of the mask): the block walks only
// the key tiles its query block lists (last first), applies a PARTIAL tile's bits to S before the
// softmax (-inf where clear; fwd_apply_mask_bits) and skips the V-tail clearing (one document
// spanning the tensor: the rows past its end are TMA's zero fill).
#pragma once

#include <cmath>
#include <type_traits>

#include "cuda/flash_attention/device_primitives.cuh"
#include "cuda/flash_attention/fwd_mainloop.cuh"
#include "cuda/flash_attention/traits.h"
#include "cuda/flash_attention/tile_scheduler.h"
#include "cuda/flash_attention/tma.cuh"
#include "cuda/flash_attention/wgmma.cuh"
#include "kestrel/cuda/check.h"

namespace kestrel::cuda::fa {

template <typename T, int kD, int kWG, int kBc, int kStages, bool kPingPong, bool kPrefix, bool kBlockMask>
__global__ void __launch_bounds__(kWG * 128, 1)
    flash_fwd_tma_kernel(const FlashAttentionParams p, const __grid_constant__ CUtensorMap tq,
                         const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                         const FlashBlockMask mask) {
  constexpr int kBr = kWG * 64;
  constexpr int kDs = kernel_smem_dim(kD);  // shared tile width (narrow kD: 128, zero past the head dim)
  constexpr int kNs = kBc / 2;   // S accumulator floats per thread
  constexpr int kNo = kD / 2;    // O accumulator floats per thread
  constexpr int kKs = kBc / 16;  // k-steps of P V (A fragments of P)
  constexpr int kWarps = kWG * 4;
  constexpr uint32_t kQBytes = kBr * kDs * 2, kKVBytes = kBc * kDs * 2;
  static_assert(kDs % 64 == 0 && kBc % 64 == 0 && kD % 16 == 0 && kD <= kDs, "64-column swizzle slabs");
  static_assert(kStages >= 2 && kStages <= 3, "K/V ring depth");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;  // [kDs/64][kBr][64]
  const uint32_t sK = sQ + kQBytes;                            // kStages x [kDs/64][kBc][64]
  const uint32_t sV = sK + kStages * kKVBytes;                 // kStages x [kDs/64][kBc][64]
  const uint32_t bars = sV + kStages * kKVBytes;               // 8-byte mbarriers:
  const uint32_t barQ = bars;                                  //   Q landed
  auto full_k = [&](int s) { return bars + 8 * (1 + s); };
  auto full_v = [&](int s) { return bars + 8 * (1 + kStages + s); };
  auto empty_k = [&](int s) { return bars + 8 * (1 + 2 * kStages + s); };
  auto empty_v = [&](int s) { return bars + 8 * (1 + 3 * kStages + s); };

  const int tid = threadIdx.x, wg = tid / 128, lane = tid % 32, wwarp = (tid % 128) / 32;
  const int g = lane / 4, c = lane % 4;
  const auto [h, hk, q_start, len_q, k_start, len_k, m0, off, n_blocks, n_first] = fwd_tile<kBr, kBc, kPrefix, kBlockMask>(p, kBlockMask ? &mask : nullptr);
  const int n_tiles = n_blocks - n_first;  // key tiles visited: blocks n_blocks - 1 down to n_first
  if (m0 >= len_q) return;
  // The loads are issued by the first thread of the last warpgroup: under ping-pong scheduling that
  // warpgroup runs behind, so the slots it releases are the last ones freed and it never waits.
  const bool producer = tid == (kWG - 1) * 128;
  const int wg_row0 = m0 + wg * 64;               // first query row of this warpgroup
  const int row_base = wg_row0 + wwarp * 16 + g;  // rows row_base and row_base + 8 of this thread
  // Block mask: the query block's first entry in the row view.
  const int mask_base = kBlockMask ? mask.q_ptr[m0 / kBlockMaskBlock] : 0;

  // Tile j (processing order) is key block n_blocks - 1 - j (with a block mask, the key block of
  // that list entry); it sits in slot j % kStages.
  auto key_block = [&](int j) {
    if constexpr (kBlockMask) return mask.q_kblock[fwd_mask_entry(mask_base, n_blocks, j)];
    return n_blocks - 1 - j;
  };
  auto load_k = [&](int j) {
    mbar_arrive_expect_tx(full_k(j % kStages), kKVBytes);
    tma_load_tile<kBc, kDs>(sK + (j % kStages) * kKVBytes, &tk, full_k(j % kStages), hk,
                           k_start + key_block(j) * kBc);
  };
  auto load_v = [&](int j) {
    mbar_arrive_expect_tx(full_v(j % kStages), kKVBytes);
    tma_load_tile<kBc, kDs>(sV + (j % kStages) * kKVBytes, &tv, full_v(j % kStages), hk,
                           k_start + key_block(j) * kBc);
  };
  if (producer) {
    prefetch_tma_map(&tq);
    prefetch_tma_map(&tk);
    prefetch_tma_map(&tv);
    mbar_init(barQ, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), 1);
      mbar_init(full_v(s), 1);
      mbar_init(empty_k(s), kWarps);
      mbar_init(empty_v(s), kWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (producer && n_tiles > 0) {
    mbar_arrive_expect_tx(barQ, kQBytes);
    tma_load_tile<kBr, kDs>(sQ, &tq, barQ, h, q_start + m0);
    for (int j = 0; j < kStages && j < n_tiles; ++j) {
      load_k(j);
      load_v(j);
    }
  }

  float o[kNo];
#pragma unroll
  for (int i = 0; i < kNo; ++i) o[i] = 0.f;
  WgmmaSoftmaxRows<kBc> sm;
  const float sl2 = p.softmax_scale * 1.4426950408889634f;
  float s[kNs];
  uint32_t pa[kKs][4];

  auto issue_qk = [&](int slot) { wgmma_issue_qk<T, kD, kBr, kBc>(s, sQ, sK + slot * kKVBytes, wg); };
  auto issue_pv = [&](int slot) { wgmma_issue_pv<T, kD, kBc>(o, pa, sV + slot * kKVBytes); };
  auto softmax = [&](int j, float (&alpha)[2]) {
    const int n0 = key_block(j) * kBc;
    if constexpr (kBlockMask) {  // PARTIAL tile: the bits (the document-end mask below still applies)
      const int kind = mask.q_kind[fwd_mask_entry(mask_base, n_blocks, j)];
      if (kind >= 0)
        fwd_apply_mask_bits(s, mask.bits + static_cast<int64_t>(kind) * (kBlockMaskBlock * 4), row_base - m0, c);
    }
    const bool need_mask = (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > wg_row0 + off) ||
                           tile_crosses_window(p, wg_row0 + 63, n0, off);
    sm.template step<kPrefix>(s, n0, need_mask, len_k, p.causal, p.window, p.prefix_len, row_base, off, c, sl2, alpha);
  };
  auto release = [&](uint32_t bar) {
    if (lane == 0) mbar_arrive(bar);
  };
  auto phase = [](int j) { return static_cast<uint32_t>((j / kStages) & 1); };
  // Zeroes V rows of tile 0 (slot 0, landed) past the document's end; block-uniform condition.
  auto clear_v_tail = [&] {
    if constexpr (kBlockMask) return;  // one document: rows past its end are past the tensor (zero fill)
    const int valid = len_k - (n_blocks - 1) * kBc;
    if (valid >= kBc) return;
    constexpr int kChunks = kBc * (kDs / 8);  // 16-byte chunks of the tile
    for (int i = tid; i < kChunks; i += kWG * 128) {
      const int slab = i / (kBc * 8), row = (i / 8) % kBc, ch = i % 8;
      if (row >= valid) {
        const uint32_t dst = sV + slab * (kBc * 128) + row * 128 + ch * 16;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(dst), "r"(0u) : "memory");
      }
    }
    fence_proxy_async();
    __syncthreads();
  };

  if (n_tiles > 0) {
    mbar_wait(barQ, 0);
    mbar_wait(full_k(0), 0);
    wgmma_fence();
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs(s);
    release(empty_k(0));
    float alpha[2];
    softmax(0, alpha);
    wgmma_pack_p<T, kBc>(s, pa);
    if (producer && kStages < n_tiles) {
      mbar_wait(empty_k(0), 0);
      load_k(kStages);
    }

    if constexpr (kPingPong) {
      if (wg == 1 && n_tiles > 1) named_bar_arrive(1, 256);  // warpgroup 0 issues first
    }
    for (int it = 1; it < n_tiles; ++it) {
      const int slot = it % kStages, pslot = (it - 1) % kStages;
      mbar_wait(full_k(slot), phase(it));
      mbar_wait(full_v(pslot), phase(it - 1));
      if (it == 1) clear_v_tail();
      // Ping-pong (2 warpgroups): GEMM issue alternates between them, so that one warpgroup's
      // softmax runs while the other's GEMMs hold the tensor cores (named barriers 1 and 2).
      if constexpr (kPingPong) named_bar_sync(1 + wg, 256);
      wgmma_fence();
      issue_qk(slot);
      issue_pv(pslot);
      if constexpr (kPingPong) {
        if (!(wg == 1 && it == n_tiles - 1)) named_bar_arrive(2 - wg, 256);  // balanced at exit
      }
      wgmma_wait<1>();  // S(it) ready; P(it-1) V(it-1) may still run
      fence_regs(s);
      release(empty_k(slot));
      softmax(it, alpha);
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pa);
      release(empty_v(pslot));
      wgmma_rescale_o<kD>(o, alpha);
      wgmma_pack_p<T, kBc>(s, pa);
      if (producer) {  // refill the two slots released in this iteration
        if (it + kStages < n_tiles) {
          mbar_wait(empty_k(slot), phase(it));
          load_k(it + kStages);
        }
        if (it - 1 + kStages < n_tiles) {
          mbar_wait(empty_v(pslot), phase(it - 1));
          load_v(it - 1 + kStages);
        }
      }
    }

    const int last = n_tiles - 1;
    mbar_wait(full_v(last % kStages), phase(last));
    if (last == 0) clear_v_tail();
    wgmma_fence();
    issue_pv(last % kStages);
    wgmma_wait<0>();
    fence_regs(o);
  }

  wgmma_fwd_epilogue<T, kD, kBc>(p, o, sm, row_base, len_q, q_start, h, c);
}

template <typename T, int kD, bool kPrefix, bool kBlockMask>
void launch_fwd_tma(const FlashAttentionParams& p, cudaStream_t stream) {
  using Tr = std::conditional_t<kBlockMask, TmaFwdMaskTraits, TmaFwdTraits<kD>>;
  constexpr int kBr = Tr::kWG * 64, kBc = Tr::kBc, kStages = Tr::kStages;
  static_assert(!Tr::kPingPong || Tr::kWG == 2, "ping-pong alternates two warpgroups");
  const CUtensorMap tq = make_tma_map_3d(p.q, p.dtype, p.total_q, p.num_heads_q, p.head_dim, kBr);
  const CUtensorMap tk = make_tma_map_3d(p.k, p.dtype, p.total_k, p.num_heads_kv, p.head_dim, kBc);
  const CUtensorMap tv = make_tma_map_3d(p.v, p.dtype, p.total_k, p.num_heads_kv, p.head_dim, kBc);
  constexpr size_t smem =
      static_cast<size_t>(kBr + 2 * kStages * kBc) * kernel_smem_dim(kD) * 2 + 1024 + 8 * (1 + 4 * kStages);
  auto kernel = flash_fwd_tma_kernel<T, kD, Tr::kWG, kBc, kStages, Tr::kPingPong, kPrefix, kBlockMask>;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const FlashBlockMask mask = kBlockMask ? *p.block_mask : FlashBlockMask{};
  kernel<<<fwd_grid(p, kBr), Tr::kWG * 128, smem, stream>>>(p, tq, tk, tv, mask);
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::fa
