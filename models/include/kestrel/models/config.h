// Hugging Face config.json <-> model configuration structs (llama, mistral, qwen2, qwen3, siglip_vision_model, and
// Kestrel's VLM config that nests a vision and a text config).
//
// Policy: fields are named as HF names them; a missing key takes the default the HF config class
// gives it (see each struct); every value is validated once at parse time and an invalid one throws
// kestrel::Error naming the file and the field. to_json() writes what transformers reads back.
// Only HF fields live here: Kestrel run settings (recompute policy, dtypes of training) belong to
// the training config, not to these structs.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kestrel/models/rope_scaling.h"

namespace kestrel::models {

// Decoder-only text model: model_type "llama", "mistral", "qwen2" or "qwen3" (qwen3: RMSNorm over each
// head of q and k before rope, q_norm/k_norm [head_dim]; head_dim defaults to 128; biases as llama's
// attention_bias; mistral: llama-shaped without biases, sliding-window attention on every layer).
// Sliding windows (src/attention_window.cpp): mistral's sliding_window, qwen2/qwen3's use_sliding_window
// + sliding_window + max_window_layers + layer_types, as transformers 5 resolves them.
// Audit (config.cpp): every field that changes the maths is implemented or refused with an error
// naming it (layer_types other than full_attention/sliding_attention, a sliding layer without a
// window, llama configs with sliding layers, partial_rotary_factor != 1,
// mlp_bias, hidden_act other than silu, qk_norm, logit softcapping, attention_dropout != 0,
// quantization_config, rope types other than supported_rope_types()). Fields that do not change the maths are kept in extra_json and
// written back by to_json().
// HF defaults (LlamaConfig / Qwen2Config):            llama     qwen2     (qwen3 as qwen2, head_dim 128;
//                                                                          mistral below the table)
//   vocab_size                                        32000     151936
//   hidden_size                                       4096      4096
//   intermediate_size                                 11008     22016
//   num_hidden_layers / num_attention_heads           32 / 32   32 / 32
//   num_key_value_heads                               = heads   = heads (see note in config.cpp)
//   head_dim                                          hidden / heads
//   max_position_embeddings                           2048      32768
//   rms_norm_eps                                      1e-6      1e-6
//   rope_theta                                        10000     10000
//   bos / eos token id                                1 / 2     none / none
//   attention_bias, mlp_bias                          false     (q/k/v bias always, o_proj never)
//   sliding_window / use_sliding_window / max_window_layers   -     4096 / false / 28
// mistral (MistralConfig): vocab 32000, intermediate 14336, kv heads 8, max_position_embeddings 131072,
// bos 1, eos 2, sliding_window 4096 (null = full attention), no biases.
struct TextConfig {
  std::string model_type = "llama";
  int64_t vocab_size = 32000;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 11008;
  int64_t num_hidden_layers = 32;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 32;
  int64_t head_dim = 128;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;      // rope_parameters.rope_theta (transformers 5) or top-level rope_theta
  RopeScaling rope_scaling;        // parsed from rope_scaling, else rope_parameters (transformers 5's order)
  std::string rope_scaling_json;  // raw rope_scaling object (or rope_parameters minus rope_theta); "" if none
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // llama, qwen3: bias on q, k, v and o projections
  bool mlp_bias = false;        // llama only (refused: not implemented)
  std::string hidden_act = "silu";
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // HF allows one id or a list
  std::optional<int64_t> pad_token_id;
  std::string torch_dtype;  // "bfloat16", "float32", ... as written; "" if absent
  std::string extra_json;   // JSON object of the fields Kestrel does not read (kept through save); "" if none
  // Sliding windows (mistral, qwen2, qwen3; see attention_window()).
  std::optional<int64_t> sliding_window;  // tokens, as written (defaults_for: 4096); none = null
  bool use_sliding_window = false;        // qwen2/qwen3: false = no layer slides
  int64_t max_window_layers = 28;         // qwen2/qwen3 without layer_types: layers >= this slide
  std::vector<std::string> layer_types;   // "full_attention"/"sliding_attention" per layer; empty = derived

  // Which projections carry a bias, from the model_type's rules.
  bool qkv_bias() const { return model_type == "qwen2" || attention_bias; }
  bool o_proj_bias() const { return model_type != "qwen2" && attention_bias; }
  bool qk_norm() const { return model_type == "qwen3"; }  // q_norm / k_norm per head before rope
  // The attention window of layer `layer` in tokens (0 = full causal): key j visible to query i iff
  // i - window < j <= i, transformers' sliding_window.
  int64_t attention_window(int64_t layer) const;
  int64_t kv_groups() const { return num_attention_heads / num_key_value_heads; }
  // FLOPs of the attention score and value products in one training step (forward and backward, no
  // recompute) over packed documents of these lengths: per layer and per visible (query, key) pair,
  // 4 * heads * head_dim forward (Q K^T and P V) and twice that backward; visible pairs are the
  // causal ones within the layer's window. What MFU adds to 6 x parameters x tokens.
  double attention_training_flops(const std::vector<int64_t>& document_lengths) const;
  // The rotary table of this config (rope_scaling applied) for sequences of up to `seq_len` tokens
  // (max position + 1; only "dynamic" depends on it).
  RopeFrequencies rope_frequencies(int64_t seq_len = 0) const;
  // Throws when a batch whose longest sequence is `seq_len` tokens cannot be computed as transformers
  // trains it ("dynamic" past max_position_embeddings).
  void check_sequence_length(int64_t seq_len) const;

  // `source` names where the JSON came from in error messages.
  static TextConfig from_json(const nlohmann::json& j, const std::string& source = "<json>");
  static TextConfig from_file(const std::string& path);
  static TextConfig defaults_for(const std::string& model_type);  // HF defaults of that type
  void validate(const std::string& source = "<config>") const;
  nlohmann::json to_json() const;
};

// SigLIP vision tower (model_type "siglip_vision_model"). HF SiglipVisionConfig defaults:
// hidden 768, intermediate 3072, 12 layers, 12 heads, 3 channels, image 224, patch 16,
// layer_norm_eps 1e-6, hidden_act "gelu_pytorch_tanh".
struct VisionConfig {
  std::string model_type = "siglip_vision_model";
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t num_channels = 3;
  int64_t image_size = 224;
  int64_t patch_size = 16;
  double layer_norm_eps = 1e-6;
  std::string hidden_act = "gelu_pytorch_tanh";
  std::string torch_dtype;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t patches_per_side() const { return image_size / patch_size; }  // floor, as the patch conv
  int64_t num_patches() const { return patches_per_side() * patches_per_side(); }

  static VisionConfig from_json(const nlohmann::json& j, const std::string& source = "<json>");
  static VisionConfig from_file(const std::string& path);
  void validate(const std::string& source = "<config>") const;
  nlohmann::json to_json() const;
};

// Kestrel's VLM (model_type "kestrel_vlm"): vision tower -> pixel shuffle (factor s: s*s patches
// concatenated into one token) -> MLP projector (hidden projector_hidden_size) -> text embeddings,
// spliced at positions holding image_token_id.
// Defaults: pixel_shuffle_factor 2, projector_hidden_size = text hidden_size; image_token_id is
// required (there is no sensible default).
// LLaVA's computation (what `kestrel-train export --format llava` writes, issue 24): pixel_shuffle_factor
// 1, projector_hidden_size = text hidden_size, projector_hidden_act "gelu" (LlavaMultiModalProjector's
// default: erf GELU; "gelu_pytorch_tanh" is Kestrel's default) and vision_feature_layer set: the image
// features are then hidden_states[vision_feature_layer] of the tower as transformers counts them
// (0 = the embeddings, k = after block k, negative from the end; -1 = the last block's output), with no
// post_layernorm. Absent (Kestrel's default), the features are the tower's post_layernorm output.
struct VlmConfig {
  VisionConfig vision_config;
  TextConfig text_config;
  int64_t pixel_shuffle_factor = 2;
  int64_t projector_hidden_size = 0;
  int64_t image_token_id = -1;
  std::string projector_hidden_act = "gelu_pytorch_tanh";  // or "gelu" (erf)
  std::optional<int64_t> vision_feature_layer;              // LLaVA's feature layer; none = post_layernorm output
  // Vision blocks the features need (all when vision_feature_layer is absent).
  int64_t vision_blocks_used() const {
    if (!vision_feature_layer) return vision_config.num_hidden_layers;
    const int64_t n = vision_config.num_hidden_layers + 1;  // hidden_states entries
    return *vision_feature_layer < 0 ? n + *vision_feature_layer : *vision_feature_layer;
  }

  // Image tokens per image after pixel shuffle.
  int64_t image_tokens_per_image() const {
    int64_t side = vision_config.patches_per_side() / pixel_shuffle_factor;
    return side * side;
  }

  static VlmConfig from_json(const nlohmann::json& j, const std::string& source = "<json>");
  static VlmConfig from_file(const std::string& path);
  void validate(const std::string& source = "<config>") const;
  nlohmann::json to_json() const;
};

// Reads and parses a JSON file; errors name the file.
nlohmann::json read_json_file(const std::string& path, const char* component = "config");
// Writes `j` (indented, trailing newline) atomically.
void write_json_file(const std::string& path, const nlohmann::json& j, const char* component = "config");

}  // namespace kestrel::models
