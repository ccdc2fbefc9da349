// Private: the sliding-window fields of a text config.json (mistral's sliding_window, qwen2/qwen3's
// use_sliding_window + sliding_window + max_window_layers + layer_types): parsing, validation and
// writing, kept out of config.cpp. Errors are "[config] '<source>': field '<prefix><key>' ...".
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/models/config.h"

namespace kestrel::models::detail {

// Reads the fields into t (t.model_type already set, defaults from TextConfig::defaults_for).
void parse_attention_window(const nlohmann::json& j, const std::string& source, const std::string& prefix,
                            TextConfig& t);
// Refuses what transformers would not compute or what Kestrel does not implement, naming the field.
void validate_attention_window(const TextConfig& t, const std::string& source, const std::string& prefix);
// Writes the fields as transformers reads them back.
void attention_window_to_json(const TextConfig& t, nlohmann::json& j);

}  // namespace kestrel::models::detail
