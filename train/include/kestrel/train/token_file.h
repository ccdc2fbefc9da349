// llm.c token files: a 256 x int32 little-endian header {magic, version, token count, 0...}
// followed by the tokens, uint16 (GPT-2 style: magic 20240520, version 1) or uint32 (Llama 3 style:
// magic 20240801, version 7), as karpathy/llm.c dev/data/data_common.py writes them.
//
// Policy: the reader memory-maps the file and validates magic, version and that the file size is
// exactly header + count x token size (a truncated or padded shard is an error, not a short read);
// every error names the file. Token ids are not range-checked on open (that would touch every page
// of a multi-GB shard); call check_vocab() where the vocabulary size is known.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kestrel/models/file_io.h"

namespace kestrel::train {

enum class TokenFormat : uint8_t { U16, U32 };  // GPT-2 (uint16) and Llama 3 (uint32) variants

inline constexpr int32_t kTokenMagicU16 = 20240520;
inline constexpr int32_t kTokenVersionU16 = 1;
inline constexpr int32_t kTokenMagicU32 = 20240801;
inline constexpr int32_t kTokenVersionU32 = 7;
inline constexpr int64_t kTokenHeaderInts = 256;
inline constexpr int64_t kTokenHeaderBytes = kTokenHeaderInts * 4;

constexpr int64_t token_size(TokenFormat f) { return f == TokenFormat::U16 ? 2 : 4; }

class TokenFile {
 public:
  static TokenFile open(const std::string& path);

  const std::string& path() const { return map_->path(); }
  TokenFormat format() const { return format_; }
  int64_t size() const { return count_; }  // number of tokens
  uint32_t operator[](int64_t i) const;    // unchecked index
  uint32_t at(int64_t i) const;            // range-checked, throws
  // Copies tokens [start, start + out.size()) widened to uint32; throws if out of range.
  void read(int64_t start, std::span<uint32_t> out) const;
  // Copies tokens [start, start + out.size()) as int32 (the dtype token tensors use).
  void read(int64_t start, std::span<int32_t> out) const;
  // Raw token bytes (count x token_size), little-endian.
  std::span<const std::byte> token_bytes() const;
  // Throws "[token_file] '<path>': token <id> at position <i> is >= vocab size <v>" for the first
  // offending token.
  void check_vocab(int64_t vocab_size) const;

 private:
  std::shared_ptr<const models::MappedFile> map_;
  TokenFormat format_ = TokenFormat::U16;
  int64_t count_ = 0;
};

// Writes tokens atomically in `format`; U16 rejects ids >= 65536 (naming the first position).
void write_token_file(const std::string& path, std::span<const uint32_t> tokens, TokenFormat format);

// Expands a shard pattern ("data/train_*.bin"; ?, * and [..] as in the shell) into a sorted file
// list; a comma-separated list of patterns is expanded piece by piece and concatenated. A pattern
// with no wildcard names one file, which must exist. Throws when nothing matches.
std::vector<std::string> expand_shards(const std::string& patterns);

}  // namespace kestrel::train
