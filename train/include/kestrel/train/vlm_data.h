// Image-caption batches for the VLM from the embedded shapes dataset: each record is
// [<image> x tokens_per_image] <bos> caption <eos>, with the loss on the caption and <eos>.
// Records are packed into one sequence (one document per record).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/models/vlm.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/tokenizer.h"

namespace kestrel::train {

class ShapesVlmData {
 public:
  ShapesVlmData(ShapesConfig shapes, int64_t tokens_per_image, Device device, DType pixel_dtype);

  // Records [first, first + count) as one packed batch.
  models::VlmBatch batch(uint64_t first, int64_t count) const;
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
