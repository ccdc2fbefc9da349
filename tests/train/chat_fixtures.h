// Shared set-up of the conversation-data tests (test_chat_data, test_chat_images and its CUDA twin):
// a byte-level tokenizer.json with both chat templates' special tokens, JSONL writing, integer array
// reads, a tiny VLM run on chat data, and the bundled sample configs/samples/vlm_chat/train.jsonl
// with the shapes PNGs it names (what its generator, sample_chat_lines, writes).
#pragma once

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/host_batch.h"
#include "kestrel/train/shapes_dataset.h"
#include "support/file_fixtures.h"
#include "support/temp_dir.h"
#include "trainer_fixtures.h"

namespace kestrel::train::testing {

// Byte-level tokenizer.json without merges: byte b is id b, then the specials below at 256.. 262.
inline const std::vector<std::string> kChatSpecials = {"<|im_start|>",        "<|im_end|>",
                                                       "<|begin_of_text|>",   "<|start_header_id|>",
                                                       "<|end_header_id|>",   "<|eot_id|>",
                                                       "<|endoftext|>"};
inline std::string write_chat_tokenizer(const kestrel::testing::TempDir& d) {
  nlohmann::json vocab = nlohmann::json::object(), added = nlohmann::json::array();
  for (int b = 0; b < 256; ++b) vocab[byte_level_symbol(static_cast<uint8_t>(b))] = b;
  for (size_t i = 0; i < kChatSpecials.size(); ++i) {
    vocab[kChatSpecials[i]] = 256 + i;
    added.push_back({{"id", 256 + i}, {"content", kChatSpecials[i]}, {"special", true}});
  }
  nlohmann::json j = {{"added_tokens", added},
                      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  std::ofstream(d.file("tokenizer.json")) << j.dump();
  return d.file("tokenizer.json");
}

inline std::shared_ptr<const TextTokenizer> chat_tokenizer(const kestrel::testing::TempDir& d) {
  return std::make_shared<BpeTokenizer>(BpeTokenizer::from_file(write_chat_tokenizer(d)));
}

// An i64 or i32 host array as int64 values.
inline std::vector<int64_t> ints(const HostArray& a) {
  std::vector<int64_t> v;
  if (a.dtype == DType::I64) {
    v.resize(a.bytes.size() / 8);
    if (!v.empty()) std::memcpy(v.data(), a.bytes.data(), a.bytes.size());
  } else {
    std::vector<int32_t> w(a.bytes.size() / 4);
    if (!w.empty()) std::memcpy(w.data(), a.bytes.data(), a.bytes.size());
    v.assign(w.begin(), w.end());
  }
  return v;
}

inline void write_lines(const std::string& path, const std::vector<std::string>& lines) {
  std::ofstream f(path);
  for (const std::string& l : lines) f << l << "\n";
}

inline nlohmann::json user_assistant(const std::string& u, const std::string& a) {
  return nlohmann::json::array({{{"from", "human"}, {"value", u}}, {{"from", "gpt"}, {"value", a}}});
}

inline void write_png(const std::string& path, const std::vector<uint8_t>& rgb, int64_t w, int64_t h) {
  const auto png = kestrel::testing::encode_png_stored(rgb, static_cast<uint32_t>(w), static_cast<uint32_t>(h));
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
}

// The tiny VLM of tiny_vlm_run over the chat tokenizer's 263 ids plus kImageId, on chat data.
inline constexpr int64_t kImageId = 263, kVocab = 264;
inline nlohmann::json chat_vlm_run(const std::string& out, const std::string& jsonl, const std::string& tok,
                                   const nlohmann::json& train, int64_t seq_len,
                                   const nlohmann::json& extra = nlohmann::json::object()) {
  nlohmann::json top = {{"data", {{"type", "chat"}, {"train_files", jsonl}, {"tokenizer", tok}, {"seq_len", seq_len},
                                  {"image_size", 16}}}};
  top.update(extra);
  nlohmann::json cfg = tiny_vlm_run(out, train, top);
  cfg["model"]["config"]["image_token_id"] = kImageId;
  cfg["model"]["config"]["text_config"]["vocab_size"] = kVocab;
  return cfg;
}

// ---- the bundled sample ----

inline const ShapesConfig kSampleShapes{32, 11, 8, 1.5};

// What the sample's generator writes: 8 conversations over shapes/0..7.png in every supported form
// (LLaVA with <image>, without it, several images; OpenAI image and image_url parts; text only).
inline std::vector<nlohmann::json> sample_chat_lines() {
  using nlohmann::json;
  ShapesDataset ds(kSampleShapes);
  auto colour = [&](int i) { return std::string(ShapesDataset::colour_names()[ds.sample(i).colour]); };
  auto shape = [&](int i) { return std::string(ShapesDataset::shape_names()[ds.sample(i).shape]); };
  auto position = [&](int i) { return std::string(ShapesDataset::position_names()[ds.sample(i).position]); };
  auto caption = [&](int i) { return ds.sample(i).caption; };
  auto png = [](int i) { return "shapes/" + std::to_string(i) + ".png"; };
  return {
      {{"image", png(0)}, {"conversations", user_assistant("<image>\nDescribe the image.", caption(0))}},
      {{"image", png(1)}, {"conversations", user_assistant("What colour is the shape?", colour(1))}},
      {{"messages", {{{"role", "user"}, {"content", {{{"type", "image"}, {"image", png(2)}},
                                                     {{"type", "text"}, {"text", "\nWhere is the shape?"}}}}},
                     {{"role", "assistant"}, {"content", "at the " + position(2)}}}}},
      {{"image", json::array({png(3), png(4)})},
       {"conversations", user_assistant("<image>\n<image>\nName both shapes.", shape(3) + " and " + shape(4))}},
      {{"conversations", {{{"from", "system"}, {"value", "Answer briefly."}},
                          {{"from", "human"}, {"value", "How many colours can a shape have here?"}},
                          {{"from", "gpt"}, {"value", "eight"}}}}},
      {{"messages", {{{"role", "system"}, {"content", "Answer briefly."}},
                     {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Describe "}},
                                                     {{"type", "image_url"}, {"image_url", {{"url", png(5)}}}}}}},
                     {{"role", "assistant"}, {"content", caption(5)}}}}},
      {{"image", png(6)},
       {"conversations", {{{"from", "human"}, {"value", "<image>\nWhat shape is it?"}}, {{"from", "gpt"}, {"value", shape(6)}},
                          {{"from", "human"}, {"value", "And its colour?"}}, {{"from", "gpt"}, {"value", colour(6)}}}}},
      {{"image", png(7)}, {"conversations", user_assistant("<image>\nDescribe the image.", caption(7))}},
  };
}

// Copies the bundled JSONL into `dir` and renders the PNGs it names there; returns the copy's path.
inline std::string materialise_chat_sample(const kestrel::testing::TempDir& dir) {
  namespace fs = std::filesystem;
  const fs::path src =
      fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "samples" / "vlm_chat" / "train.jsonl";
  fs::create_directories(dir.path / "shapes");
  fs::copy_file(src, dir.path / "train.jsonl");
  ShapesDataset ds(kSampleShapes);
  for (int i = 0; i < 8; ++i) write_png(dir.file("shapes/" + std::to_string(i) + ".png"), ds.sample(i).pixels, 32, 32);
  return dir.file("train.jsonl");
}

}  // namespace kestrel::train::testing
