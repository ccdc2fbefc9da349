#include "kestrel/train/vlm_data.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

namespace kestrel::train {

Tensor normalize_images(const std::vector<const uint8_t*>& images, int64_t S, DType dtype, Device device) {
  const int64_t count = static_cast<int64_t>(images.size());
  std::vector<float> px(static_cast<size_t>(count * 3 * S * S));
  for (int64_t b = 0; b < count; ++b)
    for (int64_t y = 0; y < S; ++y)
      for (int64_t x = 0; x < S; ++x)
        for (int64_t c = 0; c < 3; ++c)
          px[((b * 3 + c) * S + y) * S + x] = (images[b][(y * S + x) * 3 + c] / 255.0f - 0.5f) / 0.5f;
  return Tensor::from_vector(px, {count, 3, S, S}, dtype, device);
}

std::vector<uint8_t> resize_nearest(const Image& img, int64_t S) {
  if (img.width == S && img.height == S) return img.pixels;
  std::vector<uint8_t> out(static_cast<size_t>(S * S * 3));
  for (int64_t y = 0; y < S; ++y)
    for (int64_t x = 0; x < S; ++x) {
      int64_t sy = std::min(img.height - 1, (2 * y + 1) * img.height / (2 * S));
      int64_t sx = std::min(img.width - 1, (2 * x + 1) * img.width / (2 * S));
      for (int64_t c = 0; c < 3; ++c) out[(y * S + x) * 3 + c] = img.pixels[(sy * img.width + sx) * 3 + c];
    }
  return out;
}

models::VlmBatch make_vlm_batch(const std::vector<std::string>& captions, Tensor pixel_values,
                                int64_t tokens_per_image, Device device) {
  ByteTokenizer tok;
  std::vector<int64_t> ids, labels, img_pos, lengths;
  for (const std::string& caption : captions) {
    std::vector<int64_t> doc(static_cast<size_t>(tokens_per_image), ByteTokenizer::kImage);
    doc.push_back(ByteTokenizer::kBos);
    int64_t base = static_cast<int64_t>(ids.size());
    for (int64_t i = 0; i < tokens_per_image; ++i) img_pos.push_back(base + i);
    for (int64_t t : tok.encode(caption)) doc.push_back(t);
    doc.push_back(ByteTokenizer::kEos);
    // Next-token labels: from <bos> (predicting the first caption byte) to the last byte (predicting <eos>).
    for (size_t t = 0; t < doc.size(); ++t)
      labels.push_back(static_cast<int64_t>(t) >= tokens_per_image && t + 1 < doc.size() ? doc[t + 1] : -100);
    ids.insert(ids.end(), doc.begin(), doc.end());
    lengths.push_back(static_cast<int64_t>(doc.size()));
  }
  models::VlmBatch out;
  const int64_t T = static_cast<int64_t>(ids.size());
  out.input_ids = Tensor::from_vector(ids, {T}, DType::I64, device);
  out.labels = Tensor::from_vector(labels, {T}, DType::I64, device);
  out.pixel_values = std::move(pixel_values);
  out.image_positions = Tensor::from_vector(img_pos, {static_cast<int64_t>(img_pos.size())}, DType::I64, device);
  out.layout = models::PackedBatch::from_lengths(lengths, device);
  return out;
}

// ---- image-text JSONL ----

ImageTextData::ImageTextData(const std::string& jsonl_path, int64_t image_size, int64_t tokens_per_image,
                             Device device, DType pixel_dtype)
    : image_size_(image_size), tokens_per_image_(tokens_per_image), device_(device), pixel_dtype_(pixel_dtype) {
  namespace fs = std::filesystem;
  std::ifstream f(jsonl_path);
  KESTREL_CHECK(f.good(), "image_text", "cannot open '", jsonl_path, "'");
  const fs::path dir = fs::path(jsonl_path).parent_path();
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw make_error("image_text", jsonl_path, ":", n, ": not valid JSON (", e.what(), ")");
    }
    KESTREL_CHECK(j.is_object() && j.contains("image") && j["image"].is_string() && j.contains("text") &&
                      j["text"].is_string(),
                  "image_text", jsonl_path, ":", n, ": expected {\"image\": \"path\", \"text\": \"caption\"}");
    fs::path img = j["image"].get<std::string>();
    if (img.is_relative()) img = dir / img;
    KESTREL_CHECK(fs::exists(img), "image_text", jsonl_path, ":", n, ": image '", img.string(), "' does not exist");
    records_.push_back({img.string(), j["text"].get<std::string>()});
  }
  KESTREL_CHECK(!records_.empty(), "image_text", "'", jsonl_path, "' holds no records");
}

models::VlmBatch ImageTextData::batch(uint64_t first, int64_t count) const {
  std::vector<std::string> captions;
  std::vector<std::vector<uint8_t>> images;
  for (int64_t b = 0; b < count; ++b) {
    const Record& r = records_[(first + static_cast<uint64_t>(b)) % records_.size()];
    captions.push_back(r.text);
    images.push_back(resize_nearest(read_image(r.image), image_size_));
  }
  std::vector<const uint8_t*> ptrs;
  for (auto& im : images) ptrs.push_back(im.data());
  return make_vlm_batch(captions, normalize_images(ptrs, image_size_, pixel_dtype_, device_), tokens_per_image_,
                        device_);
}

// ---- the embedded shapes dataset ----

ShapesVlmData::ShapesVlmData(ShapesConfig shapes, int64_t tokens_per_image, Device device, DType pixel_dtype)
    : dataset_(shapes), tokens_per_image_(tokens_per_image), device_(device), pixel_dtype_(pixel_dtype) {}

Tensor ShapesVlmData::pixels(uint64_t first, int64_t count) const {
  std::vector<std::vector<uint8_t>> imgs(static_cast<size_t>(count), std::vector<uint8_t>(dataset_.image_bytes()));
  std::vector<const uint8_t*> ptrs;
  for (int64_t b = 0; b < count; ++b) {
    dataset_.render(first + static_cast<uint64_t>(b), imgs[b]);
    ptrs.push_back(imgs[b].data());
  }
  return normalize_images(ptrs, dataset_.image_size(), pixel_dtype_, device_);
}

std::vector<int64_t> ShapesVlmData::prompt() const {
  std::vector<int64_t> p(static_cast<size_t>(tokens_per_image_), ByteTokenizer::kImage);
  p.push_back(ByteTokenizer::kBos);
  return p;
}

models::VlmBatch ShapesVlmData::batch(uint64_t first, int64_t count) const {
  std::vector<std::string> captions;
  std::vector<std::vector<uint8_t>> imgs(static_cast<size_t>(count), std::vector<uint8_t>(dataset_.image_bytes()));
  std::vector<const uint8_t*> ptrs;
  for (int64_t b = 0; b < count; ++b) {
    captions.push_back(dataset_.render(first + static_cast<uint64_t>(b), imgs[b]).caption);
    ptrs.push_back(imgs[b].data());
  }
  return make_vlm_batch(captions, normalize_images(ptrs, dataset_.image_size(), pixel_dtype_, device_),
                        tokens_per_image_, device_);
}

}  // namespace kestrel::train
