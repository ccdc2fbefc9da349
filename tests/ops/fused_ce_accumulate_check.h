// Shared by the CPU and GPU tests: the vocabulary-sized weight gradients (fused_linear_cross_entropy's
// and embedding's) are added in place into a weight that already holds a gradient (micro-batch
// accumulation), and the result equals the sum of the two micro-batches' gradients computed
// separately (in f64 on the CPU).
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/cross_entropy.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/reduce.h"
#include "support/numerics.h"

namespace kestrel::testing {

inline void expect_fused_ce_accumulates_in_place(Device device, DType dtype, int64_t n, int64_t h, int64_t v,
                                                 double tol) {
  Tensor w0 = randn({v, h}, DType::F32, Device::cpu(), 0.05);
  std::vector<Tensor> xs, ys;
  for (int mb = 0; mb < 2; ++mb) {
    xs.push_back(randn({n, h}, DType::F32, Device::cpu(), 1.0));
    std::vector<int64_t> lab(n);
    for (int64_t i = 0; i < n; ++i) lab[i] = (i * 7919 + mb * 31) % v;
    lab[n / 2] = -100;  // an ignored token
    ys.push_back(Tensor::from_vector(lab, {n}, DType::I64));
  }
  // Under test: one leaf on `device`, two backward passes (the second accumulates in place).
  Tensor w = w0.to(dtype).to(device).clone();
  w.set_requires_grad(true);
  Tensor first_grad;
  for (int mb = 0; mb < 2; ++mb) {
    Tensor x = xs[mb].to(dtype).to(device);
    Tensor loss = fused_linear_cross_entropy(x, w, ys[mb].to(device));
    autograd::backward(loss);
    if (mb == 0) first_grad = w.grad();
  }
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(w.grad().same_as(first_grad)) << "the second micro-batch must add into the held gradient";
  // Reference: each micro-batch on its own fresh f64 CPU leaf, summed.
  Tensor sum;
  for (int mb = 0; mb < 2; ++mb) {
    Tensor wr = w0.to(dtype).to(DType::F64).clone();
    wr.set_requires_grad(true);
    Tensor loss = fused_linear_cross_entropy(xs[mb].to(dtype).to(DType::F64), wr, ys[mb]);
    autograd::backward(loss);
    sum = mb == 0 ? wr.grad().clone() : add(sum, wr.grad());
  }
  const double err = rel_l2(w.grad().to(Device::cpu()).to(DType::F64), sum);
  EXPECT_LT(err, tol) << dtype_name(dtype) << " on " << device.str();
}

inline void expect_embedding_accumulates_in_place(Device device, DType dtype, int64_t n, int64_t c, int64_t v,
                                                  double tol) {
  Tensor w0 = randn({v, c}, DType::F32, Device::cpu(), 1.0);
  std::vector<Tensor> ids, ups;
  for (int mb = 0; mb < 2; ++mb) {
    std::vector<int64_t> id(n);
    for (int64_t i = 0; i < n; ++i) id[i] = (i * 31 + mb * 7) % v;  // repeated rows
    ids.push_back(Tensor::from_vector(id, {n}, DType::I64));
    ups.push_back(randn({n, c}, DType::F32, Device::cpu(), 1.0));
  }
  Tensor w = w0.to(dtype).to(device).clone();
  w.set_requires_grad(true);
  Tensor first_grad;
  for (int mb = 0; mb < 2; ++mb) {
    Tensor e = embedding(w, ids[mb].to(device));
    autograd::backward({e}, {ups[mb].to(dtype).to(device)});
    if (mb == 0) first_grad = w.grad();
  }
  EXPECT_TRUE(w.grad().same_as(first_grad)) << "the second micro-batch must add into the held gradient";
  Tensor sum;
  for (int mb = 0; mb < 2; ++mb) {
    Tensor wr = w0.to(dtype).to(DType::F64).clone();
    wr.set_requires_grad(true);
    autograd::backward({embedding(wr, ids[mb])}, {ups[mb].to(dtype).to(DType::F64)});
    sum = mb == 0 ? wr.grad().clone() : add(sum, wr.grad());
  }
  EXPECT_LT(rel_l2(w.grad().to(Device::cpu()).to(DType::F64), sum), tol) << dtype_name(dtype) << " on " << device.str();
}

}  // namespace kestrel::testing
