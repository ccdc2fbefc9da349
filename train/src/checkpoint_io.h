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
// `data_position`: the index of the next micro-batch the model consumes (not one a prefetcher may
// already have prepared), stored in trainer_state.json.
std::string save_checkpoint(const std::string& out_dir, int64_t step, uint64_t data_position,
                            const models::ParameterList& params, const AdamW& optim, const nlohmann::json& config,
                            int64_t keep);
struct CheckpointState {
  int64_t step = 0;
  int64_t data_position = -1;  // -1: a checkpoint written before data positions were stored
};
// Loads model and optimizer state; returns the step and data position it was taken at.
CheckpointState load_checkpoint(const std::string& dir, const models::ParameterList& params, AdamW& optim);
// The newest complete checkpoint folder under out_dir/checkpoints, or "".
std::string latest_checkpoint(const std::string& out_dir);

}  // namespace kestrel::train
