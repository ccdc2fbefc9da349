// Shared set-up of the trainer tests (CPU and GPU binaries): a tiny VLM run on the embedded shapes
// data, the per-step losses a run wrote to metrics.jsonl, and a fresh temporary folder per process.
#pragma once

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kestrel/runtime/memory_trace.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/token_file.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"

namespace kestrel::train::testing {

// A resolved config: a 1-layer VLM (vision width `vision_hidden`, text width `text_hidden`, MLPs
// twice as wide), 16-pixel images, CPU, lr 3e-3 with 2 warm-up steps. `train` entries (steps,
// batch_size, grad_accum, ...) and top-level `extra` entries (device, precision, prefetch, ...)
// override the defaults.
inline nlohmann::json tiny_vlm_run(const std::string& out_dir, const nlohmann::json& train,
                                   const nlohmann::json& extra = nlohmann::json::object(), int64_t vision_hidden = 16,
                                   int64_t text_hidden = 32) {
  nlohmann::json model = {
      {"model_type", "kestrel_vlm"},
      {"image_token_id", 259},
      {"pixel_shuffle_factor", 2},
      {"projector_hidden_size", 32},
      {"vision_config",
       {{"hidden_size", vision_hidden}, {"intermediate_size", 2 * vision_hidden}, {"num_hidden_layers", 1},
        {"num_attention_heads", 2}, {"image_size", 16}, {"patch_size", 4}}},
      {"text_config",
       {{"model_type", "qwen2"}, {"vocab_size", 260}, {"hidden_size", text_hidden},
        {"intermediate_size", 2 * text_hidden}, {"num_hidden_layers", 1}, {"num_attention_heads", 2},
        {"num_key_value_heads", 1}, {"tie_word_embeddings", true}}}};
  nlohmann::json user = {{"model", {{"config", model}}},
                         {"data", {{"image_size", 16}, {"eval_samples", 4}}},
                         {"train", {{"lr", 3e-3}, {"warmup_steps", 2}}},
                         {"device", "cpu"},
                         {"log_every", 1000},
                         {"out_dir", out_dir}};
  user["train"].update(train);
  user.update(extra);
  return resolve_train_config(user, "test");
}

// LLaVA's computation in a kestrel_vlm config (what `export --format llava` needs): no pixel shuffle, an
// erf-GELU projector of width `projector_hidden_size`, features from hidden_states[feature_layer].
inline void use_llava_computation(nlohmann::json& model_config, int64_t projector_hidden_size, int64_t feature_layer) {
  model_config["pixel_shuffle_factor"] = 1;
  model_config["projector_hidden_size"] = projector_hidden_size;
  model_config["projector_hidden_act"] = "gelu";
  model_config["vision_feature_layer"] = feature_layer;
}

// The "loss" of every line of DIR/metrics.jsonl, in order.
inline std::vector<double> metric_losses(const std::string& out_dir) {
  std::vector<double> l;
  std::ifstream f(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) l.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  return l;
}

// A decoder run on a generated llm.c token file DIR/train.bin: `docs` documents, each a 0 (the
// document start) then 5 + d % `len_mod` ids in [1, vocab), for the text config `text`.
inline nlohmann::json tiny_decoder_run(const std::string& dir, const nlohmann::json& text, int docs, int len_mod,
                                       int64_t seq_len, int64_t batch, const std::string& device) {
  const int64_t vocab = text["vocab_size"];
  std::filesystem::create_directories(dir);
  std::vector<uint32_t> toks;
  for (int d = 0; d < docs; ++d) {
    toks.push_back(0);
    for (int i = 0; i < 5 + d % len_mod; ++i) toks.push_back(1 + static_cast<uint32_t>((d * 7 + i) % (vocab - 6)));
  }
  write_token_file(dir + "/train.bin", toks, TokenFormat::U16);
  nlohmann::json user = {
      {"model", {{"type", "decoder"}, {"config", text}}},
      {"data", {{"type", "tokens"}, {"train_files", dir + "/train.bin"}, {"seq_len", seq_len}, {"doc_start_token", 0}}},
      {"train", {{"steps", 2}, {"batch_size", batch}}},
      {"device", device},
      {"log_every", 1000},
      {"out_dir", dir + "/out"}};
  return resolve_train_config(user, "test");
}

// A profiled run of the trainer on `device`, as kestrel-mem profile does it. `after_start` runs
// once event logging is on, before the trainer exists (a test may free something there).
inline MemoryProfile profile_trainer_run(const nlohmann::json& cfg, Device device, const ProfileOptions& po = {},
                                         const std::function<void()>& after_start = {}) {
  MemoryTrace& trace = memory_trace(device);
  trace.clear_events();
  MemorySnapshot start = trace.snapshot();
  trace.set_event_logging(true, 1u << 22);
  if (after_start) after_start();
  {
    Trainer t(cfg);
    t.set_memory_profiling(true);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  trace.set_event_logging(false);
  MemoryProfile p = analyze_memory(trace.events(), start, trace.snapshot(), po);
  trace.clear_events();
  return p;
}

// An empty folder path under the system temp dir, unique per test process.
inline std::string fresh_temp_dir(const std::string& prefix, const std::string& name) {
  std::filesystem::path p =
      std::filesystem::temp_directory_path() / (prefix + "_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  return p.string();
}

}  // namespace kestrel::train::testing
