// Dynamic high-resolution tiling (kestrel/train/image_tiling.h): the grid of hand-computed cases
// (square, 2:1, extreme ratios, exact ties on both sides of the area rule), a brute-force comparison
// with an independent characterisation of the rule over many (W, H, S, N), and tiles / thumbnail
// equal to crops of an f64 reference resize of random images.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <nlohmann/json.hpp>
#include <tuple>

#include "kestrel/train/image_tiling.h"
#include "kestrel/train/vlm_data.h"
#include "image_reference.h"
#include "support/errors.h"

using namespace kestrel;
using namespace kestrel::train;
using kestrel::testing::error_of;
using kestrel::testing::expect_has;

namespace {

std::tuple<int64_t, int64_t, bool, int64_t> grid_of(int64_t W, int64_t H, int64_t S, int64_t N, bool thumb = true) {
  TileGrid g = choose_tile_grid(W, H, S, ImageTiling{N, thumb});
  return {g.rows, g.cols, g.thumbnail, g.images()};
}

// The rule restated as a set: among the grids whose ratio cols/rows is closest to W/H, the one with
// the most tiles (then the most columns) that has fewer than twice the image's pixels; if none of the
// tied grids has, the one with the fewest tiles (then fewest columns). Distances as exact rationals
// compared by integer cross products; the selection is a set filter, not the library's running best.
std::pair<int64_t, int64_t> reference_grid(int64_t W, int64_t H, int64_t S, int64_t N) {
  struct Cand {
    int64_t r, c;
  };
  std::vector<Cand> all;
  for (int64_t r = 1; r <= N; ++r)
    for (int64_t c = 1; r * c <= N; ++c) all.push_back({r, c});
  // d(r, c) = |W r - H c| / (H r); compare d1 < d2  <=>  |W r1 - H c1| r2 < |W r2 - H c2| r1.
  auto num = [&](const Cand& x) { return std::llabs(W * x.r - H * x.c); };
  auto less = [&](const Cand& a, const Cand& b) { return num(a) * b.r < num(b) * a.r; };
  auto equal = [&](const Cand& a, const Cand& b) { return num(a) * b.r == num(b) * a.r; };
  Cand best = all[0];
  for (const Cand& x : all)
    if (less(x, best)) best = x;
  std::vector<Cand> ties;
  for (const Cand& x : all)
    if (equal(x, best)) ties.push_back(x);
  auto key = [](const Cand& x) { return std::pair{x.r * x.c, x.c}; };
  const Cand* fits = nullptr;
  const Cand* smallest = &ties[0];
  for (const Cand& x : ties) {
    if (key(x) < key(*smallest)) smallest = &x;
    if (2 * W * H > S * S * x.r * x.c && (!fits || key(x) > key(*fits))) fits = &x;
  }
  // The first tied grid (fewest tiles) is chosen by its distance alone, whatever its pixels.
  const Cand& pick = fits && key(*fits) > key(*smallest) ? *fits : *smallest;
  return {pick.r, pick.c};
}

Image random_image(int64_t W, int64_t H, std::mt19937_64& rng) {
  Image img{W, H, std::vector<uint8_t>(static_cast<size_t>(W * H * 3))};
  for (auto& p : img.pixels) p = static_cast<uint8_t>(rng() & 0xff);
  return img;
}

using kestrel::testing::reference_resize;

}  // namespace

TEST(ImageTiling, SquareImageOfTheTowerSizeIsOneTileWithoutThumbnail) {
  // (1,1) and (2,2) are equally close (ratio 1); 2 W H = 401408 is not more than 4 S^2 = 802816, so the
  // single tile stays.
  EXPECT_EQ(grid_of(448, 448, 448, 6), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  EXPECT_EQ(grid_of(448, 448, 448, 1), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  // A large square image: 2 x 1000^2 = 2e6 > 802816, so 2 x 2 tiles and a thumbnail; with 9 tiles
  // allowed, 3 x 3 (2e6 > 9 x 448^2 = 1806336) wins over 2 x 2 as well.
  EXPECT_EQ(grid_of(1000, 1000, 448, 6), std::make_tuple(int64_t{2}, int64_t{2}, true, int64_t{5}));
  EXPECT_EQ(grid_of(1000, 1000, 448, 9), std::make_tuple(int64_t{3}, int64_t{3}, true, int64_t{10}));
  EXPECT_EQ(grid_of(1000, 1000, 448, 3), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  EXPECT_EQ(grid_of(1000, 1000, 448, 6, false), std::make_tuple(int64_t{2}, int64_t{2}, false, int64_t{4}));
}

TEST(ImageTiling, TwoToOneAndExtremeRatios) {
  // 2:1 wide: one row of two tiles (ratio exactly 2); 2 x 4 is as close but needs 2 W H > 8 S^2.
  EXPECT_EQ(grid_of(896, 448, 448, 6), std::make_tuple(int64_t{1}, int64_t{2}, true, int64_t{3}));
  EXPECT_EQ(grid_of(896, 448, 448, 8), std::make_tuple(int64_t{1}, int64_t{2}, true, int64_t{3}));
  EXPECT_EQ(grid_of(1792, 896, 448, 8), std::make_tuple(int64_t{2}, int64_t{4}, true, int64_t{9}));
  EXPECT_EQ(grid_of(1792, 896, 448, 7), std::make_tuple(int64_t{1}, int64_t{2}, true, int64_t{3}));
  // 1:2 tall: two rows of one tile.
  EXPECT_EQ(grid_of(448, 896, 448, 6), std::make_tuple(int64_t{2}, int64_t{1}, true, int64_t{3}));
  // 40:1 and 1:40: the widest (tallest) grid the budget allows.
  EXPECT_EQ(grid_of(4000, 100, 448, 6), std::make_tuple(int64_t{1}, int64_t{6}, true, int64_t{7}));
  EXPECT_EQ(grid_of(100, 4000, 448, 6), std::make_tuple(int64_t{6}, int64_t{1}, true, int64_t{7}));
  EXPECT_EQ(grid_of(4000, 100, 448, 12), std::make_tuple(int64_t{1}, int64_t{12}, true, int64_t{13}));
  // 1 x 1 pixel and a one-pixel-high strip.
  EXPECT_EQ(grid_of(1, 1, 448, 6), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  EXPECT_EQ(grid_of(3000, 1, 14, 4), std::make_tuple(int64_t{1}, int64_t{4}, true, int64_t{5}));
  // 3:2 with 6 tiles: 2 x 3 is exact (ratio 1.5).
  EXPECT_EQ(grid_of(1344, 896, 448, 6), std::make_tuple(int64_t{2}, int64_t{3}, true, int64_t{7}));
}

TEST(ImageTiling, ExactTiesFollowTheAreaRule) {
  // W/H = 1.5 lies exactly between 1 (1 x 1) and 2 (1 x 2): a tie. 1 x 2 replaces 1 x 1 only when
  // 2 W H > 2 S^2. S = 10: 30 x 20 -> 1200 > 200 (two tiles); 6 x 4 -> 48 <= 200 (one).
  EXPECT_EQ(grid_of(30, 20, 10, 2), std::make_tuple(int64_t{1}, int64_t{2}, true, int64_t{3}));
  EXPECT_EQ(grid_of(6, 4, 10, 2), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  // Either side of the bound: 15 x 10 -> 300 > 200 (two tiles); 12 x 8 -> 192 <= 200 (one).
  EXPECT_EQ(grid_of(15, 10, 10, 2), std::make_tuple(int64_t{1}, int64_t{2}, true, int64_t{3}));
  EXPECT_EQ(grid_of(12, 8, 10, 2), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  // W/H = 0.75 between 0.5 (2 x 1) and 1 (1 x 1), tall: 2 rows when large enough.
  EXPECT_EQ(grid_of(30, 40, 10, 2), std::make_tuple(int64_t{2}, int64_t{1}, true, int64_t{3}));
  EXPECT_EQ(grid_of(3, 4, 10, 2), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  // Squares either side of the 2 x 2 bound, S = 5: 2 W H > 4 S^2 = 100: 7 x 7 -> 98 (one), 8 x 8 -> 128 (2 x 2).
  EXPECT_EQ(grid_of(7, 7, 5, 4), std::make_tuple(int64_t{1}, int64_t{1}, false, int64_t{1}));
  EXPECT_EQ(grid_of(8, 8, 5, 4), std::make_tuple(int64_t{2}, int64_t{2}, true, int64_t{5}));
}

TEST(ImageTiling, GridMatchesAnIndependentEnumeration) {
  std::mt19937_64 rng(2401);
  int64_t checked = 0, multi = 0, ties = 0;
  for (int64_t S : {5, 14, 32, 448})
    for (int64_t N = 1; N <= 13; ++N)
      for (int i = 0; i < 300; ++i) {
        // Sizes from a fraction of a tile to several tiles; a third of them on exact small ratios.
        int64_t W = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(5 * S));
        int64_t H = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(5 * S));
        if (i % 3 == 0) {
          const int64_t a = 1 + static_cast<int64_t>(rng() % 7), b = 1 + static_cast<int64_t>(rng() % 7);
          const int64_t k = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(2 * S));
          W = a * k, H = b * k;
        }
        const TileGrid g = choose_tile_grid(W, H, S, ImageTiling{N, true});
        const auto [r, c] = reference_grid(W, H, S, N);
        ASSERT_EQ(std::make_pair(g.rows, g.cols), std::make_pair(r, c)) << W << "x" << H << " S=" << S << " N=" << N;
        ASSERT_LE(g.tiles(), N);
        EXPECT_EQ(g.thumbnail, g.tiles() > 1);
        EXPECT_EQ(g.resized_width, c * S);
        EXPECT_EQ(g.resized_height, r * S);
        // The boxes tile the resized image exactly once, in row-major order.
        ASSERT_EQ(static_cast<int64_t>(g.boxes.size()), r * c);
        for (int64_t k = 0; k < r * c; ++k) {
          EXPECT_EQ(g.boxes[k].x, (k % c) * S);
          EXPECT_EQ(g.boxes[k].y, (k / c) * S);
          EXPECT_EQ(g.boxes[k].width, S);
          EXPECT_EQ(g.boxes[k].height, S);
        }
        ++checked;
        multi += g.tiles() > 1;
        // How often the area rule decided between equally close grids.
        ties += r * c > 1 && std::llabs(W * r - H * c) == std::llabs(W - H) * r;
      }
  EXPECT_EQ(checked, 4 * 13 * 300);
  EXPECT_GT(multi, checked / 3);  // the sweep exercises multi-tile grids, not just 1 x 1
  EXPECT_GT(ties, 50);            // and ties with 1 x 1
}

TEST(ImageTiling, TilesAreCropsOfTheReferenceResize) {
  std::mt19937_64 rng(77);
  for (int trial = 0; trial < 120; ++trial) {
    const int64_t S = 3 + static_cast<int64_t>(rng() % 10);
    const int64_t N = 1 + static_cast<int64_t>(rng() % 9);
    const int64_t W = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(4 * S));
    const int64_t H = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(4 * S));
    const bool thumb = trial % 4 != 3;
    const Image img = random_image(W, H, rng);
    const TileGrid g = choose_tile_grid(W, H, S, ImageTiling{N, thumb});
    const std::vector<std::vector<uint8_t>> tiles = tile_image(img, S, ImageTiling{N, thumb});
    ASSERT_EQ(static_cast<int64_t>(tiles.size()), g.images());
    const std::vector<uint8_t> big = reference_resize(img, g.resized_width, g.resized_height);
    EXPECT_EQ(resize_nearest(img, g.resized_width, g.resized_height), big);
    for (int64_t k = 0; k < g.tiles(); ++k) {
      ASSERT_EQ(static_cast<int64_t>(tiles[k].size()), S * S * 3);
      const TileBox& b = g.boxes[k];
      for (int64_t y = 0; y < S; ++y)
        for (int64_t x = 0; x < S; ++x)
          for (int64_t ch = 0; ch < 3; ++ch)
            ASSERT_EQ(tiles[k][(y * S + x) * 3 + ch], big[((b.y + y) * g.resized_width + b.x + x) * 3 + ch])
                << "tile " << k << " (" << x << ", " << y << ") of " << W << "x" << H << " S=" << S << " N=" << N;
    }
    if (g.thumbnail) {
      // The thumbnail is the whole image at S x S: the image the untiled data path gives the tower.
      EXPECT_EQ(tiles.back(), reference_resize(img, S, S));
      EXPECT_EQ(tiles.back(), resize_nearest(img, S));
    }
    if (g.tiles() == 1) EXPECT_EQ(tiles[0], resize_nearest(img, S));
  }
}

TEST(ImageTiling, BadArgumentsAreRefusedByName) {
  expect_has(error_of([] { choose_tile_grid(0, 5, 4, {}); }), {"image_tiling", "0x5"});
  expect_has(error_of([] { choose_tile_grid(5, 5, 0, {}); }), {"image_tiling", "tile size"});
  expect_has(error_of([] { choose_tile_grid(5, 5, 4, ImageTiling{0, true}); }), {"image_tiling", "max_tiles"});
  expect_has(error_of([] { tile_image(Image{4, 4, std::vector<uint8_t>(10)}, 4, {}); }), {"image_tiling", "10 bytes"});
  nlohmann::json data = {{"image_tiling", {{"max_tiles", 0}, {"thumbnail", true}}}};
  expect_has(error_of([&] { image_tiling_from_config(data); }), {"data.image_tiling.max_tiles", "got 0"});
  data["image_tiling"]["max_tiles"] = 6;
  data["image_tiling"]["thumbnail"] = false;
  EXPECT_EQ(image_tiling_from_config(data), (ImageTiling{6, false}));
}
