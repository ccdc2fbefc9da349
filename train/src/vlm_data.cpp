#include "kestrel/train/vlm_data.h"

namespace kestrel::train {

ShapesVlmData::ShapesVlmData(ShapesConfig shapes, int64_t tokens_per_image, Device device, DType pixel_dtype)
    : dataset_(shapes), tokens_per_image_(tokens_per_image), device_(device), pixel_dtype_(pixel_dtype) {}

Tensor ShapesVlmData::pixels(uint64_t first, int64_t count) const {
  const int64_t S = dataset_.image_size();
  std::vector<float> px(static_cast<size_t>(count * 3 * S * S));
  std::vector<uint8_t> img(static_cast<size_t>(dataset_.image_bytes()));
  for (int64_t b = 0; b < count; ++b) {
    dataset_.render(first + static_cast<uint64_t>(b), img);
    for (int64_t y = 0; y < S; ++y)
      for (int64_t x = 0; x < S; ++x)
        for (int64_t c = 0; c < 3; ++c)
          px[((b * 3 + c) * S + y) * S + x] = (img[(y * S + x) * 3 + c] / 255.0f - 0.5f) / 0.5f;
  }
  return Tensor::from_vector(px, {count, 3, S, S}, pixel_dtype_, device_);
}

std::vector<int64_t> ShapesVlmData::prompt() const {
  std::vector<int64_t> p(static_cast<size_t>(tokens_per_image_), ByteTokenizer::kImage);
  p.push_back(ByteTokenizer::kBos);
  return p;
}

models::VlmBatch ShapesVlmData::batch(uint64_t first, int64_t count) const {
  std::vector<int64_t> ids, labels, img_pos, lengths;
  std::vector<uint8_t> img(static_cast<size_t>(dataset_.image_bytes()));
  for (int64_t b = 0; b < count; ++b) {
    ShapeSample s = dataset_.render(first + static_cast<uint64_t>(b), img);
    std::vector<int64_t> doc = prompt();
    int64_t base = static_cast<int64_t>(ids.size());
    for (int64_t i = 0; i < tokens_per_image_; ++i) img_pos.push_back(base + i);
    for (int64_t t : tokenizer_.encode(s.caption)) doc.push_back(t);
    doc.push_back(ByteTokenizer::kEos);
    // Next-token labels: from <bos> (predicting the first caption byte) to the last byte (predicting <eos>).
    for (size_t t = 0; t < doc.size(); ++t)
      labels.push_back(static_cast<int64_t>(t) >= tokens_per_image_ && t + 1 < doc.size() ? doc[t + 1] : -100);
    ids.insert(ids.end(), doc.begin(), doc.end());
    lengths.push_back(static_cast<int64_t>(doc.size()));
  }
  models::VlmBatch out;
  const int64_t T = static_cast<int64_t>(ids.size());
  out.input_ids = Tensor::from_vector(ids, {T}, DType::I64, device_);
  out.labels = Tensor::from_vector(labels, {T}, DType::I64, device_);
  out.pixel_values = pixels(first, count);
  out.image_positions = Tensor::from_vector(img_pos, {static_cast<int64_t>(img_pos.size())}, DType::I64, device_);
  out.layout = models::PackedBatch::from_lengths(lengths, device_);
  return out;
}

}  // namespace kestrel::train
