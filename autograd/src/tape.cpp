// Recording and the reverse walk. See tape.h for the policy.
#include "kestrel/autograd/tape.h"

#include <algorithm>
#include <unordered_map>

#include "capture.h"
#include "kestrel/autograd/grad_mode.h"
#include "kestrel/runtime/accumulate.h"

namespace kestrel::autograd {

namespace detail {
std::vector<std::shared_ptr<AutogradMeta>>*& leaf_capture() {
  static thread_local std::vector<std::shared_ptr<AutogradMeta>>* capture = nullptr;
  return capture;
}
}  // namespace detail

namespace {
thread_local Tape t_default_tape;
thread_local Tape* t_tape = &t_default_tape;

// True when `g` may become a leaf's .grad without a copy: nobody else holds its storage.
bool exclusively_owned(const Tensor& g) {
  return g.impl_ptr().use_count() == 1 && g.storage().use_count() == 1 && g.is_contiguous() &&
         g.storage()->owned();
}
}  // namespace

Tape& current_tape() { return *t_tape; }
TapeScope::TapeScope(Tape& tape) : saved_(t_tape) { t_tape = &tape; }
TapeScope::~TapeScope() { t_tape = saved_; }

bool should_record(const std::vector<Tensor>& inputs) {
  bool any = false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) any = true;
  if (!any) return false;
  if (grad_enabled()) return true;
  if (auto* cap = detail::leaf_capture()) {
    for (const Tensor& t : inputs)
      if (t.defined() && t.requires_grad() && t.is_leaf()) cap->push_back(t.impl().autograd);
  }
  return false;
}

void record(const std::string& name, const std::vector<Tensor>& inputs, std::vector<Tensor>& outputs,
            BackwardFn backward) {
  auto e = std::make_unique<TapeEntry>();
  e->name = name;
  e->backward = std::move(backward);
  e->inputs.reserve(inputs.size());
  for (const Tensor& t : inputs)
    e->inputs.push_back(t.defined() && t.requires_grad() ? t.impl().autograd : nullptr);
  for (Tensor& o : outputs) {
    auto meta = std::make_shared<AutogradMeta>();
    meta->id = AutogradMeta::next_id();
    meta->requires_grad = true;
    meta->is_leaf = false;
    o.impl().autograd = meta;
    e->outputs.push_back(meta);
    e->output_shapes.push_back(o.shape());
    e->output_dtypes.push_back(o.dtype());
    e->output_devices.push_back(o.device());
  }
  current_tape().entries().push_back(std::move(e));
}

void record(const std::string& name, const std::vector<Tensor>& inputs, Tensor& output, BackwardFn backward) {
  std::vector<Tensor> outs{output};
  record(name, inputs, outs, std::move(backward));
  output = outs[0];
}

namespace {

void fire_hooks(AutogradMeta& m) {
  if (m.grad_ready_hooks.empty() || !m.grad.defined()) return;
  Tensor grad = m.grad;
  Tensor unused;  // the registered wrapper supplies the parameter handle
  for (auto& h : m.grad_ready_hooks) h(unused, grad);
}

void accumulate_leaf(AutogradMeta& m, const Tensor& g) {
  if (!m.grad.defined()) {
    m.grad = exclusively_owned(g) ? g : g.clone();
  } else {
    add_into(m.grad, g);
  }
}

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads, BackwardOptions options) {
  Tape& tape = current_tape();
  auto& entries = tape.entries();
  std::unordered_map<uint64_t, Tensor> grads;  // non-leaf gradients in flight

  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    KESTREL_CHECK(r.defined() && r.requires_grad(), "backward",
                  "root ", i, " does not require grad (did the forward run with grad enabled on parameters "
                  "that require grad?)");
    Tensor g;
    if (i < root_grads.size() && root_grads[i].defined()) {
      g = root_grads[i];
      KESTREL_CHECK(g.shape() == r.shape(), "backward", "root gradient ", g.str(), " does not match root ", r.str());
    } else {
      KESTREL_CHECK(r.numel() == 1, "backward", "root ", r.str(),
                    " is not a scalar; pass its gradient explicitly");
      g = Tensor::full(r.shape(), 1.0, r.dtype(), r.device());
    }
    auto& meta = *r.impl().autograd;
    if (meta.is_leaf) {
      accumulate_leaf(meta, g);
      continue;
    }
    auto it = grads.find(meta.id);
    if (it == grads.end()) {
      grads.emplace(meta.id, g);
    } else {
      Tensor sum = it->second.clone();
      add_into(sum, g);
      it->second = sum;
    }
  }

  // Leaves' pending uses, for grad-ready hooks.
  std::unordered_map<AutogradMeta*, int> pending;
  if (options.fire_hooks) {
    for (auto& e : entries) {
      for (auto& m : e->inputs)
        if (m && m->is_leaf) ++pending[m.get()];
      for (auto& m : e->region_leaves) ++pending[m.get()];
    }
  }
  auto release_leaf = [&](AutogradMeta* m) {
    auto it = pending.find(m);
    if (it != pending.end() && --it->second == 0) fire_hooks(*m);
  };

  NoGradGuard no_grad;
  // The walk consumes the tape from the end. If an op's backward throws, the entries walked so far
  // are gone and the rest cannot be backpropagated any more: the tape is cleared on the way out too
  // (their saved tensors freed), so the caller can catch the error and run the next forward and
  // backward on an empty tape. Leaf gradients accumulated before the error stay as they are.
  struct ClearTape {
    std::vector<std::unique_ptr<TapeEntry>>& entries;
    ~ClearTape() { entries.clear(); }
  } clear_on_exit{entries};
  for (size_t k = entries.size(); k-- > 0;) {
    std::unique_ptr<TapeEntry> e = std::move(entries[k]);
    // Prefetch for the next region going backward, so its copy overlaps this entry's compute: one
    // region ahead, no more. The search stops at the nearest earlier region even when its prefetch
    // was already issued (by an entry after it), so restored inputs never pile up two or more ahead.
    for (size_t j = k; j-- > 0;) {
      if (!entries[j] || !(entries[j]->prefetch || entries[j]->prefetch_issued)) continue;
      if (entries[j]->prefetch) {
        auto pf = std::move(entries[j]->prefetch);
        entries[j]->prefetch = nullptr;
        entries[j]->prefetch_issued = true;
        pf();
      }
      break;
    }
    std::vector<Tensor> gouts(e->outputs.size());
    bool any = false;
    for (size_t o = 0; o < e->outputs.size(); ++o) {
      auto it = grads.find(e->outputs[o]->id);
      if (it != grads.end()) {
        gouts[o] = std::move(it->second);
        grads.erase(it);
        any = true;
      }
    }
    if (any) {
      for (size_t o = 0; o < gouts.size(); ++o)
        if (!gouts[o].defined())
          gouts[o] = Tensor::zeros(e->output_shapes[o], e->output_dtypes[o], e->output_devices[o]);
      std::vector<Tensor> gins = e->backward(gouts);
      KESTREL_CHECK(gins.size() == e->inputs.size(), "backward", "op '", e->name, "' returned ", gins.size(),
                    " gradients for ", e->inputs.size(), " inputs");
      gouts.clear();
      for (size_t i = 0; i < gins.size(); ++i) {
        auto& m = e->inputs[i];
        if (!m || !gins[i].defined()) continue;
        if (m->is_leaf) {
          accumulate_leaf(*m, gins[i]);
        } else {
          auto it = grads.find(m->id);
          if (it == grads.end()) {
            grads.emplace(m->id, std::move(gins[i]));
          } else {
            // Out of place: the held gradient may alias another input's gradient.
            Tensor sum = it->second.clone();
            add_into(sum, gins[i]);
            it->second = std::move(sum);
          }
        }
      }
    }
    if (options.fire_hooks) {
      for (auto& m : e->inputs)
        if (m && m->is_leaf) release_leaf(m.get());
      for (auto& m : e->region_leaves) release_leaf(m.get());
    }
    e.reset();  // drops the saved tensors now
  }
}

void backward(const Tensor& loss) { backward(std::vector<Tensor>{loss}); }

void add_grad_ready_hook(Tensor& param, std::function<void(Tensor& param, Tensor& grad)> hook) {
  KESTREL_CHECK(param.requires_grad() && param.is_leaf(), "autograd",
                "grad-ready hooks attach to leaf tensors that require grad, got ", param.str());
  // A weak reference: the hook lives in the parameter's own autograd record.
  std::weak_ptr<TensorImpl> weak = param.impl_ptr();
  param.impl().autograd->grad_ready_hooks.push_back([weak, hook = std::move(hook)](Tensor&, Tensor& g) {
    if (auto impl = weak.lock()) {
      Tensor p(impl);
      hook(p, g);
    }
  });
}

void clear_tape() { current_tape().clear(); }

}  // namespace kestrel::autograd
