// Attention over packed variable-length documents, causal or bidirectional, with GQA.
//
// Layout: q [total_q, Hq, D]; k, v [total_k, Hkv, D]; Hq a multiple of Hkv (query head h uses KV
// head h / (Hq / Hkv)). Documents are given by cumulative offsets cu_seqlens_q/k (i32, [docs + 1],
// on the device of q); no attention crosses documents. A plain batch is the equal-length case.
// Causal masking is bottom-right aligned per document (key j visible to query i iff
// j <= i + len_k - len_q). A sliding window W (causal only) also hides keys W or more positions
// behind the aligned diagonal: key j visible iff i + off - W < j <= i + off (off = len_k - len_q),
// i.e. with equal lengths j <= i and i - j < W, exactly transformers' sliding_window
// (masking_utils: sliding_window_overlay keeps kv_idx > q_idx - sliding_window on top of the causal
// kv_idx <= q_idx), so W = 1 sees only the diagonal key and W >= len_k is plain causal. The CUDA
// kernels skip the tiles outside the window. Never materialises a T x T matrix on the GPU (flash
// attention); the CPU reference computes one row at a time. Returns the output and the f32 log-sum-exp per (token, head)
// of the scaled scores (-inf for a row with no visible key, whose output is 0).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kestrel/runtime/tensor.h"

namespace kestrel {

// Block-sparse 2-D attention mask (the multi-token-position masks VLM stacks pack into one
// sequence), never a T x T tensor. It describes ONE packed sequence of total_q queries x total_k
// keys (one document: cu_seqlens_q/k = [0, total_q] / [0, total_k], max_seqlen = total; document
// boundaries, if any, are part of the mask) cut into kBlock x kBlock tiles, kBlock = 128 fixed by
// the library (the Hopper kernels' key tiles; their 64- and 128-row query tiles subdivide it).
// Per query block a sorted CSR list of key blocks, each FULL (every in-range pair visible) or
// PARTIAL (an index into `bits`); absent key blocks are skipped (the kernels do not visit them).
// The transposed view (per key block its query blocks, for the backward) and the transposed bits
// are built once by make_block_mask. Memory: 8 bytes per listed tile pair and view (key block and
// entry kind), plus 4 KiB per PARTIAL pair (2 KiB of bits per row layout, 2 KiB transposed); FULL
// and skipped pairs hold no bits. Combines with causal = false only (encode causality in the mask),
// no window, no prefix_len; GQA is fine (one mask for every head). Key j visible to query i iff
// block (i / 128, j / 128) is listed and is FULL or has bit (i % 128, j % 128) set.
//
// Trust: the kernels index with the mask's block numbers and kinds unchecked (the CUDA kernels
// cannot afford a device-to-host read per call), so attention() takes only a mask validated once
// by make_block_mask (or a builder on top of it, or to() of such a mask). Each carries a private
// validation record naming total_q / total_k and the eight tensors validated; the op refuses a mask
// without one (fields set by hand) or whose fields were replaced or changed since. The fields stay
// public to read (kernels, tests). Never write into a built mask's tensors in place: their contents
// are validated once, at building, and not re-read per call.
struct BlockMask {
  static constexpr int64_t kBlock = 128;
  static constexpr int32_t kFull = -1;  // entry kind of a FULL tile; >= 0: index of a PARTIAL tile's bits
  int64_t total_q = 0, total_k = 0;
  // Row view (forward): query block b lists key blocks q_kblock[q_ptr[b] .. q_ptr[b + 1]).
  Tensor q_ptr;     // i32 [q_blocks + 1]
  Tensor q_kblock;  // i32 [nnz], strictly increasing within a query block
  Tensor q_kind;    // i32 [nnz], kFull or the PARTIAL tile's index p
  // Column view (backward): key block b lists query blocks k_qblock[k_ptr[b] .. k_ptr[b + 1]).
  Tensor k_ptr;     // i32 [k_blocks + 1]
  Tensor k_qblock;  // i32 [nnz], strictly increasing within a key block
  Tensor k_kind;    // i32 [nnz], the same kinds as the row view
  // Bits of PARTIAL tile p (bit patterns in i32): bits[p][r][w] bit b = key 32 w + b of the tile
  // visible to its query r; bits_t[p][c][w] bit b = query 32 w + b visible to the tile's key c.
  // Pairs past total_q / total_k are 0.
  Tensor bits;    // i32 [partials, 128, 4]
  Tensor bits_t;  // i32 [partials, 128, 4]

  bool defined() const { return q_ptr.defined(); }
  int64_t q_blocks() const { return (total_q + kBlock - 1) / kBlock; }
  int64_t k_blocks() const { return (total_k + kBlock - 1) / kBlock; }
  int64_t nnz() const { return q_kblock.defined() ? q_kblock.numel() : 0; }
  int64_t partials() const { return bits.defined() ? bits.shape()[0] : 0; }
  // Every tensor moved to `device` (the kernels read the mask on q's device). The copy is validated
  // when this mask is (validation_problem() empty), else it is not either.
  BlockMask to(Device device) const;
  // Empty when this mask came out of make_block_mask (or to() of such a mask) and total_q, total_k
  // and its eight tensors are still the ones validated then; else what is wrong, e.g. "q_kblock was
  // replaced". O(1): compares identities (tensor, storage, offset, shape, strides, dtype), never data.
  std::string validation_problem() const;

 private:
  struct Validation;  // defined in ops/src/block_mask.cpp, the only place that creates one
  std::shared_ptr<const Validation> validation_;
  void seal();  // records the current tensors as validated (make_block_mask, to())
  friend BlockMask make_block_mask(int64_t, int64_t, const std::vector<int32_t>&, const std::vector<int32_t>&,
                                   const std::vector<int32_t>&, const std::vector<uint32_t>&);
};

// Builds a BlockMask (CPU tensors) from the row view: q_ptr [q_blocks + 1], q_kblock / q_kind
// [nnz], bits [partials * 128 * 4] (the row layout above). Validates everything (sizes, ranges,
// sorted key blocks, every PARTIAL index used once, no bits set past total_q / total_k), builds
// the column view and bits_t and seals the result (the only way to a mask attention() accepts).
// Throws kestrel::Error "[block_mask] ...".
BlockMask make_block_mask(int64_t total_q, int64_t total_k, const std::vector<int32_t>& q_ptr,
                          const std::vector<int32_t>& q_kblock, const std::vector<int32_t>& q_kind,
                          const std::vector<uint32_t>& bits);
// From a per-token predicate visible(i, j) (evaluated total_q x total_k times on the host; holds
// no T x T buffer): tiles with no visible pair are skipped, tiles with all pairs visible are FULL.
BlockMask block_mask_from_predicate(int64_t total_q, int64_t total_k,
                                    const std::function<bool(int64_t, int64_t)>& visible);
// From a dense boolean mask (Bool, U8 or I32; nonzero = visible) [total_q, total_k] on the CPU,
// for tests and small inputs.
BlockMask block_mask_from_dense(const Tensor& mask);

// Which implementation runs attention on a CUDA device (the CPU always runs its reference).
//   Kestrel: the library's flash-attention kernels (every feature below).
//   Cudnn:   cuDNN's fused flash attention (ops/cuda/cudnn_attention/): sm_90, bf16/f16, head dim a
//            multiple of 8 up to 128, causal (queries and keys the same documents: one cu_seqlens
//            tensor) or bidirectional, no window, prefix_len or block_mask, not deterministic. Its
//            workspace comes from the caching allocator (Workspace), its handle's and kernels' device
//            memory is charged as External. Chosen for a call it cannot run, it throws naming why
//            (also in a build without cuDNN).
//   Auto:    the measured rule in ops/cuda/attention_backend.cpp: Kestrel everywhere today (cuDNN is
//            ahead alone at head dim 128 but was slower inside the training step; bench/RESULTS.md).
// The forward and the backward each choose (a backward may run on the other backend: both use the
// same lse). Config key: attention.backend = "auto" | "kestrel" | "cudnn".
enum class AttentionBackend { Auto, Kestrel, Cudnn };
const char* attention_backend_name(AttentionBackend b);  // "auto", "kestrel", "cudnn"
// "auto" | "kestrel" | "cudnn"; anything else throws kestrel::Error naming `key` and the allowed values.
AttentionBackend parse_attention_backend(const std::string& value, const std::string& key = "attention.backend");

struct AttentionOptions {
  bool causal = true;
  double softmax_scale = 0.0;  // 0 = 1 / sqrt(D)
  // Left sliding window in tokens (see above); <= 0 = none. A window with causal = false is refused
  // (transformers' bidirectional sliding window has a different, symmetric rule; not implemented).
  int64_t window = 0;
  // Bit-reproducible backward: dQ summed in a fixed order instead of by atomics (the CUDA kernels;
  // the CPU reference is deterministic either way). Models set it from their deterministic setting.
  // CUDA: the Hopper backward (sm_90, head_dim <= 128) implements it (cost: bench_flash_attention's
  // BM_flash_attention_deterministic); the mma.sync path (head_dim > 128 or another GPU) refuses it
  // with an error naming the limit.
  bool deterministic = false;
  // Prefix-LM / per-image-bidirectional mask (causal only, no window): i32 [docs] on q's device, the
  // number of leading keys of each document that every query of the document sees, so the prefix
  // (an image, a system prompt) attends bidirectionally and the rest causally: key j visible to
  // query i iff j <= i + len_k - len_q or j < prefix_len[doc]. Undefined = plain causal. Every
  // kernel (CPU reference, the Hopper and the mma.sync CUDA kernels).
  Tensor prefix_len;
  // Block-sparse 2-D mask (BlockMask above; defined = on): causal = false, no window, no
  // prefix_len, one document spanning q and k; on q's device; built by make_block_mask or a builder
  // on top of it (moved with to()), else refused (see Trust above). CPU reference and the Hopper kernels
  // (sm_90, head dims up to 128 run at 64 or 128, bf16/f16; others refuse it; the deterministic
  // backward is not built with it and refuses).
  BlockMask block_mask;
  // Implementation on CUDA (AttentionBackend above); the CPU ignores it except that Cudnn is refused there.
  AttentionBackend backend = AttentionBackend::Auto;
};

struct AttentionOutput {
  Tensor out;  // [total_q, Hq, D], q's dtype
  Tensor lse;  // [total_q, Hq], f32
};

// max_seqlen_q/k: the longest document (known to the caller; no device-to-host read inside).
AttentionOutput attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens_q,
                          const Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                          const AttentionOptions& options = {});
// Self-attention convenience: the same documents for queries and keys.
Tensor attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_seqlens, int64_t max_seqlen,
                 const AttentionOptions& options = {});

}  // namespace kestrel
