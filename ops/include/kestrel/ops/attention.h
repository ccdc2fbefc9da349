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

#include "kestrel/runtime/tensor.h"

namespace kestrel {

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
