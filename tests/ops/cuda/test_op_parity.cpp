// CUDA op kernels against the CPU reference: elementwise, reduce and matmul (forward and gradients
// through the tape), odd sizes, strided and broadcast operands, and the CUDA-only error paths.
#include <gtest/gtest.h>

#include "kestrel/runtime/memory_config.h"
#include "kestrel/ops/matmul.h"
#include "kestrel/ops/optim.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/ops/shape.h"
#include "ops/cuda/parity.h"
#include "support/gpu.h"

namespace kestrel {
namespace {
using testing::ParityCase;
using testing::run_parity;
using V = std::vector<Tensor>;

TEST(CudaParity, Binary) {
  KESTREL_REQUIRE_GPU();
  run_parity({"add", {{7, 127}, {7, 127}}, [](const V& t) { return add(t[0], t[1]); }});
  run_parity({"add_vec_odd", {{1000, 33}, {1000, 33}}, [](const V& t) { return add(t[0], t[1]); }});
  run_parity({"sub_bcast_row", {{31, 129}, {129}}, [](const V& t) { return sub(t[0], t[1]); }});
  run_parity({"mul_bcast_col", {{5, 17, 9}, {5, 1, 9}}, [](const V& t) { return mul(t[0], t[1]); }});
  run_parity({"div", {{1, 1001}, {1, 1001}}, [](const V& t) { return div(t[0], t[1]); }, true, 0.5, 2.0});
  run_parity({"maximum", {{63, 65}, {63, 65}}, [](const V& t) { return maximum(t[0], t[1]); }});
  run_parity({"minimum_scalar", {{257}, {}}, [](const V& t) { return minimum(t[0], t[1]); }});
  run_parity({"mul_transposed", {{37, 41}, {41, 37}},
              [](const V& t) { return mul(t[0], transpose(t[1], 0, 1)); }});
  run_parity({"add_sliced", {{9, 130}, {9, 127}}, [](const V& t) { return add(narrow(t[0], 1, 3, 127), t[1]); }});
  run_parity({"add_big", {{3, 1 << 20}, {3, 1 << 20}}, [](const V& t) { return add(t[0], t[1]); }, false});
}

TEST(CudaParity, MixedDtypes) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  Tensor a = testing::randn({77, 13}).to(DType::BF16), b = testing::randn({77, 13});
  Tensor want = mul(a, b), got = mul(a.to(gpu), b.to(gpu));
  EXPECT_EQ(got.dtype(), DType::F32);
  EXPECT_LE(testing::rel_l2(got.to(Device::cpu()), want), 1e-6);
}

TEST(CudaParity, Unary) {
  KESTREL_REQUIRE_GPU();
  run_parity({"neg", {{1001}}, [](const V& t) { return neg(t[0]); }});
  run_parity({"exp", {{17, 33}}, [](const V& t) { return exp(t[0]); }});
  run_parity({"log", {{999}}, [](const V& t) { return log(t[0]); }, true, 0.1, 5.0});
  run_parity({"sqrt", {{127}}, [](const V& t) { return sqrt(t[0]); }, true, 0.1, 5.0});
  run_parity({"rsqrt", {{129}}, [](const V& t) { return rsqrt(t[0]); }, true, 0.5, 5.0});
  run_parity({"tanh", {{7, 7}}, [](const V& t) { return tanh(t[0]); }});
  run_parity({"abs", {{301}}, [](const V& t) { return abs(t[0]); }});
  run_parity({"sigmoid", {{3, 1000}}, [](const V& t) { return sigmoid(t[0]); }});
  run_parity({"square", {{1}}, [](const V& t) { return square(t[0]); }});
  run_parity({"scale", {{65}}, [](const V& t) { return scale(t[0], -1.75); }});
  run_parity({"add_scalar", {{4095}}, [](const V& t) { return add_scalar(t[0], 0.5); }});
  run_parity({"pow", {{33}}, [](const V& t) { return pow_scalar(t[0], 1.5); }, true, 0.2, 3.0});
  run_parity({"exp_transposed", {{31, 63}}, [](const V& t) { return exp(transpose(t[0], 0, 1)); }});
  // Large enough for thousands of blocks of the fast path, a partially filled last block and the
  // scalar tail (4.5M + 3 elements).
  run_parity({"exp_large", {{3, 1500001}}, [](const V& t) { return exp(t[0]); }, false});
  run_parity({"tanh_large", {{1500001, 3}}, [](const V& t) { return tanh(t[0]); }, false});
}

TEST(CudaParity, Where) {
  KESTREL_REQUIRE_GPU();
  ParityCase c{"where", {{19, 23}, {23}}, [](const V& t) { return where(t[2], t[0], t[1]); }};
  c.extra = [] {
    Tensor m = testing::randn({19, 23});
    std::vector<float> v = m.to_float_vector();
    for (float& x : v) x = x > 0 ? 1.0f : 0.0f;
    return V{Tensor::from_vector(v, {19, 23}).to(DType::Bool)};
  };
  run_parity(c);
}

TEST(CudaParity, Sum) {
  KESTREL_REQUIRE_GPU();
  run_parity({"sum_all", {{1000, 7}}, [](const V& t) { return sum(t[0]); }, true, 0, 0, 3.0});
  run_parity({"sum_last", {{127, 1001}}, [](const V& t) { return sum(t[0], {1}); }, true, 0, 0, 3.0});
  run_parity({"sum_rows", {{1001, 4097}}, [](const V& t) { return sum(t[0], {0}); }, true, 0, 0, 3.0});
  run_parity({"sum_small_rows", {{3001, 65}}, [](const V& t) { return sum(t[0], {0}); }, true, 0, 0, 3.0});
  run_parity({"sum_middle", {{5, 77, 9}}, [](const V& t) { return sum(t[0], {1}, true); }, true, 0, 0, 3.0});
  run_parity({"sum_outer_inner", {{6, 7, 8}}, [](const V& t) { return sum(t[0], {0, 2}); }, true, 0, 0, 3.0});
  run_parity({"mean_transposed", {{33, 17}}, [](const V& t) { return mean(transpose(t[0], 0, 1), {1}); }, true, 0, 0,
              3.0});
}

TEST(CudaParity, Matmul) {
  KESTREL_REQUIRE_GPU();
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      std::string n = std::string("mm") + (ta ? "T" : "N") + (tb ? "T" : "N");
      Shape sa = ta ? Shape{67, 33} : Shape{33, 67}, sb = tb ? Shape{45, 67} : Shape{67, 45};
      run_parity({n, {sa, sb}, [ta, tb](const V& t) { return matmul(t[0], t[1], ta, tb); }, true, 0, 0, 4.0});
    }
  run_parity({"bmm", {{3, 17, 64}, {3, 64, 19}}, [](const V& t) { return matmul(t[0], t[1]); }, true, 0, 0, 4.0});
  run_parity({"bmm_shared_b", {{2, 3, 31, 40}, {40, 24}}, [](const V& t) { return matmul(t[0], t[1]); }, true, 0, 0,
              4.0});
  run_parity({"bmm_shared_b_T", {{4, 31, 40}, {24, 40}}, [](const V& t) { return matmul(t[0], t[1], false, true); },
              true, 0, 0, 4.0});
  run_parity({"mm_permuted_batch", {{16, 5, 32}, {5, 32, 16}},
              [](const V& t) { return matmul(permute(t[0], {1, 0, 2}), t[1]); }, true, 0, 0, 4.0});
  run_parity({"mm_strided_copy", {{40, 3, 24}, {24, 8}},
              [](const V& t) { return matmul(narrow(permute(t[0], {1, 0, 2}), 2, 1, 20), narrow(t[1], 0, 2, 20)); },
              true, 0, 0, 4.0});
  run_parity({"linear_bias", {{7, 5, 96}, {130, 96}, {130}}, [](const V& t) { return linear(t[0], t[1], t[2]); },
              true, 0, 0, 4.0});
  run_parity({"matvec", {{1, 300}, {300, 1}}, [](const V& t) { return matmul(t[0], t[1]); }, true, 0, 0, 4.0});
  run_parity({"mm_big", {{1000, 512}, {512, 1001}}, [](const V& t) { return matmul(t[0], t[1]); }, false, 0, 0, 4.0});
}

// matmul's cuBLASLt plan (descriptor, layouts, algorithm) is cached per shape and layout: calls of one
// shape with other operands and another bias (the epilogue's pointer, set per call) each give their
// own product, exact in f32 against f64.
TEST(CudaParity, MatmulCachedPlanTakesEachCallsOperandsAndBias) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  for (int call = 0; call < 3; ++call) {
    Tensor x = testing::randn({37, 96}), w = testing::randn({130, 96}), b = testing::randn({130});
    Tensor want = add(matmul(x.to(DType::F64), w.to(DType::F64), false, true), b.to(DType::F64));
    Tensor got = linear(x.to(gpu), w.to(gpu), b.to(gpu)).to(Device::cpu()).to(DType::F64);
    EXPECT_LE(testing::rel_l2(got, want), 1e-6) << "call " << call;
  }
}

TEST(CudaParity, MatmulF32IsExactUnlessTf32) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  Tensor a = testing::randn({256, 1024}), b = testing::randn({1024, 256});
  Tensor want = matmul(a.to(DType::F64), b.to(DType::F64));
  Tensor exact = matmul(a.to(gpu), b.to(gpu)).to(Device::cpu()).to(DType::F64);
  EXPECT_LE(testing::rel_l2(exact, want), 1e-6);
  const MemoryConfig saved = memory_config(gpu);
  MemoryConfig tf32 = saved;
  tf32.matmul_tf32 = true;
  configure_memory(gpu, tf32);
  Tensor fast = matmul(a.to(gpu), b.to(gpu)).to(Device::cpu()).to(DType::F64);
  configure_memory(gpu, saved);
  double err = testing::rel_l2(fast, want);
  EXPECT_GT(err, 1e-5);  // TF32 really was used
  EXPECT_LE(err, 3e-3);
}

// AdamW on CUDA matches the CPU bit for bit: f32 master, moments, and the bf16 copy (nearest and
// stochastic rounding from the same Philox seed), over several steps and tensors of odd sizes.
TEST(CudaParity, AdamWMatchesCpuBitForBit) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  // Sizes: single element, partial vectors and chunks (the four-wide kernel's tail), several chunks of
  // 8192; f32 gradients without a copy too (the four-wide kernel's other variants). With a seed the
  // generic kernel runs.
  for (uint64_t seed : {uint64_t{0}, uint64_t{1234567}}) {
    for (int64_t n : {1, 1001, 24579, 70001}) {
      for (DType gd : {DType::BF16, DType::F32}) {
        Tensor p = testing::randn({n}), m = Tensor::zeros({n}), v = Tensor::zeros({n});
        Tensor pc = p.clone(), mc = m.clone(), vc = v.clone(), pg = p.to(gpu), mg = m.to(gpu), vg = v.to(gpu);
        Tensor copy_c = Tensor::empty({n}, DType::BF16), copy_g = Tensor::empty({n}, DType::BF16, gpu);
        AdamWOptions o;
        o.lr = 3e-3;
        for (int64_t step = 1; step <= 3; ++step) {
          Tensor g = testing::randn({n}).to(gd);
          const bool copy = gd == DType::BF16;
          adamw_step(pc, g, mc, vc, step, o, copy ? copy_c : Tensor(), seed ? seed + step : 0);
          adamw_step(pg, g.to(gpu), mg, vg, step, o, copy ? copy_g : Tensor(), seed ? seed + step : 0);
        }
        auto bits = [](const Tensor& t) {
          Tensor h = t.to(Device::cpu());
          return std::vector<uint8_t>(static_cast<uint8_t*>(h.data_ptr()), static_cast<uint8_t*>(h.data_ptr()) + h.nbytes());
        };
        EXPECT_EQ(bits(pg), bits(pc)) << "param n=" << n << " seed=" << seed;
        EXPECT_EQ(bits(mg), bits(mc)) << "m n=" << n;
        EXPECT_EQ(bits(vg), bits(vc)) << "v n=" << n;
        if (gd == DType::BF16) EXPECT_EQ(bits(copy_g), bits(copy_c)) << "bf16 copy n=" << n << " seed=" << seed;
      }
    }
  }
  std::vector<Tensor> gc = {testing::randn({1001}), testing::randn({33, 7}).to(DType::BF16)};
  std::vector<Tensor> gg = {gc[0].to(gpu), gc[1].to(gpu)};
  double nc = clip_grad_norm(gc, 0.5), ng = clip_grad_norm(gg, 0.5);
  EXPECT_NEAR(ng, nc, 1e-9 * nc);
  EXPECT_LE(testing::rel_l2(gg[0].to(Device::cpu()), gc[0]), 1e-7);
  EXPECT_LE(testing::rel_l2(gg[1].to(Device::cpu()), gc[1]), 1e-7);
}

TEST(CudaParity, EmbeddingBackwardDeterministic) {
  KESTREL_REQUIRE_GPU();
  const Device gpu = Device::cuda(0);
  // Heavily repeated ids: the deterministic path must be bitwise reproducible and match the CPU.
  std::vector<int64_t> ids(4000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>((i * 7919) % 37);
  Tensor idc = Tensor::from_vector(ids, {4000}), idg = idc.to(gpu);
  Tensor w = testing::randn({300, 96});
  Tensor up = testing::randn({4000, 96});
  auto grad_of = [&](Device d, bool det) {
    Tensor wd = w.to(d);
    wd.set_requires_grad(true);
    Tensor out = embedding(wd, d.is_cuda() ? idg : idc, det);
    autograd::backward({out}, {up.to(d)});
    return wd.grad().to(Device::cpu());
  };
  Tensor cpu = grad_of(Device::cpu(), true), a = grad_of(gpu, true), b = grad_of(gpu, true), at = grad_of(gpu, false);
  auto bits = [](const Tensor& t) {
    return std::vector<uint8_t>(static_cast<uint8_t*>(t.data_ptr()), static_cast<uint8_t*>(t.data_ptr()) + t.nbytes());
  };
  EXPECT_EQ(bits(a), bits(b));
  EXPECT_LE(testing::rel_l2(a, cpu), 1e-6);
  EXPECT_LE(testing::rel_l2(at, cpu), 1e-6);
}

TEST(CudaParity, F64IsAClearError) {
  KESTREL_REQUIRE_GPU();
  Tensor x = Tensor::zeros({4}, DType::F32, Device::cuda(0));
  Tensor xd;
  try {
    xd = Tensor::zeros({4}, DType::F64, Device::cuda(0));
  } catch (const Error&) {
    SUCCEED() << "runtime refuses f64 device tensors";
    return;
  }
  try {
    (void)exp(xd);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("f64"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kestrel
