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

}  // namespace kestrel::testing
