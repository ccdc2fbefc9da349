// Data parallelism through NCCL at world size 1 on one GPU: distributed.backend "nccl" takes the
// same path as a multi-GPU run (parameters broadcast, grad-ready hooks, buckets flattened and
// all-reduced on the comm stream, wait, copied back; the loss all-reduced; a bounded host wait per
// step) and must give the plain run's parameters bit for bit (the mean over one rank is the
// identity) wherever two plain runs are bitwise equal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/dtype.h"
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

// The largest difference between two checkpoints' parameters (bf16 or f32), and whether every
// tensor is bit for bit equal.
std::pair<double, bool> compare_checkpoints(const std::string& a_dir, const std::string& b_dir) {
  auto a = models::SafetensorsReader::open(a_dir + "/model.safetensors");
  auto b = models::SafetensorsReader::open(b_dir + "/model.safetensors");
  EXPECT_EQ(a.names(), b.names());
  double worst = 0;
  bool same = true;
  for (const std::string& n : a.names()) {
    const auto& ea = a.get(n);
    const auto& eb = b.get(n);
    EXPECT_EQ(ea.bytes.size(), eb.bytes.size()) << n;
    if (ea.bytes.size() != eb.bytes.size()) return {1e30, false};
    same = same && std::memcmp(ea.bytes.data(), eb.bytes.data(), ea.bytes.size()) == 0;
    for (int64_t i = 0; i < ea.numel(); ++i) {
      auto value = [&](const models::SafetensorsEntry& e) -> double {
        if (e.dtype == DType::BF16) {
          uint16_t h;
          std::memcpy(&h, e.bytes.data() + 2 * i, 2);
          return bf16_bits_to_float(h);
        }
        float f;
        std::memcpy(&f, e.bytes.data() + 4 * i, 4);
        return f;
      };
      worst = std::max(worst, std::fabs(value(ea) - value(eb)));
    }
  }
  return {worst, same};
}

TEST(DataParallelCuda, NcclAtWorldSizeOneEqualsThePlainRun) {
  KESTREL_REQUIRE_GPU();
  if (!nccl_available()) GTEST_SKIP() << "libnccl.so.2 not loadable here";
  const std::string dir = testing::fresh_temp_dir("kestrel_dp_cuda", "nccl1");
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 64}, {"intermediate_size", 96},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  std::vector<std::string> logs;
  auto run = [&](const std::string& name, const char* backend) {
    nlohmann::json cfg = testing::tiny_decoder_run(dir + "/" + name, text, 256, 1, 48, 4, "cuda:0");
    cfg["train"]["steps"] = 3;
    cfg["checkpoint_every"] = 3;
    cfg["distributed"]["backend"] = backend;
    cfg["distributed"]["bucket_mib"] = 0.02;  // several buckets in flight per backward
    cfg["train"]["deterministic"] = true;  // fixed-order backward: plain runs repeat bit for bit
    // The constructor reports the data-parallel set-up before a callback can be installed: capture it.
    ::testing::internal::CaptureStdout();
    Trainer t(cfg);
    logs.push_back(::testing::internal::GetCapturedStdout());
    t.set_log_callback([&](const std::string& s) { logs.push_back(s); });
    t.run();
    return last_checkpoint(dir + "/" + name + "/out");
  };
  const std::string plain = run("plain", "none"), again = run("again", "none"), nccl = run("nccl", "nccl");
  bool said = false;
  for (const auto& l : logs) said |= l.find("data parallel: rank 0 of 1 (nccl)") != std::string::npos;
  EXPECT_TRUE(said) << "the nccl run did not take the data-parallel path";
  // train.deterministic makes two plain runs bitwise equal, so the NCCL run must be too (were they
  // not, the NCCL run would be held to their spread).
  const auto [spread, reproducible] = compare_checkpoints(plain, again);
  const auto [diff, same] = compare_checkpoints(plain, nccl);
  std::printf("plain vs plain: %s (largest difference %.3g); plain vs nccl: %s (largest difference %.3g)\n",
              reproducible ? "bitwise equal" : "differ", spread, same ? "bitwise equal" : "differ", diff);
  if (reproducible) {
    EXPECT_TRUE(same) << "NCCL at world size 1 changed the parameters (largest difference " << diff << ")";
    EXPECT_EQ(testing::metric_losses(dir + "/plain/out"), testing::metric_losses(dir + "/nccl/out"));
  } else {
    EXPECT_LE(diff, 4 * spread + 1e-6);
  }
}

TEST(DataParallelCuda, ZeroAtWorldSizeOneEqualsThePlainRun) {
  // distributed.zero 1 and 2 through NCCL at world size 1: the owner broadcasts, the stage-2 buckets
  // go through ncclReduce, the checkpoint holds optimizer-00000-of-00001.safetensors and resumes.
  // Without clipping (stage 2's norm is sqrt of a squared partial) the parameters equal the plain
  // run's bit for bit.
  KESTREL_REQUIRE_GPU();
  if (!nccl_available()) GTEST_SKIP() << "libnccl.so.2 not loadable here";
  const std::string dir = testing::fresh_temp_dir("kestrel_dp_cuda", "zero1");
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 64}, {"intermediate_size", 96},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  auto config = [&](const std::string& name, const char* backend, int zero, const char* offload) {
    nlohmann::json cfg = testing::tiny_decoder_run(dir + "/" + name, text, 256, 1, 48, 4, "cuda:0");
    cfg["train"]["steps"] = 4;
    cfg["train"]["grad_clip"] = 0.0;
    cfg["checkpoint_every"] = 2;
    cfg["distributed"]["backend"] = backend;
    cfg["distributed"]["zero"] = zero;
    cfg["distributed"]["bucket_mib"] = 0.02;
    cfg["optimizer"]["offload"] = offload;
    cfg["train"]["deterministic"] = true;
    return cfg;
  };
  auto run = [&](const nlohmann::json& cfg, const std::string& resume = "") {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.resume(resume);
    t.run();
  };
  run(config("plain", "none", 0, "none"));
  const std::string plain = last_checkpoint(dir + "/plain/out");
  for (int zero : {1, 2}) {
    for (const char* offload : {"none", "host"}) {
      const std::string name = "zero" + std::to_string(zero) + "_" + offload;
      std::fprintf(stderr, "[ zero ] %s\n", name.c_str());
      run(config(name, "nccl", zero, offload));
      const std::string got = last_checkpoint(dir + "/" + name + "/out");
      EXPECT_TRUE(std::filesystem::exists(got + "/optimizer-00000-of-00001.safetensors")) << got;
      const auto [diff, same] = compare_checkpoints(plain, got);
      std::printf("plain vs %s: %s (largest difference %.3g)\n", name.c_str(), same ? "bitwise equal" : "differ", diff);
      EXPECT_TRUE(same) << name << ": largest difference " << diff;
    }
  }
  // The sharded step-2 checkpoint resumed by a plain (zero 0, no NCCL) run continues it.
  nlohmann::json resumed = config("resumed", "none", 0, "none");
  resumed["data"]["train_files"] = dir + "/zero2_none/train.bin";  // the same data: no config change
  run(resumed, dir + "/zero2_none/out/checkpoints/step_00000002");
  const auto [diff, same] = compare_checkpoints(plain, last_checkpoint(dir + "/resumed/out"));
  EXPECT_TRUE(same) << "resumed from the zero-2 shard: largest difference " << diff;
}

}  // namespace
}  // namespace kestrel::train
