// Procedural shapes dataset: one coloured square/circle/triangle/cross/diamond in a cell of a 3x3
// grid, drawn with hard edges (no anti-aliasing, so the colour at the centre is exact up to noise).
//
// Colour separation: the nominal palette colours are >= ~100 apart (Euclidean RGB); per-image colour
// jitter (+-12 per channel) plus per-pixel noise (default +-8) keep every shape pixel nearer its
// own palette colour than any other, which the tests check.
#include "kestrel/train/shapes_dataset.h"

#include <algorithm>
#include <cmath>

#include "kestrel/runtime/error.h"

namespace kestrel::train {

namespace {
constexpr const char* kComp = "shapes_dataset";

uint64_t mix64(uint64_t z) {  // splitmix64 finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Counters of the random draws of one sample (pixel noise uses kNoise + pixel * 3 + channel).
enum Draw : uint64_t { kColour = 1, kShape, kPosition, kJitterX, kJitterY, kRadius, kBackground, kTint, kNoise = 64 };

struct Rng {
  uint64_t seed, index;
  uint64_t bits(uint64_t counter) const { return shapes_hash(seed, index, counter); }
  double uniform(uint64_t counter) const { return static_cast<double>(bits(counter) >> 11) * 0x1.0p-53; }  // [0, 1)
  int below(uint64_t counter, int n) const { return static_cast<int>(bits(counter) % static_cast<uint64_t>(n)); }
  int symmetric(uint64_t counter, int amp) const { return amp == 0 ? 0 : below(counter, 2 * amp + 1) - amp; }
};

// Is the point (dx, dy) from the centre inside shape `shape` of radius r?
bool inside(int shape, double dx, double dy, double r) {
  const double ax = std::fabs(dx), ay = std::fabs(dy);
  switch (shape) {
    case 0: return ax <= 0.85 * r && ay <= 0.85 * r;                                   // square
    case 1: return dx * dx + dy * dy <= r * r;                                         // circle
    case 2: return dy >= -r && dy <= 0.7 * r && ax <= r * (dy + r) / (1.7 * r);        // triangle, apex up
    case 3: return (ax <= 0.3 * r && ay <= r) || (ay <= 0.3 * r && ax <= r);           // cross
    default: return ax + ay <= r;                                                      // diamond
  }
}

uint8_t clamp_u8(int v) { return static_cast<uint8_t>(std::clamp(v, 0, 255)); }
}  // namespace

uint64_t shapes_hash(uint64_t seed, uint64_t index, uint64_t counter) {
  const uint64_t k = mix64(mix64(seed ^ 0x9e3779b97f4a7c15ULL) ^ (index * 0x632be59bd9b4e019ULL + 1));
  return mix64(k + counter * 0xd1342543de82ef95ULL);
}

ShapesDataset::ShapesDataset(ShapesConfig config) : config_(config) {
  KESTREL_CHECK(config_.shape_scale > 0.2 && config_.shape_scale <= 1.6, kComp, "shape_scale must lie in (0.2, 1.6], got ",
                config_.shape_scale);
  KESTREL_CHECK(config_.image_size >= 12 && config_.image_size <= 4096, kComp, "image_size must lie in [12, 4096], got ",
                config_.image_size);
  KESTREL_CHECK(config_.noise >= 0 && config_.noise <= 16, kComp,
                "noise must lie in [0, 16] (more would blur colour names), got ", config_.noise);
}

const std::array<std::string_view, ShapesDataset::kNumColours>& ShapesDataset::colour_names() {
  static const std::array<std::string_view, kNumColours> names = {"red",  "green",   "blue", "yellow",
                                                                  "white", "magenta", "cyan", "orange"};
  return names;
}

const std::array<std::string_view, ShapesDataset::kNumShapes>& ShapesDataset::shape_names() {
  static const std::array<std::string_view, kNumShapes> names = {"square", "circle", "triangle", "cross", "diamond"};
  return names;
}

const std::array<std::string_view, ShapesDataset::kNumPositions>& ShapesDataset::position_names() {
  static const std::array<std::string_view, kNumPositions> names = {
      "top left", "top center", "top right", "middle left", "center", "middle right",
      "bottom left", "bottom center", "bottom right"};
  return names;
}

std::array<uint8_t, 3> ShapesDataset::colour_rgb(int colour) {
  static const uint8_t rgb[kNumColours][3] = {{220, 40, 40},  {40, 200, 60},  {50, 90, 230},  {230, 220, 50},
                                              {235, 235, 235}, {210, 60, 210}, {50, 210, 220}, {240, 140, 30}};
  KESTREL_CHECK(colour >= 0 && colour < kNumColours, kComp, "colour index ", colour, " out of range");
  return {rgb[colour][0], rgb[colour][1], rgb[colour][2]};
}

std::string ShapesDataset::caption(int colour, int shape, int position) {
  KESTREL_CHECK(shape >= 0 && shape < kNumShapes && position >= 0 && position < kNumPositions && colour >= 0 &&
                    colour < kNumColours,
                kComp, "label out of range: colour ", colour, ", shape ", shape, ", position ", position);
  std::string c = "a ";
  c += colour_names()[colour];
  c += ' ';
  c += shape_names()[shape];
  c += " at the ";
  c += position_names()[position];
  return c;
}

ShapeSample ShapesDataset::render(uint64_t index, std::span<uint8_t> out) const {
  const int64_t S = config_.image_size;
  KESTREL_CHECK(static_cast<int64_t>(out.size()) == image_bytes(), kComp, "output buffer has ", out.size(),
                " bytes, an image needs ", image_bytes());
  const Rng rng{config_.seed, index};
  ShapeSample s;
  s.colour = rng.below(kColour, kNumColours);
  s.shape = rng.below(kShape, kNumShapes);
  s.position = rng.below(kPosition, kNumPositions);
  s.caption = caption(s.colour, s.shape, s.position);

  // Geometry in continuous pixel units: pixel (x, y) covers [x, x+1) x [y, y+1).
  const double cell = static_cast<double>(S) / 3.0;
  const int row = s.position / 3, col = s.position % 3;
  const double cx = (col + 0.5) * cell + (rng.uniform(kJitterX) - 0.5) * 0.2 * cell;
  const double cy = (row + 0.5) * cell + (rng.uniform(kJitterY) - 0.5) * 0.2 * cell;
  const double r = cell * (0.28 + 0.10 * rng.uniform(kRadius)) * config_.shape_scale;
  s.centre_x = static_cast<int64_t>(std::floor(cx));
  s.centre_y = static_cast<int64_t>(std::floor(cy));

  const int bg = 8 + rng.below(kBackground, 28);  // dark grey level in [8, 35]
  const auto nominal = colour_rgb(s.colour);
  int fg[3], bgc[3];
  for (int c = 0; c < 3; ++c) {
    fg[c] = nominal[c] + rng.symmetric(kTint + c, 12);
    bgc[c] = bg + rng.symmetric(kTint + 3 + c, 4);
  }
  const int noise = config_.noise;
  for (int64_t y = 0; y < S; ++y) {
    for (int64_t x = 0; x < S; ++x) {
      const bool in = inside(s.shape, static_cast<double>(x) + 0.5 - cx, static_cast<double>(y) + 0.5 - cy, r);
      const uint64_t p = static_cast<uint64_t>(y * S + x);
      uint8_t* px = out.data() + p * 3;  // [y, x, :]
      for (int c = 0; c < 3; ++c)
        px[c] = clamp_u8((in ? fg[c] : bgc[c]) + rng.symmetric(kNoise + p * 3 + static_cast<uint64_t>(c), noise));
    }
  }
  return s;
}

ShapeSample ShapesDataset::sample(uint64_t index) const {
  std::vector<uint8_t> pixels(static_cast<size_t>(image_bytes()));
  ShapeSample s = render(index, pixels);
  s.pixels = std::move(pixels);
  return s;
}

}  // namespace kestrel::train
