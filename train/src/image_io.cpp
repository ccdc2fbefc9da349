// PPM (P6) reading/writing and optional libpng decoding into 8-bit RGB images.
#include "kestrel/train/image_io.h"

#include <cctype>
#include <cstring>
#include <new>

#include "kestrel/models/file_io.h"
#include "kestrel/runtime/error.h"

#if defined(KESTREL_WITH_PNG) && __has_include(<png.h>)
#include <png.h>
#define KESTREL_PNG_ENABLED 1
#else
#define KESTREL_PNG_ENABLED 0
#endif

namespace kestrel::train {

namespace {
constexpr const char* kComp = "image";

// Reads one header token of a PPM, skipping whitespace and '#' comments.
std::string ppm_token(std::span<const std::byte> b, size_t& pos, const std::string& source) {
  auto ch = [&](size_t i) { return static_cast<char>(b[i]); };
  while (pos < b.size()) {
    if (ch(pos) == '#') {
      while (pos < b.size() && ch(pos) != '\n') ++pos;
    } else if (std::isspace(static_cast<unsigned char>(ch(pos)))) {
      ++pos;
    } else {
      break;
    }
  }
  std::string tok;
  while (pos < b.size() && !std::isspace(static_cast<unsigned char>(ch(pos))) && ch(pos) != '#') tok += ch(pos++);
  KESTREL_CHECK(!tok.empty(), kComp, "'", source, "': PPM header is truncated");
  return tok;
}

int64_t ppm_int(std::span<const std::byte> b, size_t& pos, const std::string& source, const char* what) {
  const std::string t = ppm_token(b, pos, source);
  for (char c : t) KESTREL_CHECK(std::isdigit(static_cast<unsigned char>(c)), kComp, "'", source, "': PPM ", what, " is not a number");
  KESTREL_CHECK(t.size() <= 9, kComp, "'", source, "': PPM ", what, " has ", t.size(), " digits, too large");
  return std::stoll(t);
}
}  // namespace

void write_ppm(const std::string& path, std::span<const uint8_t> rgb, int64_t width, int64_t height) {
  KESTREL_CHECK(width > 0 && height > 0, kComp, "writing '", path, "': bad size ", width, "x", height);
  KESTREL_CHECK(static_cast<int64_t>(rgb.size()) == width * height * 3, kComp, "writing '", path, "': ", rgb.size(),
                " bytes given for a ", width, "x", height, " RGB image (", width * height * 3, " needed)");
  const std::string header = "P6\n" + std::to_string(width) + " " + std::to_string(height) + "\n255\n";
  models::AtomicFileWriter w(path, kComp);
  w.append(header.data(), header.size());
  w.append(rgb.data(), rgb.size());
  w.commit();
}

Image decode_ppm(std::span<const std::byte> b, const std::string& source) {
  // Errors never quote the file's bytes (it may not be an image at all).
  KESTREL_CHECK(b.size() >= 2 && static_cast<char>(b[0]) == 'P' && static_cast<char>(b[1]) == '6', kComp, "'",
                source, "': not a binary PPM (it does not start with 'P6')");
  size_t pos = 0;
  const std::string magic = ppm_token(b, pos, source);
  KESTREL_CHECK(magic == "P6", kComp, "'", source, "': not a binary PPM (no whitespace after 'P6')");
  Image img;
  img.width = ppm_int(b, pos, source, "width");
  img.height = ppm_int(b, pos, source, "height");
  const int64_t maxval = ppm_int(b, pos, source, "maxval");
  KESTREL_CHECK(img.width > 0 && img.height > 0, kComp, "'", source, "': bad PPM size ", img.width, "x", img.height);
  KESTREL_CHECK(img.width <= kMaxImagePixels / img.height, kComp, "'", source, "': PPM is ", img.width, "x",
                img.height, " pixels, more than the data path's limit of ", kMaxImagePixels,
                " (16384 x 16384); downscale it first");
  KESTREL_CHECK(maxval >= 1 && maxval <= 255, kComp, "'", source, "': PPM maxval ", maxval,
                " not supported (only 8-bit, maxval <= 255)");
  KESTREL_CHECK(pos < b.size(), kComp, "'", source, "': PPM has no pixel data");
  ++pos;  // exactly one whitespace byte separates the header from the pixels
  const int64_t n = img.width * img.height * 3;
  KESTREL_CHECK(static_cast<int64_t>(b.size() - pos) >= n, kComp, "'", source, "': PPM pixel data is truncated (",
                b.size() - pos, " of ", n, " bytes)");
  img.pixels.resize(static_cast<size_t>(n));
  std::memcpy(img.pixels.data(), b.data() + pos, static_cast<size_t>(n));
  if (maxval != 255)
    for (auto& v : img.pixels) v = static_cast<uint8_t>((static_cast<int>(v) * 255 + maxval / 2) / maxval);
  return img;
}

Image read_ppm(const std::string& path) {
  auto map = models::MappedFile::open(path, kComp);
  return decode_ppm(map->bytes(), path);
}

bool png_supported() { return KESTREL_PNG_ENABLED != 0; }

Image decode_png(std::span<const std::byte> bytes, const std::string& source) {
#if KESTREL_PNG_ENABLED
  png_image im;
  std::memset(&im, 0, sizeof(im));
  im.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&im, bytes.data(), bytes.size()))
    throw make_error(kComp, "'", source, "': cannot decode PNG: ", im.message);
  im.format = PNG_FORMAT_RGB;  // libpng converts grey/palette/16-bit and composites alpha on black
  // Sized in 64 bits (PNG_IMAGE_SIZE is 32-bit arithmetic and wraps) and checked against the file
  // before allocating: deflate expands at most ~1032x and a 1-bit grey pixel becomes 3 bytes, so an
  // image larger than 1032 x 24 x the file's bytes is a lie of its header, not a big picture.
  const uint64_t need = uint64_t{im.width} * uint64_t{im.height} * 3;
  const uint64_t most = (uint64_t{bytes.size()} + 64) * 1032 * 24;
  if (need > most) {
    png_image_free(&im);
    throw make_error(kComp, "'", source, "': PNG header claims ", im.width, "x", im.height, " pixels (", need,
                     " bytes as RGB), more than a ", bytes.size(), "-byte PNG can hold");
  }
  // A header within the compression bound can still ask for gigabytes (a 40000 x 40000 1-bit grey PNG
  // fits in ~200 KB); each prefetch thread would decode one.
  if (uint64_t{im.width} * uint64_t{im.height} > static_cast<uint64_t>(kMaxImagePixels)) {
    png_image_free(&im);
    throw make_error(kComp, "'", source, "': PNG is ", im.width, "x", im.height, " pixels, more than the data "
                     "path's limit of ", kMaxImagePixels, " (16384 x 16384); downscale it first");
  }
  Image img;
  img.width = im.width;
  img.height = im.height;
  try {
    img.pixels.resize(static_cast<size_t>(need));
  } catch (const std::bad_alloc&) {
    png_image_free(&im);
    throw make_error(kComp, "'", source, "': out of host memory for a ", im.width, "x", im.height, " image (",
                     need, " bytes)");
  }
  if (!png_image_finish_read(&im, nullptr, img.pixels.data(), 0, nullptr)) {
    std::string why = im.message;
    png_image_free(&im);
    throw make_error(kComp, "'", source, "': cannot decode PNG: ", why);
  }
  return img;
#else
  throw make_error(kComp, "'", source, "': PNG decoding is not available (built without libpng; "
                   "build with KESTREL_WITH_PNG and link libpng, or convert the image to PPM)");
#endif
}

Image read_png(const std::string& path) {
  auto map = models::MappedFile::open(path, kComp);
  return decode_png(map->bytes(), path);
}

Image read_image(const std::string& path) {
  auto map = models::MappedFile::open(path, kComp);
  auto b = map->bytes();
  static const unsigned char png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (b.size() >= 8 && std::memcmp(b.data(), png_sig, 8) == 0) return decode_png(b, path);
  if (b.size() >= 2 && static_cast<char>(b[0]) == 'P' && static_cast<char>(b[1]) == '6') return decode_ppm(b, path);
  throw make_error(kComp, "'", path, "': unknown image format (expected PNG or binary PPM)");
}

}  // namespace kestrel::train
