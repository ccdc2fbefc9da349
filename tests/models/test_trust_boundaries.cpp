// Trust boundaries of the model loaders (issue 18 item 4), each test written as the failure it
// prevents: a sharded index naming a file outside its folder ("../../x", an absolute path, a
// symlink out) was opened; its errors quoted the first bytes of the file read; a FIFO named by an
// index or as a config hung the process in open().
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "kestrel/models/config.h"
#include "kestrel/models/file_io.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"
#include "support/errors.h"
#include "support/file_fixtures.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::models;

using kestrel::testing::error_of;
using kestrel::testing::expect_has;
using kestrel::testing::TempDir;

namespace {

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

// One valid single-tensor safetensors file at `p` (the "secret" an index must not reach).
void write_valid_shard(const fs::path& p, const std::string& tensor) {
  static const float x[2] = {1.f, 2.f};
  write_safetensors(p.string(), {{tensor, DType::F32, {2}, x}});
}

void write_index(const fs::path& p, const std::string& tensor, const std::string& shard) {
  nlohmann::json j;
  j["metadata"] = {{"total_size", 8}};
  j["weight_map"] = {{tensor, shard}};
  write_text(p, j.dump());
}

using kestrel::testing::FifoWatch;

}  // namespace

TEST(TrustBoundaries, IndexEntryClimbingOutOfItsFolderIsRefused) {
  TempDir t;
  fs::create_directories(t.path / "model");
  write_valid_shard(t.path / "outside.safetensors", "w");  // would load fine if it were opened
  for (const std::string& shard : {std::string("../outside.safetensors"), std::string("../../x.safetensors"),
                                   std::string("sub/../../outside.safetensors")}) {
    write_index(t.path / "model" / "model.safetensors.index.json", "w", shard);
    const std::string msg = error_of([&] { SafetensorsReader::open((t.path / "model").string()); });
    expect_has(msg, {"[safetensors]", "model.safetensors.index.json", shard, "climbs out of its folder"});
  }
}

TEST(TrustBoundaries, IndexEntryWithAbsolutePathIsRefused) {
  TempDir t;
  fs::create_directories(t.path / "model");
  const std::string abs = (t.path / "outside.safetensors").string();
  write_valid_shard(abs, "w");
  write_index(t.path / "model" / "model.safetensors.index.json", "w", abs);
  const std::string msg = error_of([&] { SafetensorsReader::open((t.path / "model").string()); });
  expect_has(msg, {"model.safetensors.index.json", abs, "absolute path"});
}

TEST(TrustBoundaries, IndexEntryThroughSymlinkOutOfItsFolderIsRefused) {
  TempDir t;
  fs::create_directories(t.path / "model");
  fs::create_directories(t.path / "elsewhere");
  write_valid_shard(t.path / "elsewhere" / "w.safetensors", "w");
  fs::create_symlink(t.path / "elsewhere" / "w.safetensors", t.path / "model" / "link.safetensors");
  fs::create_directory_symlink(t.path / "elsewhere", t.path / "model" / "sub");
  for (const std::string& shard : {std::string("link.safetensors"), std::string("sub/w.safetensors")}) {
    write_index(t.path / "model" / "model.safetensors.index.json", "w", shard);
    const std::string msg = error_of([&] { SafetensorsReader::open((t.path / "model").string()); });
    expect_has(msg, {"model.safetensors.index.json", shard, "outside its folder"});
  }
  // Symlinks that stay inside the folder are fine.
  fs::create_directories(t.path / "model" / "shards");
  write_valid_shard(t.path / "model" / "shards" / "real.safetensors", "w");
  fs::create_symlink("shards/real.safetensors", t.path / "model" / "inner.safetensors");
  write_index(t.path / "model" / "model.safetensors.index.json", "w", "inner.safetensors");
  EXPECT_EQ(SafetensorsReader::open((t.path / "model").string()).get("w").numel(), 2);
}

// The Hugging Face hub cache keeps files in <repo>/blobs and links them from snapshots/<rev>/:
// confinement must not break loading from it.
TEST(TrustBoundaries, HubCacheSnapshotSymlinksIntoBlobsLoad) {
  TempDir t;
  const fs::path repo = t.path / "models--org--tiny";
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "snapshots" / "abc123");
  write_valid_shard(repo / "blobs" / "0f1e2d", "w");
  write_index(repo / "blobs" / "9a8b7c", "w", "model-00001-of-00001.safetensors");
  fs::create_symlink("../../blobs/0f1e2d", repo / "snapshots" / "abc123" / "model-00001-of-00001.safetensors");
  fs::create_symlink("../../blobs/9a8b7c", repo / "snapshots" / "abc123" / "model.safetensors.index.json");
  auto r = SafetensorsReader::open((repo / "snapshots" / "abc123").string());
  EXPECT_EQ(r.get("w").numel(), 2);
  // ... but not into another repo's blobs, nor anywhere else from the cache.
  fs::create_directories(t.path / "models--other" / "blobs");
  write_valid_shard(t.path / "models--other" / "blobs" / "ff", "w");
  fs::remove(repo / "snapshots" / "abc123" / "model-00001-of-00001.safetensors");
  fs::create_symlink("../../../models--other/blobs/ff", repo / "snapshots" / "abc123" / "model-00001-of-00001.safetensors");
  expect_has(error_of([&] { SafetensorsReader::open((repo / "snapshots" / "abc123").string()); }),
             {"outside its folder"});
}

// An index naming a file that is not safetensors: the error says so without quoting it.
TEST(TrustBoundaries, ErrorsNeverQuoteTheBytesOfTheFileRead) {
  TempDir t;
  const std::string secret = "SECRETKEY-hunter2-0123456789";
  const std::vector<std::pair<std::string, std::string>> files = {
      {"plain.txt", secret + "\n"},                         // header length = its first 8 bytes
      {"short.bin", std::string("\x10\0\0\0\0\0\0\0", 8) + "{" + secret + "}"},  // header JSON broken
      {"number.bin", std::string("\x0c\0\0\0\0\0\0\0", 8) + "[1e99999999]"},    // number overflow
  };
  for (const auto& [name, bytes] : files) {
    write_text(t.path / name, bytes);
    write_index(t.path / "model.safetensors.index.json", "w", name);
    const std::string msg = error_of([&] { SafetensorsReader::open(t.path.string()); });
    expect_has(msg, {name});
    EXPECT_EQ(msg.find("SECRET"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("hunter2"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("99999"), std::string::npos) << msg;
    // The first 8 bytes as a number are the bytes too.
    uint64_t first8 = 0;
    for (int i = 7; i >= 0; --i) first8 = (first8 << 8) | static_cast<unsigned char>(bytes[i]);
    if (first8 > kSafetensorsMaxHeaderBytes) EXPECT_EQ(msg.find(std::to_string(first8)), std::string::npos) << msg;
  }
  // JSON files (index, config) that are not JSON: position and kind, never the text.
  write_text(t.path / "model.safetensors.index.json", secret);
  expect_has(error_of([&] { SafetensorsReader::open(t.path.string()); }), {"not valid JSON", "line 1"});
  EXPECT_EQ(error_of([&] { SafetensorsReader::open(t.path.string()); }).find("SECRET"), std::string::npos);
  write_text(t.path / "config.json", "{\"a\": " + secret + "}");
  const std::string cmsg = error_of([&] { TextConfig::from_file((t.path / "config.json").string()); });
  expect_has(cmsg, {"config.json", "not valid JSON"});
  EXPECT_EQ(cmsg.find("SECRET"), std::string::npos) << cmsg;
}

TEST(TrustBoundaries, FifoNamedByAnIndexIsAnErrorNotAHang) {
  TempDir t;
  FifoWatch fifo((t.path / "pipe.safetensors").string());
  write_index(t.path / "model.safetensors.index.json", "w", "pipe.safetensors");
  const std::string msg = error_of([&] { SafetensorsReader::open(t.path.string()); });
  expect_has(msg, {"pipe.safetensors", "FIFO", "not a regular file"});
  EXPECT_FALSE(fifo.reader_blocked());
}

TEST(TrustBoundaries, FifoAsModelFileOrConfigIsAnErrorNotAHang) {
  TempDir t;
  FifoWatch model((t.path / "model.safetensors").string());
  FifoWatch config((t.path / "config.json").string());
  expect_has(error_of([&] { SafetensorsReader::open(t.path.string()); }), {"model.safetensors", "FIFO"});
  expect_has(error_of([&] { TextConfig::from_file((t.path / "config.json").string()); }), {"config.json", "FIFO"});
  expect_has(error_of([&] { MappedFile::open(t.path.string(), "test"); }), {"[test]", "a folder"});
  EXPECT_FALSE(model.reader_blocked());
  EXPECT_FALSE(config.reader_blocked());
}

TEST(TrustBoundaries, ConfinedPathRules) {
  TempDir t;
  const std::string dir = t.path.string();
  EXPECT_EQ(confined_path(dir, "a.safetensors", "idx"), (t.path / "a.safetensors").string());
  EXPECT_EQ(confined_path(dir, "sub/a.safetensors", "idx"), (t.path / "sub" / "a.safetensors").string());
  expect_has(error_of([&] { confined_path(dir, "", "idx"); }), {"idx", "empty"});
  expect_has(error_of([&] { confined_path(dir, std::string("a\0/../../x", 10), "idx"); }), {"malformed"});
  expect_has(error_of([&] { confined_path(dir, "/etc/passwd", "idx"); }), {"absolute path"});
  expect_has(error_of([&] { confined_path(dir, "..", "idx"); }), {"climbs out"});
}
