// The vision-language model: vision tower -> projector (pixel shuffle + 2-layer MLP) -> image
// embeddings written into the text sequence at the image-token positions -> decoder; one loss over
// the text. Names follow LLaVA's layout in transformers: "vision_tower.vision_model.*",
// "multi_modal_projector.linear_{1,2}.*", "language_model.model.*", "language_model.lm_head.weight".
#pragma once

#include <vector>

#include "kestrel/models/decoder.h"
#include "kestrel/models/vision.h"

namespace kestrel::models {

struct VlmBatch {
  Tensor input_ids;        // [T] i64, image-token id at image slots
  Tensor labels;           // [T] i64, next-token targets, -100 where no loss
  Tensor pixel_values;     // [B, C, H, W]: every tower image (a tiled picture is several), in document order
  Tensor image_positions;  // [B * tokens_per_image] i64: sequence slots receiving image embeddings, in order
  PackedBatch layout;      // documents (one per image-text record)
  // Host metadata: the images of each document (tiles + thumbnail), summing to B; empty = not given.
  std::vector<int64_t> images_per_document;
};

class Vlm {
 public:
  Vlm(const VlmConfig& config, DType dtype, Device device, uint64_t seed = 0);
  const VlmConfig& config() const { return config_; }
  ParameterList& parameters() { return params_; }
  Decoder& decoder() { return decoder_; }
  VisionTower& vision() { return vision_; }
  // Bit-reproducible backward in both towers (Decoder::set_deterministic, VisionTower's).
  void set_deterministic(bool on) {
    vision_.set_deterministic(on);
    decoder_.set_deterministic(on);
  }

  // Image embeddings in the text width: [B * tokens_per_image, C_text].
  Tensor image_embeddings(const Tensor& pixel_values, autograd::RecomputePolicy policy) const;
  // Final hidden states [T, C] of the text sequence with images spliced in.
  Tensor hidden(const VlmBatch& batch, autograd::RecomputePolicy policy) const;
  Tensor loss(const VlmBatch& batch, autograd::RecomputePolicy policy = autograd::RecomputePolicy::None,
              const CrossEntropyOptions& options = {}) const;

  // Greedy decoding for a batch of prompts (each: its image(s) already in `batch`): appends up to
  // `max_new_tokens` tokens to each document, stopping a document at `eos_id`. Runs without grad.
  std::vector<std::vector<int64_t>> generate_greedy(const Tensor& pixel_values,
                                                    const std::vector<std::vector<int64_t>>& prompts,
                                                    int64_t max_new_tokens, int64_t eos_id) const;

 private:
  VlmConfig config_;
  DType dtype_;
  Device device_;
  VisionTower vision_;
  Tensor proj1_w_, proj1_b_, proj2_w_, proj2_b_;
  Decoder decoder_;
  ParameterList params_;
};

}  // namespace kestrel::models
