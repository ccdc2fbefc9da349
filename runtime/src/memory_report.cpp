// memory_report / memory_report_json (memory_report.h): formatting over a MemorySnapshot.
#include "kestrel/runtime/memory_report.h"

#include <cstdio>
#include <nlohmann/json.hpp>

#include "kestrel/runtime/memory_budget.h"

namespace kestrel {

MemorySnapshot memory_stats(Device device) { return memory_trace(device).snapshot(); }

std::string memory_report(const MemorySnapshot& s, int64_t budget) {
  std::string out = "memory on " + s.device.str() + "\n";
  char line[160];
  std::snprintf(line, sizeof line, "  %-16s %14s %14s %8s\n", "tag", "current", "peak", "blocks");
  out += line;
  for (int t = 0; t < kNumMemoryTags; ++t) {
    const TagStats& ts = s.tags[t];
    if (ts.peak == 0 && ts.current == 0) continue;
    std::snprintf(line, sizeof line, "  %-16s %14s %14s %8lld\n", std::string(tag_name(static_cast<MemoryTag>(t))).c_str(),
                  format_bytes(ts.current).c_str(), format_bytes(ts.peak).c_str(), static_cast<long long>(ts.count));
    out += line;
  }
  out += "  in use " + format_bytes(s.in_use) + " (peak " + format_bytes(s.peak_in_use) + "), reserved " +
         format_bytes(s.reserved) + " (peak " + format_bytes(s.peak_reserved) + "), external " +
         format_bytes(s.external) + ", footprint peak " + format_bytes(s.peak_footprint) + "\n";
  out += "  budget " + (budget > 0 ? format_bytes(budget) : std::string("none")) + ", allocs " +
         std::to_string(s.num_allocs) + ", frees " + std::to_string(s.num_frees) + ", retries " +
         std::to_string(s.num_retries) + ", out-of-budget " + std::to_string(s.num_ooms) + "\n";
  return out;
}

std::string memory_report(Device device) { return memory_report(memory_stats(device), memory_budget(device)); }

std::string memory_report_json(Device device) {
  MemorySnapshot s = memory_stats(device);
  nlohmann::json tags = nlohmann::json::object();
  for (int t = 0; t < kNumMemoryTags; ++t)
    tags[std::string(tag_name(static_cast<MemoryTag>(t)))] = {
        {"current", s.tags[t].current}, {"peak", s.tags[t].peak}, {"count", s.tags[t].count}};
  nlohmann::json j{{"device", device.str()},      {"budget", memory_budget(device)},
                   {"in_use", s.in_use},          {"peak_in_use", s.peak_in_use},
                   {"reserved", s.reserved},      {"peak_reserved", s.peak_reserved},
                   {"external", s.external},      {"footprint", s.footprint()},
                   {"peak_footprint", s.peak_footprint}, {"num_allocs", s.num_allocs},
                   {"num_frees", s.num_frees},    {"num_retries", s.num_retries},
                   {"num_ooms", s.num_ooms},      {"tags", tags}};
  return j.dump(2);
}

}  // namespace kestrel
