// The built-in byte-level tokenizer: ids 0..255 are bytes, followed by the special tokens.
// It needs no vocabulary file, so the quickstart and tests run with nothing downloaded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kestrel::train {

class ByteTokenizer {
 public:
  static constexpr int64_t kPad = 256;
  static constexpr int64_t kBos = 257;
  static constexpr int64_t kEos = 258;
  static constexpr int64_t kImage = 259;
  static constexpr int64_t kVocabSize = 260;

  std::vector<int64_t> encode(const std::string& text) const;
  // Bytes only; special tokens are dropped (or shown as <bos>, <eos>, ... when `show_special`).
  std::string decode(const std::vector<int64_t>& ids, bool show_special = false) const;
};

}  // namespace kestrel::train
