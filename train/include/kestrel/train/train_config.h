// The trainer's run configuration: a JSON document checked against a schema of defaults.
// Unknown keys are errors that list the valid keys of their section; `--set a.b=value` overrides
// (value parsed as JSON, else taken as a string). The model's own config ("model.config", HF
// config.json fields) is validated by the model config parsers, not here.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kestrel::train {

// The defaults; every accepted key appears here.
nlohmann::json default_train_config();

// Merges `user` over the defaults, checking keys and value types; `source` names the file.
nlohmann::json resolve_train_config(const nlohmann::json& user, const std::string& source);

// Applies "a.b.c=value" to `config` (the key must exist in the schema unless under model.config).
void apply_override(nlohmann::json& config, const std::string& assignment);

// Per-device settings: "on_cpu" / "on_cuda" hold dotted overrides ({"train.steps": 500}) applied
// when the run's device is the CPU / a GPU (a CPU schedule for the quickstart, say). Applies the
// device's entries, empties both objects, then re-applies `sets` (the command line's --set, which
// win). Returns the assignments applied. kestrel-train calls it; the Trainer does not (it logs
// entries left in its config), so the trainer and the memory planner see the same run.
std::vector<std::string> apply_device_overrides(nlohmann::json& config, bool on_cuda,
                                                const std::vector<std::string>& sets = {});

}  // namespace kestrel::train
