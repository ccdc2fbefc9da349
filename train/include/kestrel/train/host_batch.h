// A micro-batch assembled on the host as plain arrays (no tensors, no allocator, no device), so it
// can be built on the prefetch thread while the device computes, then staged in pinned memory and
// copied on the H2D stream (batch_prefetcher). Each data source fills the arrays in its own order
// and turns the device copies back into its batch struct (VlmBatch, TokenBatch).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kestrel/models/packed_batch.h"
#include "kestrel/runtime/tensor.h"

namespace kestrel::train {

struct HostArray {
  DType dtype = DType::F32;
  Shape shape;
  std::vector<std::byte> bytes;  // contiguous, row-major
};

struct HostBatch {
  uint64_t index = 0;       // micro-batch index (data position) it was built for
  int64_t tokens = 0;       // tokens in the batch (for tokens/s)
  int64_t max_seqlen = 0;   // longest document (PackedBatch::max_seqlen)
  std::vector<int64_t> document_lengths;  // of the packed layout (add_packed_layout): MFU's attention FLOPs
  // VLM batches: the tower images of each document, in order (tiles then thumbnail, image_tiling.h);
  // host metadata, not copied to the device. Empty: one image per document.
  std::vector<int64_t> images_per_document;
  std::vector<HostArray> arrays;
};

template <typename T>
HostArray host_array(const std::vector<T>& values, Shape shape, DType dtype) {
  HostArray a{dtype, std::move(shape), std::vector<std::byte>(values.size() * sizeof(T))};
  if (!values.empty()) std::memcpy(a.bytes.data(), values.data(), a.bytes.size());
  return a;
}

// Float values stored as `dtype` (f32, bf16 or f16; rounded to nearest even on the host, as the
// device casts do), so a batch travels and lives on the device in the model's dtype.
HostArray host_floats(const std::vector<float>& values, Shape shape, DType dtype);

// Appends the packed layout of documents of `lengths` (positions [T] i64, cu_seqlens [docs + 1] i32)
// to `b` and sets b.max_seqlen.
void add_packed_layout(HostBatch& b, const std::vector<int64_t>& lengths);
// The layout from the device copies of those two arrays.
models::PackedBatch packed_layout(const Tensor& positions, const Tensor& cu_seqlens, int64_t max_seqlen);
// Synchronous copies of every array to `device` (owned tensors, also on the CPU).
std::vector<Tensor> arrays_to_device(const HostBatch& b, Device device);

}  // namespace kestrel::train
