// Private: trainer checkpoints. A checkpoint is a folder out_dir/checkpoints/step_NNNNNNNN with
// model.safetensors (HF names), optimizer.safetensors and trainer_state.json. It is written into a
// hidden temporary folder and renamed into place, so a folder under its final name is complete.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/models/parameters.h"
#include "kestrel/train/optimizer.h"

namespace kestrel::train {

// Writes the checkpoint for `step`, then deletes the oldest complete ones beyond `keep` (0 = keep all).
std::string save_checkpoint(const std::string& out_dir, int64_t step, const models::ParameterList& params,
                            const AdamW& optim, const nlohmann::json& config, int64_t keep);
// Loads model and optimizer state; returns the step it was taken at.
int64_t load_checkpoint(const std::string& dir, const models::ParameterList& params, AdamW& optim);
// The newest complete checkpoint folder under out_dir/checkpoints, or "".
std::string latest_checkpoint(const std::string& out_dir);

}  // namespace kestrel::train
