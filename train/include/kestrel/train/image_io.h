// Image files for the image-text data path: binary PPM (P6) read/write, and PNG decoding when the
// library is built with libpng.
//
// PNG support is compiled only when KESTREL_WITH_PNG is defined and <png.h> is present (the build
// then has to link libpng); otherwise read_png() throws saying so and png_supported() is false.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kestrel::train {

// The most pixels a decoded image may have (16384 x 16384, 768 MiB as RGB): larger files are refused
// with their name, whatever their size on disk.
inline constexpr int64_t kMaxImagePixels = int64_t{1} << 28;

struct Image {
  int64_t width = 0;
  int64_t height = 0;
  std::vector<uint8_t> pixels;  // [height, width, 3] u8 RGB
};

// Writes a binary PPM (P6, maxval 255) atomically. `rgb` is [height, width, 3].
void write_ppm(const std::string& path, std::span<const uint8_t> rgb, int64_t width, int64_t height);
// Reads a binary PPM (P6, maxval 1..255; '#' comments in the header allowed).
Image read_ppm(const std::string& path);
Image decode_ppm(std::span<const std::byte> bytes, const std::string& source = "<memory>");

bool png_supported();
// Decodes any PNG (grey, palette, alpha, 16-bit) to 8-bit RGB; alpha is dropped.
Image read_png(const std::string& path);
Image decode_png(std::span<const std::byte> bytes, const std::string& source = "<memory>");

// Chooses PPM or PNG by the file's signature.
Image read_image(const std::string& path);

}  // namespace kestrel::train
