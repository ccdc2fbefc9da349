// GPU-vs-CPU parity for the row and column kernels: the column reduction (sum over rows, strided and
// offset operands, one and many slabs), RMSNorm / add + RMSNorm / LayerNorm forward and backward and
// the softmax family, at sizes that reach every code path (row in registers with 2 or 4 chunks, 16-byte
// vectors or scalars for C not a multiple of the vector width, the streaming fallback for long rows,
// rows not a multiple of the grid); the GELU far negative tail; device-side gradient clipping.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kestrel/ops/activation.h"
#include "kestrel/ops/elementwise.h"
#include "kestrel/ops/norm.h"
#include "kestrel/ops/optim.h"
#include "kestrel/ops/shape.h"
#include "kestrel/ops/softmax.h"
#include "kestrel/runtime/accumulate.h"
#include "ops/cuda/parity.h"
#include "support/gpu.h"

namespace kestrel {
namespace {
using testing::ParityCase;
using testing::run_parity;
using V = std::vector<Tensor>;

std::vector<uint8_t> bytes_of(const Tensor& t) {
  Tensor h = t.to(Device::cpu()).contiguous();
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

TEST(CudaRowKernels, ColumnSum) {
  KESTREL_REQUIRE_GPU();
  auto rows_sum = [](const V& t) { return sum(t[0], {0}); };
  run_parity({"colsum_vec_slabs", {{3001, 4096}}, rows_sum, true, 0, 0, 3.0});
  run_parity({"colsum_odd_c", {{777, 1001}}, rows_sum, true, 0, 0, 3.0});
  run_parity({"colsum_narrow_c", {{20011, 24}}, rows_sum, true, 0, 0, 3.0});
  run_parity({"colsum_three_cols", {{70001, 3}}, rows_sum, true, 0, 0, 3.0});
  run_parity({"colsum_few_rows", {{3, 5000}}, rows_sum, true, 0, 0, 3.0});
  run_parity({"colsum_leading_dims", {{4, 250, 512}}, [](const V& t) { return sum(t[0], {0, 1}); }, true, 0, 0, 3.0});
  // Strided rows (ld > C): misaligned offset (scalar path) and a 16-byte aligned one (vector path).
  run_parity({"colsum_strided_misaligned", {{300, 4100}},
              [](const V& t) { return sum(narrow(t[0], 1, 3, 4096), {0}); }, true, 0, 0, 3.0});
  run_parity({"colsum_strided_aligned", {{300, 4112}},
              [](const V& t) { return sum(narrow(t[0], 1, 8, 4096), {0}); }, true, 0, 0, 3.0});
}

TEST(CudaRowKernels, ColumnSumIsBitwiseReproducible) {
  KESTREL_REQUIRE_GPU();
  Tensor x = testing::randn({16384, 1024}, DType::F32, Device::cuda(0));
  Tensor a = sum(x, {0}), b = sum(x, {0});
  EXPECT_EQ(bytes_of(a), bytes_of(b));
  EXPECT_LE(testing::rel_l2(a.to(Device::cpu()), sum(x.to(Device::cpu()), {0})), 1e-5);
}

// Row lengths per path (bf16 / f32): 4096 -> registers, 2 chunks; 12288 -> registers, 4 chunks (bf16),
// streaming (f32); 1001, 1999 -> scalar registers (2 and 4 chunks); 4097 -> scalar streaming;
// 16392 -> vector streaming; 64 / 96 with many rows -> several rows per block (partial dw in registers).
struct RowShape {
  int64_t rows, C;
};
const RowShape kRowShapes[] = {{67, 4096}, {5, 12288}, {33, 1001}, {17, 1999}, {9, 4097}, {3, 16392},
                               {9000, 64}, {20000, 96}, {2, 7}};

TEST(CudaRowKernels, RmsNorm) {
  KESTREL_REQUIRE_GPU();
  for (RowShape s : kRowShapes) {
    std::string n = std::to_string(s.rows) + "x" + std::to_string(s.C);
    run_parity({"rms_norm_" + n, {{s.rows, s.C}, {s.C}}, [](const V& t) { return rms_norm(t[0], t[1], 1e-5); }});
    run_parity({"add_rms_norm_" + n, {{s.rows, s.C}, {s.rows, s.C}, {s.C}},
                [](const V& t) {
                  auto [y, h] = add_rms_norm(t[0], t[1], t[2], 1e-5);
                  return add(y, scale(h, 0.5));
                }});
  }
}

TEST(CudaRowKernels, LayerNorm) {
  KESTREL_REQUIRE_GPU();
  for (RowShape s : kRowShapes) {
    std::string n = std::to_string(s.rows) + "x" + std::to_string(s.C);
    run_parity({"layer_norm_" + n, {{s.rows, s.C}, {s.C}, {s.C}},
                [](const V& t) { return layer_norm(t[0], t[1], t[2], 1e-5); }});
    run_parity({"layer_norm_plain_" + n, {{s.rows, s.C}},
                [](const V& t) { return layer_norm(t[0], Tensor(), Tensor(), 1e-5); }});
  }
  // A large mean: the two-pass variance in registers must not cancel.
  run_parity({"layer_norm_offset", {{13, 4096}, {4096}, {4096}},
              [](const V& t) { return layer_norm(add_scalar(t[0], 300.0), t[1], t[2], 1e-5); }, false, 0, 0, 2.0,
              {DType::F32}});
}

TEST(CudaRowKernels, Softmax) {
  KESTREL_REQUIRE_GPU();
  for (RowShape s : kRowShapes) {
    std::string n = std::to_string(s.rows) + "x" + std::to_string(s.C);
    run_parity({"softmax_" + n, {{s.rows, s.C}}, [](const V& t) { return softmax(scale(t[0], 3.0), -1); }});
    run_parity({"log_softmax_" + n, {{s.rows, s.C}}, [](const V& t) { return log_softmax(scale(t[0], 3.0), -1); }});
    run_parity({"logsumexp_" + n, {{s.rows, s.C}}, [](const V& t) { return logsumexp(t[0], -1); }});
  }
  run_parity({"softmax_8192", {{40, 8192}}, [](const V& t) { return softmax(t[0], -1); }});
}

// The norm backward (dx in registers, dw / db partials per block then the fixed-order column sum) on
// a shape with many rows per block and a row count that is not a multiple of the grid: two runs are
// bitwise equal, and every gradient matches the same backward in f64 on the CPU. Outputs poisoned.
TEST(CudaRowKernels, NormBackwardIsBitwiseReproducibleAndMatchesF64) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const int64_t rows = 3001, C = 4096;
  for (DType dt : {DType::F32, DType::BF16})
    for (bool layer : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (layer ? " layer_norm" : " rms_norm"));
      // Inputs rounded to dt first, so the f64 reference sees exactly the values the GPU sees.
      std::vector<Tensor> in = {testing::randn({rows, C}).to(dt), testing::randn({C}).to(dt),
                                testing::randn({C}).to(dt)};
      Tensor up = testing::randn({rows, C}).to(dt);
      auto run = [&](Device dev, DType as) {
        std::vector<Tensor> leaves;
        for (const Tensor& t : in) leaves.push_back(t.to(as).to(dev).set_requires_grad(true));
        if (dev == gpu) testing::poison_device_blocks({static_cast<size_t>(rows * C) * dtype_size(dt), C * dtype_size(dt), C * dtype_size(dt)});
        Tensor y = layer ? layer_norm(leaves[0], leaves[1], leaves[2], 1e-5) : rms_norm(leaves[0], leaves[1], 1e-5);
        autograd::backward({y}, {up.to(as).to(dev)});
        std::vector<Tensor> grads;
        for (int i = 0; i < (layer ? 3 : 2); ++i) grads.push_back(leaves[i].grad().to(Device::cpu()));
        return grads;
      };
      std::vector<Tensor> a = run(gpu, dt), b = run(gpu, dt), ref = run(Device::cpu(), DType::F64);
      const double tol = testing::parity_tolerance(dt);
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(testing::all_finite(a[i])) << "grad " << i;
        EXPECT_EQ(bytes_of(a[i]), bytes_of(b[i])) << "grad " << i << " not bitwise reproducible";
        EXPECT_LE(testing::rel_l2(a[i].to(DType::F64), ref[i]), tol) << "grad " << i;
      }
    }
}

// Contiguous add_into (gradient accumulation: several packs per thread, partial last block, a tail
// of n % 8) is bit-identical to the CPU's, for equal and mixed dtypes, at sizes around the block.
TEST(CudaRowKernels, AddIntoContiguousMatchesCpuBitwise) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  const std::pair<DType, DType> kinds[] = {
      {DType::BF16, DType::BF16}, {DType::F32, DType::BF16}, {DType::BF16, DType::F32}, {DType::F16, DType::F16},
      {DType::F32, DType::F32}};
  for (auto [dt, st] : kinds)
    for (int64_t n : {int64_t{5}, int64_t{8 * 1024 * 3 + 8 * 77 + 5}, int64_t{8 * 1024 * 64}, int64_t{8 * 1024 * 200 + 3}}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " += " + std::string(dtype_name(st)) + " n " + std::to_string(n));
      Tensor x = testing::randu({n}, -3, 3).to(dt), y = testing::randu({n}, -3, 3).to(st);
      Tensor xg = x.to(gpu), yg = y.to(gpu);
      add_into(x, y);
      add_into(xg, yg);
      ASSERT_EQ(bytes_of(xg), bytes_of(x));
    }
}

TEST(CudaRowKernels, GeluErfNegativeTail) {
  KESTREL_REQUIRE_GPU();
  // 0.5 x (1 + erf(x / sqrt2)) cancels to 0 (or noise) here; the erfc form keeps full relative accuracy.
  run_parity({"gelu_erf_tail", {{4001}}, [](const V& t) { return gelu(t[0]); }, true, -9.0, -3.0, 1.0,
              {DType::F32, DType::BF16}});
  Tensor x = Tensor::full({1}, -6.0, DType::F32, Device::cuda(0));
  double got = gelu(x).to(Device::cpu()).item();
  double want = 0.5 * -6.0 * std::erfc(6.0 / std::sqrt(2.0));  // about -5.9e-9
  EXPECT_NEAR(got, want, 1e-5 * std::abs(want));
}

TEST(CudaRowKernels, ClipGradNormOnDevice) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  for (double max_norm : {0.5, 1e9, 0.0}) {
    std::vector<Tensor> host = {testing::randn({1001}), testing::randn({33, 7}).to(DType::BF16),
                                testing::randn({70001}).to(DType::F16)};
    std::vector<Tensor> dev_a, dev_b;
    for (const Tensor& t : host) {
      dev_a.push_back(t.to(gpu));
      dev_b.push_back(t.to(gpu));
    }
    double want = clip_grad_norm(dev_a, max_norm);  // host-synchronising path on the device
    std::vector<Tensor> cpu = {host[0].clone(), host[1].clone(), host[2].clone()};
    double cpu_norm = clip_grad_norm(cpu, max_norm);  // f64 reference on the CPU
    EXPECT_NEAR(want, cpu_norm, 1e-9 * cpu_norm);
    for (size_t i = 0; i < host.size(); ++i)  // the 70001-element tensor takes the vector path
      EXPECT_LE(testing::rel_l2(dev_a[i].to(Device::cpu()).to(DType::F32), cpu[i].to(DType::F32)), 1e-6) << i;
    Tensor norm = clip_grad_norm_device(dev_b, max_norm);
    ASSERT_EQ(norm.device(), gpu);
    ASSERT_EQ(norm.dtype(), DType::F32);
    EXPECT_EQ(norm.to(Device::cpu()).item(), static_cast<double>(static_cast<float>(want))) << max_norm;
    for (size_t i = 0; i < host.size(); ++i) EXPECT_EQ(bytes_of(dev_a[i]), bytes_of(dev_b[i])) << i << " " << max_norm;
    if (max_norm == 0.5) EXPECT_NE(bytes_of(dev_b[0]), bytes_of(host[0]));  // it really scaled
    if (max_norm != 0.5) EXPECT_EQ(bytes_of(dev_b[0]), bytes_of(host[0]));
  }
  std::vector<Tensor> g = {testing::randn({513}).to(gpu)};
  EXPECT_NEAR(global_grad_norm_device(g).to(Device::cpu()).item(), global_grad_norm(g), 1e-6 * global_grad_norm(g));
  EXPECT_EQ(clip_grad_norm_device({}, 1.0).item(), 0.0);
}

// The clip factor applied inside the CUDA AdamW (grad_clip_factor_device + adamw_step's grad_scale)
// against clip_grad_norm_device's in-place scaling then the step, on the device: the same bits in
// every kernel class (the vectorised f32-master kernel with bf16 and f32 gradients, with and without
// a bf16 copy, whole and ragged chunks; the generic kernel for f16 gradients and a bf16 parameter
// without a master), the gradients left unscaled; and the factor equal to the host path's.
TEST(CudaRowKernels, ClipFactorInAdamWEqualsClippingFirst) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  struct Case {
    DType grad, param;
    bool copy;
    int64_t n;
  };
  const std::vector<Case> cases = {{DType::BF16, DType::F32, true, 3 * 8192 + 5},
                                   {DType::F32, DType::F32, false, 8192 + 3},
                                   {DType::BF16, DType::F32, false, 1001},
                                   {DType::F16, DType::F32, true, 70001},
                                   {DType::BF16, DType::BF16, false, 20000}};
  for (double max_norm : {0.4, 1e9}) {
    SCOPED_TRACE(::testing::Message() << "max_norm " << max_norm);
    V ga, gb, pa, pb, ma, mb, va, vb, ca, cb, g_host;
    for (const Case& c : cases) {
      g_host.push_back(testing::randn({c.n}).to(c.grad));
      ga.push_back(g_host.back().to(gpu));
      gb.push_back(g_host.back().to(gpu));
      Tensor p = testing::randn({c.n}).to(c.param);
      pa.push_back(p.to(gpu));
      pb.push_back(p.to(gpu));
      Tensor m = testing::randn({c.n}, DType::F32, Device::cpu(), 0.01),
             v = testing::randn({c.n}, DType::F32, Device::cpu(), 0.01);
      v = mul(v, v);  // a second moment is non-negative
      ma.push_back(m.to(gpu));
      mb.push_back(m.to(gpu));
      va.push_back(v.to(gpu));
      vb.push_back(v.to(gpu));
      ca.push_back(c.copy ? Tensor::zeros({c.n}, DType::BF16, gpu) : Tensor());
      cb.push_back(c.copy ? Tensor::zeros({c.n}, DType::BF16, gpu) : Tensor());
    }
    Tensor norm_a = clip_grad_norm_device(ga, max_norm);
    GradClip f = grad_clip_factor_device(gb, max_norm);
    ASSERT_EQ(f.factor.device(), gpu);
    EXPECT_EQ(f.norm.to(Device::cpu()).item(), norm_a.to(Device::cpu()).item());
    V host_g;
    for (const Tensor& g : g_host) host_g.push_back(g.clone());
    const double want = grad_clip_factor_device(host_g, max_norm).factor_value();
    EXPECT_NEAR(f.factor_value(), want, 1e-12 * want);
    if (max_norm > 1) EXPECT_EQ(f.factor_value(), 1.0);
    for (size_t k = 0; k < cases.size(); ++k) {
      SCOPED_TRACE(::testing::Message() << "case " << k);
      const uint64_t seed = cases[k].param == DType::BF16 ? 99 : 0;
      adamw_step(pa[k], ga[k], ma[k], va[k], 2, o, ca[k], seed);
      adamw_step(pb[k], gb[k], mb[k], vb[k], 2, o, cb[k], seed, f.factor);
      EXPECT_EQ(bytes_of(pa[k]), bytes_of(pb[k]));
      EXPECT_EQ(bytes_of(ma[k]), bytes_of(mb[k]));
      EXPECT_EQ(bytes_of(va[k]), bytes_of(vb[k]));
      if (ca[k].defined()) EXPECT_EQ(bytes_of(ca[k]), bytes_of(cb[k]));
      EXPECT_EQ(bytes_of(gb[k]), bytes_of(g_host[k]));  // left unscaled
      if (max_norm < 1) EXPECT_NE(bytes_of(ga[k]), bytes_of(g_host[k]));
    }
  }
}

}  // namespace
}  // namespace kestrel
