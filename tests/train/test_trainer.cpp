// The trainer: exact resume, a falling loss, atomic checkpoints, and config errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "kestrel/models/config.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "../../train/src/checkpoint_io.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

json tiny_run(const std::string& out_dir, int64_t steps) {
  json model = {
      {"model_type", "kestrel_vlm"},
      {"image_token_id", 259},
      {"pixel_shuffle_factor", 2},
      {"projector_hidden_size", 32},
      {"vision_config",
       {{"hidden_size", 16}, {"intermediate_size", 32}, {"num_hidden_layers", 1}, {"num_attention_heads", 2},
        {"image_size", 16}, {"patch_size", 4}}},
      {"text_config",
       {{"model_type", "qwen2"}, {"vocab_size", 260}, {"hidden_size", 32}, {"intermediate_size", 64},
        {"num_hidden_layers", 1}, {"num_attention_heads", 2}, {"num_key_value_heads", 1},
        {"tie_word_embeddings", true}}}};
  json user = {{"model", {{"config", model}}},
               {"data", {{"image_size", 16}, {"eval_samples", 4}}},
               {"train", {{"steps", steps}, {"batch_size", 4}, {"lr", 3e-3}, {"warmup_steps", 2}}},
               {"device", "cpu"},
               {"log_every", 1000},
               {"out_dir", out_dir}};
  return resolve_train_config(user, "test");
}

std::vector<double> losses(const std::string& out_dir) {
  std::vector<double> l;
  std::ifstream f(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) l.push_back(json::parse(line)["loss"].get<double>());
  return l;
}

std::string tmp(const std::string& n) {
  fs::path p = fs::temp_directory_path() / ("kestrel_trainer_" + n + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

TEST(Trainer, ResumeIsExact) {
  std::string a = tmp("straight"), b = tmp("resumed");
  {
    Trainer t(tiny_run(a, 20));
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  // Run b checkpoints at 10 and 20; cutting it back to step 10 (checkpoint and metrics) stands for
  // a run of 10 steps, which is then resumed for the last 10.
  {
    json c = tiny_run(b, 20);
    c["checkpoint_every"] = 10;
    Trainer t(c);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  std::vector<double> full = losses(a);
  ASSERT_EQ(full.size(), 20u);
  fs::remove_all(fs::path(b) / "checkpoints" / "step_00000020");
  {
    std::vector<double> first = losses(b);
    std::ofstream f(b + "/metrics.jsonl", std::ios::trunc);
    for (int i = 0; i < 10; ++i) f << json{{"loss", first[i]}}.dump() << "\n";
  }
  {
    Trainer t(tiny_run(b, 20));
    t.set_log_callback([](const std::string&) {});
    t.resume("latest");
    t.run();
  }
  std::vector<double> resumed = losses(b);
  ASSERT_EQ(resumed.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(full[i], resumed[i]) << "step " << i + 1;
  EXPECT_LT(full.back(), 0.8 * full.front());  // and it learns
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Trainer, HalfWrittenCheckpointIsIgnored) {
  std::string d = tmp("atomic");
  fs::create_directories(fs::path(d) / "checkpoints" / ".step_00000005.tmp");
  fs::create_directories(fs::path(d) / "checkpoints" / "step_00000003");  // no trainer_state.json
  EXPECT_EQ(latest_checkpoint(d), "");
  Trainer t(tiny_run(d, 2));
  EXPECT_THROW(t.resume("latest"), Error);
  fs::remove_all(d);
}

TEST(TrainConfig, ErrorsNameTheKey) {
  try {
    resolve_train_config(json{{"train", {{"stepz", 3}}}}, "run.json");
    ADD_FAILURE();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("train.stepz"), std::string::npos) << m;
    EXPECT_NE(m.find("steps"), std::string::npos) << m;  // lists the valid keys
  }
  EXPECT_THROW(resolve_train_config(json{{"train", {{"steps", "many"}}}}, "run.json"), Error);
  json c = default_train_config();
  apply_override(c, "train.lr=0.5");
  EXPECT_EQ(c["train"]["lr"].get<double>(), 0.5);
  apply_override(c, "model.config.text_config.hidden_size=64");
  EXPECT_EQ(c["model"]["config"]["text_config"]["hidden_size"].get<int>(), 64);
  EXPECT_THROW(apply_override(c, "train.nope=1"), Error);
  EXPECT_THROW(apply_override(c, "justakey"), Error);
  json bad = tiny_run(tmp("bad"), 1);
  bad["model"]["config"]["text_config"]["num_attention_heads"] = 3;
  EXPECT_THROW(Trainer t(bad), Error);
}

}  // namespace
}  // namespace kestrel::train
