// Shared by the CPU and CUDA tests of swiglu_mlp_tiled: the tiled op on `device` in `dtype` against the
// composed linear/swiglu ops in float64 on the CPU (an independent path through other kernels), over
// two backward passes so the second adds into the weights' held gradients.
#pragma once

#include <gtest/gtest.h>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/activation.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/mlp.h"
#include "kestrel/ops/reduce.h"
#include "support/numerics.h"

namespace kestrel::testing {

inline Tensor composed_mlp(const Tensor& x, const Tensor& g, const Tensor& u, const Tensor& d) {
  return linear(swiglu(linear(x, g), linear(x, u)), d);
}

// Sum of out * upstream: a scalar whose gradient is `upstream`.
inline Tensor weighted_sum(const Tensor& out, const Tensor& upstream) { return sum(mul(out, upstream)); }

inline void expect_tiled_mlp_matches(Device device, DType dtype, int64_t T, int64_t C, int64_t I, int64_t tile,
                                     double tol, bool frozen_up = false) {
  SCOPED_TRACE(::testing::Message() << "T=" << T << " C=" << C << " I=" << I << " tile=" << tile << " "
                                    << dtype_name(dtype) << " " << device.str() << (frozen_up ? " frozen up" : ""));
  // Inputs rounded to `dtype` first, so both sides see the same values.
  auto draw = [&](const Shape& s, double std) { return randn(s, DType::F32, Device::cpu(), std).to(dtype); };
  Tensor x0 = draw({T, C}, 1.0), g0 = draw({I, C}, 0.3), u0 = draw({I, C}, 0.3), d0 = draw({C, I}, 0.3);
  Tensor up1 = draw({T, C}, 1.0), up2 = draw({T, C}, 1.0);
  auto leaf = [](const Tensor& t, Device dev, DType dt, bool grad) {
    Tensor r = t.to(dt).to(dev).clone();  // a tensor of its own (to() returns t itself when nothing changes)
    if (grad) r.set_requires_grad(true);
    return r;
  };
  Tensor x = leaf(x0, device, dtype, true), g = leaf(g0, device, dtype, true), u = leaf(u0, device, dtype, !frozen_up),
         d = leaf(d0, device, dtype, true);
  Tensor xr = leaf(x0, Device::cpu(), DType::F64, true), gr = leaf(g0, Device::cpu(), DType::F64, true),
         ur = leaf(u0, Device::cpu(), DType::F64, !frozen_up), dr = leaf(d0, Device::cpu(), DType::F64, true);
  // One graph at a time: a backward consumes the whole tape.
  Tensor out = swiglu_mlp_tiled(x, g, u, d, tile);
  autograd::backward(weighted_sum(out, up1.to(device)));
  Tensor ref = composed_mlp(xr, gr, ur, dr);
  autograd::backward(weighted_sum(ref, up1.to(DType::F64)));
  EXPECT_LT(rel_l2(out.to(Device::cpu()).to(DType::F64), ref), tol) << "forward";
  // Second pass: the weights now hold gradients, which the tiled backward adds into in place.
  autograd::backward(weighted_sum(swiglu_mlp_tiled(x, g, u, d, tile), up2.to(device)));
  autograd::backward(weighted_sum(composed_mlp(xr, gr, ur, dr), up2.to(DType::F64)));
  auto host = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::F64); };
  EXPECT_LT(rel_l2(host(x.grad()), xr.grad()), tol) << "d x";
  EXPECT_LT(rel_l2(host(g.grad()), gr.grad()), tol) << "d gate";
  EXPECT_LT(rel_l2(host(d.grad()), dr.grad()), tol) << "d down";
  if (frozen_up)
    EXPECT_FALSE(u.grad().defined()) << "a frozen weight gets no gradient";
  else
    EXPECT_LT(rel_l2(host(u.grad()), ur.grad()), tol) << "d up";
}

}  // namespace kestrel::testing
