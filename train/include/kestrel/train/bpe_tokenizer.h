// HF tokenizer.json, byte-level BPE (as GPT-2, Qwen2 and Llama 3 ship it): vocabulary, merges (both
// the "a b" string form and the ["a", "b"] pair form), added tokens, the ByteLevel byte-to-unicode
// map and the pre-tokenizer split, implemented by hand (no regex engine):
//   - Gpt2:   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//             (the ByteLevel pre-tokenizer with use_regex = true)
//   - Qwen2:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//             \s*[\r\n]+|\s+(?!\S)|\s+   (digits one by one)
//   - Llama3: the same with \p{N}{1,3} (runs of up to three digits)
// chosen from the file: a Split pre-tokenizer whose Regex is one of these three patterns (behavior
// "Isolated"), followed or not by ByteLevel with use_regex = false; or ByteLevel alone.
//
// Policy: anything else (WordPiece/Unigram models, Metaspace/BertPreTokenizer, unknown Split
// patterns, byte_fallback, continuing_subword_prefix, normalizers other than none/NFC) is rejected
// with an error naming what was found. An NFC normalizer is accepted and not applied (text is taken
// as already NFC, which is what almost all text is). Added tokens are matched in the raw text
// (leftmost, longest at a position) before the split; lstrip/rstrip/single_word are not applied.
// A symbol missing from the vocabulary maps to model.unk_token when the file names one, else it is
// an error (a complete byte-level vocabulary holds all 256 byte symbols, so this only happens with
// hand-made files). Invalid UTF-8 in the input is split as punctuation bytes and still round-trips.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_map>
#include <vector>

#include "kestrel/train/tokenizer.h"

namespace kestrel::train {

enum class BpeSplit : uint8_t { Gpt2, Qwen2, Llama3 };

// The pre-tokenizer split alone (exposed for tests): the pieces concatenate back to `text`.
std::vector<std::string> bpe_pre_tokenize(const std::string& text, BpeSplit split);
// The GPT-2 ByteLevel map: byte -> one code point, UTF-8 encoded ("Ġ" for the space byte).
const std::string& byte_level_symbol(uint8_t byte);

class BpeTokenizer final : public TextTokenizer {
 public:
  static BpeTokenizer from_file(const std::string& path);
  // `source` names the document in errors.
  static BpeTokenizer from_json(const nlohmann::json& j, const std::string& source);

  std::vector<int64_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int64_t>& ids) const override;
  int64_t vocab_size() const override { return vocab_size_; }  // largest id + 1
  int64_t token_id(const std::string& token) const override;   // -1 when absent
  BpeSplit split() const { return split_; }
  bool add_prefix_space() const { return add_prefix_space_; }

 private:
  BpeTokenizer() = default;
  // Byte-level BPE of one pre-token (already mapped to byte symbols), appended to `out`.
  void encode_piece(const std::string& piece, std::vector<int64_t>& out) const;
  int64_t symbol_id(const std::string& symbol) const;

  std::unordered_map<std::string, int64_t> vocab_;
  std::vector<std::string> id_to_token_;   // "" for unused ids
  std::vector<char> id_is_added_;          // added tokens decode to their content verbatim
  std::unordered_map<uint64_t, std::pair<int32_t, int64_t>> merges_;  // (left id, right id) -> (rank, merged id)
  std::vector<std::pair<std::string, int64_t>> added_;  // content, id (longest first)
  std::array<bool, 256> added_first_{};                 // first bytes of added tokens
  int64_t vocab_size_ = 0;
  int64_t unk_id_ = -1;
  BpeSplit split_ = BpeSplit::Gpt2;
  bool add_prefix_space_ = false;
  bool ignore_merges_ = false;
  // Pre-token -> ids (guarded; encode may run on several threads).
  struct Cache;
  std::shared_ptr<Cache> cache_;
};

}  // namespace kestrel::train
