#include "kestrel/train/optimizer.h"

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {

AdamW::AdamW(const models::ParameterList& params, AdamWOptions options) : options_(options) {
  TagScope tag(MemoryTag::OptimizerState);
  for (auto& [name, p] : params.items()) {
    Slot s{name, p, Tensor(), Tensor(), Tensor()};
    MemoryLabelScope label("adamw." + name, /*nested=*/false);
    if (p->dtype() != DType::F32) s.master = p->to(DType::F32).clone();
    s.m = Tensor::zeros(p->shape(), DType::F32, p->device());
    s.v = Tensor::zeros(p->shape(), DType::F32, p->device());
    slots_.push_back(std::move(s));
  }
}

void AdamW::step(double lr) {
  autograd::NoGradGuard no_grad;
  ++step_;
  AdamWOptions o = options_;
  o.lr = lr;
  for (Slot& s : slots_) {
    Tensor g = s.param->grad();
    if (!g.defined()) continue;
    if (s.master.defined())
      adamw_step(s.master, g, s.m, s.v, step_, o, *s.param);
    else
      adamw_step(*s.param, g, s.m, s.v, step_, o);
  }
}

int64_t AdamW::state_bytes() const {
  int64_t n = 0;
  for (const Slot& s : slots_) n += static_cast<int64_t>(s.m.nbytes() + s.v.nbytes() + (s.master.defined() ? s.master.nbytes() : 0));
  return n;
}

std::vector<std::pair<std::string, Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Slot& s : slots_) {
    out.emplace_back("exp_avg." + s.name, s.m);
    out.emplace_back("exp_avg_sq." + s.name, s.v);
    if (s.master.defined()) out.emplace_back("master." + s.name, s.master);
  }
  return out;
}

void AdamW::load_state(const std::map<std::string, Tensor>& tensors, int64_t step) {
  auto take = [&](const std::string& key, Tensor& dst) {
    auto it = tensors.find(key);
    KESTREL_CHECK(it != tensors.end(), "optimizer", "checkpoint has no optimizer state '", key, "'");
    KESTREL_CHECK(it->second.shape() == dst.shape(), "optimizer", "state '", key, "' has shape ",
                  shape_str(it->second.shape()), ", expected ", shape_str(dst.shape()));
    dst.copy_(it->second);
  };
  for (Slot& s : slots_) {
    take("exp_avg." + s.name, s.m);
    take("exp_avg_sq." + s.name, s.v);
    if (s.master.defined()) take("master." + s.name, s.master);
  }
  step_ = step;
}

}  // namespace kestrel::train
