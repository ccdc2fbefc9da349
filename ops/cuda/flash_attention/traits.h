// Tile choices of each kernel, the backward kernels' argument block, and the launcher templates that
// the generated instantiation files (inst_*.cu, generate_instantiations.py) compile. Host-visible
// declarations only, so the entry points (fwd_launch.cu, bwd_launch.cu) compile without the kernels.
#pragma once

#include <cstdint>

#include "cuda/flash_attention/flash_attention.h"

namespace kestrel::cuda::fa {

// Head dims of the Hopper kernels (kD below): 64 and 128, and the narrow widths 80, 96 and 112 for
// head dims in (64, 128) that are not 128 (heuristics.cpp: D rounded up to 16). A narrow kernel keeps
// the shared tiles of the 128 kernel (kernel_smem_dim: two 64-column swizzled slabs, zero past D)
// but issues only kD/16 k-steps of S = Q K^T (dP = dO V^T) and GEMMs of width N = kD for O = P V
// (dV, dK): 80/128 of the FLOPs and accumulator registers at head dim 72. Built without the
// deterministic and prefix-LM variants (kernel_has_variants; those run padded to 128).
constexpr bool is_narrow_head_dim(int kD) { return kD == 80 || kD == 96 || kD == 112; }
constexpr int kernel_smem_dim(int kD) { return kD <= 64 ? 64 : 128; }
constexpr bool kernel_has_variants(int kD) { return kD == 64 || kD == 128; }

// Hopper forward (fwd_tma_kernel.cuh): kWG consumer warpgroups x 64 query rows per block, kBc-key
// tiles, K/V rings of kStages slots; kPingPong: the two warpgroups take turns issuing their GEMMs
// (needs kWG == 2); kWarpSpecialized: the persistent kernel with a producer warpgroup
// (flash_fwd_ws_kernel: 2 ping-pong consumers at 240 registers, or 3 free-running ones at 160),
// otherwise one block per query tile whose last warpgroup's first thread issues the loads
// (flash_fwd_tma_kernel). Measured choices in bench/notes/flash_attention.md ("Removed variants",
// "Warp-specialised persistent forward"): the specialised kernel at head dim 128 (+3% causal / +9%
// bidirectional at 8k, +14-16% at 16k, -1% at 4k) and at 64 with three consumers (causal +2% / +5%
// / +6% at 4k / 8k / 16k, bidirectional -2% / +1% / +7%; two consumers lost 5-11%), not at the
// narrow widths (-4% to +3%). The narrow head dims take the 128 kernel's tiles (same shared layout).
template <int kD>
struct TmaFwdTraits {
  static constexpr int kWG = 2, kBc = 128, kStages = 2;
  static constexpr bool kPingPong = true, kWarpSpecialized = kD == 128;
};
template <>
struct TmaFwdTraits<64> {
  static constexpr int kWG = 3, kBc = 128, kStages = 2;
  static constexpr bool kPingPong = false, kWarpSpecialized = true;
};

// The Hopper forward with a block mask (kBlockMask): 128-row query tiles at both head dims, so one
// block owns exactly one query block of the mask (kBlockMaskBlock; head dim 64 drops to 2 warpgroups
// from the dense kernel's 3), 128-key tiles = one key block; the warp-specialised kernel (+9% at D64
// and +12% at D128, fwd 8k with the bench's 50% mask, over flash_fwd_tma_kernel with the same tiles).
struct TmaFwdMaskTraits {
  static constexpr int kWG = 2, kBc = 128, kStages = 2;
  static constexpr bool kPingPong = true, kWarpSpecialized = true;
};
static_assert(TmaFwdMaskTraits::kWG * 64 == kBlockMaskBlock && TmaFwdMaskTraits::kBc == kBlockMaskBlock,
              "a masked forward block owns one 128 x 128 tile row");

// mma.sync forward (fwd_mma_kernel.cuh), built at head dim 256 only: one block of kBr query rows
// (16*kMT per warp) walks kBc-wide key tiles.
struct MmaFwdTraits { static constexpr int kD = 256, kBr = 64, kBc = 32, kMT = 1; };

// Hopper backward (bwd_wgmma_kernel.cuh): 2 warpgroups x 64 keys (kBc 128) per block, kBr-query tiles
// (64 with 128-column shared tiles, narrow head dims included). kTmaQ: Q and dO tiles by TMA (one
// thread, an mbarrier per ring slot) rather than cp.async from every thread; measured in
// bench/notes/flash_attention.md ("Q and dO by TMA in the backward"): fwd+bwd +1% at D128, +3-5% at
// D72 (kernel 80), +6% with a block mask at 128, -2-4% at D64 (which keeps cp.async).
template <int kD>
struct WgmmaBwdTraits {
  static constexpr int kBc = 128, kBr = kernel_smem_dim(kD) == 128 ? 64 : 128;
  static constexpr bool kTmaQ = kernel_smem_dim(kD) == 128;
};
// Whether the backward's warp-specialised layout (FlashBwdLayout::Specialised) is built for kernel
// head dim kD and these variants: the 128-column tiles (Q and dO by TMA), causal, bidirectional,
// windowed and prefix-LM masks; not deterministic (its ordered dQ adds live in the consumers'
// reductions), not block masks (built for them it measured level with the plain layout:
// bench/notes/flash_attention.md, "Fifteenth session"). The one rule: the kernel's template and
// choose_kernel both ask it.
constexpr bool bwd_ws_built(int kD, bool deterministic, bool block_mask) {
  return kernel_smem_dim(kD) == 128 /* WgmmaBwdTraits<kD>::kTmaQ */ && !deterministic && !block_mask;
}
static_assert(WgmmaBwdTraits<64>::kBc == kBlockMaskBlock && kBlockMaskBlock % WgmmaBwdTraits<64>::kBr == 0 &&
                  kBlockMaskBlock % WgmmaBwdTraits<128>::kBr == 0,
              "a backward block owns one key block of the mask; its query tiles subdivide query blocks");

// mma.sync backward (bwd_mma_kernel.cuh), head dim 256: one block owns kBc keys (16 per warp) of one
// KV head and kDC of its output columns, and walks kBr-row query tiles of every query head of its group.
struct MmaBwdTraits { static constexpr int kD = 256, kBc = 64, kBr = 32, kDC = 128; };

// Arguments of the main backward kernels (workspace already carved).
struct BwdArgs {
  FlashAttentionParams p;
  const void* dout;  // [total_q, Hq, D]
  void* dk;          // [total_k, Hkv, D]
  void* dv;          // [total_k, Hkv, D]
  float* dq_accum;   // [total_q, Hq, D] f32, zeroed by the preprocess kernel (kWs: 8-column groups permuted)
  const float* lse2;   // [Hq, total_q] lse * log2(e), +inf for rows without visible keys
  const float* delta;  // [Hq, total_q] rowsum(dout * out)
  int* dq_order;       // [Hq, total_q] i32, zeroed by the preprocess kernel; deterministic mode only:
                       // at the first row of each query tile, how many key blocks have added their dq
  int total_q;
};

// kPrefix: p.prefix_len is set (prefix-LM mask); kBlockMask: p.block_mask is set (built at 64 and
// 128 only, without kPrefix / kDeterministic). Template flags so that the kernels without them keep
// the plain code and registers; kBlockMask defaults to false so the dense instantiations keep their
// names.
template <typename T, int kD, bool kPrefix, bool kBlockMask = false>  // kD 64, 80, 96, 112, 128 (flags: 64, 128)
void launch_fwd_tma(const FlashAttentionParams& p, cudaStream_t stream);
template <typename T>  // head dim 256 (smaller head dims zero-padded)
void launch_fwd_mma(const FlashAttentionParams& p, cudaStream_t stream);
// specialised: FlashBwdLayout::Specialised (KernelChoice::bwd_specialised; only where bwd_ws_built).
template <typename T, int kD, bool kDeterministic, bool kPrefix, bool kBlockMask = false>  // kD as launch_fwd_tma
void launch_bwd_wgmma(const BwdArgs& a, bool specialised, cudaStream_t stream);
template <typename T>  // head dim 256 (smaller head dims zero-padded)
void launch_bwd_mma(const BwdArgs& a, cudaStream_t stream);

}  // namespace kestrel::cuda::fa
