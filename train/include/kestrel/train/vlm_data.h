// Image-caption batches for the VLM: each record is [<image> x tokens_per_image] <bos> caption <eos>,
// with the loss on the caption and <eos>; records are packed into one sequence (one document per
// record). Two sources: the embedded shapes dataset, and image-text JSONL files
// ({"image": "path.png|.ppm", "text": "..."} per line, paths relative to the JSONL file).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/models/vlm.h"
#include "kestrel/train/host_batch.h"
#include "kestrel/train/image_io.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/tokenizer.h"

namespace kestrel::train {

// Packs records (captions + their [count, 3, S, S] pixel values) into one VLM batch.
models::VlmBatch make_vlm_batch(const std::vector<std::string>& captions, Tensor pixel_values,
                                int64_t tokens_per_image, Device device);
// The same on the host: arrays input_ids [T] i64, labels [T] i64, pixel_values [count, 3, S, S]
// (`pixel_dtype`), image_positions [count * tokens_per_image] i64, positions [T] i64, cu_seqlens [count + 1] i32.
HostBatch make_vlm_host_batch(const std::vector<std::string>& captions, const std::vector<float>& pixel_values,
                              int64_t S, int64_t tokens_per_image, DType pixel_dtype = DType::F32);
// The VlmBatch of a host batch's device arrays (pixel values cast to `pixel_dtype`).
models::VlmBatch vlm_batch_from(const HostBatch& b, const std::vector<Tensor>& arrays, DType pixel_dtype);
// [H, W, 3] u8 images (each S x S) -> [count, 3, S, S] in [-1, 1] (SigLIP: (x/255 - 0.5) / 0.5).
Tensor normalize_images(const std::vector<const uint8_t*>& images, int64_t S, DType dtype, Device device);
std::vector<float> normalize_images(const std::vector<const uint8_t*>& images, int64_t S);
// Nearest-neighbour resize of an RGB image to S x S (identity when it already is).
std::vector<uint8_t> resize_nearest(const Image& img, int64_t S);

class ImageTextData {
 public:
  // Reads and validates every line (errors name file:line); images are decoded when batched.
  ImageTextData(const std::string& jsonl_path, int64_t image_size, int64_t tokens_per_image, Device device,
                DType pixel_dtype);
  int64_t size() const { return static_cast<int64_t>(records_.size()); }
  // Records [first, first + count) modulo size() as one packed batch.
  models::VlmBatch batch(uint64_t first, int64_t count) const;
  HostBatch host_batch(uint64_t first, int64_t count) const;  // thread-safe

 private:
  struct Record {
    std::string image, text;
  };
  std::vector<Record> records_;
  int64_t image_size_, tokens_per_image_;
  Device device_;
  DType pixel_dtype_;
};

class ShapesVlmData {
 public:
  ShapesVlmData(ShapesConfig shapes, int64_t tokens_per_image, Device device, DType pixel_dtype);

  // Records [first, first + count) as one packed batch.
  models::VlmBatch batch(uint64_t first, int64_t count) const;
  HostBatch host_batch(uint64_t first, int64_t count) const;  // thread-safe
  // Pixel values [count, 3, H, W] in [-1, 1] (SigLIP normalisation: (x/255 - 0.5) / 0.5).
  Tensor pixels(uint64_t first, int64_t count) const;
  // The generation prompt of one record: image tokens and <bos>.
  std::vector<int64_t> prompt() const;
  const ShapesDataset& dataset() const { return dataset_; }
  const ByteTokenizer& tokenizer() const { return tokenizer_; }

 private:
  ShapesDataset dataset_;
  ByteTokenizer tokenizer_;
  int64_t tokens_per_image_;
  Device device_;
  DType pixel_dtype_;
};

}  // namespace kestrel::train
