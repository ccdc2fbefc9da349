// Text training data: llm.c token shards (uint16 or uint32) read as one stream, cut into
// fixed-length rows, and packed into one micro-batch whose documents start at a separator token
// (llm.c's GPT-2 files put <|endoftext|> before each document), so attention never crosses a
// document boundary and positions restart at 0 in each document.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/models/packed_batch.h"
#include "kestrel/train/host_batch.h"
#include "kestrel/train/token_file.h"

namespace kestrel::train {

struct TokenBatch {
  Tensor input_ids;  // [rows * seq_len] i64
  Tensor labels;     // [rows * seq_len] i64: the next token of the stream
  models::PackedBatch layout;
};

// The TokenBatch of a host batch's device arrays.
TokenBatch token_batch_from(const HostBatch& b, const std::vector<Tensor>& arrays);

class TokenStream {
 public:
  // `patterns`: comma-separated paths or globs (expand_shards). Every token is checked against
  // `vocab_size` once, naming the file and the first offending position. `doc_start_token` < 0:
  // rows are single documents.
  TokenStream(const std::string& patterns, int64_t vocab_size, int64_t doc_start_token);

  int64_t size() const { return total_; }
  const std::vector<std::string>& files() const { return files_; }
  // Tokens [start, start + n) of the concatenated shards, wrapping at the end.
  std::vector<int64_t> read(uint64_t start, int64_t n) const;
  // Micro-batch `index`: rows r = 0..rows-1 take seq_len + 1 tokens starting at
  // (index * rows + r) * seq_len (rows overlap by the one target token).
  TokenBatch batch(uint64_t index, int64_t rows, int64_t seq_len, Device device) const;
  // The same on the host (thread-safe): arrays input_ids, labels [rows * seq_len] i64, positions, cu_seqlens.
  HostBatch host_batch(uint64_t index, int64_t rows, int64_t seq_len) const;

 private:
  std::vector<std::string> files_;
  std::vector<TokenFile> shards_;
  std::vector<int64_t> offsets_;  // cumulative token offsets of the shards
  int64_t total_ = 0;
  int64_t doc_start_;
};

}  // namespace kestrel::train
