// Sliding-window attention in text configs, as transformers 5 defines it:
// - mistral (MistralConfig): sliding_window (default 4096; null = none) on every layer. MistralModel
//   ignores layer_types, so a layer_types that disagrees with that is refused (Ministral reads it).
// - qwen2 / qwen3 (Qwen2Config, Qwen3Config): the window is sliding_window (default 4096) when
//   use_sliding_window is true, else none; layer_types, when given, says which layers slide
//   ("sliding_attention") and which do not ("full_attention"); when absent, layers
//   i >= max_window_layers (default 28) slide. A sliding layer without a window is an error in
//   transformers (its mask builder raises) and here.
// - llama: no window; these keys stay in extra_json (LlamaModel ignores them), except a layer_types
//   with sliding layers, which the audit in config.cpp refuses.
// The window semantics (key j visible to query i iff i - W < j <= i) are the attention op's.
#include "src/attention_window.h"

#include "kestrel/runtime/error.h"

namespace kestrel::models {
namespace {
constexpr const char* kComp = "config";
using nlohmann::json;

bool slides(const TextConfig& t) {
  return t.model_type == "mistral" || t.model_type == "qwen2" || t.model_type == "qwen3";
}

// The window a sliding layer uses, 0 when the config has none.
int64_t window_of(const TextConfig& t) {
  if (!t.sliding_window) return 0;
  if (t.model_type == "mistral") return *t.sliding_window;
  return t.use_sliding_window ? *t.sliding_window : 0;
}

}  // namespace

int64_t TextConfig::attention_window(int64_t layer) const {
  if (!slides(*this)) return 0;
  const int64_t w = window_of(*this);
  if (model_type == "mistral") return w;
  if (!layer_types.empty())
    return layer < static_cast<int64_t>(layer_types.size()) && layer_types[layer] == "sliding_attention" ? w : 0;
  return layer >= max_window_layers ? w : 0;
}

double TextConfig::attention_training_flops(const std::vector<int64_t>& document_lengths) const {
  double flops = 0;
  for (int64_t layer = 0; layer < num_hidden_layers; ++layer) {
    const int64_t w = attention_window(layer);
    double pairs = 0;  // sum over queries i of the keys it sees: min(i + 1, w)
    for (int64_t t : document_lengths) {
      const double T = static_cast<double>(t);
      if (w <= 0 || w >= t) {
        pairs += T * (T + 1) / 2;
      } else {
        const double W = static_cast<double>(w);
        pairs += W * (W + 1) / 2 + (T - W) * W;
      }
    }
    flops += 12.0 * static_cast<double>(num_attention_heads * head_dim) * pairs;
  }
  return flops;
}

namespace detail {

void parse_attention_window(const json& j, const std::string& source, const std::string& prefix, TextConfig& t) {
  if (!slides(t)) return;
  auto bad = [&](const char* key, const char* want, const json& v) {
    throw make_error(kComp, "'", source, "': field '", prefix, key, "' must be ", want, ", got ", v.type_name(), " ",
                     v.dump());
  };
  if (auto it = j.find("sliding_window"); it != j.end()) {
    if (it->is_null()) t.sliding_window.reset();
    else if (!it->is_number_integer()) bad("sliding_window", "an integer or null", *it);
    else t.sliding_window = it->get<int64_t>();
  }
  if (t.model_type != "mistral") {
    if (auto it = j.find("use_sliding_window"); it != j.end() && !it->is_null()) {
      if (!it->is_boolean()) bad("use_sliding_window", "true or false", *it);
      t.use_sliding_window = it->get<bool>();
    }
    if (auto it = j.find("max_window_layers"); it != j.end() && !it->is_null()) {
      if (!it->is_number_integer()) bad("max_window_layers", "an integer", *it);
      t.max_window_layers = it->get<int64_t>();
    }
  }
  t.layer_types.clear();
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) bad("layer_types", "a list of strings", *it);
    for (const json& e : *it) {
      if (!e.is_string()) bad("layer_types", "a list of strings", *it);
      t.layer_types.push_back(e.get<std::string>());
    }
  }
}

void validate_attention_window(const TextConfig& t, const std::string& source, const std::string& prefix) {
  if (!slides(t)) {
    KESTREL_CHECK(!t.sliding_window && !t.use_sliding_window && t.layer_types.empty(), kComp, "'", source,
                  "': sliding-window fields are set on a '", t.model_type,
                  "' config; they belong to mistral, qwen2 and qwen3");
    return;
  }
  if (t.sliding_window)
    KESTREL_CHECK(*t.sliding_window > 0, kComp, "'", source, "': field '", prefix,
                  "sliding_window' must be positive or null, got ", *t.sliding_window);
  KESTREL_CHECK(t.max_window_layers >= 0, kComp, "'", source, "': field '", prefix,
                "max_window_layers' must be >= 0, got ", t.max_window_layers);
  if (t.layer_types.empty()) return;
  KESTREL_CHECK(static_cast<int64_t>(t.layer_types.size()) == t.num_hidden_layers, kComp, "'", source, "': field '",
                prefix, "layer_types' has ", t.layer_types.size(), " entries for ", t.num_hidden_layers, " layers");
  const int64_t w = window_of(t);
  for (size_t l = 0; l < t.layer_types.size(); ++l) {
    const std::string& lt = t.layer_types[l];
    KESTREL_CHECK(lt == "full_attention" || lt == "sliding_attention", kComp, "'", source, "': field '", prefix,
                  "layer_types' [", l, "] = '", lt,
                  "' is not supported: implemented layer types are full_attention and sliding_attention");
    if (t.model_type == "mistral")
      KESTREL_CHECK(lt == (w > 0 ? "sliding_attention" : "full_attention"), kComp, "'", source, "': field '", prefix,
                    "layer_types' [", l, "] = '", lt, "' is not supported: transformers' MistralModel ignores "
                    "layer_types and ", w > 0 ? "slides every layer" : "slides no layer (sliding_window is null)",
                    "; a config that alternates layer types is a Ministral model");
    else if (lt == "sliding_attention")
      KESTREL_CHECK(w > 0, kComp, "'", source, "': field '", prefix, "layer_types' [", l,
                    "] is 'sliding_attention' but the window is unset (", prefix,
                    t.use_sliding_window ? "sliding_window is null" : "use_sliding_window is false",
                    "); transformers refuses this too");
  }
}

void attention_window_to_json(const TextConfig& t, json& j) {
  if (!slides(t)) return;
  j["sliding_window"] = t.sliding_window ? json(*t.sliding_window) : json(nullptr);
  if (t.model_type != "mistral") {
    j["use_sliding_window"] = t.use_sliding_window;
    j["max_window_layers"] = t.max_window_layers;
  }
  if (!t.layer_types.empty()) j["layer_types"] = t.layer_types;
}

}  // namespace detail
}  // namespace kestrel::models
