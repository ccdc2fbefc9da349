#include "kestrel/models/packed_batch.h"

#include <algorithm>

#include "kestrel/runtime/error.h"

namespace kestrel::models {

PackedBatch PackedBatch::from_lengths(const std::vector<int64_t>& lengths, Device device) {
  KESTREL_CHECK(!lengths.empty(), "packed_batch", "no documents");
  std::vector<int64_t> pos, cu{0};
  int64_t mx = 0;
  for (int64_t len : lengths) {
    KESTREL_CHECK(len > 0, "packed_batch", "document length must be positive, got ", len);
    for (int64_t i = 0; i < len; ++i) pos.push_back(i);
    cu.push_back(cu.back() + len);
    mx = std::max(mx, len);
  }
  PackedBatch b;
  b.positions = Tensor::from_vector(pos, {static_cast<int64_t>(pos.size())}, DType::I64, device);
  b.cu_seqlens = Tensor::from_vector(cu, {static_cast<int64_t>(cu.size())}, DType::I32, device);
  b.max_seqlen = mx;
  return b;
}

}  // namespace kestrel::models
