// optimizer.gradients "host" on the CPU: the stream's host copies and norm against the gradients a
// plain backward leaves, the trainer's streamed runs equal to its on-device-gradient runs bit for bit
// (clipping every step), and the refusals of what it cannot do.
#include <gtest/gtest.h>

#include "gradient_stream_check.h"
#include "kestrel/runtime/error.h"
#include "trainer_fixtures.h"

namespace kestrel::train::testing {
namespace {

TEST(GradientStream, HostCopiesEqualTheGradientsAndTheParametersKeepNone) {
  expect_stream_matches_device_gradients(Device::cpu(), DType::F32, 0.0);
  expect_stream_matches_device_gradients(Device::cpu(), DType::BF16, 0.0);
}

TEST(GradientStream, ClipsOnTheHostAsClipGradNormDoes) {
  expect_stream_matches_device_gradients(Device::cpu(), DType::F32, 0.01);
}

nlohmann::json stream_run(const std::string& dir, const char* gradients) {
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 32}, {"intermediate_size", 48},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  nlohmann::json cfg = tiny_decoder_run(dir, text, 64, 9, 24, 2, "cpu");
  cfg["train"]["steps"] = 5;
  cfg["train"]["grad_clip"] = 0.05;  // every step clips
  cfg["train"]["lr"] = 1e-2;
  cfg["precision"] = "bf16";
  cfg["recompute"] = "recompute";  // hooks of region parameters wait for their region
  cfg["optimizer"]["offload"] = "host";
  cfg["optimizer"]["gradients"] = gradients;
  return cfg;
}

TEST(GradientStream, TrainerRunsEqualRunsWithGradientsOnTheDevice) {
  const std::string dir = fresh_temp_dir("kestrel_gstream", "trainer");
  std::vector<std::vector<double>> losses;
  for (const char* g : {"device", "host"}) {
    Trainer t(stream_run(dir + "/" + g, g));
    t.set_log_callback([](const std::string&) {});
    t.run();
    losses.push_back(metric_losses(dir + "/" + g + "/out"));
  }
  ASSERT_EQ(losses[0].size(), 5u);
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_LT(losses[0].back(), losses[0].front());
}

void expect_refused(nlohmann::json cfg, const std::vector<std::string>& words) {
  try {
    Trainer t(cfg);
    FAIL() << "no error";
  } catch (const Error& e) {
    for (const std::string& w : words) EXPECT_NE(std::string(e.what()).find(w), std::string::npos) << e.what();
  }
}

TEST(GradientStream, RefusesWhatItCannotDo) {
  const std::string dir = fresh_temp_dir("kestrel_gstream", "refuse");
  nlohmann::json cfg = stream_run(dir, "host");
  cfg["optimizer"]["offload"] = "none";
  expect_refused(cfg, {"optimizer.gradients", "optimizer.offload"});
  cfg = stream_run(dir, "host");
  cfg["train"]["grad_accum"] = 2;
  expect_refused(cfg, {"optimizer.gradients", "train.grad_accum"});
  cfg = stream_run(dir, "disk");
  expect_refused(cfg, {"optimizer.gradients", "disk"});
}

}  // namespace
}  // namespace kestrel::train::testing
