#include "kestrel/train/host_batch.h"

#include <algorithm>

#include "kestrel/runtime/error.h"

namespace kestrel::train {

HostArray host_floats(const std::vector<float>& values, Shape shape, DType dtype) {
  if (dtype == DType::F32) return host_array(values, std::move(shape), dtype);
  KESTREL_CHECK(dtype == DType::BF16 || dtype == DType::F16, "host_batch", "float arrays are f32, bf16 or f16, got ",
                dtype_name(dtype));
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    bits[i] = dtype == DType::BF16 ? float_to_bf16_bits(values[i]) : float_to_f16_bits(values[i]);
  return host_array(bits, std::move(shape), dtype);
}

void add_packed_layout(HostBatch& b, const std::vector<int64_t>& lengths) {
  KESTREL_CHECK(!lengths.empty(), "host_batch", "no documents");
  std::vector<int64_t> pos;
  std::vector<int32_t> cu{0};
  int64_t mx = 0;
  for (int64_t len : lengths) {
    KESTREL_CHECK(len > 0, "host_batch", "document length must be positive, got ", len);
    for (int64_t i = 0; i < len; ++i) pos.push_back(i);
    cu.push_back(cu.back() + static_cast<int32_t>(len));
    mx = std::max(mx, len);
  }
  b.arrays.push_back(host_array(pos, {static_cast<int64_t>(pos.size())}, DType::I64));
  b.arrays.push_back(host_array(cu, {static_cast<int64_t>(cu.size())}, DType::I32));
  b.max_seqlen = mx;
  b.document_lengths = lengths;
}

models::PackedBatch packed_layout(const Tensor& positions, const Tensor& cu_seqlens, int64_t max_seqlen) {
  models::PackedBatch p;
  p.positions = positions;
  p.cu_seqlens = cu_seqlens;
  p.max_seqlen = max_seqlen;
  return p;
}

std::vector<Tensor> arrays_to_device(const HostBatch& b, Device device) {
  std::vector<Tensor> out;
  for (const HostArray& a : b.arrays) {
    Tensor host = Tensor::from_blob(const_cast<std::byte*>(a.bytes.data()), a.shape, a.dtype, Device::cpu());
    out.push_back(device.is_cpu() ? host.clone() : host.to(device));
  }
  return out;
}

}  // namespace kestrel::train
