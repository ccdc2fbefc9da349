// Reading a LLaVA folder (transformers' LlavaForConditionalGeneration: config.json + safetensors) into
// Kestrel's VLM, the reverse of `kestrel-train export --format llava` (issue 24). Used to compare Kestrel with
// transformers on the same weights (tests/train/test_vlm_hf_parity.cpp, `kestrel-grad` on a LLaVA folder).
//
// Accepted: what the VLM computes with pixel_shuffle_factor 1 (kestrel/train/vlm_export.h):
// vision_config siglip_vision_model without its pooling head, text_config llama / mistral / qwen2 / qwen3,
// projector_hidden_act "gelu" or "gelu_pytorch_tanh", multimodal_projector_bias true, one integer
// vision_feature_layer, vision_feature_select_strategy "full". Anything else is refused naming the field
// (strategy "default" drops each image's first patch, which Kestrel's VLM never does). Missing fields take
// LlavaConfig's defaults (projector_hidden_act "gelu", vision_feature_layer -2, strategy "default",
// projector bias true); image_token_id (or the older image_token_index) is required.
// Weight names: transformers >= 4.52 "model.vision_tower.*", "model.multi_modal_projector.*",
// "model.language_model.*", "lm_head.weight"; the older "vision_tower.*", "multi_modal_projector.*",
// "language_model.model.*", "language_model.lm_head.weight"; a vision tower with or without its
// "vision_model." wrapper (transformers 5.8 dropped it). A tied head may be absent or a copy.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kestrel/models/vlm.h"

namespace kestrel::train {

// The VLM config of a LLaVA config.json (`source` names it in errors).
models::VlmConfig vlm_config_from_llava(const nlohmann::json& j, const std::string& source = "<llava config>");

// Kestrel's parameter name for a LLaVA weight name, in any of the layouts above ("" for a tied head's
// copy, "lm_head.weight" when `tied`); throws naming a tensor Kestrel has no parameter for.
std::string vlm_name_from_llava(const std::string& llava_name, bool tied);

struct LlavaFolder {
  std::unique_ptr<models::Vlm> vlm;
  // (LLaVA name as stored, Kestrel name), sorted by LLaVA name; a tied head's copy is not listed.
  std::vector<std::pair<std::string, std::string>> names;
  std::vector<std::string> unused;  // SigLIP pooling-head tensors ("...vision_model.head.*"), not loaded
};

// Builds the VLM in `dtype` on `device` and loads every parameter from `dir` (each exactly once).
LlavaFolder load_llava_folder(const std::string& dir, DType dtype, Device device);

// Kestrel's batch for transformers' LLaVA inputs: input_ids [B, T] i64 (equal-length rows, no padding; each
// row one document), labels [B, T] i64 as transformers takes them (-100 = no loss; shifted by one inside
// the model) or undefined, pixel_values [N, C, S, S]; image slots are the ids equal to `image_token_id`, filled
// with the images in order (row-major), as LLaVA's masked_scatter does.
models::VlmBatch vlm_batch_from_llava_inputs(const Tensor& input_ids, const Tensor& labels,
                                             const Tensor& pixel_values, int64_t image_token_id, DType dtype,
                                             Device device);

}  // namespace kestrel::train
