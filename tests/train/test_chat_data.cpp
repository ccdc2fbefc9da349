// Conversation data (chat_data.h): the two chat templates rendered as transformers' apply_chat_template
// renders them (hand-written expected text), loss masks on assistant tokens only, packing and
// cu_seqlens, malformed lines and escaping image paths refused with file:line, and a tiny decoder
// that learns from a generated chat JSONL.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kestrel/runtime/error.h"
#include "kestrel/train/bpe_tokenizer.h"
#include "kestrel/train/chat_data.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/errors.h"
#include "support/mutate.h"
#include "support/temp_dir.h"
#include "chat_fixtures.h"
#include "trainer_fixtures.h"

namespace fs = std::filesystem;
using namespace kestrel;
using namespace kestrel::train;
using kestrel::testing::error_of;
using kestrel::testing::expect_has;
using kestrel::testing::fuzz_iterations;
using kestrel::testing::mutate_json;
using kestrel::testing::parses_or_kestrel_error;
using kestrel::testing::TempDir;
using nlohmann::json;

namespace {

using kestrel::train::testing::ints;
using kestrel::train::testing::write_lines;
std::string write_tokenizer(const TempDir& d) { return kestrel::train::testing::write_chat_tokenizer(d); }
std::shared_ptr<const TextTokenizer> tokenizer(const TempDir& d) { return kestrel::train::testing::chat_tokenizer(d); }

Conversation sample() {
  return {{}, {{"system", "You are terse."}, {"user", "Hi"}, {"assistant", " Hello! \n"}, {"user", "Bye"},
               {"assistant", "Bye."}}};
}

}  // namespace

TEST(ChatData, ChatMlRendersLikeApplyChatTemplate) {
  EXPECT_EQ(render_chat(sample(), ChatTemplate::ChatMl),
            "<|im_start|>system\nYou are terse.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n Hello! \n<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\nBye.<|im_end|>\n");
}

TEST(ChatData, Llama3RendersLikeApplyChatTemplate) {
  // Meta-Llama-3-Instruct's template: bos, then header + content | trim + <|eot_id|> per message.
  EXPECT_EQ(render_chat(sample(), ChatTemplate::Llama3),
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>");
}

TEST(ChatData, TokensSpellTheRenderingAndOnlyAssistantTokensTrain) {
  TempDir d("kestrel_chat");
  auto tok = tokenizer(d);
  for (ChatTemplate t : {ChatTemplate::ChatMl, ChatTemplate::Llama3}) {
    ChatEncoder enc(tok, t, "tiny");
    ChatTokens c = enc.encode(sample());
    ASSERT_EQ(c.ids.size(), c.trained.size());
    EXPECT_EQ(tok->decode(c.ids), render_chat(sample(), t));
    std::vector<int64_t> trained;
    for (size_t i = 0; i < c.ids.size(); ++i)
      if (c.trained[i]) trained.push_back(c.ids[i]);
    // Assistant contents and their end-of-turn tokens, nothing else (no headers, no "\n" separators).
    EXPECT_EQ(tok->decode(trained), t == ChatTemplate::ChatMl ? " Hello! \n<|im_end|>Bye.<|im_end|>"
                                                             : "Hello!<|eot_id|>Bye.<|eot_id|>");
    // Special tokens are the tokenizer's ids.
    EXPECT_EQ(c.ids[0], tok->token_id(t == ChatTemplate::ChatMl ? "<|im_start|>" : "<|begin_of_text|>"));
  }
}

TEST(ChatData, LabelsAreNextTrainedTokenPackingAndCuSeqlens) {
  TempDir d("kestrel_chat");
  const std::string tok_path = write_tokenizer(d);
  auto tok = tokenizer(d);
  const std::string line = json{{"conversations", {{{"from", "human"}, {"value", "Hi"}},
                                                   {{"from", "gpt"}, {"value", "Yo"}}}}}.dump();
  const std::string openai = json{{"messages", {{{"role", "user"}, {"content", "Hi"}},
                                                {{"role", "assistant"}, {"content", "Yo"}}}}}.dump();
  write_lines(d.file("c.jsonl"), {line, "", openai});
  // <|im_start|> user \n H i <|im_end|> \n <|im_start|> assistant \n Y o <|im_end|> \n : 25 tokens.
  ChatData data(d.file("c.jsonl"), tok, tok_path, ChatTemplate::ChatMl, 64, 264);
  EXPECT_EQ(data.conversations(), 2);
  EXPECT_EQ(data.rows(), 1);
  HostBatch b = data.host_batch(0, 2);  // the one row twice (rows wrap)
  ASSERT_EQ(b.arrays.size(), 4u);
  EXPECT_EQ(b.tokens, 128);
  std::vector<int64_t> ids = ints(b.arrays[0]), labels = ints(b.arrays[1]), pos = ints(b.arrays[2]),
                       cu = ints(b.arrays[3]);
  EXPECT_EQ(cu, (std::vector<int64_t>{0, 25, 50, 64, 89, 114, 128}));
  EXPECT_EQ(b.max_seqlen, 25);
  const int64_t im_end = tok->token_id("<|im_end|>"), pad = tok->token_id("<|endoftext|>");
  for (int64_t row = 0; row < 2; ++row)
    for (int64_t doc = 0; doc < 2; ++doc) {
      const int64_t o = row * 64 + doc * 25;
      for (int64_t i = 0; i < 25; ++i) {
        EXPECT_EQ(pos[o + i], i);
        // Only the tokens before 'Y', 'o' and <|im_end|> have labels.
        const int64_t want = i == 20 ? 'Y' : i == 21 ? 'o' : i == 22 ? im_end : -100;
        EXPECT_EQ(labels[o + i], want) << "row " << row << " doc " << doc << " position " << i;
      }
      EXPECT_EQ(ids[o + 21], 'Y');
    }
  for (int64_t i = 50; i < 64; ++i) {
    EXPECT_EQ(ids[i], pad);
    EXPECT_EQ(labels[i], -100);
    EXPECT_EQ(pos[i], i - 50);
  }
  // A row too short for the next conversation: each conversation its own row, cut when longer.
  ChatData narrow(d.file("c.jsonl"), tok, tok_path, ChatTemplate::ChatMl, 20, 264);
  EXPECT_EQ(narrow.rows(), 2);
  EXPECT_EQ(narrow.truncated(), 2);
  EXPECT_EQ(ints(narrow.host_batch(0, 1).arrays[3]), (std::vector<int64_t>{0, 20}));
}

TEST(ChatData, PacksGreedilyInFileOrder) {
  EXPECT_EQ(pack_documents({5, 5, 3, 8, 2, 12, 1}, 10),
            (std::vector<std::vector<int64_t>>{{0, 1}, {2}, {3, 4}, {5}, {6}}));
}

TEST(ChatData, TemplateSettingAndTokenizerChecked) {
  EXPECT_EQ(chat_template_from("auto", "qwen2"), ChatTemplate::ChatMl);
  EXPECT_EQ(chat_template_from("auto", "qwen3"), ChatTemplate::ChatMl);
  EXPECT_EQ(chat_template_from("auto", "llama"), ChatTemplate::Llama3);
  EXPECT_EQ(chat_template_from("llama3", "qwen2"), ChatTemplate::Llama3);
  expect_has(error_of([] { chat_template_from("vicuna", "llama"); }), {"data.chat_template", "vicuna"});
  expect_has(error_of([] { chat_template_from("auto", "mistral"); }), {"data.chat_template", "mistral"});
  auto bytes = std::make_shared<ByteTokenizer>();
  expect_has(error_of([&] { ChatEncoder(bytes, ChatTemplate::ChatMl, "byte"); }), {"'byte'", "<|im_start|>"});
  expect_has(error_of([&] { ChatEncoder(bytes, ChatTemplate::Llama3, "byte"); }), {"<|begin_of_text|>"});
}

TEST(ChatData, MalformedLinesNameFileAndLine) {
  TempDir d("kestrel_chat");
  const std::string ok = json{{"messages", {{{"role", "user"}, {"content", "a"}},
                                            {{"role", "assistant"}, {"content", "b"}}}}}.dump();
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", "not valid JSON"},
      {R"({"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]})", "robot"},
      {R"({"conversations": [{"from": "human", "value": "x"}]})", "no assistant turn"},
      {R"({"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "y"}]})", "turn 0"},
      {R"({"conversations": []})", "non-empty"},
      {R"({"text": "caption"})", "exactly one of"},
      {R"({"conversations": [{"from": "human", "value": "<image> x"}, {"from": "gpt", "value": "y"}]})", "<image>"},
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    const std::string path = d.file("bad" + std::to_string(i) + ".jsonl");
    write_lines(path, {ok, "", bad[i].first});
    expect_has(error_of([&] { read_conversations(path); }), {path + ":3", bad[i].second});
  }
}

TEST(ChatData, MutatedLinesParseOrRaiseKestrelErrors) {
  TempDir d("kestrel_chat");
  std::mt19937_64 rng(2401);
  std::ofstream(d.file("a.png")) << "x";
  const json seeds[] = {
      json{{"image", "a.png"}, {"conversations", {{{"from", "human"}, {"value", "<image>\nWhat?"}},
                                                  {{"from", "gpt"}, {"value", "A dot."}}}}},
      json{{"messages", {{{"role", "system"}, {"content", "s"}}, {{"role", "user"}, {"content", "u"}},
                         {{"role", "assistant"}, {"content", "a"}}}}}};
  int ok = 0;
  for (const json& seed : seeds)
    for (int i = 0; i < fuzz_iterations(500); ++i) {
      const json m = mutate_json(seed, rng);
      ok += parses_or_kestrel_error([&] { (void)parse_conversation(m, d.path.string(), "f.jsonl:1"); },
                                    "mutant " + std::to_string(i) + ": " + m.dump());
    }
  EXPECT_GT(ok, 0);
  // The example config resolves (its folders are not there, so only the schema is checked).
  const fs::path example = fs::path(__FILE__).parent_path() / ".." / ".." / "configs" / "chat_sft_example.json";
  const json cfg = resolve_train_config(json::parse(std::ifstream(example)), "chat_sft_example");
  EXPECT_EQ(cfg["data"]["type"], "chat");
  EXPECT_EQ(cfg["data"]["chat_template"], "auto");
}

TEST(ChatData, ImagePathsStayInTheFolder) {
  TempDir d("kestrel_chat");
  fs::create_directories(d.path / "data" / "img");
  std::ofstream(d.path / "data" / "img" / "a.png") << "x";
  std::ofstream(d.path / "secret.png") << "x";
  fs::create_symlink(d.path / "secret.png", d.path / "data" / "link.png");
  ASSERT_EQ(::mkfifo((d.path / "data" / "fifo.png").c_str(), 0600), 0);
  auto line = [](const std::string& image) {
    return json{{"image", image}, {"conversations", {{{"from", "human"}, {"value", "<image>\nWhat?"}},
                                                     {{"from", "gpt"}, {"value", "A dot."}}}}}.dump();
  };
  const std::string path = (d.path / "data" / "c.jsonl").string();
  write_lines(path, {line("img/a.png")});
  std::vector<Conversation> cs = read_conversations(path);
  ASSERT_EQ(cs.size(), 1u);
  ASSERT_EQ(cs[0].images.size(), 1u);
  EXPECT_TRUE(cs[0].images[0].ends_with("img/a.png")) << cs[0].images[0];
  for (auto [image, why] : std::vector<std::pair<std::string, std::string>>{
           {"../secret.png", "climbs out"}, {(d.path / "secret.png").string(), "absolute"},
           {"link.png", "outside"}, {"fifo.png", "not a regular file"}, {"img", "not a regular file"},
           {"missing.png", "does not exist"}}) {
    write_lines(path, {line("img/a.png"), line(image)});
    const std::string m = error_of([&] { read_conversations(path); });
    expect_has(m, {path + ":2", why});
  }
  // The decoder task has no vision tower: a conversation with an image is refused.
  write_lines(path, {line("img/a.png")});
  const std::string tok_path = write_tokenizer(d);
  expect_has(error_of([&] { ChatData(path, tokenizer(d), tok_path, ChatTemplate::ChatMl, 64, 264); }),
             {"image", "decoder"});
}

TEST(ChatData, DecoderLearnsFromChatJsonl) {
  TempDir d("kestrel_chat");
  const std::string tok_path = write_tokenizer(d);
  const std::vector<std::pair<std::string, std::string>> qa = {
      {"sky?", "blue"}, {"grass?", "green"}, {"sun?", "yellow"}, {"snow?", "white"}};
  std::vector<std::string> lines;
  for (int i = 0; i < 32; ++i) {
    const auto& [q, a] = qa[static_cast<size_t>(i) % qa.size()];
    lines.push_back(json{{"conversations", {{{"from", "human"}, {"value", q}}, {{"from", "gpt"}, {"value", a}}}}}.dump());
  }
  write_lines(d.file("chat.jsonl"), lines);
  json text = {{"model_type", "qwen2"}, {"vocab_size", 264}, {"hidden_size", 32}, {"intermediate_size", 64},
               {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
  json user = {{"model", {{"type", "decoder"}, {"config", text}}},
               {"data", {{"type", "chat"}, {"train_files", d.file("chat.jsonl")}, {"tokenizer", tok_path},
                         {"seq_len", 64}}},
               {"train", {{"steps", 30}, {"batch_size", 2}, {"lr", 1e-2}, {"warmup_steps", 2}}},
               {"device", "cpu"},
               {"log_every", 1000},
               {"out_dir", d.file("out")}};
  Trainer t(resolve_train_config(user, "test"));
  t.set_log_callback([](const std::string&) {});
  TrainSummary s = t.run();
  EXPECT_LT(s.last_loss, 0.5 * s.first_loss) << s.first_loss << " -> " << s.last_loss;
  // A template name the schema does not know is refused by key.
  user["data"]["chat_template"] = "alpaca";
  expect_has(error_of([&] { Trainer bad(resolve_train_config(user, "test")); }), {"data.chat_template", "alpaca"});
  // The VLM takes conversations too (test_chat_images.cpp), from a file it is given.
  const json vlm = kestrel::train::testing::tiny_vlm_run(
      d.file("vlm"), {{"steps", 1}}, {{"data", {{"type", "chat"}, {"image_size", 16}}}});
  expect_has(error_of([&] { Trainer bad(vlm); }), {"data.train_files", "data.type \"chat\""});
}
