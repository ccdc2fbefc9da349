// VLM export to one model folder, Kestrel's or LLaVA's layout (kestrel/train/vlm_export.h).
#include "kestrel/train/vlm_export.h"

#include <filesystem>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/models/config.h"
#include "kestrel/models/parameters.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/log.h"
#include "vlm_init.h"

namespace kestrel::train {
namespace fs = std::filesystem;
using nlohmann::json;

std::string llava_export_problems(const models::VlmConfig& c) {
  std::string why;
  auto add = [&](const std::string& s) { why += (why.empty() ? "" : "\n") + s; };
  if (c.pixel_shuffle_factor != 1)
    add("pixel_shuffle_factor is " + std::to_string(c.pixel_shuffle_factor) +
        "; LLaVA feeds every patch to the projector (set it to 1)");
  if (c.projector_hidden_size != c.text_config.hidden_size)
    add("projector_hidden_size is " + std::to_string(c.projector_hidden_size) +
        "; LLaVA's projector is vision width -> text width -> text width (set it to text_config.hidden_size = " +
        std::to_string(c.text_config.hidden_size) + ")");
  if (!c.vision_feature_layer)
    add("vision_feature_layer is not set: Kestrel then projects the tower's post_layernorm output, which LLaVA "
        "never does (set it, e.g. -1 for the last block's output or -2 as LLaVA-1.5)");
  const std::string& t = c.text_config.model_type;
  if (t != "llama" && t != "mistral" && t != "qwen2" && t != "qwen3")
    add("text_config.model_type '" + t + "' is not one LLaVA's AutoModel text configs Kestrel writes");
  return why;
}

json llava_config_json(const models::VlmConfig& c) {
  const std::string why = llava_export_problems(c);
  KESTREL_CHECK(why.empty(), "export", "this VLM does not compute what LlavaForConditionalGeneration computes, so "
                "the LLaVA export is refused:\n", why);
  json vision = c.vision_config.to_json();
  vision["vision_use_head"] = false;  // SiglipVisionModel's pooling head: not part of the features
  json text = c.text_config.to_json();
  json j = {{"architectures", json::array({"LlavaForConditionalGeneration"})},
            {"model_type", "llava"},
            {"vision_config", vision},
            {"text_config", text},
            {"image_token_id", c.image_token_id},
            {"image_token_index", c.image_token_id},
            {"projector_hidden_act", c.projector_hidden_act},
            {"vision_feature_layer", *c.vision_feature_layer},
            {"vision_feature_select_strategy", "full"},
            {"multimodal_projector_bias", true},
            {"image_seq_length", c.image_tokens_per_image()},
            {"tie_word_embeddings", c.text_config.tie_word_embeddings}};
  if (!c.text_config.torch_dtype.empty()) j["torch_dtype"] = c.text_config.torch_dtype;
  return j;
}

namespace {
// Kestrel's name -> transformers' LlavaForConditionalGeneration name (its _checkpoint_conversion_mapping
// maps the older layout the other way, so both load; this writes the newer one).
std::string llava_name(const std::string& n) {
  if (n.starts_with("vision_tower.") || n.starts_with("multi_modal_projector.")) return "model." + n;
  if (n.starts_with("language_model.model.")) return "model.language_model." + n.substr(21);
  if (n == "language_model.lm_head.weight") return "lm_head.weight";
  throw make_error("export", "no LLaVA name for parameter '", n, "'");
}
}  // namespace

void export_vlm(models::Vlm& vlm, const std::string& dir, const std::string& format) {
  KESTREL_CHECK(format == "kestrel" || format == "llava", "export", "--format must be \"kestrel\" or \"llava\", got \"",
                format, "\"");
  const json cfg = format == "llava" ? llava_config_json(vlm.config()) : vlm.config().to_json();
  fs::create_directories(dir);
  if (format == "kestrel") {
    models::save_safetensors(vlm.parameters(), dir);
  } else {
    models::ParameterList renamed;
    for (auto& [name, t] : vlm.parameters().items()) renamed.add(llava_name(name), t);
    Tensor head;  // tied: lm_head.weight written as a copy of the embedding (transformers may tie it back)
    if (vlm.config().text_config.tie_word_embeddings) {
      head = vlm.parameters().get("language_model.model.embed_tokens.weight");
      renamed.add("lm_head.weight", &head);
    }
    models::save_safetensors(renamed, dir);
  }
  models::write_json_file((fs::path(dir) / "config.json").string(), cfg, "export");
}

std::unique_ptr<models::Vlm> build_vlm_for_export(const json& cfg, const std::string& weights) {
  KESTREL_CHECK(cfg["model"]["type"] == "vlm", "export", "model.type must be \"vlm\" to export a VLM");
  const models::VlmConfig mc = resolve_vlm_config(cfg);
  auto vlm = std::make_unique<models::Vlm>(mc, DType::F32, Device::cpu(), cfg["train"]["seed"].get<uint64_t>());
  load_pretrained_towers(*vlm, cfg, [](const std::string& line) { log_message(LogLevel::Info, "export", line); });
  if (const std::string init = cfg["model"]["init_from"]; !init.empty()) models::load_safetensors(vlm->parameters(), init);
  if (!weights.empty()) {
    // A checkpoint step folder holds model.safetensors beside the optimizer's file.
    const fs::path model = fs::path(weights) / "model.safetensors";
    models::load_safetensors(vlm->parameters(), fs::exists(model) ? model.string() : weights);
  }
  return vlm;
}

Tensor vlm_logits(models::Vlm& vlm, const Tensor& input_ids, const Tensor& pixel_values) {
  autograd::NoGradGuard no_grad;
  KESTREL_CHECK(input_ids.dim() == 1 && input_ids.dtype() == DType::I64, "export", "input_ids must be [T] i64, got ",
                input_ids.str());
  const Tensor ids = input_ids.to(Device::cpu()).contiguous();
  std::vector<int64_t> slots;
  for (int64_t i = 0; i < ids.numel(); ++i)
    if (ids.data<int64_t>()[i] == vlm.config().image_token_id) slots.push_back(i);
  models::VlmBatch b;
  b.input_ids = input_ids;
  b.pixel_values = pixel_values;
  b.image_positions = Tensor::from_vector(slots, {static_cast<int64_t>(slots.size())}, DType::I64, Device::cpu());
  b.layout = models::PackedBatch::from_lengths({input_ids.numel()}, Device::cpu());
  const Tensor h = vlm.hidden(b, autograd::RecomputePolicy::None);
  return vlm.decoder().logits(h).to(DType::F32);
}

}  // namespace kestrel::train
