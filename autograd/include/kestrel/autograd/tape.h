// The tape: a per-thread Wengert list of recorded ops, and backward over it.
//
// Recording: when grad mode is on and an input requires grad, an op appends one entry holding
// its inputs' and outputs' autograd identities (small records, not the tensors) and a backward
// function whose closure owns exactly the tensors the op saved. backward(loss) walks the tape in
// reverse, routes gradients by identity, accumulates (+=) into leaves, and destroys each entry
// — and with it the saved tensors — as soon as it has run, so memory falls during backward.
// Grad-ready hooks fire on a leaf once the last entry that uses it has run.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kestrel/runtime/autograd_meta.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::autograd {

// Given the gradients of the op's outputs (zeros filled in for outputs that got none), returns one
// gradient per input (undefined for inputs that need none). Runs with grad mode off.
using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& grad_outputs)>;

struct TapeEntry {
  std::string name;
  std::vector<std::shared_ptr<AutogradMeta>> inputs;   // null where the input needs no grad
  std::vector<std::shared_ptr<AutogradMeta>> outputs;
  std::vector<Shape> output_shapes;
  std::vector<DType> output_dtypes;
  std::vector<Device> output_devices;
  BackwardFn backward;
  // Leaves used inside a recompute region: their hooks wait for this entry.
  std::vector<std::shared_ptr<AutogradMeta>> region_leaves;
  // Called (in backward) shortly before this entry runs: used to prefetch offloaded inputs.
  std::function<void()> prefetch;
  bool prefetch_issued = false;  // prefetch has run (it is then null)
};

class Tape {
 public:
  std::vector<std::unique_ptr<TapeEntry>>& entries() { return entries_; }
  size_t size() const { return entries_.size(); }
  void clear() { entries_.clear(); }

 private:
  std::vector<std::unique_ptr<TapeEntry>> entries_;
};

// The calling thread's current tape (recompute swaps in inner tapes).
Tape& current_tape();
// Makes `tape` current for the scope's lifetime.
class TapeScope {
 public:
  explicit TapeScope(Tape& tape);
  ~TapeScope();

 private:
  Tape* saved_;
};

// True when an op with these inputs must record (grad mode on and some input requires grad).
// When false and a recompute region is capturing, it notes the leaves among the inputs.
bool should_record(const std::vector<Tensor>& inputs);

// Appends an entry; gives each output a fresh non-leaf identity that requires grad.
void record(const std::string& name, const std::vector<Tensor>& inputs, std::vector<Tensor>& outputs,
            BackwardFn backward);
// Convenience for single-output ops.
void record(const std::string& name, const std::vector<Tensor>& inputs, Tensor& output, BackwardFn backward);

struct BackwardOptions {
  bool fire_hooks = true;  // off for the inner backward of a recompute region
};

// Backpropagates from `roots` with the given root gradients (ones for a scalar when omitted),
// consuming the current tape.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads = {},
              BackwardOptions options = {});
void backward(const Tensor& loss);

// Registers a hook fired once per backward when `param`'s gradient is final.
void add_grad_ready_hook(Tensor& param, std::function<void(Tensor& param, Tensor& grad)> hook);

// Drops every recorded entry (e.g. after an evaluation forward run with grad on).
void clear_tape();

}  // namespace kestrel::autograd
