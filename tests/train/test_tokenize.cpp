// The tokenize path: text / JSONL documents -> llm.c token files (uint16 or uint32 by vocabulary
// size), with the separator before each document, read back through TokenFile; and the decoder
// task's check that data.tokenizer fits the model's vocabulary.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kestrel/runtime/error.h"
#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/tokenize_text.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::string tmp_dir(const std::string& n) {
  fs::path p = fs::temp_directory_path() / ("kestrel_tokenize_" + n + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

std::vector<uint32_t> read_all(const std::string& path) {
  TokenFile f = TokenFile::open(path);
  std::vector<uint32_t> v(static_cast<size_t>(f.size()));
  f.read(0, v);
  return v;
}

// A byte-level BPE with every byte symbol (ids 0..255), one merge "h e" (256), <|endoftext|> and
// `extra` filler tokens after it.
json small_bpe(int64_t extra) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level_symbol(static_cast<uint8_t>(b))] = b;
  vocab["he"] = 256;
  vocab["<|endoftext|>"] = 257;
  for (int64_t i = 0; i < extra; ++i) vocab["filler" + std::to_string(i)] = 258 + i;
  return json{{"added_tokens", {{{"id", 257}, {"content", "<|endoftext|>"}, {"special", true}}}},
              {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"h e"})}}}};
}

TEST(Tokenize, ByteTokenizerTextAndJsonl) {
  const std::string d = tmp_dir("byte");
  std::ofstream(d + "/a.txt") << "hi\n\n  \nyo\n";
  std::ofstream(d + "/b.jsonl") << json{{"text", "x\ny"}}.dump() << "\n";
  ByteTokenizer tok;
  TokenizeResult r = tokenize_to_token_file(tok, {d + "/a.txt", d + "/b.jsonl"}, d + "/out.bin");
  EXPECT_EQ(r.documents, 3);
  EXPECT_EQ(r.separator_id, ByteTokenizer::kEos);
  EXPECT_EQ(r.format, TokenFormat::U16);
  const uint32_t e = static_cast<uint32_t>(ByteTokenizer::kEos);
  EXPECT_EQ(read_all(d + "/out.bin"), (std::vector<uint32_t>{e, 'h', 'i', e, 'y', 'o', e, 'x', '\n', 'y'}));
  EXPECT_EQ(TokenFile::open(d + "/out.bin").format(), TokenFormat::U16);
  std::ofstream(d + "/bad.jsonl") << "{\"txt\": 1}\n";
  try {
    tokenize_to_token_file(tok, {d + "/bad.jsonl"}, d + "/bad.bin");
    ADD_FAILURE();
  } catch (const Error& ex) {
    EXPECT_NE(std::string(ex.what()).find("bad.jsonl:1"), std::string::npos) << ex.what();
  }
  EXPECT_THROW(tokenize_to_token_file(tok, {d + "/a.txt"}, d + "/x.bin", "<nope>"), Error);
  fs::remove_all(d);
}

TEST(Tokenize, BpeFilesAreUint16OrUint32ByVocabulary) {
  const std::string d = tmp_dir("bpe");
  std::ofstream(d + "/doc.txt") << "hehe\n";
  BpeTokenizer small = BpeTokenizer::from_json(small_bpe(10), "small");
  TokenizeResult r = tokenize_to_token_file(small, {d + "/doc.txt"}, d + "/small.bin");
  EXPECT_EQ(r.separator_id, 257);
  EXPECT_EQ(r.format, TokenFormat::U16);
  EXPECT_EQ(read_all(d + "/small.bin"), (std::vector<uint32_t>{257, 256, 256}));
  // 258 + 65300 ids > 65536: uint32, the Llama 3 variant.
  BpeTokenizer big = BpeTokenizer::from_json(small_bpe(65300), "big");
  EXPECT_GT(big.vocab_size(), 65536);
  r = tokenize_to_token_file(big, {d + "/doc.txt"}, d + "/big.bin");
  EXPECT_EQ(r.format, TokenFormat::U32);
  EXPECT_EQ(TokenFile::open(d + "/big.bin").format(), TokenFormat::U32);
  EXPECT_EQ(read_all(d + "/big.bin"), (std::vector<uint32_t>{257, 256, 256}));
  fs::remove_all(d);
}

TEST(Tokenize, DecoderChecksTheTokenizerAgainstTheModel) {
  const std::string d = tmp_dir("decoder");
  std::ofstream(d + "/tok.json") << small_bpe(10).dump();
  std::ofstream(d + "/doc.txt") << "hello there\nhe he\n";
  BpeTokenizer tok = BpeTokenizer::from_file(d + "/tok.json");
  TokenizeResult r = tokenize_to_token_file(tok, {d + "/doc.txt"}, d + "/train.bin");
  json text = {{"model_type", "llama"}, {"vocab_size", 300}, {"hidden_size", 16}, {"intermediate_size", 32},
               {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1}};
  json user = {{"model", {{"type", "decoder"}, {"config", text}}},
               {"data", {{"type", "tokens"}, {"train_files", d + "/train.bin"}, {"seq_len", 8},
                         {"doc_start_token", r.separator_id}, {"tokenizer", d + "/tok.json"}}},
               {"train", {{"steps", 2}, {"batch_size", 2}}},
               {"device", "cpu"},
               {"log_every", 1000},
               {"out_dir", d + "/run"}};
  {
    Trainer t(resolve_train_config(user, "test"));
    t.set_log_callback([](const std::string&) {});
    EXPECT_EQ(t.run().steps, 2);
  }
  user["model"]["config"]["vocab_size"] = 260;  // the tokenizer has 268 ids
  try {
    Trainer t(resolve_train_config(user, "test"));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.tokenizer"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

}  // namespace
}  // namespace kestrel::train
