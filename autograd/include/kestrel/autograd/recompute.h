// Recompute regions (gradient checkpointing).
//
// recompute(fn, inputs, options) runs fn without recording its inner ops or keeping its inner
// activations, and records a single tape entry. In backward the entry re-runs fn on a fresh inner
// tape from the saved inputs and backpropagates through it; parameters used inside fn receive their
// gradients directly. With Offload, the saved inputs move to pinned host memory right after the
// forward (on a copy stream) and are prefetched one region ahead in backward; inputs that are
// parameters (leaves that require grad) are never offloaded, since that would free nothing.
#pragma once

#include <functional>
#include <memory>
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
};

std::vector<Tensor> recompute(const RegionFn& fn, const std::vector<Tensor>& inputs,
                              const RecomputeOptions& options = {});

}  // namespace kestrel::autograd
