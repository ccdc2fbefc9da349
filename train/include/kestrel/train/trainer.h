// The training loop behind kestrel-train and the embedding API: builds the model and data from a
// resolved config, runs micro-batches with gradient accumulation, global-norm clipping, warmup +
// cosine AdamW, logs one line per step (loss, grad norm, lr, ms, tokens/s, MFU, memory by tag) and
// a JSONL metrics file (flushed per line), evaluates with greedy captions, and writes atomic,
// verified checkpoints (step folders: model.safetensors in HF names, optimizer.safetensors,
// trainer_state.json with the config, manifest.json with every file's size and checksum). A
// non-finite loss or gradient norm stops the run (train.nonfinite "stop": run() throws, the last
// checkpoint stays the last good one) or skips that step's update ("skip").
#pragma once

#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/runtime/device.h"

namespace kestrel {
class Communicator;  // kestrel/runtime/communicator.h
}

namespace kestrel::train {

struct EvalResult {
  int64_t samples = 0;
  double caption_accuracy = 0;  // exact caption match
  double colour_accuracy = 0, shape_accuracy = 0, position_accuracy = 0;
  std::vector<std::pair<std::string, std::string>> examples;  // (expected, generated)
  // Decoders on token data: the mean next-token loss over `tokens` held-out tokens (data.eval_files,
  // data.eval_samples sequences of seq_len); tokens == 0 when the task has no held-out tokens.
  int64_t tokens = 0;
  double loss = 0;
};

struct TrainSummary {
  int64_t steps = 0;
  double first_loss = 0, last_loss = 0;
  double seconds = 0;
  EvalResult eval;
  std::string memory_report_path;
};

struct ResumeOptions {
  // Resume although the checkpoint was made with a config that differs in a setting that changes
  // the run's maths or data (model, data, precision, optimizer hyper-parameters, ...); the
  // differences are logged. Without it such a resume is refused, naming them.
  bool allow_config_change = false;
};

class Trainer {
 public:
  // `config` must be resolved (resolve_train_config). Throws kestrel::Error on bad values.
  explicit Trainer(const nlohmann::json& config);
  // Data parallelism over `comm` (tests: one in-process communicator per thread): this trainer is
  // rank comm->rank() of comm->world_size(); train.batch_size is the global micro-batch, split
  // evenly over the ranks, and gradients are averaged in backward. Only rank 0 writes checkpoints,
  // metrics and the memory report. Without a communicator the launcher's environment decides
  // (distributed.backend; see train/src/data_parallel.h).
  Trainer(const nlohmann::json& config, std::shared_ptr<Communicator> comm);
  ~Trainer();

  // Resumes from a checkpoint folder ("" = none; "latest" = the newest intact one under
  // out_dir/checkpoints, skipping, with a log line, newer ones that fail verification). The
  // checkpoint is verified against its manifest first; a damaged one is refused naming the file.
  void resume(const std::string& checkpoint, const ResumeOptions& options = {});
  // A run that was not resumed refuses to start in an out_dir holding checkpoints (another run's,
  // which it would otherwise prune and `--resume latest` would mix up) unless this is set: they are
  // then deleted when run() starts.
  void set_overwrite_out_dir(bool on);
  TrainSummary run();
  EvalResult evaluate();

  // Called with every log line (the binary prints them; embedders may route them elsewhere).
  void set_log_callback(std::function<void(const std::string&)> cb);
  Device device() const;
  // True when the caller owns the device trace's event log (kestrel-mem profile): the trainer then
  // neither switches logging on nor clears the log at each step (it does both by default, so an
  // OutOfBudget writes memory.json + memory.html of the failing step into out_dir).
  void set_memory_profiling(bool on);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kestrel::train
