// Shared by the CPU and GPU tests of the compact optimizer modes (issue 21): q8 moments offloaded to
// the host against q8 moments beside the parameters, and the update inside backward against the
// update after it; both bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "adamw_offload_check.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/error.h"

namespace kestrel::train::testing {

inline AdamWOptions compact_options() {
  AdamWOptions o;
  o.lr = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.95;
  o.eps = 1e-8;
  o.weight_decay = 0.1;
  return o;
}

// q8 moments in host memory (the offload's block-wise host loop, split across threads, through the
// staging ring on CUDA) against q8 moments beside the parameters (the op's kernel on `device`): the
// same bits, parameters and state. `ring`: the staging settings of the offloaded one.
inline void expect_q8_offload_matches_device(Device device, DType dtype, const std::vector<Shape>& shapes,
                                             OptimizerPlacement ring) {
  {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<std::unique_ptr<Tensor>> owned;
    models::ParameterList dev_list, host_list;
    twin_parameters(device, dtype, shapes, owned, dev_list, host_list);
    OptimizerPlacement pd;
    pd.state_dtype = DType::U8;
    OptimizerPlacement ph = ring;
    ph.state_dtype = DType::U8;
    ph.offload = OptimizerOffload::Host;
    AdamW a(dev_list, compact_options(), pd), b(host_list, compact_options(), ph);
    for (int s = 0; s < 4; ++s) {
      for (size_t i = 0; i < shapes.size(); ++i) {
        Tensor g = kestrel::testing::randn(shapes[i], DType::F32, Device::cpu(), s == 2 ? 1e-3 : 1.0).to(dtype).to(device);
        dev_list.get("p" + std::to_string(i)).set_grad(g.clone());
        host_list.get("p" + std::to_string(i)).set_grad(g.clone());
      }
      a.step(1e-2 * (1 + s));
      b.step(1e-2 * (1 + s));
      dev_list.zero_grad();
      host_list.zero_grad();
    }
    for (size_t i = 0; i < shapes.size(); ++i) {
      const std::string n = "p" + std::to_string(i);
      EXPECT_EQ(raw_bytes(dev_list.get(n)), raw_bytes(host_list.get(n))) << n;
    }
    auto sa = a.state(), sb = b.state();
    std::map<std::string, Tensor> mb(sb.begin(), sb.end());
    for (auto& [k, t] : sa) {
      ASSERT_TRUE(mb.count(k)) << k;
      EXPECT_EQ(raw_bytes(t), raw_bytes(mb[k])) << k;
    }
    // q8 state: 2 bytes + 8 per 2048 per parameter, plus the f32 master of 16-bit parameters.
    const int64_t n = dev_list.numel();
    EXPECT_LT(a.state_bytes(), n * (dtype == DType::F32 ? 2.1 : 6.1));
  }
}

// A loss over a ParameterList: sum over parameters of sum(x * x * c_i) with the given constants, so
// each parameter's gradient becomes ready at its own tape entry.
inline Tensor toy_loss(const models::ParameterList& params, const std::vector<Tensor>& c) {
  Tensor loss;
  size_t i = 0;
  for (auto& [name, p] : params.items()) {
    Tensor term = sum(mul(mul(*p, *p), c[i++]));
    loss = loss.defined() ? add(loss, term) : term;
  }
  return loss;
}

// The update inside backward (grad-ready hooks) equals the update after backward, bit for bit, in
// every storage mode, and no gradient is left once backward returns.
inline void expect_step_in_backward_matches_step_after(Device device, const std::vector<Shape>& shapes,
                                                       OptimizerPlacement ring) {
  struct Mode {
    DType state;
    MasterWeights master;
    OptimizerOffload offload;
  };
  for (const Mode& m : {Mode{DType::U8, MasterWeights::None, OptimizerOffload::None},
                        Mode{DType::F32, MasterWeights::None, OptimizerOffload::None},
                        Mode{DType::F32, MasterWeights::F32, OptimizerOffload::None},
                        Mode{DType::U8, MasterWeights::F32, OptimizerOffload::Host}}) {
    SCOPED_TRACE(::testing::Message() << optimizer_state_dtype_name(m.state) << " master "
                                      << master_weights_name(m.master) << " offload " << optimizer_offload_name(m.offload));
    std::vector<std::unique_ptr<Tensor>> owned;
    models::ParameterList after, inside;
    twin_parameters(device, DType::BF16, shapes, owned, after, inside);
    OptimizerPlacement pa = ring;
    pa.state_dtype = m.state;
    pa.master_weights = m.master;
    pa.offload = m.offload;
    OptimizerPlacement pb = pa;
    pb.step_in_backward = true;
    AdamW a(after, compact_options(), pa), b(inside, compact_options(), pb);
    for (int s = 1; s <= 4; ++s) {
      std::vector<Tensor> c;  // fresh constants, the same for both
      for (const Shape& sh : shapes)
        c.push_back(kestrel::testing::randn(sh, DType::F32, Device::cpu(), 1.0 + s).to(DType::BF16).to(device));
      autograd::backward(toy_loss(after, c));
      a.step(1e-2 * s);
      after.zero_grad();
      Tensor lb = toy_loss(inside, c);
      b.begin_step(1e-2 * s);
      autograd::backward(lb);
      b.end_step();
      for (auto& [name, p] : inside.items()) EXPECT_FALSE(p->grad().defined()) << name << " kept its gradient";
      ASSERT_TRUE(b.grad_norm().defined());
      EXPECT_TRUE(std::isfinite(b.grad_norm().item()));
    }
    for (auto& [name, p] : after.items()) EXPECT_EQ(raw_bytes(*p), raw_bytes(inside.get(name))) << name;
    EXPECT_THROW(b.step(1e-2), Error);  // the wrong protocol is refused
  }
}

}  // namespace kestrel::train::testing
