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

}  // namespace kestrel::train::testing
