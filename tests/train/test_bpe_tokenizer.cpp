// Byte-level BPE from tokenizer.json: a hand-built vocabulary + merges with encodings derived by hand
// from the BPE rule (lowest rank first), both merge forms, added tokens, the three split regexes on
// hand-split strings, round trips on random UTF-8, unknown bytes, and the errors for files that are
// not byte-level BPE.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "kestrel/runtime/error.h"
#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/token_file.h"

namespace kestrel::train {
namespace {
using nlohmann::json;
using Pieces = std::vector<std::string>;

// The GPT-2 byte map written independently of the library: printable bytes keep their code point,
// the rest get 256, 257, ... in byte order; UTF-8 encoded.
std::string ref_symbol(int b) {
  int n = 0, cp = -1;
  for (int x = 0; x < 256; ++x) {
    bool keep = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
    int c = keep ? x : 256 + n++;
    if (x == b) cp = c;
  }
  std::string s;
  if (cp < 128) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 63));
  }
  return s;
}

// Vocabulary: ids 0..255 are the byte symbols of bytes 0..255, then one id per merge, then
// <|endoftext|>. "Ġ" is the symbol of the space byte.
const std::vector<std::pair<std::string, std::string>> kMerges = {
    {"h", "e"},   {"l", "l"},   {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"},  {"o", "r"},
    {"Ġw", "or"}, {"l", "d"},   {"Ġwor", "ld"}, {"r", "l"},  {"Ġ", "Ġ"}};
constexpr int64_t kEot = 256 + 11;

json make_tokenizer(bool pair_merges, const json& pre_tokenizer, bool with_low_bytes = true) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b)
    if (with_low_bytes || b >= 32) vocab[ref_symbol(b)] = b;
  json merges = json::array();
  for (size_t i = 0; i < kMerges.size(); ++i) {
    vocab[kMerges[i].first + kMerges[i].second] = 256 + static_cast<int>(i);
    if (pair_merges) merges.push_back({kMerges[i].first, kMerges[i].second});
    else merges.push_back(kMerges[i].first + " " + kMerges[i].second);
  }
  vocab["<|endoftext|>"] = kEot;
  return json{{"version", "1.0"},
              {"added_tokens", {{{"id", kEot}, {"content", "<|endoftext|>"}, {"special", true}}}},
              {"normalizer", nullptr},
              {"pre_tokenizer", pre_tokenizer},
              {"decoder", {{"type", "ByteLevel"}}},
              {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"vocab", vocab}, {"merges", merges}}}};
}

json gpt2_pre() { return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}; }
json split_pre(const std::string& regex) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
            {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
}
const std::string kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const std::string kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

std::vector<int64_t> bytes_of(const std::string& s) {
  std::vector<int64_t> v;
  for (unsigned char c : s) v.push_back(c);
  return v;
}

TEST(BpeTokenizer, ByteMapMatchesGpt2) {
  for (int b = 0; b < 256; ++b) EXPECT_EQ(byte_level_symbol(static_cast<uint8_t>(b)), ref_symbol(b)) << b;
  EXPECT_EQ(byte_level_symbol(' '), "\xC4\xA0");  // "Ġ" = U+0120
}

TEST(BpeTokenizer, MergesByRankNotLeftToRight) {
  for (bool pairs : {false, true}) {
    BpeTokenizer t = BpeTokenizer::from_json(make_tokenizer(pairs, gpt2_pre()), "test");
    EXPECT_EQ(t.vocab_size(), kEot + 1);
    // "hello" -> he (rank 0), ll (1), hell (2), hello (3); " world" -> Ġw (4), or (5), Ġwor (6), ld (7), Ġworld (8).
    EXPECT_EQ(t.encode("hello world"), (std::vector<int64_t>{259, 264}));
    // "rld": (r,l) has rank 9, (l,d) rank 7, so l+d merges first and r stays alone; left to right would give rl + d.
    EXPECT_EQ(t.encode("rld"), (std::vector<int64_t>{'r', 263}));
    // "hel": he, then (he, l) is no merge.
    EXPECT_EQ(t.encode("hel"), (std::vector<int64_t>{256, 'l'}));
    // Added token cut out first; the text on both sides is split on its own.
    EXPECT_EQ(t.encode("hello<|endoftext|> world"), (std::vector<int64_t>{259, kEot, 264}));
    // "  world": the split gives " " (\s+(?!\S) leaves the last space to the word) and " world".
    EXPECT_EQ(t.encode("  world"), (std::vector<int64_t>{' ', 264}));
    // Three trailing spaces stay one piece; ĠĠ (rank 10) merges the first pair, then (ĠĠ, Ġ) is no merge.
    EXPECT_EQ(t.encode("o   "), (std::vector<int64_t>{'o', 266, ' '}));
    EXPECT_EQ(t.token_id("<|endoftext|>"), kEot);
    EXPECT_EQ(t.token_id("Ġworld"), 264);
    EXPECT_EQ(t.token_id("nope"), -1);
    EXPECT_EQ(t.decode({259, kEot, 264}), "hello<|endoftext|> world");
  }
}

TEST(BpeTokenizer, Gpt2Split) {
  EXPECT_EQ(bpe_pre_tokenize("Hello, world! I'm  fine\n\n 123", BpeSplit::Gpt2),
            (Pieces{"Hello", ",", " world", "!", " I", "'m", " ", " fine", "\n\n", " 123"}));
  EXPECT_EQ(bpe_pre_tokenize("I'M (ok) x2 ...", BpeSplit::Gpt2),
            (Pieces{"I", "'", "M", " (", "ok", ")", " x", "2", " ..."}));
  EXPECT_EQ(bpe_pre_tokenize("caf\xC3\xA9 \xC3\xBC" "ber \xD9\xA3\xD9\xA4", BpeSplit::Gpt2),  // café über ٣٤
            (Pieces{"caf\xC3\xA9", " \xC3\xBC" "ber", " \xD9\xA3\xD9\xA4"}));
  // Only U+0020 may lead a word: "\t\tb" gives "\t" (\s+(?!\S) backs off), "\t" (\s+), "b".
  EXPECT_EQ(bpe_pre_tokenize("a\t\tb  ", BpeSplit::Gpt2), (Pieces{"a", "\t", "\t", "b", "  "}));
}

TEST(BpeTokenizer, Qwen2AndLlama3Split) {
  const std::string s = "Hello, world! I'm  fine\n\n 1234";
  EXPECT_EQ(bpe_pre_tokenize(s, BpeSplit::Qwen2),
            (Pieces{"Hello", ",", " world", "!", " I", "'m", " ", " fine", "\n\n", " ", "1", "2", "3", "4"}));
  EXPECT_EQ(bpe_pre_tokenize(s, BpeSplit::Llama3),
            (Pieces{"Hello", ",", " world", "!", " I", "'m", " ", " fine", "\n\n", " ", "123", "4"}));
  // Case-insensitive contractions; one non-letter glued to the next word; punctuation keeps its newlines.
  EXPECT_EQ(bpe_pre_tokenize("I'M (ok).\n\nYes", BpeSplit::Qwen2), (Pieces{"I", "'M", " (", "ok", ").\n\n", "Yes"}));
  EXPECT_EQ(bpe_pre_tokenize("(hello \tworld", BpeSplit::Qwen2), (Pieces{"(hello", " ", "\tworld"}));
  // \s*[\r\n]+ ends at the last newline of a whitespace run.
  EXPECT_EQ(bpe_pre_tokenize("a \n \n  b", BpeSplit::Qwen2), (Pieces{"a", " \n \n", " ", " b"}));
}

TEST(BpeTokenizer, SplitPatternsSelectTheSplit) {
  EXPECT_EQ(BpeTokenizer::from_json(make_tokenizer(false, split_pre(kQwen2)), "q").split(), BpeSplit::Qwen2);
  EXPECT_EQ(BpeTokenizer::from_json(make_tokenizer(false, split_pre(kLlama3)), "l").split(), BpeSplit::Llama3);
  BpeTokenizer q = BpeTokenizer::from_json(make_tokenizer(false, split_pre(kQwen2)), "q");
  EXPECT_EQ(q.encode("hello 12"), (std::vector<int64_t>{259, ' ', '1', '2'}));
  EXPECT_EQ(BpeTokenizer::from_json(make_tokenizer(false, gpt2_pre()), "g").encode("hello 12"),
            (std::vector<int64_t>{259, ' ', '1', '2'}));  // " 12" has no merges either way
}

TEST(BpeTokenizer, RoundTripsRandomUtf8) {
  BpeTokenizer g = BpeTokenizer::from_json(make_tokenizer(false, gpt2_pre()), "g");
  BpeTokenizer q = BpeTokenizer::from_json(make_tokenizer(true, split_pre(kQwen2)), "q");
  std::mt19937 rng(1234);
  const std::vector<char32_t> pool = {'a', 'Z', ' ', ' ', '\n', '\t', '\'', '1', '.', 'h', 'e', 'l', 'o',
                                      0xE9, 0x4E2D, 0x1F600, 0x0663, 0x3000, 0x00A0, 0x2028};
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    const int len = static_cast<int>(rng() % 40);
    for (int i = 0; i < len; ++i) {
      char32_t c = pool[rng() % pool.size()];
      if (rng() % 8 == 0) c = 0x20 + rng() % 0x2FFF;  // anything in the BMP's first part
      if (c >= 0xD800 && c <= 0xDFFF) c = 'x';
      if (c < 0x80) s += static_cast<char>(c);
      else if (c < 0x800) { s += static_cast<char>(0xC0 | (c >> 6)); s += static_cast<char>(0x80 | (c & 63)); }
      else if (c < 0x10000) { s += static_cast<char>(0xE0 | (c >> 12)); s += static_cast<char>(0x80 | ((c >> 6) & 63)); s += static_cast<char>(0x80 | (c & 63)); }
      else { s += static_cast<char>(0xF0 | (c >> 18)); s += static_cast<char>(0x80 | ((c >> 12) & 63)); s += static_cast<char>(0x80 | ((c >> 6) & 63)); s += static_cast<char>(0x80 | (c & 63)); }
      if (rng() % 20 == 0) s += "<|endoftext|>";
    }
    for (const BpeTokenizer* t : {&g, &q}) {
      std::vector<int64_t> ids = t->encode(s);
      EXPECT_EQ(t->decode(ids), s);
      std::string joined;
      for (auto& p : bpe_pre_tokenize(s, t->split())) joined += p;
      EXPECT_EQ(joined, s);
    }
  }
  // Invalid UTF-8 still round-trips byte for byte.
  const std::string bad = "ab\xFF\xC3(\xE2\x82 x";
  EXPECT_EQ(g.decode(g.encode(bad)), bad);
  EXPECT_EQ(q.decode(q.encode(bad)), bad);
}

TEST(BpeTokenizer, UnknownBytes) {
  // Bytes 0..31 missing from the vocabulary: an error naming the byte, or unk_token when there is one.
  json j = make_tokenizer(false, gpt2_pre(), /*with_low_bytes=*/false);
  BpeTokenizer t = BpeTokenizer::from_json(j, "t");
  EXPECT_EQ(t.encode("hello"), (std::vector<int64_t>{259}));
  try {
    t.encode("a\x01");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("0x01"), std::string::npos) << e.what();
  }
  j["model"]["unk_token"] = "<|endoftext|>";
  BpeTokenizer u = BpeTokenizer::from_json(j, "u");
  EXPECT_EQ(u.encode("a\x01"), (std::vector<int64_t>{'a', kEot}));
  EXPECT_THROW(t.decode({9999}), Error);
}

TEST(BpeTokenizer, RejectsOtherTokenizers) {
  auto msg = [](const json& j) {
    try {
      BpeTokenizer::from_json(j, "x.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  json wp = make_tokenizer(false, gpt2_pre());
  wp["model"]["type"] = "WordPiece";
  EXPECT_NE(msg(wp).find("WordPiece"), std::string::npos);
  json sp = make_tokenizer(false, {{"type", "Metaspace"}});
  EXPECT_NE(msg(sp).find("Metaspace"), std::string::npos);
  json fb = make_tokenizer(false, gpt2_pre());
  fb["model"]["byte_fallback"] = true;
  EXPECT_NE(msg(fb).find("byte_fallback"), std::string::npos);
  EXPECT_NE(msg(make_tokenizer(false, split_pre("\\w+"))).find("Split pattern"), std::string::npos);
  json bm = make_tokenizer(false, gpt2_pre());
  bm["model"]["merges"].push_back("q z");
  EXPECT_NE(msg(bm).find("missing from the vocabulary"), std::string::npos);
  EXPECT_NE(msg(json{{"vocab", 1}}).find("not an HF tokenizer.json"), std::string::npos);
}

TEST(BpeTokenizer, LoadsFromFileAndByteSpec) {
  const std::string path = (std::filesystem::temp_directory_path() / ("kestrel_bpe_" + std::to_string(::getpid()) + ".json")).string();
  std::ofstream(path) << make_tokenizer(false, gpt2_pre()).dump();
  std::unique_ptr<TextTokenizer> t = load_text_tokenizer(path);
  EXPECT_EQ(t->encode("hello world"), (std::vector<int64_t>{259, 264}));
  std::unique_ptr<TextTokenizer> b = load_text_tokenizer("byte");
  EXPECT_EQ(b->encode("hi"), bytes_of("hi"));
  EXPECT_EQ(b->token_id("<eos>"), 258);
  EXPECT_THROW(load_text_tokenizer(path + ".missing"), Error);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kestrel::train
