// adamw_step against a float64 reference over several steps (bias correction, decoupled weight
// decay, 16-bit gradients), the 16-bit parameter copy (nearest and stochastic rounding, the latter
// unbiased over many seeds), and global-norm clipping.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/optim.h"
#include "support/numerics.h"

namespace kestrel {
namespace {
using testing::host_f64;
using testing::randn;


void check_adamw(DType grad_dtype, int64_t n) {
  SCOPED_TRACE(::testing::Message() << "grad " << dtype_name(grad_dtype) << " n=" << n);
  AdamWOptions o;
  o.lr = 3e-3;
  o.beta1 = 0.85;
  o.beta2 = 0.99;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  Tensor p = randn({n}), m = Tensor::zeros({n}), v = Tensor::zeros({n});
  Tensor copy = Tensor::full({n}, NAN, DType::BF16);
  std::vector<double> rp = host_f64(p), rm(n, 0.0), rv(n, 0.0);
  for (int64_t step = 1; step <= 5; ++step) {
    Tensor g = randn({n}, grad_dtype);
    std::vector<double> gd = host_f64(g);
    adamw_step(p, g, m, v, step, o, copy);
    double bc1 = 1 - std::pow(o.beta1, step), bc2 = 1 - std::pow(o.beta2, step);
    for (int64_t i = 0; i < n; ++i) {
      rp[i] *= 1 - o.lr * o.weight_decay;
      rm[i] = o.beta1 * rm[i] + (1 - o.beta1) * gd[i];
      rv[i] = o.beta2 * rv[i] + (1 - o.beta2) * gd[i] * gd[i];
      rp[i] -= o.lr / bc1 * rm[i] / (std::sqrt(rv[i]) / std::sqrt(bc2) + o.eps);
    }
  }
  std::vector<double> hp = host_f64(p), hm = host_f64(m), hv = host_f64(v), hc = host_f64(copy);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(hp[i], rp[i], 2e-6 * (1 + std::abs(rp[i]))) << i;
    EXPECT_NEAR(hm[i], rm[i], 1e-6 * (1 + std::abs(rm[i]))) << i;
    EXPECT_NEAR(hv[i], rv[i], 1e-6 * (1 + std::abs(rv[i]))) << i;
    // Round to nearest: exactly the bf16 of the f32 master value.
    EXPECT_EQ(hc[i], static_cast<double>(static_cast<float>(bf16(static_cast<float>(hp[i]))))) << i;
  }
}

TEST(AdamW, MatchesFloat64ReferenceOverSteps) {
  check_adamw(DType::F32, 1);
  check_adamw(DType::F32, 1000);
  check_adamw(DType::BF16, 127);
  check_adamw(DType::F16, 7);
  check_adamw(DType::F64, 33);
}

TEST(AdamW, F64MasterForGradientTools) {
  Tensor p = randn({9}, DType::F64), m = Tensor::zeros({9}, DType::F64), v = Tensor::zeros({9}, DType::F64);
  Tensor g = randn({9}, DType::F64);
  std::vector<double> p0 = host_f64(p), gd = host_f64(g);
  AdamWOptions o;
  adamw_step(p, g, m, v, 1, o);
  std::vector<double> p1 = host_f64(p);
  for (int i = 0; i < 9; ++i) {
    // Step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps).
    double expect = p0[i] * (1 - o.lr * o.weight_decay) - o.lr * gd[i] / (std::abs(gd[i]) + o.eps);
    EXPECT_NEAR(p1[i], expect, 1e-15);
  }
}

template <typename T16>
void check_stochastic_rounding(DType dt) {
  SCOPED_TRACE(dtype_name(dt));
  // lr = 0 and no weight decay leave the master value unchanged, so the copy is just SR(param).
  const int64_t n = 64;
  const int seeds = 400;
  Tensor p = testing::randu({n}, -3.0, 3.0);
  p.data<float>()[0] = 1.0f;      // exactly representable: never perturbed
  p.data<float>()[1] = 1e-6f;     // f16 subnormal range / bf16 normal
  p.data<float>()[2] = -2.7182817f;
  std::vector<double> x = host_f64(p), mean(n, 0.0);
  AdamWOptions o;
  o.lr = 0;
  o.weight_decay = 0;
  Tensor g = randn({n}), m = Tensor::zeros({n}), v = Tensor::zeros({n});
  Tensor copy = Tensor::empty({n}, dt);
  for (int s = 1; s <= seeds; ++s) {
    adamw_step(p, g, m, v, 1, o, copy, 0x9e3779b97f4a7c15ull * s);
    std::vector<double> c = host_f64(copy);
    for (int64_t i = 0; i < n; ++i) {
      // Always one of the two neighbours.
      float xf = static_cast<float>(x[i]);
      T16 nearest(xf);
      double a = static_cast<float>(nearest);
      double other = static_cast<float>(T16::from_bits(static_cast<uint16_t>(
          (static_cast<double>(a) < x[i]) == (x[i] > 0) ? nearest.bits + 1 : nearest.bits - 1)));
      ASSERT_TRUE(c[i] == a || c[i] == other) << "element " << i << " x=" << x[i] << " got " << c[i];
      mean[i] += c[i] / seeds;
    }
  }
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    float xf = static_cast<float>(x[i]);
    T16 nearest(xf);
    double a = static_cast<float>(nearest);
    double other = static_cast<float>(T16::from_bits(static_cast<uint16_t>(
        (a < x[i]) == (x[i] > 0) ? nearest.bits + 1 : nearest.bits - 1)));
    double gap = std::abs(other - a);
    if (a == x[i]) {
      EXPECT_NEAR(mean[i], x[i], 1e-12 * std::abs(x[i]));
      continue;
    }
    // Standard deviation of the mean of a two-point distribution over `seeds` draws <= gap / (2 sqrt(seeds)).
    double err = std::abs(mean[i] - x[i]) / gap;
    worst = std::max(worst, err);
    EXPECT_LT(err, 5 * 0.5 / std::sqrt(static_cast<double>(seeds))) << "element " << i << " x=" << x[i];
  }
  std::printf("  %s: worst |mean - x| / gap over %d seeds = %.4f (bound %.4f)\n", std::string(dtype_name(dt)).c_str(),
              seeds, worst, 2.5 / std::sqrt(static_cast<double>(seeds)));
}

TEST(AdamW, StochasticRoundingIsUnbiased) {
  check_stochastic_rounding<bf16>(DType::BF16);
  check_stochastic_rounding<f16>(DType::F16);
}

TEST(AdamW, StochasticRoundingIsReproducible) {
  Tensor p = randn({100}), g = randn({100}), m = Tensor::zeros({100}), v = Tensor::zeros({100});
  Tensor c1 = Tensor::empty({100}, DType::BF16), c2 = Tensor::empty({100}, DType::BF16);
  AdamWOptions o;
  o.lr = 0;
  adamw_step(p, g, m, v, 1, o, c1, 42);
  adamw_step(p, g, m, v, 1, o, c2, 42);
  EXPECT_EQ(host_f64(c1), host_f64(c2));
}

TEST(AdamW, Errors) {
  Tensor p = randn({4}), g = randn({4}), m = Tensor::zeros({4}), v = Tensor::zeros({4});
  auto msg = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg([&] { adamw_step(p, randn({5}), m, v, 1, {}); }).find("[adamw_step] shapes differ"), std::string::npos);
  EXPECT_NE(msg([&] { adamw_step(p.to(DType::I32), g, m, v, 1, {}); }).find("master parameter must be f32"),
            std::string::npos);
  EXPECT_NE(msg([&] { adamw_step(p, g, m, v, 0, {}); }).find("step counts from 1"), std::string::npos);
  EXPECT_NE(msg([&] { adamw_step(p, g, m.to(DType::BF16), v, 1, {}); }).find("moments must be f32"),
            std::string::npos);
}

TEST(ClipGradNorm, NormAndScaling) {
  std::vector<Tensor> grads = {randn({7, 3}), randn({1000}, DType::BF16), Tensor(), randn({1}, DType::F64)};
  double ss = 0;
  for (const Tensor& g : grads)
    if (g.defined())
      for (double x : host_f64(g)) ss += x * x;
  double norm = std::sqrt(ss);
  EXPECT_NEAR(global_grad_norm(grads), norm, 1e-12 * norm);

  // max_norm above the norm: unchanged.
  std::vector<std::vector<double>> before;
  for (const Tensor& g : grads) before.push_back(g.defined() ? host_f64(g) : std::vector<double>());
  EXPECT_NEAR(clip_grad_norm(grads, 2 * norm), norm, 1e-12 * norm);
  for (size_t k = 0; k < grads.size(); ++k)
    if (grads[k].defined()) EXPECT_EQ(host_f64(grads[k]), before[k]);

  // max_norm below: scaled by max_norm / (norm + 1e-6); returns the norm before clipping.
  double max_norm = norm / 4;
  EXPECT_NEAR(clip_grad_norm(grads, max_norm), norm, 1e-12 * norm);
  double coef = max_norm / (norm + 1e-6);
  for (size_t k = 0; k < grads.size(); ++k) {
    if (!grads[k].defined()) continue;
    std::vector<double> after = host_f64(grads[k]);
    double tol = grads[k].dtype() == DType::BF16 ? 4e-3 : 1e-6;
    for (size_t i = 0; i < after.size(); ++i) EXPECT_NEAR(after[i], before[k][i] * coef, tol * std::abs(before[k][i]));
  }
  EXPECT_NEAR(global_grad_norm(grads), max_norm, 2e-3 * max_norm);

  // max_norm <= 0: norm only.
  std::vector<double> g0 = host_f64(grads[0]);
  clip_grad_norm(grads, 0.0);
  EXPECT_EQ(host_f64(grads[0]), g0);
  EXPECT_EQ(global_grad_norm({}), 0.0);
}

TEST(ClipGradNorm, NonFiniteNormLeavesGradientsUntouched) {
  Tensor g = randn({10});
  g.data<float>()[3] = INFINITY;
  std::vector<double> before = host_f64(g);
  EXPECT_TRUE(std::isinf(clip_grad_norm({g}, 1.0)));
  std::vector<double> after = host_f64(g);
  for (size_t i = 0; i < before.size(); ++i)
    if (std::isfinite(before[i])) EXPECT_EQ(after[i], before[i]);
}

// The device-side API on the CPU: the host path, its norm returned as a [] f32 tensor.
TEST(ClipGradNorm, DeviceApiOnCpuMatchesHostPath) {
  std::vector<Tensor> a = {randn({301}), randn({7, 5}).to(DType::BF16)}, b = {a[0].clone(), a[1].clone()};
  double want = clip_grad_norm(a, 0.25);
  Tensor got = clip_grad_norm_device(b, 0.25);
  EXPECT_EQ(got.dtype(), DType::F32);
  EXPECT_EQ(got.dim(), 0);
  EXPECT_EQ(got.item(), static_cast<double>(static_cast<float>(want)));
  EXPECT_EQ(host_f64(a[0]), host_f64(b[0]));
  EXPECT_EQ(host_f64(a[1]), host_f64(b[1]));
  EXPECT_NEAR(global_grad_norm_device(b).item(), 0.25, 2e-3);  // bf16 re-rounding after scaling
  EXPECT_EQ(clip_grad_norm_device({}, 1.0).item(), 0.0);
}

// grad_clip_factor_device + adamw_step(..., grad_scale) against clip_grad_norm_device then adamw_step:
// the same parameters, moments and copies bit for bit, the gradients left unscaled, for f32, bf16 and
// f16 gradients, an f32 master with a bf16 copy and a bf16 parameter without one, clipping active
// (factor < 1) and not (factor exactly 1).
TEST(ClipGradNorm, FactorAppliedInTheUpdateEqualsClippingFirst) {
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  for (double max_norm : {0.3, 1e9}) {
    SCOPED_TRACE(::testing::Message() << "max_norm " << max_norm);
    const std::vector<DType> gdt = {DType::F32, DType::BF16, DType::F16};
    std::vector<Tensor> ga, gb, pa, pb, ma, mb, va, vb, ca, cb;
    for (size_t k = 0; k < gdt.size(); ++k) {
      const int64_t n = 257 + 100 * static_cast<int64_t>(k);
      ga.push_back(randn({n}, gdt[k]));
      gb.push_back(ga.back().clone());
      pa.push_back(k == 2 ? randn({n}, DType::BF16) : randn({n}));  // the last: bf16, no master
      pb.push_back(pa.back().clone());
      Tensor mk = randn({n}, DType::F32, Device::cpu(), 0.01), vk = randn({n}, DType::F32, Device::cpu(), 0.01);
      vk = mul(vk, vk);  // a second moment is non-negative
      ma.push_back(mk.clone());
      mb.push_back(mk.clone());
      va.push_back(vk.clone());
      vb.push_back(vk.clone());
      ca.push_back(k == 2 ? Tensor() : Tensor::zeros({n}, DType::BF16));
      cb.push_back(k == 2 ? Tensor() : Tensor::zeros({n}, DType::BF16));
    }
    const std::vector<std::vector<double>> g_before = {host_f64(gb[0]), host_f64(gb[1]), host_f64(gb[2])};
    Tensor norm_a = clip_grad_norm_device(ga, max_norm);
    GradClip c = grad_clip_factor_device(gb, max_norm);
    EXPECT_EQ(c.norm.item(), norm_a.item());
    const double norm = global_grad_norm(gb);
    EXPECT_EQ(c.factor_value(), std::min(1.0, max_norm / (norm + 1e-6)));
    for (size_t k = 0; k < gdt.size(); ++k) {
      SCOPED_TRACE(::testing::Message() << "grad " << dtype_name(gdt[k]));
      const uint64_t seed = k == 2 ? 77 : 0;
      adamw_step(pa[k], ga[k], ma[k], va[k], 3, o, ca[k], seed);
      adamw_step(pb[k], gb[k], mb[k], vb[k], 3, o, cb[k], seed, c.factor);
      EXPECT_EQ(host_f64(pa[k]), host_f64(pb[k]));
      EXPECT_EQ(host_f64(ma[k]), host_f64(mb[k]));
      EXPECT_EQ(host_f64(va[k]), host_f64(vb[k]));
      if (ca[k].defined()) EXPECT_EQ(host_f64(ca[k]), host_f64(cb[k]));
      EXPECT_EQ(host_f64(gb[k]), g_before[k]);  // left unscaled
      if (max_norm < 1) EXPECT_NE(host_f64(ga[k]), g_before[k]);  // the in-place path did scale
    }
  }
  Tensor p = randn({4}), g = randn({4}), m = Tensor::zeros({4}), v = Tensor::zeros({4});
  try {
    adamw_step(p, g, m, v, 1, {}, Tensor(), 0, Tensor::full({}, 0.5, DType::F32));
    ADD_FAILURE() << "an f32 grad_scale was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("grad_scale must be grad_clip_factor_device's factor"), std::string::npos)
        << e.what();
  }
  GradClip none = grad_clip_factor_device({}, 1.0);
  EXPECT_EQ(none.norm.item(), 0.0);
  EXPECT_EQ(none.factor_value(), 1.0);
}

}  // namespace
}  // namespace kestrel
