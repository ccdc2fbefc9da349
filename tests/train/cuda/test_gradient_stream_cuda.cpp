// optimizer.gradients "host" on the GPU: gradients copied out on the D2H stream as their hooks fire
// equal the device gradients bit for bit, the parameters hold none, and the host clip matches
// clip_grad_norm's.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>

#include "../gradient_stream_check.h"
#include "support/gpu.h"
#include "../trainer_fixtures.h"

namespace kestrel::train::testing {
namespace {

TEST(GradientStreamCuda, HostCopiesEqualTheDeviceGradients) {
  KESTREL_REQUIRE_GPU();
  expect_stream_matches_device_gradients(Device::cuda(0), DType::BF16, 0.0);
  expect_stream_matches_device_gradients(Device::cuda(0), DType::F32, 0.01);
}

// optimizer.update_overlap on the GPU: the worker thread's parameter copies reach each layer's
// kernels through per-parameter events. With train.deterministic (fixed-order attention and
// embedding backward) two runs are comparable bit for bit: the overlapped run's losses and final
// parameters and optimizer state equal the run that updates before the forward.
TEST(GradientStreamCuda, OverlappedUpdateEqualsTheUpdateBeforeTheForwardBitwise) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = fresh_temp_dir("kestrel_gstream_cuda", "overlap");
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 301}, {"hidden_size", 128}, {"intermediate_size", 320},
                         {"num_hidden_layers", 3}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  std::vector<std::vector<double>> losses;
  for (const char* mode : {"off", "on"}) {
    nlohmann::json cfg = tiny_decoder_run(dir + "/" + mode, text, 96, 13, 200, 2, "cuda:0");
    cfg["train"]["steps"] = 6;
    cfg["train"]["grad_clip"] = 0.5;
    cfg["train"]["deterministic"] = true;
    cfg["precision"] = "bf16";
    cfg["recompute"] = "offload";
    cfg["checkpoint_every"] = 3;
    cfg["optimizer"]["offload"] = "host";
    cfg["optimizer"]["gradients"] = "host";
    cfg["optimizer"]["staging_slot_mib"] = 1;  // several chunks per parameter
    cfg["optimizer"]["update_overlap"] = mode;
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
    losses.push_back(metric_losses(dir + "/" + mode + "/out"));
  }
  ASSERT_EQ(losses[0].size(), 6u);
  EXPECT_EQ(losses[0], losses[1]);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    auto bytes = [&](const char* mode) {
      std::ifstream f(dir + "/" + mode + "/out/checkpoints/step_00000006/" + file, std::ios::binary);
      EXPECT_TRUE(f.good()) << mode << " " << file;
      return std::string(std::istreambuf_iterator<char>(f), {});
    };
    EXPECT_EQ(bytes("off"), bytes("on")) << file;
  }
}

}  // namespace
}  // namespace kestrel::train::testing
