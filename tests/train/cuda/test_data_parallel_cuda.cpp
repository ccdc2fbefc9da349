// Data parallelism through NCCL at world size 1 on one GPU: distributed.backend "nccl" takes the
// same path as a multi-GPU run (grad-ready hooks, buckets flattened and all-reduced on the comm
// stream, wait, copied back; the loss all-reduced) and must give the plain run's parameters bit for
// bit (the mean over one rank is the identity).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/communicator.h"
#include "support/gpu.h"
#include "../trainer_fixtures.h"

namespace kestrel::train {
namespace {

std::string last_checkpoint(const std::string& out_dir) {
  std::string last;
  for (const auto& e : std::filesystem::directory_iterator(out_dir + "/checkpoints"))
    if (e.path().filename().string().rfind("step_", 0) == 0 && e.path().string() > last) last = e.path().string();
  return last;
}

TEST(DataParallelCuda, NcclAtWorldSizeOneEqualsThePlainRunBitwise) {
  KESTREL_REQUIRE_GPU();
  if (!nccl_available()) GTEST_SKIP() << "built without NCCL";
  const std::string dir = testing::fresh_temp_dir("kestrel_dp_cuda", "nccl1");
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 64}, {"intermediate_size", 96},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  std::vector<std::string> outs;
  std::vector<std::string> logs;
  for (const char* backend : {"none", "nccl"}) {
    nlohmann::json cfg = testing::tiny_decoder_run(dir + "/" + backend, text, 256, 1, 48, 4, "cuda:0");
    cfg["train"]["steps"] = 3;
    cfg["checkpoint_every"] = 3;
    cfg["distributed"]["backend"] = backend;
    cfg["distributed"]["bucket_mib"] = 0.02;  // several buckets in flight per backward
    Trainer t(cfg);
    t.set_log_callback([&](const std::string& s) { logs.push_back(s); });
    t.run();
    outs.push_back(last_checkpoint(dir + "/" + backend + "/out"));
  }
  bool said = false;
  for (const auto& l : logs) said |= l.find("data parallel: rank 0 of 1 (nccl)") != std::string::npos;
  EXPECT_TRUE(said) << "the nccl run did not take the data-parallel path";
  auto a = models::SafetensorsReader::open(outs[0] + "/model.safetensors");
  auto b = models::SafetensorsReader::open(outs[1] + "/model.safetensors");
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& n : a.names()) {
    const auto& ea = a.get(n);
    const auto& eb = b.get(n);
    ASSERT_EQ(ea.bytes.size(), eb.bytes.size()) << n;
    EXPECT_EQ(std::memcmp(ea.bytes.data(), eb.bytes.data(), ea.bytes.size()), 0) << n;
  }
  EXPECT_EQ(testing::metric_losses(dir + "/none/out"), testing::metric_losses(dir + "/nccl/out"));
}

}  // namespace
}  // namespace kestrel::train
