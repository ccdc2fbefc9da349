// Hopper bulk tensor copies (TMA) for the flash attention kernels: the host-side tensor map of a
// [tokens, heads, D] 16-bit tensor whose boxes land in the kernels' 128-byte-swizzled
// [64-column slab][rows][64] shared layout, and the device-side copy / transaction-count
// primitives (PTX ISA: cp.async.bulk.tensor, mbarrier.expect_tx). sm_90a only.
//
// A box is 64 columns x 1 head x `rows` tokens (128 B per row, the swizzle span); a D-column tile
// takes D/64 boxes. Reads past the tensor's last token or last column are zero-filled by the copy
// engine (and still count toward the transaction bytes), so a tile never reads out of bounds.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/flash_attention/flash_attention.h"

namespace kestrel::cuda::fa {

// Encodes the map for `base` [tokens, heads, dim] of 2-byte elements; boxes of box_rows tokens.
// Throws kestrel::Error "[flash_attention] ..." if the driver rejects it.
CUtensorMap make_tma_map_3d(const void* base, AttnDType dtype, int tokens, int heads, int dim, int box_rows);

// The same for a [tokens, heads, dim] f32 tensor (the backward's dq accumulator): boxes of 32
// columns (128 B, the swizzle span) x 1 head x box_rows tokens, written by bulk reductions
// (tma_reduce_add_3d); a D-column tile takes ceil(D/32) boxes, and columns or tokens past the
// tensor's end are dropped.
CUtensorMap make_tma_map_3d_f32(float* base, int tokens, int heads, int dim, int box_rows);

#if defined(__CUDACC__)
// Arrives on `bar` (one arrival) and raises its expected transaction bytes by `bytes`.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Makes this CTA's mbarrier initialisations visible to the async proxy (the copy engine).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// Box (col, head, token) of `map` -> shared `dst`; completes `bytes` on `bar`.
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int col, int head,
                                            int token) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(head), "r"(token), "r"(bar)
      : "memory");
}

// Loads a [kRows tokens, kD] tile (kD/64 boxes) of head `head` starting at `token` into the
// [kD/64][kRows][64] layout at dst. One thread issues it; the caller arms `bar` for the bytes.
template <int kRows, int kD>
__device__ __forceinline__ void tma_load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, int head,
                                              int token) {
#pragma unroll
  for (int slab = 0; slab < kD / 64; ++slab) tma_load_3d(dst + slab * (kRows * 128), map, bar, slab * 64, head, token);
}

// Adds the f32 box at shared `src` element-wise into box (col, head, token) of `map` in global
// memory (an L2 reduction per element; this thread's bulk group: tma_commit / tma_wait_read).
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* map, uint32_t src, int col, int head, int token) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(col), "r"(head), "r"(token), "r"(src)
      : "memory");
}
__device__ __forceinline__ void tma_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups still read their shared source.
template <int N>
__device__ __forceinline__ void tma_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until at most N of this thread's bulk groups are still incomplete (their writes included).
template <int N>
__device__ __forceinline__ void tma_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void prefetch_tma_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
#endif

}  // namespace kestrel::cuda::fa
