// Memory profiles: from a MemoryTrace event log (alloc/free/reserve events with labels, phase
// markers) compute where device memory went, and write it as memory.json and memory.html.
//
// What a profile holds: the per-tag timeline (downsampled for the chart, but every peak kept), the
// peak per phase (forward / backward / optimizer, the maximum over all micro-batches and steps)
// and per recompute region (its forward and its backward), the largest live allocations at the
// global peak with the label of the module that made them, bytes by label at the peak, reserved
// vs in use, and External (charged outside the allocator, from the trace's snapshot).
//
// memory.json schema ("kestrel.memory/1"); every field is always present:
//   schema            string   "kestrel.memory/1"
//   device            string   "cpu", "cuda:0"
//   budget            int      bytes, 0 = none
//   meta              object   free-form (config path, steps, precision, recompute, ...)
//   summary           object   peak_in_use int, peak_time_s number, peak_phase string,
//                              peak_reserved int, peak_footprint int, reserved_at_peak int,
//                              external int, num_events int, events_truncated bool
//   tags              array    {tag string, peak int, at_peak int, current int} for all 9 tags
//   phases            array    {name string, count int, peak_in_use int, start_in_use int,
//                              peak_time_s number, tags_at_peak object tag->int}
//   regions           array    {name string, forward_peak int, forward_delta int,
//                              backward_peak int, backward_delta int} (delta = peak - in use at entry)
//   top_allocations   array    {bytes int, tag string, label string, time_s number} live at the peak
//   labels_at_peak    array    {label string, bytes int} live bytes by label at the peak
//   timeline          object   tags [string], t [number] (s), in_use [int], reserved [int],
//                              by_tag [[int]] (one array per tag, aligned with t)
//   spans             array    {name string, t0 number, t1 number}: forward/backward/optimizer
//   plan              object or null: {peak int, tags object tag->int, fits bool} when a plan was given
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <functional>
#include <string>
#include <vector>

#include "kestrel/runtime/memory_trace.h"
#include "kestrel/train/memory_viz_export.h"

namespace kestrel::train {

struct PhasePeak {
  std::string name;
  int64_t count = 0;          // occurrences
  int64_t peak_in_use = 0;    // max over occurrences
  int64_t start_in_use = 0;   // in use when the peaking occurrence began
  double peak_time_s = 0;
  std::array<int64_t, kNumMemoryTags> tags_at_peak{};
};

struct RegionPeak {
  std::string name;
  int64_t forward_peak = 0, forward_delta = 0;
  int64_t backward_peak = 0, backward_delta = 0;
};

struct LiveAllocation {
  int64_t bytes = 0;
  MemoryTag tag{};
  std::string label;
  double time_s = 0;
};

struct PhaseSpan {
  std::string name;
  double t0 = 0, t1 = 0;
};

struct MemoryProfile {
  std::string device;
  int64_t budget = 0;
  nlohmann::json meta = nlohmann::json::object();
  int64_t peak_in_use = 0;
  double peak_time_s = 0;
  std::string peak_phase;
  int64_t peak_reserved = 0, peak_footprint = 0, reserved_at_peak = 0, external = 0;
  int64_t num_events = 0;
  bool events_truncated = false;
  std::array<int64_t, kNumMemoryTags> tag_peak{}, tag_at_peak{}, tag_current{};
  std::vector<PhasePeak> phases;  // forward, backward, optimizer first, then the others seen
  std::vector<RegionPeak> regions;
  std::vector<LiveAllocation> top_allocations;
  std::vector<std::pair<std::string, int64_t>> labels_at_peak;
  // Timeline (downsampled): times, in use, reserved and bytes per tag at each point.
  std::vector<double> t;
  std::vector<int64_t> in_use, reserved;
  std::array<std::vector<int64_t>, kNumMemoryTags> by_tag;
  std::vector<PhaseSpan> spans;
  nlohmann::json plan;  // null unless attached
  MemoryVizTrace viz;   // the log as a PyTorch memory snapshot (memory_snapshot.pickle); empty unless kept
};

struct ProfileOptions {
  int64_t budget = 0;
  size_t top_k = 25;
  size_t max_points = 2400;  // timeline points kept for the chart
  size_t max_events = 1u << 22;  // the trace's cap, to flag a truncated log
  bool viz = true;   // keep the log as a PyTorch memory snapshot (MemoryProfile::viz)
};

// `start` is the trace snapshot taken when event logging was switched on (what was already live:
// its tag currents seed the timeline), `end` the snapshot at the end (External, peaks reserved).
MemoryProfile analyze_memory(const std::vector<MemoryEvent>& events, const MemorySnapshot& start,
                             const MemorySnapshot& end, const ProfileOptions& options = {});

nlohmann::json profile_to_json(const MemoryProfile& p);
// One self-contained HTML page (inline SVG chart and tables, no scripts from the network).
std::string profile_to_html(const MemoryProfile& p);
// Writes DIR/memory.json, DIR/memory.html and, when the profile kept it, DIR/memory_snapshot.pickle
// (PyTorch's snapshot format: memory_viz_export.h) (creating DIR); returns the json path.
std::string write_memory_profile(const MemoryProfile& p, const std::string& dir);

// Writes DIR/memory_report.json (creating DIR): the device's per-tag current and peak bytes, peaks
// in use / reserved / footprint, External, the budget, `extra` fields and, after an OutOfBudget,
// its report text. With an OutOfBudget it also writes the profile of the events logged since
// `log_start` (write_memory_profile, `meta` as the profile's meta). Returns the report's path.
std::string write_memory_report(const std::string& dir, Device device, const std::string& out_of_budget,
                                const MemorySnapshot& log_start, const nlohmann::json& extra = nlohmann::json::object(),
                                const nlohmann::json& meta = nlohmann::json::object());

// Runs `fn`; when it throws OutOfBudget, first writes the report of `device` into `dir`
// (write_memory_report with the exception's text, `extra()` fields and `meta`: memory_report.json and
// the profile of the events logged since `log_start`), then rethrows it for the caller to log or
// turn into an exit code. The one place an OutOfBudget becomes files: the trainer's steps and
// kestrel-train's set-up (building the model, resuming) run through it.
void run_with_memory_report(const std::function<void()>& fn, const std::string& dir, Device device,
                            const MemorySnapshot& log_start,
                            const std::function<nlohmann::json()>& extra = nullptr,
                            const nlohmann::json& meta = nlohmann::json::object());

// A plain-text summary table (per tag peak and at-peak, phases, top allocations).
std::string profile_summary(const MemoryProfile& p);

}  // namespace kestrel::train
