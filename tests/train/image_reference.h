// Test-only reference of the VLM data path's image resampling (test_image_tiling*.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kestrel/train/image_io.h"

namespace kestrel::testing {

// f64 reference of nearest-pixel-centre sampling: output pixel centre (x + 0.5) maps to source
// coordinate (x + 0.5) * W / w, whose pixel is its floor. [h, w, 3] bytes of the [H, W, 3] image.
inline std::vector<uint8_t> reference_resize(const train::Image& img, int64_t w, int64_t h) {
  std::vector<uint8_t> out(static_cast<size_t>(w * h * 3));
  for (int64_t y = 0; y < h; ++y)
    for (int64_t x = 0; x < w; ++x) {
      const int64_t sx =
          std::min<int64_t>(img.width - 1, static_cast<int64_t>(std::floor((x + 0.5) * img.width / double(w))));
      const int64_t sy =
          std::min<int64_t>(img.height - 1, static_cast<int64_t>(std::floor((y + 0.5) * img.height / double(h))));
      for (int k = 0; k < 3; ++k) out[(y * w + x) * 3 + k] = img.pixels[(sy * img.width + sx) * 3 + k];
    }
  return out;
}

}  // namespace kestrel::testing
