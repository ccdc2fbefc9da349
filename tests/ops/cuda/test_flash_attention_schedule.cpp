// The persistent forward's work list (tile_scheduler.h: fwd_work_at, fwd_work_index_at,
// fwd_section_pairs), checked on the host: for many grid sizes and list lengths every block walks
// increasing indices and stops at its first index past the list, every item is walked by exactly one
// block, the items map one to one onto (query tile, head, document), section by section with the
// query tiles in non-increasing bands inside each, and the sections hold whole GQA groups whose K/V
// fit in half the L2. No GPU needed: the kernels call the same functions with blockIdx.x / gridDim.x.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <tuple>
#include <vector>

#include "cuda/flash_attention/tile_scheduler.h"

namespace kestrel::cuda::fa {
namespace {

TEST(FlashAttentionSchedule, EveryItemIsWalkedByExactlyOneBlock) {
  for (int grid : {1, 2, 3, 7, 131, 132, 133, 1000}) {
    for (int n_work : {1, 2, 5, 131, 132, 133, 263, 264, 265, 1000, 4113}) {
      std::vector<int> seen(n_work, 0);
      for (int b = 0; b < grid; ++b) {
        int last = -1;
        for (int r = 0;; ++r) {
          const int w = fwd_work_index_at(r, b, grid);
          if (w >= n_work) break;
          ASSERT_GT(w, last) << "grid " << grid << " block " << b << " round " << r;
          ASSERT_GE(w, r * grid);
          ASSERT_LT(w, (r + 1) * grid);  // one item per block per round
          last = w;
          ++seen[w];
        }
        // The loop's exit is final: no later round of this block lands inside the list.
        int exit_round = 0;
        while (fwd_work_index_at(exit_round, b, grid) < n_work) ++exit_round;
        for (int r = exit_round; r < exit_round + 4; ++r) ASSERT_GE(fwd_work_index_at(r, b, grid), n_work);
      }
      for (int w = 0; w < n_work; ++w) ASSERT_EQ(seen[w], 1) << "grid " << grid << " n_work " << n_work << " item " << w;
    }
  }
}

TEST(FlashAttentionSchedule, SnakeOrderAlternatesTheBlocksOfEachRound) {
  const int grid = 5;
  EXPECT_EQ(fwd_work_index_at(0, 0, grid), 0);
  EXPECT_EQ(fwd_work_index_at(0, 4, grid), 4);
  EXPECT_EQ(fwd_work_index_at(1, 0, grid), 9);  // odd round: block 0 takes the round's last item
  EXPECT_EQ(fwd_work_index_at(1, 4, grid), 5);
  EXPECT_EQ(fwd_work_index_at(2, 0, grid), 10);
  // Over rounds 0 and 1 every block's two indices sum to the same value: b + (2 * grid - 1 - b).
  for (int b = 0; b < grid; ++b) EXPECT_EQ(fwd_work_index_at(0, b, grid) + fwd_work_index_at(1, b, grid), 2 * grid - 1);
}

TEST(FlashAttentionSchedule, ItemsMapOneToOneOntoTilesHeadsAndDocumentsSectionBySectionHeaviestBandFirst) {
  for (auto [heads, docs, n_qtiles] : {std::tuple{1, 1, 1}, std::tuple{32, 2, 64}, std::tuple{12, 3, 16},
                                       std::tuple{7, 5, 3}}) {
    const int pairs = heads * docs, n_work = pairs * n_qtiles;
    for (int section : {1, 2, 3, 8, pairs - 1, pairs, pairs + 5}) {
      if (section < 1) continue;
      std::set<std::tuple<int, int, int>> items;
      int prev_sec = -1, prev_m = n_qtiles;
      for (int w = 0; w < n_work; ++w) {
        const FwdWork it = fwd_work_at(heads, docs, n_qtiles, section, w);
        ASSERT_GE(it.h, 0);
        ASSERT_LT(it.h, heads);
        ASSERT_GE(it.doc, 0);
        ASSERT_LT(it.doc, docs);
        ASSERT_GE(it.m, 0);
        ASSERT_LT(it.m, n_qtiles);
        // The item's pair lies in its section, and the sections come in order, each walked whole.
        const int pair = it.doc * heads + it.h, sec = pair / section;
        ASSERT_GE(sec, prev_sec) << "sections in order";
        if (sec != prev_sec) {
          ASSERT_EQ(w, sec * section * n_qtiles) << "a section starts after the previous one's every item";
          prev_m = n_qtiles;
        }
        ASSERT_LE(it.m, prev_m) << "inside a section, query tiles in non-increasing bands (heaviest causal first)";
        prev_sec = sec;
        prev_m = it.m;
        items.insert({it.h, it.m, it.doc});
      }
      EXPECT_EQ(static_cast<int>(items.size()), n_work)
          << heads << " heads, " << docs << " docs, " << n_qtiles << " tiles, section " << section;
    }
  }
}

TEST(FlashAttentionSchedule, SectionsHoldWholeGqaGroupsWhoseKeysAndValuesFitInHalfTheL2) {
  FlashAttentionParams p{};
  p.num_heads_q = 32;
  p.num_heads_kv = 8;
  p.num_docs = 2;
  p.head_dim = 128;
  p.max_seqlen_k = 8192;
  const int64_t l2 = int64_t{50} << 20;  // an H100 / H200: 50 MiB
  // K and V of one KV head of one document: 8192 x 128 x 2 bytes x 2 = 4 MiB; half the L2 holds 6.
  EXPECT_EQ(fwd_section_pairs(p, l2), 6 * 4);
  p.max_seqlen_k = 1 << 20;  // one KV head is larger than the budget: one group per section
  EXPECT_EQ(fwd_section_pairs(p, l2), 4);
  p.max_seqlen_k = 128;  // everything fits: one section
  EXPECT_EQ(fwd_section_pairs(p, l2), 64);
  for (int seqlen : {1, 100, 4096, 8192, 65536})
    for (int kv : {1, 2, 8, 32}) {
      p.num_heads_kv = kv;
      p.max_seqlen_k = seqlen;
      const int s = fwd_section_pairs(p, l2);
      EXPECT_GE(s, 1);
      EXPECT_LE(s, p.num_heads_q * p.num_docs);
      if (s < p.num_heads_q * p.num_docs) EXPECT_EQ(s % (p.num_heads_q / kv), 0) << "whole GQA groups";
    }
}

}  // namespace
}  // namespace kestrel::cuda::fa
