// llm.c token files: round trips of both variants, header layout as llm.c writes it, corrupt
// headers, out-of-range token ids, and shard glob expansion.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "kestrel/runtime/error.h"
#include "kestrel/train/token_file.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::train;

using kestrel::testing::TempDir;

namespace {

std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
void dump(const std::string& path, const std::vector<char>& b) {
  std::ofstream(path, std::ios::binary).write(b.data(), static_cast<std::streamsize>(b.size()));
}
int32_t i32_at(const std::vector<char>& b, size_t off) {
  int32_t v;
  std::memcpy(&v, b.data() + off, 4);
  return v;
}
void set_i32(std::vector<char>& b, size_t off, int32_t v) { std::memcpy(b.data() + off, &v, 4); }

template <typename Fn>
void expect_error(Fn fn, std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected a kestrel::Error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("[token_file]"), std::string::npos) << msg;
    for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << "missing '" << n << "' in: " << msg;
  }
}
}  // namespace

TEST(TokenFile, RoundTripBothVariants) {
  TempDir dir;
  std::mt19937_64 rng(42);
  for (TokenFormat fmt : {TokenFormat::U16, TokenFormat::U32}) {
    const uint32_t limit = fmt == TokenFormat::U16 ? 50257u : 128256u;
    std::vector<uint32_t> toks(100003);
    for (auto& t : toks) t = static_cast<uint32_t>(rng() % limit);
    toks[0] = fmt == TokenFormat::U16 ? 65535u : 0xfffffffeu;  // extremes survive
    const std::string path = dir.file(fmt == TokenFormat::U16 ? "gpt2.bin" : "llama3.bin");
    write_token_file(path, toks, fmt);

    // Header exactly as llm.c's write_datafile lays it out.
    auto raw = slurp(path);
    ASSERT_EQ(raw.size(), 1024 + toks.size() * token_size(fmt));
    EXPECT_EQ(i32_at(raw, 0), fmt == TokenFormat::U16 ? 20240520 : 20240801);
    EXPECT_EQ(i32_at(raw, 4), fmt == TokenFormat::U16 ? 1 : 7);
    EXPECT_EQ(i32_at(raw, 8), static_cast<int32_t>(toks.size()));
    for (size_t i = 3; i < 256; ++i) ASSERT_EQ(i32_at(raw, 4 * i), 0);

    TokenFile f = TokenFile::open(path);
    EXPECT_EQ(f.format(), fmt);
    ASSERT_EQ(f.size(), static_cast<int64_t>(toks.size()));
    for (size_t i = 0; i < toks.size(); ++i) ASSERT_EQ(f[static_cast<int64_t>(i)], toks[i]) << i;
    std::vector<uint32_t> window(777);
    f.read(1234, window);
    for (size_t i = 0; i < window.size(); ++i) ASSERT_EQ(window[i], toks[1234 + i]);
    EXPECT_EQ(f.token_bytes().size(), toks.size() * token_size(fmt));
    expect_error([&] { f.read(static_cast<int64_t>(toks.size()) - 10, window); }, {path, "runs past"});
    expect_error([&] { (void)f.at(-1); }, {path, "out of range"});
  }
  // Empty file of tokens is valid.
  write_token_file(dir.file("empty.bin"), {}, TokenFormat::U32);
  EXPECT_EQ(TokenFile::open(dir.file("empty.bin")).size(), 0);
}

TEST(TokenFile, CorruptHeaders) {
  TempDir dir;
  std::vector<uint32_t> toks = {1, 2, 3, 4, 5};
  const std::string good = dir.file("good.bin");
  write_token_file(good, toks, TokenFormat::U16);
  const auto raw = slurp(good);

  auto variant = [&](const char* name, auto edit) {
    auto b = raw;
    edit(b);
    dump(dir.file(name), b);
    return dir.file(name);
  };
  std::string p = variant("magic.bin", [](auto& b) { set_i32(b, 0, 12345); });
  expect_error([&] { TokenFile::open(p); }, {p, "bad magic number 12345"});
  p = variant("version.bin", [](auto& b) { set_i32(b, 4, 3); });
  expect_error([&] { TokenFile::open(p); }, {p, "version 3, expected 1"});
  p = variant("count.bin", [](auto& b) { set_i32(b, 8, 6); });
  expect_error([&] { TokenFile::open(p); }, {p, "header says 6 tokens", "truncated"});
  p = variant("trailing.bin", [](auto& b) { b.push_back(0); });
  expect_error([&] { TokenFile::open(p); }, {p, "trailing bytes"});
  p = variant("negative.bin", [](auto& b) { set_i32(b, 8, -1); });
  expect_error([&] { TokenFile::open(p); }, {p, "negative token count"});
  p = variant("short.bin", [](auto& b) { b.resize(100); });
  expect_error([&] { TokenFile::open(p); }, {p, "smaller than the 1024-byte header"});
  // A uint32 magic with the uint16 version.
  p = variant("mixed.bin", [](auto& b) { set_i32(b, 0, 20240801); });
  expect_error([&] { TokenFile::open(p); }, {p, "version 1, expected 7"});
  expect_error([&] { TokenFile::open(dir.file("absent.bin")); }, {"absent.bin", "cannot open"});
}

TEST(TokenFile, VocabCheckNamesFirstOffender) {
  TempDir dir;
  std::vector<uint32_t> toks(1000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = static_cast<uint32_t>(i % 500);
  toks[617] = 70000;
  toks[800] = 90000;
  const std::string path = dir.file("v.bin");
  write_token_file(path, toks, TokenFormat::U32);
  TokenFile f = TokenFile::open(path);
  f.check_vocab(100000);
  expect_error([&] { f.check_vocab(50000); }, {path, "token 70000 at position 617", "vocab size 50000"});
  // uint16 cannot hold ids >= 65536: the writer says where.
  expect_error([&] { write_token_file(dir.file("w.bin"), toks, TokenFormat::U16); },
               {"w.bin", "token 70000 at position 617", "uint32"});
  EXPECT_FALSE(fs::exists(dir.file("w.bin")));
}

TEST(TokenFile, ShardGlobs) {
  TempDir dir;
  for (const char* n : {"train_003.bin", "train_001.bin", "train_002.bin", "val_000.bin"})
    write_token_file(dir.file(n), std::vector<uint32_t>{1, 2}, TokenFormat::U16);
  auto shards = expand_shards(dir.file("train_*.bin"));
  ASSERT_EQ(shards.size(), 3u);
  EXPECT_EQ(fs::path(shards[0]).filename(), "train_001.bin");
  EXPECT_EQ(fs::path(shards[2]).filename(), "train_003.bin");
  auto both = expand_shards(dir.file("val_*.bin") + ", " + dir.file("train_00[12].bin"));
  ASSERT_EQ(both.size(), 3u);
  EXPECT_EQ(fs::path(both[0]).filename(), "val_000.bin");
  EXPECT_EQ(expand_shards(dir.file("val_000.bin")).size(), 1u);
  expect_error([&] { expand_shards(dir.file("test_*.bin")); }, {"no files match", "test_*.bin"});
  expect_error([&] { expand_shards(dir.file("nothere.bin")); }, {"nothere.bin", "does not exist"});
  expect_error([&] { expand_shards(" , "); }, {"empty shard pattern"});
}
