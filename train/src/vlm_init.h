// Private: a VLM whose towers come from pretrained Hugging Face folders (issue 24).
//
// model.vision_from: a SigLIP folder, either a vision model (config.json model_type
// "siglip_vision_model") or a full SigLIP (model_type "siglip", the tower's config under
// "vision_config"); the tower's weights are its "vision_model.*" tensors (a full checkpoint's
// "text_model.*", "logit_scale", ... and the pooling head "vision_model.head.*" are not used).
// model.text_from: a Llama / Mistral / Qwen2 / Qwen3 folder (config.json + safetensors, "model.*" and
// "lm_head.weight"). The projector stays freshly initialised.
// The run's model.config (or config_path) may leave out vision_config / text_config: they are then
// read from the folders. When it gives them, every field that sets a shape (widths, depths, heads,
// image and patch size, vocabulary, tying) must agree with the folder, else the run is refused naming
// the field; image_token_id must lie inside the text model's vocabulary. model.init_from (a whole
// VLM) and these keys exclude each other.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/models/vlm.h"

namespace kestrel::train {

// The VLM config of a resolved trainer config (model.config or config_path, towers' configs filled in
// from model.vision_from / model.text_from).
models::VlmConfig resolve_vlm_config(const nlohmann::json& cfg);

// Loads the towers named by model.vision_from / model.text_from into `vlm` (nothing when both are "").
// `log` receives one line per folder.
void load_pretrained_towers(models::Vlm& vlm, const nlohmann::json& cfg,
                            const std::function<void(const std::string&)>& log);

}  // namespace kestrel::train
