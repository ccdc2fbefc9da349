// Trainable patterns, weight-decay groups and the vision tower's lr multiplier (param_groups.h).
#include "param_groups.h"

#include <algorithm>

#include "kestrel/runtime/error.h"

namespace kestrel::train {

bool glob_match(std::string_view pattern, std::string_view name) {
  // Iterative matcher with one backtrack point for the last '*' (linear in practice).
  size_t p = 0, n = 0, star = std::string_view::npos, mark = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p, ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      mark = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

ParameterGroupRules ParameterGroupRules::from_config(const nlohmann::json& cfg) {
  ParameterGroupRules r;
  const nlohmann::json& tr = cfg["train"];
  if (tr.contains("trainable")) {
    const nlohmann::json& t = tr["trainable"];
    KESTREL_CHECK(t.is_array() && !t.empty(), "train",
                  "train.trainable must be a non-empty list of glob patterns over parameter names (e.g. "
                  "[\"multi_modal_projector.*\"]; [\"*\"] trains everything), got ", t.dump());
    r.trainable.clear();
    for (const auto& p : t) {
      KESTREL_CHECK(p.is_string() && !p.get<std::string>().empty(), "train",
                    "train.trainable entries must be non-empty strings (glob patterns), got ", p.dump());
      r.trainable.push_back(p.get<std::string>());
    }
  }
  const std::string decay = tr.value("weight_decay_params", std::string("matrices"));
  KESTREL_CHECK(decay == "matrices" || decay == "all", "train",
                "train.weight_decay_params must be \"matrices\" (decay tensors of >= 2 dimensions only; norms and "
                "biases do not decay) or \"all\", got \"", decay, "\"");
  r.decay_all = decay == "all";
  r.vision_lr_scale = tr.value("vision_lr_scale", 1.0);
  KESTREL_CHECK(r.vision_lr_scale >= 0 && r.vision_lr_scale <= 1e3, "train",
                "train.vision_lr_scale must lie in [0, 1000] (a multiple of train.lr), got ", r.vision_lr_scale);
  return r;
}

bool ParameterGroupRules::trains_everything() const {
  return std::find(trainable.begin(), trainable.end(), "*") != trainable.end();
}

bool ParameterGroupRules::is_trainable(const std::string& name) const {
  return std::any_of(trainable.begin(), trainable.end(), [&](const std::string& p) { return glob_match(p, name); });
}

ParameterGroup ParameterGroupRules::group(const std::string& name, int64_t dim, double weight_decay) const {
  ParameterGroup g;
  g.weight_decay = decay_all || dim >= 2 ? weight_decay : 0.0;
  g.lr_scale = name.starts_with("vision_tower.") ? vision_lr_scale : 1.0;
  return g;
}

void ParameterGroupRules::check_names(const std::vector<std::string>& names) const {
  bool any = false;
  for (const std::string& p : trainable) {
    const bool hit = std::any_of(names.begin(), names.end(), [&](const std::string& n) { return glob_match(p, n); });
    KESTREL_CHECK(hit, "train", "train.trainable pattern \"", p, "\" matches no parameter of the model (",
                  names.size(), " parameters, e.g. '", names.empty() ? std::string() : names.front(), "', '",
                  names.empty() ? std::string() : names.back(),
                  "'); patterns are globs over the whole Hugging Face name: '*' matches any run of characters, "
                  "dots included");
    any = true;
  }
  KESTREL_CHECK(any, "train", "train.trainable leaves nothing to train");
  // A multiplier for a tower the model does not have would change nothing: say so.
  const bool tower = std::any_of(names.begin(), names.end(), [](const std::string& n) { return n.starts_with("vision_tower."); });
  KESTREL_CHECK(vision_lr_scale == 1.0 || tower, "train", "train.vision_lr_scale is ", vision_lr_scale,
                " but the model has no vision tower (no 'vision_tower.*' parameter), so it would change nothing; "
                "leave it at 1 (it applies to model.type \"vlm\")");
}

int64_t apply_trainable(const models::ParameterList& params, const ParameterGroupRules& rules) {
  std::vector<std::string> names;
  for (auto& [name, p] : params.items()) names.push_back(name);
  rules.check_names(names);
  int64_t n = 0;
  for (auto& [name, p] : params.items()) {
    const bool on = rules.is_trainable(name);
    if (p->requires_grad() != on) p->set_requires_grad(on);
    if (on) n += p->numel();
  }
  return n;
}

}  // namespace kestrel::train

namespace kestrel::train {

std::vector<std::pair<std::string, int64_t>> model_parameter_sizes(const models::VlmConfig& mc, bool vlm) {
  std::vector<std::pair<std::string, int64_t>> out;
  auto add = [&](const std::string& name, int64_t n) { out.emplace_back(name, n); };
  const std::string tp = vlm ? "language_model." : "";
  if (vlm) {  // models/src/vision.cpp, then the projector of models/src/vlm.cpp
    const auto& v = mc.vision_config;
    const int64_t E = v.hidden_size, I = v.intermediate_size, P = v.patch_size;
    const std::string vp = "vision_tower.vision_model.";
    add(vp + "embeddings.patch_embedding.weight", E * v.num_channels * P * P);
    add(vp + "embeddings.patch_embedding.bias", E);
    add(vp + "embeddings.position_embedding.weight", v.num_patches() * E);
    for (int64_t l = 0; l < v.num_hidden_layers; ++l) {
      const std::string p = vp + "encoder.layers." + std::to_string(l) + ".";
      add(p + "layer_norm1.weight", E);
      add(p + "layer_norm1.bias", E);
      for (const char* m : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
        add(p + "self_attn." + m + ".weight", E * E);
        add(p + "self_attn." + m + ".bias", E);
      }
      add(p + "layer_norm2.weight", E);
      add(p + "layer_norm2.bias", E);
      add(p + "mlp.fc1.weight", I * E);
      add(p + "mlp.fc1.bias", I);
      add(p + "mlp.fc2.weight", E * I);
      add(p + "mlp.fc2.bias", E);
    }
    add(vp + "post_layernorm.weight", E);
    add(vp + "post_layernorm.bias", E);
    const int64_t s = mc.pixel_shuffle_factor, C = mc.text_config.hidden_size;
    const int64_t Hp = mc.projector_hidden_size > 0 ? mc.projector_hidden_size : C;
    add("multi_modal_projector.linear_1.weight", Hp * E * s * s);
    add("multi_modal_projector.linear_1.bias", Hp);
    add("multi_modal_projector.linear_2.weight", C * Hp);
    add("multi_modal_projector.linear_2.bias", C);
  }
  const auto& t = mc.text_config;  // models/src/decoder.cpp
  const int64_t C = t.hidden_size, V = t.vocab_size, I = t.intermediate_size, D = t.head_dim;
  const int64_t Hq = t.num_attention_heads, Hkv = t.num_key_value_heads;
  add(tp + "model.embed_tokens.weight", V * C);
  for (int64_t l = 0; l < t.num_hidden_layers; ++l) {
    const std::string p = tp + "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", C);
    add(p + "self_attn.q_proj.weight", Hq * D * C);
    if (t.qkv_bias()) add(p + "self_attn.q_proj.bias", Hq * D);
    add(p + "self_attn.k_proj.weight", Hkv * D * C);
    if (t.qkv_bias()) add(p + "self_attn.k_proj.bias", Hkv * D);
    add(p + "self_attn.v_proj.weight", Hkv * D * C);
    if (t.qkv_bias()) add(p + "self_attn.v_proj.bias", Hkv * D);
    add(p + "self_attn.o_proj.weight", C * Hq * D);
    if (t.o_proj_bias()) add(p + "self_attn.o_proj.bias", C);
    if (t.qk_norm()) {
      add(p + "self_attn.q_norm.weight", D);
      add(p + "self_attn.k_norm.weight", D);
    }
    add(p + "post_attention_layernorm.weight", C);
    add(p + "mlp.gate_proj.weight", I * C);
    add(p + "mlp.up_proj.weight", I * C);
    add(p + "mlp.down_proj.weight", C * I);
  }
  add(tp + "model.norm.weight", C);
  if (!t.tie_word_embeddings) add(tp + "lm_head.weight", V * C);
  return out;
}

}  // namespace kestrel::train
