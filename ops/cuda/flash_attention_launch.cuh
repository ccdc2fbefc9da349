// Tile choices per head dimension and the launcher templates that the per-dtype / per-head-dim
// .cu files instantiate (flash_attention_fwd_*.cu, flash_attention_bwd_*.cu). Host-visible
// declarations only, so the entry points compile without pulling in the kernels.
#pragma once

#include <cstdint>

#include "cuda/flash_attention.h"

namespace kestrel::cuda::fa {

// Forward: one block of kBr query rows (16*kMT per warp) walks kBc-wide key tiles.
template <int kD>
struct FwdTraits;
template <>
struct FwdTraits<64> { static constexpr int kBr = 128, kBc = 64, kMT = 2; };
template <>
struct FwdTraits<128> { static constexpr int kBr = 128, kBc = 64, kMT = 2; };
template <>
struct FwdTraits<256> { static constexpr int kBr = 64, kBc = 32, kMT = 1; };

// Hopper wgmma forward (flash_attention_fwd_wgmma_kernel.cuh): kWG consumer warpgroups x 64 query
// rows per block, kBc-key tiles. Head dims 64 and 128 only (the others use the mma.sync kernel).
template <int kD>
struct WgmmaFwdTraits;
template <>
struct WgmmaFwdTraits<64> { static constexpr int kWG = 3, kBc = 128; };
template <>
struct WgmmaFwdTraits<128> { static constexpr int kWG = 2, kBc = 128; };

// Backward: one block owns kBc keys (16 per warp) of one KV head and kDC of its output columns
// (dk, dv, dq), and walks kBr-row query tiles of every query head of its GQA group.
template <int kD>
struct BwdTraits;
template <>
struct BwdTraits<64> { static constexpr int kBc = 128, kBr = 64, kDC = 64; };
template <>
struct BwdTraits<128> { static constexpr int kBc = 128, kBr = 64, kDC = 128; };
template <>
struct BwdTraits<256> { static constexpr int kBc = 64, kBr = 32, kDC = 128; };

// Arguments of the main backward kernel (workspace already carved).
struct BwdArgs {
  FlashAttentionParams p;
  const void* dout;  // [total_q, Hq, D]
  void* dk;          // [total_k, Hkv, D]
  void* dv;          // [total_k, Hkv, D]
  float* dq_accum;   // [total_q, Hq, D] f32, zeroed by the preprocess kernel
  const float* lse2;   // [Hq, total_q] lse * log2(e), +inf for rows without visible keys
  const float* delta;  // [Hq, total_q] rowsum(dout * out)
  int total_q;
};

// Shared validation (throws kestrel::Error "[flash_attention] ...") and head-dim dispatch.
void check_params(const FlashAttentionParams& p);
int padded_head_dim(int head_dim);

template <typename T, int kD>
void launch_fwd(const FlashAttentionParams& p, cudaStream_t stream);
template <typename T, int kD>  // kD 64 and 128; stages: K/V ring depth, 2 or 3
void launch_fwd_wgmma(const FlashAttentionParams& p, int stages, cudaStream_t stream);
template <typename T, int kD>
void launch_bwd_v2(const BwdArgs& a, cudaStream_t stream);     // 16 keys per warp (all head dims)
template <typename T, int kD>
void launch_bwd_tiled(const BwdArgs& a, cudaStream_t stream);  // 2-D warp tiles (instantiated: kD 128)
// Hopper wgmma backward (flash_attention_bwd_wgmma_kernel.cuh), kD 64 and 128: 2 warpgroups x 64
// keys per block, 64-query tiles at kD 128, 128 at kD 64.
template <typename T, int kD>
void launch_bwd_wgmma(const BwdArgs& a, cudaStream_t stream);

}  // namespace kestrel::cuda::fa
