// The CUDA kernels' workspace sizing rules (kestrel/ops/workspace_sizes.h), on the CPU: the picker
// stays under its bound, layouts are aligned and ordered, and the numbers the design states hold
// (the lse-based backward at 8k tokens and a 250k vocabulary needs about 0.53 GiB).
#include <gtest/gtest.h>

#include "kestrel/ops/workspace_sizes.h"
#include "kestrel/runtime/error.h"

namespace kestrel {
namespace {
namespace ws = kestrel::workspace;

ws::FusedCrossEntropyShape shape(int64_t tokens, int64_t hidden, int64_t vocab, DType dtype = DType::BF16) {
  ws::FusedCrossEntropyShape s;
  s.dtype = dtype;
  s.tokens = tokens;
  s.hidden = hidden;
  s.vocab = vocab;
  return s;
}

TEST(WorkspaceSizes, CrossEntropyPickerStaysUnderItsBound) {
  for (int64_t tokens : {1, 100, 8192, 65536}) {
    for (int64_t vocab : {8, 32000, 151936, 256000}) {
      for (bool gradients : {false, true}) {
        auto s = shape(tokens, 4096, vocab);
        s.d_hidden = gradients;
        const auto l = ws::resolved_fused_cross_entropy_layout(s);
        EXPECT_LE(l.total, ws::kFusedCrossEntropyBound) << tokens << " x " << vocab;
        EXPECT_GE(l.nc, 1);
        EXPECT_LE(l.nc, tokens);
        EXPECT_EQ(l.vc % 8, 0);
        EXPECT_EQ(l.n_vchunks, (vocab + l.vc - 1) / l.vc);
        for (size_t off : {l.logits, l.pmax, l.psum, l.plsum, l.label_logit, l.row_coef, l.token_loss, l.weight_sum})
          EXPECT_EQ(off % 256, 0u);
        EXPECT_EQ(l.store != 0, gradients);
      }
    }
  }
}

TEST(WorkspaceSizes, CrossEntropyChunksAsGiven) {
  auto s = shape(1000, 64, 1001);
  s.token_chunk = 300;
  s.vocab_chunk = 250;
  const auto c = ws::resolve_fused_cross_entropy_chunks(s);
  EXPECT_EQ(c.token_chunk, 300);
  EXPECT_EQ(c.vocab_chunk, 256);  // rounded up to 8
  EXPECT_EQ(c.gemm_workspace_bytes, ws::kCublasLtWorkspaceBytes);
}

TEST(WorkspaceSizes, CrossEntropyRefusesBadShapesAndTooSmallBounds) {
  EXPECT_THROW(ws::resolve_fused_cross_entropy_chunks(shape(0, 64, 100)), Error);
  EXPECT_THROW(ws::resolve_fused_cross_entropy_chunks(shape(10, 64, 100, DType::I32)), Error);
  EXPECT_THROW(ws::pick_fused_cross_entropy_chunks(shape(10, 64, 100), 1 << 20), Error);
}

TEST(WorkspaceSizes, CrossEntropyBackwardAt8kTokensAnd250kVocabulary) {
  auto s = shape(8192, 4096, 256000);
  s.d_hidden = true;
  s.d_weight = true;
  s.d_weight_f32 = false;
  const auto l = ws::fused_cross_entropy_backward_layout(s);
  EXPECT_EQ(l.nc, 8192);  // one token chunk: d_weight written by its GEMM, no f32 [vc, H] block
  EXPECT_FALSE(l.dw_f32_scratch);
  EXPECT_TRUE(l.dh_f32_scratch);
  const double gib = static_cast<double>(l.total) / double(1 << 30);
  EXPECT_GT(gib, 0.52);
  EXPECT_LT(gib, 0.54);
  // Past one token chunk a 16-bit d_weight goes through one f32 [vc, H] block.
  s.tokens = 65536;
  const auto many = ws::fused_cross_entropy_backward_layout(s);
  EXPECT_LT(many.nc, s.tokens);
  EXPECT_TRUE(many.dw_f32_scratch);
  EXPECT_EQ(many.total - many.dw32, (size_t(many.vc) * 4096 * 4 + 255) / 256 * 256);
}

TEST(WorkspaceSizes, AttentionBackwardAndNormBound) {
  const auto l = ws::attention_backward_layout(100, 3, 64);
  EXPECT_EQ(l.dq_accum, 0u);
  EXPECT_EQ(l.lse2, 76800u);                 // 300 rows x 64 x 4 bytes
  EXPECT_EQ(l.delta, 76800u + 1280u);        // 300 x 4 bytes, 256-aligned
  EXPECT_EQ(l.total, 76800u + 2 * 1280u);
  EXPECT_EQ(ws::norm_backward_max_partial_rows(100, 132), 100);
  EXPECT_EQ(ws::norm_backward_max_partial_rows(1 << 20, 132), 132 * ws::kNormBackwardMaxBlocksPerSm);
}

}  // namespace
}  // namespace kestrel
