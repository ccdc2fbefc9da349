// kestrel-mem: where device memory goes, and whether a configuration fits.
//   kestrel-mem profile --config run.json --steps N [--memory-budget 40GiB] [--set k=v] --out DIR
//       runs N real training steps with the trace's event log on; writes DIR/memory.json,
//       DIR/memory.html (with the plan next to the measurement) and DIR/memory_snapshot.pickle (the
//       log in PyTorch's snapshot format, for pytorch.org/memory_viz) and prints a summary table.
//   kestrel-mem plan --config run.json [--memory-budget 40GiB] [--set k=v] [--find-max batch|seq_len]
//       predicts the peak per tag without running; says whether it fits and the headroom.
// Exit codes: 0 ok (plan: fits), 1 error, 2 usage, 3 out of budget (profile) / does not fit (plan).
#include <cstdio>
#include <limits>
#include <fstream>
#include <string>
#include <vector>

#include "kestrel/models/config.h"
#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"
#include "kestrel/runtime/memory_trace.h"
#include "kestrel/runtime/parse_number.h"
#include "kestrel/train/memory_plan.h"
#include "kestrel/train/memory_profile.h"
#include "kestrel/train/run_config.h"
#include "kestrel/train/train_config.h"
#include "kestrel/train/trainer.h"

using namespace kestrel;
using nlohmann::json;

namespace {

void usage(FILE* f) {
  std::fprintf(f,
               "usage: kestrel-mem profile --config run.json --steps N [--memory-budget SIZE] [--set K=V] --out DIR\n"
               "       kestrel-mem plan --config run.json [--memory-budget SIZE] [--set K=V] [--find-max batch|seq_len]\n"
               "                        [--world-size N]\n"
               "  profile   run N training steps with memory tracing; write DIR/memory.json, DIR/memory.html\n"
               "  plan      predict the peak per tag without running; fits / does not fit and the headroom\n"
               "            (--world-size N: per GPU of N data-parallel ranks, ZeRO from distributed.zero)\n");
}

struct Args {
  std::string cmd, config, out, find_max;
  std::vector<std::string> sets;
  int64_t steps = 2;
  int64_t world_size = 1;  // plan: data-parallel ranks
};

json load_config(const Args& a) {
  json cfg = train::resolve_train_config(models::read_json_file(a.config, "config"), a.config);
  for (const std::string& s : a.sets) train::apply_override(cfg, s);
  // The device's on_cpu / on_cuda settings as kestrel-train applies them (then --set again), so the
  // plan and the profile describe the run that trains.
  train::apply_device_overrides(cfg, train::RunConfig::resolve_device(cfg).is_cuda(), a.sets);
  return cfg;
}

int profile(const Args& a) {
  json cfg = load_config(a);
  cfg["train"]["steps"] = a.steps;
  cfg["out_dir"] = a.out;
  cfg["log_every"] = 1;
  cfg["checkpoint_every"] = 0;
  cfg["eval_every"] = 0;
  train::PlanOptions po;
  po.steps = a.steps;
  train::MemoryPlan plan = train::plan_memory(cfg, po);

  // The log starts before the model exists, so parameters and optimizer state carry their names.
  const train::RunConfig run = train::RunConfig::resolve(cfg);
  const Device dev = run.device;
  MemoryTrace& trace = memory_trace(dev);
  trace.clear_events();
  MemorySnapshot start = trace.snapshot();
  trace.set_event_logging(true, 1u << 23);
  train::ProfileOptions popt;
  popt.max_events = 1u << 23;
  int rc = 0;
  std::string oom;
  try {
    // Building the model and its optimizer state can go over the budget too: same report.
    train::Trainer trainer(cfg);
    trainer.set_memory_profiling(true);
    trainer.run();
  } catch (const OutOfBudget& e) {
    oom = e.what();
    rc = 3;
  }
  trace.set_event_logging(false);
  popt.budget = memory_budget(dev);
  // On the CPU the trainer does not enforce a budget; the requested one is still drawn for reference.
  if (popt.budget == 0) popt.budget = run.memory_budget_bytes;
  train::MemoryProfile p = train::analyze_memory(trace.events(), start, trace.snapshot(), popt);
  p.meta = {{"config", a.config},          {"steps", a.steps},
            {"precision", plan.precision}, {"recompute", plan.recompute},
            {"batch_size", cfg["train"]["batch_size"]}, {"tokens_per_micro_batch", plan.tokens}};
  if (!oom.empty()) p.meta["out_of_budget"] = oom;
  // The host side (optimizer.offload=host): the AdamW state as the CPU trace counted it (tag
  // OptimizerState), pinned staging, and the process's peak resident set.
  const int64_t host_state = memory_trace(Device::cpu()).snapshot().tags[static_cast<int>(MemoryTag::OptimizerState)].peak;
  int64_t rss_peak = 0;
  {
    std::ifstream st("/proc/self/status");
    std::string key;
    while (st >> key) {
      if (key == "VmHWM:") st >> rss_peak, rss_peak *= 1024;
      std::string rest;
      std::getline(st, rest);
    }
  }
  p.meta["host"] = {{"optimizer_state_peak", host_state}, {"rss_peak", rss_peak}};
  p.plan = plan.to_json();
  std::string path = train::write_memory_profile(p, a.out);
  std::printf("%s", train::profile_summary(p).c_str());
  std::printf("%-16s %14s %14s %8s\n", "plan vs measured", "planned", "measured", "ratio");
  for (int t = 0; t < kNumMemoryTags; ++t) {
    if (p.tag_peak[t] == 0 && plan.tag_peak[t] == 0) continue;
    std::printf("%-16s %14s %14s %7.1f%%\n", std::string(tag_name(static_cast<MemoryTag>(t))).c_str(),
                format_bytes(plan.tag_peak[t]).c_str(), format_bytes(p.tag_peak[t]).c_str(),
                p.tag_peak[t] ? 100.0 * static_cast<double>(plan.tag_peak[t]) / static_cast<double>(p.tag_peak[t]) : 0.0);
  }
  std::printf("%-16s %14s %14s %7.1f%%\n", "peak in use", format_bytes(plan.peak).c_str(), format_bytes(p.peak_in_use).c_str(),
              p.peak_in_use ? 100.0 * static_cast<double>(plan.peak) / static_cast<double>(p.peak_in_use) : 0.0);
  if (plan.host_optimizer_state > 0 || host_state > 0) {
    std::printf("%-16s %14s %14s %7.1f%%\n", "host opt. state", format_bytes(plan.host_optimizer_state).c_str(),
                format_bytes(host_state).c_str(),
                host_state ? 100.0 * static_cast<double>(plan.host_optimizer_state) / static_cast<double>(host_state) : 0.0);
    std::printf("%-16s %14s %14s %7.1f%%\n", "host total", format_bytes(plan.host_optimizer_state + plan.host_pinned).c_str(),
                format_bytes(rss_peak).c_str(),
                rss_peak ? 100.0 * static_cast<double>(plan.host_optimizer_state + plan.host_pinned) / static_cast<double>(rss_peak)
                         : 0.0);
  }
  std::printf("wrote %s, %s/memory.html and %s/memory_snapshot.pickle (PyTorch memory_viz format)\n", path.c_str(),
              a.out.c_str(), a.out.c_str());
  if (rc == 3) std::fprintf(stderr, "kestrel-mem: the run went out of the memory budget:\n%s\n", oom.c_str());
  return rc;
}

int plan_cmd(const Args& a) {
  json cfg = load_config(a);
  train::PlanOptions po;
  po.world_size = a.world_size;
  train::MemoryPlan plan = train::plan_memory(cfg, po);
  std::printf("%s", plan.table().c_str());
  // What each recompute setting would cost and save for this run ("auto" takes the fastest that fits).
  std::printf("%s", train::recompute_costs_table(train::recompute_costs(cfg, po), plan.budget).c_str());
  if (!a.find_max.empty()) {
    KESTREL_CHECK(plan.budget > 0, "kestrel-mem", "--find-max needs a budget (--memory-budget SIZE)");
    // The searched key: train.batch_size, or data.seq_len (decoder runs on token files).
    std::string section, key;
    if (a.find_max == "batch" || a.find_max == "batch_size") {
      section = "train", key = "batch_size";
    } else if (a.find_max == "seq_len") {
      KESTREL_CHECK(cfg["model"]["type"] == "decoder", "kestrel-mem",
                    "this config's sequence length is set by its data (images + captions), not by data.seq_len; "
                    "use --find-max batch");
      section = "data", key = "seq_len";
    } else {
      throw make_error("kestrel-mem", "--find-max takes batch or seq_len, got '", a.find_max, "'");
    }
    auto fits = [&](int64_t v) {
      json c = cfg;
      c[section][key] = v;
      return train::plan_memory(c, po).fits;
    };
    int64_t lo = 0, hi = 1;
    while (fits(hi) && hi < (int64_t{1} << 24)) lo = hi, hi *= 2;
    while (hi - lo > 1) {
      int64_t mid = (lo + hi) / 2;
      (fits(mid) ? lo : hi) = mid;
    }
    if (lo == 0)
      std::printf("largest %s that fits: none (%s = 1 does not fit)\n", key.c_str(), key.c_str());
    else {
      json c = cfg;
      c[section][key] = lo;
      train::MemoryPlan best = train::plan_memory(c, po);
      std::printf("largest %s that fits: %lld (peak %s + external %s, headroom %s)\n", key.c_str(),
                  static_cast<long long>(lo), format_bytes(best.peak).c_str(), format_bytes(best.external).c_str(),
                  format_bytes(best.headroom).c_str());
    }
  }
  return plan.fits ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  Args a;
  a.cmd = argv[1];
  if (a.cmd == "--help" || a.cmd == "-h") {
    usage(stdout);
    return 0;
  }
  for (int i = 2; i < argc; ++i) {
    std::string s = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kestrel-mem: %s needs a value\n", s.c_str());
      return 2;
    }
    std::string v = argv[++i];
    try {
      if (s == "--memory-budget") parse_size(v, "--memory-budget");
      if (s == "--steps") a.steps = parse_integer(v, "--steps", 1, std::numeric_limits<int32_t>::max());
      if (s == "--world-size") a.world_size = parse_integer(v, "--world-size", 1, 1 << 20);
    } catch (const Error& e) {
      std::fprintf(stderr, "kestrel-mem: error: %s\n", e.what());
      return 2;
    }
    if (s == "--config") a.config = v;
    else if (s == "--out") a.out = v;
    else if (s == "--set") a.sets.push_back(v);
    else if (s == "--memory-budget") a.sets.push_back("memory_budget=" + v);
    else if (s == "--find-max") a.find_max = v;
    else if (s == "--steps" || s == "--world-size") continue;
    else {
      std::fprintf(stderr, "kestrel-mem: unknown argument '%s'\n", s.c_str());
      usage(stderr);
      return 2;
    }
  }
  if (a.config.empty() || (a.cmd == "profile" && a.out.empty()) || (a.cmd != "profile" && a.cmd != "plan")) {
    usage(stderr);
    return 2;
  }
  try {
    return a.cmd == "profile" ? profile(a) : plan_cmd(a);
  } catch (const Error& e) {
    std::fprintf(stderr, "kestrel-mem: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kestrel-mem: error: %s\n", e.what());
    return 1;
  }
}
