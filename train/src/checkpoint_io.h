// Private: trainer checkpoints. A checkpoint is a folder out_dir/checkpoints/step_NNNNNNNN with
// model.safetensors (HF names; shards + index when large), optimizer.safetensors (absent with
// checkpoint_optimizer_state "none"), trainer_state.json (step, data position, optimizer steps and
// the run's config) and manifest.json (size and XXH64 of every other file, step, data position,
// optimizer-state form), written last. With ZeRO (distributed.zero > 0 on W ranks) the optimizer
// state is one file per rank instead, optimizer-RRRRR-of-WWWWW.safetensors, each holding the state
// of the parameters that rank owns under the same names; a loader reads whichever form is there and
// takes the names its AdamW holds, so a resume onto another world size or stage reshards.
//
// Policy:
// - Writing: the disk space the checkpoint needs is checked first (nothing is written when it does
//   not fit); files go to a hidden temporary folder that is fsync'ed and renamed into place, so a
//   folder under its final name is complete. Replacing a folder of the same step and pruning old
//   ones rename first (to hidden names) and delete second, so a kill never leaves a half-deleted
//   step folder under its final name; leftovers are cleaned (or a replaced folder restored) by
//   clean_checkpoint_leftovers at the next start.
// - Trust: a checkpoint counts only when verify_checkpoint passes: every manifest file present with
//   its size and checksum, no unlisted weight files, an index naming only files of the folder, and
//   the step and data position agreeing across the folder name, manifest and trainer_state.json.
//   `latest` is the newest checkpoint that verifies; the ones skipped are reported with the reason.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kestrel/models/parameters.h"
#include "kestrel/ops/fp8.h"
#include "kestrel/runtime/communicator.h"
#include "kestrel/train/optimizer.h"

namespace kestrel::train {

// checkpoint_optimizer_state: "full" (exact resume), "bf16" (moments and master copies rounded to
// bf16: about half the optimizer bytes, resume not bit-exact), "none" (weights + trainer state:
// resume restarts the optimizer state).
enum class OptimizerStateForm { Full, Bf16, None };
OptimizerStateForm parse_optimizer_state_form(const std::string& s);
const char* optimizer_state_form_name(OptimizerStateForm f);

// Bytes the checkpoint's files will take (tensor data plus a bound on headers and JSON).
uint64_t checkpoint_bytes(const models::ParameterList& params, const AdamW& optim, OptimizerStateForm form);

// Writes the checkpoint for `step`, then prunes the oldest checkpoints beyond `keep` (0 = keep all).
// `data_position`: the index of the next micro-batch the model consumes (not one a prefetcher may
// already have prepared). Throws before writing anything when the disk lacks the space.
// `shards` (ZeRO): every rank of the group calls this with its own AdamW; rank 0 checks the space
// (its shard's bytes times the world size), makes the hidden folder and writes the model, every rank
// writes its optimizer file into it, and rank 0 writes the trainer state and the manifest (which
// hashes every rank's file; out_dir must be one filesystem all ranks see) and renames the folder
// into place, with a barrier between the phases. A rank that fails aborts the group with its error.
std::string save_checkpoint(const std::string& out_dir, int64_t step, uint64_t data_position,
                            const models::ParameterList& params, const AdamW& optim, const nlohmann::json& config,
                            int64_t keep, OptimizerStateForm form = OptimizerStateForm::Full,
                            Communicator* shards = nullptr, const Fp8State* fp8 = nullptr);
// `fp8` (fp8.enabled): its scaling state goes into fp8_state.safetensors (written by rank 0; tensors
// "history" f32 [3L, H], "scale" f32 [3L], "rolls" i64 [1]). Loaded by load_fp8_state: false when the
// checkpoint has no such file; an error when its shapes do not match `fp8` (another model or history).
bool load_fp8_state(const std::string& dir, Fp8State& fp8);

// "optimizer-00003-of-00008.safetensors" for rank 3 of 8.
std::string optimizer_shard_name(int rank, int world);

// "" when `dir` is an intact checkpoint, else what is wrong with it (naming the file or field).
std::string verify_checkpoint(const std::string& dir);

struct CheckpointState {
  int64_t step = 0;
  int64_t data_position = 0;
  int64_t optimizer_steps = 0;
  OptimizerStateForm optimizer_state = OptimizerStateForm::Full;
  nlohmann::json config;  // the resolved run config the checkpoint was made with
};
// Reads trainer_state.json and the manifest of a verified checkpoint.
CheckpointState read_checkpoint_state(const std::string& dir);
// Loads the model and the optimizer state of a verified checkpoint (optimizer.safetensors or its
// per-rank shards, whatever their number: `optim` takes the names it holds). With the "none" form the
// optimizer restarts (zero moments, master copies from the loaded weights, step 0); with "bf16" the
// state is widened back to the optimizer's dtypes.
void load_checkpoint(const std::string& dir, const CheckpointState& state, const models::ParameterList& params,
                     AdamW& optim);

struct SkippedCheckpoint {
  std::string dir, problem;
};
// The newest checkpoint under out_dir/checkpoints that verifies, or "". Newer ones that do not
// verify are appended to `skipped` (newest first).
std::string latest_checkpoint(const std::string& out_dir, std::vector<SkippedCheckpoint>* skipped = nullptr);
// Every step_* folder under out_dir/checkpoints, intact or not, oldest first.
std::vector<std::string> checkpoint_folders(const std::string& out_dir);
// Removes hidden temporary / half-deleted folders under out_dir/checkpoints, restoring a step
// folder that was being replaced when the process died. Returns one line per action.
std::vector<std::string> clean_checkpoint_leftovers(const std::string& out_dir);
// Removes every checkpoint under out_dir (rename first, delete second). Returns the folders removed.
std::vector<std::string> discard_checkpoints(const std::string& out_dir);

// The settings in which two resolved configs differ and which change the run's maths or data
// ("train.lr: saved 0.001, now 0.002"). Settings that only change how the run is carried out or
// observed (train.steps, logging, checkpointing, out_dir, device, recompute, prefetch, threads,
// memory_budget, evaluation and samples) are not compared.
std::vector<std::string> run_config_differences(const nlohmann::json& saved, const nlohmann::json& now);

// Tests: replaces std::filesystem::space(dir).available in the disk-space check (nullptr: off).
void set_available_space_override(std::function<uint64_t(const std::string& dir)> f);

}  // namespace kestrel::train
