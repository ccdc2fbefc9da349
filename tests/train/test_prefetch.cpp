// Loading overlapped with compute: the prefetcher hands out exactly prepare(index) in order, after
// jumps and after a failed batch; a run with prefetching resumes exactly (the checkpoint stores the
// data position of the next batch consumed, not of the prefetched ones) and matches a run without;
// periodic greedy samples and per-device settings.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "train/src/batch_prefetcher.h"
#include "kestrel/models/config.h"
#include "kestrel/runtime/error.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "kestrel/train/vlm_data.h"
#include "trainer_fixtures.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

HostBatch numbered(uint64_t index) {
  std::this_thread::sleep_for(std::chrono::microseconds(200 + (index * 37) % 300));  // uneven preparation times
  std::vector<int64_t> v(5);
  for (int i = 0; i < 5; ++i) v[static_cast<size_t>(i)] = static_cast<int64_t>(index * 1000 + static_cast<uint64_t>(i) * 7 + 3);
  HostBatch b;
  b.tokens = static_cast<int64_t>(index);
  b.arrays.push_back(host_array(v, {5}, DType::I64));
  return b;
}

void expect_batch(BatchPrefetcher& p, uint64_t index) {
  BatchPrefetcher::Batch b = p.get(index);
  ASSERT_EQ(b.host->index, index);
  ASSERT_EQ(b.arrays.size(), 1u);
  std::vector<int64_t> got = b.arrays[0].to_int_vector(), want(5);
  for (int i = 0; i < 5; ++i) want[static_cast<size_t>(i)] = static_cast<int64_t>(index * 1000 + static_cast<uint64_t>(i) * 7 + 3);
  EXPECT_EQ(got, want) << "index " << index;
}

TEST(Prefetch, HandsOutPrepareOfEachIndexInOrderAndAfterJumps) {
  for (auto [depth, threads] : {std::pair{0, 1}, {1, 1}, {3, 1}, {4, 3}}) {
    BatchPrefetcher p(numbered, Device::cpu(), depth, threads);
    for (uint64_t i = 5; i < 25; ++i) expect_batch(p, i);
    expect_batch(p, 400);  // a jump ahead drops what was prepared
    expect_batch(p, 401);
    expect_batch(p, 2);    // and back
    expect_batch(p, 3);
    if (depth > 0) EXPECT_GE(p.stats().prepared, 24);
  }
}

TEST(Prefetch, ErrorsReachTheConsumerForTheirIndex) {
  auto prepare = [](uint64_t index) {
    KESTREL_CHECK(index != 7, "test", "no batch 7");
    return numbered(index);
  };
  for (int threads : {1, 2}) {
    BatchPrefetcher p(prepare, Device::cpu(), 2, threads);
    for (uint64_t i = 0; i < 7; ++i) expect_batch(p, i);
    EXPECT_THROW(p.get(7), Error);
    EXPECT_THROW(p.get(7), Error);  // retried, fails again
    expect_batch(p, 8);
    expect_batch(p, 9);
  }
}

TEST(Prefetch, HostBatchesCarryPixelsInTheModelDtype) {
  // Pixels are rounded to bf16 / f16 on the host (so they travel and live on the device at 2 bytes);
  // the values must equal the runtime's own cast of the f32 pixels.
  ShapesConfig sc;
  sc.image_size = 16;
  sc.seed = 5;
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
    ShapesVlmData data(sc, 4, Device::cpu(), dt);
    models::VlmBatch b = data.batch(3, 2);
    EXPECT_EQ(b.pixel_values.dtype(), dt);
    Tensor ref = data.pixels(3, 2);  // Tensor::from_vector(f32 values, dtype)
    EXPECT_EQ(b.pixel_values.to_float_vector(), ref.to_float_vector()) << dtype_name(dt);
  }
}

json tiny_run(const std::string& out_dir, int64_t steps, int64_t prefetch) {
  return testing::tiny_vlm_run(out_dir, {{"steps", steps}, {"batch_size", 3}, {"grad_accum", 2}},
                               {{"prefetch", prefetch}});
}
std::vector<double> losses(const std::string& out_dir) { return testing::metric_losses(out_dir); }
std::string prefetch_tmp(const std::string& n) { return testing::fresh_temp_dir("kestrel_prefetch", n); }

TEST(Prefetch, ResumeIsExactWithPrefetching) {
  const std::string a = prefetch_tmp("inline"), b = prefetch_tmp("prefetched");
  {
    Trainer t(tiny_run(a, 12, 0));  // no prefetching, straight through
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  {
    json c = tiny_run(b, 12, 3);  // prefetching 3 ahead on 2 threads, checkpoints at 6 and 12
    c["prefetch_threads"] = 2;
    c["checkpoint_every"] = 6;
    Trainer t(c);
    t.set_log_callback([](const std::string&) {});
    t.run();
  }
  const std::vector<double> straight = losses(a), prefetched = losses(b);
  ASSERT_EQ(straight.size(), 12u);
  ASSERT_EQ(prefetched.size(), 12u);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(straight[i], prefetched[i]) << "step " << i + 1;
  // The checkpoint at step 6 holds the next micro-batch the model consumes: 6 steps x 2 micro-batches,
  // though the prefetcher had prepared up to 3 beyond it.
  json st = models::read_json_file(b + "/checkpoints/step_00000006/trainer_state.json", "test");
  EXPECT_EQ(st["data_position"].get<int64_t>(), 12);
  // Cut back to step 6 and resume with prefetching: the same last 6 losses.
  fs::remove_all(fs::path(b) / "checkpoints" / "step_00000012");
  {
    std::ofstream f(b + "/metrics.jsonl", std::ios::trunc);
    for (int i = 0; i < 6; ++i) f << json{{"loss", prefetched[static_cast<size_t>(i)]}}.dump() << "\n";
  }
  {
    Trainer t(tiny_run(b, 12, 3));
    std::vector<std::string> lines;
    t.set_log_callback([&](const std::string& s) { lines.push_back(s); });
    t.resume("latest");
    t.run();
    EXPECT_NE(lines.front().find("data position 12"), std::string::npos) << lines.front();
  }
  const std::vector<double> resumed = losses(b);
  ASSERT_EQ(resumed.size(), 12u);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(straight[i], resumed[i]) << "step " << i + 1;
  fs::remove_all(a);
  fs::remove_all(b);
}

TEST(Trainer, PeriodicGreedySamples) {
  const std::string d = prefetch_tmp("samples");
  json c = tiny_run(d, 4, 2);
  c["sample_every"] = 2;
  c["sample_count"] = 2;
  Trainer t(c);
  std::vector<std::string> samples;
  t.set_log_callback([&](const std::string& s) {
    if (s.rfind("sample @", 0) == 0) samples.push_back(s);
  });
  t.run();
  // At step 2 only (not at the last step, where the final evaluation reports), two images.
  ASSERT_EQ(samples.size(), 2u);
  for (const std::string& s : samples) {
    EXPECT_EQ(s.rfind("sample @ 2: ", 0), 0u) << s;
    EXPECT_NE(s.find("expected \"a "), std::string::npos) << s;  // a true shapes caption
    EXPECT_NE(s.find("generated \""), std::string::npos) << s;
  }
  fs::remove_all(d);
}

TEST(TrainConfig, DeviceOverridesApplyOnTheirDeviceAndSetWins) {
  json user = {{"train", {{"steps", 100}}},
               {"on_cpu", {{"train.steps", 7}, {"train.batch_size", 5}}},
               {"on_cuda", {{"train.steps", 9000}, {"precision", "bf16"}}}};
  json c = resolve_train_config(user, "run.json");
  json cpu = c;
  auto applied = apply_device_overrides(cpu, /*on_cuda=*/false);
  EXPECT_EQ(applied.size(), 2u);
  EXPECT_EQ(cpu["train"]["steps"].get<int64_t>(), 7);
  EXPECT_EQ(cpu["train"]["batch_size"].get<int64_t>(), 5);
  EXPECT_EQ(cpu["precision"], "auto");
  EXPECT_TRUE(cpu["on_cpu"].empty() && cpu["on_cuda"].empty());
  json gpu = c;
  apply_device_overrides(gpu, /*on_cuda=*/true, {"train.steps=11"});
  EXPECT_EQ(gpu["train"]["steps"].get<int64_t>(), 11);  // --set wins
  EXPECT_EQ(gpu["precision"], "bf16");
  json bad = resolve_train_config(json{{"on_cpu", {{"train.stepz", 1}}}}, "run.json");
  EXPECT_THROW(apply_device_overrides(bad, false), Error);  // the entries are checked like --set
  EXPECT_THROW(resolve_train_config(json{{"on_cpu", 3}}, "run.json"), Error);
}

}  // namespace
}  // namespace kestrel::train
