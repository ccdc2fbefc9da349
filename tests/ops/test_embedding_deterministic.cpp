// The embedding's deterministic backward (issue 18 item 7: train.deterministic selects it on the
// GPU) checked on the CPU, where both settings run the reference scatter-add: heavily repeated ids
// (one id takes half the positions, as a padding or separator token does) against a float64 sum
// done here, rounded once; the in-place accumulation into a leaf's existing gradient; and the same
// bits whatever the thread count. The GPU kernel's own checks (bitwise twice, against this
// reference) are in tests/ops/cuda/test_deterministic_cuda.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kestrel/autograd/tape.h"
#include "kestrel/ops/embedding.h"
#include "kestrel/runtime/parallel.h"
#include "support/numerics.h"

namespace kestrel {
namespace {

// M ids over [0, V): id 0 at every even position, the others spread (i * 7919) % V.
std::vector<int64_t> skewed_ids(int64_t M, int64_t V) {
  std::vector<int64_t> ids(static_cast<size_t>(M));
  for (int64_t i = 0; i < M; ++i) ids[static_cast<size_t>(i)] = i % 2 == 0 ? 0 : (i * 7919) % V;
  return ids;
}

std::vector<double> as_doubles(const Tensor& t) {
  Tensor f = t.to(DType::F64).contiguous();
  return std::vector<double>(f.data<double>(), f.data<double>() + f.numel());
}

// d_weight [V, C] = base + sum over positions m of up[m, :] at row ids[m], in float64.
std::vector<double> reference_grad(const std::vector<int64_t>& ids, const Tensor& up, int64_t V, int64_t C,
                                   std::vector<double> base = {}) {
  std::vector<double> u = as_doubles(up), g = base.empty() ? std::vector<double>(static_cast<size_t>(V * C), 0.0) : base;
  for (size_t m = 0; m < ids.size(); ++m)
    for (int64_t c = 0; c < C; ++c) g[static_cast<size_t>(ids[m] * C + c)] += u[m * static_cast<size_t>(C) + c];
  return g;
}

// Every element within half a unit in the last place of the float64 value (one rounding), in
// `dtype`: unit roundoff 2^-24 for f32; for bf16 (8 significant bits) 2^-8 plus 2^-24, as the kernel
// narrows f64 to bf16 through f32 (a second rounding that matters only at a bf16 tie).
void expect_rounded_once(const Tensor& got, const std::vector<double>& ref, DType dtype, const char* what) {
  const double u = dtype == DType::F32 ? std::ldexp(1.0, -24) * (1 + 1e-9) : std::ldexp(1.0, -8) + std::ldexp(1.0, -24);
  std::vector<double> g = as_doubles(got);
  ASSERT_EQ(g.size(), ref.size());
  int64_t bad = 0;
  for (size_t i = 0; i < g.size(); ++i)
    if (std::abs(g[i] - ref[i]) > u * std::abs(ref[i]) && bad++ < 3)
      ADD_FAILURE() << what << " " << dtype_name(dtype) << " [" << i << "] got " << g[i] << " float64 sum " << ref[i];
  EXPECT_EQ(bad, 0) << what << ": elements off the once-rounded float64 sum";
}

Tensor weight_grad(const Tensor& w0, const Tensor& ids, const Tensor& up, bool deterministic, int calls = 1) {
  Tensor w = w0.clone();
  w.set_requires_grad(true);
  for (int k = 0; k < calls; ++k) {  // calls > 1: micro-batch accumulation into w.grad in place
    Tensor out = embedding(w, ids, deterministic);
    autograd::backward({out}, {up});
  }
  return w.grad();
}

std::vector<uint8_t> bytes(const Tensor& t) {
  Tensor c = t.contiguous();
  const auto* p = static_cast<const uint8_t*>(c.data_ptr());
  return std::vector<uint8_t>(p, p + c.nbytes());
}

TEST(EmbeddingDeterministic, BackwardIsTheOnceRoundedFloat64Sum) {
  const int64_t V = 61, C = 37, M = 3001;
  const std::vector<int64_t> ids = skewed_ids(M, V);
  for (DType dt : {DType::F32, DType::BF16}) {
    for (DType id_dtype : {DType::I32, DType::I64}) {
      Tensor idt = Tensor::from_vector(ids, {M}, id_dtype);
      Tensor w = testing::randn({V, C}, dt);
      Tensor up = testing::randn({M, C}, dt);
      const std::vector<double> ref = reference_grad(ids, up, V, C);
      for (bool det : {true, false}) {
        Tensor g = weight_grad(w, idt, up, det);
        ASSERT_EQ(g.dtype(), dt);
        expect_rounded_once(g, ref, dt, det ? "deterministic" : "default");
      }
      EXPECT_EQ(bytes(weight_grad(w, idt, up, true)), bytes(weight_grad(w, idt, up, false)));
    }
  }
}

TEST(EmbeddingDeterministic, AccumulatesIntoAnExistingGradientInPlace) {
  // Two micro-batches: the second backward adds into w.grad (no second [V, C] buffer); each adds
  // its float64 sum to the held value and rounds once.
  const int64_t V = 40, C = 24, M = 999;
  const std::vector<int64_t> ids = skewed_ids(M, V);
  Tensor idt = Tensor::from_vector(ids, {M}, DType::I64);
  Tensor w = testing::randn({V, C});
  Tensor up = testing::randn({M, C});
  Tensor g = weight_grad(w, idt, up, true, 2);
  std::vector<double> once = as_doubles(weight_grad(w, idt, up, true, 1));
  expect_rounded_once(g, reference_grad(ids, up, V, C, once), DType::F32, "second micro-batch");
}

TEST(EmbeddingDeterministic, SameBitsForAnyThreadCount) {
  // The CPU scatter-add sums each row's positions in position order, whatever the pool's split.
  const int64_t V = 300, C = 130, M = 20000;
  const std::vector<int64_t> ids = skewed_ids(M, V);
  Tensor idt = Tensor::from_vector(ids, {M}, DType::I64);
  Tensor w = testing::randn({V, C}, DType::BF16);
  Tensor up = testing::randn({M, C}, DType::BF16);
  const int before = num_cpu_threads();
  set_num_cpu_threads(1);
  const std::vector<uint8_t> one = bytes(weight_grad(w, idt, up, true));
  set_num_cpu_threads(3);
  const std::vector<uint8_t> three = bytes(weight_grad(w, idt, up, true));
  set_num_cpu_threads(before);
  EXPECT_EQ(one, three);
}

}  // namespace
}  // namespace kestrel
