// Private: what the training loop trains. A Task owns a model and its data: it turns a micro-batch
// index into host arrays (prepare: pure and thread-safe, so the prefetch thread runs it) and a
// prepared batch on the device into a loss on the tape; the loop (trainer.cpp) owns everything else
// (prefetching, optimizer, schedule, logging, checkpoints). Tasks: "vlm" on the embedded shapes data,
// image-text JSONL or conversation JSONL with images; "decoder" on llm.c token files or conversation
// JSONL (chat_data.h).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "kestrel/autograd/recompute.h"
#include "kestrel/models/decoder.h"
#include "kestrel/models/parameters.h"
#include "kestrel/train/host_batch.h"
#include "kestrel/train/trainer.h"

namespace kestrel::train {

class Task {
 public:
  virtual ~Task() = default;
  virtual models::ParameterList& parameters() = 0;
  // Micro-batch `index` as host arrays: a pure function of the index, safe on any thread.
  virtual HostBatch prepare(uint64_t index, int64_t batch_size) const = 0;
  // The loss (recorded on the tape) of a prepared batch whose arrays are on the device. loss_grad, when
  // defined, is the scalar the loop will pass to backward as this loss's gradient: the language-model
  // head then computes its gradients in the forward (CrossEntropyOptions::known_grad, train.loss_gradient).
  virtual Tensor loss(const HostBatch& batch, const std::vector<Tensor>& arrays, autograd::RecomputePolicy policy,
                      const Tensor& loss_grad) = 0;
  // Held-out evaluation (samples == 0 when the task has none).
  virtual EvalResult evaluate() = 0;
  // Greedy outputs next to the expected ones for the first `count` held-out records (none: empty).
  virtual std::vector<std::pair<std::string, std::string>> samples(int64_t count) { return {}; }
  virtual std::string name() const = 0;
  // The language model's decoder (run settings such as its MLP tile); null when the task has none.
  virtual models::Decoder* decoder() { return nullptr; }
  // train.deterministic: every model of the task sums its backward in a fixed order (no atomics).
  virtual void set_deterministic(bool on) {
    if (models::Decoder* d = decoder()) d->set_deterministic(on);
  }
};

// Builds the task a resolved config names (model.type, data.type); errors name the key.
std::unique_ptr<Task> make_task(const nlohmann::json& cfg, DType dtype, Device device);

}  // namespace kestrel::train
