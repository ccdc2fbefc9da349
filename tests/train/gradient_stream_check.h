// Shared by the CPU and CUDA tests of optimizer.gradients "host" (train/src/gradient_stream.h): the
// host copies equal the gradients backward would have left on the device, the parameters hold none,
// and the norm and clip match clip_grad_norm's.
#pragma once

#include <gtest/gtest.h>

#include <cmath>

#include "kestrel/autograd/tape.h"
#include "kestrel/models/parameters.h"
#include "kestrel/ops/activation.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/optim.h"
#include "kestrel/ops/reduce.h"
#include "support/numerics.h"
#include "train/src/gradient_stream.h"

namespace kestrel::train::testing {

// Two twins of a small two-layer network with a tied weight (used twice, so its hook waits for
// both uses) and a frozen one; loss = sum(relu(x A^T) B^T + x C^T) over a random x.
struct StreamNet {
  Tensor a, b, c, frozen;
  models::ParameterList params;
  StreamNet(const std::vector<Tensor>& init, Device dev) {
    a = init[0].to(dev).clone();
    b = init[1].to(dev).clone();
    c = init[2].to(dev).clone();
    frozen = init[3].to(dev).clone();
    for (Tensor* t : {&a, &b, &c}) t->set_requires_grad(true);
    a.set_name("a"), b.set_name("b"), c.set_name("c"), frozen.set_name("frozen");
    params.add("a", &a);
    params.add("b", &b);
    params.add("c", &c);
    params.add("frozen", &frozen);
  }
  Tensor loss(const Tensor& x) const {
    Tensor h = relu(linear(x, a));
    return add(add(sum(linear(linear(h, b), a)) /* a again: tied */, sum(linear(x, c))), sum(linear(x, frozen)));
  }
};

inline void expect_stream_matches_device_gradients(Device dev, DType dt, double max_norm) {
  SCOPED_TRACE(::testing::Message() << dev.str() << " " << dtype_name(dt) << " max_norm " << max_norm);
  using kestrel::testing::randn;
  const int64_t n = 64, d = 48, h = 48;  // a [h, d] used as [h, d] twice: d == h
  std::vector<Tensor> init = {randn({h, d}, DType::F32, Device::cpu(), 0.2).to(dt),
                              randn({h, h}, DType::F32, Device::cpu(), 0.2).to(dt),
                              randn({5, d}, DType::F32, Device::cpu(), 0.2).to(dt),
                              randn({3, d}, DType::F32, Device::cpu(), 0.2).to(dt)};
  Tensor x = randn({n, d}, DType::F32, Device::cpu(), 1.0).to(dt).to(dev);
  StreamNet ref(init, dev), net(init, dev);
  autograd::backward(ref.loss(x));
  // What the stream must hold: the device gradients on the host, clipped by clip_grad_norm there.
  std::vector<Tensor> want;
  for (Tensor* p : {&ref.a, &ref.b, &ref.c}) want.push_back(p->grad().to(Device::cpu()).clone());
  const double want_norm = clip_grad_norm(want, max_norm);
  GradientStream stream(net.params);
  EXPECT_EQ(stream.host_bytes() % 256, 0);
  autograd::backward(net.loss(x));
  for (Tensor* p : {&net.a, &net.b, &net.c}) EXPECT_FALSE(p->grad().defined()) << p->name() << " kept a gradient";
  EXPECT_EQ(stream.finish(max_norm), want_norm);
  const std::vector<Tensor>& got = stream.gradients();
  ASSERT_EQ(got.size(), 4u);
  EXPECT_FALSE(got[3].defined()) << "the frozen parameter got a gradient";
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(got[i].defined());
    EXPECT_TRUE(got[i].device().is_cpu());
    EXPECT_EQ(kestrel::testing::max_abs_diff(got[i], want[i]), 0.0) << "gradient " << i << " differs";
  }
  stream.clear();
  EXPECT_FALSE(stream.gradients()[0].defined());
  // A second step streams again into the same buffers.
  autograd::backward(net.loss(x));
  const double again = stream.finish(0.0);
  EXPECT_GT(again, 0.0);
  EXPECT_TRUE(std::isfinite(again));
}

}  // namespace kestrel::train::testing
