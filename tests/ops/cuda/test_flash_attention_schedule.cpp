// The persistent forward's work list (tile_scheduler.h: fwd_work_at, fwd_work_index_at), checked on
// the host: for many grid sizes and list lengths every block walks increasing indices and stops at
// its first index past the list, every item is walked by exactly one block, and the items map one to
// one onto (query tile, head, document) with the query tiles in non-increasing bands. No GPU needed:
// the kernels call the same functions with blockIdx.x / gridDim.x.
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

TEST(FlashAttentionSchedule, ItemsMapOneToOneOntoTilesHeadsAndDocumentsHeaviestBandFirst) {
  for (auto [heads, docs, n_qtiles] : {std::tuple{1, 1, 1}, std::tuple{32, 2, 64}, std::tuple{12, 3, 16},
                                       std::tuple{7, 5, 3}}) {
    std::set<std::tuple<int, int, int>> items;
    int prev_m = n_qtiles;
    const int n_work = heads * docs * n_qtiles;
    for (int w = 0; w < n_work; ++w) {
      const FwdWork it = fwd_work_at(heads, docs, n_qtiles, w);
      ASSERT_GE(it.h, 0);
      ASSERT_LT(it.h, heads);
      ASSERT_GE(it.doc, 0);
      ASSERT_LT(it.doc, docs);
      ASSERT_GE(it.m, 0);
      ASSERT_LT(it.m, n_qtiles);
      ASSERT_LE(it.m, prev_m) << "query tiles in non-increasing bands (heaviest causal tiles first)";
      prev_m = it.m;
      items.insert({it.h, it.m, it.doc});
    }
    EXPECT_EQ(static_cast<int>(items.size()), n_work) << heads << " heads, " << docs << " docs, " << n_qtiles << " tiles";
  }
}

}  // namespace
}  // namespace kestrel::cuda::fa
