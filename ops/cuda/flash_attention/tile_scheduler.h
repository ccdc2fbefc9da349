// Tile scheduling shared by every flash attention kernel: the launch grid (host) and the tile a
// block owns (device), so the kernels and launchers agree on one mapping.
//
// Forward grid: persistent (fwd_persistent_grid / fwd_work_item: one block per SM walking the query
// tiles in L2 sections of (head, document) pairs, heaviest band first, snake order) for the
// warp-specialised Hopper forward; x = query head, y = query tile (heaviest-first under causal
// masking: block y takes tile gridDim.y - 1 - y), z = document for the per-tile Hopper forward
// (narrow head dims) and the mma.sync one.
// Backward grid: x = KV head (x column splits for the head-dim-256 kernel), y = key block,
// z = document; a backward block walks the query tiles of every query head of its GQA group that
// see its keys. The pre/post-processing kernels are grid-stride
// loops capped at 16 blocks per SM of the current device (sm_count(): cudaDevAttrMultiProcessorCount,
// read once per device and cached).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/flash_attention/flash_attention.h"
#include "kestrel/cuda/context.h"

namespace kestrel::cuda::fa {

inline dim3 fwd_grid(const FlashAttentionParams& p, int block_rows) {
  return dim3(p.num_heads_q, (p.max_seqlen_q + block_rows - 1) / block_rows, p.num_docs);
}
// Persistent forward (fwd_work_item): one block per SM of the current device, at most one per item.
inline int64_t fwd_work_count(const FlashAttentionParams& p, int block_rows) {
  return static_cast<int64_t>((p.max_seqlen_q + block_rows - 1) / block_rows) * p.num_heads_q * p.num_docs;
}
inline dim3 fwd_persistent_grid(const FlashAttentionParams& p, int block_rows) {
  return dim3(static_cast<unsigned>(std::min<int64_t>(fwd_work_count(p, block_rows), sm_count())));
}
inline dim3 bwd_grid(const FlashAttentionParams& p, int block_keys, int column_splits = 1) {
  return dim3(p.num_heads_kv * column_splits, (p.max_seqlen_k + block_keys - 1) / block_keys, p.num_docs);
}
// Blocks of a grid-stride kernel over `items` work items, `per_block` per block and pass.
inline int grid_stride_blocks(int64_t items, int per_block) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((items + per_block - 1) / per_block,
                                                                 int64_t{16} * sm_count())));
}

// Persistent forward: the (query head, document) pairs, pair = doc * Hq + h, are cut into L2
// sections of `section` consecutive pairs (fwd_section_pairs: whole GQA groups whose K and V fit in
// half the L2 cache). The list runs section by section; inside a section of `width` pairs, item i is
// query tile n_qtiles - 1 - i / width -- the bands of equal causal weight, heaviest first -- of pair
// first + i % width. So the blocks running at one time read the K/V of one or two sections, which
// stay in L2, rather than every head's (band-major over all pairs, the order before, read K and V
// from DRAM once per query tile: 58% of DRAM bandwidth and 93% of L2's in the 8k causal D128
// forward, ncu; with sections 12% and 45%, and the forward 11% faster). Block b of G takes item
// r * G + b in even rounds r and r * G + G - 1 - b in odd ones (snake order: the blocks that took
// the heavier items of a band take the lighter ones of the next, so their sums stay within one
// band's spread); a block stops at its first index past the list. Host and device
// (tests/ops/cuda/test_flash_attention_schedule.cpp checks every item is walked exactly once, and
// the sections).
struct FwdWork {
  int h, m, doc;
};
inline int fwd_section_pairs(const FlashAttentionParams& p, int64_t l2_bytes) {
  const int64_t pairs = static_cast<int64_t>(p.num_heads_q) * p.num_docs;
  const int group = p.num_heads_q / p.num_heads_kv;
  const int64_t kv_bytes = std::max<int64_t>(1, static_cast<int64_t>(p.max_seqlen_k) * p.head_dim * 2 * 2);  // K and V
  const int64_t kv_heads = std::max<int64_t>(1, l2_bytes / 2 / kv_bytes);
  return static_cast<int>(std::min(pairs, kv_heads * group));
}
__host__ __device__ __forceinline__ FwdWork fwd_work_at(int num_heads_q, int num_docs, int n_qtiles, int section,
                                                        int w) {
  const int pairs = num_heads_q * num_docs, per_section = section * n_qtiles;
  const int sec = w / per_section, first = sec * section;
  const int width = section < pairs - first ? section : pairs - first, i = w - sec * per_section;
  const int pair = first + i % width;
  return FwdWork{pair % num_heads_q, n_qtiles - 1 - i / width, pair / num_heads_q};
}
__host__ __device__ __forceinline__ int fwd_work_index_at(int round, int block, int grid) {
  return round * grid + ((round & 1) ? grid - 1 - block : block);
}

#if defined(__CUDACC__)
// Prefix-LM length of document doc (0 = none): causal attention where every query also sees the
// keys j < prefix. kPrefix is a template flag of the Hopper kernels (their instantiations without it
// compile to the plain causal code, registers included); the mma.sync kernels pass true and check
// p.prefix_len at run time.
template <bool kPrefix>
__device__ __forceinline__ int doc_prefix(const FlashAttentionParams& p, int doc) {
  if constexpr (kPrefix) return p.prefix_len ? p.prefix_len[doc] : 0;
  return 0;
}
// The last key causal query i sees: i + off, or with a prefix-LM mask max(i + off, prefix - 1).
template <bool kPrefix>
__device__ __forceinline__ int causal_last_key(int i_off, int prefix) {
  if constexpr (kPrefix) return max(i_off, prefix - 1);
  return i_off;
}

// The query tile a forward block owns (grid: x = query head, y = query tile, heaviest causal tiles
// first, z = document) and the key tiles it visits, n_first .. n_blocks - 1; key j is visible to
// query i iff j <= i + off (causal, bottom-right aligned) and, with a window, j > i + off - window.
struct FwdTile {
  int h, hk, q_start, len_q, k_start, len_k, m0, off, n_blocks, n_first;
};

// Sliding-window mask of one score: key j lies before the window of query i (p.window > 0 only).
__device__ __forceinline__ bool before_window(const FlashAttentionParams& p, int i, int j, int off) {
  return p.window > 0 && j <= i + off - p.window;
}
// Whether a [rows up to i_max] x [keys from j_min] tile holds any score before the window.
__device__ __forceinline__ bool tile_crosses_window(const FlashAttentionParams& p, int i_max, int j_min, int off) {
  return p.window > 0 && j_min <= i_max + off - p.window;
}
// fwd_tile_at: query tile m (rows m * kBr ..) of head h of document doc; fwd_tile: the one the
// block owns in the non-persistent grid.
// kBlockMask (kBr = kBc = 128, one document): n_blocks = the number of key blocks its query block
// lists (tile j is the listed block n_blocks - 1 - j, fwd_mask_key_block), n_first = 0.
template <int kBr, int kBc, bool kPrefix, bool kBlockMask = false>
__device__ __forceinline__ FwdTile fwd_tile_at(const FlashAttentionParams& p, const FlashBlockMask* mask, int h, int m,
                                               int doc) {
  FwdTile t;
  t.h = h;
  t.hk = t.h / (p.num_heads_q / p.num_heads_kv);
  t.q_start = p.cu_seqlens_q[doc];
  t.len_q = p.cu_seqlens_q[doc + 1] - t.q_start;
  t.k_start = p.cu_seqlens_k[doc];
  t.len_k = p.cu_seqlens_k[doc + 1] - t.k_start;
  t.m0 = m * kBr;
  t.off = t.len_k - t.len_q;
  // Causal: keys up to the tile's last row's diagonal, and with a prefix-LM mask the whole prefix.
  const int causal_end = kPrefix ? max(t.m0 + kBr + t.off, doc_prefix<kPrefix>(p, doc)) : t.m0 + kBr + t.off;
  const int n_end = p.causal ? min(t.len_k, causal_end) : t.len_k;
  t.n_blocks = n_end > 0 ? (n_end + kBc - 1) / kBc : 0;
  // The tile's first row sees keys from m0 + off - window + 1 on: earlier key tiles are skipped.
  t.n_first = p.window > 0 ? min(t.n_blocks, max(0, t.m0 + t.off - p.window + 1) / kBc) : 0;
  if constexpr (kBlockMask) {
    static_assert(kBr == kBlockMaskBlock && kBc == kBlockMaskBlock, "one mask tile per forward tile");
    const int qb = t.m0 / kBlockMaskBlock;
    t.n_blocks = mask->q_ptr[qb + 1] - mask->q_ptr[qb];
    t.n_first = 0;
  }
  return t;
}
template <int kBr, int kBc, bool kPrefix, bool kBlockMask = false>
__device__ __forceinline__ FwdTile fwd_tile(const FlashAttentionParams& p, const FlashBlockMask* mask = nullptr) {
  return fwd_tile_at<kBr, kBc, kPrefix, kBlockMask>(p, mask, blockIdx.x, gridDim.y - 1 - blockIdx.y, blockIdx.z);
}

// Persistent forward: the device side of fwd_work_at / fwd_work_index_at (above) for this block.
__device__ __forceinline__ FwdWork fwd_work_item(const FlashAttentionParams& p, int n_qtiles, int section, int w) {
  return fwd_work_at(p.num_heads_q, p.num_docs, n_qtiles, section, w);
}
__device__ __forceinline__ int fwd_work_index(int round) {
  return fwd_work_index_at(round, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
}

// Geometry of one backward block: the kBc keys of key block n_block of document doc, and the query
// tiles it walks: tiles_per_head kBr-row tiles (from tile m_begin; causal skips the queries before
// these keys, a window the queries past them) of each of the `group` query heads sharing the KV
// head, n_iter in all.
struct BwdTile {
  int q_start, len_q, k_start, len_k, n0, group, off, m_begin, tiles_per_head, n_iter;
};
// kBlockMask (kBc = 128, one document): the query tiles of the query blocks its key block lists,
// 128 / kBr per block (fewer for a last query block shorter than 128); m_begin = 0, tile t of a head
// is sub-tile t % (128 / kBr) of listed block t / (128 / kBr) (bwd_mask_tile_m0).
template <int kBc, int kBr, bool kPrefix, bool kBlockMask = false>
__device__ __forceinline__ BwdTile bwd_tile(const FlashAttentionParams& p, int n_block, int doc,
                                            const FlashBlockMask* mask = nullptr) {
  BwdTile t;
  t.q_start = p.cu_seqlens_q[doc];
  t.len_q = p.cu_seqlens_q[doc + 1] - t.q_start;
  t.k_start = p.cu_seqlens_k[doc];
  t.len_k = p.cu_seqlens_k[doc + 1] - t.k_start;
  t.n0 = n_block * kBc;
  t.group = p.num_heads_q / p.num_heads_kv;
  t.off = t.len_k - t.len_q;
  // Causal: the queries before these keys see none of them, unless the keys lie in the prefix.
  t.m_begin = p.causal && (!kPrefix || t.n0 >= doc_prefix<kPrefix>(p, doc)) ? max(0, t.n0 - t.off) / kBr : 0;
  int m_end = (t.len_q + kBr - 1) / kBr;
  if (p.window > 0) {  // the last query that sees key n0 + kBc - 1 is n0 + kBc - 2 - off + window
    const int i_last = t.n0 + kBc - 2 - t.off + p.window;
    m_end = i_last < 0 ? 0 : min(m_end, i_last / kBr + 1);
  }
  t.tiles_per_head = max(0, m_end - t.m_begin);
  if constexpr (kBlockMask) {
    static_assert(kBc == kBlockMaskBlock && kBlockMaskBlock % kBr == 0, "query tiles subdivide a mask block");
    constexpr int kSub = kBlockMaskBlock / kBr;
    const int base = mask->k_ptr[n_block], count = mask->k_ptr[n_block + 1] - base;
    int tiles = count * kSub;
    const int last_qb = (t.len_q - 1) / kBlockMaskBlock;  // listed last: the lists are sorted
    if (count > 0 && mask->k_qblock[base + count - 1] == last_qb)
      tiles -= kSub - (t.len_q - last_qb * kBlockMaskBlock + kBr - 1) / kBr;
    t.m_begin = 0;
    t.tiles_per_head = tiles;
  }
  t.n_iter = t.tiles_per_head * t.group;
  return t;
}

// Block mask: the key block of forward tile j (processing order, last listed first) of the query
// block whose list starts at entry `base`, and that entry's kind (-1 FULL, else the bits' index).
__device__ __forceinline__ int fwd_mask_entry(int base, int n_blocks, int j) { return base + n_blocks - 1 - j; }
// Block mask: the first query row of backward tile t (of one head) of the key block whose list
// starts at entry `base`, and the list entry it belongs to.
template <int kBr>
__device__ __forceinline__ int bwd_mask_entry(int base, int t) { return base + t / (kBlockMaskBlock / kBr); }
template <int kBr>
__device__ __forceinline__ int bwd_mask_tile_m0(const FlashBlockMask& mask, int base, int t) {
  return mask.k_qblock[bwd_mask_entry<kBr>(base, t)] * kBlockMaskBlock + (t % (kBlockMaskBlock / kBr)) * kBr;
}

// Block mask, PARTIAL tile: P^T (the backward's m64n{kBr} accumulator of this thread's keys `key`
// and key + 8 of the tile, queries q0 + 8j + 2c + (e & 1) of the tile, q0 = 0 or 64) set to 0 where
// the tile's transposed bits are clear; one word loaded and applied at a time (register pressure).
template <int kBr>
__device__ __forceinline__ void bwd_apply_mask_bits(float (&s)[kBr / 2], const uint32_t* tile_bits_t, int key, int q0,
                                                    int c) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int w = 0; w < kBr / 32; ++w) {
      const uint32_t word = __ldg(tile_bits_t + (key + 8 * r) * 4 + q0 / 32 + w);
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int b = 0; b < 2; ++b)
          if (!((word >> (8 * jj + 2 * c + b)) & 1u)) s[4 * (4 * w + jj) + 2 * r + b] = 0.f;
    }
}

// Block mask, PARTIAL tile: S (the forward's m64n128 accumulator of this thread's rows `row` and
// row + 8 of the tile, columns 8j + 2c + (e & 1)) set to -inf where the tile's row-layout bits are
// clear. One 16-byte load per row.
__device__ __forceinline__ void fwd_apply_mask_bits(float (&s)[64], const uint32_t* tile_bits, int row, int c) {
  const uint4 w0 = __ldg(reinterpret_cast<const uint4*>(tile_bits) + row);
  const uint4 w1 = __ldg(reinterpret_cast<const uint4*>(tile_bits) + row + 8);
  const uint32_t w[2][4] = {{w0.x, w0.y, w0.z, w0.w}, {w1.x, w1.y, w1.z, w1.w}};
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (!((w[e >> 1][j / 4] >> (8 * (j % 4) + 2 * c + (e & 1))) & 1u)) s[4 * j + e] = -INFINITY;
}

// Deterministic backward: of the key blocks of a document that add into query tile m (kBr rows),
// the first. Key blocks n_lo(m) .. n - 1 all visit tile m before block n does (the visited range
// [m_begin, m_end) of bwd_tile grows with the key block, also with a prefix), so block n adds its
// partial after n - n_lo(m) others. Without a window n_lo = 0; with one, n_lo is the first block whose last
// visited query (n0 + kBc - 2 - off + window) reaches row m * kBr.
template <int kBc, int kBr>
__device__ __forceinline__ int bwd_first_key_block(const FlashAttentionParams& p, int m, int off) {
  if (p.window <= 0) return 0;
  const int x = m * kBr - kBc + 2 + off - p.window;
  return x <= 0 ? 0 : (x + kBc - 1) / kBc;
}
#endif  // __CUDACC__

}  // namespace kestrel::cuda::fa
