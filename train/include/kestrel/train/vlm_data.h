// Image-caption batches for the VLM: each record is [<image> x tokens_per_image] <bos> caption <eos>,
// with the loss on the caption and <eos>; records are packed into one sequence (one document per
// record). Two sources: the embedded shapes dataset, and image-text JSONL files
// ({"image": "path.png|.ppm", "text": "..."} per line, paths relative to the JSONL file).
// With data.image_tiling (image_tiling.h) a picture is several tower images (tiles, then a
// thumbnail), cut on the prefetch thread; its record then starts with images x tokens_per_image
// <image> slots and the batch's images_per_document says how many each record has.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kestrel/models/vlm.h"
#include "kestrel/train/host_batch.h"
#include "kestrel/train/image_io.h"
#include "kestrel/train/image_tiling.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/tokenizer.h"

namespace kestrel::train {

// Image-token slots one image takes in the text sequence, the count every data path expands an image
// to (runs of image_token_id): one S x S view through the tower, (S / patch)^2 / pixel_shuffle^2.
inline int64_t tokens_per_image(const models::VlmConfig& config) { return config.image_tokens_per_image(); }
// The same for one width x height picture under data.image_tiling: its grid's tiles and thumbnail,
// each one S x S view (image_tiling.h); tokens_per_image(config) when tiling is off.
inline int64_t tokens_per_image(const models::VlmConfig& config, int64_t width, int64_t height,
                                const ImageTiling& tiling) {
  return tiled_image_tokens(width, height, config.vision_config.image_size, tiling, tokens_per_image(config));
}

// Packs records (captions + their [count, 3, S, S] pixel values) into one VLM batch.
models::VlmBatch make_vlm_batch(const std::vector<std::string>& captions, Tensor pixel_values,
                                int64_t tokens_per_image, Device device);
// The same on the host: arrays input_ids [T] i64, labels [T] i64, pixel_values [n, 3, S, S]
// (`pixel_dtype`), image_positions [n * tokens_per_image] i64, positions [T] i64, cu_seqlens [count + 1] i32.
// Record r has images_per_record[r] images (all 1 when empty), n their sum, and as many blocks of
// tokens_per_image slots before its <bos>; b.images_per_document records them.
HostBatch make_vlm_host_batch(const std::vector<std::string>& captions, const std::vector<float>& pixel_values,
                              int64_t S, int64_t tokens_per_image, DType pixel_dtype = DType::F32,
                              const std::vector<int64_t>& images_per_record = {});
// The VlmBatch of a host batch's device arrays (pixel values cast to `pixel_dtype`).
models::VlmBatch vlm_batch_from(const HostBatch& b, const std::vector<Tensor>& arrays, DType pixel_dtype);
// [H, W, 3] u8 images (each S x S) -> [count, 3, S, S] in [-1, 1] (SigLIP: (x/255 - 0.5) / 0.5).
Tensor normalize_images(const std::vector<const uint8_t*>& images, int64_t S, DType dtype, Device device);
std::vector<float> normalize_images(const std::vector<const uint8_t*>& images, int64_t S);
// Nearest-neighbour resize of an RGB image to S x S (identity when it already is).
std::vector<uint8_t> resize_nearest(const Image& img, int64_t S);

// An image file named by a data line (`where`: "file:line" for messages): a path relative to the data
// file's folder `dir` that stays inside it after resolving symlinks (models::confined_path: no absolute
// path, no '..'), no URL of any kind (remote and inline images are not fetched), and a regular file.
// Returns the joined path. Both image data paths (image-text JSONL and chat) use it.
std::string data_image_path(const std::string& dir, const std::string& name, const std::string& where,
                            const char* component);

class ImageTextData {
 public:
  // Reads and validates every line (errors name file:line); images are decoded when batched.
  // `image_size` is the tower's S; with `tiling` enabled each picture becomes its grid's tiles + thumbnail.
  ImageTextData(const std::string& jsonl_path, int64_t image_size, int64_t tokens_per_image, Device device,
                DType pixel_dtype, ImageTiling tiling = {});
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
  ImageTiling tiling_;
};

class ShapesVlmData {
 public:
  // The tower sees shapes.image_size images, or with `tiling` enabled the tiles (of `tile_size`, the
  // tower's S) and thumbnail of each (then shapes.image_size may exceed S).
  ShapesVlmData(ShapesConfig shapes, int64_t tokens_per_image, Device device, DType pixel_dtype,
                ImageTiling tiling = {}, int64_t tile_size = 0);

  // Records [first, first + count) as one packed batch.
  models::VlmBatch batch(uint64_t first, int64_t count) const;
  HostBatch host_batch(uint64_t first, int64_t count) const;  // thread-safe
  // Pixel values [count * images_per_record(), 3, S, S] in [-1, 1] (SigLIP normalisation: (x/255 - 0.5) / 0.5).
  Tensor pixels(uint64_t first, int64_t count) const;
  // The generation prompt of one record: image tokens and <bos>.
  std::vector<int64_t> prompt() const;
  // Tower images per record: 1 untiled, else the tile grid of a square image_size picture + thumbnail.
  int64_t images_per_record() const { return images_per_record_; }
  const ShapesDataset& dataset() const { return dataset_; }
  const ByteTokenizer& tokenizer() const { return tokenizer_; }

 private:
  ShapesDataset dataset_;
  ByteTokenizer tokenizer_;
  int64_t tokens_per_image_;
  Device device_;
  DType pixel_dtype_;
  ImageTiling tiling_;
  int64_t tile_size_, images_per_record_;
  // The tower images of record `index` appended to `out` (u8 [S, S, 3] each); returns its labels.
  ShapeSample render_images(uint64_t index, std::vector<std::vector<uint8_t>>& out) const;
};

}  // namespace kestrel::train
