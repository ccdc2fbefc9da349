// Shared by the CPU and GPU tests: the vocabulary-sized weight gradients (fused_linear_cross_entropy's
// and embedding's) are added in place into a weight that already holds a gradient (micro-batch
// accumulation), and the result equals the sum of the two micro-batches' gradients computed
// separately (in f64 on the CPU); the loss's gradients computed in the forward (known_grad) equal both.
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/cross_entropy.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/reduce.h"
#include "kestrel/autograd/grad_mode.h"
#include "support/errors.h"
#include "support/numerics.h"

namespace kestrel::testing {

// Two micro-batches of a linear + cross-entropy on the CPU in f32: the weight [V, H], and per
// micro-batch the hidden states [N, H] and labels [N] (one of them ignore_index).
struct CeMicroBatches {
  Tensor w0;
  std::vector<Tensor> xs, ys;
};
inline CeMicroBatches ce_micro_batches(int64_t n, int64_t h, int64_t v) {
  CeMicroBatches b;
  b.w0 = randn({v, h}, DType::F32, Device::cpu(), 0.05);
  for (int mb = 0; mb < 2; ++mb) {
    b.xs.push_back(randn({n, h}, DType::F32, Device::cpu(), 1.0));
    std::vector<int64_t> lab(n);
    for (int64_t i = 0; i < n; ++i) lab[i] = (i * 7919 + mb * 31) % v;
    lab[n / 2] = -100;  // an ignored token
    b.ys.push_back(Tensor::from_vector(lab, {n}, DType::I64));
  }
  return b;
}

inline void expect_fused_ce_accumulates_in_place(Device device, DType dtype, int64_t n, int64_t h, int64_t v,
                                                 double tol) {
  const auto [w0, xs, ys] = ce_micro_batches(n, h, v);
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

// CrossEntropyOptions::known_grad: two micro-batches whose gradients are computed in the forward for
// the seed (1/2, as the trainer's with train.grad_accum 2) equal the backward-from-lse path's and the
// f64 CPU reference's: the loss, d_hidden of each micro-batch and the accumulated d_weight (added in
// place into the held gradient by the second forward). A backward handed another gradient tensor is
// refused, even one with the same value.
inline void expect_known_grad_matches_backward(Device device, DType dtype, int64_t n, int64_t h, int64_t v,
                                               double tol) {
  const auto [w0, xs, ys] = ce_micro_batches(n, h, v);
  // path 0: gradients in the backward from the lse; path 1: in the forward (known_grad); path 2: f64 CPU.
  std::vector<Tensor> w(3), losses[3], dhs[3];
  for (int path = 0; path < 3; ++path) {
    const Device d = path == 2 ? Device::cpu() : device;
    const DType t = path == 2 ? DType::F64 : dtype;
    w[path] = w0.to(dtype).to(t).to(d).clone();
    w[path].set_requires_grad(true);
    Tensor first_grad;
    for (int mb = 0; mb < 2; ++mb) {
      Tensor x = xs[mb].to(dtype).to(t).to(d).clone();
      x.set_requires_grad(true);
      Tensor seed = Tensor::full({}, 0.5, t == DType::F64 ? DType::F64 : DType::F32, d);
      CrossEntropyOptions o;
      if (path == 1) o.known_grad = seed;
      Tensor loss = fused_linear_cross_entropy(x, w[path], ys[mb].to(d), Tensor(), o);
      if (path == 1 && mb == 1) {
        EXPECT_TRUE(w[path].grad().same_as(first_grad)) << "the second forward must add into the held gradient";
      }
      autograd::backward({loss}, {seed});
      if (mb == 0) first_grad = w[path].grad();
      losses[path].push_back(loss.to(Device::cpu()).to(DType::F64));
      dhs[path].push_back(x.grad().to(Device::cpu()).to(DType::F64));
    }
  }
  for (int path = 0; path < 2; ++path) {
    SCOPED_TRACE(std::string(path == 0 ? "backward from lse" : "known_grad") + " " + std::string(dtype_name(dtype)) + " on " +
                 device.str());
    for (int mb = 0; mb < 2; ++mb) {
      EXPECT_NEAR(losses[path][mb].to_double_vector()[0], losses[2][mb].to_double_vector()[0],
                  1e-5 * (1 + std::abs(losses[2][mb].to_double_vector()[0])));
      EXPECT_LT(rel_l2(dhs[path][mb], dhs[2][mb]), tol) << "d_hidden of micro-batch " << mb;
    }
    EXPECT_LT(rel_l2(w[path].grad().to(Device::cpu()).to(DType::F64), w[2].grad()), tol) << "d_weight";
  }
  // A backward with another gradient tensor is refused by name (its forward already added d_weight).
  Tensor x = xs[0].to(dtype).to(device);
  CrossEntropyOptions o;
  o.known_grad = Tensor::full({}, 0.5, DType::F32, device);
  Tensor loss = fused_linear_cross_entropy(x, w[1], ys[0].to(device), Tensor(), o);
  const std::string err = error_of([&] { autograd::backward({loss}, {Tensor::full({}, 0.5, DType::F32, device)}); });
  EXPECT_NE(err.find("known_grad"), std::string::npos) << err;
  // Not recording (no grad): known_grad changes nothing, the loss is the plain forward's.
  autograd::NoGradGuard no_grad;
  Tensor plain = fused_linear_cross_entropy(x, w[1], ys[0].to(device), Tensor(), o);
  EXPECT_FALSE(plain.requires_grad());
  EXPECT_NEAR(plain.to(Device::cpu()).to_double_vector()[0], losses[2][0].to_double_vector()[0],
              1e-5 * (1 + std::abs(losses[2][0].to_double_vector()[0])));
}

}  // namespace kestrel::testing
