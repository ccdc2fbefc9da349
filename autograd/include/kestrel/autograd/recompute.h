// Recompute regions (gradient checkpointing).
//
// recompute(fn, inputs, options) runs fn without recording its inner ops or keeping its inner
// activations, and records a single tape entry. In backward the entry re-runs fn on a fresh inner
// tape from the saved inputs and backpropagates through it; parameters used inside fn receive their
// gradients directly. With Offload, the saved inputs move to pinned host memory right after the
// forward (on a copy stream) and are prefetched one region ahead in backward; inputs that are
// parameters (leaves that require grad) are never offloaded, since that would free nothing.
//
// Selective recompute: a region may keep the outputs of named ops (RecomputeOptions::
// keep_outputs_of, e.g. "attention") from its forward. Those ops cooperate through
// reuse_kept_outputs() / keep_outputs() below: in the forward the op's outputs are held (no copy;
// offloaded like the inputs under Offload), and in the backward re-run the op takes them back and
// records its tape entry around them without running its kernel. Calls are matched in order per
// region; the re-run must make the same calls as the forward. Kept outputs belong to the innermost
// region that is running its forward (with grad mode on) or its re-run.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kestrel/runtime/offload.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::autograd {

enum class RecomputePolicy {
  None,     // no region: fn's ops record normally (activations kept)
  Keep,     // recompute in backward; saved inputs stay on the device
  Offload,  // recompute in backward; saved inputs offloaded to pinned host memory
};

const char* policy_name(RecomputePolicy p);
RecomputePolicy parse_recompute_policy(const std::string& s);

using RegionFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

// Saved inputs of Offload regions go through the device's offloader (kestrel/runtime/offload.h);
// the names stay reachable here, where the recompute API is.
using kestrel::OffloadHandle;
using kestrel::keep_in_place;
using kestrel::Offloader;
using kestrel::offload;
using kestrel::set_offloader;

struct RecomputeOptions {
  RecomputePolicy policy = RecomputePolicy::Keep;
  std::string name = "region";
  // Ops (by the name they give their tape entry) whose outputs the region keeps from its forward so
  // that its re-run does not run them again. Empty: full recompute.
  std::vector<std::string> keep_outputs_of = {};
};

std::vector<Tensor> recompute(const RegionFn& fn, const std::vector<Tensor>& inputs,
                              const RecomputeOptions& options = {});

// For ops whose outputs a region may keep. Before running its kernel an op asks for kept outputs:
// inside the backward re-run of a region that keeps `op`'s outputs, the outputs the forward kept
// for this call come back (in the forward's call order) and the op must not run its kernel; else
// nullopt. After running its kernel the op offers its outputs: inside the forward of a region that
// keeps `op`'s outputs they are held for the re-run; else nothing happens.
std::optional<std::vector<Tensor>> reuse_kept_outputs(const std::string& op);
void keep_outputs(const std::string& op, const std::vector<Tensor>& outputs);

}  // namespace kestrel::autograd
