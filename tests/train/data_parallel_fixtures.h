// Helpers of the data-parallel tests (test_data_parallel.cpp, test_zero.cpp): a tiny decoder run
// whose rows all hold the same number of predicted tokens, the parameters of a run's last
// checkpoint, N trainers on threads with one in-process group, and a parameter comparison.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/dtype.h"
#include "kestrel/train/trainer.h"
#include "trainer_fixtures.h"

namespace kestrel::train::testing {

inline nlohmann::json dp_run(const std::string& dir, int64_t batch, int64_t accum) {
  nlohmann::json text = {{"model_type", "llama"}, {"vocab_size", 67}, {"hidden_size", 32}, {"intermediate_size", 48},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"tie_word_embeddings", false}};
  // Documents as long as a row (len_mod 1: 5 ids + the start token = seq_len 6 + 1 overlap), so
  // every row holds the same number of predicted tokens and the mean of the ranks' means is the
  // global mean.
  nlohmann::json cfg = tiny_decoder_run(dir, text, 256, 1, 12, batch, "cpu");
  cfg["train"]["steps"] = 4;
  cfg["train"]["grad_accum"] = accum;
  cfg["train"]["lr"] = 1e-2;
  cfg["train"]["warmup_steps"] = 1;
  cfg["checkpoint_every"] = 4;
  cfg["prefetch"] = 0;
  cfg["threads"] = 1;
  cfg["distributed"]["bucket_mib"] = 0.004;  // ~4 KiB: many buckets per backward
  return cfg;
}

// The parameters of the last checkpoint under out_dir, by name.
inline std::map<std::string, std::vector<float>> final_parameters(const std::string& out_dir) {
  std::string last;
  for (const auto& e : std::filesystem::directory_iterator(out_dir + "/checkpoints"))
    if (e.path().filename().string().rfind("step_", 0) == 0 && e.path().string() > last) last = e.path().string();
  auto file = models::SafetensorsReader::open(last + "/model.safetensors");
  std::map<std::string, std::vector<float>> out;
  for (const std::string& n : file.names()) {
    const auto& e = file.get(n);
    std::vector<float> v(e.numel());
    if (e.dtype == DType::BF16) {
      for (size_t i = 0; i < v.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, e.bytes.data() + 2 * i, 2);
        v[i] = bf16_bits_to_float(h);
      }
    } else {
      EXPECT_EQ(e.dtype, DType::F32);
      std::memcpy(v.data(), e.bytes.data(), v.size() * sizeof(float));
    }
    out[n] = std::move(v);
  }
  return out;
}

// Runs `world` trainers on threads with one in-process group; returns each rank's error ("" = none).
inline std::vector<std::string> run_group(const nlohmann::json& cfg, int world, std::chrono::milliseconds timeout,
                                   const std::function<void(int rank, Trainer&)>& body = {},
                                   const std::function<nlohmann::json(int rank)>& cfg_of_rank = {}) {
  auto group = make_inprocess_group(world, CommOptions{timeout});
  std::vector<std::shared_ptr<Communicator>> comms;
  for (auto& c : group) comms.push_back(std::move(c));
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        Trainer t(cfg_of_rank ? cfg_of_rank(r) : cfg, comms[r]);
        t.set_log_callback([](const std::string&) {});
        if (body)
          body(r, t);
        else
          t.run();
      } catch (const std::exception& e) {
        errors[r] = e.what();
        comms[r]->abort(e.what());
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

inline void expect_same_parameters(const std::map<std::string, std::vector<float>>& a,
                            const std::map<std::string, std::vector<float>>& b, double tol) {
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, va] : a) {
    const auto& vb = b.at(name);
    ASSERT_EQ(va.size(), vb.size()) << name;
    for (size_t i = 0; i < va.size(); ++i) {
      const double d = std::fabs(static_cast<double>(va[i]) - vb[i]);
      worst = std::max(worst, d);
      ASSERT_LE(d, tol * (1 + std::fabs(vb[i]))) << name << "[" << i << "]: " << va[i] << " vs " << vb[i];
    }
  }
  std::printf("largest parameter difference %.3g\n", worst);
}

}  // namespace kestrel::train::testing
