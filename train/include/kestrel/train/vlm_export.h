// Saving a trained VLM as one model folder (issue 24): `kestrel-train export`.
//
// Formats:
// - "kestrel": config.json (model_type kestrel_vlm) + model.safetensors under Kestrel's names; a run
//   continues from it with model.config_path = DIR/config.json and model.init_from = DIR.
// - "llava": what transformers' LlavaForConditionalGeneration loads (transformers >= 4.52 layout):
//   config.json {model_type "llava", vision_config siglip_vision_model (vision_use_head false),
//   text_config llama / mistral / qwen2 / qwen3, image_token_id (and image_token_index), projector_hidden_act,
//   vision_feature_layer, vision_feature_select_strategy "full" (SigLIP has no CLS token),
//   multimodal_projector_bias true, image_seq_length} and weights "model.vision_tower.vision_model.*",
//   "model.multi_modal_projector.linear_{1,2}.*", "model.language_model.*" and "lm_head.weight" (written
//   also when tied, as a copy). Refused, naming each field, unless the model computes what LLaVA
//   computes: pixel_shuffle_factor 1, projector_hidden_size = the text width, vision_feature_layer set
//   (Kestrel's default post_layernorm features have no LLaVA equivalent).
// The weights are written in f32 (the export builds the VLM in f32); the config's torch_dtype is the
// source folders'.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/models/vlm.h"

namespace kestrel::train {

// Why `config` cannot be exported as LLaVA ("" when it can): every reason, one per line.
std::string llava_export_problems(const models::VlmConfig& config);
// The LLaVA config.json of `config` (throws with llava_export_problems when it has any).
nlohmann::json llava_config_json(const models::VlmConfig& config);
// Writes `vlm` to folder `dir` in `format` ("kestrel" or "llava").
void export_vlm(models::Vlm& vlm, const std::string& dir, const std::string& format);

// The model a resolved trainer config describes, on the CPU in f32: its config (towers from
// model.vision_from / text_from), initialised by the train.seed, the towers loaded, model.init_from
// loaded, then `weights` (a checkpoint step folder or model folder; "" = none).
std::unique_ptr<models::Vlm> build_vlm_for_export(const nlohmann::json& cfg, const std::string& weights);

// The next-token logits [T, V] (f32) of one document: input_ids [T] i64 (image_token_id at the image
// slots), pixel_values [B, 3, S, S] f32. For comparing with transformers (bench/vlm_export_check.py).
Tensor vlm_logits(models::Vlm& vlm, const Tensor& input_ids, const Tensor& pixel_values);

}  // namespace kestrel::train
