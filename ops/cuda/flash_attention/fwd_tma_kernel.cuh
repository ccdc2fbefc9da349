// Flash attention forwards for Hopper (sm_90a), fed by TMA; two kernels share the mainloop
// (traits.h picks per head dim: kWarpSpecialized):
// - flash_fwd_ws_kernel: persistent, a producer warpgroup issues the loads (comment at the kernel;
//   head dims 64 and 128, every prefix-LM and block-mask forward);
// - flash_fwd_tma_kernel: one block per query tile, the loads issued by a consumer thread (the
//   narrow head dims 80/96/112, built without the mask variants).
// The mainloop (both): 64 query rows per consumer warpgroup, kBc-key tiles walked from the last,
// S = Q K^T and O += P V on wgmma (fwd_mainloop.cuh), the P V GEMM of tile i-1 overlapping the
// softmax of tile i, no block barrier per tile:
// - Q and the K/V tiles arrive by cp.async.bulk.tensor (one thread issues a whole tile; the
//   consumers execute no copy instructions and no proxy fence);
// - K and V live in kStages-deep rings with a "full" mbarrier per slot (armed with the tile's
//   bytes) and an "empty" one (one arrival per warp once its wgmma reading the slot completed);
// - with two consumer warpgroups, named barriers make them take turns issuing their GEMMs (FA3's
//   ping-pong scheduling), so one warpgroup's softmax overlaps the other's GEMMs.
// Boxes read past the tensor's end are zero-filled. A document's last tile can also hold keys of
// the next document: S masks them (P = 0), and before its first P V GEMM the block zeroes those V
// rows (once per item, one barrier), so that 0 * (a non-finite value of another document) never
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
#include "kestrel/runtime/error.h"

namespace kestrel::cuda::fa {

// flash_fwd_tma_kernel: two warpgroups in ping-pong; the first thread of the last warpgroup refills
// a ring slot when every warp has released it, at the end of its iteration, so the warpgroups are
// never stopped by a __syncthreads.
template <typename T, int kD, int kBc, int kStages>
__global__ void __launch_bounds__(256, 1)
    flash_fwd_tma_kernel(const FlashAttentionParams p, const __grid_constant__ CUtensorMap tq,
                         const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv) {
  constexpr int kWG = 2, kBr = kWG * 64;
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
  const uint32_t barQ = bars;                                  //   Q landed, then the rings'
  const KvRingBarriers<kStages> ring{bars + 8};

  // wg broadcast from lane 0 so that ptxas treats it (and what is built from it) as warp-uniform, as in
  // the backward (bwd_wgmma_kernel.cuh).
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid / 128, 0), lane = tid % 32, wwarp = (tid % 128) / 32;
  const int g = lane / 4, c = lane % 4;
  const auto [h, hk, q_start, len_q, k_start, len_k, m0, off, n_blocks, n_first] = fwd_tile<kBr, kBc, false>(p);
  const int n_tiles = n_blocks - n_first;  // key tiles visited: blocks n_blocks - 1 down to n_first
  if (m0 >= len_q) return;
  // The loads are issued by the first thread of the last warpgroup: under ping-pong scheduling that
  // warpgroup runs behind, so the slots it releases are the last ones freed and it never waits.
  const bool producer = tid == (kWG - 1) * 128;
  const int wg_row0 = m0 + wg * 64;               // first query row of this warpgroup
  const int row_base = wg_row0 + wwarp * 16 + g;  // rows row_base and row_base + 8 of this thread

  // Tile j (processing order) is key block n_blocks - 1 - j; it sits in slot j % kStages.
  auto key_block = [&](int j) { return n_blocks - 1 - j; };
  auto load_k = [&](int j) {
    mbar_arrive_expect_tx(ring.full_k(j % kStages), kKVBytes);
    tma_load_tile<kBc, kDs>(sK + (j % kStages) * kKVBytes, &tk, ring.full_k(j % kStages), hk,
                           k_start + key_block(j) * kBc);
  };
  auto load_v = [&](int j) {
    mbar_arrive_expect_tx(ring.full_v(j % kStages), kKVBytes);
    tma_load_tile<kBc, kDs>(sV + (j % kStages) * kKVBytes, &tv, ring.full_v(j % kStages), hk,
                           k_start + key_block(j) * kBc);
  };
  if (producer) {
    prefetch_tma_map(&tq);
    prefetch_tma_map(&tk);
    prefetch_tma_map(&tv);
    mbar_init(barQ, 1);
    ring.init(kWarps);
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
    const bool need_mask = (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > wg_row0 + off) ||
                           tile_crosses_window(p, wg_row0 + 63, n0, off);
    sm.template step<false>(s, n0, need_mask, len_k, p.causal, p.window, p.prefix_len, blockIdx.z, row_base, off, c,
                            sl2, alpha);
  };
  auto release = [&](uint32_t bar) {
    if (lane == 0) mbar_arrive(bar);
  };
  auto phase = [](int j) { return static_cast<uint32_t>((j / kStages) & 1); };
  // Zeroes V rows of tile 0 (slot 0, landed) past the document's end; block-uniform condition.
  auto clear_v_tail = [&] {
    const int valid = len_k - (n_blocks - 1) * kBc;
    if (valid >= kBc) return;
    zero_tile_rows<kBc, kDs>(sV, valid, tid, kWG * 128);
    __syncthreads();
  };

  if (n_tiles > 0) {
    mbar_wait(barQ, 0);
    mbar_wait(ring.full_k(0), 0);
    wgmma_fence();
    issue_qk(0);
    wgmma_wait<0>();
    fence_regs(s);
    release(ring.empty_k(0));
    float alpha[2];
    softmax(0, alpha);
    wgmma_pack_p<T, kBc>(s, pa);
    if (producer && kStages < n_tiles) {
      mbar_wait(ring.empty_k(0), 0);
      load_k(kStages);
    }

    if (wg == 1 && n_tiles > 1) named_bar_arrive(1, 256);  // warpgroup 0 issues first
    for (int it = 1; it < n_tiles; ++it) {
      const int slot = it % kStages, pslot = (it - 1) % kStages;
      mbar_wait(ring.full_k(slot), phase(it));
      mbar_wait(ring.full_v(pslot), phase(it - 1));
      if (it == 1) clear_v_tail();
      // Ping-pong: GEMM issue alternates between the warpgroups, so that one warpgroup's softmax
      // runs while the other's GEMMs hold the tensor cores (named barriers 1 and 2).
      named_bar_sync(1 + wg, 256);
      wgmma_fence();
      issue_qk(slot);
      issue_pv(pslot);
      if (!(wg == 1 && it == n_tiles - 1)) named_bar_arrive(2 - wg, 256);  // balanced at exit
      wgmma_wait<1>();  // S(it) ready; P(it-1) V(it-1) may still run
      fence_regs(s);
      release(ring.empty_k(slot));
      softmax(it, alpha);
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pa);
      release(ring.empty_v(pslot));
      wgmma_rescale_o<kD>(o, alpha);
      wgmma_pack_p<T, kBc>(s, pa);
      if (producer) {  // refill the two slots released in this iteration
        if (it + kStages < n_tiles) {
          mbar_wait(ring.empty_k(slot), phase(it));
          load_k(it + kStages);
        }
        if (it - 1 + kStages < n_tiles) {
          mbar_wait(ring.empty_v(pslot), phase(it - 1));
          load_v(it - 1 + kStages);
        }
      }
    }

    const int last = n_tiles - 1;
    mbar_wait(ring.full_v(last % kStages), phase(last));
    if (last == 0) clear_v_tail();
    wgmma_fence();
    issue_pv(last % kStages);
    wgmma_wait<0>();
    fence_regs(o);
  }

  wgmma_fwd_epilogue<T, kD, kBc>(p, o, sm, row_base, len_q, q_start, h, c);
}

// Warp-specialised persistent forward (FA3's layout): kWG + 1 warpgroups, the first a producer
// whose first thread issues every TMA load (setmaxnreg: 24 registers; its other warps leave), the
// others consumers of 64 query rows each that run the mainloop above without a single copy or
// producer wait in their instruction stream: two taking turns to issue their GEMMs (kPingPong, 240
// registers; head dim 128, block masks) or three running free (160 registers; head dim 64). One
// block per SM walks the work items of fwd_work_item (in L2 sections, heaviest causal band first
// inside each, snake order); the K/V rings and their phases run on across items, and Q has a
// "free" mbarrier (one arrival per consumer warp once its last S GEMM of the item completed), so
// the producer loads the next item's Q and first K/V tiles while the consumers finish the last
// tile and write the output.
template <typename T, int kD, int kWG, int kBc, int kStages, bool kPingPong, bool kPrefix, bool kBlockMask>
__global__ void __launch_bounds__((kWG + 1) * 128, 1)
    flash_fwd_ws_kernel(const FlashAttentionParams p, const __grid_constant__ CUtensorMap tq,
                        const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                        const FlashBlockMask mask, int n_qtiles, int section) {
  constexpr int kBr = kWG * 64;
  constexpr int kDs = kernel_smem_dim(kD);
  // Registers: producer 24, consumers the rest of the 64K file (multiples of 8): 240 for 2, 160 for 3.
  constexpr int kConsumerRegs = kWG == 2 ? 240 : 160;
  static_assert(kWG == 2 || (kWG == 3 && !kPingPong), "2 ping-pong consumers or 3 without");
  constexpr int kNs = kBc / 2, kNo = kD / 2, kKs = kBc / 16;
  constexpr int kWarps = kWG * 4;  // consumer warps: the count of every "empty" barrier
  constexpr uint32_t kQBytes = kBr * kDs * 2, kKVBytes = kBc * kDs * 2;
  static_assert(kDs % 64 == 0 && kBc % 64 == 0 && kD % 16 == 0 && kD <= kDs, "64-column swizzle slabs");
  static_assert(kStages >= 2 && kStages <= 3, "K/V ring depth");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t sQ = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sK = sQ + kQBytes;
  const uint32_t sV = sK + kStages * kKVBytes;
  const uint32_t bars = sV + kStages * kKVBytes;
  const uint32_t barQ = bars, barQfree = bars + 8;  // then the rings'
  const KvRingBarriers<kStages> ring{bars + 16};
  const int tid = threadIdx.x;
  const int n_work = n_qtiles * p.num_heads_q * p.num_docs;
  if (tid == 0) {
    prefetch_tma_map(&tq);
    prefetch_tma_map(&tk);
    prefetch_tma_map(&tv);
    mbar_init(barQ, 1);
    mbar_init(barQfree, kWarps);
    ring.init(kWarps);
    fence_mbarrier_init();
  }
  __syncthreads();

  if (tid < 128) {  // producer warpgroup
    setmaxnreg_dec<24>();
    if (tid != 0) return;
    int kv = 0, q_items = 0;  // K/V tiles loaded so far (ring position), items whose Q was loaded
    for (int r = 0;; ++r) {
      const int w = fwd_work_index(r);
      if (w >= n_work) break;
      const FwdWork wk = fwd_work_item(p, n_qtiles, section, w);
      const FwdTile t = fwd_tile_at<kBr, kBc, kPrefix, kBlockMask>(p, &mask, wk.h, wk.m, wk.doc);
      const int n_tiles = t.n_blocks - t.n_first;
      if (t.m0 >= t.len_q || n_tiles <= 0) continue;
      if (q_items > 0) mbar_wait(barQfree, (q_items - 1) & 1);
      mbar_arrive_expect_tx(barQ, kQBytes);
      tma_load_tile<kBr, kDs>(sQ, &tq, barQ, t.h, t.q_start + t.m0);
      ++q_items;
      const int mask_base = kBlockMask ? mask.q_ptr[t.m0 / kBlockMaskBlock] : 0;
      for (int j = 0; j < n_tiles; ++j, ++kv) {
        const int slot = kv % kStages, use = kv / kStages;
        const int kb = kBlockMask ? mask.q_kblock[fwd_mask_entry(mask_base, t.n_blocks, j)] : t.n_blocks - 1 - j;
        if (use > 0) mbar_wait(ring.empty_k(slot), (use - 1) & 1);
        mbar_arrive_expect_tx(ring.full_k(slot), kKVBytes);
        tma_load_tile<kBc, kDs>(sK + slot * kKVBytes, &tk, ring.full_k(slot), t.hk, t.k_start + kb * kBc);
        if (use > 0) mbar_wait(ring.empty_v(slot), (use - 1) & 1);
        mbar_arrive_expect_tx(ring.full_v(slot), kKVBytes);
        tma_load_tile<kBc, kDs>(sV + slot * kKVBytes, &tv, ring.full_v(slot), t.hk, t.k_start + kb * kBc);
      }
    }
    return;
  }

  setmaxnreg_inc<kConsumerRegs>();
  // wg broadcast from lane 0 (warp-uniform to ptxas): 40 instructions fewer at D128, the forward +1% to
  // +1.5% (bench/notes/flash_attention.md, "Sixteenth session").
  const int ctid = tid - 128, wg = __shfl_sync(0xffffffffu, ctid / 128, 0), lane = tid % 32, wwarp = (ctid % 128) / 32;
  const int g = lane / 4, c = lane % 4;
  const float sl2 = p.softmax_scale * 1.4426950408889634f;
  int kv = 0, q_items = 0;  // as the producer's: ring position and items whose Q was used
  for (int r = 0;; ++r) {
    const int w = fwd_work_index(r);
    if (w >= n_work) break;
    const FwdWork wk = fwd_work_item(p, n_qtiles, section, w);
    const auto [h, hk, q_start, len_q, k_start, len_k, m0, off, n_blocks, n_first] =
        fwd_tile_at<kBr, kBc, kPrefix, kBlockMask>(p, &mask, wk.h, wk.m, wk.doc);
    if (m0 >= len_q) continue;
    const int n_tiles = n_blocks - n_first;
    const int wg_row0 = m0 + wg * 64;
    const int row_base = wg_row0 + wwarp * 16 + g;
    const int mask_base = kBlockMask ? mask.q_ptr[m0 / kBlockMaskBlock] : 0;
    const int kv0 = kv;
    auto key_block = [&](int j) {
      if constexpr (kBlockMask) return mask.q_kblock[fwd_mask_entry(mask_base, n_blocks, j)];
      return n_blocks - 1 - j;
    };
    auto slot_of = [&](int j) { return (kv0 + j) % kStages; };
    auto phase = [&](int j) { return static_cast<uint32_t>(((kv0 + j) / kStages) & 1); };

    float o[kNo];
#pragma unroll
    for (int i = 0; i < kNo; ++i) o[i] = 0.f;
    WgmmaSoftmaxRows<kBc> sm;
    float s[kNs];
    uint32_t pa[kKs][4];
    auto issue_qk = [&](int slot) { wgmma_issue_qk<T, kD, kBr, kBc>(s, sQ, sK + slot * kKVBytes, wg); };
    auto issue_pv = [&](int slot) { wgmma_issue_pv<T, kD, kBc>(o, pa, sV + slot * kKVBytes); };
    auto softmax = [&](int j, float (&alpha)[2]) {
      const int n0 = key_block(j) * kBc;
      if constexpr (kBlockMask) {
        const int kind = mask.q_kind[fwd_mask_entry(mask_base, n_blocks, j)];
        if (kind >= 0)
          fwd_apply_mask_bits(s, mask.bits + static_cast<int64_t>(kind) * (kBlockMaskBlock * 4), row_base - m0, c);
      }
      const bool need_mask = (n0 + kBc > len_k) || (p.causal && n0 + kBc - 1 > wg_row0 + off) ||
                             tile_crosses_window(p, wg_row0 + 63, n0, off);
      sm.template step<kPrefix>(s, n0, need_mask, len_k, p.causal, p.window, p.prefix_len, wk.doc, row_base, off,
                                c, sl2, alpha);
    };
    auto release = [&](uint32_t bar) {
      if (lane == 0) mbar_arrive(bar);
    };
    // Zeroes the V rows of tile 0 (landed) past the document's end; item-uniform condition. The two
    // consumer warpgroups meet at named barrier 3.
    auto clear_v_tail = [&] {
      if constexpr (kBlockMask) return;
      const int valid = len_k - (n_blocks - 1) * kBc;
      if (valid >= kBc) return;
      zero_tile_rows<kBc, kDs>(sV + slot_of(0) * kKVBytes, valid, ctid, kWG * 128);
      named_bar_sync(3, kWG * 128);
    };

    if (n_tiles > 0) {
      mbar_wait(barQ, q_items & 1);
      ++q_items;
      mbar_wait(ring.full_k(slot_of(0)), phase(0));
      wgmma_fence();
      issue_qk(slot_of(0));
      wgmma_wait<0>();
      fence_regs(s);
      release(ring.empty_k(slot_of(0)));
      if (n_tiles == 1) release(barQfree);
      float alpha[2];
      softmax(0, alpha);
      wgmma_pack_p<T, kBc>(s, pa);
      if constexpr (kPingPong) {
        if (wg == 1 && n_tiles > 1) named_bar_arrive(1, kWG * 128);  // warpgroup 0 issues first
      }
      for (int it = 1; it < n_tiles; ++it) {
        const int slot = slot_of(it), pslot = slot_of(it - 1);
        mbar_wait(ring.full_k(slot), phase(it));
        mbar_wait(ring.full_v(pslot), phase(it - 1));
        if (it == 1) clear_v_tail();
        if constexpr (kPingPong) named_bar_sync(1 + wg, kWG * 128);
        wgmma_fence();
        issue_qk(slot);
        issue_pv(pslot);
        if constexpr (kPingPong) {
          if (!(wg == 1 && it == n_tiles - 1)) named_bar_arrive(2 - wg, kWG * 128);  // balanced per item
        }
        wgmma_wait<1>();
        fence_regs(s);
        release(ring.empty_k(slot));
        if (it == n_tiles - 1) release(barQfree);
        softmax(it, alpha);
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(pa);
        release(ring.empty_v(pslot));
        wgmma_rescale_o<kD>(o, alpha);
        wgmma_pack_p<T, kBc>(s, pa);
      }
      const int last = n_tiles - 1;
      mbar_wait(ring.full_v(slot_of(last)), phase(last));
      if (last == 0) clear_v_tail();
      wgmma_fence();
      issue_pv(slot_of(last));
      wgmma_wait<0>();
      fence_regs(o);
      release(ring.empty_v(slot_of(last)));
      kv += n_tiles;
    }
    wgmma_fwd_epilogue<T, kD, kBc>(p, o, sm, row_base, len_q, q_start, h, c);
  }
}

template <typename T, int kD, bool kPrefix, bool kBlockMask>
void launch_fwd_tma(const FlashAttentionParams& p, cudaStream_t stream) {
  using Tr = std::conditional_t<kBlockMask, TmaFwdMaskTraits, TmaFwdTraits<kD>>;
  constexpr int kBr = Tr::kWG * 64, kBc = Tr::kBc, kStages = Tr::kStages;
  static_assert(!Tr::kPingPong || Tr::kWG == 2, "ping-pong alternates two warpgroups");
  const CUtensorMap tq = make_tma_map_3d(p.q, p.dtype, p.total_q, p.num_heads_q, p.head_dim, kBr);
  const CUtensorMap tk = make_tma_map_3d(p.k, p.dtype, p.total_k, p.num_heads_kv, p.head_dim, kBc);
  const CUtensorMap tv = make_tma_map_3d(p.v, p.dtype, p.total_k, p.num_heads_kv, p.head_dim, kBc);
  const FlashBlockMask mask = kBlockMask ? *p.block_mask : FlashBlockMask{};
  if constexpr (Tr::kWarpSpecialized) {
    constexpr size_t smem =
        static_cast<size_t>(kBr + 2 * kStages * kBc) * kernel_smem_dim(kD) * 2 + 1024 + 8 * (2 + 4 * kStages);
    auto kernel = flash_fwd_ws_kernel<T, kD, Tr::kWG, kBc, kStages, Tr::kPingPong, kPrefix, kBlockMask>;
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const int64_t n_work = fwd_work_count(p, kBr);
    KESTREL_CHECK(n_work < (int64_t{1} << 30), "flash_attention", "forward: ", n_work,
                  " work items (query tiles x heads x documents) exceed the persistent scheduler's 2^30");
    const int n_qtiles = (p.max_seqlen_q + kBr - 1) / kBr;
    const int section = fwd_section_pairs(p, l2_cache_bytes());
    kernel<<<fwd_persistent_grid(p, kBr), (Tr::kWG + 1) * 128, smem, stream>>>(p, tq, tk, tv, mask, n_qtiles, section);
  } else {
    static_assert(!kPrefix && !kBlockMask && Tr::kWG == 2 && Tr::kPingPong,
                  "the per-tile kernel is built for the narrow head dims only: two ping-pong warpgroups, no mask variants");
    constexpr size_t smem =
        static_cast<size_t>(kBr + 2 * kStages * kBc) * kernel_smem_dim(kD) * 2 + 1024 + 8 * (1 + 4 * kStages);
    auto kernel = flash_fwd_tma_kernel<T, kD, kBc, kStages>;
    KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<fwd_grid(p, kBr), 256, smem, stream>>>(p, tq, tk, tv);
  }
  KESTREL_CUDA_CHECK_LAUNCH();
}

}  // namespace kestrel::cuda::fa
