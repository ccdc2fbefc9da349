// ZeRO-1/2 (distributed.zero) with the in-process communicator (threads as ranks): 2, 4 and 8
// ranks at every stage end within f32 rounding of one rank with the whole batch; at one world size
// stage 1 is bit for bit stage 0 (the same all-reduce, norm and update; only where AdamW runs
// differs) and so is stage 2 without clipping (the reduce gives the owner the all-reduce's bits);
// with clipping stage 2's norm sums the ranks' partials in another order (a stated bound). With
// the host offload each rank offloads its shard, bit for bit the zero-0 offloaded run. Parameter ownership is
// contiguous and balanced. Checkpoints hold the optimizer state per shard (an incomplete shard set
// is not trusted) and resume onto another world size (and stage). kestrel-mem's plan is per GPU.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "data_parallel_fixtures.h"
#include "kestrel/models/config.h"
#include "kestrel/models/safetensors.h"
#include "support/errors.h"
#include "kestrel/train/memory_plan.h"
#include "train/src/checkpoint_io.h"
#include "train/src/zero.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {

using testing::dp_run;
using testing::expect_same_parameters;
using testing::final_parameters;
using testing::fresh_temp_dir;
using testing::run_group;
using Params = std::map<std::string, std::vector<float>>;

Params run_world(const nlohmann::json& base, const std::string& dir, int world, int zero) {
  nlohmann::json cfg = base;
  cfg["out_dir"] = dir;
  cfg["distributed"]["zero"] = zero;
  if (world == 1) {
    Trainer t(cfg);
    t.set_log_callback([](const std::string&) {});
    t.run();
  } else {
    const auto errors = run_group(cfg, world, std::chrono::seconds(120));
    for (int r = 0; r < world; ++r) EXPECT_EQ(errors[r], "") << "rank " << r << " of " << world << ", zero " << zero;
  }
  return final_parameters(dir);
}

TEST(Zero, OwnershipIsContiguousAndBalanced) {
  std::vector<Tensor> storage;
  std::mt19937_64 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    storage.clear();
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) storage.push_back(Tensor::zeros({1 + static_cast<int64_t>(rng() % 300)}));
    models::ParameterList params;
    int64_t biggest = 0;
    for (int i = 0; i < n; ++i) {
      params.add("p" + std::to_string(i), &storage[i]);
      biggest = std::max(biggest, storage[i].numel());
    }
    for (int world : {1, 2, 3, 4, 8}) {
      const std::vector<int> owners = assign_parameter_owners(params, world);
      ASSERT_EQ(owners.size(), params.size());
      std::vector<int64_t> load(world, 0);
      for (int i = 0; i < n; ++i) {
        ASSERT_GE(owners[i], 0);
        ASSERT_LT(owners[i], world);
        if (i > 0) ASSERT_GE(owners[i], owners[i - 1]) << "contiguous runs";
        load[owners[i]] += storage[i].numel();
      }
      const double even = static_cast<double>(params.numel()) / world;
      for (int r = 0; r < world; ++r) EXPECT_LE(std::fabs(load[r] - even), biggest) << "rank " << r << " of " << world;
      int64_t owned = 0;
      for (int r = 0; r < world; ++r) owned += owned_parameters(params, owners, r).numel();
      EXPECT_EQ(owned, params.numel());
    }
  }
}

// Frozen parameters (train.trainable) hold no AdamW state and no gradient: the balance is over
// the trainable elements, else with the frozen half of a model first every trainable element would
// land on the last ranks (2/W of the state each, where kestrel-mem plans 1/W).
TEST(Zero, OwnershipBalancesTheTrainableElements) {
  std::vector<Tensor> storage;
  for (int i = 0; i < 8; ++i) storage.push_back(Tensor::zeros({100}));
  models::ParameterList params;
  for (int i = 0; i < 8; ++i) {
    storage[i].set_requires_grad(i >= 4);  // a frozen tower first, the trained half after it
    params.add("p" + std::to_string(i), &storage[i]);
  }
  for (int world : {2, 4}) {
    const std::vector<int> owners = assign_parameter_owners(params, world);
    std::vector<int64_t> load(world, 0);
    for (int i = 0; i < 8; ++i) {
      if (i > 0) ASSERT_GE(owners[i], owners[i - 1]) << "contiguous runs";
      if (storage[i].requires_grad()) load[owners[i]] += storage[i].numel();
    }
    for (int r = 0; r < world; ++r) EXPECT_EQ(load[r], 400 / world) << "rank " << r << " of " << world;
  }
}

TEST(Zero, EveryStageOnTwoFourAndEightRanksMatchesOneRank) {
  const std::string dir = fresh_temp_dir("kestrel_zero", "equal");
  nlohmann::json cfg = dp_run(dir, 8, 1);
  cfg["train"]["grad_clip"] = 0.0;
  const Params want = run_world(cfg, dir + "/one", 1, 0);
  for (int world : {2, 4, 8}) {
    const std::string w = dir + "/w" + std::to_string(world);
    const Params z0 = run_world(cfg, w + "_z0", world, 0);
    // f32 rounding of sums taken in another order, carried through 4 AdamW steps at lr 1e-2.
    expect_same_parameters(z0, want, 2e-5);
    for (int zero : {1, 2}) {
      const Params z = run_world(cfg, w + "_z" + std::to_string(zero), world, zero);
      EXPECT_EQ(z, z0) << "zero " << zero << " on " << world << " ranks is not bit for bit zero 0";
      expect_same_parameters(z, want, 2e-5);
    }
  }
}

TEST(Zero, ClippingStaysExactWithAccumulation) {
  // grad_clip small enough to clip every step; two micro-batches per step.
  const std::string dir = fresh_temp_dir("kestrel_zero", "clip");
  nlohmann::json cfg = dp_run(dir, 4, 2);
  cfg["train"]["grad_clip"] = 0.05;
  const Params want = run_world(cfg, dir + "/one", 1, 0);
  for (int world : {2, 4}) {
    const std::string w = dir + "/w" + std::to_string(world);
    const Params z0 = run_world(cfg, w + "_z0", world, 0);
    expect_same_parameters(z0, want, 2e-5);
    EXPECT_EQ(run_world(cfg, w + "_z1", world, 1), z0) << "zero 1 on " << world << " ranks";
    // The norm from the ranks' squared partials: f32 sums in another order (a few ulps of the
    // clip factor), within 1e-6 relative after 4 steps.
    expect_same_parameters(run_world(cfg, w + "_z2", world, 2), z0, 1e-6);
  }
}

TEST(Zero, EachRankOffloadsOnlyItsShard) {
  // optimizer.offload=host: each rank's AdamW (its shard) lives in host memory; the run is bit for
  // bit the zero-0 run with the same offload, and within f32 rounding of the on-device update.
  const std::string dir = fresh_temp_dir("kestrel_zero", "offload");
  nlohmann::json cfg = dp_run(dir, 4, 1);
  cfg["train"]["grad_clip"] = 0.0;  // stage 2's clip norm is summed in another order
  const Params device = run_world(cfg, dir + "/device", 2, 0);
  nlohmann::json host = cfg;
  host["optimizer"]["offload"] = "host";
  const Params z0 = run_world(host, dir + "/z0", 2, 0);
  expect_same_parameters(z0, device, 1e-6);
  for (int zero : {1, 2}) EXPECT_EQ(run_world(host, dir + "/host_z" + std::to_string(zero), 2, zero), z0) << zero;
}

// The optimizer files of a checkpoint and the tensor names each holds.
std::map<std::string, std::vector<std::string>> optimizer_files(const std::string& ckpt) {
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("optimizer", 0) == 0) out[n] = models::SafetensorsReader::open(e.path().string()).names();
  }
  return out;
}

TEST(Zero, CheckpointsHoldOneShardPerRankAndResumeOntoAnotherWorld) {
  // 4 ranks at zero 2 train to step 2 (checkpoint), then 2 ranks at zero 1, 8 ranks at zero 2 and
  // one rank resume from it to step 4: all continue the uninterrupted one-rank run.
  const std::string dir = fresh_temp_dir("kestrel_zero", "reshard");
  nlohmann::json cfg = dp_run(dir, 8, 1);
  cfg["checkpoint_every"] = 2;
  const Params want = run_world(cfg, dir + "/one", 1, 0);
  run_world(cfg, dir + "/four", 4, 2);
  const std::string step2 = dir + "/four/checkpoints/step_00000002";
  ASSERT_TRUE(std::filesystem::exists(step2 + "/manifest.json"));
  const auto files = optimizer_files(step2);
  ASSERT_EQ(files.size(), 4u) << "one optimizer file per rank";
  size_t names = 0;
  for (int r = 0; r < 4; ++r) {
    const std::string f = "optimizer-0000" + std::to_string(r) + "-of-00004.safetensors";
    ASSERT_TRUE(files.count(f)) << f;
    names += files.at(f).size();
  }
  {
    // A shard set missing one shard (dropped from the manifest as well as the folder) is not trusted.
    const std::string copy = dir + "/damaged/checkpoints/step_00000002";
    std::filesystem::create_directories(dir + "/damaged/checkpoints");
    std::filesystem::copy(step2, copy, std::filesystem::copy_options::recursive);
    EXPECT_EQ(verify_checkpoint(copy), "");
    nlohmann::json m = models::read_json_file(copy + "/manifest.json", "test");
    m["files"].erase("optimizer-00001-of-00004.safetensors");
    models::write_json_file(copy + "/manifest.json", m, "test");
    std::filesystem::remove(copy + "/optimizer-00001-of-00004.safetensors");
    kestrel::testing::expect_has(verify_checkpoint(copy), {"3 of the 4 optimizer shards"});
    // Rank 2 listed twice under another spelling in place of rank 1: not four ranks.
    std::filesystem::copy_file(copy + "/optimizer-00002-of-00004.safetensors", copy + "/optimizer-2-of-4.safetensors");
    m["files"]["optimizer-2-of-4.safetensors"] = m["files"]["optimizer-00002-of-00004.safetensors"];
    models::write_json_file(copy + "/manifest.json", m, "test");
    kestrel::testing::expect_has(verify_checkpoint(copy), {"optimizer-2-of-4.safetensors", "not a shard"});
  }
  const auto whole = optimizer_files(dir + "/one/checkpoints/step_00000002");
  ASSERT_EQ(whole.size(), 1u);
  EXPECT_EQ(names, whole.at("optimizer.safetensors").size()) << "the shards hold the state once, between them";
  for (auto [world, zero] : {std::pair{2, 1}, std::pair{8, 2}, std::pair{1, 0}}) {
    nlohmann::json c = cfg;
    const std::string out = dir + "/resume_w" + std::to_string(world);
    c["out_dir"] = out;
    c["distributed"]["zero"] = zero;
    if (world == 1) {
      Trainer t(c);
      t.set_log_callback([](const std::string&) {});
      t.resume(step2);
      t.run();
    } else {
      for (const auto& e : run_group(c, world, std::chrono::seconds(120), [&](int, Trainer& t) {
             t.resume(step2);
             t.run();
           }))
        ASSERT_EQ(e, "");
    }
    expect_same_parameters(final_parameters(out), want, 2e-5);
  }
}

TEST(Zero, ThePlanIsPerGpu) {
  // kestrel-mem plan --world-size W: one rank's batch share; ZeRO-1 divides the optimizer state by
  // W, ZeRO-2 the kept gradients too; the buckets' flat copies are counted.
  const std::string dir = fresh_temp_dir("kestrel_zero", "plan");
  nlohmann::json cfg = dp_run(dir, 8, 1);
  PlanOptions one;
  const MemoryPlan p1 = plan_memory(cfg, one);
  const auto tag = [](const MemoryPlan& p, MemoryTag t) { return p.tag_peak[static_cast<int>(t)]; };
  for (int64_t world : {2, 4, 8}) {
    PlanOptions po;
    po.world_size = world;
    std::map<int, MemoryPlan> by_zero;
    for (int zero : {0, 1, 2}) {
      nlohmann::json c = cfg;
      c["distributed"]["zero"] = zero;
      by_zero[zero] = plan_memory(c, po);
      EXPECT_EQ(by_zero[zero].world_size, world);
      EXPECT_EQ(by_zero[zero].zero, zero);
      EXPECT_EQ(by_zero[zero].tokens * world, p1.tokens) << "one rank's share of the micro-batch";
    }
    const int64_t state = tag(p1, MemoryTag::OptimizerState);
    EXPECT_EQ(tag(by_zero[0], MemoryTag::OptimizerState), state);
    EXPECT_NEAR(static_cast<double>(tag(by_zero[1], MemoryTag::OptimizerState)), static_cast<double>(state) / world, 1.0);
    EXPECT_EQ(tag(by_zero[2], MemoryTag::OptimizerState), tag(by_zero[1], MemoryTag::OptimizerState));
    EXPECT_EQ(tag(by_zero[1], MemoryTag::Gradient), tag(by_zero[0], MemoryTag::Gradient));
    EXPECT_LT(tag(by_zero[2], MemoryTag::Gradient), tag(by_zero[1], MemoryTag::Gradient));
    EXPECT_GT(tag(by_zero[0], MemoryTag::Gradient), tag(p1, MemoryTag::Gradient) / 2) << "the flat copies";
    EXPECT_LE(by_zero[2].peak, by_zero[1].peak);  // a tiny model peaks in its activations
    EXPECT_LT(by_zero[1].peak, by_zero[0].peak);
  }
  PlanOptions bad;
  bad.world_size = 3;
  EXPECT_THROW(plan_memory(cfg, bad), Error);
}

}  // namespace
}  // namespace kestrel::train
