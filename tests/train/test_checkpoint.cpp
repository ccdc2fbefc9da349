// Checkpoints that can be trusted (issue 18): each test is the failure it prevents. Tiny CPU VLM
// runs of a few steps (trainer_fixtures.h).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iterator>
#include <thread>

#include "kestrel/runtime/error.h"
#include "kestrel/train/trainer.h"
#include "train/src/checkpoint_io.h"
#include "train/src/checkpoint_manifest.h"
#include "train/src/xxhash64.h"
#include "trainer_fixtures.h"
#include "support/errors.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::string checkpoint_tmp(const std::string& n) { return testing::fresh_temp_dir("kestrel_ckpt", n); }

// `steps` steps with a checkpoint every `every` steps, all kept; `extra` overrides top-level keys.
json run_cfg(const std::string& out, int64_t steps, int64_t every, const json& extra = json::object(),
             const json& train = json::object()) {
  json t = {{"steps", steps}, {"batch_size", 2}};
  t.update(train);
  json e = {{"checkpoint_every", every}, {"keep_checkpoints", 0}, {"prefetch", 0}};
  e.update(extra);
  return testing::tiny_vlm_run(out, t, e);
}

struct Logged {
  std::vector<std::string> lines;
  bool has(const std::string& s) const {
    for (const std::string& l : lines)
      if (l.find(s) != std::string::npos) return true;
    return false;
  }
};

TrainSummary train(const json& cfg, const std::string& resume = "", Logged* log = nullptr,
                   ResumeOptions opt = {}, bool overwrite = false) {
  Trainer t(cfg);
  t.set_log_callback([log](const std::string& s) {
    if (log) log->lines.push_back(s);
  });
  t.set_overwrite_out_dir(overwrite);
  t.resume(resume, opt);
  return t.run();
}

using kestrel::testing::error_of;

std::string ckpt(const std::string& out, int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return (fs::path(out) / "checkpoints" / buf).string();
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

void flip_last_byte(const fs::path& p) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-1, std::ios::end);
  char c;
  f.get(c);
  f.seekp(-1, std::ios::end);
  f.put(static_cast<char>(c ^ 0x10));
}

TEST(Xxhash64, KnownAnswers) {
  auto h = [](const char* s) { return xxhash64_hex(xxhash64(s, std::strlen(s))); };
  EXPECT_EQ(h(""), "ef46db3751d8e999");
  EXPECT_EQ(h("a"), "d24ec4f1a98c6e5b");
  EXPECT_EQ(h("abc"), "44bc2cf5ad770999");
  EXPECT_EQ(h("Nobody inspects the spammish repetition"), "fbcea83c8a378bf1");  // > 32 bytes: the stripe loop
}

// Flipped bits in optimizer data used to resume silently (the loss went to NaN, exit 0).
TEST(Checkpoint, FlippedByteIsRefusedNamingTheFileAndLatestFallsBack) {
  std::string out = checkpoint_tmp("flip");
  train(run_cfg(out, 4, 2));
  ASSERT_TRUE(verify_checkpoint(ckpt(out, 4)).empty()) << verify_checkpoint(ckpt(out, 4));
  flip_last_byte(fs::path(ckpt(out, 4)) / "optimizer.safetensors");
  std::string m = error_of([&] { train(run_cfg(out, 6, 2), ckpt(out, 4)); });
  EXPECT_NE(m.find("optimizer.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("checksum"), std::string::npos) << m;
  // `latest` skips it, says so, and continues from step 2.
  Logged log;
  TrainSummary s = train(run_cfg(out, 6, 2), "latest", &log);
  EXPECT_TRUE(log.has("step_00000004 skipped")) << log.lines.front();
  EXPECT_TRUE(log.has("falling back to " + ckpt(out, 2)));
  EXPECT_TRUE(fs::exists(ckpt(out, 4) + ".damaged"));  // set aside, not counted, not pruned
  EXPECT_TRUE(verify_checkpoint(ckpt(out, 4)).empty());  // written again by the resumed run
  EXPECT_EQ(s.steps, 4);
  EXPECT_TRUE(std::isfinite(s.last_loss));
  fs::remove_all(out);
}

// A kill while the old code pruned (remove_all) left a step folder without its optimizer state that
// still counted as complete; --resume latest then failed instead of falling back.
TEST(Checkpoint, HalfDeletedFolderIsSkippedAndLeftoversAreCleaned) {
  std::string out = checkpoint_tmp("prune");
  train(run_cfg(out, 4, 2));
  fs::remove(fs::path(ckpt(out, 4)) / "optimizer.safetensors");
  EXPECT_EQ(latest_checkpoint(out), ckpt(out, 2));
  std::vector<SkippedCheckpoint> skipped;
  latest_checkpoint(out, &skipped);
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].problem.find("optimizer.safetensors is missing"), std::string::npos) << skipped[0].problem;
  // What a kill leaves with the rename-first scheme: a temp folder, a half-deleted hidden folder,
  // and a replaced folder renamed away before its replacement moved in.
  fs::path root = fs::path(out) / "checkpoints";
  fs::create_directories(root / ".step_00000006.tmp");
  fs::create_directories(root / ".step_00000004.deleting");
  fs::rename(ckpt(out, 2), root / ".step_00000002.old");
  std::vector<std::string> done = clean_checkpoint_leftovers(out);
  EXPECT_EQ(done.size(), 3u);
  EXPECT_FALSE(fs::exists(root / ".step_00000006.tmp"));
  EXPECT_FALSE(fs::exists(root / ".step_00000004.deleting"));
  EXPECT_TRUE(verify_checkpoint(ckpt(out, 2)).empty());  // restored
  fs::remove_all(out);
}

// Pruning keeps exactly `keep` intact folders and never leaves hidden leftovers.
TEST(Checkpoint, PruningRenamesFirst) {
  std::string out = checkpoint_tmp("keep");
  train(run_cfg(out, 6, 1, {{"keep_checkpoints", 2}}));
  std::vector<std::string> all = checkpoint_folders(out);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0], ckpt(out, 5));
  EXPECT_EQ(all[1], ckpt(out, 6));
  for (auto& e : fs::directory_iterator(fs::path(out) / "checkpoints"))
    EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
  fs::remove_all(out);
}

// The step in the folder name, the manifest and trainer_state.json must agree.
TEST(Checkpoint, RenamedFolderIsNotTrusted) {
  std::string out = checkpoint_tmp("renamed");
  train(run_cfg(out, 2, 2));
  fs::rename(ckpt(out, 2), ckpt(out, 8));
  std::string p = verify_checkpoint(ckpt(out, 8));
  EXPECT_NE(p.find("named for step 8"), std::string::npos) << p;
  fs::remove_all(out);
}

// Inside a checkpoint, an index pointing at another step's weights resumed silently with them, even
// when the manifest was rewritten to match.
TEST(Checkpoint, IndexPointingOutsideTheFolderIsNotTrusted) {
  std::string out = checkpoint_tmp("index");
  train(run_cfg(out, 4, 2));
  fs::path d = ckpt(out, 4);
  fs::remove(d / "model.safetensors");
  fs::remove(d / "manifest.json");
  json idx = {{"metadata", json::object()}, {"weight_map", {{"model.embed_tokens.weight", "../step_00000002/model.safetensors"}}}};
  std::ofstream(d / "model.safetensors.index.json") << idx.dump();
  write_checkpoint_manifest(d.string(), 4, 4, "full");
  std::string p = verify_checkpoint(d.string());
  EXPECT_NE(p.find("../step_00000002/model.safetensors"), std::string::npos) << p;
  EXPECT_NE(p.find("not a file of this checkpoint"), std::string::npos) << p;
  EXPECT_EQ(latest_checkpoint(out), ckpt(out, 2));
  fs::remove_all(out);
}

// --resume into a different config continued silently; now it names the differences and refuses.
TEST(Checkpoint, ResumeIntoADifferentConfigIsRefused) {
  std::string out = checkpoint_tmp("config");
  train(run_cfg(out, 2, 2));
  std::string m = error_of([&] { train(run_cfg(out, 4, 2, json::object(), {{"lr", 1e-2}}), "latest"); });
  EXPECT_NE(m.find("train.lr: saved 0.003, now 0.01"), std::string::npos) << m;
  EXPECT_NE(m.find("--allow-config-change"), std::string::npos) << m;
  // A longer run (train.steps) and other logging/checkpoint settings are not differences.
  Logged log;
  TrainSummary s = train(run_cfg(out, 3, 3, {{"log_every", 7}}), "latest", &log);
  EXPECT_EQ(s.steps, 1);
  // Told to, it resumes and logs what differs.
  log.lines.clear();
  train(run_cfg(out, 4, 4, json::object(), {{"lr", 1e-2}}), "latest", &log, ResumeOptions{true});
  EXPECT_TRUE(log.has("train.lr")) << log.lines.front();
  fs::remove_all(out);
}

// optimizer.update_overlap (the same update, bit for bit) and profile_step (a diagnostic) change
// nothing a resume must refuse; they were compared, so profiling a step of a resumed run, or
// resuming without the overlap, needed --allow-config-change.
TEST(Checkpoint, OverlapAndProfileStepAreNotConfigChanges) {
  const json saved = default_train_config();
  json now = saved;
  now["profile_step"] = 7;
  now["optimizer"]["update_overlap"] = saved["optimizer"]["update_overlap"] == "off" ? "auto" : "off";
  EXPECT_EQ(run_config_differences(saved, now), std::vector<std::string>{});
  now["train"]["lr"] = saved["train"]["lr"].get<double>() * 2;
  EXPECT_EQ(run_config_differences(saved, now).size(), 1u);
}

// A checkpoint from before train.weight_decay_params decayed every parameter; resumed under the new
// default ("matrices": norms and biases do not decay) the update changed silently, as the absent key
// counted as "added at its default". It is compared as "all", the behaviour it was made with.
TEST(Checkpoint, ResumeFromBeforeWeightDecayParamsIsComparedAsAll) {
  json saved = default_train_config();
  saved["train"].erase("weight_decay_params");
  json now = default_train_config();
  ASSERT_EQ(now["train"]["weight_decay_params"], "matrices");
  const std::vector<std::string> d = run_config_differences(saved, now);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_NE(d[0].find("train.weight_decay_params"), std::string::npos) << d[0];
  now["train"]["weight_decay_params"] = "all";
  EXPECT_EQ(run_config_differences(saved, now), std::vector<std::string>{});
}

// A fresh run in an out_dir with another run's checkpoints pruned them as its own oldest and made
// --resume latest continue the other run.
TEST(Checkpoint, FreshRunRefusesAnotherRunsOutDir) {
  std::string out = checkpoint_tmp("foreign");
  train(run_cfg(out, 2, 2));
  const std::string before = read_bytes(fs::path(ckpt(out, 2)) / "model.safetensors");
  std::string m = error_of([&] { train(run_cfg(out, 4, 2, json::object(), {{"lr", 1e-2}})); });
  EXPECT_NE(m.find("already holds 1 checkpoint"), std::string::npos) << m;
  EXPECT_NE(m.find("--resume latest"), std::string::npos) << m;
  EXPECT_NE(m.find("--overwrite-out-dir"), std::string::npos) << m;
  EXPECT_EQ(read_bytes(fs::path(ckpt(out, 2)) / "model.safetensors"), before);
  // Told to overwrite, the new run replaces them.
  train(run_cfg(out, 3, 3, json::object(), {{"lr", 1e-2}}), "", nullptr, {}, /*overwrite=*/true);
  EXPECT_EQ(checkpoint_folders(out), std::vector<std::string>{ckpt(out, 3)});
  fs::remove_all(out);
}

// A checkpoint that does not fit must fail before writing anything, keeping the previous one.
TEST(Checkpoint, DiskFullFailsClearlyAndKeepsThePreviousCheckpoint) {
  std::string out = checkpoint_tmp("diskfull");
  train(run_cfg(out, 2, 2));
  std::map<std::string, std::string> before;
  for (auto& e : fs::directory_iterator(ckpt(out, 2))) before[e.path().filename()] = read_bytes(e.path());
  set_available_space_override([](const std::string&) { return uint64_t{4096}; });
  std::string m = error_of([&] { train(run_cfg(out, 4, 2), "latest"); });
  set_available_space_override(nullptr);
  EXPECT_NE(m.find("not enough disk space"), std::string::npos) << m;
  EXPECT_NE(m.find("step_00000002 is untouched"), std::string::npos) << m;
  EXPECT_NE(m.find("checkpoint_optimizer_state=\"bf16\""), std::string::npos) << m;
  EXPECT_NE(m.find("checkpoint_optimizer_state=\"none\""), std::string::npos) << m;
  EXPECT_EQ(checkpoint_folders(out), std::vector<std::string>{ckpt(out, 2)});
  for (auto& e : fs::directory_iterator(fs::path(out) / "checkpoints"))
    EXPECT_EQ(e.path().string(), ckpt(out, 2));  // no temp folder left
  for (auto& [name, bytes] : before) EXPECT_EQ(read_bytes(fs::path(ckpt(out, 2)) / name), bytes) << name;
  fs::remove_all(out);
}

// The smaller forms: bf16 halves the optimizer file and says the resume is not exact; none has no
// optimizer file and restarts the optimizer with a warning. Both resume and keep training.
TEST(Checkpoint, OptimizerStateForms) {
  std::string full = checkpoint_tmp("full"), half = checkpoint_tmp("bf16"), none = checkpoint_tmp("none");
  train(run_cfg(full, 2, 2));
  train(run_cfg(half, 2, 2, {{"checkpoint_optimizer_state", "bf16"}}));
  train(run_cfg(none, 2, 2, {{"checkpoint_optimizer_state", "none"}}));
  const auto opt_bytes = [](const std::string& d) { return fs::file_size(fs::path(d) / "optimizer.safetensors"); };
  EXPECT_LT(opt_bytes(ckpt(half, 2)), opt_bytes(ckpt(full, 2)) * 6 / 10);
  EXPECT_FALSE(fs::exists(fs::path(ckpt(none, 2)) / "optimizer.safetensors"));
  EXPECT_TRUE(verify_checkpoint(ckpt(none, 2)).empty()) << verify_checkpoint(ckpt(none, 2));
  Logged lh, ln;
  TrainSummary sh = train(run_cfg(half, 4, 2, {{"checkpoint_optimizer_state", "bf16"}}), "latest", &lh);
  TrainSummary sn = train(run_cfg(none, 4, 2, {{"checkpoint_optimizer_state", "none"}}), "latest", &ln);
  EXPECT_TRUE(lh.has("not bit-exact"));
  EXPECT_TRUE(ln.has("AdamW restarts"));
  EXPECT_EQ(sh.steps, 2);
  EXPECT_EQ(sn.steps, 2);
  EXPECT_TRUE(std::isfinite(sh.last_loss) && std::isfinite(sn.last_loss));
  EXPECT_THROW(Trainer(run_cfg(full, 2, 2, {{"checkpoint_optimizer_state", "half"}})), Error);
  for (auto& d : {full, half, none}) fs::remove_all(d);
}

// A kill left torn and extra metrics lines; a resume keeps exactly the steps the checkpoint saw.
TEST(Checkpoint, ResumeTrimsMetricsToTheCheckpoint) {
  std::string out = checkpoint_tmp("metrics");
  train(run_cfg(out, 3, 2));
  fs::remove_all(ckpt(out, 3));  // killed before its step-3 checkpoint: metrics are one step ahead
  {
    std::ofstream f(out + "/metrics.jsonl", std::ios::app);
    f << "{\"step\": 4, \"lo";  // torn by a kill
  }
  train(run_cfg(out, 4, 2), "latest");
  std::ifstream f(out + "/metrics.jsonl");
  std::vector<int64_t> steps;
  for (std::string line; std::getline(f, line);) steps.push_back(json::parse(line)["step"].get<int64_t>());
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 2, 3, 4}));
  fs::remove_all(out);
}

// metrics.jsonl was opened with std::ofstream (and read with std::ifstream on resume): a FIFO there
// blocked the run in open() for good, and a folder there lost every row silently. Now both are
// refused, naming the path, for a fresh run and for a resume. A regression fails after 30 s instead
// of hanging: the FIFO is then opened read-write, which releases an opener blocked on either end.
std::string error_within_30s(const std::string& fifo, const std::function<void()>& f) {
  std::promise<std::string> done;
  std::future<std::string> result = done.get_future();
  std::thread t([&] { done.set_value(error_of(f)); });
  int release = -1;
  if (result.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    ADD_FAILURE() << "the trainer hung on the FIFO " << fifo;
    release = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
  }
  t.join();
  if (release >= 0) ::close(release);
  return result.get();
}

TEST(Checkpoint, MetricsPathThatIsNotARegularFileIsRefused) {
  const std::string out = checkpoint_tmp("metrics_fifo");
  const std::string metrics = out + "/metrics.jsonl";
  fs::create_directories(out);
  ASSERT_EQ(::mkfifo(metrics.c_str(), 0600), 0);
  std::string m = error_within_30s(metrics, [&] { train(run_cfg(out, 1, 1)); });
  EXPECT_NE(m.find(metrics), std::string::npos) << m;
  EXPECT_NE(m.find("FIFO"), std::string::npos) << m;

  // Resuming: the trim reads the file first.
  fs::remove(metrics);
  train(run_cfg(out, 2, 1));
  fs::remove(metrics);
  ASSERT_EQ(::mkfifo(metrics.c_str(), 0600), 0);
  m = error_within_30s(metrics, [&] { train(run_cfg(out, 3, 1), "latest"); });
  EXPECT_NE(m.find(metrics), std::string::npos) << m;
  EXPECT_NE(m.find("FIFO"), std::string::npos) << m;

  // A folder: the rows used to go nowhere.
  fs::remove(metrics);
  fs::create_directories(metrics);
  m = error_of([&] { train(run_cfg(out, 3, 1), "latest"); });
  EXPECT_NE(m.find(metrics), std::string::npos) << m;
  EXPECT_NE(m.find("not a regular file"), std::string::npos) << m;
  fs::remove_all(out);
}

// A non-finite loss used to carry on (NaN losses, exit 0). lr 1e30 blows the weights up after
// step 1, so step 2's loss is not finite.
TEST(Checkpoint, NonFiniteLossStopsKeepingTheLastGoodCheckpoint) {
  std::string out = checkpoint_tmp("nan");
  json cfg = run_cfg(out, 5, 1, json::object(), {{"lr", 1e30}, {"min_lr", 1e29}, {"warmup_steps", 0}});
  std::string m = error_of([&] { train(cfg); });
  EXPECT_NE(m.find("non-finite"), std::string::npos) << m;
  EXPECT_NE(m.find("at step 2"), std::string::npos) << m;
  EXPECT_NE(m.find("last good checkpoint is " + ckpt(out, 1)), std::string::npos) << m;
  EXPECT_EQ(checkpoint_folders(out), std::vector<std::string>{ckpt(out, 1)});
  // "skip": the run goes on without applying the bad updates.
  std::string out2 = checkpoint_tmp("nan_skip");
  Logged log;
  json skip = run_cfg(out2, 3, 0, json::object(), {{"lr", 1e30}, {"min_lr", 1e29}, {"warmup_steps", 0}, {"nonfinite", "skip"}});
  EXPECT_EQ(train(skip, "", &log).steps, 3);
  EXPECT_TRUE(log.has("update was skipped"));
  fs::remove_all(out);
  fs::remove_all(out2);
}

}  // namespace
}  // namespace kestrel::train
