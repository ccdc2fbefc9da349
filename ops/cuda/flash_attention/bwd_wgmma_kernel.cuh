// Flash attention backward for Hopper (sm_90a) with warpgroup MMA (FA3's data flow, our code).
//
// One block = 2 warpgroups owning kBc = 128 keys of one KV head (64 keys each: wgmma's M) and
// walking kBr-query tiles of every query head of its GQA group, so dK/dV stay in registers for
// the whole kernel and reduce deterministically (same BwdArgs and workspace as the mma.sync
// kernels). Head dim 128 uses kBr = 64, head dim 64 kBr = 128; the narrow head dims 80/96/112
// (traits.h) keep the 128 layout and kBr = 64, issue kD/16 k-steps for S^T / dP^T and N = kD for
// dV / dK, and load only the first kD columns of each tile. Per query tile and warpgroup:
//   S^T  = K Q^T    wgmma m64n{kBr}k16, K and Q K-major from 128-byte-swizzled shared tiles;
//   dP^T = V dO^T   same;
//   P^T  = exp2(S^T * scale * log2e - lse2) (masked: causal bottom-right, sliding window, document ends),
//   dS^T = P^T (dP^T - delta), both packed to 16-bit A fragments in registers;
//   dV  += P^T dO   wgmma m64n{kD}k16, A from registers, dO [query][d] read MN-major;
//   dK  += dS^T Q   same with Q;
//   dS^T also goes to shared memory ([key][query] tile, stmatrix); after a barrier of both warpgroups,
//   dQ[64 rows, 64 cols] = dS K   wgmma m64n64k16 with both operands MN-major (transpose
//   immediates): head dim 128 splits dQ's columns over the warpgroups, head dim 64 its rows;
//   then predicated red.global.add.v2.f32 into the f32 dq workspace.
// Q, dO, lse2 and delta arrive one tile ahead into 3-deep rings, issued after the tile's first
// GEMMs; dS^T is double-buffered. Q and dO: with kTmaQ (traits.h: 128-column shared tiles) thread 0
// issues their TMA boxes on a "landed" mbarrier per buffer, which every thread waits on at the
// tile's start (a last tile of a document zeroes the rows past it in shared memory, another
// document's values, behind one more barrier); otherwise every thread issues cp.async with zero
// fill. lse2 and delta: cp.async (4 bytes per row). One barrier per tile: the dS^T exchange, which
// also publishes the next tile's cp.async copies. GEMM order dV, (exchange), dQ, dK, with dQ's
// reductions issued while dK runs. The variants measured on the way (sequential phases, a second barrier per tile,
// copies before the GEMMs, dV issued before dS^T) are in bench/notes/flash_attention.md.
// kWs (FlashBwdLayout::Specialised: 128-column tiles, not deterministic, no block mask; bwd_ws_built):
// 384 threads, the first warpgroup a producer (setmaxnreg 24) and the two above consumers (240) that neither
// load nor reduce. The producer's warp 0 fills a two-deep ring: lse2 and delta by its lanes, Q and
// dO by TMA, on a "full" mbarrier (32 arrivals + the bytes) that the consumers' warps release on an
// "empty" one after the tile's last GEMM; its warp 1 adds each dQ tile into the workspace with TMA
// bulk tensor reductions (f32 map, 32-column 128-byte-swizzled boxes; the rows past a document add
// exact zeros) from two shared f32 tiles the consumers fill by stmatrix in place of their red.global
// (dq_full / dq_empty mbarriers; each 8-column group in the order 0 2 4 6 1 3 5 7, see store_dq). All
// its waits are mbar_wait<true> (a trap in the kernel would cost the consumers their setmaxnreg
// registers).
// kDeterministic: the key blocks of a document add their dQ partials to a query tile in key-block
// order. Thread 0 waits, before the tile's exchange barrier, until the tile's counter (a.dq_order,
// at the tile's first row) says that every earlier key block visiting the tile has added its part
// (bwd_first_key_block); at the end of the next tile (past its barrier, which every thread reaches
// after issuing the previous tile's reductions) it releases the previous tile (+1). Both sit where
// no wgmma is in flight (elsewhere ptxas injects warpgroup.arrive, C7519). Blocks wait
// only on blocks of lower index, which the hardware schedules first (FA3's deterministic mode and
// CUTLASS's serial split-K rely on the same order).
// kBlockMask (one key block of the mask per block): the block walks only the query tiles of the
// query blocks its key block lists (bwd_tile), and a PARTIAL tile's transposed bits (bits_t: per
// key, kBr/32 words of this tile's queries, loaded in the masked branch only) zero P^T, hence dS^T.
#pragma once

#include <cmath>
#include <type_traits>

#include "cuda/flash_attention/device_primitives.cuh"
#include "cuda/flash_attention/tile_scheduler.h"
#include "cuda/flash_attention/tma.cuh"
#include "cuda/flash_attention/traits.h"
#include "cuda/flash_attention/wgmma.cuh"
#include "kestrel/cuda/check.h"
#include "kestrel/runtime/error.h"

namespace kestrel::cuda::fa {

template <int kD, int kBr, bool kWs>
constexpr size_t bwd_wgmma_smem_bytes() {
  // K, V; kBufs x (Q, dO); 2 x dS^T; kWs: 2 x the f32 dQ tile; kBufs x (lse2, delta); the
  // mbarriers; 1 KiB for the 1024-byte alignment.
  constexpr int kDs = kernel_smem_dim(kD), kBufs = kWs ? 2 : 3;
  return static_cast<size_t>(2 * 128 * kDs + 2 * kBufs * kBr * kDs + 2 * 128 * kBr) * 2 +
         (kWs ? 2 * kBr * kDs * sizeof(float) : 0) + 2 * kBufs * kBr * sizeof(float) + 8 * 8 + 1024;
}

template <typename T, int kD, int kBr, bool kDeterministic, bool kPrefix, bool kBlockMask, bool kWs>
__global__ void __launch_bounds__(kWs ? 384 : 256, 1)
    flash_bwd_wgmma_kernel(const BwdArgs a, const FlashBlockMask mask, const __grid_constant__ CUtensorMap tq,
                           const __grid_constant__ CUtensorMap tdo, const __grid_constant__ CUtensorMap tdq) {
  static_assert(!kWs || bwd_ws_built(kD, kDeterministic, kBlockMask), "layout not built");
  constexpr int kBc = 128, kThreads = 256, kBufs = kWs ? 2 : 3;  // kThreads: the consumer threads
  constexpr int kDs = kernel_smem_dim(kD);  // shared tile width (narrow kD: 128; columns kD.. never read
                                            // except by dQ's second 64-column half, whose extra columns
                                            // are dropped by reduce_dq)
  constexpr int kNs = kBr / 2;   // S^T, dP^T accumulator floats per thread (64 keys x kBr queries)
  constexpr int kNd = kD / 2;    // dK, dV accumulator floats per thread (64 keys x kD)
  constexpr int kKs = kBr / 16;  // k-steps of dV / dK (A fragments of P^T / dS^T)
  constexpr uint32_t kKVBytes = kBc * kDs * 2, kQBytes = kBr * kDs * 2, kSBytes = kBc * kBr * 2;
  static_assert((kDs == 128 && kBr == 64) || (kDs == 64 && kBr == 128), "dQ tile: 64 x 64 per warpgroup");
  static_assert(kD % 16 == 0 && kD <= kDs && kD > kDs - 64, "head dim within the shared tile's last slab");
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t sK = (raw + 1023u) & ~1023u;    // [kDs/64][kBc][64]
  const uint32_t sV = sK + kKVBytes;             // [kDs/64][kBc][64]
  const uint32_t sQ0 = sV + kKVBytes;            // kBufs x [kDs/64][kBr][64]
  const uint32_t sdO0 = sQ0 + kBufs * kQBytes;   // kBufs x [kDs/64][kBr][64]
  const uint32_t sdS0 = sdO0 + kBufs * kQBytes;  // 2 x [kBr/64][kBc][64]: dS^T [key][query]
  constexpr uint32_t kDqBytes = kBr * kDs * 4;
  const uint32_t sdQ0 = sdS0 + 2 * kSBytes;      // kWs: 2 x [kDs/32][kBr][32] f32, 128-byte swizzle
  float* sLse = reinterpret_cast<float*>(smem_raw + (sdQ0 + (kWs ? 2 * kDqBytes : 0) - raw));  // kBufs x [kBr]
  float* sDelta = sLse + kBufs * kBr;                                              // kBufs x [kBr]
  constexpr bool kBwdTmaQ = WgmmaBwdTraits<kD>::kTmaQ;
  // kBwdTmaQ: full(b) "Q and dO (kWs: and lse2, delta) of buffer b landed"; kWs: empty(b) "every
  // consumer warp is done with buffer b", dq_full(b) "the dQ tile b is written", dq_empty(b) "dQ tile
  // b was read by its reduction".
  const uint32_t bars = smem_u32(sDelta + kBufs * kBr);
  auto full = [&](int b) { return bars + 8 * b; };
  auto empty = [&](int b) { return bars + 8 * (2 + b); };
  auto dq_full = [&](int b) { return bars + 8 * (4 + b); };
  auto dq_empty = [&](int b) { return bars + 8 * (6 + b); };

  const FlashAttentionParams& p = a.p;
  const int tid = kWs ? static_cast<int>(threadIdx.x) - 128 : static_cast<int>(threadIdx.x);  // consumer index
  // wg broadcast from lane 0: ptxas then knows it is warp-uniform, so the K, V and dS descriptors built
  // from it live in uniform registers (their 64-bit adds and R2UR moves leave the vector pipe: +1.4% to
  // +2.5% on the specialised layout, bench/notes/flash_attention.md "Fifteenth session").
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0), wwarp = (tid % 128) / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int hk = blockIdx.x, n_block = blockIdx.y, doc = blockIdx.z;
  const auto [q_start, len_q, k_start, len_k, n0, group, off, m_begin, tiles_per_head, n_iter] =
      bwd_tile<kBc, kBr, kPrefix, kBlockMask>(p, n_block, doc, kBlockMask ? &mask : nullptr);
  if (n0 >= len_k) return;
  const int D = p.head_dim;
  if constexpr (kBwdTmaQ) {
    if (threadIdx.x == 0) {
      prefetch_tma_map(&tq);
      prefetch_tma_map(&tdo);
      if constexpr (kWs) prefetch_tma_map(&tdq);
      for (int b = 0; b < kBufs; ++b) {
        mbar_init(full(b), kWs ? 32 : 1);
        if constexpr (kWs) {
          mbar_init(empty(b), 8);
          mbar_init(dq_full(b), kThreads);
          mbar_init(dq_empty(b), 1);
        }
      }
      fence_mbarrier_init();
    }
    __syncthreads();
  }
  const int mask_base = kBlockMask ? mask.k_ptr[n_block] : 0;  // the key block's first list entry
  auto tile_head = [&](int it) { return hk * group + it / tiles_per_head; };
  auto tile_m0 = [&](int it) {
    if constexpr (kBlockMask) return bwd_mask_tile_m0<kBr>(mask, mask_base, it % tiles_per_head);
    return (m_begin + it % tiles_per_head) * kBr;
  };
  if constexpr (kWs) {
    if (threadIdx.x < 128) {  // producer warpgroup: warp 0 loads, warp 1 reduces dQ, the others leave
      setmaxnreg_dec<24>();
      const int warp = threadIdx.x / 32;
      if (warp == 0) {
        for (int it = 0; it < n_iter; ++it) {
          const int buf = it % kBufs, h = tile_head(it), m0 = tile_m0(it);
          if (it >= kBufs) mbar_wait<kWs>(empty(buf), static_cast<uint32_t>((it / kBufs - 1) & 1));
          for (int i = lane; i < 2 * kBr; i += 32) {
            const int r = i % kBr;
            const bool ok = m0 + r < len_q;
            const int64_t idx = static_cast<int64_t>(h) * a.total_q + q_start + m0 + (ok ? r : 0);
            const float x = ok ? (i < kBr ? a.lse2 : a.delta)[idx] : 0.f;
            (i < kBr ? sLse : sDelta)[buf * kBr + r] = x;
          }
          if (lane == 0) {
            mbar_arrive_expect_tx(full(buf), 2 * kQBytes);
            tma_load_tile<kBr, kDs>(sQ0 + buf * kQBytes, &tq, full(buf), h, q_start + m0);
            tma_load_tile<kBr, kDs>(sdO0 + buf * kQBytes, &tdo, full(buf), h, q_start + m0);
          } else {
            mbar_arrive(full(buf));
          }
        }
      } else if (threadIdx.x == 32) {
        for (int it = 0; it < n_iter; ++it) {
          const int b = it & 1, h = tile_head(it), m0 = tile_m0(it);
          mbar_wait<kWs>(dq_full(b), static_cast<uint32_t>((it >> 1) & 1));
          for (int box = 0; box * 32 < p.head_dim; ++box)
            tma_reduce_add_3d(&tdq, sdQ0 + b * kDqBytes + box * (kBr * 128), box * 32, h, q_start + m0);
          tma_commit();
          tma_wait_read<0>();
          mbar_arrive(dq_empty(b));
        }
        tma_wait<0>();
      }
      return;
    }
    setmaxnreg_inc<240>();
  }

  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* dout = static_cast<const T*>(a.dout);
  const int64_t q_stride = static_cast<int64_t>(p.num_heads_q) * D;
  const int64_t kv_stride = static_cast<int64_t>(p.num_heads_kv) * D;
  const int64_t kv_off = (static_cast<int64_t>(k_start + n0) * p.num_heads_kv + hk) * D;

  load_tile_sw128<kBc, kD, kThreads>(sK, k + kv_off, kv_stride, len_k - n0, D, tid);
  load_tile_sw128<kBc, kD, kThreads>(sV, v + kv_off, kv_stride, len_k - n0, D, tid);

  // Block mask: the kind of tile it's list entry (-1 FULL, else the index of its bits).
  auto tile_kind = [&](int it) {
    if constexpr (kBlockMask) return mask.k_kind[bwd_mask_entry<kBr>(mask_base, it % tiles_per_head)];
    return -1;
  };
  auto prefetch = [&](int it) {
    const int h = tile_head(it), m0 = tile_m0(it), buf = it % kBufs;
    if constexpr (kBwdTmaQ) {
      if (tid == 0) {
        mbar_arrive_expect_tx(full(buf), 2 * kQBytes);
        tma_load_tile<kBr, kDs>(sQ0 + buf * kQBytes, &tq, full(buf), h, q_start + m0);
        tma_load_tile<kBr, kDs>(sdO0 + buf * kQBytes, &tdo, full(buf), h, q_start + m0);
      }
    } else {
      const int64_t qo = (static_cast<int64_t>(q_start + m0) * p.num_heads_q + h) * D;
      load_tile_sw128<kBr, kD, kThreads>(sQ0 + buf * kQBytes, q + qo, q_stride, len_q - m0, D, tid);
      load_tile_sw128<kBr, kD, kThreads>(sdO0 + buf * kQBytes, dout + qo, q_stride, len_q - m0, D, tid);
    }
    if (tid < 2 * kBr) {
      const int r = tid % kBr;
      const bool ok = m0 + r < len_q;
      const int64_t idx = static_cast<int64_t>(h) * a.total_q + q_start + m0 + (ok ? r : 0);
      const float* src = tid < kBr ? a.lse2 + idx : a.delta + idx;
      float* dst = (tid < kBr ? sLse : sDelta) + buf * kBr + r;
      cp_async_4(smem_u32(dst), src, ok);
    }
  };
  if (!kWs && n_iter > 0) prefetch(0);
  cp_async_commit();

  float dv[kNd], dk[kNd], dq[32];
#pragma unroll
  for (int i = 0; i < kNd; ++i) dv[i] = dk[i] = 0.f;
  float s[kNs], dp[kNs];
  uint32_t pa[kKs][4], da[kKs][4];  // P^T, dS^T as 16-bit A fragments
  const float sl2 = p.softmax_scale * 1.4426950408889634f;
  const int n0w = n0 + wg * 64;                // first key of this warpgroup
  const int key_lo = wwarp * 16 + g;           // accumulator rows key_lo, key_lo + 8 (of the warpgroup's 64)
  // dS^T store (stmatrix): this lane addresses row wg*64 + 16 wwarp + 8 ((lane >> 3) & 1) + (lane & 7) of
  // the matrices of (lane >> 4); the 128-byte swizzle's chunk XOR is stsm_y (see compute_ds).
  const uint32_t stsm_base = static_cast<uint32_t>((wg * 64 + wwarp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * 128);
  const uint32_t stsm_y = static_cast<uint32_t>((lane >> 4) ^ (lane & 7));

  // Matrix descriptors, built once: the operand at byte offset o of a tile is the tile's descriptor
  // + o / 16 (the 14-bit start-address field cannot carry: shared offsets stay below 256 KiB).
  // Rebuilding each descriptor from its address cost ~5 instructions per wgmma operand.
  const uint64_t dK_k = wgmma_desc(sK + wg * (64 * 128), 16, 1024);  // this warpgroup's 64 keys, K-major
  const uint64_t dV_k = wgmma_desc(sV + wg * (64 * 128), 16, 1024);
  const uint64_t dQ_k = wgmma_desc(sQ0, 16, 1024), dO_k = wgmma_desc(sdO0, 16, 1024);
  const uint64_t dQ_mn = wgmma_desc(sQ0, kBr * 128, 1024), dO_mn = wgmma_desc(sdO0, kBr * 128, 1024);
  const uint64_t dS_mn = wgmma_desc(sdS0 + (kBr == 128 ? wg * (kBc * 128) : 0), kBc * 128, 1024);
  const uint64_t dK_mn = wgmma_desc(sK + (kDs == 128 ? wg * (kBc * 128) : 0), kBc * 128, 1024);

  auto issue_sdp = [&](int buf) {
    const uint64_t q_t = dQ_k + buf * (kQBytes / 16), o_t = dO_k + buf * (kQBytes / 16);
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t a_off = (kk / 4) * (kBc * 128) + (kk % 4) * 32;
      const uint32_t b_off = (kk / 4) * (kBr * 128) + (kk % 4) * 32;
      WgmmaSS<T, kBr>::run(s, dK_k + a_off / 16, q_t + b_off / 16, kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      const uint32_t a_off = (kk / 4) * (kBc * 128) + (kk % 4) * 32;
      const uint32_t b_off = (kk / 4) * (kBr * 128) + (kk % 4) * 32;
      WgmmaSS<T, kBr>::run(dp, dV_k + a_off / 16, o_t + b_off / 16, kk > 0);
    }
    wgmma_commit();
  };

  // P^T = exp2(S^T * sl2 - lse2) in place in s; masked tiles (per warpgroup) take the checked copy.
  // kEarlyLse (head dim 128, plain layout): lse2 read into registers before the S^T wait (16 more
  // live registers; at head dim 64 that spills, so does the specialised layout's 240-register
  // budget, and both read lse2 inside the loop below).
  constexpr bool kEarlyLse = kBr == 64 && !kWs;
  auto load_lse = [&](int buf, float2 (&l)[kBr / 8]) {
#pragma unroll
    for (int j = 0; j < kBr / 8; ++j) l[j] = *reinterpret_cast<const float2*>(sLse + buf * kBr + 8 * j + 2 * c);
  };
  auto compute_p = [&](int buf, int m0, const float2 (&lse)[kBr / 8], int kind) {
    const bool need_mask = (m0 + kBr > len_q) || (n0w + 64 > len_k) || (p.causal && n0w + 63 > m0 + off) ||
                           tile_crosses_window(p, m0 + kBr - 1, n0w, off);
    auto body = [&](auto masked) {
      // prefix-LM keys every query sees (kPrefix only); read in masked tiles only (no register elsewhere)
      const int prefix = decltype(masked)::value ? doc_prefix<kPrefix>(p, doc) : 0;
#pragma unroll
      for (int j = 0; j < kBr / 8; ++j) {
        const float2 l = kEarlyLse ? lse[j] : *reinterpret_cast<const float2*>(sLse + buf * kBr + 8 * j + 2 * c);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = fast_exp2(fmaf(s[4 * j + e], sl2, -((e & 1) ? l.y : l.x)));
          if constexpr (decltype(masked)::value) {
            const int key = n0w + key_lo + (e >= 2 ? 8 : 0);
            const int qi = m0 + 8 * j + 2 * c + (e & 1);
            // Bitwise, not short-circuit: one select per element, no branches.
            const bool dead = (qi >= len_q) | (key >= len_k) | (p.causal & (key > causal_last_key<kPrefix>(qi + off, prefix))) |
                              ((p.window > 0) & (key <= qi + off - p.window));
            x = dead ? 0.f : x;
          }
          s[4 * j + e] = x;
        }
      }
    };
    if (need_mask) body(std::true_type{});
    else body(std::false_type{});
    if constexpr (kBlockMask) {  // PARTIAL tile: P^T = 0 where the bit is clear (one word live at a time)
      if (kind >= 0)
        bwd_apply_mask_bits<kBr>(s, mask.bits_t + static_cast<int64_t>(kind) * (kBlockMaskBlock * 4), wg * 64 + key_lo,
                                 m0 % kBlockMaskBlock, c);
    }
#pragma unroll
    for (int kk = 0; kk < kKs; ++kk) {
      pa[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };
  // dS^T = P^T (dP^T - delta): A fragments, and the [key][query] shared tile for dQ.
  auto compute_ds = [&](int buf, uint32_t sdS) {
    const float* dlt = sDelta + buf * kBr;
#pragma unroll
    for (int j = 0; j < kBr / 8; ++j) {
      const float2 d = *reinterpret_cast<const float2*>(dlt + 8 * j + 2 * c);
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[4 * j + e] = s[4 * j + e] * (dp[4 * j + e] - ((e & 1) ? d.y : d.x));
    }
#pragma unroll
    for (int kk = 0; kk < kKs; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) da[kk][i] = pack2<T>(dp[8 * kk + 2 * i], dp[8 * kk + 2 * i + 1]);
    }
    // da[k][i] is the 8x8 matrix (keys 8r.., queries 8j..) with r = i & 1, j = 2k + (i >> 1); lane
    // 8i + rr addresses its row rr: slab k / 4, chunk (2 (k % 4) + (i >> 1)) ^ rr = 2 (k % 4) ^ y.
#pragma unroll
    for (int k = 0; k < kKs; ++k)
      stmatrix_x4(sdS + stsm_base + (k / 4) * (kBc * 128) + ((2u * (k % 4) ^ stsm_y) << 4), da[k][0], da[k][1],
                  da[k][2], da[k][3]);
  };
  auto issue_dv = [&](int buf) {
    const uint64_t o_t = dO_mn + buf * (kQBytes / 16);
#pragma unroll
    for (int kk = 0; kk < kKs; ++kk) WgmmaRS<T, kD>::run(dv, pa[kk], o_t + kk * (16 * 128 / 16));
    wgmma_commit();
  };
  auto issue_dk = [&](int buf) {
    const uint64_t q_t = dQ_mn + buf * (kQBytes / 16);
#pragma unroll
    for (int kk = 0; kk < kKs; ++kk) WgmmaRS<T, kD>::run(dk, da[kk], q_t + kk * (16 * 128 / 16));
    wgmma_commit();
  };
  // dQ[64, 64] = dS K for this warpgroup: rows (kBr 128) or columns (kDs 128) split by wg.
  auto issue_dq = [&](int sbuf) {
    const uint64_t s_t = dS_mn + sbuf * (kSBytes / 16);
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk)
      WgmmaSST<T, 64>::run(dq, s_t + kk * (16 * 128 / 16), dK_mn + kk * (16 * 128 / 16), kk > 0);
    wgmma_commit();
  };
  auto reduce_dq = [&](int it) {
    const int h = tile_head(it), m0 = tile_m0(it);
    const int qrow = m0 + (kBr == 128 ? wg * 64 : 0) + key_lo;  // accumulator rows qrow, qrow + 8
    const int col0 = (kDs == 128 ? wg * 64 : 0) + 2 * c;
    float* dst = a.dq_accum + (static_cast<int64_t>(q_start + qrow) * p.num_heads_q + h) * D + col0;
    const int64_t row_step = static_cast<int64_t>(p.num_heads_q) * D * 8;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool row_ok = qrow + 8 * r < len_q;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        red_add_f32x2(dst + r * row_step + 8 * j, dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1], row_ok && col0 + 8 * j < D);
    }
  };

  // kWs: this thread's dQ accumulator into the f32 tile b (the layout of tma_reduce_add_3d's boxes:
  // 32-column slabs of 128-byte rows, chunk ^ row % 8), then "written" for the reducing warp. One
  // stmatrix per 8-column group j stores the accumulator's register quad dq[4j..4j+3] as it is: its
  // matrices are row g's even columns, row g's odd columns, row g + 8's even, row g + 8's odd, so each
  // group lands as columns 0 2 4 6 1 3 5 7 (the workspace's permuted order, undone by
  // bwd_convert_dq_kernel). Lane l gives row 8 (l >> 4) + (l & 7) of matrix l >> 3, whose 16-byte chunk
  // is 2 (j % 4) + ((l >> 3) & 1) before the swizzle. 8 stmatrix where there were 16 st.shared.v2.f32:
  // +2% to +3% on the specialised layout (bench/notes/flash_attention.md, "Sixteenth session").
  auto store_dq = [&](int b) {
    const uint32_t base = sdQ0 + b * kDqBytes + (kDs == 128 ? wg * 2 * (kBr * 128) : wg * (64 * 128)) +
                          static_cast<uint32_t>((wwarp * 16 + (lane >> 4) * 8 + (lane & 7)) * 128);
    const uint32_t y = static_cast<uint32_t>(((lane >> 3) & 1) ^ (lane & 7));
#pragma unroll
    for (int j = 0; j < 8; ++j)
      stmatrix_x4(base + (j / 4) * (kBr * 128) + ((2u * (j % 4) ^ y) << 4), __float_as_uint(dq[4 * j]),
                  __float_as_uint(dq[4 * j + 1]), __float_as_uint(dq[4 * j + 2]), __float_as_uint(dq[4 * j + 3]));
    fence_proxy_async();
    mbar_arrive(dq_full(b));
  };

  // Deterministic mode: the counter of tile it ([Hq, total_q] at the tile's first row).
  auto dq_order_flag = [&](int it) {
    return a.dq_order + static_cast<int64_t>(tile_head(it)) * a.total_q + q_start + tile_m0(it);
  };

  if (n_iter > 0) {
    cp_async_wait<0>();
    fence_proxy_async();
    if constexpr (kWs) named_bar_sync(3, kThreads);  // K, V visible to both consumer warpgroups
    else __syncthreads();                           // K, V and tile 0 visible
  }
  for (int it = 0; it < n_iter; ++it) {
    const int buf = it % kBufs;
    if constexpr (kBwdTmaQ) {
      mbar_wait<kWs>(full(buf), static_cast<uint32_t>((it / kBufs) & 1));
      if constexpr (kWs) {  // dQ tile it & 1 was last reduced for tile it - 2
        if (it >= 2) mbar_wait<kWs>(dq_empty(it & 1), static_cast<uint32_t>(((it >> 1) - 1) & 1));
      }
      const int valid = len_q - tile_m0(it);
      if (valid < kBr) {  // block-uniform: rows past the document hold another one's Q/dO -> zeros
        zero_tile_rows<kBr, kDs>(sQ0 + buf * kQBytes, valid, tid, kThreads);
        zero_tile_rows<kBr, kDs>(sdO0 + buf * kQBytes, valid, tid, kThreads);
        named_bar_sync(2, kThreads);
      }
    }
    wgmma_fence();
    issue_sdp(buf);
    // The next tile's copies (their address arithmetic runs while the GEMMs do): buffer
    // (it + 1) % 3 was last read by tile it - 2, finished in both warpgroups before the barrier
    // of tile it - 1 that this thread passed.
    if (!kWs && it + 1 < n_iter) prefetch(it + 1);
    cp_async_commit();
    float2 lse[kBr / 8];
    if constexpr (kEarlyLse) load_lse(buf, lse);
    wgmma_wait<1>();
    fence_regs(s);
    compute_p(buf, tile_m0(it), lse, tile_kind(it));
    wgmma_wait<0>();
    fence_regs(dp);
    compute_ds(buf, sdS0 + (it & 1) * kSBytes);
    if constexpr (kDeterministic) {  // no wgmma in flight here; the barrier below releases the block
      if (tid == 0) wait_counter_eq(dq_order_flag(it), n_block - bwd_first_key_block<kBc, kBr>(p, tile_m0(it) / kBr, off));
    }
    wgmma_fence();
    issue_dv(buf);       // dV runs while dS^T is exchanged
    cp_async_wait<0>();  // tile it + 1 landed: the barrier below publishes it
    fence_proxy_async();
    named_bar_sync(1, kThreads);  // both warpgroups' dS^T in shared memory
    issue_dq(it & 1);
    issue_dk(buf);
    wgmma_wait<1>();  // dV, dQ done; dK runs while dQ is reduced (FA2's order)
    fence_regs(dq);
    if constexpr (kWs) store_dq(it & 1);
    else reduce_dq(it);
    wgmma_wait<0>();
    fence_regs(pa);
    fence_regs(da);
    if constexpr (kWs) {
      if (lane == 0) mbar_arrive(empty(buf));
    }
    if constexpr (kDeterministic) {  // every thread's tile it - 1 reductions preceded this tile's barrier
      if (tid == 0 && it > 0) release_counter_inc(dq_order_flag(it - 1));
    }
  }
  if constexpr (kDeterministic) {
    if (n_iter > 0) {
      named_bar_sync(1, kThreads);
      if (tid == 0) release_counter_inc(dq_order_flag(n_iter - 1));
    }
  }
  fence_regs(dk);
  fence_regs(dv);
  cp_async_wait<0>();  // nothing may still be landing in shared memory when the block exits

  T* dkp = static_cast<T*>(a.dk);
  T* dvp = static_cast<T*>(a.dv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int key = n0w + key_lo + 8 * r;
    if (key >= len_k) continue;
    const int64_t base = (static_cast<int64_t>(k_start + key) * p.num_heads_kv + hk) * D;
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      const int col = 8 * j + 2 * c;
      if (col < D) {
        *reinterpret_cast<uint32_t*>(dkp + base + col) =
            pack2<T>(dk[4 * j + 2 * r] * p.softmax_scale, dk[4 * j + 2 * r + 1] * p.softmax_scale);
        *reinterpret_cast<uint32_t*>(dvp + base + col) = pack2<T>(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]);
      }
    }
  }
}

template <typename T, int kD, bool kDeterministic, bool kPrefix, bool kBlockMask, bool kWs>
void launch_bwd_wgmma_layout(const BwdArgs& a, cudaStream_t stream) {
  static_assert(!kBlockMask || (!kDeterministic && !kPrefix), "the block mask is built alone");
  using Tr = WgmmaBwdTraits<kD>;
  constexpr size_t smem = bwd_wgmma_smem_bytes<kD, Tr::kBr, kWs>();
  auto kernel = flash_bwd_wgmma_kernel<T, kD, Tr::kBr, kDeterministic, kPrefix, kBlockMask, kWs>;
  KESTREL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const FlashBlockMask mask = kBlockMask ? *a.p.block_mask : FlashBlockMask{};
  CUtensorMap tq{}, tdo{}, tdq{};
  if constexpr (Tr::kTmaQ) {
    tq = make_tma_map_3d(a.p.q, a.p.dtype, a.p.total_q, a.p.num_heads_q, a.p.head_dim, Tr::kBr);
    tdo = make_tma_map_3d(a.dout, a.p.dtype, a.p.total_q, a.p.num_heads_q, a.p.head_dim, Tr::kBr);
  }
  if constexpr (kWs) tdq = make_tma_map_3d_f32(a.dq_accum, a.p.total_q, a.p.num_heads_q, a.p.head_dim, Tr::kBr);
  kernel<<<bwd_grid(a.p, Tr::kBc), kWs ? 384 : 256, smem, stream>>>(a, mask, tq, tdo, tdq);
  KESTREL_CUDA_CHECK_LAUNCH();
}

template <typename T, int kD, bool kDeterministic, bool kPrefix, bool kBlockMask>
void launch_bwd_wgmma(const BwdArgs& a, bool specialised, cudaStream_t stream) {
  if constexpr (bwd_ws_built(kD, kDeterministic, kBlockMask)) {
    if (specialised) return launch_bwd_wgmma_layout<T, kD, kDeterministic, kPrefix, kBlockMask, true>(a, stream);
  }
  KESTREL_CHECK(!specialised, "flash_attention", "no warp-specialised backward at kernel head dim ", kD,
                kDeterministic ? ", deterministic" : "", kPrefix ? ", prefix-LM" : "", kBlockMask ? ", block mask" : "");
  launch_bwd_wgmma_layout<T, kD, kDeterministic, kPrefix, kBlockMask, false>(a, stream);
}

}  // namespace kestrel::cuda::fa
