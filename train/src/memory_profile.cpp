// Memory profile analysis (see memory_profile.h): two passes over the event log. The first finds
// the global peak and, per timeline bucket, the events with the highest and lowest bytes in use
// (so the downsampled chart keeps every peak and trough); the second replays the log with the
// per-tag counters, the phase stack (peaks per phase and region) and the live-block map up to the
// peak (the largest live allocations and bytes by label at the peak).
#include "kestrel/train/memory_profile.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>

#include "kestrel/runtime/error.h"
#include "kestrel/runtime/memory_budget.h"

namespace kestrel::train {

using nlohmann::json;

namespace {

bool is_top_phase(const std::string& n) { return n == "forward" || n == "backward" || n == "optimizer"; }

// "region:decoder.layer.3:forward" -> {"decoder.layer.3", true}
bool parse_region(const std::string& n, std::string& region, bool& forward) {
  if (n.rfind("region:", 0) != 0) return false;
  size_t last = n.rfind(':');
  if (last <= 7) return false;
  region = n.substr(7, last - 7);
  forward = n.compare(last + 1, std::string::npos, "forward") == 0;
  return true;
}

// Live bytes at the peak are grouped by who made them: parameters and optimizer state by kind
// (their labels are per tensor), everything else by its module label.
std::string label_group(MemoryTag tag, const std::string& label) {
  if (tag == MemoryTag::Parameter) return "parameters";
  if (tag == MemoryTag::OptimizerState && label.rfind("adamw.", 0) == 0) return "adamw state";
  if (tag == MemoryTag::Gradient && label.empty()) return "gradients (backward)";
  return label.empty() ? "(unlabelled)" : label;
}

}  // namespace

MemoryProfile analyze_memory(const std::vector<MemoryEvent>& events, const MemorySnapshot& start,
                             const MemorySnapshot& end, const ProfileOptions& options) {
  MemoryProfile p;
  p.device = end.device.str();
  p.budget = options.budget;
  p.num_events = static_cast<int64_t>(events.size());
  p.events_truncated = events.size() >= options.max_events;
  p.external = end.external;
  p.peak_reserved = end.peak_reserved;
  p.peak_footprint = end.peak_footprint;
  const int64_t t0 = events.empty() ? 0 : events.front().time_ns;
  auto secs = [&](int64_t ns) { return static_cast<double>(ns - t0) * 1e-9; };

  // Pass 1: the global peak and the picks of each timeline bucket.
  const size_t n = events.size();
  int64_t start_in_use = start.in_use;
  size_t peak_index = n;  // n: the peak is the starting state
  p.peak_in_use = start_in_use;
  for (size_t i = 0; i < n; ++i)
    if (events[i].in_use_after > p.peak_in_use) {
      p.peak_in_use = events[i].in_use_after;
      peak_index = i;
    }
  std::vector<char> pick(n, 0);
  const size_t buckets = std::max<size_t>(1, options.max_points / 2);
  const size_t per = std::max<size_t>(1, (n + buckets - 1) / buckets);
  for (size_t b = 0; b * per < n; ++b) {
    size_t lo = b * per, hi = std::min(n, lo + per), imax = lo, imin = lo;
    for (size_t i = lo; i < hi; ++i) {
      if (events[i].in_use_after > events[imax].in_use_after) imax = i;
      if (events[i].in_use_after < events[imin].in_use_after) imin = i;
    }
    pick[imax] = pick[imin] = 1;
  }
  if (n) pick[n - 1] = 1;
  if (peak_index < n) pick[peak_index] = 1;

  // Pass 2: replay.
  std::array<int64_t, kNumMemoryTags> cur{};
  for (int t = 0; t < kNumMemoryTags; ++t) cur[t] = t == static_cast<int>(MemoryTag::External) ? 0 : start.tags[t].current;
  cur[static_cast<int>(MemoryTag::External)] = end.external;
  p.tag_peak = cur;
  p.tag_at_peak = cur;
  int64_t reserved = start.reserved, in_use = start_in_use;

  struct Occurrence {
    std::string name;
    int64_t start_in_use = 0, peak = 0;
    int64_t peak_ns = 0;
    std::array<int64_t, kNumMemoryTags> tags{};
    int64_t t0_ns = 0;
  };
  std::vector<Occurrence> stack;
  std::map<std::string, PhasePeak> agg;
  std::vector<std::string> order;
  std::map<std::string, RegionPeak> regions;
  std::vector<std::string> region_order;
  std::unordered_map<const void*, LiveAllocation> live;

  auto record_point = [&](int64_t ns) {
    p.t.push_back(secs(ns));
    p.in_use.push_back(in_use);
    p.reserved.push_back(reserved);
    for (int t = 0; t < kNumMemoryTags; ++t) p.by_tag[t].push_back(cur[t]);
  };
  if (n) record_point(events.front().time_ns);

  for (size_t i = 0; i < n; ++i) {
    const MemoryEvent& e = events[i];
    const int ti = static_cast<int>(e.tag);
    switch (e.kind) {
      case MemoryEventKind::Alloc:
        cur[ti] += e.bytes;
        p.tag_peak[ti] = std::max(p.tag_peak[ti], cur[ti]);
        in_use = e.in_use_after;
        if (i < peak_index && e.address) live[e.address] = LiveAllocation{e.bytes, e.tag, e.label, secs(e.time_ns)};
        break;
      case MemoryEventKind::Free:
        cur[ti] -= e.bytes;
        in_use = e.in_use_after;
        if (i < peak_index && e.address) live.erase(e.address);
        break;
      case MemoryEventKind::Reserve:
      case MemoryEventKind::Release:
        reserved = e.reserved_after;
        break;
      case MemoryEventKind::PhaseBegin: {
        Occurrence o;
        o.name = e.label;
        o.start_in_use = o.peak = in_use;
        o.peak_ns = o.t0_ns = e.time_ns;
        o.tags = cur;
        stack.push_back(std::move(o));
        break;
      }
      case MemoryEventKind::PhaseEnd: {
        // Pop to the matching name (tolerates unbalanced logs from a truncated trace).
        while (!stack.empty()) {
          Occurrence o = std::move(stack.back());
          stack.pop_back();
          if (!agg.count(o.name)) order.push_back(o.name);
          PhasePeak& a = agg[o.name];
          a.name = o.name;
          a.count += 1;
          if (a.count == 1 || o.peak > a.peak_in_use) {
            a.peak_in_use = o.peak;
            a.start_in_use = o.start_in_use;
            a.peak_time_s = secs(o.peak_ns);
            a.tags_at_peak = o.tags;
          }
          std::string region;
          bool fwd = false;
          if (parse_region(o.name, region, fwd)) {
            if (!regions.count(region)) region_order.push_back(region);
            RegionPeak& r = regions[region];
            r.name = region;
            int64_t& pk = fwd ? r.forward_peak : r.backward_peak;
            int64_t& dl = fwd ? r.forward_delta : r.backward_delta;
            if (o.peak > pk) pk = o.peak;
            dl = std::max(dl, o.peak - o.start_in_use);
          }
          if (is_top_phase(o.name)) p.spans.push_back({o.name, secs(o.t0_ns), secs(e.time_ns)});
          if (o.name == e.label) break;
        }
        break;
      }
      default:
        break;
    }
    for (Occurrence& o : stack)
      if (in_use > o.peak) {
        o.peak = in_use;
        o.peak_ns = e.time_ns;
        o.tags = cur;
      }
    if (i == peak_index) {
      p.peak_time_s = secs(e.time_ns);
      p.tag_at_peak = cur;
      p.reserved_at_peak = reserved;
      std::string ph;
      for (const Occurrence& o : stack) ph += (ph.empty() ? "" : " > ") + o.name;
      p.peak_phase = ph.empty() ? "(none)" : ph;
    }
    if (pick[i]) record_point(e.time_ns);
  }
  p.tag_current = cur;

  // Phases: forward, backward, optimizer first.
  for (const char* top : {"forward", "backward", "optimizer"})
    if (agg.count(top)) p.phases.push_back(agg[top]);
  for (const std::string& name : order)
    if (!is_top_phase(name) && name.rfind("region:", 0) != 0) p.phases.push_back(agg[name]);
  for (const std::string& r : region_order) p.regions.push_back(regions[r]);

  // Live at the peak: largest blocks, and bytes by label (blocks from before profiling as one row per tag).
  std::vector<LiveAllocation> blocks;
  blocks.reserve(live.size());
  std::map<std::string, int64_t> by_label;
  for (auto& [addr, a] : live) {
    blocks.push_back(a);
    by_label[label_group(a.tag, a.label)] += a.bytes;
  }
  for (int t = 0; t < kNumMemoryTags; ++t)
    if (t != static_cast<int>(MemoryTag::External) && start.tags[t].current > 0)
      by_label["(before profiling: " + std::string(tag_name(static_cast<MemoryTag>(t))) + ")"] += start.tags[t].current;
  std::sort(blocks.begin(), blocks.end(), [](const LiveAllocation& a, const LiveAllocation& b) { return a.bytes > b.bytes; });
  if (blocks.size() > options.top_k) blocks.resize(options.top_k);
  p.top_allocations = std::move(blocks);
  p.labels_at_peak.assign(by_label.begin(), by_label.end());
  std::sort(p.labels_at_peak.begin(), p.labels_at_peak.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  if (p.labels_at_peak.size() > 40) p.labels_at_peak.resize(40);
  if (options.viz) p.viz = build_memory_viz_trace(events, start, end, options.budget);
  return p;
}

json profile_to_json(const MemoryProfile& p) {
  auto tag_object = [](const std::array<int64_t, kNumMemoryTags>& v) {
    json o = json::object();
    for (int t = 0; t < kNumMemoryTags; ++t) o[std::string(tag_name(static_cast<MemoryTag>(t)))] = v[t];
    return o;
  };
  json j;
  j["schema"] = "kestrel.memory/1";
  j["device"] = p.device;
  j["budget"] = p.budget;
  j["meta"] = p.meta.is_object() ? p.meta : json::object();
  j["summary"] = {{"peak_in_use", p.peak_in_use},       {"peak_time_s", p.peak_time_s},
                  {"peak_phase", p.peak_phase},         {"peak_reserved", p.peak_reserved},
                  {"peak_footprint", p.peak_footprint}, {"reserved_at_peak", p.reserved_at_peak},
                  {"external", p.external},             {"num_events", p.num_events},
                  {"events_truncated", p.events_truncated}};
  json tags = json::array();
  for (int t = 0; t < kNumMemoryTags; ++t)
    tags.push_back({{"tag", std::string(tag_name(static_cast<MemoryTag>(t)))},
                    {"peak", p.tag_peak[t]},
                    {"at_peak", p.tag_at_peak[t]},
                    {"current", p.tag_current[t]}});
  j["tags"] = tags;
  json phases = json::array();
  for (const PhasePeak& ph : p.phases)
    phases.push_back({{"name", ph.name},
                      {"count", ph.count},
                      {"peak_in_use", ph.peak_in_use},
                      {"start_in_use", ph.start_in_use},
                      {"peak_time_s", ph.peak_time_s},
                      {"tags_at_peak", tag_object(ph.tags_at_peak)}});
  j["phases"] = phases;
  json regions = json::array();
  for (const RegionPeak& r : p.regions)
    regions.push_back({{"name", r.name},
                       {"forward_peak", r.forward_peak},
                       {"forward_delta", r.forward_delta},
                       {"backward_peak", r.backward_peak},
                       {"backward_delta", r.backward_delta}});
  j["regions"] = regions;
  json top = json::array();
  for (const LiveAllocation& a : p.top_allocations)
    top.push_back({{"bytes", a.bytes}, {"tag", std::string(tag_name(a.tag))}, {"label", a.label}, {"time_s", a.time_s}});
  j["top_allocations"] = top;
  json labels = json::array();
  for (const auto& [l, b] : p.labels_at_peak) labels.push_back({{"label", l}, {"bytes", b}});
  j["labels_at_peak"] = labels;
  json tl;
  json names = json::array(), by_tag = json::array();
  for (int t = 0; t < kNumMemoryTags; ++t) {
    names.push_back(std::string(tag_name(static_cast<MemoryTag>(t))));
    by_tag.push_back(p.by_tag[t]);
  }
  tl["tags"] = names;
  tl["t"] = p.t;
  tl["in_use"] = p.in_use;
  tl["reserved"] = p.reserved;
  tl["by_tag"] = by_tag;
  j["timeline"] = tl;
  json spans = json::array();
  for (const PhaseSpan& s : p.spans) spans.push_back({{"name", s.name}, {"t0", s.t0}, {"t1", s.t1}});
  j["spans"] = spans;
  j["plan"] = p.plan;
  return j;
}

std::string write_memory_report(const std::string& dir, Device device, const std::string& out_of_budget,
                                const MemorySnapshot& log_start, const nlohmann::json& extra,
                                const nlohmann::json& meta) {
  MemorySnapshot s = memory_trace(device).snapshot();
  nlohmann::json tags = nlohmann::json::object();
  for (int t = 0; t < kNumMemoryTags; ++t)
    tags[std::string(tag_name(static_cast<MemoryTag>(t)))] = {{"current", s.tags[t].current}, {"peak", s.tags[t].peak}};
  nlohmann::json report{{"device", device.str()},       {"peak_in_use", s.peak_in_use},
                        {"peak_reserved", s.peak_reserved}, {"peak_footprint", s.peak_footprint},
                        {"external", s.external},         {"tags", tags},
                        {"num_allocs", s.num_allocs},     {"num_ooms", s.num_ooms},
                        {"memory_budget", memory_budget(device)}};
  report.update(extra);
  if (!out_of_budget.empty()) report["out_of_budget"] = out_of_budget;
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/memory_report.json";
  {
    std::ofstream f(path);
    KESTREL_CHECK(f.good(), "memory-profile", "cannot write ", path);
    f << report.dump(2) << "\n";
  }
  if (!out_of_budget.empty()) {
    ProfileOptions po;
    po.budget = memory_budget(device);
    MemoryProfile p = analyze_memory(memory_trace(device).events(), log_start, s, po);
    p.meta = meta;
    p.meta["out_of_budget"] = out_of_budget;
    write_memory_profile(p, dir);
  }
  return path;
}

void run_with_memory_report(const std::function<void()>& fn, const std::string& dir, Device device,
                            const MemorySnapshot& log_start, const std::function<nlohmann::json()>& extra,
                            const nlohmann::json& meta) {
  try {
    fn();
  } catch (const OutOfBudget& e) {
    write_memory_report(dir, device, e.what(), log_start, extra ? extra() : nlohmann::json::object(), meta);
    throw;
  }
}

std::string write_memory_profile(const MemoryProfile& p, const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string jpath = dir + "/memory.json", hpath = dir + "/memory.html";
  {
    std::ofstream f(jpath);
    KESTREL_CHECK(f.good(), "memory-profile", "cannot write ", jpath);
    f << profile_to_json(p).dump(1) << "\n";
  }
  std::ofstream h(hpath);
  KESTREL_CHECK(h.good(), "memory-profile", "cannot write ", hpath);
  h << profile_to_html(p);
  if (!p.viz.empty()) write_memory_viz(p.viz, dir);
  return jpath;
}

std::string profile_summary(const MemoryProfile& p) {
  std::ostringstream os;
  char buf[256];
  std::snprintf(buf, sizeof buf, "peak in use %s at %.3f s in %s; reserved at peak %s, peak footprint %s, external %s%s\n",
                format_bytes(p.peak_in_use).c_str(), p.peak_time_s, p.peak_phase.c_str(),
                format_bytes(p.reserved_at_peak).c_str(), format_bytes(p.peak_footprint).c_str(),
                format_bytes(p.external).c_str(),
                p.budget > 0 ? (", budget " + format_bytes(p.budget)).c_str() : "");
  os << buf;
  std::snprintf(buf, sizeof buf, "%-16s %14s %14s %14s\n", "tag", "peak", "at peak", "end");
  os << buf;
  for (int t = 0; t < kNumMemoryTags; ++t) {
    if (p.tag_peak[t] == 0 && p.tag_current[t] == 0) continue;
    std::snprintf(buf, sizeof buf, "%-16s %14s %14s %14s\n", std::string(tag_name(static_cast<MemoryTag>(t))).c_str(),
                  format_bytes(p.tag_peak[t]).c_str(), format_bytes(p.tag_at_peak[t]).c_str(),
                  format_bytes(p.tag_current[t]).c_str());
    os << buf;
  }
  std::snprintf(buf, sizeof buf, "%-16s %14s %14s %6s\n", "phase", "peak", "at entry", "count");
  os << buf;
  for (const PhasePeak& ph : p.phases) {
    std::snprintf(buf, sizeof buf, "%-16s %14s %14s %6lld\n", ph.name.c_str(), format_bytes(ph.peak_in_use).c_str(),
                  format_bytes(ph.start_in_use).c_str(), static_cast<long long>(ph.count));
    os << buf;
  }
  os << "largest live allocations at the peak:\n";
  for (size_t i = 0; i < p.top_allocations.size() && i < 8; ++i) {
    const LiveAllocation& a = p.top_allocations[i];
    std::snprintf(buf, sizeof buf, "  %12s  %-16s %s\n", format_bytes(a.bytes).c_str(),
                  std::string(tag_name(a.tag)).c_str(), a.label.c_str());
    os << buf;
  }
  return os.str();
}

}  // namespace kestrel::train
