// kestrel-train's profile_step: the chosen step's device time per op in the log and in
// out_dir/op_profile.json (the ops a decoder step runs, forward and backward, each with calls and
// time; their sum within the step's wall time); 0 (the default) writes nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "kestrel/runtime/error.h"
#include "trainer_fixtures.h"

namespace kestrel::train::testing {
namespace {

TEST(OpProfileRun, TheChosenStepsOpsGoToTheLogAndTheJson) {
  const std::string dir = fresh_temp_dir("kestrel_op_profile", "run");
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 32}, {"intermediate_size", 48},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  nlohmann::json cfg = tiny_decoder_run(dir, text, 64, 9, 24, 2, "cpu");
  cfg["train"]["steps"] = 3;
  cfg["profile_step"] = 2;
  std::vector<std::string> logs;
  Trainer t(cfg);
  t.set_log_callback([&](const std::string& s) { logs.push_back(s); });
  t.run();
  bool said = false;
  for (const auto& l : logs) said |= l.find("op profile of step 2") != std::string::npos;
  EXPECT_TRUE(said);
  std::ifstream f(dir + "/out/op_profile.json");
  ASSERT_TRUE(f.good());
  nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j["step"], 2);
  std::set<std::string> ops;
  double sum = 0;
  for (const auto& r : j["ops"]) {
    ops.insert(r["op"].get<std::string>());
    EXPECT_GT(r["calls"].get<int64_t>(), 0);
    sum += r["ms"].get<double>();
  }
  for (const char* want : {"matmul", "attention", "attention_backward", "rms_norm"})
    EXPECT_TRUE(ops.count(want)) << want << " missing from the profile";
  EXPECT_NEAR(sum, j["ops_ms"].get<double>(), 1e-6);
  EXPECT_LE(sum, j["wall_ms"].get<double>());

  const std::string quiet = fresh_temp_dir("kestrel_op_profile", "off");
  nlohmann::json off = tiny_decoder_run(quiet, text, 64, 9, 24, 2, "cpu");
  Trainer t2(off);
  t2.set_log_callback([](const std::string&) {});
  t2.run();
  EXPECT_FALSE(std::filesystem::exists(quiet + "/out/op_profile.json"));
}

// A profile_step the run never reaches (past train.steps, or negative) profiled nothing without a
// word; it is refused naming the key.
TEST(OpProfileRun, AStepOutsideTheRunIsRefused) {
  const std::string dir = fresh_temp_dir("kestrel_op_profile", "outside");
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 32}, {"intermediate_size", 48},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  nlohmann::json cfg = tiny_decoder_run(dir, text, 64, 9, 24, 2, "cpu");
  cfg["train"]["steps"] = 3;
  for (int64_t bad : {4, -1}) {
    cfg["profile_step"] = bad;
    try {
      Trainer t(cfg);
      ADD_FAILURE() << "profile_step " << bad << " with train.steps 3 was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("profile_step"), std::string::npos) << e.what();
    }
  }
  cfg["profile_step"] = 3;
  EXPECT_NO_THROW(Trainer t(cfg));
}

}  // namespace
}  // namespace kestrel::train::testing
