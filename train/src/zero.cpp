// ZeRO-1/2 pieces: parameter ownership, the owners' broadcast of updated parameters and the
// sharded global-norm clip (zero.h states the policy).
#include "zero.h"

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/optim.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train {

std::vector<int> assign_parameter_owners(const models::ParameterList& params, int world) {
  KESTREL_CHECK(world >= 1, "zero", "world size must be >= 1, got ", world);
  // Balance what the owner pays for: the trainable elements (AdamW state, stage 2's gradients). A
  // frozen parameter (train.trainable) weighs nothing and goes with its neighbours; with no
  // trainable parameter at all, every element counts.
  int64_t trainable = 0;
  for (auto& [name, p] : params.items())
    if (p->requires_grad()) trainable += p->numel();
  const bool all = trainable == 0;
  const int64_t total = all ? params.numel() : trainable;
  std::vector<int> owners;
  owners.reserve(params.size());
  int64_t start = 0;
  for (auto& [name, p] : params.items()) {
    const int64_t n = all || p->requires_grad() ? p->numel() : 0;
    // The rank whose even share of the flat order holds this parameter's midpoint (2x to stay integral).
    const int64_t mid2 = 2 * start + n;
    int r = total > 0 ? static_cast<int>(mid2 * world / (2 * total)) : 0;
    owners.push_back(std::min(r, world - 1));
    start += n;
  }
  return owners;
}

models::ParameterList owned_parameters(const models::ParameterList& params, const std::vector<int>& owners, int rank) {
  KESTREL_CHECK(owners.size() == params.size(), "zero", "owners for ", owners.size(), " parameters, the list has ",
                params.size());
  models::ParameterList out;
  size_t i = 0;
  for (auto& [name, p] : params.items())
    if (owners[i++] == rank) out.add(name, p);
  return out;
}

void gather_parameters(const models::ParameterList& params, const std::vector<int>& owners, Communicator& comm) {
  size_t i = 0;
  for (auto& [name, p] : params.items()) comm.broadcast(*p, owners[i++]);
  comm.wait();
}

Tensor clip_sharded_grad_norm(const std::vector<Tensor>& owned_grads, double max_norm, Communicator& comm,
                              Device device) {
  autograd::NoGradGuard no_grad;
  // This rank's squared partial norm as a [1] f32 tensor on the device (zero when it owns nothing).
  Tensor sq;
  if (owned_grads.empty()) {
    sq = Tensor::zeros({1}, DType::F32, device);
  } else {
    Tensor n = global_grad_norm_device(owned_grads).to(device);
    sq = mul(n, n).contiguous().view({1});
  }
  comm.all_reduce(sq, ReduceOp::Sum);
  comm.wait();
  Tensor norm = sqrt(sq).view({});
  if (max_norm > 0 && !owned_grads.empty()) {
    // min(1, max_norm / (norm + 1e-6)) on the device: no host synchronisation.
    Tensor coef = minimum(Tensor::full({}, 1.0, DType::F32, device),
                          div(Tensor::full({}, max_norm, DType::F32, device), add_scalar(norm, 1e-6)));
    for (const Tensor& g : owned_grads) {
      Tensor gg = g;
      gg.copy_(mul(g, coef));
    }
  }
  return norm;
}

}  // namespace kestrel::train
