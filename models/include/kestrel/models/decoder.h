// The Llama/Qwen2/Qwen3 decoder: embedding, N x (RMSNorm, attention with RoPE and GQA, RMSNorm, SwiGLU
// MLP), final RMSNorm, LM head (tied or not), loss through the fused linear + cross-entropy. Qwen3
// normalises q and k per head (RMSNorm over head_dim) before rope. RoPE uses the config's table
// (rope_scaling applied), computed once at construction.
// Parameters carry Hugging Face names (prefix + "model.layers.N.self_attn.q_proj.weight", ...).
// Each layer is one recompute region (policy per call). What a region keeps for its backward is the
// decoder's recompute mode: Full keeps only the layer input; Selective also keeps the attention
// output and its log-sum-exp, so the re-run recomputes norms, projections, RoPE and the MLP but
// never attention (q, k and v are recomputed: attention's backward needs them, and they cost more
// bytes to keep than the projection GEMMs cost to redo).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kestrel/autograd/recompute.h"
#include "kestrel/models/config.h"
#include "kestrel/models/packed_batch.h"
#include "kestrel/models/parameters.h"
#include "kestrel/ops/attention.h"
#include "kestrel/ops/cross_entropy.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/ops/rope.h"

namespace kestrel::models {

// What each layer's recompute region keeps from its forward (forward() with a policy other than None).
enum class LayerRecompute {
  Full,       // the layer input only: backward re-runs the whole layer
  Selective,  // also attention's output and log-sum-exp: the re-run skips attention
};
const char* layer_recompute_name(LayerRecompute r);

struct DecoderLayer {
  Tensor input_layernorm;           // [C]
  Tensor q_proj, q_bias;            // [Hq*D, C], [Hq*D] (qwen2 / attention_bias)
  Tensor k_proj, k_bias;            // [Hkv*D, C]
  Tensor v_proj, v_bias;            // [Hkv*D, C]
  Tensor o_proj, o_bias;            // [C, Hq*D]
  Tensor q_norm, k_norm;            // [D] (qwen3: RMSNorm over each head before rope)
  Tensor post_attention_layernorm;  // [C]
  Tensor gate_proj, up_proj;        // [I, C]
  Tensor down_proj;                 // [C, I]
};

// Keys and values of past tokens for incremental decoding, per layer and per document (rope
// applied). Documents are decoded side by side: each step appends `step_lengths[d]` tokens to
// document d. Filled and read by Decoder::forward_cached.
struct KvCache {
  std::vector<std::vector<Tensor>> k, v;  // [layer][document]: [cached_len, Hkv, D]
  std::vector<int64_t> lengths;           // tokens cached per document
  std::vector<int64_t> step_lengths;      // tokens of the step being run, per document
};

class Decoder {
 public:
  // Allocates parameters on `device` in `dtype` and initialises them (normal(0, 0.02), norms 1,
  // biases 0) from `seed`. `prefix` is prepended to every name (e.g. "language_model.").
  Decoder(const TextConfig& config, DType dtype, Device device, uint64_t seed = 0, const std::string& prefix = "");

  const TextConfig& config() const { return config_; }
  ParameterList& parameters() { return params_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  Tensor embed(const Tensor& ids) const;  // [T] -> [T, C]
  // Final hidden states [T, C] (after the last norm) for input embeddings [T, C].
  Tensor forward(const Tensor& embeds, const PackedBatch& batch,
                 autograd::RecomputePolicy policy = autograd::RecomputePolicy::None) const;
  // Final hidden states [sum(new_lengths), C] of new tokens that continue the documents held in
  // `cache` (empty cache: a prefill), appending their keys and values. No tape (run under no-grad).
  Tensor forward_cached(const Tensor& embeds, const std::vector<int64_t>& new_lengths, KvCache& cache) const;
  // One layer (exposed for tests and profiling); with `cache`, attention also sees the cached tokens.
  Tensor layer_forward(int index, const Tensor& h, const PackedBatch& batch, KvCache* cache = nullptr) const;
  const Tensor& lm_head_weight() const { return config_.tie_word_embeddings ? embed_tokens_ : lm_head_; }
  // Mean (or configured) next-token loss of hidden [T, C] against labels [T] (ignore_index -100).
  Tensor loss(const Tensor& hidden, const Tensor& labels, const CrossEntropyOptions& options = {}) const;
  // Logits [T, V] (for generation and debugging: materialises the full row block).
  Tensor logits(const Tensor& hidden) const;

  // Token tile of the MLP (kestrel/ops/mlp.h): 0 runs it as linear/swiglu ops that keep three [T, I]
  // activations for backward; N > 0 runs it N tokens at a time, keeping only its input (two more
  // GEMMs per tile in backward). The trainer picks N from the memory budget for long contexts.
  void set_mlp_tile_tokens(int64_t tokens);
  int64_t mlp_tile_tokens() const { return mlp_tile_tokens_; }

  // What a layer's recompute region keeps (see LayerRecompute); Full by default. Has an effect only
  // when forward() runs the layers as regions (policy Keep or Offload): Selective with Offload
  // offloads the kept attention output and log-sum-exp with the layer input.
  void set_layer_recompute(LayerRecompute r) { layer_recompute_ = r; }
  LayerRecompute layer_recompute() const { return layer_recompute_; }

  // Bit-reproducible training on the GPU: the embedding's backward scatter-add and attention's dQ
  // sum in a fixed order instead of by atomics (kestrel/ops/embedding.h, AttentionOptions). Off by
  // default (the atomics are faster); the CPU is deterministic either way. The trainer sets it from
  // train.deterministic.
  void set_deterministic(bool on) { deterministic_ = on; }
  bool deterministic() const { return deterministic_; }

  // The attention implementation of the layers' training forward and backward (AttentionBackend in
  // kestrel/ops/attention.h: auto, kestrel or cudnn); decoding against a KvCache always runs the
  // default (Auto). The trainer sets it from attention.backend.
  void set_attention_backend(AttentionBackend b) { attention_backend_ = b; }
  AttentionBackend attention_backend() const { return attention_backend_; }

  // FP8 training of the layers' linear projections (q/k/v/o, gate/up/down; kestrel/ops/fp8.h): each is
  // linear_fp8 with its own delayed-scaling rows (index layer * 7 + {q, k, v, o, gate, up, down});
  // q/k/v share one cast of their input (q's input row), gate/up one of theirs (gate's input row).
  // The embedding, norms, attention and the output head stay in the model's dtype. The tiled MLP is
  // refused with FP8 (its GEMMs are bf16 only). Refused too: a dtype/device pair other than bf16 (or
  // f32 on the CPU), a projection dimension (hidden_size, heads * head_dim, kv heads * head_dim,
  // intermediate_size) that is not a multiple of 16, and a second call. The caller rolls the state once
  // per optimizer step (fp8_state()->roll()) and turns its observing off around forwards that are not
  // training (Fp8ObserveOff). Off (null) by default.
  void enable_fp8(const Fp8Recipe& recipe);
  Fp8State* fp8_state() const { return fp8_.get(); }
  static constexpr int64_t kFp8LinearsPerLayer = 7;
  // With FP8, the input casts of q/k/v, gate/up and down are made by the ops that produce those
  // inputs (kestrel/ops/fp8_producers.h: the input RMSNorm and the residual add + RMSNorm, then the
  // cast as a second pass; SwiGLU in its own pass once the state is seeded); off: linear_fp8 casts
  // each input itself. Losses and
  // gradients are bit for bit the same either way (only the passes over memory differ). On by default.
  void set_fp8_fused_casts(bool on) { fp8_fused_casts_ = on; }
  bool fp8_fused_casts() const { return fp8_fused_casts_; }

  // Called with each group of parameters just before the forward first reads them: the embedding
  // table in embed(), a layer's tensors before forward() runs the layer, the final norm and the
  // output head before the final norm (loss() and logits() read nothing else). The trainer's
  // overlapped optimizer step (optimizer.update_overlap) waits there for each parameter's update,
  // so the next forward starts while the host still updates the later layers. Empty: no calls.
  using ParameterFence = std::function<void(const std::vector<const Tensor*>&)>;
  void set_parameter_fence(ParameterFence fence) { fence_ = std::move(fence); }

 private:
  TextConfig config_;
  DType dtype_;
  Device device_;
  std::string prefix_;
  RopeFrequencies rope_;  // the config's rotary table (rope_scaling applied), computed once
  Tensor embed_tokens_;  // [V, C]
  std::vector<DecoderLayer> layers_;
  Tensor norm_;     // [C]
  Tensor lm_head_;  // [V, C] unless tied
  ParameterList params_;
  int64_t mlp_tile_tokens_ = 0;
  LayerRecompute layer_recompute_ = LayerRecompute::Full;
  bool deterministic_ = false;
  AttentionBackend attention_backend_ = AttentionBackend::Auto;
  bool fp8_fused_casts_ = true;
  std::shared_ptr<Fp8State> fp8_;  // shared by copies of the decoder (one model, one state)
  ParameterFence fence_;
};

}  // namespace kestrel::models
