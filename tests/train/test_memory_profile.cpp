// Memory profiling and planning on the CPU: the plan agrees with a profiled run per tag (within
// 10%) on the quickstart VLM and on a smaller one (recompute on and off), memory.json carries every
// field its header documents with the right type, and memory.html holds the data and the chart.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "kestrel/models/config.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/tensor.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/token_file.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"
#include "trainer_fixtures.h"
#include "support/temp_dir.h"

namespace kestrel::train {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

using kestrel::testing::source_dir;

json quickstart(const std::string& out_dir, int64_t steps) {
  json cfg = resolve_train_config(models::read_json_file(source_dir() + "/configs/quickstart_vlm.json", "config"),
                                  "quickstart");
  cfg["train"]["steps"] = steps;
  cfg["out_dir"] = out_dir;
  cfg["device"] = "cpu";
  cfg["log_every"] = 1000;
  return cfg;
}

// A profiled run of the trainer, as kestrel-mem profile does it.
MemoryProfile profile_run(const json& cfg) { return testing::profile_trainer_run(cfg, Device::cpu()); }

void expect_plan_matches(const json& cfg, const char* what) {
  PlanOptions po;
  po.steps = cfg["train"]["steps"];
  MemoryPlan plan = plan_memory(cfg, po);
  MemoryProfile p = profile_run(cfg);
  for (MemoryTag t : {MemoryTag::Parameter, MemoryTag::Gradient, MemoryTag::OptimizerState, MemoryTag::Activation}) {
    const double measured = static_cast<double>(p.tag_peak[static_cast<int>(t)]);
    const double planned = static_cast<double>(plan.tag_peak[static_cast<int>(t)]);
    ASSERT_GT(measured, 0) << what << " " << tag_name(t);
    EXPECT_NEAR(planned / measured, 1.0, 0.10) << what << " " << tag_name(t) << ": planned " << planned
                                                << ", measured " << measured;
  }
  EXPECT_NEAR(static_cast<double>(plan.peak) / static_cast<double>(p.peak_in_use), 1.0, 0.10)
      << what << " total: planned " << plan.peak << " (" << plan.peak_where << "), measured " << p.peak_in_use << " ("
      << p.peak_phase << ")";
}

TEST(MemoryPlan, MatchesProfileOnQuickstart) {
  std::string dir = (fs::temp_directory_path() / "kestrel_mem_q").string();
  json cfg = quickstart(dir, 2);
  expect_plan_matches(cfg, "quickstart");
  cfg["recompute"] = "recompute";
  expect_plan_matches(cfg, "quickstart+recompute");
  fs::remove_all(dir);
}

TEST(MemoryPlan, MatchesProfileOnSmallerModel) {
  std::string dir = (fs::temp_directory_path() / "kestrel_mem_s").string();
  json cfg = quickstart(dir, 3);
  cfg["train"]["batch_size"] = 5;
  cfg["model"]["config"]["text_config"]["num_hidden_layers"] = 1;
  cfg["model"]["config"]["text_config"]["intermediate_size"] = 192;
  cfg["model"]["config"]["vision_config"]["num_hidden_layers"] = 1;
  expect_plan_matches(cfg, "small");
  cfg["recompute"] = "recompute";
  expect_plan_matches(cfg, "small+recompute");
  // bf16 (f32 AdamW masters): the image branch's backward runs while the token embeddings'
  // gradient waits, which decides the gradient peak of a small model.
  cfg["precision"] = "bf16";
  cfg["recompute"] = "none";
  expect_plan_matches(cfg, "small bf16");
  cfg["train"]["grad_accum"] = 2;
  expect_plan_matches(cfg, "small bf16, accumulation 2");
  fs::remove_all(dir);
}

TEST(MemoryPlan, MatchesProfileOnDecoderTokens) {
  std::string dir = testing::fresh_temp_dir("kestrel_mem", "decoder");
  for (bool tied : {false, true}) {
    json text = {{"model_type", "qwen2"}, {"vocab_size", 96}, {"hidden_size", 64}, {"intermediate_size", 160},
                 {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                 {"tie_word_embeddings", tied}};
    json cfg = testing::tiny_decoder_run(dir, text, 300, 11, /*seq_len=*/64, /*batch=*/6, "cpu");
    expect_plan_matches(cfg, tied ? "decoder tied" : "decoder");
    cfg["recompute"] = "recompute";
    expect_plan_matches(cfg, tied ? "decoder tied+recompute" : "decoder+recompute");
    // Accumulation: later micro-batches run with the first one's parameter gradients held (the
    // vocabulary-sized ones are added in place); the planner replays a second micro-batch.
    cfg["train"]["grad_accum"] = 3;
    expect_plan_matches(cfg, tied ? "decoder tied+recompute, accumulation 3" : "decoder+recompute, accumulation 3");
    cfg["recompute"] = "none";
    cfg["precision"] = "bf16";
    cfg["optimizer"]["offload"] = "host";
    expect_plan_matches(cfg, tied ? "decoder tied bf16, accumulation 3, offload host"
                                  : "decoder bf16, accumulation 3, offload host");
    // The loss head's gradients in the backward (from the lse) instead of the forward.
    cfg["train"]["loss_gradient"] = "backward";
    expect_plan_matches(cfg, tied ? "decoder tied bf16, accumulation 3, offload host, loss gradient in backward"
                                  : "decoder bf16, accumulation 3, offload host, loss gradient in backward");
  }
  fs::remove_all(dir);
}

TEST(MemoryPlan, BudgetAnswersAndFindMaxAreConsistent) {
  json cfg = quickstart("/tmp/unused", 2);
  MemoryPlan free_run = plan_memory(cfg);
  EXPECT_TRUE(free_run.fits);
  cfg["memory_budget"] = "8MiB";
  MemoryPlan tight = plan_memory(cfg);
  EXPECT_FALSE(tight.fits);
  EXPECT_EQ(tight.headroom, tight.budget - tight.peak - tight.external);
  // A larger batch never needs less memory.
  json big = cfg;
  big["train"]["batch_size"] = 2 * cfg["train"]["batch_size"].get<int64_t>();
  EXPECT_GT(plan_memory(big).peak, tight.peak);
}

// Every field memory_profile.h documents, with its JSON type.
struct Field {
  const char* path;
  json::value_t type;
};

void expect_type(const json& v, json::value_t want, const std::string& path) {
  bool ok = v.type() == want ||
            (want == json::value_t::number_integer && v.type() == json::value_t::number_unsigned) ||
            (want == json::value_t::number_float && v.is_number());
  EXPECT_TRUE(ok) << path << " is " << v.type_name();
}

// The report every OutOfBudget leaves (also the one kestrel-train writes when the model does not
// fit while it is built): per-tag bytes equal to the trace's, the report text, and the profile files
// built from the events logged since the start snapshot.
TEST(MemoryProfile, OutOfBudgetReportHoldsTheTraceAndTheProfile) {
  const std::string dir = testing::fresh_temp_dir("kestrel_mem", "oom_report");
  MemoryTrace& trace = memory_trace(Device::cpu());
  trace.clear_events();
  const MemorySnapshot start = trace.snapshot();
  trace.set_event_logging(true, 1u << 20);
  Tensor a, b;
  {
    TagScope tag(MemoryTag::Parameter);
    MemoryLabelScope label("model.layer.0");
    a = Tensor::empty({1000 + 17}, DType::F32, Device::cpu());
    b = Tensor::empty({333}, DType::F32, Device::cpu());
  }
  b = Tensor();
  const MemorySnapshot now = trace.snapshot();
  const std::string path = write_memory_report(dir, Device::cpu(), "request 1.00 GiB over the budget", start,
                                               {{"parameters", 1017}}, {{"source", "test"}});
  trace.set_event_logging(false);
  trace.clear_events();
  std::ifstream f(path);
  const json r = json::parse(f);
  EXPECT_EQ(r["out_of_budget"], "request 1.00 GiB over the budget");
  EXPECT_EQ(r["parameters"], 1017);
  EXPECT_EQ(r["device"], "cpu");
  const int pt = static_cast<int>(MemoryTag::Parameter);
  EXPECT_EQ(r["tags"]["parameter"]["current"].get<int64_t>(), now.tags[pt].current);
  EXPECT_EQ(r["tags"]["parameter"]["peak"].get<int64_t>(), now.tags[pt].peak);
  EXPECT_EQ(r["peak_in_use"].get<int64_t>(), now.peak_in_use);
  std::ifstream pf(dir + "/memory.json");
  ASSERT_TRUE(pf.good()) << "the profile of the logged events";
  const json prof = json::parse(pf);
  EXPECT_EQ(prof["meta"]["source"], "test");
  EXPECT_EQ(prof["meta"]["out_of_budget"], "request 1.00 GiB over the budget");
  EXPECT_TRUE(fs::exists(dir + "/memory.html"));
  EXPECT_TRUE(fs::exists(dir + "/memory_snapshot.pickle"));
  // Without an OutOfBudget only the report is written.
  const std::string quiet = testing::fresh_temp_dir("kestrel_mem", "report_only");
  write_memory_report(quiet, Device::cpu(), "", start);
  EXPECT_TRUE(fs::exists(quiet + "/memory_report.json"));
  EXPECT_FALSE(fs::exists(quiet + "/memory.json"));
  a = Tensor();
  fs::remove_all(dir);
  fs::remove_all(quiet);
}

TEST(MemoryProfile, JsonFollowsTheDocumentedSchemaAndHtmlHoldsTheChart) {
  std::string dir = (fs::temp_directory_path() / "kestrel_mem_json").string();
  fs::remove_all(dir);
  json cfg = quickstart(dir, 2);
  cfg["recompute"] = "recompute";
  MemoryProfile p = profile_run(cfg);
  p.budget = 64ll << 20;
  p.plan = plan_memory(cfg).to_json();
  write_memory_profile(p, dir);
  std::ifstream jf(dir + "/memory.json");
  json j = json::parse(jf);

  using T = json::value_t;
  const T I = T::number_integer, N = T::number_float, S = T::string, B = T::boolean, O = T::object, A = T::array;
  const std::vector<Field> top = {{"schema", S}, {"device", S},  {"budget", I},   {"meta", O},
                                  {"summary", O}, {"tags", A},   {"phases", A},   {"regions", A},
                                  {"top_allocations", A}, {"labels_at_peak", A}, {"timeline", O}, {"spans", A},
                                  {"plan", O}};
  const std::vector<Field> summary = {{"peak_in_use", I},   {"peak_time_s", N},      {"peak_phase", S},
                                      {"peak_reserved", I}, {"peak_footprint", I},   {"reserved_at_peak", I},
                                      {"external", I},      {"num_events", I},       {"events_truncated", B}};
  const std::vector<Field> tag = {{"tag", S}, {"peak", I}, {"at_peak", I}, {"current", I}};
  const std::vector<Field> phase = {{"name", S}, {"count", I}, {"peak_in_use", I}, {"start_in_use", I},
                                    {"peak_time_s", N}, {"tags_at_peak", O}};
  const std::vector<Field> region = {{"name", S}, {"forward_peak", I}, {"forward_delta", I}, {"backward_peak", I},
                                     {"backward_delta", I}};
  const std::vector<Field> top_alloc = {{"bytes", I}, {"tag", S}, {"label", S}, {"time_s", N}};
  const std::vector<Field> label = {{"label", S}, {"bytes", I}};
  const std::vector<Field> timeline = {{"tags", A}, {"t", A}, {"in_use", A}, {"reserved", A}, {"by_tag", A}};
  const std::vector<Field> span = {{"name", S}, {"t0", N}, {"t1", N}};

  // The header documents each field by name: keep the test and the documentation together.
  std::ifstream hf(source_dir() + "/train/include/kestrel/train/memory_profile.h");
  std::stringstream hs;
  hs << hf.rdbuf();
  const std::string header = hs.str();
  auto check = [&](const json& obj, const std::vector<Field>& fields, const std::string& where) {
    ASSERT_TRUE(obj.is_object()) << where;
    for (const Field& f : fields) {
      EXPECT_NE(header.find(f.path), std::string::npos) << f.path << " is not documented in memory_profile.h";
      ASSERT_TRUE(obj.contains(f.path)) << where << "." << f.path << " missing";
      expect_type(obj[f.path], f.type, where + "." + f.path);
    }
  };
  check(j, top, "");
  EXPECT_EQ(j["schema"], "kestrel.memory/1");
  check(j["summary"], summary, "summary");
  ASSERT_EQ(j["tags"].size(), static_cast<size_t>(kNumMemoryTags));
  for (const json& t : j["tags"]) check(t, tag, "tags[]");
  ASSERT_GE(j["phases"].size(), 3u);
  for (const json& ph : j["phases"]) check(ph, phase, "phases[]");
  EXPECT_EQ(j["phases"][0]["name"], "forward");
  EXPECT_EQ(j["phases"][1]["name"], "backward");
  EXPECT_EQ(j["phases"][2]["name"], "optimizer");
  // Regions: 2 vision blocks + 2 decoder layers, each with a forward and a backward peak.
  ASSERT_EQ(j["regions"].size(), 4u);
  for (const json& r : j["regions"]) {
    check(r, region, "regions[]");
    EXPECT_GT(r["forward_peak"].get<int64_t>(), 0);
    EXPECT_GT(r["backward_delta"].get<int64_t>(), 0) << r["name"];
  }
  ASSERT_FALSE(j["top_allocations"].empty());
  for (const json& a : j["top_allocations"]) check(a, top_alloc, "top_allocations[]");
  // The labels say who allocated: decoder layers and vision blocks appear among the live blocks.
  std::string labels = j["labels_at_peak"].dump();
  EXPECT_NE(labels.find("decoder.layer."), std::string::npos) << labels;
  for (const json& l : j["labels_at_peak"]) check(l, label, "labels_at_peak[]");
  check(j["timeline"], timeline, "timeline");
  const size_t n = j["timeline"]["t"].size();
  ASSERT_GT(n, 10u);
  ASSERT_EQ(j["timeline"]["by_tag"].size(), static_cast<size_t>(kNumMemoryTags));
  for (const json& series : j["timeline"]["by_tag"]) EXPECT_EQ(series.size(), n);
  int64_t max_in_use = 0;
  for (const json& v : j["timeline"]["in_use"]) max_in_use = std::max(max_in_use, v.get<int64_t>());
  EXPECT_EQ(max_in_use, j["summary"]["peak_in_use"].get<int64_t>()) << "the downsampled timeline keeps the peak";
  ASSERT_EQ(j["spans"].size(), 6u);  // 2 steps x forward/backward/optimizer
  for (const json& s : j["spans"]) check(s, span, "spans[]");

  std::ifstream html_file(dir + "/memory.html");
  std::stringstream html_stream;
  html_stream << html_file.rdbuf();
  const std::string html = html_stream.str();
  for (const char* needle : {"<svg", "class=\"area\" data-tag=\"activation\"", "class=\"area\" data-tag=\"parameter\"",
                             "class=\"band\" data-phase=\"forward\"", "data-phase=\"backward\"",
                             "data-phase=\"optimizer\"", "class=\"budget\"", "id=\"memory-data\"",
                             "decoder.layer.1", "Recompute regions", "Largest live allocations"})
    EXPECT_NE(html.find(needle), std::string::npos) << needle;
  EXPECT_EQ(html.find("<script src"), std::string::npos) << "the page must be self-contained";
  EXPECT_EQ(html.find("https://"), std::string::npos) << "the page must not reach the network";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::train
