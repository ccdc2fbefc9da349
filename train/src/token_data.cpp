#include "kestrel/train/token_data.h"

#include <algorithm>

#include "kestrel/runtime/error.h"

namespace kestrel::train {

TokenStream::TokenStream(const std::string& patterns, int64_t vocab_size, int64_t doc_start_token)
    : doc_start_(doc_start_token) {
  files_ = expand_shards(patterns);
  offsets_.push_back(0);
  for (const std::string& f : files_) {
    shards_.push_back(TokenFile::open(f));
    shards_.back().check_vocab(vocab_size);
    offsets_.push_back(offsets_.back() + shards_.back().size());
  }
  total_ = offsets_.back();
  KESTREL_CHECK(total_ > 1, "token_data", "'", patterns, "' holds ", total_, " tokens; need at least 2");
}

std::vector<int64_t> TokenStream::read(uint64_t start, int64_t n) const {
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  int64_t pos = static_cast<int64_t>(start % static_cast<uint64_t>(total_));
  while (static_cast<int64_t>(out.size()) < n) {
    size_t s = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), pos) - offsets_.begin() - 1);
    int64_t local = pos - offsets_[s];
    int64_t take = std::min(n - static_cast<int64_t>(out.size()), shards_[s].size() - local);
    std::vector<uint32_t> buf(static_cast<size_t>(take));
    shards_[s].read(local, buf);
    out.insert(out.end(), buf.begin(), buf.end());
    pos = (pos + take) % total_;
  }
  return out;
}

HostBatch TokenStream::host_batch(uint64_t index, int64_t rows, int64_t seq_len) const {
  KESTREL_CHECK(rows > 0 && seq_len > 0, "token_data", "rows and seq_len must be positive, got ", rows, " and ", seq_len);
  std::vector<int64_t> ids, labels, lengths;
  ids.reserve(static_cast<size_t>(rows * seq_len));
  labels.reserve(static_cast<size_t>(rows * seq_len));
  for (int64_t r = 0; r < rows; ++r) {
    uint64_t start = (index * static_cast<uint64_t>(rows) + static_cast<uint64_t>(r)) * static_cast<uint64_t>(seq_len);
    std::vector<int64_t> t = read(start, seq_len + 1);
    int64_t doc_begin = 0;
    for (int64_t i = 0; i < seq_len; ++i) {
      if (i > 0 && doc_start_ >= 0 && t[i] == doc_start_) {
        lengths.push_back(i - doc_begin);
        doc_begin = i;
      }
      ids.push_back(t[i]);
      labels.push_back(t[i + 1]);
    }
    lengths.push_back(seq_len - doc_begin);
  }
  HostBatch b;
  b.index = index;
  b.tokens = rows * seq_len;
  b.arrays.push_back(host_array(ids, {b.tokens}, DType::I64));
  b.arrays.push_back(host_array(labels, {b.tokens}, DType::I64));
  add_packed_layout(b, lengths);
  return b;
}

TokenBatch token_batch_from(const HostBatch& b, const std::vector<Tensor>& a) {
  KESTREL_CHECK(a.size() == 4, "token_data", "a token batch has 4 arrays, got ", a.size());
  TokenBatch out;
  out.input_ids = a[0];
  out.labels = a[1];
  out.layout = packed_layout(a[2], a[3], b.max_seqlen);
  return out;
}

TokenBatch TokenStream::batch(uint64_t index, int64_t rows, int64_t seq_len, Device device) const {
  HostBatch b = host_batch(index, rows, seq_len);
  return token_batch_from(b, arrays_to_device(b, device));
}

}  // namespace kestrel::train
