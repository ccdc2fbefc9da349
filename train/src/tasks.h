// Private: what the training loop trains. A Task owns a model and its data and turns a micro-batch
// index into a loss on the tape; the loop (trainer.cpp) owns everything else (optimizer, schedule,
// logging, checkpoints). Tasks: "vlm" on the embedded shapes data, "decoder" on llm.c token files.
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/autograd/recompute.h"
#include "kestrel/models/parameters.h"
#include "kestrel/train/trainer.h"

namespace kestrel::train {

class Task {
 public:
  virtual ~Task() = default;
  virtual models::ParameterList& parameters() = 0;
  // The loss of micro-batch `index` (recorded on the tape); `tokens` receives its token count.
  virtual Tensor micro_batch_loss(uint64_t index, int64_t batch_size, autograd::RecomputePolicy policy,
                                  int64_t& tokens) = 0;
  // Held-out evaluation (samples == 0 when the task has none).
  virtual EvalResult evaluate() = 0;
  virtual std::string name() const = 0;
};

// Builds the task a resolved config names (model.type, data.type); errors name the key.
std::unique_ptr<Task> make_task(const nlohmann::json& cfg, DType dtype, Device device);

}  // namespace kestrel::train
