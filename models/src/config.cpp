// HF config.json parsing, validation and writing for TextConfig, VisionConfig and VlmConfig.
//
// Defaults are those of transformers' LlamaConfig, MistralConfig, Qwen2Config and SiglipVisionConfig. One
// deliberate deviation: Qwen2Config's signature defaults num_key_value_heads to 32 when the key is
// missing; we default it to num_attention_heads (the documented "backward compatibility" meaning,
// and what LlamaConfig does), since 32 is invalid for most head counts. Real qwen2 config.json
// files always carry the key, and to_json() always writes it.
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kestrel/models/config.h"
#include "kestrel/models/file_io.h"
#include "kestrel/models/json_text.h"
#include "kestrel/runtime/error.h"
#include "src/attention_window.h"

namespace kestrel::models {

namespace {
constexpr const char* kComp = "config";
constexpr const char* kTextModels = "llama, mistral, qwen2, qwen3";
using nlohmann::json;

// Where we are: the file (or "<json>") and the nesting prefix ("text_config.").
struct Ctx {
  const std::string& source;
  std::string prefix;
  std::string field(const char* key) const { return prefix + key; }
};

[[noreturn]] void type_error(const Ctx& c, const char* key, const char* want, const json& v) {
  throw make_error(kComp, "'", c.source, "': field '", c.field(key), "' must be ", want, ", got ", v.type_name(),
                   " ", v.dump());
}

const json* lookup(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

void read_int(const json& j, const Ctx& c, const char* key, int64_t& out) {
  const json* v = lookup(j, key);
  if (v == nullptr) return;
  if (!v->is_number_integer()) type_error(c, key, "an integer", *v);
  out = v->get<int64_t>();
}

void read_double(const json& j, const Ctx& c, const char* key, double& out) {
  const json* v = lookup(j, key);
  if (v == nullptr) return;
  if (!v->is_number()) type_error(c, key, "a number", *v);
  out = v->get<double>();
}

void read_bool(const json& j, const Ctx& c, const char* key, bool& out) {
  const json* v = lookup(j, key);
  if (v == nullptr) return;
  if (!v->is_boolean()) type_error(c, key, "true or false", *v);
  out = v->get<bool>();
}

void read_string(const json& j, const Ctx& c, const char* key, std::string& out) {
  const json* v = lookup(j, key);
  if (v == nullptr) return;
  if (!v->is_string()) type_error(c, key, "a string", *v);
  out = v->get<std::string>();
}

void read_opt_int(const json& j, const Ctx& c, const char* key, std::optional<int64_t>& out) {
  const json* v = lookup(j, key);
  if (v == nullptr) return;
  if (!v->is_number_integer()) type_error(c, key, "an integer or null", *v);
  out = v->get<int64_t>();
}

void read_int_list(const json& j, const Ctx& c, const char* key, std::vector<int64_t>& out) {
  const json* v = lookup(j, key);
  if (v == nullptr) return;
  out.clear();
  if (v->is_number_integer()) {
    out.push_back(v->get<int64_t>());
    return;
  }
  if (!v->is_array()) type_error(c, key, "an integer or a list of integers", *v);
  for (const json& e : *v) {
    if (!e.is_number_integer()) type_error(c, key, "an integer or a list of integers", *v);
    out.push_back(e.get<int64_t>());
  }
}

constexpr int64_t kMaxHeadDim = 65536;

void check_positive(const Ctx& c, const char* key, int64_t v) {
  KESTREL_CHECK(v > 0, kComp, "'", c.source, "': field '", c.field(key), "' must be positive, got ", v);
}
void check_positive(const Ctx& c, const char* key, double v) {
  KESTREL_CHECK(v > 0.0, kComp, "'", c.source, "': field '", c.field(key), "' must be positive, got ", v);
}

void check_object(const json& j, const Ctx& c) {
  KESTREL_CHECK(j.is_object(), kComp, "'", c.source, "': ", c.prefix.empty() ? std::string("config") : c.prefix,
                " must be a JSON object, got ", j.type_name());
}

std::string model_type_of(const json& j, const Ctx& c, const char* fallback) {
  std::string t = fallback;
  read_string(j, c, "model_type", t);
  KESTREL_CHECK(!t.empty(), kComp, "'", c.source, "': field '", c.field("model_type"), "' is missing");
  return t;
}

void read_opt_double(const json& j, const Ctx& c, const char* key, std::optional<double>& out) {
  const json* v = lookup(j, key);
  if (v == nullptr) return;
  if (!v->is_number()) type_error(c, key, "a number or null", *v);
  out = v->get<double>();
}

[[noreturn]] void refuse(const Ctx& c, const char* key, const json& v, const std::string& why) {
  throw make_error(kComp, "'", c.source, "': field '", c.field(key), "' = ", v.dump(), " is not supported: ", why);
}

// ---- text ----

// Keys parse_text reads and to_json writes; every other key (top-level original_max_position_embeddings
// and partial_rotary_factor included) is kept verbatim in extra_json. "architectures" is rewritten by
// to_json, "dtype" is the transformers 5 spelling of torch_dtype.
bool is_text_key(const std::string& k) {
  static const char* const keys[] = {
      "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
      "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
      "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias",
      "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "use_sliding_window",
      "sliding_window", "max_window_layers", "layer_types"};
  for (const char* key : keys)
    if (k == key) return true;
  return false;
}

// The audit: fields that change the maths of a text model and that Kestrel does not compute are
// refused here, by name (a config that merely carries them with their neutral value passes).
// Sliding windows are parsed and checked in attention_window.cpp; LlamaModel has none, so a llama
// config whose layer_types asks for other than full attention is refused.
void audit_text_fields(const json& j, const Ctx& c, const std::string& type) {
  auto truthy = [](const json* v) { return v != nullptr && !(v->is_boolean() && !v->get<bool>()); };
  if (const json* lt = lookup(j, "layer_types"); lt && type == "llama") {
    if (!lt->is_array()) type_error(c, "layer_types", "a list of strings", *lt);
    for (const json& e : *lt)
      if (!e.is_string() || e.get<std::string>() != "full_attention")
        refuse(c, "layer_types", *lt,
               "llama has only \"full_attention\" layers (sliding windows: model_type mistral, qwen2 or qwen3)");
  }
  if (const json* v = lookup(j, "partial_rotary_factor")) {
    if (!v->is_number()) type_error(c, "partial_rotary_factor", "a number", *v);
    if (v->get<double>() != 1.0)
      refuse(c, "partial_rotary_factor", *v, "llama/qwen2/qwen3 rotate the whole head (partial rotary is not implemented)");
  }
  if (type == "llama") {
    if (const json* v = lookup(j, "mlp_bias")) {
      if (!v->is_boolean()) type_error(c, "mlp_bias", "true or false", *v);
      if (v->get<bool>()) refuse(c, "mlp_bias", *v, "MLP biases are not implemented");
    }
  }
  for (const char* key : {"qk_norm", "use_qk_norm"}) {
    const json* v = lookup(j, key);
    if (type != "qwen3" && truthy(v)) refuse(c, key, *v, "q/k normalisation is not part of " + type + " (use model_type qwen3)");
  }
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping", "logit_softcapping"}) {
    if (const json* v = lookup(j, key)) refuse(c, key, *v, "logit soft-capping is not implemented");
  }
  if (const json* v = lookup(j, "quantization_config"))
    refuse(c, "quantization_config", *v, "quantized checkpoints are not implemented (load a bf16/f32 export)");
  if (const json* v = lookup(j, "attention_dropout")) {
    if (!v->is_number()) type_error(c, "attention_dropout", "a number", *v);
    if (v->get<double>() != 0.0) refuse(c, "attention_dropout", *v, "attention dropout is not implemented");
  }
}

// rope_theta, rope_scaling / rope_parameters as transformers 5 standardises them: the scaling dict is
// rope_scaling when non-empty, else rope_parameters; its rope_theta wins over the top-level one; the
// type is rope_type, else the legacy "type", else "default"; original_max_position_embeddings is the
// top-level key, else the dict's, else max_position_embeddings. Needs max_position_embeddings read.
void parse_rope(const json& j, const Ctx& c, TextConfig& t) {
  read_double(j, c, "rope_theta", t.rope_theta);
  const json* rs = lookup(j, "rope_scaling");
  const json* rp = lookup(j, "rope_parameters");
  if (rs && !rs->is_object()) type_error(c, "rope_scaling", "an object or null", *rs);
  if (rp && !rp->is_object()) type_error(c, "rope_parameters", "an object or null", *rp);
  const bool use_scaling = rs && !rs->empty();
  const json* d = use_scaling ? rs : rp;
  RopeScaling s;
  s.original_max_position_embeddings = t.max_position_embeddings;
  read_int(j, c, "original_max_position_embeddings", s.original_max_position_embeddings);
  if (d == nullptr) {
    t.rope_scaling = s;
    return;
  }
  const Ctx in{c.source, c.prefix + (use_scaling ? "rope_scaling." : "rope_parameters.")};
  read_double(*d, in, "rope_theta", t.rope_theta);
  read_string(*d, in, "type", s.rope_type);
  read_string(*d, in, "rope_type", s.rope_type);
  if (const json* v = lookup(*d, "partial_rotary_factor")) {
    if (!v->is_number()) type_error(in, "partial_rotary_factor", "a number", *v);
    if (v->get<double>() != 1.0)
      refuse(in, "partial_rotary_factor", *v, "llama/qwen2/qwen3 rotate the whole head (partial rotary is not implemented)");
  }
  read_opt_double(*d, in, "factor", s.factor);
  if (lookup(j, "original_max_position_embeddings") == nullptr)
    read_int(*d, in, "original_max_position_embeddings", s.original_max_position_embeddings);
  read_double(*d, in, "low_freq_factor", s.low_freq_factor);
  read_double(*d, in, "high_freq_factor", s.high_freq_factor);
  read_opt_double(*d, in, "attention_factor", s.attention_factor);
  read_opt_double(*d, in, "beta_fast", s.beta_fast);
  read_opt_double(*d, in, "beta_slow", s.beta_slow);
  read_opt_double(*d, in, "mscale", s.mscale);
  read_opt_double(*d, in, "mscale_all_dim", s.mscale_all_dim);
  read_bool(*d, in, "truncate", s.truncate);
  const std::string& rt = s.rope_type;
  KESTREL_CHECK(rt == "default" || rt == "linear" || rt == "dynamic" || rt == "llama3" || rt == "yarn", kComp, "'",
                c.source, "': field '", in.field("rope_type"), "' is '", rt, "'; supported: ",
                supported_rope_types());
  if (rt == "linear" || rt == "dynamic" || rt == "llama3" || rt == "yarn")
    KESTREL_CHECK(lookup(*d, "factor") != nullptr || (rt == "yarn" && d->contains("factor")), kComp, "'", c.source,
                  "': field '", in.field("factor"), "' is required for rope_type '", rt, "'");
  if (rt == "llama3")
    for (const char* key : {"low_freq_factor", "high_freq_factor"})
      KESTREL_CHECK(lookup(*d, key) != nullptr, kComp, "'", c.source, "': field '", in.field(key),
                    "' is required for rope_type 'llama3'");
  t.rope_scaling = s;
  json rest = *d;
  rest.erase("rope_theta");
  if (!(rt == "default" && (rest.empty() || (rest.size() == 1 && (rest.contains("rope_type") || rest.contains("type"))))))
    t.rope_scaling_json = rest.dump();
}

TextConfig parse_text(const json& j, const Ctx& c, const char* fallback_type) {
  check_object(j, c);
  const std::string type = model_type_of(j, c, fallback_type);
  KESTREL_CHECK(type == "llama" || type == "mistral" || type == "qwen2" || type == "qwen3", kComp, "'", c.source,
                "': field '", c.field("model_type"), "' is '", type, "'; supported text models: ", kTextModels);
  audit_text_fields(j, c, type);
  TextConfig t = TextConfig::defaults_for(type);
  read_int(j, c, "vocab_size", t.vocab_size);
  read_int(j, c, "hidden_size", t.hidden_size);
  read_int(j, c, "intermediate_size", t.intermediate_size);
  read_int(j, c, "num_hidden_layers", t.num_hidden_layers);
  read_int(j, c, "num_attention_heads", t.num_attention_heads);
  t.num_key_value_heads = type == "mistral" ? 8 : t.num_attention_heads;  // MistralConfig defaults it to 8
  read_int(j, c, "num_key_value_heads", t.num_key_value_heads);
  if (type != "qwen3")  // Qwen3Config's head_dim defaults to 128, not hidden / heads
    t.head_dim = t.num_attention_heads > 0 ? t.hidden_size / t.num_attention_heads : 0;
  read_int(j, c, "head_dim", t.head_dim);
  read_int(j, c, "max_position_embeddings", t.max_position_embeddings);
  read_double(j, c, "rms_norm_eps", t.rms_norm_eps);
  parse_rope(j, c, t);
  read_bool(j, c, "tie_word_embeddings", t.tie_word_embeddings);
  if (type == "llama" || type == "qwen3") read_bool(j, c, "attention_bias", t.attention_bias);
  if (type == "llama") read_bool(j, c, "mlp_bias", t.mlp_bias);
  read_string(j, c, "hidden_act", t.hidden_act);
  read_opt_int(j, c, "bos_token_id", t.bos_token_id);
  read_int_list(j, c, "eos_token_id", t.eos_token_ids);
  read_opt_int(j, c, "pad_token_id", t.pad_token_id);
  read_string(j, c, "torch_dtype", t.torch_dtype);
  if (t.torch_dtype.empty()) read_string(j, c, "dtype", t.torch_dtype);
  detail::parse_attention_window(j, c.source, c.prefix, t);
  // Keys this type does not read stay verbatim (qwen2/mistral attention_bias, llama's window keys, ...).
  auto unread = [&](const std::string& k) {
    if ((type == "qwen2" || type == "mistral") && k == "attention_bias") return true;
    if (type != "llama" && k == "mlp_bias") return true;
    if (type == "llama" && (k == "use_sliding_window" || k == "sliding_window" || k == "max_window_layers" ||
                            k == "layer_types"))
      return true;
    return type == "mistral" && (k == "use_sliding_window" || k == "max_window_layers");
  };
  json extra = json::object();
  for (auto it = j.begin(); it != j.end(); ++it)
    if (!is_text_key(it.key()) || unread(it.key())) extra[it.key()] = it.value();
  if (!extra.empty()) t.extra_json = extra.dump();
  return t;
}

void validate_rope(const TextConfig& t, const Ctx& c) {
  const RopeScaling& s = t.rope_scaling;
  const std::string& rt = s.rope_type;
  KESTREL_CHECK(rt == "default" || rt == "linear" || rt == "dynamic" || rt == "llama3" || rt == "yarn", kComp, "'",
                c.source, "': field '", c.field("rope_scaling.rope_type"), "' is '", rt, "'; supported: ",
                supported_rope_types());
  if (rt == "default") return;
  if (rt != "yarn" || s.factor)
    KESTREL_CHECK(s.factor && *s.factor > 0, kComp, "'", c.source, "': field '", c.field("rope_scaling.factor"),
                  "' must be a positive number for rope_type '", rt, "'");
  if (rt == "llama3" || rt == "yarn")
    KESTREL_CHECK(s.original_max_position_embeddings > 0, kComp, "'", c.source, "': field '",
                  c.field("rope_scaling.original_max_position_embeddings"), "' must be positive, got ",
                  s.original_max_position_embeddings);
  if (rt == "llama3")
    KESTREL_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor, kComp, "'", c.source,
                  "': fields '", c.field("rope_scaling.low_freq_factor"), "' and 'high_freq_factor' must satisfy 0 < "
                  "low < high, got ", s.low_freq_factor, " and ", s.high_freq_factor);
  if (rt == "dynamic")
    KESTREL_CHECK(t.head_dim > 2, kComp, "'", c.source, "': rope_type 'dynamic' needs head_dim > 2");
}

void validate_text(const TextConfig& t, const Ctx& c) {
  KESTREL_CHECK(t.model_type == "llama" || t.model_type == "mistral" || t.model_type == "qwen2" ||
                    t.model_type == "qwen3",
                kComp, "'", c.source, "': field '", c.field("model_type"), "' is '", t.model_type,
                "'; supported text models: ", kTextModels);
  check_positive(c, "vocab_size", t.vocab_size);
  check_positive(c, "hidden_size", t.hidden_size);
  check_positive(c, "intermediate_size", t.intermediate_size);
  check_positive(c, "num_hidden_layers", t.num_hidden_layers);
  check_positive(c, "num_attention_heads", t.num_attention_heads);
  check_positive(c, "num_key_value_heads", t.num_key_value_heads);
  check_positive(c, "head_dim", t.head_dim);
  check_positive(c, "max_position_embeddings", t.max_position_embeddings);
  check_positive(c, "rms_norm_eps", t.rms_norm_eps);
  check_positive(c, "rope_theta", t.rope_theta);
  // An explicit head_dim need not be hidden / heads (q_proj is [heads * head_dim, hidden] either way);
  // a derived one must divide exactly.
  KESTREL_CHECK(t.hidden_size % t.num_attention_heads == 0 || t.head_dim != t.hidden_size / t.num_attention_heads,
                kComp, "'", c.source, "': field '", c.field("num_attention_heads"), "' (", t.num_attention_heads,
                ") must divide hidden_size (", t.hidden_size, ") unless head_dim is given");
  KESTREL_CHECK(t.num_attention_heads % t.num_key_value_heads == 0, kComp, "'", c.source, "': field '",
                c.field("num_key_value_heads"), "' (", t.num_key_value_heads, ") must divide num_attention_heads (",
                t.num_attention_heads, ")");
  KESTREL_CHECK(t.head_dim % 2 == 0, kComp, "'", c.source, "': field '", c.field("head_dim"),
                "' must be even for rotary embeddings, got ", t.head_dim);
  // The rotary table holds head_dim / 2 frequencies: an impossible head size is an error here, not
  // a bad_alloc when the table is built (real models use 64 to 256).
  KESTREL_CHECK(t.head_dim <= kMaxHeadDim, kComp, "'", c.source, "': field '", c.field("head_dim"), "' is ",
                t.head_dim, ", beyond the largest head size supported (", kMaxHeadDim, ")");
  KESTREL_CHECK(t.hidden_act == "silu", kComp, "'", c.source, "': field '", c.field("hidden_act"), "' is '",
                t.hidden_act, "'; only 'silu' is supported");
  KESTREL_CHECK(t.model_type != "qwen2" || (!t.attention_bias && !t.mlp_bias), kComp, "'", c.source,
                "': attention_bias/mlp_bias are llama/qwen3 fields; qwen2 always has q/k/v bias and no o_proj bias");
  KESTREL_CHECK(!t.mlp_bias, kComp, "'", c.source, "': field '", c.field("mlp_bias"),
                "' = true is not supported: MLP biases are not implemented");
  KESTREL_CHECK(t.model_type != "mistral" || !t.attention_bias, kComp, "'", c.source,
                "': mistral has no attention biases (MistralAttention ignores attention_bias)");
  validate_rope(t, c);
  detail::validate_attention_window(t, c.source, c.prefix);
}

json rope_scaling_to_json(const RopeScaling& s) {
  json r = {{"rope_type", s.rope_type}};
  if (s.factor) r["factor"] = *s.factor;
  if (s.rope_type == "llama3" || s.rope_type == "yarn")
    r["original_max_position_embeddings"] = s.original_max_position_embeddings;
  if (s.rope_type == "llama3") {
    r["low_freq_factor"] = s.low_freq_factor;
    r["high_freq_factor"] = s.high_freq_factor;
  }
  if (s.rope_type == "yarn") {
    if (s.attention_factor) r["attention_factor"] = *s.attention_factor;
    if (s.beta_fast) r["beta_fast"] = *s.beta_fast;
    if (s.beta_slow) r["beta_slow"] = *s.beta_slow;
    if (s.mscale) r["mscale"] = *s.mscale;
    if (s.mscale_all_dim) r["mscale_all_dim"] = *s.mscale_all_dim;
    if (!s.truncate) r["truncate"] = false;
  }
  return r;
}

json text_to_json(const TextConfig& t) {
  json j = json::object();
  j["architectures"] = {t.model_type == "qwen2"     ? "Qwen2ForCausalLM"
                        : t.model_type == "qwen3"   ? "Qwen3ForCausalLM"
                        : t.model_type == "mistral" ? "MistralForCausalLM"
                                                    : "LlamaForCausalLM"};
  j["model_type"] = t.model_type;
  j["vocab_size"] = t.vocab_size;
  j["hidden_size"] = t.hidden_size;
  j["intermediate_size"] = t.intermediate_size;
  j["num_hidden_layers"] = t.num_hidden_layers;
  j["num_attention_heads"] = t.num_attention_heads;
  j["num_key_value_heads"] = t.num_key_value_heads;
  if (t.model_type != "qwen2" || t.head_dim != t.hidden_size / t.num_attention_heads) j["head_dim"] = t.head_dim;
  j["max_position_embeddings"] = t.max_position_embeddings;
  j["rms_norm_eps"] = t.rms_norm_eps;
  j["rope_theta"] = t.rope_theta;
  j["rope_scaling"] = !t.rope_scaling_json.empty() ? json::parse(t.rope_scaling_json)
                      : t.rope_scaling.is_default()  ? json(nullptr)
                                                     : rope_scaling_to_json(t.rope_scaling);
  j["tie_word_embeddings"] = t.tie_word_embeddings;
  if (t.model_type == "llama" || t.model_type == "qwen3") j["attention_bias"] = t.attention_bias;
  if (t.model_type == "llama") j["mlp_bias"] = t.mlp_bias;
  detail::attention_window_to_json(t, j);
  j["hidden_act"] = t.hidden_act;
  j["bos_token_id"] = t.bos_token_id ? json(*t.bos_token_id) : json(nullptr);
  if (t.eos_token_ids.empty()) j["eos_token_id"] = nullptr;
  else if (t.eos_token_ids.size() == 1) j["eos_token_id"] = t.eos_token_ids[0];
  else j["eos_token_id"] = t.eos_token_ids;
  if (t.pad_token_id) j["pad_token_id"] = *t.pad_token_id;
  if (!t.torch_dtype.empty()) j["torch_dtype"] = t.torch_dtype;
  if (!t.extra_json.empty()) {
    const json extra = json::parse(t.extra_json);
    for (auto it = extra.begin(); it != extra.end(); ++it)
      if (!j.contains(it.key())) j[it.key()] = it.value();
  }
  return j;
}

// ---- vision ----
VisionConfig parse_vision(const json& j, const Ctx& c) {
  check_object(j, c);
  VisionConfig v;
  const std::string type = model_type_of(j, c, "siglip_vision_model");
  KESTREL_CHECK(type == "siglip_vision_model", kComp, "'", c.source, "': field '", c.field("model_type"), "' is '",
                type, "'; supported vision models: siglip_vision_model");
  read_int(j, c, "hidden_size", v.hidden_size);
  read_int(j, c, "intermediate_size", v.intermediate_size);
  read_int(j, c, "num_hidden_layers", v.num_hidden_layers);
  read_int(j, c, "num_attention_heads", v.num_attention_heads);
  read_int(j, c, "num_channels", v.num_channels);
  read_int(j, c, "image_size", v.image_size);
  read_int(j, c, "patch_size", v.patch_size);
  read_double(j, c, "layer_norm_eps", v.layer_norm_eps);
  read_string(j, c, "hidden_act", v.hidden_act);
  read_string(j, c, "torch_dtype", v.torch_dtype);
  if (v.torch_dtype.empty()) read_string(j, c, "dtype", v.torch_dtype);
  return v;
}

void validate_vision(const VisionConfig& v, const Ctx& c) {
  check_positive(c, "hidden_size", v.hidden_size);
  check_positive(c, "intermediate_size", v.intermediate_size);
  check_positive(c, "num_hidden_layers", v.num_hidden_layers);
  check_positive(c, "num_attention_heads", v.num_attention_heads);
  check_positive(c, "num_channels", v.num_channels);
  check_positive(c, "image_size", v.image_size);
  check_positive(c, "patch_size", v.patch_size);
  check_positive(c, "layer_norm_eps", v.layer_norm_eps);
  KESTREL_CHECK(v.hidden_size % v.num_attention_heads == 0, kComp, "'", c.source, "': field '",
                c.field("num_attention_heads"), "' (", v.num_attention_heads, ") must divide hidden_size (",
                v.hidden_size, ")");
  // Not required to divide image_size: the patch conv floors (so400m-patch14-384 has 27x27 patches).
  KESTREL_CHECK(v.patch_size <= v.image_size, kComp, "'", c.source, "': field '", c.field("patch_size"), "' (",
                v.patch_size, ") must not exceed image_size (", v.image_size, ")");
  KESTREL_CHECK(v.hidden_act == "gelu_pytorch_tanh", kComp, "'", c.source, "': field '", c.field("hidden_act"),
                "' is '", v.hidden_act, "'; only 'gelu_pytorch_tanh' is supported");
}

json vision_to_json(const VisionConfig& v) {
  json j = json::object();
  j["model_type"] = v.model_type;
  j["hidden_size"] = v.hidden_size;
  j["intermediate_size"] = v.intermediate_size;
  j["num_hidden_layers"] = v.num_hidden_layers;
  j["num_attention_heads"] = v.num_attention_heads;
  j["num_channels"] = v.num_channels;
  j["image_size"] = v.image_size;
  j["patch_size"] = v.patch_size;
  j["layer_norm_eps"] = v.layer_norm_eps;
  j["hidden_act"] = v.hidden_act;
  if (!v.torch_dtype.empty()) j["torch_dtype"] = v.torch_dtype;
  return j;
}
}  // namespace

// ---- TextConfig ----

TextConfig TextConfig::defaults_for(const std::string& model_type) {
  TextConfig t;
  t.model_type = model_type;
  if (model_type == "qwen2" || model_type == "qwen3") {
    t.vocab_size = 151936;
    t.intermediate_size = 22016;
    t.max_position_embeddings = 32768;
    t.bos_token_id.reset();
    t.eos_token_ids.clear();
    t.sliding_window = 4096;
  } else if (model_type == "mistral") {
    t.intermediate_size = 14336;
    t.num_key_value_heads = 8;
    t.max_position_embeddings = 4096 * 32;
    t.bos_token_id = 1;
    t.eos_token_ids = {2};
    t.sliding_window = 4096;
  } else {
    KESTREL_CHECK(model_type == "llama", kComp, "unknown text model_type '", model_type,
                  "'; supported: ", kTextModels);
    t.bos_token_id = 1;
    t.eos_token_ids = {2};
  }
  return t;
}

TextConfig TextConfig::from_json(const nlohmann::json& j, const std::string& source) {
  Ctx c{source, ""};
  TextConfig t = parse_text(j, c, "");
  validate_text(t, c);
  return t;
}

TextConfig TextConfig::from_file(const std::string& path) { return from_json(read_json_file(path), path); }

RopeFrequencies TextConfig::rope_frequencies(int64_t seq_len) const {
  return models::rope_frequencies(rope_scaling, rope_theta, head_dim, max_position_embeddings, seq_len);
}

void TextConfig::check_sequence_length(int64_t seq_len) const {
  KESTREL_CHECK(rope_scaling.rope_type != "dynamic" || seq_len <= max_position_embeddings, "rope",
                "rope_type 'dynamic' with a sequence of ", seq_len, " tokens past max_position_embeddings (",
                max_position_embeddings, "): transformers then recomputes the frequencies from the longest sequence "
                "seen so far (a stateful inference rule, not one model), so Kestrel does not train it; keep "
                "documents within ", max_position_embeddings, " tokens or use rope_type 'linear' or 'yarn'");
}

void TextConfig::validate(const std::string& source) const { validate_text(*this, Ctx{source, ""}); }

nlohmann::json TextConfig::to_json() const { return text_to_json(*this); }

// ---- VisionConfig ----

VisionConfig VisionConfig::from_json(const nlohmann::json& j, const std::string& source) {
  Ctx c{source, ""};
  VisionConfig v = parse_vision(j, c);
  validate_vision(v, c);
  return v;
}

VisionConfig VisionConfig::from_file(const std::string& path) { return from_json(read_json_file(path), path); }

void VisionConfig::validate(const std::string& source) const { validate_vision(*this, Ctx{source, ""}); }

nlohmann::json VisionConfig::to_json() const { return vision_to_json(*this); }

// ---- VlmConfig ----

VlmConfig VlmConfig::from_json(const nlohmann::json& j, const std::string& source) {
  Ctx c{source, ""};
  check_object(j, c);
  const std::string type = model_type_of(j, c, "");
  KESTREL_CHECK(type == "kestrel_vlm", kComp, "'", source, "': field 'model_type' is '", type,
                "'; a VLM config needs 'kestrel_vlm'");
  VlmConfig m;
  const json* vc = lookup(j, "vision_config");
  const json* tc = lookup(j, "text_config");
  KESTREL_CHECK(vc != nullptr, kComp, "'", source, "': field 'vision_config' is missing");
  KESTREL_CHECK(tc != nullptr, kComp, "'", source, "': field 'text_config' is missing");
  m.vision_config = parse_vision(*vc, Ctx{source, "vision_config."});
  m.text_config = parse_text(*tc, Ctx{source, "text_config."}, "llama");
  read_int(j, c, "pixel_shuffle_factor", m.pixel_shuffle_factor);
  m.projector_hidden_size = m.text_config.hidden_size;
  read_int(j, c, "projector_hidden_size", m.projector_hidden_size);
  KESTREL_CHECK(lookup(j, "image_token_id") != nullptr, kComp, "'", source, "': field 'image_token_id' is missing");
  read_int(j, c, "image_token_id", m.image_token_id);
  read_string(j, c, "projector_hidden_act", m.projector_hidden_act);
  if (const json* f = lookup(j, "vision_feature_layer"); f != nullptr && !f->is_null()) {
    int64_t layer = 0;
    read_int(j, c, "vision_feature_layer", layer);
    m.vision_feature_layer = layer;
  }
  m.validate(source);
  return m;
}

VlmConfig VlmConfig::from_file(const std::string& path) { return from_json(read_json_file(path), path); }

void VlmConfig::validate(const std::string& source) const {
  Ctx c{source, ""};
  validate_vision(vision_config, Ctx{source, "vision_config."});
  validate_text(text_config, Ctx{source, "text_config."});
  check_positive(c, "pixel_shuffle_factor", pixel_shuffle_factor);
  check_positive(c, "projector_hidden_size", projector_hidden_size);
  KESTREL_CHECK(vision_config.patches_per_side() % pixel_shuffle_factor == 0, kComp, "'", source,
                "': field 'pixel_shuffle_factor' (", pixel_shuffle_factor, ") must divide the patch grid side (",
                vision_config.patches_per_side(), ")");
  KESTREL_CHECK(image_token_id >= 0 && image_token_id < text_config.vocab_size, kComp, "'", source,
                "': field 'image_token_id' (", image_token_id, ") must lie in [0, text_config.vocab_size = ",
                text_config.vocab_size, ")");
  KESTREL_CHECK(projector_hidden_act == "gelu_pytorch_tanh" || projector_hidden_act == "gelu", kComp, "'", source,
                "': field 'projector_hidden_act' is '", projector_hidden_act,
                "'; supported: 'gelu_pytorch_tanh', 'gelu' (erf)");
  if (vision_feature_layer) {
    const int64_t n = vision_config.num_hidden_layers;
    KESTREL_CHECK(*vision_feature_layer >= -(n + 1) && *vision_feature_layer <= n, kComp, "'", source,
                  "': field 'vision_feature_layer' (", *vision_feature_layer, ") must index the tower's ", n + 1,
                  " hidden states: [", -(n + 1), ", ", n, "]");
  }
}

nlohmann::json VlmConfig::to_json() const {
  json j = json::object();
  j["model_type"] = "kestrel_vlm";
  j["vision_config"] = vision_to_json(vision_config);
  j["text_config"] = text_to_json(text_config);
  j["pixel_shuffle_factor"] = pixel_shuffle_factor;
  j["projector_hidden_size"] = projector_hidden_size;
  j["image_token_id"] = image_token_id;
  j["projector_hidden_act"] = projector_hidden_act;
  if (vision_feature_layer) j["vision_feature_layer"] = *vision_feature_layer;
  return j;
}

// ---- files ----

nlohmann::json read_json_file(const std::string& path, const char* component) {
  auto map = MappedFile::open(path, component);
  return parse_json_text(std::string_view(reinterpret_cast<const char*>(map->data()), map->size()),
                         "'" + path + "'", component);
}

void write_json_file(const std::string& path, const nlohmann::json& j, const char* component) {
  const std::string text = j.dump(2) + "\n";
  write_file_atomic(path, std::as_bytes(std::span(text.data(), text.size())), component);
}

}  // namespace kestrel::models
