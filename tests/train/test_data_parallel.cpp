// Data parallelism in the trainer with the in-process communicator (threads as ranks): N ranks,
// each with 1/N of every global micro-batch, end with the parameters of one rank with the whole
// batch (within f32 rounding: the full batch's gradient sums rows in another order than the mean of
// the ranks' means), through several optimizer steps with accumulation and small buckets; only
// rank 0 writes out_dir; a resume onto another number of ranks continues the run; the data shard is a pure function of (position, rank, world); refusals;
// and a rank that dies makes every other rank fail within the timeout instead of hanging.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

#include "kestrel/models/safetensors.h"
#include "kestrel/runtime/communicator.h"
#include "kestrel/runtime/dtype.h"
#include "support/errors.h"
#include "train/src/data_parallel.h"
#include "data_parallel_fixtures.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {

using kestrel::testing::error_of;
using kestrel::testing::expect_has;
using testing::dp_run;
using testing::expect_same_parameters;
using testing::final_parameters;
using testing::fresh_temp_dir;
using testing::metric_losses;
using testing::run_group;

TEST(DataParallel, RanksWithSlicesOfTheBatchMatchOneRankWithTheWholeBatch) {
  const std::string dir = fresh_temp_dir("kestrel_dp", "equal");
  for (int64_t accum : {1, 2}) {
    const std::string base = dir + "/accum" + std::to_string(accum);
    {
      Trainer one(dp_run(base + "/one", 4, accum));
      one.set_log_callback([](const std::string&) {});
      one.run();
    }
    const auto want = final_parameters(base + "/one/out");
    const auto want_losses = metric_losses(base + "/one/out");
    for (int world : {2, 4}) {
      const std::string wdir = base + "/w" + std::to_string(world);
      const auto errors = run_group(dp_run(wdir, 4, accum), world, std::chrono::seconds(60));
      for (int r = 0; r < world; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
      // f32 rounding of sums taken in another order, carried through 4 AdamW steps at lr 1e-2.
      expect_same_parameters(final_parameters(wdir + "/out"), want, 2e-5);
      const auto losses = metric_losses(wdir + "/out");
      ASSERT_EQ(losses.size(), want_losses.size());
      for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], want_losses[i], 1e-5 * want_losses[i]);
    }
  }
}

TEST(DataParallel, RanksStartFromRankZerosParameters) {
  // Rank 1 initialises its model from another seed; the start-up broadcast makes it rank 0's.
  const std::string dir = fresh_temp_dir("kestrel_dp", "bcast");
  {
    Trainer one(dp_run(dir + "/one", 4, 1));
    one.set_log_callback([](const std::string&) {});
    one.run();
  }
  const nlohmann::json cfg = dp_run(dir + "/two", 4, 1);
  const auto errors = run_group(cfg, 2, std::chrono::seconds(60), {}, [&](int rank) {
    nlohmann::json c = cfg;
    if (rank == 1) c["train"]["seed"] = 99;
    return c;
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  expect_same_parameters(final_parameters(dir + "/two/out"), final_parameters(dir + "/one/out"), 2e-5);
  // bf16 parameters with an f32 master in AdamW: the master is taken after the broadcast, so the
  // run with rank 1 seeded differently is bit for bit the run with equal seeds.
  std::vector<std::map<std::string, std::vector<float>>> runs;
  for (int seed : {1234, 99}) {
    nlohmann::json c = dp_run(dir + "/bf16_" + std::to_string(seed), 4, 1);
    c["precision"] = "bf16";
    ASSERT_EQ(c["train"]["seed"].get<int>(), 1234);
    for (const auto& e : run_group(c, 2, std::chrono::seconds(60), {}, [&](int rank) {
           nlohmann::json r = c;
           if (rank == 1) r["train"]["seed"] = seed;
           return r;
         }))
      ASSERT_EQ(e, "");
    runs.push_back(final_parameters(dir + "/bf16_" + std::to_string(seed) + "/out"));
  }
  EXPECT_EQ(runs[0], runs[1]);
}

TEST(DataParallel, RunsAreBitIdenticalRunToRun) {
  const std::string dir = fresh_temp_dir("kestrel_dp", "repeat");
  std::vector<std::map<std::string, std::vector<float>>> runs;
  for (int k = 0; k < 2; ++k) {
    const std::string d = dir + "/run" + std::to_string(k);
    const auto errors = run_group(dp_run(d, 6, 1), 3, std::chrono::seconds(60));
    for (const auto& e : errors) ASSERT_EQ(e, "");
    runs.push_back(final_parameters(d + "/out"));
  }
  EXPECT_EQ(runs[0], runs[1]);
}

TEST(DataParallel, OnlyRankZeroWritesTheOutputFolder) {
  const std::string dir = fresh_temp_dir("kestrel_dp", "writer");
  nlohmann::json cfg = dp_run(dir, 4, 1);
  cfg["out_dir"] = dir + "/out";
  std::vector<std::string> errors = run_group(cfg, 2, std::chrono::seconds(60));
  for (const auto& e : errors) ASSERT_EQ(e, "");
  EXPECT_EQ(metric_losses(dir + "/out").size(), 4u);  // one line per step, not one per rank
  EXPECT_TRUE(std::filesystem::exists(dir + "/out/checkpoints/step_00000004/manifest.json"));
}

TEST(DataParallel, ResumingOntoAnotherNumberOfRanksContinuesTheSameRun) {
  // 2 ranks train to step 2 (checkpoint), then 4 ranks and 1 rank each resume from it to step 4:
  // the data position is counted in global micro-batches, so all continue the one-rank run.
  const std::string dir = fresh_temp_dir("kestrel_dp", "reshard");
  nlohmann::json cfg = dp_run(dir + "/one", 4, 1);
  cfg["checkpoint_every"] = 2;
  {
    Trainer one(cfg);
    one.set_log_callback([](const std::string&) {});
    one.run();
  }
  const auto want = final_parameters(dir + "/one/out");
  nlohmann::json two = cfg;
  two["out_dir"] = dir + "/two";
  for (const auto& e : run_group(two, 2, std::chrono::seconds(60))) ASSERT_EQ(e, "");
  const std::string step2 = dir + "/two/checkpoints/step_00000002";
  ASSERT_TRUE(std::filesystem::exists(step2 + "/manifest.json"));
  nlohmann::json four = cfg;
  four["out_dir"] = dir + "/four";
  const auto errors = run_group(four, 4, std::chrono::seconds(60), [&](int, Trainer& t) {
    t.resume(step2);
    t.run();
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  expect_same_parameters(final_parameters(dir + "/four"), want, 2e-5);
  nlohmann::json single = cfg;
  single["out_dir"] = dir + "/single";
  {
    Trainer t(single);
    t.set_log_callback([](const std::string&) {});
    t.resume(step2);
    t.run();
  }
  expect_same_parameters(final_parameters(dir + "/single"), want, 2e-5);
}

TEST(DataParallel, TheShardIsAPureFunctionOfPositionRankAndWorld) {
  // World w, rank r takes task micro-batch position * w + r at batch / w rows: rows
  // [position * batch + r * batch / w, ...) of the one-rank run's numbering.
  for (int w : {1, 2, 3, 4})
    for (int r = 0; r < w; ++r)
      for (uint64_t pos : {0ull, 1ull, 7ull, 1000ull}) {
        DataShard s{r, w};
        const int64_t local = 12 / w;
        EXPECT_EQ(s.index(pos) * static_cast<uint64_t>(local), pos * 12 + static_cast<uint64_t>(r * local));
      }
}

TEST(DataParallel, RefusesWhatIsNotBuilt) {
  const std::string dir = fresh_temp_dir("kestrel_dp", "refuse");
  nlohmann::json cfg = dp_run(dir, 4, 1);
  auto first_error = [&](nlohmann::json c, int world) {
    for (const auto& e : run_group(c, world, std::chrono::seconds(10)))
      if (!e.empty()) return e;
    return std::string();
  };
  nlohmann::json zero = cfg;
  zero["distributed"]["zero"] = 3;
  expect_has(first_error(zero, 2), {"distributed.zero", "got 3", "ZeRO-3", "not built"});
  expect_has(first_error(cfg, 3), {"train.batch_size 4", "3 ranks"});
  nlohmann::json sib = cfg;
  sib["optimizer"]["step_in_backward"] = true;
  sib["train"]["grad_clip"] = 0;
  expect_has(first_error(sib, 2), {"step_in_backward", "not built"});
  nlohmann::json set = cfg;  // the keys take what a user types
  apply_override(set, "distributed.bucket_mib=0.5");
  apply_override(set, "distributed.timeout_s=2.5");
  EXPECT_EQ(set["distributed"]["bucket_mib"].get<double>(), 0.5);
  expect_has(error_of([&] { apply_override(set, "distributed.zero=0.5"); }), {"distributed.zero"});
  nlohmann::json nccl_cpu = cfg;  // Trainer(config) connects from the launcher's variables
  nccl_cpu["distributed"]["backend"] = "nccl";
  expect_has(error_of([&] { Trainer t(nccl_cpu); }), {"NCCL", "the device is cpu"});
  nlohmann::json backend = cfg;
  backend["distributed"]["backend"] = "mpi";
  expect_has(error_of([&] { Trainer t(backend); }), {"distributed.backend", "'mpi'"});
}

TEST(DataParallel, ADeadRankFailsTheOthersWithinTheTimeout) {
  const std::string dir = fresh_temp_dir("kestrel_dp", "dead");
  const auto start = std::chrono::steady_clock::now();
  // Rank 1 builds its trainer and then never trains (a process that hung or died silently).
  const auto errors = run_group(dp_run(dir, 4, 1), 2, std::chrono::milliseconds(500), [](int rank, Trainer& t) {
    if (rank == 0) t.run();
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(secs, 20.0);
  expect_has(errors[0], {"[comm] all_reduce", "timed out", "rank(s) 1"});
  EXPECT_EQ(errors[1], "");
}

TEST(DataParallel, AFailingRankEndsTheRunOnEveryRankWithItsMessage) {
  const std::string dir = fresh_temp_dir("kestrel_dp", "fail");
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_group(dp_run(dir, 4, 1), 2, std::chrono::seconds(60), [](int rank, Trainer& t) {
    if (rank == 1) throw make_error("test", "rank 1 lost its data");
    t.run();
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 20.0);
  expect_has(errors[0], {"aborted", "rank 1 lost its data"});
}

}  // namespace
}  // namespace kestrel::train
