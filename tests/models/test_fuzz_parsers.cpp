// Bounded random mutation of the model-side parsers (issue 18): a safetensors header, a sharded
// index and config.json, each mutated a few thousand times (structurally as JSON and byte by
// byte). Every failure must be a kestrel::Error; a crash, a raw JSON-library exception or a
// bad_alloc fails the test. Seeds are fixed, so a failure reproduces; about 2 s in all.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "kestrel/models/config.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"
#include "support/mutate.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::models;
using kestrel::testing::fuzz_iterations;
using kestrel::testing::mutate_bytes;
using kestrel::testing::mutate_json;
using kestrel::testing::parses_or_kestrel_error;
using nlohmann::json;

using kestrel::testing::TempDir;
using kestrel::testing::read_bytes;
using kestrel::testing::write_bytes;

namespace {

// Opens `path` and touches every tensor byte (which must lie inside the map).
void open_and_touch(const std::string& path) {
  SafetensorsReader r = SafetensorsReader::open(path);
  for (const std::string& n : r.names()) {
    const SafetensorsEntry& e = r.get(n);
    volatile std::byte sink{};
    for (std::byte b : e.bytes) sink = b;
    (void)sink;
  }
}

std::string with_header(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

}  // namespace

TEST(FuzzParsers, SafetensorsHeader) {
  TempDir t;
  std::mt19937_64 rng(1801);
  float a[6] = {1, 2, 3, 4, 5, 6};
  uint16_t b[5] = {1, 2, 3, 4, 5};
  uint8_t c[4] = {1, 0, 1, 1};
  const auto image = serialize_safetensors(
      {{"a", DType::F32, {3, 2}, a}, {"b", DType::BF16, {5}, b}, {"c", DType::Bool, {4}, c}}, {{"k", "v"}});
  const std::string file(reinterpret_cast<const char*>(image.data()), image.size());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(file[i]);
  const std::string header = file.substr(8, n), data = file.substr(8 + n);
  const json header_json = json::parse(header);
  const std::string path = (t.path / "f.safetensors").string();
  int ok = 0;
  for (int i = 0; i < fuzz_iterations(700); ++i) {  // structural: the header as JSON
    write_bytes(path, with_header(mutate_json(header_json, rng).dump(), data));
    ok += parses_or_kestrel_error([&] { open_and_touch(path); }, "header mutant " + std::to_string(i));
  }
  for (int i = 0; i < fuzz_iterations(700); ++i) {  // bytes: header and length word together
    write_bytes(path, mutate_bytes(file.substr(0, 8 + n + 8), rng) + file.substr(8 + n + 8));
    ok += parses_or_kestrel_error([&] { open_and_touch(path); }, "byte mutant " + std::to_string(i));
  }
  EXPECT_GT(ok, 0);  // some mutants stay valid: the harness does reach the success path
}

TEST(FuzzParsers, ShardedIndex) {
  TempDir t;
  std::mt19937_64 rng(1802);
  std::vector<float> w(64, 1.f);
  std::vector<SafetensorsWriteEntry> entries;
  for (int i = 0; i < 6; ++i) entries.push_back({"layers." + std::to_string(i) + ".weight", DType::F32, {8, 8}, w.data()});
  write_safetensors_checkpoint(t.path.string(), entries, {{"format", "pt"}}, 600);
  const fs::path index = t.path / "model.safetensors.index.json";
  ASSERT_TRUE(fs::exists(index));
  const std::string text = read_bytes(index);
  const json j = json::parse(text);
  int ok = 0;
  for (int i = 0; i < fuzz_iterations(700); ++i) {
    write_bytes(index, mutate_json(j, rng).dump());
    ok += parses_or_kestrel_error([&] { open_and_touch(t.path.string()); }, "index mutant " + std::to_string(i));
  }
  for (int i = 0; i < fuzz_iterations(1000); ++i) {
    write_bytes(index, mutate_bytes(text, rng));
    ok += parses_or_kestrel_error([&] { open_and_touch(t.path.string()); }, "index byte mutant " + std::to_string(i));
  }
  EXPECT_GT(ok, 0);
}

TEST(FuzzParsers, ConfigJson) {
  TempDir t;
  std::mt19937_64 rng(1803);
  const fs::path fixtures = fs::path(__FILE__).parent_path() / "fixtures";
  int ok = 0;
  for (const char* name : {"qwen2_yarn", "llama_llama3", "qwen3_yarn", "llama_dynamic"}) {
    const fs::path cfg = fixtures / name / "config.json";
    if (!fs::exists(cfg)) continue;
    const std::string text = read_bytes(cfg);
    const json j = json::parse(text);
    for (int i = 0; i < fuzz_iterations(600); ++i) {
      const json m = mutate_json(j, rng);
      ok += parses_or_kestrel_error(
          [&] {
            TextConfig c = TextConfig::from_json(m, "config.json");
            (void)c.to_json();
            (void)c.rope_frequencies();
          },
          std::string(name) + " mutant " + std::to_string(i) + ": " + m.dump());
    }
    const fs::path path = t.path / "config.json";
    for (int i = 0; i < fuzz_iterations(300); ++i) {
      write_bytes(path, mutate_bytes(text, rng));
      ok += parses_or_kestrel_error([&] { TextConfig::from_file(path.string()); },
                                    std::string(name) + " byte mutant " + std::to_string(i));
    }
  }
  // The VLM config (nested vision and text configs) of the quickstart.
  const fs::path quick = fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "quickstart_vlm.json";
  if (fs::exists(quick)) {
    const json vlm = json::parse(read_bytes(quick))["model"]["config"];
    for (int i = 0; i < fuzz_iterations(800); ++i) {
      const json m = mutate_json(vlm, rng);
      ok += parses_or_kestrel_error([&] { (void)VlmConfig::from_json(m, "vlm.json").to_json(); },
                                    "vlm mutant " + std::to_string(i) + ": " + m.dump());
    }
  }
  EXPECT_GT(ok, 0);
}
