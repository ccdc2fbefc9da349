// Grid choice, nearest-pixel-centre resize and tile cutting (policy in image_tiling.h).
#include "kestrel/train/image_tiling.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "kestrel/runtime/error.h"

namespace kestrel::train {

namespace {
constexpr const char* kComp = "image_tiling";
using Wide = __int128;  // W * rows * rows' stays exact for any decodable image and kMaxTiles

// Source index of output pixel `o` of `out` along an axis of `in` pixels (nearest pixel centre).
int64_t nearest_source(int64_t o, int64_t in, int64_t out) { return std::min(in - 1, (2 * o + 1) * in / (2 * out)); }
}  // namespace

ImageTiling image_tiling_from_config(const nlohmann::json& data) {
  const nlohmann::json& t = data.at("image_tiling");
  ImageTiling out;
  out.max_tiles = t.at("max_tiles").get<int64_t>();
  out.thumbnail = t.at("thumbnail").get<bool>();
  KESTREL_CHECK(out.max_tiles >= 1 && out.max_tiles <= kMaxTiles, "config", "'data.image_tiling.max_tiles' must be in [1, ",
                kMaxTiles, "] (1 = no tiling), got ", out.max_tiles);
  return out;
}

TileGrid choose_tile_grid(int64_t width, int64_t height, int64_t tile_size, const ImageTiling& tiling) {
  KESTREL_CHECK(width > 0 && height > 0, kComp, "image size must be positive, got ", width, "x", height);
  KESTREL_CHECK(tile_size > 0, kComp, "tile size must be positive, got ", tile_size);
  KESTREL_CHECK(tiling.max_tiles >= 1 && tiling.max_tiles <= kMaxTiles, kComp, "max_tiles must be in [1, ", kMaxTiles,
                "], got ", tiling.max_tiles);
  const Wide W = width, H = height, S2 = Wide{tile_size} * tile_size;
  // |W/H - c/r| = |W r - H c| / (H r); comparing two candidates the common 1/H cancels.
  auto distance = [&](int64_t r, int64_t c) { return W * r > H * c ? W * r - H * c : H * c - W * r; };
  int64_t best_r = 1, best_c = 1;
  bool first = true;
  for (int64_t n = 1; n <= tiling.max_tiles; ++n)
    for (int64_t c = 1; c <= n; ++c) {
      if (n % c) continue;
      const int64_t r = n / c;
      if (first) {
        first = false;
        continue;  // (1, 1) starts as the best
      }
      const Wide lhs = distance(r, c) * best_r, rhs = distance(best_r, best_c) * r;  // d(r,c) vs d(best)
      if (lhs < rhs || (lhs == rhs && 2 * W * H > S2 * n)) best_r = r, best_c = c;
    }
  TileGrid g;
  g.rows = best_r;
  g.cols = best_c;
  g.thumbnail = tiling.thumbnail && g.tiles() > 1;
  g.resized_width = best_c * tile_size;
  g.resized_height = best_r * tile_size;
  for (int64_t r = 0; r < g.rows; ++r)
    for (int64_t c = 0; c < g.cols; ++c) g.boxes.push_back({c * tile_size, r * tile_size, tile_size, tile_size});
  return g;
}

int64_t tiled_image_tokens(int64_t width, int64_t height, int64_t tile_size, const ImageTiling& tiling,
                           int64_t tokens_per_image) {
  return choose_tile_grid(width, height, tile_size, tiling).images() * tokens_per_image;
}

std::vector<uint8_t> resize_nearest(const Image& img, int64_t width, int64_t height) {
  KESTREL_CHECK(width > 0 && height > 0, kComp, "resize to ", width, "x", height, ": size must be positive");
  KESTREL_CHECK(static_cast<int64_t>(img.pixels.size()) == img.width * img.height * 3 && img.width > 0 && img.height > 0,
                kComp, "image of ", img.width, "x", img.height, " holds ", img.pixels.size(), " bytes, not ",
                img.width * img.height * 3);
  if (img.width == width && img.height == height) return img.pixels;
  std::vector<uint8_t> out(static_cast<size_t>(width * height * 3));
  for (int64_t y = 0; y < height; ++y) {
    const uint8_t* row = img.pixels.data() + nearest_source(y, img.height, height) * img.width * 3;
    for (int64_t x = 0; x < width; ++x) {
      const uint8_t* p = row + nearest_source(x, img.width, width) * 3;
      std::copy(p, p + 3, out.data() + (y * width + x) * 3);
    }
  }
  return out;
}

std::vector<std::vector<uint8_t>> tile_image(const Image& img, int64_t tile_size, const ImageTiling& tiling) {
  const TileGrid g = choose_tile_grid(img.width, img.height, tile_size, tiling);
  KESTREL_CHECK(static_cast<int64_t>(img.pixels.size()) == img.width * img.height * 3, kComp, "image of ", img.width,
                "x", img.height, " holds ", img.pixels.size(), " bytes, not ", img.width * img.height * 3);
  const int64_t S = tile_size;
  std::vector<std::vector<uint8_t>> out;
  out.reserve(static_cast<size_t>(g.images()));
  if (g.tiles() == 1) {
    out.push_back(resize_nearest(img, S, S));
    return out;
  }
  for (const TileBox& b : g.boxes) {
    std::vector<uint8_t> tile(static_cast<size_t>(S * S * 3));
    for (int64_t y = 0; y < S; ++y) {
      const int64_t sy = nearest_source(b.y + y, img.height, g.resized_height);
      for (int64_t x = 0; x < S; ++x) {
        const uint8_t* p = img.pixels.data() + (sy * img.width + nearest_source(b.x + x, img.width, g.resized_width)) * 3;
        std::copy(p, p + 3, tile.data() + (y * S + x) * 3);
      }
    }
    out.push_back(std::move(tile));
  }
  if (g.thumbnail) out.push_back(resize_nearest(img, S, S));
  return out;
}

}  // namespace kestrel::train
