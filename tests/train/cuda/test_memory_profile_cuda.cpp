// Memory planning and OutOfBudget on the GPU.
// - Plan vs profile per tag within 10% on tiny configurations run on CUDA (VLM and decoder, with and
//   without recompute): parameters, gradients, optimizer state, activations and the CUDA Workspace
//   (the context's cuBLASLt workspace, the fused cross-entropy workspace, the attention and norm
//   backward buffers), and the peak in use. Each case prints its table (the figures in
//   bench/notes/memory_planning.md).
// - A run that goes over its budget: train two steps with checkpoints, resume with a budget that
//   holds the model but not a step, through the library and through the kestrel-train binary; the
//   run fails with the OutOfBudget report, writes memory_report.json, memory.json, memory.html and
//   memory_snapshot.pickle, the binary exits with 3, and the checkpoints stay byte-identical.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "kestrel/models/config.h"
#include "kestrel/cuda/memory.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/token_file.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "support/gpu.h"
#include "../trainer_fixtures.h"
#include "support/temp_dir.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

const Device kGpu = Device::cuda(0);

using kestrel::testing::source_dir;

json quickstart(const std::string& out_dir, int64_t steps, int64_t batch) {
  json cfg = resolve_train_config(models::read_json_file(source_dir() + "/configs/quickstart_vlm.json", "config"),
                                  "quickstart");
  cfg["train"]["steps"] = steps;
  cfg["train"]["batch_size"] = batch;
  cfg["out_dir"] = out_dir;
  cfg["device"] = "cuda";
  cfg["log_every"] = 1000;
  cfg["eval_every"] = 0;
  return cfg;
}

MemoryProfile profile_run(const json& cfg) {
  ProfileOptions po;
  po.viz = false;
  return testing::profile_trainer_run(cfg, kGpu, po);
}

void expect_plan_matches(const json& cfg, const std::string& what) {
  PlanOptions po;
  po.steps = cfg["train"]["steps"];
  MemoryPlan plan = plan_memory(cfg, po);
  MemoryProfile p = profile_run(cfg);
  std::printf("%s: %lld tokens per micro-batch, %s, recompute %s\n", what.c_str(), static_cast<long long>(plan.tokens),
              plan.precision.c_str(), plan.recompute.c_str());
  std::printf("  %-16s %12s %12s %8s\n", "tag", "planned", "measured", "ratio");
  for (int t = 0; t < kNumMemoryTags; ++t) {
    if (plan.tag_peak[t] == 0 && p.tag_peak[t] == 0) continue;
    std::printf("  %-16s %12s %12s %7.1f%%\n", std::string(tag_name(static_cast<MemoryTag>(t))).c_str(),
                format_bytes(plan.tag_peak[t]).c_str(), format_bytes(p.tag_peak[t]).c_str(),
                p.tag_peak[t] ? 100.0 * static_cast<double>(plan.tag_peak[t]) / static_cast<double>(p.tag_peak[t]) : 0.0);
  }
  std::printf("  %-16s %12s %12s %7.1f%%   (planned at %s; measured in %s)\n", "peak in use",
              format_bytes(plan.peak).c_str(), format_bytes(p.peak_in_use).c_str(),
              100.0 * static_cast<double>(plan.peak) / static_cast<double>(p.peak_in_use), plan.peak_where.c_str(),
              p.peak_phase.c_str());
  for (MemoryTag t : {MemoryTag::Parameter, MemoryTag::Gradient, MemoryTag::OptimizerState, MemoryTag::Activation,
                      MemoryTag::Workspace}) {
    const double measured = static_cast<double>(p.tag_peak[static_cast<int>(t)]);
    const double planned = static_cast<double>(plan.tag_peak[static_cast<int>(t)]);
    ASSERT_GT(measured, 0) << what << " " << tag_name(t);
    EXPECT_NEAR(planned / measured, 1.0, 0.10) << what << " " << tag_name(t) << ": planned " << planned
                                                << ", measured " << measured;
  }
  EXPECT_NEAR(static_cast<double>(plan.peak) / static_cast<double>(p.peak_in_use), 1.0, 0.10) << what;
}

TEST(MemoryPlanCuda, MatchesProfileOnQuickstart) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = (fs::temp_directory_path() / "kestrel_mem_cuda_q").string();
  json cfg = quickstart(dir, 2, 32);
  expect_plan_matches(cfg, "quickstart VLM, batch 32");
  cfg["recompute"] = "recompute";
  expect_plan_matches(cfg, "quickstart VLM, batch 32");
  cfg["recompute"] = "selective";
  expect_plan_matches(cfg, "quickstart VLM, batch 32, selective");
  fs::remove_all(dir);
}

TEST(MemoryPlanCuda, MatchesProfileOnSmallerVlm) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = (fs::temp_directory_path() / "kestrel_mem_cuda_s").string();
  json cfg = quickstart(dir, 3, 5);
  cfg["model"]["config"]["text_config"]["num_hidden_layers"] = 1;
  cfg["model"]["config"]["text_config"]["intermediate_size"] = 192;
  cfg["model"]["config"]["vision_config"]["num_hidden_layers"] = 1;
  expect_plan_matches(cfg, "small VLM, batch 5");
  cfg["recompute"] = "recompute";
  expect_plan_matches(cfg, "small VLM, batch 5");
  fs::remove_all(dir);
}

TEST(MemoryPlanCuda, MatchesProfileOnDecoderTokens) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = testing::fresh_temp_dir("kestrel_mem_cuda", "decoder");
  for (bool tied : {false, true}) {
    json text = {{"model_type", "qwen2"}, {"vocab_size", 256}, {"hidden_size", 128}, {"intermediate_size", 352},
                 {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                 {"tie_word_embeddings", tied}};
    json cfg = testing::tiny_decoder_run(dir, text, 400, 13, /*seq_len=*/128, /*batch=*/8, "cuda");
    const std::string name = tied ? "decoder (tied), 8 x 128 tokens" : "decoder, 8 x 128 tokens";
    expect_plan_matches(cfg, name);
    cfg["recompute"] = "recompute";
    expect_plan_matches(cfg, name);
    cfg["recompute"] = "selective";  // attention's out and lse kept per layer, not re-run
    expect_plan_matches(cfg, name + ", selective");
    cfg["train"]["loss_gradient"] = "backward";  // the lse-based backward's workspace instead of the single pass's
    expect_plan_matches(cfg, name + ", selective, loss gradient in backward");
  }
  fs::remove_all(dir);
}

// fp8.enabled (bf16, the planner's FP8 model: X8T kept, the casts' transients, the FP8 state) with
// qkv biases and 1000 tokens (padded to 1008 for the FP8 GEMMs), every recompute setting.
TEST(MemoryPlanCuda, MatchesProfileWithFp8) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = testing::fresh_temp_dir("kestrel_mem_cuda", "fp8");
  json text = {{"model_type", "qwen2"}, {"vocab_size", 256}, {"hidden_size", 128}, {"intermediate_size", 352},
               {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
  json cfg = testing::tiny_decoder_run(dir, text, 400, 13, /*seq_len=*/125, /*batch=*/8, "cuda");
  cfg["precision"] = "bf16";
  cfg["fp8"]["enabled"] = true;
  cfg["mlp_tile_tokens"] = 0;
  for (const char* recompute : {"none", "recompute", "selective"}) {
    cfg["recompute"] = recompute;
    expect_plan_matches(cfg, std::string("decoder fp8, 8 x 125 tokens, ") + recompute);
  }
  fs::remove_all(dir);
}

// Every file under `root` (relative path -> bytes).
std::map<std::string, std::string> read_tree(const std::string& root) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    files[fs::relative(e.path(), root).string()] = ss.str();
  }
  return files;
}

// Names of the files that differ between two trees (added, removed or changed).
std::string tree_diff(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  std::string out;
  for (const auto& [name, bytes] : a)
    if (auto it = b.find(name); it == b.end() || it->second != bytes) out += name + " ";
  for (const auto& [name, bytes] : b)
    if (!a.count(name)) out += name + "(new) ";
  return out;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void remove_reports(const std::string& dir) {
  for (const char* f : {"memory_report.json", "memory.json", "memory.html", "memory_snapshot.pickle"})
    fs::remove(dir + "/" + f);
}

// The reports an OutOfBudget run leaves in its out_dir.
void expect_oom_reports(const std::string& dir, const std::string& how) {
  ASSERT_TRUE(fs::exists(dir + "/memory_report.json")) << how;
  json report = json::parse(read_text(dir + "/memory_report.json"));
  EXPECT_TRUE(report.contains("out_of_budget")) << how;
  ASSERT_TRUE(fs::exists(dir + "/memory.json")) << how << ": the profile of the failing step";
  json mem = json::parse(read_text(dir + "/memory.json"));
  EXPECT_EQ(mem["schema"], "kestrel.memory/1");
  EXPECT_EQ(mem["device"], "cuda:0");
  EXPECT_GT(mem["budget"].get<int64_t>(), 0) << how;
  ASSERT_TRUE(mem["meta"].contains("out_of_budget")) << how;
  EXPECT_NE(mem["meta"]["out_of_budget"].get<std::string>().find("budget"), std::string::npos) << how;
  const std::string html = read_text(dir + "/memory.html");
  EXPECT_NE(html.find("class=\"budget\""), std::string::npos) << how << ": the chart draws the budget line";
  const std::string pickle = read_text(dir + "/memory_snapshot.pickle");
  ASSERT_GT(pickle.size(), 2u) << how;
  EXPECT_EQ(static_cast<uint8_t>(pickle[0]), 0x80);
  EXPECT_NE(pickle.find("oom"), std::string::npos) << how << ": the snapshot records the failed request";
}

std::string find_kestrel_train() {
  if (const char* e = std::getenv("KESTREL_TRAIN_BIN")) return e;
  const fs::path self = fs::read_symlink("/proc/self/exe");  // build/tests/test_train_cuda
  for (const fs::path& p : {self.parent_path().parent_path() / "kestrel-train", self.parent_path() / "kestrel-train"})
    if (fs::exists(p)) return p.string();
  return "";
}

TEST(MemoryOutOfBudgetCuda, ResumeOverBudgetFailsWithReportsAndKeepsTheCheckpoints) {
  KESTREL_REQUIRE_GPU();
  const std::string dir = (fs::temp_directory_path() / "kestrel_oom_cuda").string();
  fs::remove_all(dir);
  json cfg = quickstart(dir, 2, 64);
  cfg["checkpoint_every"] = 1;
  {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  const auto before = read_tree(dir + "/checkpoints");
  ASSERT_FALSE(before.empty());
  remove_reports(dir);

  // 1. The library: the model and AdamW state fit with 16 MiB to spare; a step needs far more.
  // The first run's cached segments go back first: a budget only gates new segments, so memory
  // already reserved would let the step run (lowering a budget does not trim the cache).
  json cfg4 = cfg;
  cfg4["train"]["steps"] = 4;
  int64_t budget = 0;
  std::string what;
  {
    Trainer t(cfg4);
    t.set_log_callback([](const std::string&) {});
    t.resume("latest");
    cuda::release_cached(0);
    budget = device_footprint(kGpu) + (int64_t{16} << 20);
    set_memory_budget(kGpu, budget);
    try {
      t.run();
      ADD_FAILURE() << "the run fitted a budget of " << format_bytes(budget);
    } catch (const OutOfBudget& e) {
      what = e.what();
    }
    set_memory_budget(kGpu, 0);
  }
  std::printf("library run, budget %s: %s\n", format_bytes(budget).c_str(), what.substr(0, what.find('\n')).c_str());
  EXPECT_NE(what.find("budget"), std::string::npos) << what;
  expect_oom_reports(dir, "library");
  EXPECT_EQ(tree_diff(before, read_tree(dir + "/checkpoints")), "") << "the checkpoints are untouched";

  // 2. The binary: exit code 3, the same reports, the checkpoints untouched.
  const std::string bin = find_kestrel_train();
  if (bin.empty()) {
    std::printf("kestrel-train not found (set KESTREL_TRAIN_BIN): the binary check is skipped\n");
    return;
  }
  remove_reports(dir);
  // The binary applies the config's on_cuda overrides (the quickstart's batch 512); the library runs
  // above did not, and resuming a checkpoint under a different batch is refused (checkpoint_io.h). So
  // the file holds the config the checkpoints were made with.
  json file_cfg = cfg4;
  file_cfg["on_cuda"] = json::object();
  // The library run planned its MLP without a budget (set after construction); the binary knows the
  // budget from the start, and mlp_tile_tokens "auto" would tile the MLP to fit it: keep it untiled.
  file_cfg["mlp_tile_tokens"] = 0;
  std::ofstream(dir + "/run.json") << file_cfg.dump(2);
  const std::string log = dir + "/oom.log";
  // A fresh process holds less than the library's (no first run's workspaces), so the same budget
  // can fit a batch-64 step there: the resumed step takes batch 1024 (16x the activations) under it.
  const std::string cmd = bin + " --config " + dir + "/run.json --resume latest --allow-config-change --set " +
                          "train.batch_size=1024 --memory-budget " +
                          std::to_string((budget + (int64_t{8} << 20)) / 1024) + "KiB > " + log + " 2>&1";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << cmd;
  const std::string out = read_text(log);
  EXPECT_EQ(WEXITSTATUS(status), 3) << out;
  EXPECT_NE(out.find("out of the memory budget"), std::string::npos) << out;
  std::printf("kestrel-train exit %d; last lines:\n%s\n", WEXITSTATUS(status),
              out.substr(out.size() > 600 ? out.size() - 600 : 0).c_str());
  expect_oom_reports(dir, "kestrel-train");
  EXPECT_EQ(tree_diff(before, read_tree(dir + "/checkpoints")), "") << "the checkpoints are untouched";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train
