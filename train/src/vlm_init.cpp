// Pretrained towers for the VLM (vlm_init.h states the rules).
#include "vlm_init.h"

#include "kestrel/models/safetensors.h"

#include <filesystem>
#include <sstream>

#include "kestrel/models/config.h"
#include "kestrel/models/parameters.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::string config_file(const std::string& folder, const char* key) {
  KESTREL_CHECK(fs::is_directory(folder), "train", key, " '", folder, "' is not a folder (expected a Hugging Face "
                "model folder with config.json and safetensors)");
  const std::string path = (fs::path(folder) / "config.json").string();
  KESTREL_CHECK(fs::exists(path), "train", key, " '", folder, "' has no config.json");
  return path;
}

// The vision tower's config.json object from a SigLIP folder.
json vision_json_of(const std::string& folder) {
  const std::string path = config_file(folder, "model.vision_from");
  json j = models::read_json_file(path, "train");
  const std::string type = j.is_object() && j.contains("model_type") && j["model_type"].is_string()
                               ? j["model_type"].get<std::string>() : "";
  if (type == "siglip") {
    KESTREL_CHECK(j.contains("vision_config") && j["vision_config"].is_object(), "train", "model.vision_from: '", path,
                  "' is a full SigLIP config without a 'vision_config' object");
    json v = j["vision_config"];
    v["model_type"] = "siglip_vision_model";
    return v;
  }
  KESTREL_CHECK(type == "siglip_vision_model", "train", "model.vision_from: '", path, "' has model_type '", type,
                "'; expected 'siglip_vision_model' or 'siglip' (the vision half of a full SigLIP)");
  return j;
}

// Fields that set shapes: a VLM config that gives them must agree with the folder.
template <typename T>
void same(const char* folder_key, const std::string& folder, const std::string& field, const T& theirs, const T& ours) {
  if (theirs == ours) return;
  std::ostringstream a, b;
  a << theirs;
  b << ours;
  throw make_error("train", folder_key, " '", folder, "' has ", field, " = ", a.str(), " but model.config's ",
                   field, " is ", b.str(), ": leave that section out of model.config (it is read from the folder) "
                   "or make the two agree");
}

}  // namespace

models::VlmConfig resolve_vlm_config(const json& cfg) {
  const json& m = cfg["model"];
  const std::string vision_from = m.value("vision_from", std::string());
  const std::string text_from = m.value("text_from", std::string());
  const std::string path = m["config_path"];
  const std::string source = path.empty() ? "model.config" : path;
  json j = path.empty() ? m["config"] : models::read_json_file(path, "config");
  if (vision_from.empty() && text_from.empty()) return models::VlmConfig::from_json(j, source);
  KESTREL_CHECK(m["init_from"].get<std::string>().empty(), "train", "model.init_from (a whole VLM) and "
                "model.vision_from / model.text_from (pretrained towers under a fresh projector) exclude each other; "
                "to continue from a saved VLM set model.init_from only");
  KESTREL_CHECK(j.is_object(), "train", source, " must be an object (the kestrel_vlm config)");
  if (!j.contains("model_type")) j["model_type"] = "kestrel_vlm";
  json given_vision = j.value("vision_config", json());
  json given_text = j.value("text_config", json());
  models::VisionConfig vf;
  models::TextConfig tf;
  if (!vision_from.empty()) {
    vf = models::VisionConfig::from_json(vision_json_of(vision_from), vision_from + "/config.json");
    j["vision_config"] = vf.to_json();
  }
  if (!text_from.empty()) {
    tf = models::TextConfig::from_file(config_file(text_from, "model.text_from"));
    j["text_config"] = tf.to_json();
  }
  models::VlmConfig mc = models::VlmConfig::from_json(j, source);
  if (!vision_from.empty() && !given_vision.is_null()) {
    const models::VisionConfig g = models::VisionConfig::from_json(given_vision, source + " vision_config");
    const char* k = "model.vision_from";
    same(k, vision_from, "vision_config.hidden_size", vf.hidden_size, g.hidden_size);
    same(k, vision_from, "vision_config.intermediate_size", vf.intermediate_size, g.intermediate_size);
    same(k, vision_from, "vision_config.num_hidden_layers", vf.num_hidden_layers, g.num_hidden_layers);
    same(k, vision_from, "vision_config.num_attention_heads", vf.num_attention_heads, g.num_attention_heads);
    same(k, vision_from, "vision_config.num_channels", vf.num_channels, g.num_channels);
    same(k, vision_from, "vision_config.image_size", vf.image_size, g.image_size);
    same(k, vision_from, "vision_config.patch_size", vf.patch_size, g.patch_size);
  }
  if (!text_from.empty() && !given_text.is_null()) {
    const models::TextConfig g = models::TextConfig::from_json(given_text, source + " text_config");
    const char* k = "model.text_from";
    same(k, text_from, "text_config.model_type", tf.model_type, g.model_type);
    same(k, text_from, "text_config.vocab_size", tf.vocab_size, g.vocab_size);
    same(k, text_from, "text_config.hidden_size", tf.hidden_size, g.hidden_size);
    same(k, text_from, "text_config.intermediate_size", tf.intermediate_size, g.intermediate_size);
    same(k, text_from, "text_config.num_hidden_layers", tf.num_hidden_layers, g.num_hidden_layers);
    same(k, text_from, "text_config.num_attention_heads", tf.num_attention_heads, g.num_attention_heads);
    same(k, text_from, "text_config.num_key_value_heads", tf.num_key_value_heads, g.num_key_value_heads);
    same(k, text_from, "text_config.head_dim", tf.head_dim, g.head_dim);
    same(k, text_from, "text_config.tie_word_embeddings", tf.tie_word_embeddings, g.tie_word_embeddings);
  }
  return mc;
}

void load_pretrained_towers(models::Vlm& vlm, const json& cfg, const std::function<void(const std::string&)>& log) {
  const json& m = cfg["model"];
  for (const auto& [key, prefix] : {std::pair{"vision_from", "vision_tower."}, {"text_from", "language_model."}}) {
    const std::string folder = m.value(key, std::string());
    if (folder.empty()) continue;
    // The tower's parameters under the folder's names: "vision_tower.vision_model.X" is the SigLIP
    // checkpoint's "vision_model.X"; "language_model.model.X" the decoder's "model.X".
    models::ParameterList tower;
    const std::string pre = prefix;
    // SigLIP folders come in two layouts: the Hub's (and transformers' before 5.8) "vision_model.X",
    // and the flat "X" that transformers' SiglipVisionModel saves since it dropped its wrapper.
    std::string strip;
    if (std::string(key) == "vision_from") {
      try {
        const models::SafetensorsReader r = models::SafetensorsReader::open(folder);
        if (!r.contains("vision_model.embeddings.patch_embedding.weight") &&
            r.contains("embeddings.patch_embedding.weight"))
          strip = "vision_model.";
      } catch (const Error& e) {
        throw make_error("train", "model.", key, " '", folder, "': ", e.what());
      }
    }
    for (auto& [name, t] : vlm.parameters().items()) {
      if (!name.starts_with(pre)) continue;
      std::string local = name.substr(pre.size());
      if (!strip.empty() && local.starts_with(strip)) local = local.substr(strip.size());
      tower.add(local, t);
    }
    models::LoadReport r;
    try {
      r = models::load_safetensors(tower, folder, /*strict=*/true);
    } catch (const Error& e) {
      throw make_error("train", "model.", key, " '", folder, "': ", e.what());
    }
    std::string unused;
    for (size_t i = 0; i < r.unexpected.size() && i < 3; ++i) unused += (i ? ", " : "") + r.unexpected[i];
    log("model." + std::string(key) + ": " + std::to_string(tower.size()) + " tensors from " + folder +
        (r.unexpected.empty() ? std::string()
                              : " (" + std::to_string(r.unexpected.size()) + " of its tensors unused, e.g. " + unused +
                                    (r.unexpected.size() > 3 ? ", ..." : "") + ")"));
  }
}

}  // namespace kestrel::train
