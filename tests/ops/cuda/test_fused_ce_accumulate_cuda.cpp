// The CUDA backward of fused_linear_cross_entropy from the saved lse: gradients against the f64 CPU
// reference at a vocabulary that spans several 8192-row chunks (with a ragged last one), token counts
// of one and of several token chunks, and accumulation into a held weight gradient.
#include <gtest/gtest.h>

#include "../fused_ce_accumulate_check.h"
#include "support/gpu.h"

namespace kestrel::testing {
namespace {

TEST(FusedCrossEntropyBackwardCuda, AccumulatesIntoTheHeldWeightGradient) {
  KESTREL_REQUIRE_GPU();
  expect_fused_ce_accumulates_in_place(Device::cuda(0), DType::BF16, 300, 64, 20000, 1e-2);
  expect_fused_ce_accumulates_in_place(Device::cuda(0), DType::F32, 129, 32, 9000, 1e-4);
}

// The single CUDA pass (loss and both gradients, three GEMMs) behind known_grad: one token chunk, and
// a vocabulary large enough for several (bf16: 6000 x 100000 keeps ~1.2 GiB of 16-bit rows over the
// launcher's 1 GiB bound, so d_weight is added into per token chunk).
TEST(FusedCrossEntropyBackwardCuda, KnownGradComputesTheGradientsInTheForward) {
  KESTREL_REQUIRE_GPU();
  expect_known_grad_matches_backward(Device::cuda(0), DType::BF16, 300, 64, 20000, 1e-2);
  expect_known_grad_matches_backward(Device::cuda(0), DType::F32, 129, 32, 9000, 1e-4);
  expect_known_grad_matches_backward(Device::cuda(0), DType::BF16, 6000, 16, 100000, 1e-2);
}

TEST(EmbeddingCuda, AccumulatesIntoTheHeldWeightGradient) {
  KESTREL_REQUIRE_GPU();
  expect_embedding_accumulates_in_place(Device::cuda(0), DType::BF16, 700, 96, 301, 1e-2);
  // Rows of 16-byte multiples take the vector reductions (8 bf16 / f16 or 4 f32 per instruction), the
  // others the scalar atomics; many repeats of few rows contend on the same addresses.
  expect_embedding_accumulates_in_place(Device::cuda(0), DType::F16, 900, 40, 13, 1e-2);
  expect_embedding_accumulates_in_place(Device::cuda(0), DType::F32, 900, 36, 13, 1e-5);
  expect_embedding_accumulates_in_place(Device::cuda(0), DType::BF16, 333, 21, 50, 1e-2);
}

TEST(FusedCrossEntropyBackwardCuda, GradientsMatchTheReferenceAcrossChunks) {
  KESTREL_REQUIRE_GPU();
  // 17000 tokens x vocab 8200 at H 64: 17000 tokens exceed one token chunk of the 768 MiB block
  // (bf16: 768 MiB / (8200 x 6 B) ~ 16.3k), so d_weight goes through the f32 [vc, H] block.
  for (auto [n, v] : {std::pair<int64_t, int64_t>{17000, 8200}, {513, 40001}}) {
    Tensor x0 = randn({n, 64}, DType::F32, Device::cpu(), 1.0), w0 = randn({v, 64}, DType::F32, Device::cpu(), 0.05);
    std::vector<int64_t> lab(n);
    for (int64_t i = 0; i < n; ++i) lab[i] = (i * 104729) % v;
    Tensor y = Tensor::from_vector(lab, {n}, DType::I64);
    Tensor x = x0.to(DType::BF16).to(Device::cuda(0)), w = w0.to(DType::BF16).to(Device::cuda(0));
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    autograd::backward(fused_linear_cross_entropy(x, w, y.to(Device::cuda(0))));
    Tensor xr = x0.to(DType::BF16).to(DType::F64), wr = w0.to(DType::BF16).to(DType::F64);
    xr.set_requires_grad(true);
    wr.set_requires_grad(true);
    autograd::backward(fused_linear_cross_entropy(xr, wr, y));
    EXPECT_LT(rel_l2(x.grad().to(Device::cpu()).to(DType::F64), xr.grad()), 1e-2) << "d_hidden n=" << n << " v=" << v;
    EXPECT_LT(rel_l2(w.grad().to(Device::cpu()).to(DType::F64), wr.grad()), 1e-2) << "d_weight n=" << n << " v=" << v;
  }
}

}  // namespace
}  // namespace kestrel::testing
