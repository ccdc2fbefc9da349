// Bounded random mutation of the data-side parsers (issue 18): the llm.c token-file header, the
// trainer config and tokenizer.json, each mutated a few thousand times. Every failure must be a
// kestrel::Error; a crash, a raw JSON-library exception or a bad_alloc fails the test. Seeds are
// fixed, so a failure reproduces.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "kestrel/runtime/error.h"
#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/token_file.h"
#include "kestrel/train/train_config.h"
#include "support/mutate.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::train;
using kestrel::testing::fuzz_iterations;
using kestrel::testing::mutate_bytes;
using kestrel::testing::mutate_json;
using kestrel::testing::parses_or_kestrel_error;
using nlohmann::json;

using kestrel::testing::TempDir;
using kestrel::testing::read_bytes;
using kestrel::testing::write_bytes;

namespace {

}  // namespace

TEST(FuzzParsers, TokenFileHeader) {
  TempDir t;
  std::mt19937_64 rng(1811);
  const fs::path path = t.path / "t.bin";
  int ok = 0;
  for (TokenFormat fmt : {TokenFormat::U16, TokenFormat::U32}) {
    std::vector<uint32_t> toks(300);
    for (auto& v : toks) v = static_cast<uint32_t>(rng() % 1000);
    write_token_file(path.string(), toks, fmt);
    const std::string file = read_bytes(path);
    static const int32_t words[] = {0, 1, -1, 7, 20240520, 20240801, 300, 301, 299, INT32_MAX, INT32_MIN, 150, 600};
    for (int i = 0; i < fuzz_iterations(1000); ++i) {
      std::string m;
      if (i % 2 == 0) {  // header words: magic, version, count set to boundary values
        m = file;
        const int32_t v = words[rng() % (sizeof(words) / sizeof(words[0]))];
        std::memcpy(m.data() + 4 * (rng() % 3), &v, 4);
        if (rng() % 3 == 0) m.resize(rng() % (m.size() + 8));
      } else {
        m = mutate_bytes(file.substr(0, 64), rng) + file.substr(64);
      }
      write_bytes(path, m);
      ok += parses_or_kestrel_error(
          [&] {
            TokenFile f = TokenFile::open(path.string());
            f.check_vocab(1000);
            std::vector<uint32_t> out(static_cast<size_t>(std::min<int64_t>(f.size(), 16)));
            f.read(0, out);
          },
          "token-file mutant " + std::to_string(i));
    }
  }
  EXPECT_GT(ok, 0);
}

TEST(FuzzParsers, TrainerConfig) {
  std::mt19937_64 rng(1812);
  const fs::path root = fs::path(__FILE__).parent_path() / ".." / "..";
  int ok = 0;
  for (const char* name : {"quickstart_vlm.json", "llama_1b5_8k.json"}) {
    const fs::path p = root / "configs" / name;
    if (!fs::exists(p)) continue;
    const json j = json::parse(read_bytes(p));
    for (int i = 0; i < fuzz_iterations(1000); ++i) {
      const json m = mutate_json(j, rng);
      ok += parses_or_kestrel_error([&] { (void)resolve_train_config(m, name); },
                                    std::string(name) + " mutant " + std::to_string(i) + ": " + m.dump());
    }
  }
  EXPECT_GT(ok, 0);
}

TEST(FuzzParsers, TokenizerJson) {
  TempDir t;
  std::mt19937_64 rng(1813);
  json vocab = json::object();
  const char* sym[] = {"h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll", "hell", "hello", "Ġw"};
  for (int i = 0; i < 13; ++i) vocab[sym[i]] = i;
  const json tok = {
      {"added_tokens", {{{"id", 13}, {"content", "<|endoftext|>"}, {"special", true}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"h e", "l l", "he ll", "hell o", "Ġ w"}}, {"unk_token", "h"}}}};
  int ok = 0;
  for (int i = 0; i < fuzz_iterations(1000); ++i) {
    const json m = mutate_json(tok, rng);
    ok += parses_or_kestrel_error(
        [&] {
          BpeTokenizer b = BpeTokenizer::from_json(m, "tokenizer.json");
          (void)b.encode("hello world<|endoftext|>");
        },
        "tokenizer mutant " + std::to_string(i) + ": " + m.dump());
  }
  const fs::path path = t.path / "tokenizer.json";
  const std::string text = tok.dump();
  for (int i = 0; i < fuzz_iterations(500); ++i) {
    write_bytes(path, mutate_bytes(text, rng));
    ok += parses_or_kestrel_error([&] { (void)BpeTokenizer::from_file(path.string()); },
                                  "tokenizer byte mutant " + std::to_string(i));
  }
  EXPECT_GT(ok, 0);
}
