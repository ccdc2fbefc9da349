// SigLIP-style vision tower: patch embedding, learned position embeddings, N x pre-norm blocks
// (LayerNorm, bidirectional attention, GELU-tanh MLP), final LayerNorm. HF names under
// prefix + "vision_model." (SiglipVisionModel). Each block is one recompute region.
#pragma once

#include <string>
#include <vector>

#include "kestrel/autograd/recompute.h"
#include "kestrel/models/config.h"
#include "kestrel/models/parameters.h"

namespace kestrel::models {

struct VisionBlock {
  Tensor ln1_w, ln1_b, ln2_w, ln2_b;     // [E]
  Tensor q_w, q_b, k_w, k_b, v_w, v_b;   // [E, E], [E]
  Tensor o_w, o_b;                       // out_proj
  Tensor fc1_w, fc1_b, fc2_w, fc2_b;     // [I, E], [I], [E, I], [E]
};

class VisionTower {
 public:
  VisionTower(const VisionConfig& config, DType dtype, Device device, uint64_t seed = 0,
              const std::string& prefix = "");
  const VisionConfig& config() const { return config_; }
  ParameterList& parameters() { return params_; }

  // pixel_values [B, C, H, W] (model dtype) -> [B * num_patches, E] (each image one document).
  Tensor forward(const Tensor& pixel_values, autograd::RecomputePolicy policy = autograd::RecomputePolicy::None) const;
  // hidden_states[k] as transformers' SiglipVisionModel returns them (output_hidden_states): the
  // embeddings for k = 0, else block k's output, without post_layernorm; blocks past k do not run.
  // LLaVA's image features (VlmConfig::vision_feature_layer). [B * num_patches, E].
  Tensor hidden_state(const Tensor& pixel_values, int64_t k,
                      autograd::RecomputePolicy policy = autograd::RecomputePolicy::None) const;

  // Attention's dQ summed in a fixed order (AttentionOptions::deterministic); see Decoder.
  void set_deterministic(bool on) { deterministic_ = on; }
  bool deterministic() const { return deterministic_; }

 private:
  Tensor block_forward(int index, const Tensor& x, const Tensor& cu_seqlens, int64_t n) const;
  Tensor blocks_forward(const Tensor& pixel_values, int64_t blocks, autograd::RecomputePolicy policy) const;

  VisionConfig config_;
  DType dtype_;
  Device device_;
  Tensor patch_w_, patch_b_;  // [E, C, P, P], [E]
  Tensor pos_emb_;            // [num_patches, E]
  std::vector<VisionBlock> blocks_;
  Tensor post_ln_w_, post_ln_b_;
  ParameterList params_;
  bool deterministic_ = false;
};

}  // namespace kestrel::models
