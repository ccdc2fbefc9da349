// Recompute regions: one tape entry per region; backward re-runs the region on an inner tape.
// Selective regions also hold the outputs of the ops they name (keep_outputs_of) from the forward
// and hand them back to those ops during the re-run (recompute.h states the contract).
#include "kestrel/autograd/recompute.h"

#include <algorithm>

#include "capture.h"
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/runtime/memory_trace.h"

namespace kestrel::autograd {

const char* policy_name(RecomputePolicy p) {
  switch (p) {
    case RecomputePolicy::None: return "none";
    case RecomputePolicy::Keep: return "recompute";
    case RecomputePolicy::Offload: return "offload";
  }
  return "?";
}

RecomputePolicy parse_recompute_policy(const std::string& s) {
  if (s == "none") return RecomputePolicy::None;
  if (s == "recompute" || s == "keep" || s == "full") return RecomputePolicy::Keep;
  if (s == "offload" || s == "recompute+offload" || s == "full+offload") return RecomputePolicy::Offload;
  throw make_error("recompute", "unknown policy '", s, "'; expected none, recompute (full) or offload");
}

namespace {
// The device whose memory trace gets the region's phase markers (that of the first input).
Device region_device(const std::vector<Tensor>& inputs) {
  for (const Tensor& t : inputs)
    if (t.defined()) return t.device();
  return Device::cpu();
}

// The region running its forward or its re-run on this thread: what keep_outputs() and
// reuse_kept_outputs() talk to.
struct KeepContext {
  const std::vector<std::string>* ops = nullptr;  // the region's keep_outputs_of
  bool rerun = false;
  // Forward: appended per kept call. Re-run: handed out in order (moved out, so a kept tensor lives
  // on only in the tape entry of the op that took it back).
  std::vector<std::pair<std::string, std::vector<Tensor>>> kept;
  size_t next = 0;
  bool keeps(const std::string& op) const { return std::find(ops->begin(), ops->end(), op) != ops->end(); }
};
thread_local KeepContext* t_keep = nullptr;

class KeepScope {
 public:
  explicit KeepScope(KeepContext* c) : saved_(t_keep) { t_keep = c; }
  ~KeepScope() { t_keep = saved_; }
  KeepScope(const KeepScope&) = delete;
  KeepScope& operator=(const KeepScope&) = delete;

 private:
  KeepContext* saved_;
};
}  // namespace

std::optional<std::vector<Tensor>> reuse_kept_outputs(const std::string& op) {
  KeepContext* c = t_keep;
  if (!c || !c->rerun || !c->keeps(op)) return std::nullopt;
  KESTREL_CHECK(c->next < c->kept.size() && c->kept[c->next].first == op, "recompute", "the re-run calls '", op,
                "' (kept call ", c->next, ") but the forward kept ",
                c->next < c->kept.size() ? "'" + c->kept[c->next].first + "' there" : "no more calls",
                ": a selective region must make the same calls in its forward and its re-run");
  std::vector<Tensor> out = std::move(c->kept[c->next].second);
  ++c->next;
  return out;
}

void keep_outputs(const std::string& op, const std::vector<Tensor>& outputs) {
  KeepContext* c = t_keep;
  if (!c || c->rerun || !c->keeps(op)) return;
  std::vector<Tensor> held;
  for (const Tensor& t : outputs) held.push_back(t.defined() ? t.detach() : Tensor());
  c->kept.emplace_back(op, std::move(held));
}

// Every region marks phases "region:<name>:forward" / "region:<name>:backward" on the trace and
// labels its allocations with its name, so the profiler can give peaks per region. The backward
// re-run allocates under the Activation tag (those are activations, recomputed), its gradients
// under the caller's tag.
std::vector<Tensor> recompute(const RegionFn& fn, const std::vector<Tensor>& inputs, const RecomputeOptions& options) {
  const Device dev = region_device(inputs);
  MemoryLabelScope label(options.name, /*nested=*/false);
  if (options.policy == RecomputePolicy::None || !grad_enabled()) {
    PhaseScope phase(dev, "region:" + options.name + ":forward");
    return fn(inputs);
  }

  // Forward without recording; note the leaves the region touches and keep the named ops' outputs.
  std::vector<std::shared_ptr<AutogradMeta>> leaves;
  std::vector<Tensor> outputs;
  KeepContext keep;
  keep.ops = &options.keep_outputs_of;
  {
    auto* saved_capture = detail::leaf_capture();
    detail::leaf_capture() = &leaves;
    NoGradGuard no_grad;
    KeepScope keep_scope(&keep);
    PhaseScope phase(dev, "region:" + options.name + ":forward");
    try {
      outputs = fn(inputs);
    } catch (...) {
      detail::leaf_capture() = saved_capture;
      throw;
    }
    detail::leaf_capture() = saved_capture;
  }
  bool any_input = false;
  for (const Tensor& t : inputs) any_input |= t.defined() && t.requires_grad();
  if (!any_input && leaves.empty()) return outputs;
  // Deduplicate leaves.
  std::sort(leaves.begin(), leaves.end());
  leaves.erase(std::unique(leaves.begin(), leaves.end()), leaves.end());

  // Saved inputs: data only (no autograd identity), possibly offloaded; kept op outputs the same way.
  struct Saved {
    std::vector<std::unique_ptr<OffloadHandle>> handles;
    std::vector<bool> needs_grad;
    std::vector<std::string> kept_ops;
    std::vector<std::vector<std::unique_ptr<OffloadHandle>>> kept;
  };
  auto saved = std::make_shared<Saved>();
  for (const Tensor& t : inputs) {
    saved->needs_grad.push_back(t.defined() && t.requires_grad());
    if (!t.defined()) {
      saved->handles.push_back(nullptr);
    } else if (options.policy == RecomputePolicy::Offload && !(t.is_leaf() && t.requires_grad())) {
      // Parameters (leaves that require grad) stay: the model holds them anyway, so copying them
      // out would spend copy bandwidth and free nothing.
      saved->handles.push_back(offload(t.detach()));
    } else {
      saved->handles.push_back(keep_in_place(t.detach()));
    }
  }
  for (auto& [op, tensors] : keep.kept) {
    saved->kept_ops.push_back(op);
    auto& hs = saved->kept.emplace_back();
    for (Tensor& t : tensors) {
      if (!t.defined())
        hs.push_back(nullptr);
      else
        hs.push_back(options.policy == RecomputePolicy::Offload ? offload(t) : keep_in_place(t));
      t = Tensor();  // the handle holds it now (an offloaded block goes back once its copy lands)
    }
  }
  keep.kept.clear();

  BackwardFn bw = [fn, saved, dev, name = options.name, keep_ops = options.keep_outputs_of](const std::vector<Tensor>& grad_outputs) {
    MemoryLabelScope label(name, /*nested=*/false);
    PhaseScope phase(dev, "region:" + name + ":backward");
    std::vector<Tensor> inner_inputs;
    for (size_t i = 0; i < saved->handles.size(); ++i) {
      if (!saved->handles[i]) {
        inner_inputs.emplace_back();
        continue;
      }
      Tensor t = saved->handles[i]->get().detach();
      if (saved->needs_grad[i]) t.set_requires_grad(true);
      inner_inputs.push_back(t);
    }
    saved->handles.clear();  // the inner inputs own the data now
    KeepContext rerun;
    rerun.ops = &keep_ops;
    rerun.rerun = true;
    for (size_t i = 0; i < saved->kept.size(); ++i) {
      std::vector<Tensor> ts;
      for (auto& h : saved->kept[i]) ts.push_back(h ? h->get().detach() : Tensor());
      rerun.kept.emplace_back(saved->kept_ops[i], std::move(ts));
    }
    saved->kept.clear();
    Tape inner;
    TapeScope scope(inner);
    std::vector<Tensor> outs;
    {
      EnableGradGuard grad_on;
      TagScope tag(MemoryTag::Activation);
      KeepScope keep_scope(&rerun);
      outs = fn(inner_inputs);
    }
    KESTREL_CHECK(rerun.next == rerun.kept.size(), "recompute", "region '", name, "' kept the outputs of ",
                  rerun.kept.size(), " op calls in its forward but its re-run took back ", rerun.next);
    KESTREL_CHECK(outs.size() == grad_outputs.size(), "recompute",
                  "region returned ", outs.size(), " outputs on re-run, ", grad_outputs.size(), " in forward");
    std::vector<Tensor> roots, root_grads;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].defined() && outs[i].requires_grad()) {
        roots.push_back(outs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) backward(roots, root_grads, BackwardOptions{.fire_hooks = false});
    inner.clear();
    std::vector<Tensor> gins;
    for (size_t i = 0; i < inner_inputs.size(); ++i)
      gins.push_back(saved->needs_grad[i] ? inner_inputs[i].grad() : Tensor());
    return gins;
  };

  std::vector<Tensor> recorded_inputs = inputs;
  record(options.name, recorded_inputs, outputs, std::move(bw));
  TapeEntry& entry = *current_tape().entries().back();
  entry.region_leaves = std::move(leaves);
  if (options.policy == RecomputePolicy::Offload) {
    entry.prefetch = [saved] {
      for (auto& h : saved->handles)
        if (h) h->prefetch();
      for (auto& hs : saved->kept)
        for (auto& h : hs)
          if (h) h->prefetch();
    };
  }
  return outputs;
}

}  // namespace kestrel::autograd
