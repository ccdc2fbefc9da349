// Trust boundaries of the data loaders (issue 18 item 4), each test written as the failure it
// prevents: a FIFO matched by a token-file glob (or named as a tokenizer) hung the process in
// open(); impossible sizes in a file's header became std::bad_alloc (or an allocation of
// gigabytes) instead of an error naming the file and the size; errors quoted a file's bytes.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "kestrel/runtime/error.h"
#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/image_io.h"
#include "kestrel/train/token_data.h"
#include "kestrel/train/token_file.h"
#include "kestrel/train/vlm_data.h"
#include "support/errors.h"
#include "support/file_fixtures.h"
#include "support/temp_dir.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::train;
using nlohmann::json;

using kestrel::testing::FifoWatch;
using kestrel::testing::error_of;
using kestrel::testing::expect_has;
using kestrel::testing::TempDir;

namespace {

json tiny_tokenizer(int64_t last_id) {
  json vocab = json::object();
  vocab["a"] = 0;
  vocab["b"] = last_id;
  return json{{"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
              {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}}};
}

// A PNG whose header claims w x h 8-bit RGB pixels, followed by a few bytes of (unused) data.
std::vector<std::byte> png_claiming(uint32_t w, uint32_t h) {
  const std::vector<uint8_t> png = kestrel::testing::png_rgb8_file(w, h, {0x78, 0x01, 0x03, 0x00});
  std::vector<std::byte> out(png.size());
  std::memcpy(out.data(), png.data(), png.size());
  return out;
}

}  // namespace

TEST(DataTrust, FifoMatchedByATokenGlobIsAnErrorNotAHang) {
  TempDir dir;
  write_token_file(dir.file("train_000.bin"), std::vector<uint32_t>{1, 2, 3}, TokenFormat::U16);
  FifoWatch fifo(dir.file("train_001.bin"));
  const std::string pattern = dir.file("train_*.bin");
  expect_has(error_of([&] { expand_shards(pattern); }), {"[token_file]", pattern, "train_001.bin", "not a regular file"});
  expect_has(error_of([&] { TokenStream(pattern, 16, -1); }), {"train_001.bin", "not a regular file"});
  // Named without a wildcard, or opened directly.
  expect_has(error_of([&] { expand_shards(dir.file("train_001.bin")); }), {"train_001.bin", "FIFO"});
  expect_has(error_of([&] { TokenFile::open(dir.file("train_001.bin")); }), {"train_001.bin", "FIFO"});
  EXPECT_FALSE(fifo.reader_blocked());
  // A folder matched by the glob is refused the same way.
  fs::create_directories(dir.path / "train_002.bin");
  fs::remove(dir.path / "train_001.bin");
  expect_has(error_of([&] { expand_shards(pattern); }), {"train_002.bin", "not a regular file"});
}

TEST(DataTrust, FifoAsTokenizerIsAnErrorNotAHang) {
  TempDir dir;
  FifoWatch fifo(dir.file("tokenizer.json"));
  expect_has(error_of([&] { BpeTokenizer::from_file(dir.file("tokenizer.json")); }), {"tokenizer.json", "FIFO"});
  EXPECT_FALSE(fifo.reader_blocked());
}

TEST(DataTrust, FifoAsImageTextDataOrImageIsAnErrorNotAHang) {
  TempDir dir;
  {
    FifoWatch fifo(dir.file("data.jsonl"));
    expect_has(error_of([&] { ImageTextData(dir.file("data.jsonl"), 16, 4, Device::cpu(), DType::F32); }),
               {"[image_text]", "data.jsonl", "FIFO"});
    EXPECT_FALSE(fifo.reader_blocked());
  }
  FifoWatch image(dir.file("img.ppm"));
  std::ofstream(dir.file("records.jsonl")) << json{{"image", "img.ppm"}, {"text", "a red circle"}}.dump() << "\n";
  expect_has(error_of([&] { ImageTextData(dir.file("records.jsonl"), 16, 4, Device::cpu(), DType::F32); }),
             {"records.jsonl:1", "img.ppm", "not a regular file"});
  expect_has(error_of([&] { read_image(dir.file("img.ppm")); }), {"img.ppm", "FIFO"});
  EXPECT_FALSE(image.reader_blocked());
}

TEST(DataTrust, TokenizerIdFarBeyondItsTokensIsAnErrorNotBadAlloc) {
  TempDir dir;
  std::ofstream(dir.file("tokenizer.json")) << tiny_tokenizer(2'000'000'000).dump();
  expect_has(error_of([&] { BpeTokenizer::from_file(dir.file("tokenizer.json")); }),
             {"tokenizer.json", "'b'", "id 2000000000", "far beyond"});
  // Small gaps in the ids (reserved ranges) stay fine.
  std::ofstream(dir.file("gappy.json")) << tiny_tokenizer(1000).dump();
  EXPECT_EQ(BpeTokenizer::from_file(dir.file("gappy.json")).vocab_size(), 1001);
}

TEST(DataTrust, TokenizerErrorsNeverQuoteTheFile) {
  TempDir dir;
  std::ofstream(dir.file("tokenizer.json")) << "SECRETKEY-hunter2";
  const std::string msg = error_of([&] { BpeTokenizer::from_file(dir.file("tokenizer.json")); });
  expect_has(msg, {"tokenizer.json", "not valid JSON"});
  EXPECT_EQ(msg.find("SECRET"), std::string::npos) << msg;
}

TEST(DataTrust, ImageHeaderClaimingAnImpossibleSizeIsAnErrorNotBadAlloc) {
  if (!png_supported()) GTEST_SKIP() << "built without libpng";
  // 1,000,000 x 1,000,000 RGB (3 TB; libpng's own limit is 1e6 per side) from a ~60-byte file.
  auto png = png_claiming(1'000'000, 1'000'000);
  expect_has(error_of([&] { decode_png(png, "huge.png"); }), {"huge.png", "1000000x1000000", "3000000000000 bytes"});
  // 65536 x 65536 is 12 GiB and wraps PNG_IMAGE_SIZE's 32-bit arithmetic to 0: refused too.
  png = png_claiming(65536, 65536);
  expect_has(error_of([&] { decode_png(png, "wrap.png"); }), {"wrap.png", "65536x65536"});
  // Within the compression bound (the file padded to 200 KB) but above the pixel limit: refused too.
  png = png_claiming(20000, 20000);
  png.resize(200'000, std::byte{0});
  expect_has(error_of([&] { decode_png(png, "bomb.png"); }), {"bomb.png", "20000x20000", "limit"});
}

TEST(DataTrust, PpmErrorsNeverQuoteTheFile) {
  const std::string text = "SECRETKEY-hunter2 and more";
  std::vector<std::byte> b(text.size());
  std::memcpy(b.data(), text.data(), text.size());
  std::string msg = error_of([&] { decode_ppm(b, "x.ppm"); });
  expect_has(msg, {"x.ppm", "not a binary PPM"});
  EXPECT_EQ(msg.find("SECRET"), std::string::npos) << msg;
  const std::string bad = "P6 SECRETKEY 2 255\n";
  b.assign(bad.size(), std::byte{0});
  std::memcpy(b.data(), bad.data(), bad.size());
  msg = error_of([&] { decode_ppm(b, "y.ppm"); });
  expect_has(msg, {"y.ppm", "width is not a number"});
  EXPECT_EQ(msg.find("SECRET"), std::string::npos) << msg;
}
