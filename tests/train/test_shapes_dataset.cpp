// Shapes dataset: determinism from (seed, index), label coverage, and captions checked against the
// drawn pixels (colour at the centre, shape cell from the pixel centroid, shape kind from the mask).
// Also PPM round trips and PNG decoding of a hand-built file (when built with libpng).
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "kestrel/runtime/error.h"
#include "kestrel/train/image_io.h"
#include "kestrel/train/shapes_dataset.h"
#include "support/file_fixtures.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::train;

using kestrel::testing::TempDir;

namespace {
int nearest_colour(const uint8_t* px) {
  int best = -1;
  double best_d = 1e30;
  for (int c = 0; c < ShapesDataset::kNumColours; ++c) {
    auto rgb = ShapesDataset::colour_rgb(c);
    double d = 0;
    for (int k = 0; k < 3; ++k) d += (double(px[k]) - rgb[k]) * (double(px[k]) - rgb[k]);
    if (d < best_d) best_d = d, best = c;
  }
  return best;
}

// Shape kind from the foreground mask's geometry (see the fill ratios in the dataset's geometry).
int classify_shape(const std::vector<uint8_t>& mask, int64_t S) {
  int64_t x0 = S, y0 = S, x1 = -1, y1 = -1, count = 0;
  for (int64_t y = 0; y < S; ++y)
    for (int64_t x = 0; x < S; ++x)
      if (mask[y * S + x]) x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y), ++count;
  const double w = double(x1 - x0 + 1), h = double(y1 - y0 + 1);
  const double fill = double(count) / (w * h);
  if (fill > 0.9) return 0;   // square
  if (fill > 0.68) return 1;  // circle (pi/4)
  int64_t top = 0, bottom = 0;
  const double mid = (y0 + y1 + 1) / 2.0;
  for (int64_t y = y0; y <= y1; ++y)
    for (int64_t x = x0; x <= x1; ++x)
      if (mask[y * S + x]) (y + 0.5 < mid ? top : bottom) += 1;
  if (bottom > 1.5 * top) return 2;  // triangle, apex up
  // Diamond covers (-0.45r, -0.45r) from the centre; the cross's arms (half-width 0.3r) do not.
  const int64_t px = static_cast<int64_t>(x0 + 0.275 * w), py = static_cast<int64_t>(y0 + 0.275 * h);
  return mask[py * S + px] ? 4 : 3;
}
}  // namespace

TEST(ShapesDataset, DeterministicFromSeedAndIndex) {
  ShapesDataset a({32, 7, 8}), b({32, 7, 8}), other({32, 8, 8});
  for (uint64_t i : {0ull, 1ull, 12345ull, (1ull << 40) + 3}) {
    ShapeSample x = a.sample(i), y = b.sample(i);
    EXPECT_EQ(x.pixels, y.pixels);
    EXPECT_EQ(x.caption, y.caption);
    EXPECT_EQ(x.pixels.size(), 32u * 32u * 3u);
  }
  // Generation order does not matter (counter-based, no stream state).
  EXPECT_EQ(b.sample(5).pixels, a.sample(5).pixels);
  int same_seed_diff = 0, same_index_diff = 0;
  for (uint64_t i = 0; i < 50; ++i) {
    same_index_diff += a.sample(i).pixels != other.sample(i).pixels;
    same_seed_diff += a.sample(i).pixels != a.sample(i + 1000000).pixels;
  }
  EXPECT_EQ(same_index_diff, 50);
  EXPECT_EQ(same_seed_diff, 50);
  std::vector<uint8_t> buf(a.image_bytes());
  ShapeSample labels = a.render(3, buf);
  EXPECT_EQ(buf, a.sample(3).pixels);
  EXPECT_TRUE(labels.pixels.empty());
  EXPECT_THROW(a.render(3, std::span<uint8_t>(buf.data(), buf.size() - 1)), Error);
  EXPECT_THROW(ShapesDataset({4, 0, 8}), Error);
}

TEST(ShapesDataset, CaptionsMatchPixels) {
  for (int64_t S : {32, 128}) {
    ShapesDataset ds({S, 2024, 8});
    std::array<int, ShapesDataset::kNumColours> colours{};
    std::array<int, ShapesDataset::kNumShapes> shapes{};
    std::array<int, ShapesDataset::kNumPositions> positions{};
    const int n = S == 32 ? 1500 : 200;
    for (int i = 0; i < n; ++i) {
      ShapeSample s = ds.sample(static_cast<uint64_t>(i));
      SCOPED_TRACE(s.caption);
      colours[s.colour]++, shapes[s.shape]++, positions[s.position]++;
      ASSERT_EQ(s.caption, "a " + std::string(ShapesDataset::colour_names()[s.colour]) + " " +
                               std::string(ShapesDataset::shape_names()[s.shape]) + " at the " +
                               std::string(ShapesDataset::position_names()[s.position]));
      // The colour at the shape's centre is the caption's colour.
      const uint8_t* centre = s.pixels.data() + (s.centre_y * S + s.centre_x) * 3;
      ASSERT_EQ(nearest_colour(centre), s.colour);
      // Foreground = bright pixels (every palette colour has a channel >= 200; the background <= 35 + noise).
      std::vector<uint8_t> mask(S * S);
      double sx = 0, sy = 0, cnt = 0;
      for (int64_t p = 0; p < S * S; ++p) {
        const uint8_t* px = s.pixels.data() + p * 3;
        const int mx = std::max({px[0], px[1], px[2]});
        ASSERT_TRUE(mx > 150 || mx < 60) << "ambiguous pixel value " << mx;
        if (mx > 150) {
          ASSERT_EQ(nearest_colour(px), s.colour);
          mask[p] = 1, sx += p % S + 0.5, sy += p / S + 0.5, cnt += 1;
        }
      }
      ASSERT_GT(cnt, 4);
      // The shape's centroid lies in the caption's cell of the 3x3 grid.
      const int col = std::min(2, static_cast<int>(sx / cnt / (S / 3.0)));
      const int row = std::min(2, static_cast<int>(sy / cnt / (S / 3.0)));
      ASSERT_EQ(row * 3 + col, s.position);
      // Large images: the mask's geometry says which shape it is.
      if (S == 128) ASSERT_EQ(classify_shape(mask, S), s.shape);
    }
    if (S == 32) {
      for (int c : colours) EXPECT_GT(c, n / ShapesDataset::kNumColours / 2);
      for (int c : shapes) EXPECT_GT(c, n / ShapesDataset::kNumShapes / 2);
      for (int c : positions) EXPECT_GT(c, n / ShapesDataset::kNumPositions / 2);
    }
  }
  EXPECT_EQ(ShapesDataset::caption(0, 1, 0), "a red circle at the top left");
  EXPECT_EQ(ShapesDataset::caption(2, 0, 4), "a blue square at the center");
  EXPECT_EQ(ShapesDataset::caption(3, 2, 8), "a yellow triangle at the bottom right");
}

// ---- image files ----

namespace {

// An 8-bit RGB PNG built by hand (one stored deflate block).
std::vector<uint8_t> make_png(const std::vector<uint8_t>& rgb, uint32_t w, uint32_t h) {
  return kestrel::testing::encode_png_stored(rgb, w, h);
}
}  // namespace

TEST(ImageIo, PpmRoundTripAndErrors) {
  TempDir dir;
  ShapesDataset ds({32, 1, 8});
  ShapeSample s = ds.sample(9);
  write_ppm(dir.file("s.ppm"), s.pixels, 32, 32);
  Image img = read_ppm(dir.file("s.ppm"));
  EXPECT_EQ(img.width, 32);
  EXPECT_EQ(img.height, 32);
  EXPECT_EQ(img.pixels, s.pixels);
  EXPECT_EQ(read_image(dir.file("s.ppm")).pixels, s.pixels);

  // Comments and a non-255 maxval (rescaled to 8 bits).
  { std::ofstream(dir.file("c.ppm"), std::ios::binary) << "P6\n# made by hand\n2 1 # size\n15\n" << std::string("\x0f\x00\x07\x0f\x0f\x0f", 6); }
  Image c = read_ppm(dir.file("c.ppm"));
  EXPECT_EQ(c.pixels, (std::vector<uint8_t>{255, 0, 119, 255, 255, 255}));

  { std::ofstream(dir.file("t.ppm"), std::ios::binary) << "P6\n4 4\n255\n" << std::string(10, 'x'); }
  try {
    read_ppm(dir.file("t.ppm"));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("t.ppm"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  { std::ofstream(dir.file("p3.ppm"), std::ios::binary) << "P3\n1 1\n255\n1 2 3\n"; }
  EXPECT_THROW(read_ppm(dir.file("p3.ppm")), Error);
  EXPECT_THROW(write_ppm(dir.file("bad.ppm"), s.pixels, 31, 32), Error);
}

TEST(ImageIo, PngDecode) {
  TempDir dir;
  std::mt19937 rng(3);
  const uint32_t w = 7, h = 5;
  std::vector<uint8_t> rgb(w * h * 3);
  for (auto& v : rgb) v = static_cast<uint8_t>(rng());
  auto png = make_png(rgb, w, h);
  std::ofstream(dir.file("x.png"), std::ios::binary).write(reinterpret_cast<const char*>(png.data()), png.size());
  if (!png_supported()) {
    try {
      read_png(dir.file("x.png"));
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("without libpng"), std::string::npos) << e.what();
    }
    GTEST_SKIP() << "built without libpng (KESTREL_WITH_PNG undefined)";
  }
  Image img = read_image(dir.file("x.png"));
  EXPECT_EQ(img.width, w);
  EXPECT_EQ(img.height, h);
  EXPECT_EQ(img.pixels, rgb);
  png[50] ^= 0xff;  // corrupt the IDAT payload: its CRC no longer matches
  std::ofstream(dir.file("bad.png"), std::ios::binary).write(reinterpret_cast<const char*>(png.data()), png.size());
  EXPECT_THROW(read_png(dir.file("bad.png")), Error);
}
