// Conversation data with images for the VLM (chat_data.h, issue 24): a packed batch's tokens, labels,
// image slots, positions, cu_seqlens and pixels against a hand computation; truncation that never
// splits an image's slots; every refusal naming file:line; the bundled sample (configs/samples) as
// its generator writes it; a tiny VLM that learns from it on the CPU; and the projector's gradient
// from a chat batch equal to that of the same batch built by hand with the image-text loader's pixels.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>

#include "chat_fixtures.h"
#include "kestrel/autograd/tape.h"
#include "kestrel/models/vlm.h"
#include "kestrel/runtime/error.h"
#include "kestrel/train/chat_data.h"
#include "kestrel/train/image_io.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/shapes_dataset.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "kestrel/train/vlm_data.h"
#include "support/errors.h"
#include "support/file_fixtures.h"
#include "support/temp_dir.h"
#include "trainer_fixtures.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::train;
using kestrel::testing::error_of;
using kestrel::testing::expect_has;
using kestrel::testing::TempDir;
using kestrel::train::testing::ints;
using kestrel::train::testing::write_chat_tokenizer;
using kestrel::train::testing::write_lines;
using nlohmann::json;

namespace {

// The tiny VLM of chat_vlm_run (16 px images, patch 4, pixel shuffle 2: 4 slots an image).
using kestrel::train::testing::chat_vlm_run;
using kestrel::train::testing::kImageId;
using kestrel::train::testing::kVocab;
using kestrel::train::testing::materialise_chat_sample;
using kestrel::train::testing::sample_chat_lines;
using kestrel::train::testing::user_assistant;
using kestrel::train::testing::write_png;
constexpr int64_t kSlots = 4, kS = 16;
constexpr int64_t kImStart = 256, kImEnd = 257, kPad = 262;

ChatVision vision(int64_t image_id = kImageId) { return {{image_id, kSlots}, kS, DType::F32}; }

// The expected token sequence, built by hand: ChatML turns over the byte ids.
struct Seq {
  std::vector<int64_t> ids;
  std::vector<uint8_t> trained;
  std::vector<int64_t> slots;  // image-slot indices, in order
  void text(const std::string& s, bool t) {
    for (unsigned char c : s) ids.push_back(c), trained.push_back(t);
  }
  void token(int64_t id, bool t) { ids.push_back(id), trained.push_back(t); }
  void image() {
    for (int64_t k = 0; k < kSlots; ++k) slots.push_back(static_cast<int64_t>(ids.size())), token(kImageId, false);
  }
  // A turn whose content is text with '#' marking an image.
  void turn(const std::string& role, const std::string& content) {
    const bool a = role == "assistant";
    token(kImStart, false);
    text(role + "\n", false);
    for (char c : content)
      if (c == '#') image();
      else text(std::string(1, c), a);
    token(kImEnd, a);
    text("\n", false);
  }
};

std::vector<uint8_t> random_rgb(int64_t w, int64_t h, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<uint8_t> px(static_cast<size_t>(w * h * 3));
  for (auto& v : px) v = static_cast<uint8_t>(g() & 0xff);
  return px;
}

std::vector<float> floats(const HostArray& a) {
  std::vector<float> v(a.bytes.size() / 4);
  if (!v.empty()) std::memcpy(v.data(), a.bytes.data(), a.bytes.size());
  return v;
}

// Four conversations: a LLaVA line with <image>, an OpenAI line with two image parts (a PNG that
// needs resizing and a PPM), a text-only line, and a LLaVA line without a placeholder.
struct Fixture {
  TempDir dir{"kestrel_chat_img"};
  std::string tok, jsonl;
  std::vector<uint8_t> a = random_rgb(16, 16, 1), b = random_rgb(32, 32, 2), c = random_rgb(16, 16, 3);
  Fixture() {
    tok = write_chat_tokenizer(dir);
    write_png(dir.file("a.png"), a, 16, 16);
    write_png(dir.file("b.png"), b, 32, 32);
    write_ppm(dir.file("c.ppm"), c, 16, 16);
    jsonl = dir.file("chat.jsonl");
    const json parts = {{{"type", "text"}, {"text", "A"}},
                        {{"type", "image"}, {"image", "b.png"}},
                        {{"type", "text"}, {"text", "B"}},
                        {{"type", "image_url"}, {"image_url", {{"url", "c.ppm"}}}}};
    write_lines(jsonl, {json{{"image", "a.png"}, {"conversations", user_assistant("<image>\nHi", "Yo")}}.dump(),
                        json{{"messages", {{{"role", "user"}, {"content", parts}},
                                           {{"role", "assistant"}, {"content", "ok"}}}}}.dump(),
                        "",
                        json{{"conversations", user_assistant("Q", "R")}}.dump(),
                        json{{"image", "a.png"}, {"conversations", user_assistant("What?", "Z")}}.dump()});
  }
  // The documents as the policy says they render ('#': an image).
  std::vector<Seq> docs() const {
    std::vector<Seq> d(4);
    d[0].turn("user", "#\nHi"), d[0].turn("assistant", "Yo");
    d[1].turn("user", "A#B#"), d[1].turn("assistant", "ok");
    d[2].turn("user", "Q"), d[2].turn("assistant", "R");
    d[3].turn("user", "#\nWhat?"), d[3].turn("assistant", "Z");  // LLaVA's rule: "<image>\n" first
    return d;
  }
  // The pixels the tower should see for a, b, c, a: b resized 32 -> 16 by nearest pixel centres
  // (source 2y+1, 2x+1), all mapped to [-1, 1].
  std::vector<float> pixels() const {
    std::vector<float> px;
    for (int img = 0; img < 4; ++img)
      for (int ch = 0; ch < 3; ++ch)
        for (int y = 0; y < kS; ++y)
          for (int x = 0; x < kS; ++x) {
            const uint8_t v = img == 1 ? b[((2 * y + 1) * 32 + 2 * x + 1) * 3 + ch]
                              : img == 2 ? c[(y * 16 + x) * 3 + ch]
                                         : a[(y * 16 + x) * 3 + ch];
            px.push_back((v / 255.0f - 0.5f) / 0.5f);
          }
    return px;
  }
};

// The hand-built arrays of rows {doc 0, doc 1} and {doc 2, doc 3} of 64 tokens.
struct HandBatch {
  std::vector<int64_t> ids, labels, positions, cu{0}, image_positions;
  int64_t max_seqlen = 0;
};
HandBatch hand_batch(const std::vector<Seq>& docs) {
  HandBatch h;
  for (const auto& row : std::vector<std::vector<int>>{{0, 1}, {2, 3}}) {
    int64_t used = 0;
    for (int d : row) {
      const Seq& s = docs[static_cast<size_t>(d)];
      const int64_t n = static_cast<int64_t>(s.ids.size()), base = static_cast<int64_t>(h.ids.size());
      for (int64_t k : s.slots) h.image_positions.push_back(base + k);
      for (int64_t i = 0; i < n; ++i) {
        h.ids.push_back(s.ids[i]);
        h.labels.push_back(i + 1 < n && s.trained[i + 1] ? s.ids[i + 1] : -100);
        h.positions.push_back(i);
      }
      h.cu.push_back(h.cu.back() + n);
      h.max_seqlen = std::max(h.max_seqlen, n);
      used += n;
    }
    for (int64_t i = 0; i < 64 - used; ++i) h.ids.push_back(kPad), h.labels.push_back(-100), h.positions.push_back(i);
    h.cu.push_back(h.cu.back() + 64 - used);
  }
  return h;
}

}  // namespace

TEST(ChatImages, PackedBatchIsTheHandComputation) {
  Fixture f;
  ChatData data(f.jsonl, kestrel::train::testing::chat_tokenizer(f.dir), f.tok, ChatTemplate::ChatMl, 64, kVocab,
                vision());
  EXPECT_EQ(data.conversations(), 4);
  EXPECT_EQ(data.images(), 4);
  EXPECT_EQ(data.rows(), 2);  // 30 + 33 tokens, then 23 + 32
  const std::vector<Seq> docs = f.docs();
  ASSERT_EQ(docs[0].ids.size(), 30u);
  ASSERT_EQ(docs[1].ids.size(), 33u);
  const HandBatch h = hand_batch(docs);
  HostBatch b = data.host_batch(0, 2);
  ASSERT_EQ(b.arrays.size(), 6u);
  EXPECT_EQ(b.tokens, 128);
  EXPECT_EQ(ints(b.arrays[0]), h.ids);
  EXPECT_EQ(ints(b.arrays[1]), h.labels);
  EXPECT_EQ(b.arrays[2].shape, (Shape{4, 3, kS, kS}));
  EXPECT_EQ(floats(b.arrays[2]), f.pixels());
  EXPECT_EQ(ints(b.arrays[3]), h.image_positions);
  EXPECT_EQ(ints(b.arrays[4]), h.positions);
  EXPECT_EQ(ints(b.arrays[5]), h.cu);
  EXPECT_EQ(b.max_seqlen, h.max_seqlen);
  EXPECT_EQ(b.images_per_document, (std::vector<int64_t>{1, 2, 0, 0, 1, 0}));  // docs, then row padding
  // Anchors of the hand computation: <|im_start|> user \n, then the first image's slots at 6..9;
  // the second document's images after "A" and "B" at 30 + 7 and 30 + 12; the last one after the
  // 23-token text-only document of row 2 (64 + 23 + 6).
  EXPECT_EQ(ints(b.arrays[3]), (std::vector<int64_t>{6, 7, 8, 9, 37, 38, 39, 40, 42, 43, 44, 45, 93, 94, 95, 96}));
  EXPECT_EQ(ints(b.arrays[5]), (std::vector<int64_t>{0, 30, 63, 64, 87, 119, 128}));
  // No image slot carries a label, and no label predicts an image slot.
  const std::vector<int64_t> labels = ints(b.arrays[1]);
  for (int64_t p : ints(b.arrays[3])) {
    EXPECT_EQ(labels[static_cast<size_t>(p)], -100) << p;
    EXPECT_EQ(labels[static_cast<size_t>(p) - 1], -100) << p;
  }
  // Row 1 alone (the second micro-batch of size 1): its one image and the slots from 0.
  HostBatch r1 = data.host_batch(1, 1);
  EXPECT_EQ(r1.arrays[2].shape, (Shape{1, 3, kS, kS}));
  EXPECT_EQ(ints(r1.arrays[3]), (std::vector<int64_t>{29, 30, 31, 32}));
  // The rendering holds the placeholder where the image goes (LLaVA's rule for the 4th line).
  const std::vector<Conversation> cs = read_conversations(f.jsonl);
  EXPECT_EQ(render_chat(cs[3], ChatTemplate::ChatMl),
            "<|im_start|>user\n<image>\nWhat?<|im_end|>\n<|im_start|>assistant\nZ<|im_end|>\n");
  EXPECT_EQ(cs[1].turns[0].content, "A<image>B<image>");
  ASSERT_EQ(cs[1].images.size(), 2u);
  EXPECT_TRUE(cs[1].images[1].ends_with("c.ppm"));
}

TEST(ChatImages, Llama3TemplatePlacesSlotsInsideTheStrippedContent) {
  TempDir d("kestrel_chat_img");
  const std::string tok = write_chat_tokenizer(d);
  std::ofstream(d.file("a.png")) << "x";  // never decoded here
  Conversation c = parse_conversation(json{{"image", "a.png"}, {"conversations", user_assistant("  <image>\nHi ", "Yo")}},
                                      d.path.string(), "t:1");
  ChatEncoder enc(kestrel::train::testing::chat_tokenizer(d), ChatTemplate::Llama3, tok, ChatImageTokens{kImageId, 3});
  ChatTokens k = enc.encode(c);
  // <|begin_of_text|> <|start_header_id|> user <|end_header_id|> \n\n, then the stripped content.
  EXPECT_EQ(k.image_starts, (std::vector<int64_t>{9}));
  EXPECT_EQ(std::vector<int64_t>(k.ids.begin() + 9, k.ids.begin() + 14),
            (std::vector<int64_t>{kImageId, kImageId, kImageId, '\n', 'H'}));
}

TEST(ChatImages, TruncationNeverSplitsAnImage) {
  TempDir d("kestrel_chat_img");
  const std::string tok = write_chat_tokenizer(d);
  write_png(d.file("a.png"), random_rgb(16, 16, 4), 16, 16);
  write_lines(d.file("c.jsonl"), {json{{"image", "a.png"}, {"conversations", user_assistant("abc<image>d", "e")}}.dump()});
  auto tk = kestrel::train::testing::chat_tokenizer(d);
  // <|im_start|> user \n a b c: the image's slots are 9..12.
  ChatData whole(d.file("c.jsonl"), tk, tok, ChatTemplate::ChatMl, 13, kVocab, vision());
  EXPECT_EQ(whole.truncated(), 1);
  EXPECT_EQ(whole.images(), 1);
  HostBatch b = whole.host_batch(0, 1);
  EXPECT_EQ(ints(b.arrays[3]), (std::vector<int64_t>{9, 10, 11, 12}));
  EXPECT_EQ(ints(b.arrays[5]), (std::vector<int64_t>{0, 13}));
  // A cut at 11 would split the slots: it moves back to 9 and the image goes.
  ChatData cut(d.file("c.jsonl"), tk, tok, ChatTemplate::ChatMl, 11, kVocab, vision());
  EXPECT_EQ(cut.images(), 0);
  HostBatch c = cut.host_batch(0, 1);
  EXPECT_EQ(c.arrays[2].shape, (Shape{0, 3, kS, kS}));
  EXPECT_TRUE(ints(c.arrays[3]).empty());
  EXPECT_EQ(ints(c.arrays[5]), (std::vector<int64_t>{0, 9, 11}));  // the cut document, then padding
  for (int64_t id : ints(c.arrays[0])) EXPECT_NE(id, kImageId);
  // seq_len must leave room for one image.
  expect_has(error_of([&] { ChatData(d.file("c.jsonl"), tk, tok, ChatTemplate::ChatMl, kSlots, kVocab, vision()); }),
             {"data.seq_len", "image-token slots"});
}

TEST(ChatImages, RefusalsNameFileAndLine) {
  TempDir d("kestrel_chat_img");
  const std::string tok = write_chat_tokenizer(d);
  write_png(d.file("a.png"), random_rgb(16, 16, 5), 16, 16);
  std::ofstream(d.file("bad.png")) << "not an image";
  const std::string ok = json{{"image", "a.png"}, {"conversations", user_assistant("<image>\nHi", "Yo")}}.dump();
  auto msg = [](const json& content) {
    return json{{"messages", {{{"role", "user"}, {"content", content}}, {{"role", "assistant"}, {"content", "y"}}}}}.dump();
  };
  const json img_part = {{"type", "image"}, {"image", "a.png"}};
  const std::vector<std::pair<std::string, std::string>> bad = {
      {json{{"image", "nope.png"}, {"conversations", user_assistant("<image>", "y")}}.dump(), "does not exist"},
      {"{\"image\": \"a.png\", ", "not valid JSON"},
      {json{{"image", "a.png"}, {"conversations", user_assistant("<image><image>", "y")}}.dump(),
       "2 <image> placeholder(s) for 1 image(s)"},
      {json{{"image", json::array({"a.png", "a.png"})}, {"conversations", user_assistant("<image>", "y")}}.dump(),
       "1 <image> placeholder(s) for 2 image(s)"},
      {json{{"conversations", user_assistant("<image>", "y")}}.dump(), "1 <image> placeholder(s) for 0 image(s)"},
      {msg(json::array({img_part, {{"type", "text"}, {"text", "<image>"}}})), "2 <image> placeholder(s) for 1 image(s)"},
      {json{{"image", "a.png"}, {"conversations", {{{"from", "robot"}, {"value", "x"}}, {{"from", "gpt"}, {"value", "y"}}}}}.dump(),
       "robot"},
      {msg(json::array({{{"type", "image_url"}, {"image_url", {{"url", "https://example.com/a.png"}}}}})), "is a URL"},
      {msg(json::array({{{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,AAAA"}}}}})), "is a URL"},
      {msg(json::array({{{"type", "video"}, {"video", "a.mp4"}}})), "type 'video'"},
      {msg(json::array({{{"type", "image"}, {"path", "a.png"}}})), "{\"type\": \"image\", \"image\": \"path\"}"},
      {json{{"messages", {{{"role", "user"}, {"content", "q"}}, {{"role", "assistant"}, {"content", json::array({img_part})}}}}}.dump(),
       "images belong in a user turn"},
      {json{{"image", "a.png"}, {"messages", {{{"role", "user"}, {"content", json::array({img_part})}},
                                              {{"role", "assistant"}, {"content", "y"}}}}}.dump(),
       "give them one way"},
      {json{{"image", "a.png"}, {"images", json::array({"a.png"})}, {"conversations", user_assistant("q", "y")}}.dump(),
       "not both"},
      {json{{"image", json::array({"a.png", 3})}, {"conversations", user_assistant("q", "y")}}.dump(), "hold strings"},
      {json{{"conversations", {{{"from", "human"}, {"value", json::array({img_part})}}, {{"from", "gpt"}, {"value", "y"}}}}}.dump(),
       "\"value\" must be a string"},
      // A bound on what one line can make the loader stat and encode: 256 images per conversation.
      {json{{"image", std::vector<std::string>(257, "a.png")}, {"conversations", user_assistant("q", "y")}}.dump(),
       "257 images in one conversation, more than 256"},
      {msg(std::vector<json>(257, img_part)), "more than 256 images in one conversation"},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string path = d.file("bad" + std::to_string(i) + ".jsonl");
    write_lines(path, {ok, bad[i].first});
    expect_has(error_of([&] { read_conversations(path); }), {path + ":2", bad[i].second});
  }
  auto tk = kestrel::train::testing::chat_tokenizer(d);
  // An image that does not decode: refused when its batch is built (on the prefetch thread), naming
  // the line and the file.
  const std::string unreadable = d.file("unreadable.jsonl");
  write_lines(unreadable, {ok, json{{"image", "bad.png"}, {"conversations", user_assistant("<image>", "y")}}.dump()});
  ChatData data(unreadable, tk, tok, ChatTemplate::ChatMl, 40, kVocab, vision());  // 30 + 26 tokens: a row each
  EXPECT_NO_THROW(data.host_batch(0, 1));
  expect_has(error_of([&] { data.host_batch(1, 1); }), {unreadable + ":2", "bad.png", "cannot be read"});
  // A text token equal to image_token_id would read as an image slot: refused.
  const std::string clash = d.file("clash.jsonl");
  write_lines(clash, {ok, json{{"conversations", user_assistant("Hi", "y")}}.dump()});
  expect_has(error_of([&] { ChatData(clash, tk, tok, ChatTemplate::ChatMl, 64, kVocab, vision('H')); }),
             {clash + ":1", "image_token_id"});
  // The decoder has no tower.
  expect_has(error_of([&] { ChatData(clash, tk, tok, ChatTemplate::ChatMl, 64, kVocab); }),
             {clash + ":1", "model.type \"decoder\" has no vision tower"});
}

// ---- the bundled sample: configs/samples/vlm_chat/train.jsonl over shapes images ----

TEST(ChatImages, BundledSampleIsWhatItsGeneratorWrites) {
  TempDir d("kestrel_chat_img");
  const std::string path = materialise_chat_sample(d);
  std::ifstream f(path);
  std::vector<json> lines;
  for (std::string l; std::getline(f, l);) lines.push_back(json::parse(l));
  const std::vector<json> want = sample_chat_lines();
  ASSERT_EQ(lines.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(lines[i], want[i]) << "line " << i + 1 << " should be " << want[i].dump();
  const std::vector<Conversation> cs = read_conversations(path);
  size_t images = 0;
  for (const Conversation& c : cs) images += c.images.size();
  EXPECT_EQ(images, 8u);
  // In rows of 128 (the runs below and the CUDA test) each conversation is a row of its own but for
  // one pair, and the text-only one's row is a micro-batch without images (the blank-image path).
  ChatData data(path, kestrel::train::testing::chat_tokenizer(d), write_chat_tokenizer(d), ChatTemplate::ChatMl, 128,
                kVocab, vision());
  ASSERT_EQ(data.rows(), 7);
  std::vector<int64_t> per_row;
  for (int64_t r = 0; r < data.rows(); ++r) per_row.push_back(data.host_batch(static_cast<uint64_t>(r), 1).arrays[2].shape[0]);
  EXPECT_EQ(per_row, (std::vector<int64_t>{1, 2, 2, 0, 1, 1, 1}));
}

TEST(ChatImages, TinyVlmLearnsFromTheBundledSample) {
  TempDir d("kestrel_chat_img");
  const std::string path = materialise_chat_sample(d);
  const std::string tok = write_chat_tokenizer(d);
  // 8 conversations (8 images) in 7 rows of 128 tokens, 2 rows a step.
  json cfg = chat_vlm_run(d.file("out"), path, tok, {{"steps", 40}, {"batch_size", 2}, {"lr", 1e-2}}, 128);
  Trainer t(cfg);
  t.set_log_callback([](const std::string&) {});
  TrainSummary s = t.run();
  EXPECT_LT(s.last_loss, 0.5 * s.first_loss) << s.first_loss << " -> " << s.last_loss;
  std::cout << "bundled sample: loss " << s.first_loss << " -> " << s.last_loss << "\n";
  // The example config names a chat file and resolves (its folders are not here: schema only).
  const fs::path example = fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "vlm_chat_sft.json";
  const json ex = resolve_train_config(json::parse(std::ifstream(example)), "vlm_chat_sft");
  EXPECT_EQ(ex["model"]["type"], "vlm");
  EXPECT_EQ(ex["data"]["type"], "chat");
}

TEST(ChatImages, PlanBoundsTheChatRun) {
  // The planner takes rows of seq_len and at most seq_len / tokens_per_image images a row (32 here);
  // the run's batches hold 1 to 3, so its measured peaks stay under the plan's; the parameters agree.
  TempDir d("kestrel_chat_img");
  const std::string path = materialise_chat_sample(d);
  const std::string tok = write_chat_tokenizer(d);
  const json cfg = chat_vlm_run(d.file("out"), path, tok, {{"steps", 2}, {"batch_size", 2}}, 128);
  PlanOptions po;
  po.steps = 2;
  const MemoryPlan plan = plan_memory(cfg, po);
  EXPECT_EQ(plan.tokens, 2 * 128);
  json none = cfg;  // seq_len at or below one image's slots: refused by name, not a division by zero
  none["data"]["seq_len"] = 4;
  kestrel::testing::expect_has(kestrel::testing::error_of([&] { plan_memory(none, po); }),
                               {"data.seq_len (4)", "image-token slots"});
  json fewer = cfg;
  fewer["data"]["seq_len"] = 64;  // 16 images a row at most, and half the tokens
  EXPECT_LT(plan_memory(fewer, po).tag_peak[static_cast<int>(MemoryTag::Activation)],
            plan.tag_peak[static_cast<int>(MemoryTag::Activation)]);
  const MemoryProfile p = kestrel::train::testing::profile_trainer_run(cfg, Device::cpu());
  const int par = static_cast<int>(MemoryTag::Parameter);
  EXPECT_NEAR(static_cast<double>(plan.tag_peak[par]) / static_cast<double>(p.tag_peak[par]), 1.0, 0.10);
  // Activations and the backward's activation gradients (tag Gradient) scale with the images.
  for (MemoryTag tag : {MemoryTag::Activation, MemoryTag::Gradient})
    EXPECT_LE(p.tag_peak[static_cast<int>(tag)], plan.tag_peak[static_cast<int>(tag)])
        << tag_name(tag) << ": the plan's images are an upper bound";
  EXPECT_LE(p.peak_in_use, plan.peak);
}

TEST(ChatImages, TextOnlyBatchesTrainTheVlm) {
  // No image in any batch: the tower runs on a blank image at weight 0 (tasks.cpp), the loss is the
  // text's and falls.
  TempDir d("kestrel_chat_img");
  const std::string tok = write_chat_tokenizer(d);
  std::vector<std::string> lines;
  for (const auto& [q, a] : std::vector<std::pair<std::string, std::string>>{{"sky?", "blue"}, {"grass?", "green"}})
    lines.push_back(json{{"conversations", user_assistant(q, a)}}.dump());
  write_lines(d.file("text.jsonl"), lines);
  json cfg = chat_vlm_run(d.file("out"), d.file("text.jsonl"), tok, {{"steps", 12}, {"batch_size", 1}, {"lr", 1e-2}}, 64);
  Trainer t(cfg);
  t.set_log_callback([](const std::string&) {});
  TrainSummary s = t.run();
  EXPECT_TRUE(std::isfinite(s.last_loss));
  EXPECT_LT(s.last_loss, 0.7 * s.first_loss) << s.first_loss << " -> " << s.last_loss;
}

TEST(ChatImages, ProjectorGradientEqualsTheHandBuiltCaptionStyleBatch) {
  Fixture f;
  ChatData data(f.jsonl, kestrel::train::testing::chat_tokenizer(f.dir), f.tok, ChatTemplate::ChatMl, 64, kVocab,
                vision());
  const json cfg = chat_vlm_run(f.dir.file("out"), f.jsonl, f.tok, json::object(), 64);
  const models::VlmConfig mc = models::VlmConfig::from_json(cfg["model"]["config"]);
  ASSERT_EQ(tokens_per_image(mc), kSlots);
  models::Vlm vlm(mc, DType::F32, Device::cpu(), 17);
  const std::vector<std::string> watched = {"multi_modal_projector.linear_1.weight", "multi_modal_projector.linear_2.weight",
                                            "multi_modal_projector.linear_1.bias"};
  auto grads_of = [&](const models::VlmBatch& b, double* loss_out) {
    vlm.parameters().zero_grad();
    Tensor loss = vlm.loss(b);
    *loss_out = loss.item();
    autograd::backward(loss);
    std::vector<std::vector<float>> g;
    for (auto& [name, p] : vlm.parameters().items())
      for (const std::string& w : watched)
        if (name == w) g.push_back(p->grad().to_float_vector());
    return g;
  };
  // (1) The chat loader's batch.
  HostBatch hb = data.host_batch(0, 2);
  double loss_chat = 0, loss_hand = 0;
  const auto g_chat = grads_of(vlm_batch_from(hb, arrays_to_device(hb, Device::cpu()), DType::F32), &loss_chat);
  // (2) The same batch by hand: tokens from the hand rendering, pixels from the image-text loader
  // (ImageTextData) reading the same files in the same order.
  write_lines(f.dir.file("caps.jsonl"), {json{{"image", "a.png"}, {"text", "x"}}.dump(), json{{"image", "b.png"}, {"text", "x"}}.dump(),
                                         json{{"image", "c.ppm"}, {"text", "x"}}.dump(), json{{"image", "a.png"}, {"text", "x"}}.dump()});
  const HandBatch h = hand_batch(f.docs());
  models::VlmBatch hand;
  const int64_t T = static_cast<int64_t>(h.ids.size());
  hand.input_ids = Tensor::from_vector(h.ids, {T}, DType::I64, Device::cpu());
  hand.labels = Tensor::from_vector(h.labels, {T}, DType::I64, Device::cpu());
  hand.pixel_values = ImageTextData(f.dir.file("caps.jsonl"), kS, kSlots, Device::cpu(), DType::F32).batch(0, 4).pixel_values;
  hand.image_positions =
      Tensor::from_vector(h.image_positions, {static_cast<int64_t>(h.image_positions.size())}, DType::I64, Device::cpu());
  hand.layout = packed_layout(Tensor::from_vector(h.positions, {T}, DType::I64, Device::cpu()),
                              Tensor::from_vector(h.cu, {static_cast<int64_t>(h.cu.size())}, DType::I32, Device::cpu()),
                              h.max_seqlen);
  const auto g_hand = grads_of(hand, &loss_hand);
  EXPECT_EQ(loss_chat, loss_hand);
  ASSERT_EQ(g_chat.size(), watched.size());
  ASSERT_EQ(g_hand.size(), watched.size());
  for (size_t k = 0; k < watched.size(); ++k) {
    double norm = 0, diff = 0;
    for (size_t i = 0; i < g_chat[k].size(); ++i) {
      norm = std::max(norm, std::abs(static_cast<double>(g_chat[k][i])));
      diff = std::max(diff, std::abs(static_cast<double>(g_chat[k][i]) - g_hand[k][i]));
    }
    EXPECT_GT(norm, 0) << watched[k] << ": the image tokens do not reach the loss";
    EXPECT_LE(diff, 1e-6 * norm) << watched[k];
  }
  // The images matter: the same tokens with the images swapped change the projector's gradient.
  models::VlmBatch swapped = hand;
  std::vector<float> px = hand.pixel_values.to_float_vector();
  const size_t one = static_cast<size_t>(3 * kS * kS);
  std::swap_ranges(px.begin(), px.begin() + one, px.begin() + one);
  swapped.pixel_values = Tensor::from_vector(px, {4, 3, kS, kS}, DType::F32, Device::cpu());
  double loss_swapped = 0;
  const auto g_swapped = grads_of(swapped, &loss_swapped);
  EXPECT_NE(loss_swapped, loss_hand);
  EXPECT_NE(g_swapped[0], g_hand[0]);
}
