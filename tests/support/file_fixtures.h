// Fixtures for tests of the loaders' trust boundaries and file formats: a FIFO watched while a loader
// runs (a hang becomes a failure) and the byte-level pieces of a hand-built PNG.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace kestrel::testing {

// A FIFO at `path`, watched while a loader runs: a reader blocked in open() lets a non-blocking
// writer's open succeed, which both records the hang and releases the reader (so a regression
// fails, it does not hang).
class FifoWatch {
 public:
  explicit FifoWatch(std::string path) : path_(std::move(path)) {
    EXPECT_EQ(::mkfifo(path_.c_str(), 0600), 0) << "mkfifo " << path_;
    thread_ = std::thread([this] {
      while (!stop_) {
        int fd = ::open(path_.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd >= 0) {
          blocked_reader_ = true;
          ::close(fd);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
    });
  }
  ~FifoWatch() {
    stop_ = true;
    thread_.join();
  }
  FifoWatch(const FifoWatch&) = delete;
  FifoWatch& operator=(const FifoWatch&) = delete;
  bool reader_blocked() const { return blocked_reader_; }

 private:
  std::string path_;
  std::atomic<bool> stop_{false}, blocked_reader_{false};
  std::thread thread_;
};

// PNG pieces: CRC-32 (the PNG/zlib polynomial), big-endian words and a chunk {length, type, data, crc}.
inline uint32_t png_crc32(const uint8_t* p, size_t n) {
  uint32_t crc = ~0u;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

inline void put_be32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 3; i >= 0; --i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

inline void png_chunk(std::vector<uint8_t>& out, const char* type, const std::vector<uint8_t>& data) {
  put_be32(out, static_cast<uint32_t>(data.size()));
  std::vector<uint8_t> td(type, type + 4);
  td.insert(td.end(), data.begin(), data.end());
  out.insert(out.end(), td.begin(), td.end());
  put_be32(out, png_crc32(td.data(), td.size()));
}

// A PNG file whose header says w x h 8-bit RGB, holding `idat` (a zlib stream, or anything: the
// trust tests give headers that lie) as its one IDAT chunk.
inline std::vector<uint8_t> png_rgb8_file(uint32_t w, uint32_t h, const std::vector<uint8_t>& idat) {
  std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<uint8_t> ihdr;
  put_be32(ihdr, w);
  put_be32(ihdr, h);
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});
  png_chunk(png, "IHDR", ihdr);
  png_chunk(png, "IDAT", idat);
  png_chunk(png, "IEND", {});
  return png;
}

// An 8-bit RGB PNG built by hand ([h, w, 3] u8 `rgb`): a zlib stream of one stored (uncompressed)
// deflate block, so h * (3w + 1) must stay under 64 KiB.
inline std::vector<uint8_t> encode_png_stored(const std::vector<uint8_t>& rgb, uint32_t w, uint32_t h) {
  std::vector<uint8_t> raw;
  for (uint32_t y = 0; y < h; ++y) {
    raw.push_back(0);  // filter: none
    raw.insert(raw.end(), rgb.begin() + y * w * 3, rgb.begin() + (y + 1) * w * 3);
  }
  std::vector<uint8_t> z = {0x78, 0x01, 0x01, static_cast<uint8_t>(raw.size() & 0xff),
                            static_cast<uint8_t>(raw.size() >> 8), static_cast<uint8_t>(~raw.size() & 0xff),
                            static_cast<uint8_t>((~raw.size() >> 8) & 0xff)};
  z.insert(z.end(), raw.begin(), raw.end());
  uint32_t a = 1, b = 0;
  for (uint8_t v : raw) a = (a + v) % 65521, b = (b + a) % 65521;
  put_be32(z, (b << 16) | a);
  return png_rgb8_file(w, h, z);
}

}  // namespace kestrel::testing
