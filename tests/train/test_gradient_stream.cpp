// optimizer.gradients "host" on the CPU: the stream's host copies and norm against the gradients a
// plain backward leaves, the trainer's streamed runs equal to its on-device-gradient runs bit for bit
// (clipping every step), and the refusals of what it cannot do.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

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

// optimizer.update_overlap: the host update of step s runs beside step s + 1's forward, each layer
// waiting for its own parameters; the losses, the parameters and the optimizer state at the end
// equal the run that updates before the forward, bit for bit (checkpoints every 2 steps and at the
// end finish the pending update first).
TEST(GradientStream, OverlappedUpdateEqualsTheUpdateBeforeTheForward) {
  const std::string dir = fresh_temp_dir("kestrel_gstream", "overlap");
  std::vector<std::vector<double>> losses;
  std::vector<std::string> logs;
  for (const char* mode : {"off", "on"}) {
    nlohmann::json cfg = stream_run(dir + "/" + mode, "host");
    cfg["optimizer"]["update_overlap"] = mode;
    cfg["checkpoint_every"] = 2;
    ::testing::internal::CaptureStdout();  // the constructor reports the set-up before a callback exists
    Trainer t(cfg);
    logs.push_back(::testing::internal::GetCapturedStdout());
    t.set_log_callback([&](const std::string& s) { logs.push_back(s); });
    t.run();
    losses.push_back(metric_losses(dir + "/" + mode + "/out"));
  }
  ASSERT_EQ(losses[0].size(), 5u);
  EXPECT_EQ(losses[0], losses[1]);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    auto bytes = [&](const char* mode) {
      std::ifstream f(dir + "/" + mode + "/out/checkpoints/step_00000005/" + file, std::ios::binary);
      EXPECT_TRUE(f.good()) << dir << "/" << mode << "/out/checkpoints/step_00000005/" << file;
      return std::string(std::istreambuf_iterator<char>(f), {});
    };
    EXPECT_EQ(bytes("off"), bytes("on")) << file;
  }
  bool said = false;
  for (const auto& l : logs) said |= l.find("optimizer.update_overlap") != std::string::npos;
  EXPECT_TRUE(said) << "the overlapped run did not say so";
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
  // The overlap needs the gradients on the host (and says so), and takes three values.
  cfg = stream_run(dir, "device");
  cfg["optimizer"]["update_overlap"] = "on";
  expect_refused(cfg, {"optimizer.update_overlap", "optimizer.gradients"});
  cfg = stream_run(dir, "host");
  cfg["optimizer"]["update_overlap"] = "yes";
  expect_refused(cfg, {"optimizer.update_overlap", "yes"});
}

}  // namespace
}  // namespace kestrel::train::testing
