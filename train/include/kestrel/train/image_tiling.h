// Dynamic high-resolution tiling of an image for a vision tower of S x S inputs (InternVL's dynamic
// preprocessing): the image is resized to a grid of rows x cols tiles of S x S chosen by its aspect
// ratio, cut into those tiles in row-major order, and, when there is more than one tile, followed by
// a thumbnail (the whole image resized to S x S). Each tile and the thumbnail is one image for the
// tower (one attention document), so a record carries images() x tokens_per_image image-token slots.
//
// Grid policy (choose_tile_grid): the candidates are every (rows, cols) with rows * cols <= max_tiles,
// ordered by tile count, then by cols. The best is the candidate whose ratio cols / rows is closest to
// the image's W / H; a later candidate with an equally close ratio replaces it only when the image
// has more than half the candidate's pixels (2 W H > S^2 rows cols), so a small square image stays one
// tile and a large one uses 2 x 2. Ratios are compared exactly (integer cross-multiplication), never
// in floating point, so ties are ties. max_tiles 1 is the untiled path: one S x S image, no thumbnail.
//
// Resampling: nearest pixel centre, the rule the data path already uses (resize_nearest), so the
// thumbnail is exactly the image the untiled path feeds the tower.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <vector>

#include "kestrel/train/image_io.h"

namespace kestrel::train {

// data.image_tiling: {"max_tiles": N, "thumbnail": true|false}.
struct ImageTiling {
  int64_t max_tiles = 1;  // 1: off (the image resized to one tile)
  bool thumbnail = true;  // append the whole image at S x S when the grid has more than one tile
  bool enabled() const { return max_tiles > 1; }
  bool operator==(const ImageTiling&) const = default;
};
// Reads data.image_tiling from a resolved train config's "data" object (keys and types already
// checked by the schema); a max_tiles outside [1, kMaxTiles] is an error naming the key.
ImageTiling image_tiling_from_config(const nlohmann::json& data);
inline constexpr int64_t kMaxTiles = 256;

struct TileBox {
  int64_t x = 0, y = 0;  // top-left corner in the resized image
  int64_t width = 0, height = 0;
};

struct TileGrid {
  int64_t rows = 1, cols = 1;
  bool thumbnail = false;
  int64_t resized_width = 0, resized_height = 0;  // cols * S, rows * S
  std::vector<TileBox> boxes;                     // rows * cols crops of the resized image, row-major
  int64_t tiles() const { return rows * cols; }
  // Images the tower sees for this picture: the tiles, then the thumbnail.
  int64_t images() const { return rows * cols + (thumbnail ? 1 : 0); }
};

// The grid for a width x height image and S x S tiles (the policy above).
TileGrid choose_tile_grid(int64_t width, int64_t height, int64_t tile_size, const ImageTiling& tiling);

// Image-token slots of one picture: images() x tokens_per_image.
int64_t tiled_image_tokens(int64_t width, int64_t height, int64_t tile_size, const ImageTiling& tiling,
                           int64_t tokens_per_image);

// Nearest-pixel-centre resize of an RGB image to width x height ([height, width, 3] u8; a copy when
// the size is unchanged): output pixel (x, y) reads source (min(W-1, (2x+1)W / 2w), likewise y).
std::vector<uint8_t> resize_nearest(const Image& img, int64_t width, int64_t height);

// The tower's images of one picture, each S x S x 3 u8: the grid's tiles in row-major order, then the
// thumbnail. A tile equals the crop of resize_nearest(img, cols*S, rows*S) at its box (computed
// directly, without the full resized image).
std::vector<std::vector<uint8_t>> tile_image(const Image& img, int64_t tile_size, const ImageTiling& tiling);

}  // namespace kestrel::train
