// The embedded "shapes" image-text dataset: procedurally drawn RGB images of one coloured shape on a
// dark, mildly noisy background, captioned "a red circle at the top left".
//
// Policy: every sample is a pure function of (seed, index) through a counter-based hash (no state,
// no RNG stream to advance), so any sample can be regenerated anywhere, data-parallel ranks need no
// coordination, and a held-out split is just another index range. Labels come with the pixels so
// tests can check that the caption describes what was drawn (the pixel at centre_x/centre_y always
// has the shape's colour).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::train {

struct ShapesConfig {
  int64_t image_size = 32;  // square images, image_size x image_size
  uint64_t seed = 0;
  int noise = 8;  // per-pixel noise amplitude (uniform in [-noise, noise])
  double shape_scale = 1.0;  // shape radius = cell * (0.28 + 0.10 u) * shape_scale, cell = image_size / 3
};

struct ShapeSample {
  std::vector<uint8_t> pixels;  // [H, W, 3] u8 RGB, row-major
  int colour = 0;               // index into ShapesDataset::colour_names()
  int shape = 0;                // index into shape_names()
  int position = 0;             // 0..8, row-major 3x3 grid: 0 = top left, 4 = center, 8 = bottom right
  int64_t centre_x = 0;         // a pixel inside the shape, at its centre
  int64_t centre_y = 0;
  std::string caption;          // "a red circle at the top left"
};

class ShapesDataset {
 public:
  static constexpr int kNumColours = 8;
  static constexpr int kNumShapes = 5;
  static constexpr int kNumPositions = 9;

  explicit ShapesDataset(ShapesConfig config = {});

  const ShapesConfig& config() const { return config_; }
  int64_t image_size() const { return config_.image_size; }
  int64_t image_bytes() const { return config_.image_size * config_.image_size * 3; }

  ShapeSample sample(uint64_t index) const;
  // Draws sample `index` into `out` ([H, W, 3], image_bytes() long) and returns its labels (pixels empty).
  ShapeSample render(uint64_t index, std::span<uint8_t> out) const;

  static const std::array<std::string_view, kNumColours>& colour_names();  // red, green, blue, ...
  static const std::array<std::string_view, kNumShapes>& shape_names();    // square, circle, ...
  static const std::array<std::string_view, kNumPositions>& position_names();  // "top left", ...
  static std::array<uint8_t, 3> colour_rgb(int colour);  // nominal RGB of a colour
  static std::string caption(int colour, int shape, int position);

 private:
  ShapesConfig config_;
};

// Counter-based hash used by the dataset: 64 well-mixed bits from (seed, index, counter).
uint64_t shapes_hash(uint64_t seed, uint64_t index, uint64_t counter);

}  // namespace kestrel::train
