// Flash attention over raw device pointers: forward and backward, causal (bottom-right aligned per
// document, optionally a sliding window) and bidirectional, GQA, packed variable-length documents
// given by cumulative offsets. Private launcher API; the Tensor-level op (ops/cuda/attention.cu)
// wraps it. The folder's layout is described in DESIGN.md (ops/) and in bench/notes/flash_attention.md.
//
// Layouts: q/out/dout/dq [total_q, Hq, D], k/v/dk/dv [total_k, Hkv, D], lse [total_q, Hq] (f32,
// natural log of sum_j exp(scale * q.k_j)). A query row with no visible key gets out = 0 and
// lse = -inf. Extra memory is O(tokens x heads): the backward workspace holds an f32 dq
// accumulator and two f32 rows per (token, head) (plus one i32 per (token, head) when
// deterministic). No host synchronisation: max lengths and token counts come from the caller.
// head_dim must be a multiple of 8 and at most 256; on sm_90 64, 80, 96, 112 and 128 are the fast
// path, any other value runs a zero-padded instantiation (72 -> 80; one log line on first use).
//
// Determinism: forward, dk and dv are bitwise reproducible. dq is summed over key blocks into an
// f32 accumulator; by default with f32 atomics in arrival order (repeated runs can differ by one
// unit in the last place after rounding), with `deterministic` in a fixed order (key block 0
// first, through a per-(query tile, head) counter; a few percent slower).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace kestrel::cuda {

enum class AttnDType { BF16, F16 };

// Which kernels run. Auto: choose_flash_kernel (heuristics.cpp) from the parameters and the device.
// The explicit values exist for tests and A/B runs; each throws where it cannot run the shape.
//   Hopper:  the sm_90a kernels (TMA-fed wgmma forward, wgmma backward) at head dim 64, 128 or, for
//            head dims in (64, 128), the narrow widths 80/96/112 (head dim rounded up to 16; GEMMs
//            that stop there instead of at 128).
//   HopperPadded: the same kernels at 64 or 128 only (no narrow width; the A/B reference).
//   MmaSync: the mma.sync kernels (cp.async, FA2 layout) built at head dim 256, which run any
//            head dim zero-padded to 256 (the path of head dims above 128 today).
enum class FlashKernel { Auto, Hopper, HopperPadded, MmaSync };

// Layout of the Hopper backward where both are built (kernel head dims 80-128, not deterministic,
// no block mask; prefix-LM included). Auto: choose_kernel's rule, Specialised wherever it is built (it
// measured faster at every built head dim, causal or not). The explicit values exist for tests and A/B
// runs; Specialised throws where it is not built.
//   Plain:       two warpgroups, each issuing its share of the loads and its dQ reductions
//                (red.global.add) between its GEMMs.
//   Specialised: the same two warpgroups as consumers (240 registers) and a producer warpgroup
//                whose first warp loads Q, dO (TMA), lse2 and delta into a two-deep ring and whose
//                second reduces each dQ tile into the workspace by TMA bulk reductions.
enum class FlashBwdLayout : uint8_t { Auto, Plain, Specialised };

// Block-sparse 2-D mask over one document (kestrel::BlockMask in kestrel/ops/attention.h, on the
// device): 128 x 128 tiles; per query block a sorted list of key blocks (q_ptr / q_kblock), each
// FULL (kind -1) or PARTIAL (kind = index p of bits[p]: [128 query rows][4 words], bit = key
// visible), and the transposed view per key block (k_ptr / k_qblock / k_kind, bits_t[p]: [128 keys]
// [4 words], bit = query). Unlisted tiles are skipped by both directions. FlashAttentionParams holds
// a host pointer to it (the launchers pass the struct to the masked kernels as an argument of its
// own: a by-value member would grow the dense kernels' parameter block, and ptxas then changes their
// code; with one pointer their machine code stays byte-identical). The kernels index with these
// arrays unchecked: fill them only from a kestrel::BlockMask built by make_block_mask (the op
// refuses any other, see check_block_mask in ops/src/attention.cpp).
constexpr int kBlockMaskBlock = 128;
struct FlashBlockMask {
  const int32_t* q_ptr = nullptr;  // [q_blocks + 1]; nullptr = no mask
  const int32_t* q_kblock = nullptr;
  const int32_t* q_kind = nullptr;
  const int32_t* k_ptr = nullptr;  // [k_blocks + 1]
  const int32_t* k_qblock = nullptr;
  const int32_t* k_kind = nullptr;
  const uint32_t* bits = nullptr;    // [partials][128][4]
  const uint32_t* bits_t = nullptr;  // [partials][128][4]
};

struct FlashAttentionParams {
  const void* q;                // [total_q, Hq, D] contiguous
  const void* k;                // [total_k, Hkv, D]
  const void* v;                // [total_k, Hkv, D]
  void* out;                    // [total_q, Hq, D]
  float* lse;                   // [total_q, Hq] natural-log log-sum-exp of the scaled scores per row
  const int32_t* cu_seqlens_q;  // device [num_docs+1], cumulative offsets (packed documents)
  const int32_t* cu_seqlens_k;  // device [num_docs+1]
  int num_docs, max_seqlen_q, max_seqlen_k;  // max lengths known on the host: no host sync inside
  int num_heads_q, num_heads_kv, head_dim;   // Hq % Hkv == 0 (GQA); head_dim <= 256
  float softmax_scale;
  bool causal;
  AttnDType dtype;
  // Rows of q and of k/v (tokens); required (they bound the TMA tensor maps and size the backward
  // workspace).
  int total_q = 0, total_k = 0;
  // Sliding window (causal only; 0 = none): key j visible to query i iff i + off - window < j <= i + off
  // (off = len_k - len_q), transformers' sliding_window. Every kernel skips the key tiles (forward) and
  // query tiles (backward) wholly outside it and masks the partial tiles at both edges.
  int window = 0;
  // Prefix-LM mask (causal only, no window; nullptr = none): device i32 [num_docs], the leading keys
  // of each document that every query of it sees (key j visible iff j <= i + off or j < prefix[doc]).
  // The forward visits the key tiles up to the prefix's end, the backward all query tiles for the
  // key blocks inside the prefix; the tiles past the diagonal are masked.
  const int32_t* prefix_len = nullptr;
  FlashKernel kernel = FlashKernel::Auto;
  // Backward only: add the key blocks' dq partials in a fixed order (bitwise-reproducible dq).
  // Implemented by the Hopper backward (head dims up to 128); refused on the mma.sync path.
  bool deterministic = false;
  // Backward only (one byte beside `deterministic`: the kernels' parameter block keeps its size).
  FlashBwdLayout bwd_layout = FlashBwdLayout::Auto;
  // Block-sparse 2-D mask (non-null = on): causal false, no window / prefix, one
  // document (num_docs 1, max_seqlen_q/k = total_q/k). The Hopper kernels only (head dims 64 and 128
  // and those padded to them), not deterministic. The forward visits only its query block's listed
  // key tiles and applies the bits of PARTIAL ones (-inf before the softmax); the backward visits
  // only its key block's listed query tiles and applies the transposed bits to P.
  const FlashBlockMask* block_mask = nullptr;  // host pointer (the struct's arrays are on the device)
};

void flash_attention_forward(const FlashAttentionParams& p, cudaStream_t stream);

struct FlashAttentionBackwardParams {
  FlashAttentionParams fwd;      // q, k, v, out, lse as produced by the forward
  const void* dout;              // [total_q, Hq, D]
  void* dq;                      // [total_q, Hq, D]
  void* dk;                      // [total_k, Hkv, D], summed over the query heads of each KV group
  void* dv;                      // [total_k, Hkv, D]
  void* workspace;               // caller-allocated, flash_attention_backward_workspace_bytes()
  size_t workspace_bytes;
};

// Bytes of device workspace the backward needs (kestrel/ops/workspace_sizes.h's layout), 256-aligned.
size_t flash_attention_backward_workspace_bytes(const FlashAttentionParams& p);
void flash_attention_backward(const FlashAttentionBackwardParams& p, cudaStream_t stream);

}  // namespace kestrel::cuda
