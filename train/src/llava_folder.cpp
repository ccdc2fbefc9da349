// A LLaVA folder read into Kestrel's VLM (kestrel/train/llava_folder.h).
#include "kestrel/train/llava_folder.h"

#include <set>

#include "kestrel/models/config.h"
#include "kestrel/models/parameters.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {
using nlohmann::json;

namespace {
constexpr const char* kComp = "llava";

const json* field(const json& j, const char* key) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}
}  // namespace

models::VlmConfig vlm_config_from_llava(const json& j, const std::string& source) {
  KESTREL_CHECK(j.is_object(), kComp, "'", source, "' is not a JSON object");
  const json* type = field(j, "model_type");
  KESTREL_CHECK(type && type->is_string() && *type == "llava", kComp, "'", source, "': field 'model_type' is ",
                type ? type->dump() : std::string("missing"), "; a LLaVA folder has \"llava\"");
  const json* vc = field(j, "vision_config");
  const json* tc = field(j, "text_config");
  KESTREL_CHECK(vc && vc->is_object(), kComp, "'", source, "': field 'vision_config' is missing");
  KESTREL_CHECK(tc && tc->is_object(), kComp, "'", source, "': field 'text_config' is missing");
  models::VlmConfig m;
  m.vision_config = models::VisionConfig::from_json(*vc, source + " (vision_config)");
  m.text_config = models::TextConfig::from_json(*tc, source + " (text_config)");
  m.pixel_shuffle_factor = 1;
  m.projector_hidden_size = m.text_config.hidden_size;

  const json* tok = field(j, "image_token_id");
  if (!tok) tok = field(j, "image_token_index");
  KESTREL_CHECK(tok && tok->is_number_integer(), kComp, "'", source,
                "': field 'image_token_id' (or 'image_token_index') must be an integer");
  m.image_token_id = tok->get<int64_t>();

  m.projector_hidden_act = "gelu";  // LlavaConfig's default
  if (const json* a = field(j, "projector_hidden_act")) {
    KESTREL_CHECK(a->is_string(), kComp, "'", source, "': field 'projector_hidden_act' must be a string");
    m.projector_hidden_act = a->get<std::string>();
  }
  m.vision_feature_layer = -2;  // LlavaConfig's default
  if (const json* f = field(j, "vision_feature_layer")) {
    KESTREL_CHECK(f->is_number_integer(), kComp, "'", source, "': field 'vision_feature_layer' is ", f->dump(),
                  "; Kestrel's VLM takes the features of one layer (an integer), not a list of layers");
    m.vision_feature_layer = f->get<int64_t>();
  }
  std::string strategy = "default";
  if (const json* s = field(j, "vision_feature_select_strategy")) strategy = s->is_string() ? s->get<std::string>() : "";
  KESTREL_CHECK(strategy == "full", kComp, "'", source, "': field 'vision_feature_select_strategy' is '", strategy,
                "' (LlavaConfig's default is 'default', which drops each image's first patch as a CLS token); "
                "Kestrel's VLM feeds every patch to the projector: only 'full' is supported");
  if (const json* b = field(j, "multimodal_projector_bias"))
    KESTREL_CHECK(b->is_boolean() && b->get<bool>(), kComp, "'", source, "': field 'multimodal_projector_bias' is ",
                  b->dump(), "; Kestrel's projector has biases (only true is supported)");
  if (const json* t = field(j, "tie_word_embeddings"))
    KESTREL_CHECK(t->is_boolean() && t->get<bool>() == m.text_config.tie_word_embeddings, kComp, "'", source,
                  "': field 'tie_word_embeddings' (", t->dump(), ") disagrees with text_config.tie_word_embeddings (",
                  m.text_config.tie_word_embeddings, ")");
  m.validate(source);
  return m;
}

std::string vlm_name_from_llava(const std::string& llava_name, bool tied) {
  std::string s = llava_name;
  if (s == "lm_head.weight" || s == "language_model.lm_head.weight") return tied ? "" : "language_model.lm_head.weight";
  for (const char* top : {"vision_tower.", "multi_modal_projector.", "language_model."})
    if (s.starts_with(std::string("model.") + top)) {
      s = s.substr(6);
      break;
    }
  if (s.starts_with("vision_tower.")) {
    std::string rest = s.substr(13);
    return "vision_tower." + (rest.starts_with("vision_model.") ? rest : "vision_model." + rest);
  }
  if (s.starts_with("multi_modal_projector.")) return s;
  if (s.starts_with("language_model.")) {
    std::string rest = s.substr(15);
    return rest.starts_with("model.") ? s : "language_model.model." + rest;
  }
  throw make_error(kComp, "tensor '", llava_name, "' belongs to no part of a LLaVA model Kestrel knows "
                   "(vision_tower, multi_modal_projector, language_model, lm_head)");
}

LlavaFolder load_llava_folder(const std::string& dir, DType dtype, Device device) {
  const std::string cfg_path = dir + "/config.json";
  const models::VlmConfig mc = vlm_config_from_llava(models::read_json_file(cfg_path, kComp), cfg_path);
  LlavaFolder f;
  f.vlm = std::make_unique<models::Vlm>(mc, dtype, device);
  const models::SafetensorsReader reader = models::SafetensorsReader::open(dir);
  models::ParameterList renamed;
  std::set<std::string> loaded;
  for (const std::string& name : reader.names()) {
    const std::string k = vlm_name_from_llava(name, mc.text_config.tie_word_embeddings);
    if (k.empty()) continue;  // a tied head's copy
    Tensor* t = f.vlm->parameters().find(k);
    if (t == nullptr && k.starts_with("vision_tower.vision_model.head.")) {
      f.unused.push_back(name);  // SigLIP's pooling head: LLaVA's features never pass through it
      continue;
    }
    KESTREL_CHECK(t != nullptr, kComp, "'", dir, "': tensor '", name, "' (Kestrel's name '", k,
                  "') matches no parameter of the VLM its config.json describes");
    KESTREL_CHECK(loaded.insert(k).second, kComp, "'", dir, "': two tensors load parameter '", k, "' (the second is '",
                  name, "')");
    renamed.add(name, t);
    f.names.emplace_back(name, k);
  }
  models::load_safetensors(renamed, dir, /*strict=*/true);
  for (const auto& [k, t] : f.vlm->parameters().items())
    KESTREL_CHECK(loaded.count(k), kComp, "'", dir, "' has no tensor for parameter '", k, "'");
  return f;
}

models::VlmBatch vlm_batch_from_llava_inputs(const Tensor& input_ids, const Tensor& labels, const Tensor& pixel_values,
                                             int64_t image_token_id, DType dtype, Device device) {
  KESTREL_CHECK(input_ids.defined() && input_ids.dim() == 2 && input_ids.dtype() == DType::I64, kComp,
                "input_ids must be [B, T] i64, got ", input_ids.defined() ? input_ids.str() : "none");
  const int64_t B = input_ids.shape()[0], T = input_ids.shape()[1];
  KESTREL_CHECK(B > 0 && T > 0, kComp, "input_ids is empty: ", input_ids.str());
  const std::vector<int64_t> ids = input_ids.to_int_vector();
  std::vector<int64_t> next(ids.size(), -100), slots;
  if (labels.defined()) {
    KESTREL_CHECK(labels.shape() == input_ids.shape() && labels.dtype() == DType::I64, kComp,
                  "labels must be [B, T] i64 like input_ids ", input_ids.str(), ", got ", labels.str());
    const std::vector<int64_t> hf = labels.to_int_vector();
    // transformers shifts inside the model: position t is scored on labels[t + 1] of its own row.
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t + 1 < T; ++t) next[b * T + t] = hf[b * T + t + 1];
  }
  for (int64_t i = 0; i < B * T; ++i)
    if (ids[i] == image_token_id) slots.push_back(i);
  models::VlmBatch batch;
  batch.input_ids = Tensor::from_vector(ids, {B * T}, DType::I64, device);
  batch.labels = Tensor::from_vector(next, {B * T}, DType::I64, device);
  batch.image_positions = Tensor::from_vector(slots, {static_cast<int64_t>(slots.size())}, DType::I64, device);
  if (pixel_values.defined()) batch.pixel_values = pixel_values.to(dtype).to(device);
  batch.layout = models::PackedBatch::from_lengths(std::vector<int64_t>(static_cast<size_t>(B), T), device);
  return batch;
}

}  // namespace kestrel::train
