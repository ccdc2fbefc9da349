// Shared by the CPU and GPU optimizer tests: AdamW with its state offloaded to the host must take
// exactly the steps of AdamW with its state beside the parameters. Two identical parameter sets get
// the same fresh random gradients (clipped by the global norm, as the trainer does) for several steps
// with a changing learning rate; parameters, f32 masters and both moments must agree bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "kestrel/models/parameters.h"
#include "kestrel/ops/optim.h"
#include "kestrel/runtime/error.h"
#include "kestrel/train/optimizer.h"
#include "support/numerics.h"

namespace kestrel::train::testing {

using kestrel::testing::randn;

inline std::vector<uint8_t> raw_bytes(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).contiguous();
  std::vector<uint8_t> b(h.nbytes());
  std::memcpy(b.data(), h.data_ptr(), b.size());
  return b;
}

// Two parameter lists "p0", "p1", ... of `shapes` with the same fresh random values (owned by `owned`).
inline void twin_parameters(Device device, DType dtype, const std::vector<Shape>& shapes,
                            std::vector<std::unique_ptr<Tensor>>& owned, models::ParameterList& a,
                            models::ParameterList& b) {
  for (size_t i = 0; i < shapes.size(); ++i) {
    Tensor init = randn(shapes[i], DType::F32, Device::cpu(), 0.5).to(dtype);
    for (models::ParameterList* list : {&a, &b}) {
      owned.push_back(std::make_unique<Tensor>(models::make_parameter("p" + std::to_string(i), shapes[i], dtype, device)));
      owned.back()->copy_(init);
      list->add("p" + std::to_string(i), owned.back().get());
    }
  }
}

// `shapes`: the parameters (odd sizes; some larger than a staging slot so they split into chunks).
inline void expect_offloaded_adamw_matches_device(Device device, DType dtype, const std::vector<Shape>& shapes,
                                                  OptimizerPlacement host, int steps, double clip) {
  std::vector<std::unique_ptr<Tensor>> owned;
  models::ParameterList on_device, offloaded;
  twin_parameters(device, dtype, shapes, owned, on_device, offloaded);
  AdamWOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  AdamW a(on_device, o);
  host.offload = OptimizerOffload::Host;
  AdamW b(offloaded, o, host);
  EXPECT_EQ(b.device_state_bytes(), 0);
  // Offloaded, every parameter has a host master (for f32 ones the on-device AdamW updates in place).
  EXPECT_EQ(b.host_state_bytes(), a.state_bytes() + (dtype == DType::F32 ? on_device.numel() * 4 : 0));
  for (int s = 0; s < steps; ++s) {
    std::vector<Tensor> ga, gb;
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (s == 1 && i == 0) continue;  // a parameter without a gradient this step is left alone
      Tensor g = randn(shapes[i], DType::F32, Device::cpu(), 1.0 + s).to(dtype);
      ga.push_back(g.to(device).clone());
      gb.push_back(g.to(device).clone());
      on_device.get("p" + std::to_string(i)).set_grad(ga.back());
      offloaded.get("p" + std::to_string(i)).set_grad(gb.back());
    }
    clip_grad_norm_device(ga, clip);
    clip_grad_norm_device(gb, clip);
    const double lr = 1e-2 * (1.0 + 0.5 * s);
    a.step(lr);
    b.step(lr);
    on_device.zero_grad();
    offloaded.zero_grad();
  }
  for (size_t i = 0; i < shapes.size(); ++i) {
    const std::string n = "p" + std::to_string(i);
    EXPECT_EQ(raw_bytes(on_device.get(n)), raw_bytes(offloaded.get(n))) << "parameter " << n;
  }
  auto sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t k = 0; k < sa.size(); ++k) {
    ASSERT_EQ(sa[k].first, sb[k].first);
    EXPECT_TRUE(sb[k].second.device().is_cpu()) << sb[k].first;
    EXPECT_EQ(raw_bytes(sa[k].second), raw_bytes(sb[k].second)) << sa[k].first;
  }
  // The offloaded state loads back into a fresh optimizer and round-trips.
  std::map<std::string, Tensor> saved;
  for (auto& [k, t] : sb) saved[k] = t.clone();
  AdamW c(offloaded, o, host);
  c.load_state(saved, b.steps());
  auto sc = c.state();
  for (size_t k = 0; k < sc.size(); ++k) EXPECT_EQ(raw_bytes(sc[k].second), raw_bytes(saved[sc[k].first])) << sc[k].first;
}

// AdamW::step_async against step(): the same parameters and state bit for bit, each parameter
// already final when wait_parameter() returns for it (the caller reads it then, as a forward
// would), in forward order or not, with per-parameter groups (decay off for 1-D parameters, a
// lower learning rate for one of them) so every chunk carries its own constants.
inline void expect_async_adamw_matches_sync(Device device, DType dtype, const std::vector<Shape>& shapes,
                                            OptimizerPlacement host, int steps, bool reverse_waits) {
  std::vector<std::unique_ptr<Tensor>> owned;
  models::ParameterList sync_list, async_list;
  twin_parameters(device, dtype, shapes, owned, sync_list, async_list);
  AdamWOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  const ParameterGroupFn groups = [](const std::string& name, const Tensor& p) {
    return ParameterGroup{p.dim() >= 2 ? 0.1 : 0.0, name == "p2" ? 0.5 : 1.0};
  };
  host.offload = OptimizerOffload::Host;
  AdamW a(sync_list, o, host, groups), b(async_list, o, host, groups);
  for (int s = 0; s < steps; ++s) {
    std::vector<Tensor> grads;
    for (size_t i = 0; i < shapes.size(); ++i) {
      if (s == 1 && i == 0) continue;  // no gradient: left alone, and not waited for
      Tensor g = randn(shapes[i], DType::F32, Device::cpu(), 1.0 + s).to(dtype);
      sync_list.get("p" + std::to_string(i)).set_grad(g.to(device).clone());
      async_list.get("p" + std::to_string(i)).set_grad(g.to(device).clone());
    }
    const double lr = 1e-2 * (1.0 + 0.5 * s);
    a.step(lr);
    b.step_async(lr);
    ASSERT_TRUE(b.step_pending());
    // The gradients are the step's now: dropping them here must not disturb the update.
    sync_list.zero_grad();
    async_list.zero_grad();
    EXPECT_EQ(b.unwaited_parameters().size(), shapes.size() - (s == 1 ? 1 : 0));
    for (size_t j = 0; j < shapes.size(); ++j) {
      const size_t i = reverse_waits ? shapes.size() - 1 - j : j;
      const std::string n = "p" + std::to_string(i);
      b.wait_parameter(&async_list.get(n));
      EXPECT_EQ(raw_bytes(sync_list.get(n)), raw_bytes(async_list.get(n))) << "step " << s << ", parameter " << n
                                                                             << " read after its wait";
    }
    EXPECT_TRUE(b.unwaited_parameters().empty());
    b.finish_step();
    EXPECT_FALSE(b.step_pending());
  }
  auto sa = a.state(), sb = b.state();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t k = 0; k < sa.size(); ++k) EXPECT_EQ(raw_bytes(sa[k].second), raw_bytes(sb[k].second)) << sa[k].first;
  // A pending step: state() refuses, a plain step() finishes it first.
  for (size_t i = 0; i < shapes.size(); ++i)
    async_list.get("p" + std::to_string(i)).set_grad(randn(shapes[i], DType::F32, Device::cpu(), 1.0).to(dtype).to(device));
  b.step_async(1e-3);
  EXPECT_THROW(b.state(), Error);
  EXPECT_FALSE(b.unwaited_parameters().empty());
  b.finish_step();
  EXPECT_NO_THROW(b.state());
}

}  // namespace kestrel::train::testing
