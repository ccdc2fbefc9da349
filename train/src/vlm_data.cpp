#include "kestrel/train/vlm_data.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kestrel/models/file_io.h"

namespace kestrel::train {

std::vector<float> normalize_images(const std::vector<const uint8_t*>& images, int64_t S) {
  const int64_t count = static_cast<int64_t>(images.size());
  std::vector<float> px(static_cast<size_t>(count * 3 * S * S));  // [count, 3, S, S]
  for (int64_t b = 0; b < count; ++b)
    for (int64_t y = 0; y < S; ++y)
      for (int64_t x = 0; x < S; ++x)
        for (int64_t c = 0; c < 3; ++c)
          px[((b * 3 + c) * S + y) * S + x] = (images[b][(y * S + x) * 3 + c] / 255.0f - 0.5f) / 0.5f;
  return px;
}

Tensor normalize_images(const std::vector<const uint8_t*>& images, int64_t S, DType dtype, Device device) {
  return Tensor::from_vector(normalize_images(images, S), {static_cast<int64_t>(images.size()), 3, S, S}, dtype, device);
}
std::vector<uint8_t> resize_nearest(const Image& img, int64_t S) { return resize_nearest(img, S, S); }

HostBatch make_vlm_host_batch(const std::vector<std::string>& captions, const std::vector<float>& pixel_values,
                              int64_t S, int64_t tokens_per_image, DType pixel_dtype,
                              const std::vector<int64_t>& images_per_record) {
  std::vector<int64_t> per_record = images_per_record;
  if (per_record.empty()) per_record.assign(captions.size(), 1);
  KESTREL_CHECK(per_record.size() == captions.size(), "vlm_data", "images per record given for ", per_record.size(),
                " records, the batch has ", captions.size());
  ByteTokenizer tok;
  std::vector<int64_t> ids, labels, img_pos, lengths;
  int64_t count = 0;  // tower images
  for (size_t r = 0; r < captions.size(); ++r) {
    KESTREL_CHECK(per_record[r] >= 0, "vlm_data", "record ", r, " has ", per_record[r], " images");
    const int64_t slots = per_record[r] * tokens_per_image;
    count += per_record[r];
    std::vector<int64_t> doc(static_cast<size_t>(slots), ByteTokenizer::kImage);
    doc.push_back(ByteTokenizer::kBos);
    int64_t base = static_cast<int64_t>(ids.size());
    for (int64_t i = 0; i < slots; ++i) img_pos.push_back(base + i);
    for (int64_t t : tok.encode(captions[r])) doc.push_back(t);
    doc.push_back(ByteTokenizer::kEos);
    // Next-token labels: from <bos> (predicting the first caption byte) to the last byte (predicting <eos>).
    for (size_t t = 0; t < doc.size(); ++t)
      labels.push_back(static_cast<int64_t>(t) >= slots && t + 1 < doc.size() ? doc[t + 1] : -100);
    ids.insert(ids.end(), doc.begin(), doc.end());
    lengths.push_back(static_cast<int64_t>(doc.size()));
  }
  const int64_t T = static_cast<int64_t>(ids.size());
  KESTREL_CHECK(static_cast<int64_t>(pixel_values.size()) == count * 3 * S * S, "vlm_data", "pixel values hold ",
                pixel_values.size(), " floats; ", count, " images of ", S, "x", S, " need ", count * 3 * S * S);
  HostBatch b;
  b.tokens = T;
  b.images_per_document = per_record;
  b.arrays.push_back(host_array(ids, {T}, DType::I64));
  b.arrays.push_back(host_array(labels, {T}, DType::I64));
  b.arrays.push_back(host_floats(pixel_values, {count, 3, S, S}, pixel_dtype));
  b.arrays.push_back(host_array(img_pos, {static_cast<int64_t>(img_pos.size())}, DType::I64));
  add_packed_layout(b, lengths);
  return b;
}

models::VlmBatch vlm_batch_from(const HostBatch& b, const std::vector<Tensor>& a, DType pixel_dtype) {
  KESTREL_CHECK(a.size() == 6, "vlm_data", "a VLM batch has 6 arrays, got ", a.size());
  models::VlmBatch out;
  out.input_ids = a[0];
  out.labels = a[1];
  out.pixel_values = a[2].dtype() == pixel_dtype ? a[2] : a[2].to(pixel_dtype);
  out.image_positions = a[3];
  out.layout = packed_layout(a[4], a[5], b.max_seqlen);
  out.images_per_document = b.images_per_document;
  return out;
}

models::VlmBatch make_vlm_batch(const std::vector<std::string>& captions, Tensor pixel_values,
                                int64_t tokens_per_image, Device device) {
  const int64_t S = pixel_values.size(3);
  HostBatch b = make_vlm_host_batch(captions, pixel_values.to_float_vector(), S, tokens_per_image);
  std::vector<Tensor> a = arrays_to_device(b, device);
  a[2] = pixel_values;
  return vlm_batch_from(b, a, pixel_values.dtype());
}
// ---- image-text JSONL ----

std::string data_image_path(const std::string& dir, const std::string& name, const std::string& where,
                            const char* component) {
  KESTREL_CHECK(!name.empty(), component, where, ": an image path is empty");
  KESTREL_CHECK(name.find("://") == std::string::npos && name.rfind("data:", 0) != 0, component, where,
                ": image '", name, "' is a URL; remote and inline images are not fetched: give a file path "
                "relative to the data file's folder");
  const std::string path = models::confined_path(dir, name, where, component);
  std::error_code ec;  // status() never opens, so a FIFO cannot block here
  const auto st = std::filesystem::status(path, ec);
  KESTREL_CHECK(st.type() != std::filesystem::file_type::not_found, component, where, ": image '", path,
                "' does not exist");
  KESTREL_CHECK(st.type() == std::filesystem::file_type::regular, component, where, ": image '", path,
                "' is not a regular file (a folder, a FIFO or a device)");
  return path;
}

ImageTextData::ImageTextData(const std::string& jsonl_path, int64_t image_size, int64_t tokens_per_image,
                             Device device, DType pixel_dtype, ImageTiling tiling)
    : image_size_(image_size),
      tokens_per_image_(tokens_per_image),
      device_(device),
      pixel_dtype_(pixel_dtype),
      tiling_(tiling) {
  namespace fs = std::filesystem;
  models::require_regular_file(jsonl_path, "image_text");  // a FIFO would block the open below
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
    const std::string where = jsonl_path + ":" + std::to_string(n);
    records_.push_back({data_image_path(dir.string(), j["image"].get<std::string>(), where, "image_text"),
                        j["text"].get<std::string>()});
  }
  KESTREL_CHECK(!records_.empty(), "image_text", "'", jsonl_path, "' holds no records");
}

HostBatch ImageTextData::host_batch(uint64_t first, int64_t count) const {
  std::vector<std::string> captions;
  std::vector<std::vector<uint8_t>> images;  // the tower's S x S images, record after record
  std::vector<int64_t> per_record;
  for (int64_t b = 0; b < count; ++b) {
    const Record& r = records_[(first + static_cast<uint64_t>(b)) % records_.size()];
    captions.push_back(r.text);
    std::vector<std::vector<uint8_t>> tiles = tile_image(read_image(r.image), image_size_, tiling_);
    per_record.push_back(static_cast<int64_t>(tiles.size()));
    for (auto& t : tiles) images.push_back(std::move(t));
  }
  std::vector<const uint8_t*> ptrs;
  for (auto& im : images) ptrs.push_back(im.data());
  return make_vlm_host_batch(captions, normalize_images(ptrs, image_size_), image_size_, tokens_per_image_,
                             pixel_dtype_, per_record);
}

models::VlmBatch ImageTextData::batch(uint64_t first, int64_t count) const {
  HostBatch b = host_batch(first, count);
  return vlm_batch_from(b, arrays_to_device(b, device_), pixel_dtype_);
}

// ---- the embedded shapes dataset ----

ShapesVlmData::ShapesVlmData(ShapesConfig shapes, int64_t tokens_per_image, Device device, DType pixel_dtype,
                             ImageTiling tiling, int64_t tile_size)
    : dataset_(shapes),
      tokens_per_image_(tokens_per_image),
      device_(device),
      pixel_dtype_(pixel_dtype),
      tiling_(tiling),
      tile_size_(tile_size > 0 ? tile_size : shapes.image_size) {
  const int64_t size = dataset_.image_size();
  KESTREL_CHECK(tiling_.enabled() || size == tile_size_, "vlm_data", "shapes images of ", size, "x", size,
                " need image tiling to feed a tower of ", tile_size_, "x", tile_size_);
  images_per_record_ = choose_tile_grid(size, size, tile_size_, tiling_).images();
}

ShapeSample ShapesVlmData::render_images(uint64_t index, std::vector<std::vector<uint8_t>>& out) const {
  Image img{dataset_.image_size(), dataset_.image_size(), std::vector<uint8_t>(dataset_.image_bytes())};
  ShapeSample s = dataset_.render(index, img.pixels);
  if (!tiling_.enabled()) {
    out.push_back(std::move(img.pixels));
    return s;
  }
  for (auto& t : tile_image(img, tile_size_, tiling_)) out.push_back(std::move(t));
  return s;
}

Tensor ShapesVlmData::pixels(uint64_t first, int64_t count) const {
  std::vector<std::vector<uint8_t>> imgs;
  for (int64_t b = 0; b < count; ++b) render_images(first + static_cast<uint64_t>(b), imgs);
  std::vector<const uint8_t*> ptrs;
  for (auto& im : imgs) ptrs.push_back(im.data());
  return normalize_images(ptrs, tile_size_, pixel_dtype_, device_);
}

std::vector<int64_t> ShapesVlmData::prompt() const {
  std::vector<int64_t> p(static_cast<size_t>(images_per_record_ * tokens_per_image_), ByteTokenizer::kImage);
  p.push_back(ByteTokenizer::kBos);
  return p;
}

HostBatch ShapesVlmData::host_batch(uint64_t first, int64_t count) const {
  std::vector<std::string> captions;
  std::vector<std::vector<uint8_t>> imgs;
  for (int64_t b = 0; b < count; ++b) captions.push_back(render_images(first + static_cast<uint64_t>(b), imgs).caption);
  std::vector<const uint8_t*> ptrs;
  for (auto& im : imgs) ptrs.push_back(im.data());
  return make_vlm_host_batch(captions, normalize_images(ptrs, tile_size_), tile_size_, tokens_per_image_, pixel_dtype_,
                             std::vector<int64_t>(static_cast<size_t>(count), images_per_record_));
}

models::VlmBatch ShapesVlmData::batch(uint64_t first, int64_t count) const {
  HostBatch b = host_batch(first, count);
  return vlm_batch_from(b, arrays_to_device(b, device_), pixel_dtype_);
}

}  // namespace kestrel::train
