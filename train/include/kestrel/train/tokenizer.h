// Tokenizers. The built-in byte-level tokenizer: ids 0..255 are bytes, followed by the special
// tokens; it needs no vocabulary file, so the quickstart and tests run with nothing downloaded.
// HF tokenizer.json files (byte-level BPE) load through load_text_tokenizer (bpe_tokenizer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kestrel::train {

// What the tokenize path needs of a tokenizer.
class TextTokenizer {
 public:
  virtual ~TextTokenizer() = default;
  virtual std::vector<int64_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // The id of a token given by its text ("<|endoftext|>", "<eos>"); -1 when there is none.
  virtual int64_t token_id(const std::string& token) const = 0;
};

class ByteTokenizer final : public TextTokenizer {
 public:
  static constexpr int64_t kPad = 256;
  static constexpr int64_t kBos = 257;
  static constexpr int64_t kEos = 258;
  static constexpr int64_t kImage = 259;
  static constexpr int64_t kVocabSize = 260;

  std::vector<int64_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override { return decode(ids, false); }
  // Bytes only; special tokens are dropped (or shown as <bos>, <eos>, ... when `show_special`).
  std::string decode(const std::vector<int64_t>& ids, bool show_special) const;
  int64_t vocab_size() const override { return kVocabSize; }
  int64_t token_id(const std::string& token) const override;  // "<pad>", "<bos>", "<eos>", "<image>"
};

// "byte" (or "") -> ByteTokenizer; anything else is a tokenizer.json path (BpeTokenizer).
std::unique_ptr<TextTokenizer> load_text_tokenizer(const std::string& spec);

}  // namespace kestrel::train
