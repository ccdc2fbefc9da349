// Test scratch space: a fresh folder under the system temp dir, removed with its contents when the
// object goes, and whole-file byte reads and writes; the source tree's root (configs/, tools/).
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <system_error>

namespace kestrel::testing {

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix = "kestrel_tmp") {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// The repository's root, from this header's own path (tests/support/ is two levels below it).
inline std::string source_dir() {
  return (std::filesystem::path(__FILE__).parent_path() / ".." / "..").lexically_normal().string();
}

inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

}  // namespace kestrel::testing
