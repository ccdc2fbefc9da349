// GPU-vs-CPU parity harness for the op tests in tests/ops/cuda: one Case per op and shape class.
//
// For each case and dtype: fresh random inputs are drawn on the CPU, cast to the dtype and copied to
// the GPU; the op runs on both devices (the GPU's output blocks are NaN-poisoned first by freeing
// NaN-filled blocks of the same sizes into the caching allocator, which hands them back); outputs are
// compared by relative L2 against a tolerance tied to the dtype. With `grad`, a random upstream
// gradient is backpropagated through the tape on both devices and every input gradient compared.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/runtime/tensor.h"
#include "support/numerics.h"

namespace kestrel::testing {

struct ParityCase {
  std::string name;
  std::vector<Shape> shapes;                                   // floating inputs
  std::function<Tensor(const std::vector<Tensor>&)> f;          // the op under test
  bool grad = true;                                            // also compare input gradients
  double lo = 0, hi = 0;                                       // uniform [lo, hi) inputs when hi > lo, else normal
  double tol_scale = 1.0;                                      // multiplies the dtype tolerance
  std::vector<DType> dtypes = {DType::F32, DType::BF16, DType::F16};
  // Extra non-floating inputs appended after the random ones (e.g. positions, labels), CPU tensors.
  std::function<std::vector<Tensor>()> extra;
};

inline double parity_tolerance(DType t) {
  switch (t) {
    case DType::F32: return 2e-5;
    case DType::F16: return 4e-3;
    default: return 2.4e-2;
  }
}

// Frees NaN-filled device blocks of these byte sizes so the next allocations of the same sizes get them.
inline void poison_device_blocks(const std::vector<size_t>& bytes) {
  std::vector<Tensor> held;
  for (size_t b : bytes) {
    Tensor t = Tensor::empty({static_cast<int64_t>((b + 3) / 4)}, DType::F32, Device::cuda(0));
    t.fill_(std::numeric_limits<double>::quiet_NaN());
    held.push_back(t);
  }
}

inline void run_parity(const ParityCase& c) {
  const Device gpu = Device::cuda(0);
  for (DType dt : c.dtypes) {
    SCOPED_TRACE(c.name + " " + std::string(dtype_name(dt)));
    std::vector<Tensor> cpu_in, gpu_in;
    for (const Shape& s : c.shapes) {
      Tensor x = (c.hi > c.lo ? randu(s, c.lo, c.hi) : randn(s)).to(dt);
      cpu_in.push_back(x);
      gpu_in.push_back(x.to(gpu));
    }
    std::vector<Tensor> extra = c.extra ? c.extra() : std::vector<Tensor>{};
    for (const Tensor& e : extra) {
      cpu_in.push_back(e);
      gpu_in.push_back(e.to(gpu));
    }
    if (c.grad)
      for (size_t i = 0; i < c.shapes.size(); ++i) {
        cpu_in[i].set_requires_grad(true);
        gpu_in[i].set_requires_grad(true);
      }
    Tensor want = c.f(cpu_in);
    poison_device_blocks({want.nbytes()});
    Tensor got = c.f(gpu_in);
    ASSERT_EQ(got.device(), gpu);
    ASSERT_EQ(got.shape(), want.shape());
    ASSERT_EQ(got.dtype(), want.dtype());
    Tensor got_h = got.detach().to(Device::cpu());
    double tol = parity_tolerance(want.dtype()) * c.tol_scale;
    EXPECT_TRUE(all_finite(got_h)) << "non-finite output (poison not overwritten?)";
    EXPECT_LE(rel_l2(got_h, want.detach()), tol) << "forward";
    if (!c.grad) continue;
    Tensor up = randn(want.shape()).to(want.dtype());
    // One backward over both roots: a backward consumes the whole tape.
    autograd::backward({want, got}, {up, up.to(gpu)});
    for (size_t i = 0; i < c.shapes.size(); ++i) {
      Tensor gw = cpu_in[i].grad(), gg = gpu_in[i].grad();
      ASSERT_EQ(gw.defined(), gg.defined()) << "input " << i;
      if (!gw.defined()) continue;
      Tensor gg_h = gg.to(Device::cpu());
      EXPECT_TRUE(all_finite(gg_h)) << "grad " << i;
      EXPECT_LE(rel_l2(gg_h, gw), tol * 2) << "grad of input " << i;
    }
  }
}

}  // namespace kestrel::testing
