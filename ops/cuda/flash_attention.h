// Flash attention (FA2 algorithm, mma.sync) over raw device pointers: forward and backward,
// causal (bottom-right aligned per document, optionally a sliding window) and bidirectional, GQA, packed variable-length
// documents given by cumulative offsets. Private launcher API; the Tensor-level op wraps it.
//
// Layouts: q/out/dout/dq [total_q, Hq, D], k/v/dk/dv [total_k, Hkv, D], lse [total_q, Hq] (f32,
// natural log of sum_j exp(scale * q.k_j)). A query row with no visible key gets out = 0 and
// lse = -inf. Extra memory is O(tokens x heads): the backward workspace holds an f32 dq
// accumulator and two f32 rows per (token, head). No host synchronisation: max lengths come
// from the caller. head_dim must be a multiple of 8 and at most 256; 64 and 128 are the fast
// path, any other value runs a zero-padded instantiation (one stderr line on first use).
//
// Determinism: forward, dk and dv are bitwise reproducible. dq is summed over key tiles with f32
// atomics, so its f32 accumulator can differ in the last bits between runs (order of additions);
// after rounding to bf16/f16 repeated runs differ by at most one unit in the last place.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

namespace kestrel::cuda {

enum class AttnDType { BF16, F16 };

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
  // Rows of q and of k/v (tokens). Optional (0 = not given): the TMA forward needs them to bound
  // its tensor maps and is skipped without them.
  int total_q = 0, total_k = 0;
  // Sliding window (causal only; 0 = none): key j visible to query i iff i + off - window < j <= i + off
  // (off = len_k - len_q), transformers' sliding_window. Every kernel skips the key tiles (forward) and
  // query tiles (backward) wholly outside it and masks the partial tiles at both edges.
  int window = 0;
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

// Bytes of device workspace the backward needs (f32 dq accumulator + lse/delta rows), 256-aligned.
size_t flash_attention_backward_workspace_bytes(const FlashAttentionParams& p, int total_q);
void flash_attention_backward(const FlashAttentionBackwardParams& p, int total_q, cudaStream_t stream);

}  // namespace kestrel::cuda
