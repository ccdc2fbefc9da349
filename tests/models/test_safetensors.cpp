// safetensors reader/writer: bit-exact round trips of every dtype, sharded checkpoints, and one
// test per malformed-file class asserting the error names the file and the problem.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "kestrel/models/config.h"
#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/error.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::models;

using kestrel::testing::TempDir;

namespace {

// A fresh folder under the temp dir, removed at the end of the test.

// Random bytes for a tensor of `dtype` and `shape` (bools are 0/1).
std::vector<uint8_t> random_bytes(DType dtype, const std::vector<int64_t>& shape, std::mt19937_64& rng) {
  size_t n = dtype_size(dtype);
  for (int64_t d : shape) n *= static_cast<size_t>(d);
  std::vector<uint8_t> b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  if (dtype == DType::Bool)
    for (auto& x : b) x &= 1;
  return b;
}

void write_raw(const std::string& path, const std::string& header, const std::vector<uint8_t>& data,
               std::optional<uint64_t> header_len = std::nullopt) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = header_len.value_or(header.size());
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f.write(header.data(), static_cast<std::streamsize>(header.size()));
  f.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
}

// Expects open() to throw a kestrel::Error mentioning every needle.
void expect_open_error(const std::string& path, std::initializer_list<std::string> needles) {
  try {
    SafetensorsReader::open(path);
    FAIL() << "expected an error opening " << path;
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("[safetensors]"), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}

struct Owned {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

std::vector<Owned> random_tensors(std::mt19937_64& rng) {
  const DType all[] = {DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32, DType::U8, DType::Bool};
  std::vector<Owned> out;
  int i = 0;
  for (DType t : all) {
    for (auto shape : {std::vector<int64_t>{7, 13}, std::vector<int64_t>{3}, std::vector<int64_t>{}}) {
      std::string name = "layers." + std::to_string(i++) + "." + std::string(dtype_name(t));
      out.push_back({name, t, shape, random_bytes(t, shape, rng)});
    }
  }
  out.push_back({"empty", DType::F32, {0, 5}, {}});
  return out;
}

std::vector<SafetensorsWriteEntry> views(const std::vector<Owned>& owned) {
  std::vector<SafetensorsWriteEntry> v;
  for (const auto& o : owned) v.push_back({o.name, o.dtype, o.shape, o.bytes.data()});
  return v;
}

void expect_same(const SafetensorsReader& r, const std::vector<Owned>& owned) {
  ASSERT_EQ(r.size(), owned.size());
  for (const auto& o : owned) {
    const SafetensorsEntry& e = r.get(o.name);
    EXPECT_EQ(e.dtype, o.dtype) << o.name;
    EXPECT_EQ(e.shape, o.shape) << o.name;
    ASSERT_EQ(e.bytes.size(), o.bytes.size()) << o.name;
    if (!o.bytes.empty()) EXPECT_EQ(std::memcmp(e.bytes.data(), o.bytes.data(), o.bytes.size()), 0) << o.name;
    // Reference layout: every tensor starts aligned to its element size.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(e.bytes.data()) % dtype_size(e.dtype), 0u) << o.name;
  }
}

}  // namespace

TEST(Safetensors, RoundTripEveryDtypeBitExact) {
  TempDir dir;
  std::mt19937_64 rng(1234);
  auto owned = random_tensors(rng);
  const std::string path = dir.file("weights.safetensors");
  write_safetensors(path, views(owned), {{"format", "pt"}, {"note", "kestrel test"}});
  auto r = SafetensorsReader::open(path);
  expect_same(r, owned);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  EXPECT_EQ(r.metadata().at("note"), "kestrel test");
  // Header padded with spaces to a multiple of 8, as the reference writer does.
  EXPECT_EQ(r.files()[0].data_offset() % 8, 0u);
  // The in-memory image is the file image.
  auto image = serialize_safetensors(views(owned), {{"format", "pt"}, {"note", "kestrel test"}});
  std::ifstream f(path, std::ios::binary);
  std::vector<char> disk((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_EQ(disk.size(), image.size());
  EXPECT_EQ(std::memcmp(disk.data(), image.data(), disk.size()), 0);
  // No temporary files are left behind.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path), fs::directory_iterator()), 1);
}

TEST(Safetensors, ShardedRoundTripAndIndex) {
  TempDir dir;
  std::mt19937_64 rng(99);
  auto owned = random_tensors(rng);
  uint64_t total = 0;
  for (const auto& o : owned) total += o.bytes.size();
  // Limit chosen so several shards are needed.
  auto written = write_safetensors_checkpoint(dir.path.string(), views(owned), {{"format", "pt"}}, 400);
  ASSERT_GE(written.size(), 3u);
  const size_t nshards = written.size() - 1;
  EXPECT_EQ(fs::path(written.back()).filename(), "model.safetensors.index.json");
  char first[64];
  std::snprintf(first, sizeof(first), "model-00001-of-%05zu.safetensors", nshards);
  EXPECT_EQ(fs::path(written[0]).filename(), first);
  auto idx = nlohmann::json::parse(std::ifstream(written.back()));
  EXPECT_EQ(idx["metadata"]["total_size"].get<uint64_t>(), total);
  EXPECT_EQ(idx["weight_map"].size(), owned.size());

  // Folder, index path and the tensors all agree.
  for (const std::string& p : {dir.path.string(), written.back()}) {
    auto r = SafetensorsReader::open(p);
    EXPECT_EQ(r.files().size(), nshards);
    expect_same(r, owned);
    EXPECT_EQ(r.metadata().at("total_size"), std::to_string(total));
  }
  // Rewriting below the threshold replaces the shards with one file.
  write_safetensors_checkpoint(dir.path.string(), views(owned), {}, 1u << 20);
  EXPECT_TRUE(fs::exists(dir.file("model.safetensors")));
  EXPECT_FALSE(fs::exists(dir.file("model.safetensors.index.json")));
  EXPECT_FALSE(fs::exists(dir.path / first));
  expect_same(SafetensorsReader::open(dir.path.string()), owned);
}

TEST(Safetensors, UnalignedHeaderLengthAccepted) {
  TempDir dir;
  std::vector<uint8_t> data = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::string header = R"({"a":{"dtype":"U8","shape":[2,4],"data_offsets":[0,8]}})";  // 55 bytes
  ASSERT_NE(header.size() % 8, 0u);
  write_raw(dir.file("u.safetensors"), header, data);
  auto r = SafetensorsReader::open(dir.file("u.safetensors"));
  const auto& e = r.get("a");
  EXPECT_EQ(e.shape, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(std::memcmp(e.bytes.data(), data.data(), 8), 0);
}

TEST(Safetensors, TruncatedFiles) {
  TempDir dir;
  std::mt19937_64 rng(5);
  auto owned = random_tensors(rng);
  auto image = serialize_safetensors(views(owned));
  const std::string tiny = dir.file("tiny.safetensors");
  { std::ofstream(tiny, std::ios::binary).write(reinterpret_cast<const char*>(image.data()), 5); }
  expect_open_error(tiny, {tiny, "truncated"});
  // Cut inside the data section: the last tensor's offsets now point past the end.
  const std::string cut = dir.file("cut.safetensors");
  { std::ofstream(cut, std::ios::binary).write(reinterpret_cast<const char*>(image.data()), image.size() - 3); }
  expect_open_error(cut, {cut, "outside the data section"});
  // Cut inside the header.
  const std::string cut_header = dir.file("cut_header.safetensors");
  { std::ofstream(cut_header, std::ios::binary).write(reinterpret_cast<const char*>(image.data()), 40); }
  expect_open_error(cut_header, {cut_header, "beyond the end of the file"});
}

TEST(Safetensors, HeaderLengthBounds) {
  TempDir dir;
  const std::string header = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})";
  write_raw(dir.file("beyond.safetensors"), header, {7}, 4096);
  expect_open_error(dir.file("beyond.safetensors"), {dir.file("beyond.safetensors"), "header length 4096", "beyond"});
  write_raw(dir.file("huge.safetensors"), header, {7}, 200'000'000);
  expect_open_error(dir.file("huge.safetensors"), {dir.file("huge.safetensors"), "exceeds the limit"});
  write_raw(dir.file("json.safetensors"), R"({"a": {"dtype": )", {});
  expect_open_error(dir.file("json.safetensors"), {dir.file("json.safetensors"), "not valid JSON"});
  write_raw(dir.file("array.safetensors"), "[1, 2, 3]", {});
  expect_open_error(dir.file("array.safetensors"), {"must be a JSON object"});
}

TEST(Safetensors, BadTensorEntries) {
  TempDir dir;
  std::vector<uint8_t> data(16, 3);
  struct Case {
    const char* file;
    std::string header;
    std::vector<std::string> needles;
  };
  const std::vector<Case> cases = {
      {"beyond.safetensors", R"({"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})",
       {"'w'", "outside the data section of 16 bytes"}},
      {"f64.safetensors", R"({"w":{"dtype":"F64","shape":[2],"data_offsets":[0,16]}})",
       {"'w'", "F64", "not supported"}},
      {"i8.safetensors", R"({"w":{"dtype":"I8","shape":[16],"data_offsets":[0,16]}})", {"'w'", "I8", "not supported"}},
      {"bogus.safetensors", R"({"w":{"dtype":"Q4","shape":[16],"data_offsets":[0,16]}})",
       {"'w'", "unknown dtype 'Q4'"}},
      {"mismatch.safetensors", R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})",
       {"'w'", "byte length mismatch", "needs 12 bytes"}},
      {"reversed.safetensors", R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[8,4]}})", {"'w'", "begin 8 > end 4"}},
      {"overlap.safetensors",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       {"'a'", "'b'", "overlap"}},
      {"negative.safetensors", R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,16]}})", {"'w'", "non-negative"}},
      {"nooffsets.safetensors", R"({"w":{"dtype":"U8","shape":[16]}})", {"'w'", "data_offsets"}},
      {"meta.safetensors", R"({"__metadata__":{"k":3}})", {"__metadata__", "'k'", "must be a string"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    write_raw(dir.file(c.file), c.header, data);
    try {
      SafetensorsReader::open(dir.file(c.file));
      ADD_FAILURE() << "no error for " << c.file;
    } catch (const Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(dir.file(c.file)), std::string::npos) << msg;
      for (const auto& n : c.needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
    }
  }
}

TEST(Safetensors, MissingTensorAndMissingShard) {
  TempDir dir;
  std::mt19937_64 rng(7);
  auto owned = random_tensors(rng);
  write_safetensors_checkpoint(dir.path.string(), views(owned), {}, 400);
  auto r = SafetensorsReader::open(dir.path.string());
  EXPECT_EQ(r.find("nope"), nullptr);
  try {
    r.get("model.nope.weight");
    ADD_FAILURE();
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("no tensor named 'model.nope.weight'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir.path.string()), std::string::npos) << msg;
  }
  std::string shard2;
  for (auto& de : fs::directory_iterator(dir.path))
    if (de.path().filename().string().rfind("model-00002-of-", 0) == 0) shard2 = de.path().filename().string();
  ASSERT_FALSE(shard2.empty());
  fs::remove(dir.path / shard2);
  expect_open_error(dir.path.string(), {"model.safetensors.index.json", shard2, "does not exist"});
  // A folder with neither layout.
  TempDir empty;
  expect_open_error(empty.path.string(), {empty.path.string(), "neither model.safetensors"});
  expect_open_error(dir.file("absent.safetensors"), {dir.file("absent.safetensors"), "cannot open"});
}

TEST(Safetensors, WriterRejectsBadEntries) {
  TempDir dir;
  float x[2] = {1.f, 2.f};
  std::vector<SafetensorsWriteEntry> dup = {{"a", DType::F32, {2}, x}, {"a", DType::F32, {2}, x}};
  EXPECT_THROW(write_safetensors(dir.file("d.safetensors"), dup), Error);
  std::vector<SafetensorsWriteEntry> null_data = {{"a", DType::F32, {2}, nullptr}};
  EXPECT_THROW(write_safetensors(dir.file("n.safetensors"), null_data), Error);
  EXPECT_FALSE(fs::exists(dir.file("d.safetensors")));
}

// A tiny HF-layout folder: config.json + model.safetensors, written and read back.
TEST(Safetensors, HfFolderFixture) {
  TempDir dir;
  TextConfig cfg = TextConfig::defaults_for("llama");
  cfg.vocab_size = 64;
  cfg.hidden_size = 16;
  cfg.intermediate_size = 32;
  cfg.num_hidden_layers = 1;
  cfg.num_attention_heads = 4;
  cfg.num_key_value_heads = 2;
  cfg.head_dim = 4;
  cfg.torch_dtype = "float32";
  cfg.validate();
  write_json_file(dir.file("config.json"), cfg.to_json());

  std::mt19937_64 rng(11);
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t KV = cfg.num_key_value_heads * cfg.head_dim;
  std::vector<Owned> owned = {
      {"model.embed_tokens.weight", DType::F32, {V, H}, {}},
      {"model.layers.0.self_attn.q_proj.weight", DType::F32, {H, H}, {}},
      {"model.layers.0.self_attn.k_proj.weight", DType::F32, {KV, H}, {}},
      {"model.layers.0.self_attn.v_proj.weight", DType::F32, {KV, H}, {}},
      {"model.layers.0.self_attn.o_proj.weight", DType::F32, {H, H}, {}},
      {"model.layers.0.mlp.gate_proj.weight", DType::F32, {I, H}, {}},
      {"model.layers.0.mlp.up_proj.weight", DType::F32, {I, H}, {}},
      {"model.layers.0.mlp.down_proj.weight", DType::F32, {H, I}, {}},
      {"model.layers.0.input_layernorm.weight", DType::F32, {H}, {}},
      {"model.layers.0.post_attention_layernorm.weight", DType::F32, {H}, {}},
      {"model.norm.weight", DType::F32, {H}, {}},
      {"lm_head.weight", DType::F32, {V, H}, {}},
  };
  for (auto& o : owned) o.bytes = random_bytes(o.dtype, o.shape, rng);
  write_safetensors_checkpoint(dir.path.string(), views(owned), {{"format", "pt"}});

  TextConfig back = TextConfig::from_file(dir.file("config.json"));
  EXPECT_EQ(back.to_json(), cfg.to_json());
  auto r = SafetensorsReader::open(dir.path.string());
  expect_same(r, owned);
  EXPECT_EQ(r.get("model.layers.0.self_attn.k_proj.weight").shape, (std::vector<int64_t>{KV, H}));
  EXPECT_EQ(r.metadata().at("format"), "pt");
}

// Every prefix of a file and random byte flips: open() either succeeds or throws kestrel::Error,
// never crashes or throws anything else (run under the sanitizer build to catch out-of-bounds reads).
TEST(Safetensors, CorruptionNeverCrashes) {
  TempDir dir;
  std::mt19937_64 rng(17);
  std::vector<Owned> owned = {{"a", DType::F32, {3, 2}, {}}, {"b", DType::BF16, {5}, {}}, {"c", DType::Bool, {4}, {}}};
  for (auto& o : owned) o.bytes = random_bytes(o.dtype, o.shape, rng);
  const auto image = serialize_safetensors(views(owned), {{"k", "v"}});
  const std::string path = dir.file("f.safetensors");
  auto try_open = [&](const std::vector<std::byte>& bytes) {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
    try {
      auto r = SafetensorsReader::open(path);
      for (const auto& n : r.names()) {
        const auto& e = r.get(n);
        EXPECT_EQ(static_cast<uint64_t>(e.numel()) * dtype_size(e.dtype), e.bytes.size());
        volatile std::byte sink{};
        for (std::byte b : e.bytes) sink = b;  // touches every byte: must stay inside the map
        (void)sink;
      }
    } catch (const Error&) {
    }
  };
  for (size_t n = 0; n <= image.size(); ++n) try_open(std::vector<std::byte>(image.begin(), image.begin() + n));
  for (int i = 0; i < 400; ++i) {
    auto b = image;
    const size_t at = rng() % b.size();
    b[at] = static_cast<std::byte>(rng());
    try_open(b);
  }
}
