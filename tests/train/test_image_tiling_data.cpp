// Tiling in the VLM data path (data.image_tiling): a batch of pictures of different aspect ratios
// carries exactly the hand-computed tower images (tiles row-major, then the thumbnail), image slots,
// labels and documents; a tiny VLM trains on tiled image-text records and on tiled shapes data (loss
// finite and falling, held-out evaluation runs on tiled prompts); the planner counts the tiles; and
// the config refuses what it cannot do, naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>

#include "kestrel/autograd/grad_mode.h"
#include "kestrel/models/config.h"
#include "kestrel/models/vlm.h"
#include "kestrel/train/image_io.h"
#include "kestrel/train/image_tiling.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "kestrel/train/vlm_data.h"
#include "image_reference.h"
#include "support/errors.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;
using kestrel::testing::error_of;
using kestrel::testing::expect_has;

std::string tiling_tmp(const std::string& n) { return testing::fresh_temp_dir("kestrel_tiling", n); }

using kestrel::testing::reference_resize;

// The [S, S, 3] crop at tile (r, c) of an [h, w, 3] image.
std::vector<uint8_t> crop(const std::vector<uint8_t>& rgb, int64_t w, int64_t r, int64_t c, int64_t S) {
  std::vector<uint8_t> out;
  for (int64_t y = 0; y < S; ++y)
    for (int64_t x = 0; x < S; ++x)
      for (int k = 0; k < 3; ++k) out.push_back(rgb[((r * S + y) * w + c * S + x) * 3 + k]);
  return out;
}

Image random_image(int64_t W, int64_t H, std::mt19937_64& rng) {
  Image img{W, H, std::vector<uint8_t>(static_cast<size_t>(W * H * 3))};
  for (auto& p : img.pixels) p = static_cast<uint8_t>(rng() & 0xff);
  return img;
}

// Shapes pictures stretched to the given sizes, captioned, as an image-text JSONL; returns its path.
std::string write_stretched_shapes(const std::string& dir, int n, const std::vector<std::pair<int64_t, int64_t>>& sizes) {
  fs::create_directories(dir + "/img");
  ShapesConfig sc;
  sc.image_size = 32;
  sc.seed = 5;
  ShapesDataset ds(sc);
  std::ofstream f(dir + "/train.jsonl");
  for (int i = 0; i < n; ++i) {
    ShapeSample s = ds.sample(static_cast<uint64_t>(i));
    const auto [w, h] = sizes[static_cast<size_t>(i) % sizes.size()];
    const std::vector<uint8_t> px = resize_nearest(Image{32, 32, s.pixels}, w, h);
    const std::string name = "img/" + std::to_string(i) + ".ppm";
    write_ppm(dir + "/" + name, px, w, h);
    f << json{{"image", name}, {"text", s.caption}}.dump() << "\n";
  }
  return dir + "/train.jsonl";
}

// The tower: 16 x 16 images, patch 4, pixel shuffle 2 -> (16/4/2)^2 = 4 tokens per image.
constexpr int64_t kS = 16, kTpi = 4;

TEST(ImageTilingData, BatchOfMixedAspectRatiosIsExactlyTheHandComputedOne) {
  const std::string dir = tiling_tmp("batch");
  fs::create_directories(dir);
  std::mt19937_64 rng(11);
  // With max_tiles 4 and S = 16:
  //   16 x 16 (square, the tower's size)   -> 1 x 1, no thumbnail: 1 image
  //   32 x 16 (2:1)                         -> 1 x 2 + thumbnail:  3 images
  //   16 x 40 (0.4: closest 1/3)            -> 3 x 1 + thumbnail:  4 images
  //   64 x 64 (square, 2 W H > 4 S^2)       -> 2 x 2 + thumbnail:  5 images
  struct Rec {
    int64_t w, h, rows, cols, images;
    std::string caption;
  };
  const std::vector<Rec> recs = {{16, 16, 1, 1, 1, "ab"}, {32, 16, 1, 2, 3, "c"}, {16, 40, 3, 1, 4, "def"},
                                 {64, 64, 2, 2, 5, "gh"}};
  std::vector<Image> imgs;
  {
    std::ofstream f(dir + "/data.jsonl");
    for (size_t i = 0; i < recs.size(); ++i) {
      imgs.push_back(random_image(recs[i].w, recs[i].h, rng));
      write_ppm(dir + "/" + std::to_string(i) + ".ppm", imgs.back().pixels, recs[i].w, recs[i].h);
      f << json{{"image", std::to_string(i) + ".ppm"}, {"text", recs[i].caption}}.dump() << "\n";
    }
  }
  ImageTextData data(dir + "/data.jsonl", kS, kTpi, Device::cpu(), DType::F32, ImageTiling{4, true});
  const HostBatch hb = data.host_batch(0, 4);
  models::VlmBatch b = data.batch(0, 4);
  EXPECT_EQ(hb.images_per_document, (std::vector<int64_t>{1, 3, 4, 5}));
  EXPECT_EQ(b.images_per_document, (std::vector<int64_t>{1, 3, 4, 5}));
  ASSERT_EQ(b.pixel_values.shape(), (Shape{13, 3, kS, kS}));

  // Hand-built expectation: per record [<image> x images*4] <bos> caption <eos>, labels from <bos>.
  std::vector<int64_t> ids, labels, slots, cu{0}, positions;
  for (const Rec& r : recs) {
    std::vector<int64_t> doc(static_cast<size_t>(r.images * kTpi), ByteTokenizer::kImage);
    for (int64_t i = 0; i < r.images * kTpi; ++i) slots.push_back(static_cast<int64_t>(ids.size()) + i);
    doc.push_back(ByteTokenizer::kBos);
    for (char ch : r.caption) doc.push_back(static_cast<unsigned char>(ch));
    doc.push_back(ByteTokenizer::kEos);
    for (size_t t = 0; t < doc.size(); ++t) {
      labels.push_back(static_cast<int64_t>(t) >= r.images * kTpi && t + 1 < doc.size() ? doc[t + 1] : -100);
      positions.push_back(static_cast<int64_t>(t));
    }
    ids.insert(ids.end(), doc.begin(), doc.end());
    cu.push_back(static_cast<int64_t>(ids.size()));
  }
  // Document lengths: 4+2+2, 12+2+1, 16+2+3, 20+2+2.
  EXPECT_EQ(cu, (std::vector<int64_t>{0, 8, 23, 44, 68}));
  EXPECT_EQ(b.input_ids.to_int_vector(), ids);
  EXPECT_EQ(b.labels.to_int_vector(), labels);
  EXPECT_EQ(b.image_positions.to_int_vector(), slots);
  EXPECT_EQ(b.layout.positions.to_int_vector(), positions);
  EXPECT_EQ(b.layout.cu_seqlens.to_int_vector(), cu);
  EXPECT_EQ(hb.max_seqlen, 24);

  // Tower images in order: each record's tiles (crops of the f64 reference resize to cols*S x rows*S,
  // row-major), then its thumbnail (the whole picture at S x S), normalised as (x/255 - 0.5) / 0.5.
  std::vector<std::vector<uint8_t>> want;
  for (size_t i = 0; i < recs.size(); ++i) {
    const Rec& r = recs[i];
    const std::vector<uint8_t> big = reference_resize(imgs[i], r.cols * kS, r.rows * kS);
    for (int64_t tr = 0; tr < r.rows; ++tr)
      for (int64_t tc = 0; tc < r.cols; ++tc) want.push_back(crop(big, r.cols * kS, tr, tc, kS));
    if (r.images > r.rows * r.cols) want.push_back(reference_resize(imgs[i], kS, kS));
  }
  ASSERT_EQ(want.size(), 13u);
  // Record 1 (32 x 16 -> 1 x 2 at its own size): its tiles are the picture's halves, pixel for pixel.
  EXPECT_EQ(want[1], crop(imgs[1].pixels, 32, 0, 0, kS));
  EXPECT_EQ(want[2], crop(imgs[1].pixels, 32, 0, 1, kS));
  const std::vector<float> px = b.pixel_values.to_float_vector();
  for (int64_t n = 0; n < 13; ++n)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t y = 0; y < kS; ++y)
        for (int64_t x = 0; x < kS; ++x) {
          const float expect = (want[n][(y * kS + x) * 3 + c] / 255.0f - 0.5f) / 0.5f;
          ASSERT_EQ(px[((n * 3 + c) * kS + y) * kS + x], expect) << "image " << n << " (" << x << ", " << y << ")";
        }

  // Without the thumbnail: 1, 2, 3, 4 images.
  ImageTextData no_thumb(dir + "/data.jsonl", kS, kTpi, Device::cpu(), DType::F32, ImageTiling{4, false});
  EXPECT_EQ(no_thumb.host_batch(0, 4).images_per_document, (std::vector<int64_t>{1, 2, 3, 4}));
  // Untiled (the default): one S x S image per record, as before.
  ImageTextData plain(dir + "/data.jsonl", kS, kTpi, Device::cpu(), DType::F32);
  const HostBatch pb = plain.host_batch(0, 4);
  EXPECT_EQ(pb.images_per_document, (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(pb.arrays[2].shape, (Shape{4, 3, kS, kS}));
  fs::remove_all(dir);
}

TEST(ImageTilingData, TinyVlmTrainsOnTiledImageTextRecords) {
  const std::string dir = tiling_tmp("train_jsonl");
  // Pictures of 16 x 16 (1 tile), 32 x 16 (1 x 2 + thumbnail), 16 x 48 (3 x 1 + thumbnail), 32 x 32
  // (2 x 2 + thumbnail): batches mix 1 to 5 tower images per record.
  const std::string path = write_stretched_shapes(dir, 24, {{16, 16}, {32, 16}, {16, 48}, {32, 32}});
  json cfg = testing::tiny_vlm_run(dir + "/out", {{"steps", 25}, {"batch_size", 4}});
  cfg["data"]["type"] = "jsonl";
  cfg["data"]["train_files"] = path;
  cfg["data"]["image_tiling"] = {{"max_tiles", 4}, {"thumbnail", true}};
  cfg["prefetch"] = 2;  // tiles cut on the prefetch thread
  Trainer t(cfg);
  t.set_log_callback([](const std::string&) {});
  TrainSummary s = t.run();
  const std::vector<double> l = testing::metric_losses(dir + "/out");
  ASSERT_EQ(l.size(), 25u);
  for (double x : l) EXPECT_TRUE(std::isfinite(x));
  EXPECT_LT(s.last_loss, 0.8 * s.first_loss) << s.first_loss << " -> " << s.last_loss;
  fs::remove_all(dir);
}

TEST(ImageTilingData, TinyVlmTrainsOnTiledShapesAndEvaluates) {
  const std::string dir = tiling_tmp("train_shapes");
  // 32 px shapes pictures for a 16 px tower: 2 x 2 tiles + thumbnail, 5 images and 20 slots per record.
  json cfg = testing::tiny_vlm_run(dir + "/out", {{"steps", 25}, {"batch_size", 4}});
  cfg["data"]["image_size"] = 32;
  cfg["data"]["image_tiling"] = {{"max_tiles", 4}, {"thumbnail", true}};
  ShapesConfig sc;
  sc.image_size = 32;
  ShapesVlmData data(sc, kTpi, Device::cpu(), DType::F32, ImageTiling{4, true}, kS);
  EXPECT_EQ(data.images_per_record(), 5);
  EXPECT_EQ(data.prompt().size(), 5u * kTpi + 1);
  EXPECT_EQ(data.pixels(3, 2).shape(), (Shape{10, 3, kS, kS}));
  // The last image of a record is its thumbnail: the 32 px picture at 16 px.
  std::vector<uint8_t> pic(static_cast<size_t>(32 * 32 * 3));
  ShapesDataset(sc).render(3, pic);
  const std::vector<uint8_t> thumb = reference_resize(Image{32, 32, pic}, kS, kS);
  const std::vector<float> px = data.pixels(3, 1).to_float_vector();
  for (int64_t c = 0; c < 3; ++c)
    for (int64_t i = 0; i < kS * kS; ++i)
      ASSERT_EQ(px[(4 * 3 + c) * kS * kS + i], (thumb[i * 3 + c] / 255.0f - 0.5f) / 0.5f);

  Trainer t(cfg);
  t.set_log_callback([](const std::string&) {});
  TrainSummary s = t.run();
  for (double x : testing::metric_losses(dir + "/out")) EXPECT_TRUE(std::isfinite(x));
  EXPECT_LT(s.last_loss, 0.8 * s.first_loss) << s.first_loss << " -> " << s.last_loss;
  EXPECT_EQ(t.evaluate().samples, 4);  // greedy captions from tiled prompts (20 image slots + <bos>)
  fs::remove_all(dir);
}

TEST(ImageTilingData, VlmChecksImagesPerDocument) {
  const json cfg = testing::tiny_vlm_run("unused", {{"steps", 1}});
  const models::VlmConfig mc = models::VlmConfig::from_json(cfg["model"]["config"], "model.config");
  models::Vlm vlm(mc, DType::F32, Device::cpu(), 3);
  autograd::NoGradGuard no_grad;  // record no tape: nothing outlives the test (later tests profile memory)
  ShapesConfig sc;
  sc.image_size = 32;
  ShapesVlmData data(sc, tokens_per_image(mc), Device::cpu(), DType::F32, ImageTiling{4, true}, kS);
  models::VlmBatch b = data.batch(0, 2);
  EXPECT_EQ(b.images_per_document, (std::vector<int64_t>{5, 5}));
  EXPECT_EQ(b.image_positions.numel(), 2 * 5 * kTpi);
  EXPECT_TRUE(std::isfinite(vlm.loss(b).item()));
  // Metadata that disagrees with the pixels or the documents is an error, not a silent misalignment.
  b.images_per_document = {4, 5};
  expect_has(error_of([&] { vlm.loss(b); }), {"vlm", "images per document", "9 images", "10 pixel images"});
  b.images_per_document = {5, 5, 0};
  expect_has(error_of([&] { vlm.loss(b); }), {"vlm", "3 documents", "its 2 documents"});
}

TEST(ImageTilingData, PlanCountsTheTiles) {
  const std::string dir = tiling_tmp("plan");
  json cfg = testing::tiny_vlm_run(dir + "/out", {{"steps", 2}, {"batch_size", 4}});
  PlanOptions po;
  po.steps = 2;
  const MemoryPlan plain = plan_memory(cfg, po);
  cfg["data"]["image_size"] = 32;
  cfg["data"]["image_tiling"] = {{"max_tiles", 4}, {"thumbnail", true}};
  const MemoryPlan tiled = plan_memory(cfg, po);
  // 5 tower images and 20 image slots per record instead of 1 and 4: 16 more tokens per record.
  EXPECT_EQ(tiled.tokens, plain.tokens + 4 * 16);
  {
    // Image-text records are planned at the most a picture can have: 6 tiles + thumbnail, 28 slots.
    json jsonl = cfg;
    jsonl["data"]["type"] = "jsonl";
    jsonl["data"]["image_tiling"]["max_tiles"] = 6;
    EXPECT_EQ(plan_memory(jsonl, po).tokens, plain.tokens + 4 * 6 * kTpi);
  }
  EXPECT_GT(tiled.tag_peak[static_cast<int>(MemoryTag::Activation)],
            plain.tag_peak[static_cast<int>(MemoryTag::Activation)]);
  // And it agrees with a profiled run of the tiled config (per tag and in total, within 10%).
  MemoryProfile p = testing::profile_trainer_run(cfg, Device::cpu());
  for (MemoryTag tag : {MemoryTag::Parameter, MemoryTag::Gradient, MemoryTag::Activation}) {
    const double measured = static_cast<double>(p.tag_peak[static_cast<int>(tag)]);
    const double planned = static_cast<double>(tiled.tag_peak[static_cast<int>(tag)]);
    EXPECT_NEAR(planned / measured, 1.0, 0.10) << tag_name(tag) << ": planned " << planned << ", measured " << measured;
  }
  EXPECT_NEAR(static_cast<double>(tiled.peak) / static_cast<double>(p.peak_in_use), 1.0, 0.10);
  fs::remove_all(dir);
}

TEST(ImageTilingData, ExampleConfigResolvesAndPlans) {
  const fs::path root = fs::path(__FILE__).parent_path() / ".." / "..";
  json cfg = resolve_train_config(models::read_json_file((root / "configs/vlm_hires_example.json").string(), "config"),
                                  "vlm_hires_example.json");
  EXPECT_EQ(image_tiling_from_config(cfg["data"]), (ImageTiling{6, true}));
  cfg["device"] = "cpu";
  cfg["train"]["steps"] = 1;
  // 64 px pictures for the 32 px tower: 2 x 2 tiles + thumbnail (3 x 3 needs 9 > 6 tiles).
  EXPECT_EQ(choose_tile_grid(64, 64, 32, ImageTiling{6, true}).images(), 5);
  const models::VlmConfig mc = models::VlmConfig::from_json(cfg["model"]["config"], "model.config");
  EXPECT_EQ(tokens_per_image(mc, 64, 64, ImageTiling{6, true}), 5 * tokens_per_image(mc));
  EXPECT_EQ(tokens_per_image(mc, 64, 64, ImageTiling{}), tokens_per_image(mc));
  const MemoryPlan plan = plan_memory(cfg);
  EXPECT_GT(plan.peak, 0);
}

TEST(ImageTilingData, ConfigErrorsNameTheKey) {
  const std::string dir = tiling_tmp("errors");
  json user = {{"data", {{"image_tiling", {{"max_tiles", 4}, {"thumbnial", true}}}}}};
  expect_has(error_of([&] { resolve_train_config(user, "test"); }), {"data.image_tiling.thumbnial", "max_tiles, thumbnail"});
  user = {{"data", {{"image_tiling", {{"max_tiles", "six"}}}}}};
  expect_has(error_of([&] { resolve_train_config(user, "test"); }), {"data.image_tiling.max_tiles"});
  json cfg = testing::tiny_vlm_run(dir + "/out", {{"steps", 1}, {"batch_size", 2}});
  cfg["data"]["image_tiling"]["max_tiles"] = 0;
  expect_has(error_of([&] { Trainer t(cfg); }), {"data.image_tiling.max_tiles", "got 0"});
  // Untiled shapes must match the tower's size (tiling is what makes a larger picture fit).
  cfg["data"]["image_tiling"]["max_tiles"] = 1;
  cfg["data"]["image_size"] = 32;
  expect_has(error_of([&] { Trainer t(cfg); }), {"data.image_size"});
  // A decoder has no images.
  json dec = testing::tiny_decoder_run(dir + "/dec", {{"model_type", "qwen2"}, {"vocab_size", 64}, {"hidden_size", 16},
                                                      {"intermediate_size", 32}, {"num_hidden_layers", 1},
                                                      {"num_attention_heads", 2}, {"num_key_value_heads", 1}},
                                       4, 3, 16, 2, "cpu");
  dec["data"]["image_tiling"]["max_tiles"] = 6;
  expect_has(error_of([&] { Trainer t(dec); }), {"data.image_tiling", "model.type \"vlm\""});
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train
